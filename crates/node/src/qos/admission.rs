//! Overcommit admission by measured usage (pure arithmetic; see [`check`]).
//!
//! Per resource (memory in MiB, CPU in cores), with `P` the node's physical capacity:
//!
//! 1. **Overcommit ratio** (both classes): the requests of every sandbox (running and starting)
//!    plus the new one stay within `P × overcommit` (`memory_overcommit`, `cpu_overcommit`).
//! 2. **Latency-sensitive floor** (LS only): the requests of LS sandboxes plus the new one stay
//!    within `P × ls_ratio` (`qos.ls_memory_ratio`, default 4 like `memory_overcommit`; 1.0
//!    never overcommits LS memory; `qos.ls_cpu_ratio`). LS admission ignores best-effort usage: under
//!    pressure best-effort sandboxes are reclaimed and paused, LS ones are protected.
//! 3. **Real usage** (best-effort only): memory — the LS requests (their guaranteed floor), the
//!    measured working set of running BE sandboxes, the reservations of starting sandboxes and
//!    the new one's reservation stay within `P × qos.memory_usage_limit`; CPU — the measured CPU
//!    use of every sandbox plus reservations stays within `P × qos.cpu_usage_limit`. A starting
//!    sandbox reserves `min(request, qos.start_reservation_*)` until it is measured.

use dsec_wire::api::{AdmissionStatus, QosClass};

/// A pair of memory (MiB) and CPU (cores) figures.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Amount {
    pub memory_mb: f64,
    pub cpu: f64,
}

impl Amount {
    pub fn new(memory_mb: f64, cpu: f64) -> Self {
        Amount { memory_mb, cpu }
    }
}

impl std::ops::Add for Amount {
    type Output = Amount;
    fn add(self, o: Amount) -> Amount {
        Amount::new(self.memory_mb + o.memory_mb, self.cpu + o.cpu)
    }
}

impl std::ops::AddAssign for Amount {
    fn add_assign(&mut self, o: Amount) {
        *self = *self + o;
    }
}

/// The node's capacity and the configured ratios.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Policy {
    /// Physical capacity.
    pub physical: Amount,
    pub memory_overcommit: f64,
    pub cpu_overcommit: f64,
    pub ls_memory_ratio: f64,
    pub ls_cpu_ratio: f64,
    pub memory_usage_limit: f64,
    pub cpu_usage_limit: f64,
    /// What a starting sandbox reserves (capped by its request).
    pub start_reservation: Amount,
}

/// What the node holds right now.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Snapshot {
    /// Requests of LS sandboxes (running and starting).
    pub committed_ls: Amount,
    /// Requests of BE sandboxes (running and starting).
    pub committed_be: Amount,
    /// Measured working set of running BE sandboxes (memory) and measured CPU use of every
    /// running sandbox (cpu).
    pub used: Amount,
    /// Reservations of starting sandboxes.
    pub reserved: Amount,
}

/// Why a request was refused: which resource, which rule, the figures, and what to change.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("{resource}: {rule}: {detail}; {advice}")]
pub struct Refusal {
    pub resource: &'static str,
    pub rule: &'static str,
    pub detail: String,
    /// What the caller can change (ask for less, another class, wait).
    pub advice: String,
    /// Only starting (or not yet measured) sandboxes stand in the way: the request fits once
    /// they settle, so the edge waits instead of refusing ([`Snapshot::settled`]).
    pub transient: bool,
}

impl Snapshot {
    /// The snapshot once every starting sandbox is running and measured idle: no start
    /// reservations. (Optimistic: a refusal that still holds then is a real lack of room.)
    pub fn settled(&self, unmeasured: Amount) -> Snapshot {
        Snapshot {
            used: Amount::new(
                (self.used.memory_mb - unmeasured.memory_mb).max(0.0),
                (self.used.cpu - unmeasured.cpu).max(0.0),
            ),
            reserved: Amount::default(),
            ..*self
        }
    }
}

