//! Finding and killing processes by scanning /proc.

use std::collections::{HashMap, HashSet};

use crate::sys;

/// The fields of /proc/<pid>/stat we need.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Proc {
    pub pid: i32,
    pub ppid: i32,
    pub pgrp: i32,
    pub sid: i32,
    /// Start time in clock ticks since boot: (pid, start) identifies a process across pid reuse.
    pub start: u64,
}

/// Parses the contents of /proc/<pid>/stat.
pub fn parse_stat(s: &str) -> Option<Proc> {
    let pid = s.split_whitespace().next()?.parse().ok()?;
    // The command name may contain spaces and parentheses: fields resume after the last ')'.
    let rest = &s[s.rfind(')')? + 1..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    // rest[0] is field 3 (state); ppid=4, pgrp=5, session=6, starttime=22.
    Some(Proc {
        pid,
        ppid: f.get(1)?.parse().ok()?,
        pgrp: f.get(2)?.parse().ok()?,
        sid: f.get(3)?.parse().ok()?,
        start: f.get(19)?.parse().ok()?,
    })
}

/// Every process visible in /proc.
pub fn scan() -> Vec<Proc> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut out = Vec::new();
    for ent in dir.flatten() {
        let name = ent.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.bytes().all(|b| b.is_ascii_digit()) {
            continue;
        }
        if let Ok(s) = std::fs::read_to_string(format!("/proc/{name}/stat")) {
            if let Some(p) = parse_stat(&s) {
                out.push(p);
            }
        }
    }
    out
}

/// Pids of all descendants of `root` (not including `root`).
pub fn descendants(procs: &[Proc], root: i32) -> HashSet<i32> {
    let mut children: HashMap<i32, Vec<i32>> = HashMap::new();
    for p in procs {
        children.entry(p.ppid).or_default().push(p.pid);
    }
    let mut out = HashSet::new();
    let mut stack = vec![root];
    while let Some(p) = stack.pop() {
        if let Some(cs) = children.get(&p) {
            for &c in cs {
                if c != root && out.insert(c) {
                    stack.push(c);
                }
            }
        }
    }
    out
}

/// The processes that belong to a shell/command started as session leader `leader`: same
/// session id, or descendants that moved to another session.
pub fn members(procs: &[Proc], leader: i32) -> Vec<Proc> {
    let desc = descendants(procs, leader);
    procs
        .iter()
        .filter(|p| p.pid != leader && (p.sid == leader || desc.contains(&p.pid)))
        .copied()
        .collect()
}

/// Kills `victims` (and their process groups, unless the group is `protect_pgrp`).
pub fn kill_procs(victims: &[Proc], protect_pgrp: i32) {
    let mut groups = HashSet::new();
    for p in victims {
        if p.pgrp > 1 && p.pgrp != protect_pgrp && groups.insert(p.pgrp) {
            sys::kill(-p.pgrp, libc::SIGKILL);
        }
        if p.pid > 1 {
            sys::kill(p.pid, libc::SIGKILL);
        }
    }
}

/// Kills everything a session leader started, and the leader; repeats a few times to catch
/// processes forked while we were scanning.
pub fn kill_session(leader: i32) {
    if leader <= 1 {
        return;
    }
    for _ in 0..3 {
        sys::kill(-leader, libc::SIGKILL);
        sys::kill(leader, libc::SIGKILL);
        let procs = scan();
        let m = members(&procs, leader);
        if m.is_empty() {
            break;
        }
        kill_procs(&m, 0);
    }
}

/// Kills every process that is a member of `leader`'s session and not in `keep` (identified by
/// (pid, start)), never the leader itself. Returns how many were killed.
pub fn kill_new_members(leader: i32, keep: &HashSet<(i32, u64)>) -> usize {
    // A fork bomb keeps making new members while we scan, so: stop every victim (a stopped
    // process cannot fork), kill them, and rescan until a scan finds none — bounded in time.
    let give_up = std::time::Instant::now() + std::time::Duration::from_secs(3);
    let mut total = 0;
    let mut clean_scans = 0;
    while clean_scans < 2 && std::time::Instant::now() < give_up {
        let procs = scan();
        let victims: Vec<Proc> = members(&procs, leader)
            .into_iter()
            .filter(|p| !keep.contains(&(p.pid, p.start)))
            .collect();
        if victims.is_empty() {
            clean_scans += 1;
            continue;
        }
        clean_scans = 0;
        // Groups that hold surviving older processes are not killed wholesale.
        let mut protected: HashSet<i32> = procs
            .iter()
            .filter(|p| keep.contains(&(p.pid, p.start)))
            .map(|p| p.pgrp)
            .collect();
        protected.insert(leader);
        for sig in [libc::SIGSTOP, libc::SIGKILL] {
            for p in &victims {
                if !protected.contains(&p.pgrp) && p.pgrp > 1 {
                    sys::kill(-p.pgrp, sig);
                }
                if p.pid > 1 {
                    sys::kill(p.pid, sig);
                }
            }
        }
        total += victims.len();
    }
    total
}

/// Snapshot of a session's current members.
pub fn snapshot(leader: i32) -> HashSet<(i32, u64)> {
    members(&scan(), leader)
        .into_iter()
        .map(|p| (p.pid, p.start))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stat_with_odd_names() {
        let s = "1234 (a b) c)) S 1 1234 1234 34816 1234 4194560 100 0 0 0 0 0 0 0 20 0 1 0 98765 1000 10 18446744073709551615";
        let p = parse_stat(s).unwrap();
        assert_eq!(
            p,
            Proc {
                pid: 1234,
                ppid: 1,
                pgrp: 1234,
                sid: 1234,
                start: 98765
            }
        );
        assert!(parse_stat("garbage").is_none());
    }

    #[test]
    fn tree() {
        let p = |pid, ppid, sid| Proc {
            pid,
            ppid,
            pgrp: pid,
            sid,
            start: 0,
        };
        let procs = vec![
            p(10, 1, 10),
            p(11, 10, 10),
            p(12, 11, 12),
            p(13, 1, 10),
            p(20, 1, 20),
        ];
        let d = descendants(&procs, 10);
        assert_eq!(d, [11, 12].into_iter().collect());
        let mut m: Vec<i32> = members(&procs, 10).iter().map(|p| p.pid).collect();
        m.sort();
        assert_eq!(m, vec![11, 12, 13]);
    }
}
