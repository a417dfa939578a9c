//! `Stats`: what the sandbox's agent measures from inside: its root file system, its network
//! interfaces and (meaningful in a VM guest) its kernel's CPU time and memory.

use dsec_wire::api::AgentStats;

/// Received and sent bytes summed over the interfaces of `/proc/net/dev`, loopback excluded.
pub fn parse_net_dev(text: &str) -> (u64, u64) {
    let mut rx = 0u64;
    let mut tx = 0u64;
    for line in text.lines().skip(2) {
        let Some((name, rest)) = line.split_once(':') else {
            continue;
        };
        if name.trim() == "lo" {
            continue;
        }
        let f: Vec<u64> = rest
            .split_whitespace()
            .map(|v| v.parse().unwrap_or(0))
            .collect();
        if f.len() >= 9 {
            rx = rx.saturating_add(f[0]);
            tx = tx.saturating_add(f[8]);
        }
    }
    (rx, tx)
}

/// CPU seconds of the `cpu` line of `/proc/stat` (everything but idle and iowait).
pub fn parse_proc_stat_cpu(text: &str, ticks_per_s: f64) -> f64 {
    let Some(line) = text.lines().find(|l| l.starts_with("cpu ")) else {
        return 0.0;
    };
    let f: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .map(|v| v.parse().unwrap_or(0))
        .collect();
    // user nice system idle iowait irq softirq steal
    let busy: u64 = f
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != 3 && *i != 4 && *i < 8)
        .map(|(_, v)| *v)
        .sum();
    busy as f64 / ticks_per_s.max(1.0)
}

/// `MemTotal - MemAvailable` of `/proc/meminfo`, in bytes.
pub fn parse_meminfo_used(text: &str) -> u64 {
    let field = |name: &str| {
        text.lines()
            .find(|l| l.starts_with(name))
            .and_then(|l| l.split_whitespace().nth(1))
            .and_then(|v| v.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field("MemTotal:").saturating_sub(field("MemAvailable:")) * 1024
}

fn statvfs_root() -> (u64, u64) {
    // SAFETY: statvfs writes into a zeroed struct we own; the path is a static C string.
    unsafe {
        let mut st: libc::statvfs = std::mem::zeroed();
        if libc::statvfs(c"/".as_ptr(), &mut st) != 0 {
            return (0, 0);
        }
        let frsize = st.f_frsize as u64;
        let total = st.f_blocks as u64 * frsize;
        let free = st.f_bfree as u64 * frsize;
        (total.saturating_sub(free), total)
    }
}

pub fn collect() -> AgentStats {
    let (disk_used_bytes, disk_total_bytes) = statvfs_root();
    let (net_rx_bytes, net_tx_bytes) = std::fs::read_to_string("/proc/net/dev")
        .map(|t| parse_net_dev(&t))
        .unwrap_or((0, 0));
    // SAFETY: sysconf takes an int name and no pointers.
    let ticks = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    let kernel_cpu_time_s = std::fs::read_to_string("/proc/stat")
        .map(|t| parse_proc_stat_cpu(&t, ticks))
        .unwrap_or(0.0);
    let kernel_memory_used_bytes = std::fs::read_to_string("/proc/meminfo")
        .map(|t| parse_meminfo_used(&t))
        .unwrap_or(0);
    AgentStats {
        disk_used_bytes,
        disk_total_bytes,
        net_rx_bytes,
        net_tx_bytes,
        kernel_cpu_time_s,
        kernel_memory_used_bytes,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn net_dev_skips_loopback() {
        let t = "Inter-|   Receive                                                |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
lo: 1000 10 0 0 0 0 0 0 1000 10 0 0 0 0 0 0\n  \
eth0: 5000 40 0 0 0 0 0 0 7000 50 0 0 0 0 0 0\n";
        assert_eq!(parse_net_dev(t), (5000, 7000));
    }

    #[test]
    fn proc_stat_and_meminfo() {
        let s = "cpu  100 0 50 1000 20 5 5 0 0 0\ncpu0 1 2 3\n";
        assert!((parse_proc_stat_cpu(s, 100.0) - 1.6).abs() < 1e-9);
        let m = "MemTotal:       1000 kB\nMemFree:         100 kB\nMemAvailable:    400 kB\n";
        assert_eq!(parse_meminfo_used(m), 600 * 1024);
    }
}