/// What the caller can change when `rule` refuses `resource` (`left`: what still fits).
fn advice(rule: &str, resource: &str, left: f64) -> String {
    let overcommit = rule.starts_with("overcommit");
    let floor = rule.starts_with("latency");
    match (resource, overcommit, floor) {
        ("cpu", true, _) => format!(
            "ask for fewer cores: cpu_cores_limit={:.2} or less fits (an idle sandbox needs far less than the default 1 core), or raise the node's cpu_overcommit",
            left.max(0.0)
        ),
        ("memory", true, _) => format!(
            "ask for less memory: memory_limit_mb={:.0} or less fits, or raise the node's memory_overcommit",
            left.max(0.0).floor()
        ),
        (_, _, true) => format!(
            "ask for qos=\"best_effort\" (admitted by measured use), or less ({resource}: {:.2} fits), or raise qos.ls_{resource}_ratio",
            left.max(0.0)
        ),
        ("cpu", _, _) => "best-effort sandboxes on this node are busy using its CPU: wait for capacity (wait_s) or use another node, or raise qos.cpu_usage_limit".into(),
        _ => "this node's memory is really in use: wait for capacity (wait_s), stop or pause sandboxes, or use another node".into(),
    }
}

fn reservation(p: &Policy, req: Amount) -> Amount {
    Amount::new(
        req.memory_mb.min(p.start_reservation.memory_mb),
        req.cpu.min(p.start_reservation.cpu),
    )
}

/// One headroom per rule for `class`: (resource, rule, headroom memory/cpu, whether the rule
/// is checked against the reservation instead of the request).
struct Headroom {
    rule: &'static str,
    room: Amount,
    against_reservation: bool,
}

fn headrooms(class: QosClass, p: &Policy, s: &Snapshot) -> Vec<Headroom> {
    let all = s.committed_ls + s.committed_be;
    let mut out = vec![Headroom {
        rule: "overcommit ratio (requests of all sandboxes)",
        room: Amount::new(
            p.physical.memory_mb * p.memory_overcommit - all.memory_mb,
            p.physical.cpu * p.cpu_overcommit - all.cpu,
        ),
        against_reservation: false,
    }];
    match class {
        QosClass::LatencySensitive => out.push(Headroom {
            rule: "latency-sensitive floor (requests of LS sandboxes)",
            room: Amount::new(
                p.physical.memory_mb * p.ls_memory_ratio - s.committed_ls.memory_mb,
                p.physical.cpu * p.ls_cpu_ratio - s.committed_ls.cpu,
            ),
            against_reservation: false,
        }),
        QosClass::BestEffort => out.push(Headroom {
            rule: "measured usage (LS floor + BE working sets + starting reservations)",
            room: Amount::new(
                p.physical.memory_mb * p.memory_usage_limit
                    - (s.committed_ls.memory_mb + s.used.memory_mb + s.reserved.memory_mb),
                p.physical.cpu * p.cpu_usage_limit - (s.used.cpu + s.reserved.cpu),
            ),
            against_reservation: true,
        }),
    }
    out
}

/// Admits `req` of `class` or says which rule refuses it.
pub fn check(class: QosClass, req: Amount, p: &Policy, s: &Snapshot) -> Result<(), Refusal> {
    const EPS: f64 = 1e-9;
    for h in headrooms(class, p, s) {
        let need = if h.against_reservation {
            reservation(p, req)
        } else {
            req
        };
        if need.memory_mb > h.room.memory_mb + EPS {
            return Err(Refusal {
                resource: "memory",
                rule: h.rule,
                detail: format!(
                    "{:.0} MiB needed, {:.0} MiB left",
                    need.memory_mb,
                    h.room.memory_mb.max(0.0)
                ),
                advice: advice(h.rule, "memory", h.room.memory_mb),
                transient: false,
            });
        }
        if need.cpu > h.room.cpu + EPS {
            return Err(Refusal {
                resource: "cpu",
                rule: h.rule,
                detail: format!(
                    "{:.2} cores needed, {:.2} cores left",
                    need.cpu,
                    h.room.cpu.max(0.0)
                ),
                advice: advice(h.rule, "cpu", h.room.cpu),
                transient: false,
            });
        }
    }
    Ok(())
}

/// The largest request of `class` [`check`] admits now (per resource, each on its own).
pub fn free(class: QosClass, p: &Policy, s: &Snapshot) -> Amount {
    let one = |room: f64, res_cap: f64, against_res: bool| -> f64 {
        if !against_res {
            room
        } else if room >= res_cap {
            // Any request reserves at most `res_cap`: this rule does not bound it.
            f64::INFINITY
        } else {
            room
        }
    };
    let mut out = Amount::new(f64::INFINITY, f64::INFINITY);
    for h in headrooms(class, p, s) {
        out.memory_mb = out.memory_mb.min(one(
            h.room.memory_mb,
            p.start_reservation.memory_mb,
            h.against_reservation,
        ));
        out.cpu = out.cpu.min(one(
            h.room.cpu,
            p.start_reservation.cpu,
            h.against_reservation,
        ));
    }
    Amount::new(out.memory_mb.max(0.0), out.cpu.max(0.0))
}

