//! `dsec top`: the live cluster view (refreshes until interrupted, or once with --once).

use std::time::{Duration, Instant};

use clap::Args;
use reqwest::Method;

use super::bench::Api;

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

pub async fn top(api: &Api, a: TopArgs) -> anyhow::Result<()> {
    let mut prev: Option<(u64, Instant)> = None;
    loop {
        let v = api.call(Method::GET, "/v1/cluster", None).await?;
        if a.once && a.json {
            return super::print_json(&v);
        }
        let created = v["created_total"].as_u64().unwrap_or(0);
        let rate = match prev {
            Some((c, t)) => created.saturating_sub(c) as f64 / t.elapsed().as_secs_f64().max(1e-3),
            None => 0.0,
        };
        prev = Some((created, Instant::now()));
        let empty = vec![];
        let nodes = v["nodes"].as_array().unwrap_or(&empty);
        let rows: Vec<Vec<String>> = nodes
            .iter()
            .map(|n| {
                let mut labels: Vec<String> = n["labels"]
                    .as_object()
                    .map(|m| {
                        m.iter()
                            .map(|(k, v)| format!("{k}={}", v.as_str().unwrap_or("")))
                            .collect()
                    })
                    .unwrap_or_default();
                labels.sort();
                vec![
                    n["node"].as_str().unwrap_or("?").to_string(),
                    if n["healthy"].as_bool() == Some(true) {
                        "healthy"
                    } else {
                        "UNHEALTHY"
                    }
                    .into(),
                    format!("{}/{}", n["sandboxes"], n["capacity"]),
                    format!("{:.0}%", n["load"].as_f64().unwrap_or(0.0) * 100.0),
                    labels.join(","),
                ]
            })
            .collect();
        if !a.once {
            print!("\x1b[2J\x1b[H");
        }
        println!(
            "sandboxes {}  capacity {}  healthy nodes {}/{}  primary pool {:.0}% (overflow above {:.0}%)  placement {}",
            v["sandboxes"],
            v["capacity"],
            v["healthy_nodes"],
            nodes.len(),
            v["primary_utilisation"].as_f64().unwrap_or(0.0) * 100.0,
            v["overflow_threshold"].as_f64().unwrap_or(0.0) * 100.0,
            v["placement"].as_str().unwrap_or("?"),
        );
        println!(
            "this apiserver: {created} created ({rate:.0}/s), {} quota refusals, {} no-room refusals, {} to overflow",
            v["quota_refusals_total"], v["placement_refusals_total"], v["overflow_placements_total"],
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
