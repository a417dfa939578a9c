//! Node memory pressure: when is the node short, and what to do about it.
//!
//! Signals (either one means pressure):
//! - the sandboxes' working set (parent cgroup usage less inactive page cache) at or above
//!   `pressure_high_ratio` × the node memory budget (the parent's memory limit);
//! - PSI `some avg10` at or above `pressure_psi_some_avg10` (v2: the parent's
//!   `memory.pressure`; v1: `/proc/pressure/memory`, the whole host). 0 disables PSI.
//!
//! Escalation within one pressure episode ([`Episode`]): the first tick reclaims every
//! best-effort sandbox (paused ones first); each later tick still under pressure reclaims again
//! and pauses the largest running best-effort sandbox; with `stop_on_pressure`, from the
//! [`STOP_AFTER_TICKS`]th tick on, when no running best-effort sandbox is left to pause, it ends
//! the largest paused one (end reason `memory_pressure`) and starts a new episode.
//! Latency-sensitive sandboxes are never touched. The episode ends at the first tick without
//! pressure.

/// Parsed PSI line pair (`some` / `full` avg10).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Psi {
    pub some_avg10: f64,
    pub full_avg10: f64,
}

/// Parses `/proc/pressure/memory` or a v2 `memory.pressure`.
pub fn parse_psi(text: &str) -> Option<Psi> {
    let avg10 = |kind: &str| {
        text.lines().find_map(|l| {
            let mut it = l.split_whitespace();
            if it.next() != Some(kind) {
                return None;
            }
            it.find_map(|kv| kv.strip_prefix("avg10=")?.parse::<f64>().ok())
        })
    };
    Some(Psi {
        some_avg10: avg10("some")?,
        full_avg10: avg10("full").unwrap_or(0.0),
    })
}

/// The host-wide PSI (v1 hosts have no per-cgroup PSI).
pub fn host_psi() -> Option<Psi> {
    parse_psi(&std::fs::read_to_string("/proc/pressure/memory").ok()?)
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PressureInput {
    pub working_set: u64,
    /// The node memory budget in bytes, if one is enforced.
    pub budget: Option<u64>,
    pub psi_some_avg10: Option<f64>,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Thresholds {
    pub high_ratio: f64,
    /// 0: PSI is ignored.
    pub psi_some_avg10: f64,
}

/// Why the node is under pressure, or None.
pub fn pressure_reason(i: &PressureInput, t: &Thresholds) -> Option<String> {
    if let Some(b) = i.budget.filter(|b| *b > 0 && *b < u64::MAX / 2) {
        let high = (b as f64 * t.high_ratio) as u64;
        if i.working_set >= high {
            return Some(format!(
                "node memory pressure: sandboxes' working set {} MiB >= {:.0}% of the node memory budget {} MiB",
                i.working_set >> 20,
                t.high_ratio * 100.0,
                b >> 20
            ));
        }
    }
    if t.psi_some_avg10 > 0.0 {
        if let Some(p) = i.psi_some_avg10 {
            if p >= t.psi_some_avg10 {
                return Some(format!(
                    "node memory pressure: PSI some avg10 {p:.1}% >= {:.1}%",
                    t.psi_some_avg10
                ));
            }
        }
    }
    None
}

/// What the policy does on one tick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Reclaim every best-effort sandbox (paused first).
    Reclaim,
    /// Reclaim again and pause the largest running best-effort sandbox.
    ReclaimAndPause,
}

/// Ticks of one episode before a paused sandbox may be ended (`stop_on_pressure`): the
/// pauses and reclaim of the ticks before have had their chance.
pub const STOP_AFTER_TICKS: u32 = 4;

/// One pressure episode's progress.
#[derive(Debug, Default, Clone)]
pub struct Episode {
    ticks: u32,
}

impl Episode {
    /// Advances by one tick; `pressure` is whether the node is short right now.
    pub fn tick(&mut self, pressure: bool) -> Option<Step> {
        if !pressure {
            self.ticks = 0;
            return None;
        }
        self.ticks += 1;
        Some(if self.ticks == 1 {
            Step::Reclaim
        } else {
            Step::ReclaimAndPause
        })
    }

    /// Ticks under pressure so far in this episode.
    pub fn ticks(&self) -> u32 {
        self.ticks
    }

    pub fn active(&self) -> bool {
        self.ticks > 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn psi_parsing() {
        let t = "some avg10=1.50 avg60=0.20 avg300=0.00 total=6135933\nfull avg10=0.75 avg60=0.00 avg300=0.00 total=5220187\n";
        assert_eq!(
            parse_psi(t),
            Some(Psi {
                some_avg10: 1.5,
                full_avg10: 0.75
            })
        );
        assert_eq!(parse_psi("garbage"), None);
    }

    #[test]
    fn budget_and_psi_thresholds() {
        let t = Thresholds {
            high_ratio: 0.9,
            psi_some_avg10: 0.0,
        };
        let mut i = PressureInput {
            working_set: 899 << 20,
            budget: Some(1000 << 20),
            psi_some_avg10: Some(99.0),
        };
        assert_eq!(pressure_reason(&i, &t), None, "PSI disabled, under 90%");
        i.working_set = 900 << 20;
        assert!(pressure_reason(&i, &t).unwrap().contains("budget 1000 MiB"));
        // Unlimited parent: no budget signal.
        i.budget = Some(u64::MAX);
        assert_eq!(pressure_reason(&i, &t), None);
        let t = Thresholds {
            psi_some_avg10: 10.0,
            ..t
        };
        assert!(pressure_reason(&i, &t).unwrap().contains("PSI"));
        i.psi_some_avg10 = Some(9.9);
        assert_eq!(pressure_reason(&i, &t), None);
    }

    #[test]
    fn escalation() {
        let mut e = Episode::default();
        assert_eq!(e.tick(false), None);
        assert_eq!(e.tick(true), Some(Step::Reclaim));
        assert_eq!(e.tick(true), Some(Step::ReclaimAndPause));
        assert_eq!(e.tick(true), Some(Step::ReclaimAndPause));
        assert_eq!(e.ticks(), 3);
        assert!(
            e.ticks() < STOP_AFTER_TICKS,
            "a stop waits past the first pause"
        );
        assert!(e.active());
        assert_eq!(e.tick(false), None);
        assert!(!e.active());
        assert_eq!(e.tick(true), Some(Step::Reclaim));
    }
}
