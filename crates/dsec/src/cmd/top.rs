//! `dsec top`: the live cluster view (refreshes until interrupted, or once with --once).

use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use dsec_client::Client;

#[derive(Args, Debug)]
pub struct TopArgs {
    /// Refresh period in seconds.
    #[arg(long, default_value_t = 1.0)]
    pub interval: f64,
    /// Print one view and exit.
    #[arg(long)]
    pub once: bool,
    /// Print JSON (with --once).
    #[arg(long)]
    pub json: bool,
}

/// The wire name of a placement strategy (`power_of_k`, ...).
fn strategy_name(s: dsec_wire::admin::Strategy) -> String {
    serde_json::to_value(s)
        .ok()
        .and_then(|v| v.as_str().map(str::to_string))
        .unwrap_or_else(|| "?".into())
}

pub async fn top(c: &Client, a: TopArgs) -> anyhow::Result<()> {
    let mut prev: Option<(u64, Instant)> = None;
    loop {
        let v = c.cluster().await.context("read the cluster view")?;
        if a.once && a.json {
            return super::print_json(&v);
        }
        let created = v.created_total;
        let rate = match prev {
            Some((c, t)) => created.saturating_sub(c) as f64 / t.elapsed().as_secs_f64().max(1e-3),
            None => 0.0,
        };
        prev = Some((created, Instant::now()));
        let rows: Vec<Vec<String>> = v
            .nodes
            .iter()
            .map(|n| {
                let mut labels: Vec<String> =
                    n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                labels.sort();
                vec![
                    n.node.clone(),
                    if n.healthy { "healthy" } else { "UNHEALTHY" }.into(),
                    format!("{}/{}", n.sandboxes, n.capacity),
                    format!("{:.0}%", n.load * 100.0),
                    labels.join(","),
                ]
            })
            .collect();
        if !a.once {
            print!("\x1b[2J\x1b[H");
        }
        println!(
            "sandboxes {}  capacity {}  healthy nodes {}/{}  primary pool {:.0}% (overflow above {:.0}%)  placement {}",
            v.sandboxes,
            v.capacity,
            v.healthy_nodes,
            v.nodes.len(),
            v.primary_utilisation * 100.0,
            v.overflow_threshold * 100.0,
            strategy_name(v.placement),
        );
        println!(
            "this apiserver: {created} created ({rate:.0}/s), {} quota refusals, {} no-room refusals, {} to overflow",
            v.quota_refusals_total, v.placement_refusals_total, v.overflow_placements_total,
        );
        print!(
            "{}",
            crate::table::render(&["NODE", "HEALTH", "SANDBOXES", "LOAD", "LABELS"], &rows)
        );
        if a.once {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_secs_f64(a.interval.max(0.1))).await;
    }
}
