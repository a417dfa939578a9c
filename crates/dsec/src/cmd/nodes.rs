//! `dsec nodes`.

use anyhow::Context;
use clap::Args;
use dsec_client::Client;
use dsec_wire::api::{AdmissionStatus, Capability, NodeCapabilities};

#[derive(Args, Debug)]
pub struct NodesArgs {
    /// Print JSON for scripts.
    #[arg(long)]
    pub json: bool,
}

pub async fn nodes(c: &Client, a: NodesArgs) -> anyhow::Result<()> {
    let list = c.nodes().await.context("list nodes")?;
    if a.json {
        return super::print_json(&list);
    }
    let rows: Vec<Vec<String>> = list
        .nodes
        .iter()
        .map(|n| {
            vec![
                n.node.clone(),
                if n.healthy { "healthy" } else { "unhealthy" }.to_string(),
                format!(
                    "{}/{}",
                    n.sandboxes_running + n.sandboxes_paused,
                    n.capacity_sandboxes
                ),
                format!("{:.1}/{:.0}", n.cpu_cores_allocated, n.cpu_cores_total),
                format!("{}/{}M", n.memory_mb_allocated, n.memory_mb_total),
                n.images.len().to_string(),
                n.url.clone(),
            ]
        })
        .collect();
    print!(
        "{}",
        crate::table::render(
            &[
                "NODE",
                "STATUS",
                "SANDBOXES",
                "CPUS",
                "MEMORY",
                "IMAGES",
                "URL"
            ],
            &rows
        )
    );
    for n in &list.nodes {
        if let Some(c) = &n.capabilities {
            println!("{}: {}", n.node, capabilities_line(c));
        }
        if let Some(a) = &n.admission {
            println!("{}: {}", n.node, admission_line(a));
        }
    }
    Ok(())
}

fn cap(c: &Capability) -> String {
    if c.available {
        "available".to_string()
    } else if c.detail.is_empty() {
        "unavailable".to_string()
    } else {
        format!("unavailable ({})", c.detail)
    }
}

/// `capabilities: cgroup v1, cpu.idle: available, core scheduling: unavailable (EINVAL), ...`
pub fn capabilities_line(c: &NodeCapabilities) -> String {
    format!(
        "capabilities: cgroup {}, cpu.idle: {}, core scheduling: {}, SCHED_IDLE: {}, SMT: {}, PSI: {}, DAMON: {}, zram: {}, KSM: {}, favordynmods: {}",
        c.cgroup_version,
        cap(&c.cpu_idle),
        cap(&c.core_scheduling),
        cap(&c.sched_idle),
        cap(&c.smt),
        cap(&c.psi),
        cap(&c.damon),
        cap(&c.zram),
        cap(&c.ksm),
        cap(&c.cgroup_favordynmods)
    )
}

/// `admission: memory used 1200M (LS 2048M, BE 512M requested), free LS 22528M / BE 20000M; ...`
pub fn admission_line(a: &AdmissionStatus) -> String {
    format!(
        "admission: memory used {}M (requested LS {}M, BE {}M), admits LS {}M / BE {}M; cpu used {:.2} (requested LS {:.1}, BE {:.1}), admits LS {:.1} / BE {:.1}",
        a.memory_mb_used,
        a.memory_mb_committed_ls,
        a.memory_mb_committed_be,
        a.memory_mb_free_ls,
        a.memory_mb_free_be,
        a.cpu_cores_used,
        a.cpu_cores_committed_ls,
        a.cpu_cores_committed_be,
        a.cpu_cores_free_ls,
        a.cpu_cores_free_be
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capability_report() {
        let c = NodeCapabilities {
            cgroup_version: "v1".into(),
            core_scheduling: Capability {
                available: false,
                detail: "EINVAL".into(),
            },
            psi: Capability {
                available: true,
                detail: "x".into(),
            },
            cgroup_favordynmods: Capability {
                available: true,
                detail: String::new(),
            },
            ..Default::default()
        };
        let line = capabilities_line(&c);
        assert!(line.contains("favordynmods: available"), "{line}");
        assert!(line.contains("cgroup v1"), "{line}");
        assert!(
            line.contains("core scheduling: unavailable (EINVAL)"),
            "{line}"
        );
        assert!(line.contains("PSI: available"), "{line}");
        let a = admission_line(&AdmissionStatus {
            memory_mb_free_be: 7,
            ..Default::default()
        });
        assert!(a.contains("BE 7M"), "{a}");
    }
}
