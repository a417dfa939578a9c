//! `dsec nodes`.

use anyhow::Context;
use clap::Args;
use dsec_client::Client;

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
    Ok(())
}
