//! `dsec snapshot ID [--name N]` and `dsec fork ID -n N [--label k=v]`.

use anyhow::Context;
use clap::Args;
use dsec_client::Client;
use dsec_wire::api::{ForkRequest, SnapshotRequest};

#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// Sandbox id.
    pub id: String,
    /// Image name of the snapshot (default `snapshot/<id>-<ms>`).
    #[arg(long)]
    pub name: Option<String>,
    /// Print the whole answer as JSON (default: the snapshot id).
    #[arg(long)]
    pub json: bool,
}

pub async fn snapshot(c: &Client, a: SnapshotArgs) -> anyhow::Result<()> {
    let s = c
        .snapshot(
            &a.id,
            &SnapshotRequest {
                name: a.name,
                memory: false,
            },
        )
        .await
        .with_context(|| format!("snapshot {}", a.id))?;
    if a.json {
        super::print_json(&s)
    } else {
        println!("{}", s.id);
        Ok(())
    }
}

#[derive(Args, Debug)]
pub struct ForkArgs {
    /// Sandbox id.
    pub id: String,
    /// How many children (1..=100).
    #[arg(short = 'n', long = "count")]
    pub n: u32,
    /// Label of every child, `key=value`; repeat for several.
    #[arg(long = "label", value_parser = crate::parse::parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Print the whole answer as JSON (default: one child id per line).
    #[arg(long)]
    pub json: bool,
}

pub async fn fork(c: &Client, a: ForkArgs) -> anyhow::Result<()> {
    let r = c
        .fork(
            &a.id,
            &ForkRequest {
                n: a.n,
                labels: a.labels.into_iter().collect(),
                snapshot_name: None,
            },
        )
        .await
        .with_context(|| format!("fork {}", a.id))?;
    if a.json {
        super::print_json(&r)?;
    } else {
        for ch in &r.children {
            println!("{}", ch.id);
        }
        for f in &r.failed {
            eprintln!("dsec: fork child #{}: {}", f.index, f.error.message);
        }
    }
    if !r.failed.is_empty() {
        anyhow::bail!("{} of {} children could not be made", r.failed.len(), a.n);
    }
    Ok(())
}
