//! How many more sandboxes of a request's shape the watcher's view has room for: the burst
//! queue lets no more attempts through than that, so attempts rarely find no room (which would
//! put them back behind later creates that did find it).

use dsec_wire::api::{CreateSandboxRequest, QosClass};

use crate::watcher::NodeView;

/// Room counted for a node that has not been polled yet (a create right after start).
const UNPOLLED: usize = 1;
/// Room counted for a node without a sandbox limit whose memory does not bound it either.
const UNBOUNDED: usize = 1 << 20;

/// Sandboxes like `req` the healthy nodes its labels select have room for (sandbox count and
/// the edges' own admission figures, as placement judges them).
pub fn room_for(nodes: &[NodeView], req: &CreateSandboxRequest) -> usize {
    let sel: Vec<(&str, &str)> = req
        .labels
        .iter()
        .filter_map(|(k, v)| k.strip_prefix("node.").map(|k| (k, v.as_str())))
        .collect();
    let mut room = 0usize;
    for n in nodes {
        let Some(s) = &n.status else {
            if !n.polled {
                room += UNPOLLED;
            }
            continue;
        };
        if !n.healthy
            || n.cordoned
            || !(s.substrates.is_empty() || s.substrates.contains(&req.substrate))
            || !sel
                .iter()
                .all(|(k, v)| s.labels.get(*k).map(String::as_str) == Some(*v))
        {
            continue;
        }
        let by_count = if s.capacity_sandboxes == 0 {
            UNBOUNDED
        } else {
            s.capacity_sandboxes
                .saturating_sub(s.sandboxes_running + s.sandboxes_paused) as usize
        };
        let by_admission = s.admission.as_ref().map_or(UNBOUNDED, |a| {
            let (mem, cpu) = match req.qos.unwrap_or_default() {
                QosClass::LatencySensitive => (a.memory_mb_free_ls, a.cpu_cores_free_ls),
                QosClass::BestEffort => (a.memory_mb_free_be, a.cpu_cores_free_be),
            };
            let want_mem = req.memory_limit_mb.unwrap_or(1).max(1);
            let want_cpu = req.cpu_cores_limit.unwrap_or(0.0);
            if want_mem > mem || want_cpu > cpu + 1e-9 {
                0
            } else {
                // At least one fits; the edge's admission has the final word on more.
                ((mem / want_mem) as usize).max(1)
            }
        });
        room = room.saturating_add(by_count.min(by_admission));
    }
    room
}

/// Why the view has no room for `req`, per resource, for a refusal past `wait_s`.
pub fn why_no_room(nodes: &[NodeView], req: &CreateSandboxRequest) -> String {
    let (mut unhealthy, mut full, mut used, mut cap, mut mem, mut cpu) = (0, 0, 0u64, 0u64, 0, 0);
    // The most any node not full by count has free for this class.
    let (mut best_mem, mut best_cpu) = (0u64, 0.0f64);
    for n in nodes {
        let Some(s) = n.status.as_ref().filter(|_| n.healthy) else {
            unhealthy += 1;
            continue;
        };
        used += s.sandboxes_running + s.sandboxes_paused;
        cap += s.capacity_sandboxes;
        if s.capacity_sandboxes > 0
            && s.sandboxes_running + s.sandboxes_paused >= s.capacity_sandboxes
        {
            full += 1;
            continue;
        }
        if let Some(a) = &s.admission {
            let (m, c) = match req.qos.unwrap_or_default() {
                QosClass::LatencySensitive => (a.memory_mb_free_ls, a.cpu_cores_free_ls),
                QosClass::BestEffort => (a.memory_mb_free_be, a.cpu_cores_free_be),
            };
            best_mem = best_mem.max(m);
            best_cpu = best_cpu.max(c);
            if req.memory_limit_mb.unwrap_or(1) > m {
                mem += 1;
            } else if req.cpu_cores_limit.unwrap_or(0.0) > c + 1e-9 {
                cpu += 1;
            }
        }
    }
    let mut parts = Vec::new();
    if full > 0 {
        parts.push(format!(
            "{full} node(s) full by sandbox count ({used} of {cap} sandboxes in use)"
        ));
    }
    if mem > 0 {
        parts.push(format!(
            "{mem} node(s) without the memory asked for (ask for memory_limit_mb={best_mem} or less to fit now)"
        ));
    }
    if cpu > 0 {
        parts.push(format!(
            "{cpu} node(s) without the CPU asked for (ask for cpu_cores_limit={:.2} or less to fit now; an idle sandbox needs far less than the default 1 core)",
            (best_cpu * 100.0).floor() / 100.0
        ));
    }
    if unhealthy > 0 {
        parts.push(format!("{unhealthy} node(s) unhealthy or not polled"));
    }
    if parts.is_empty() {
        "every node with room is taken by earlier creates of the queue".into()
    } else {
        format!("no node has room: {}", parts.join(", "))
    }
}