/// The figures the node status reports (and placement reads).
pub fn status(p: &Policy, s: &Snapshot) -> AdmissionStatus {
    let ls = free(QosClass::LatencySensitive, p, s);
    let be = free(QosClass::BestEffort, p, s);
    AdmissionStatus {
        memory_mb_used: (s.committed_ls.memory_mb + s.used.memory_mb + s.reserved.memory_mb).round()
            as u64,
        cpu_cores_used: s.used.cpu + s.reserved.cpu,
        memory_mb_committed_ls: s.committed_ls.memory_mb.round() as u64,
        cpu_cores_committed_ls: s.committed_ls.cpu,
        memory_mb_committed_be: s.committed_be.memory_mb.round() as u64,
        cpu_cores_committed_be: s.committed_be.cpu,
        memory_mb_free_ls: ls.memory_mb.floor() as u64,
        cpu_cores_free_ls: ls.cpu,
        memory_mb_free_be: be.memory_mb.floor() as u64,
        cpu_cores_free_be: be.cpu,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use QosClass::{BestEffort as BE, LatencySensitive as LS};

    /// 24 GiB, 2 cores, ratios 4 / 25, LS floor 1.0 / 8, usage limits 0.9 / 1.0.
    fn policy() -> Policy {
        Policy {
            physical: Amount::new(24576.0, 2.0),
            memory_overcommit: 4.0,
            cpu_overcommit: 25.0,
            ls_memory_ratio: 1.0,
            ls_cpu_ratio: 8.0,
            memory_usage_limit: 0.9,
            cpu_usage_limit: 1.0,
            start_reservation: Amount::new(64.0, 0.1),
        }
    }

    #[test]
    fn empty_node_admits_both() {
        let p = policy();
        let s = Snapshot::default();
        check(LS, Amount::new(1024.0, 1.0), &p, &s).unwrap();
        check(BE, Amount::new(1024.0, 1.0), &p, &s).unwrap();
        // LS is bounded by its floor: physical memory, 8x the cores.
        let f = free(LS, &p, &s);
        assert_eq!(f, Amount::new(24576.0, 16.0));
        // BE by the overcommit ratio (usage does not bound it on an empty node).
        assert_eq!(free(BE, &p, &s), Amount::new(98304.0, 50.0));
    }

    #[test]
    fn latency_sensitive_floor_never_overcommits_memory() {
        let p = policy();
        let s = Snapshot {
            committed_ls: Amount::new(24000.0, 4.0),
            ..Default::default()
        };
        check(LS, Amount::new(576.0, 1.0), &p, &s).unwrap();
        let e = check(LS, Amount::new(577.0, 1.0), &p, &s).unwrap_err();
        assert_eq!(
            (e.resource, e.rule.starts_with("latency")),
            ("memory", true)
        );
        // CPU floor: 16 cores of LS requests on 2 cores.
        let s = Snapshot {
            committed_ls: Amount::new(0.0, 15.5),
            ..Default::default()
        };
        assert_eq!(
            check(LS, Amount::new(64.0, 1.0), &p, &s)
                .unwrap_err()
                .resource,
            "cpu"
        );
    }

    #[test]
    fn best_effort_fills_by_measured_usage_not_requests() {
        let p = policy();
        // 20 GiB of LS requests; BE sandboxes have asked for 60 GiB but use 1 GiB.
        let s = Snapshot {
            committed_ls: Amount::new(20480.0, 2.0),
            committed_be: Amount::new(61440.0, 10.0),
            used: Amount::new(1024.0, 0.3),
            reserved: Amount::default(),
        };
        // Room by usage: 0.9 * 24576 - 20480 - 1024 = 614 MiB > the 64 MiB reservation.
        check(BE, Amount::new(4096.0, 1.0), &p, &s).unwrap();
        // A sum-of-requests check would have refused long ago (81 GiB > 24 GiB), the ratio
        // still has 98304 - 81920 = 16384 MiB.
        assert_eq!(free(BE, &p, &s).memory_mb, 16384.0);
        // Once BE sandboxes really use the memory, the LS floor is protected.
        let busy = Snapshot {
            used: Amount::new(1600.0, 0.3),
            ..s
        };
        let e = check(BE, Amount::new(256.0, 0.5), &p, &busy).unwrap_err();
        assert_eq!(e.resource, "memory");
        assert!(e.rule.starts_with("measured usage"), "{e}");
        // ... while an LS request within the floor is still admitted.
        check(LS, Amount::new(2048.0, 1.0), &p, &busy).unwrap();
        // The free BE figure is what is left by usage when below the reservation.
        let f = free(BE, &p, &busy);
        assert!(f.memory_mb < 64.0 && f.memory_mb > 0.0, "{f:?}");
    }

    #[test]
    fn starting_sandboxes_count_by_reservation() {
        let p = policy();
        let s = Snapshot {
            committed_ls: Amount::new(22000.0, 0.0),
            used: Amount::new(0.0, 0.0),
            reserved: Amount::new(64.0 * 2.0, 0.2),
            ..Default::default()
        };
        // 0.9 * 24576 = 22118.4; 22000 + 128 already > that: refused.
        assert!(check(BE, Amount::new(16.0, 0.01), &p, &s).is_err());
        let s = Snapshot {
            reserved: Amount::new(32.0, 0.2),
            ..s
        };
        // 22118.4 - 22032 = 86.4 left; the request reserves min(1024, 64) = 64.
        check(BE, Amount::new(1024.0, 0.5), &p, &s).unwrap();
    }

    #[test]
    fn cpu_usage_bounds_best_effort_only() {
        let p = policy();
        let s = Snapshot {
            used: Amount::new(0.0, 1.95),
            ..Default::default()
        };
        let e = check(BE, Amount::new(64.0, 1.0), &p, &s).unwrap_err();
        assert_eq!(e.resource, "cpu");
        check(LS, Amount::new(64.0, 1.0), &p, &s).unwrap();
        assert!((free(BE, &p, &s).cpu - 0.05).abs() < 1e-9);
    }

    #[test]
    fn refusals_say_what_to_ask_for_and_settled_books_admit_a_burst() {
        let p = policy();
        // 50 cores of 1-core requests on 2 cores x 25: the 51st is refused with a request
        // that fits named.
        let full = Snapshot {
            committed_be: Amount::new(1000.0, 49.5),
            ..Default::default()
        };
        let e = check(BE, Amount::new(64.0, 1.0), &p, &full).unwrap_err();
        assert!(
            e.to_string().contains("cpu_cores_limit=0.50 or less fits"),
            "{e}"
        );
        // 20 starting best-effort sandboxes hold 2 cores of reservations: the 21st waits
        // (the refusal is transient: settled, the same request fits).
        let starting = Snapshot {
            committed_be: Amount::new(20.0 * 64.0, 2.0),
            reserved: Amount::new(20.0 * 64.0, 2.0),
            ..Default::default()
        };
        let e = check(BE, Amount::new(64.0, 0.1), &p, &starting).unwrap_err();
        assert_eq!(e.resource, "cpu");
        check(
            BE,
            Amount::new(64.0, 0.1),
            &p,
            &starting.settled(Amount::default()),
        )
        .unwrap();
        // Measured, really busy CPU stays a refusal when settled.
        let busy = Snapshot {
            used: Amount::new(0.0, 1.95),
            ..Default::default()
        };
        assert!(check(
            BE,
            Amount::new(64.0, 0.1),
            &p,
            &busy.settled(Amount::default())
        )
        .is_err());
    }

    #[test]
    fn overcommit_ratio_applies_to_both() {
        let p = policy();
        let s = Snapshot {
            committed_ls: Amount::new(1000.0, 10.0),
            committed_be: Amount::new(1000.0, 39.5),
            ..Default::default()
        };
        for class in [LS, BE] {
            let e = check(class, Amount::new(64.0, 1.0), &p, &s).unwrap_err();
            assert_eq!(
                (e.resource, e.rule.starts_with("overcommit")),
                ("cpu", true)
            );
        }
        let st = status(&p, &s);
        assert_eq!(st.memory_mb_committed_be, 1000);
        assert!((st.cpu_cores_free_ls - 0.5).abs() < 1e-9);
        assert!((st.cpu_cores_free_be - 0.5).abs() < 1e-9);
    }
}
