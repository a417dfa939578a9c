//! `dsec node ls|cordon|uncordon|drain|token create`: cluster membership (issue 22).

use anyhow::Context;
use clap::{Args, Subcommand};
use dsec_client::Client;
use dsec_wire::api::{DrainPolicy, NodeAction, NodeList, NodePool};

#[derive(Subcommand, Debug)]
pub enum NodeCommand {
    /// Every node: state, pool, capacity, sandboxes, labels, last heartbeat.
    Ls(LsArgs),
    /// No new placements on the node; its sandboxes run on.
    Cordon(IdArgs),
    /// Placements again (also after a drain).
    Uncordon(IdArgs),
    /// No new placements, then pause (default) or stop every live sandbox of the node.
    Drain(DrainArgs),
    /// Cluster join tokens for `dsec edge --join URL --token T`.
    #[command(subcommand)]
    Token(TokenCommand),
}

#[derive(Args, Debug)]
pub struct LsArgs {
    /// Print JSON for scripts.
    #[arg(long)]
    pub json: bool,
}

#[derive(Args, Debug)]
pub struct IdArgs {
    /// Node id.
    pub id: String,
}

#[derive(Args, Debug)]
pub struct DrainArgs {
    /// Node id.
    pub id: String,
    /// What to do with the node's live sandboxes.
    #[arg(long, default_value = "pause", value_parser = ["pause", "stop"])]
    pub policy: String,
}

#[derive(Subcommand, Debug)]
pub enum TokenCommand {
    /// Issue a join token (printed once).
    Create,
}

pub async fn node(c: &Client, cmd: NodeCommand) -> anyhow::Result<()> {
    match cmd {
        NodeCommand::Ls(a) => {
            let list = c.nodes().await.context("list nodes")?;
            if a.json {
                return super::print_json(&list);
            }
            print!("{}", render(&list, dsec_apiserver_now_ms()));
            Ok(())
        }
        NodeCommand::Cordon(a) => action(c.cordon_node(&a.id).await.context("cordon")?),
        NodeCommand::Uncordon(a) => action(c.uncordon_node(&a.id).await.context("uncordon")?),
        NodeCommand::Drain(a) => {
            let policy = if a.policy == "stop" {
                DrainPolicy::Stop
            } else {
                DrainPolicy::Pause
            };
            action(c.drain_node(&a.id, policy).await.context("drain")?)
        }
        NodeCommand::Token(TokenCommand::Create) => {
            let t = c.create_join_token().await.context("create a join token")?;
            println!("{}", t.token);
            Ok(())
        }
    }
}

fn dsec_apiserver_now_ms() -> i64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or(0)
}

fn action(a: NodeAction) -> anyhow::Result<()> {
    println!("{} {}", a.node_id, a.state);
    if !a.paused.is_empty() {
        println!("paused: {}", a.paused.join(" "));
    }
    if !a.stopped.is_empty() {
        println!("stopped: {}", a.stopped.join(" "));
    }
    for (id, why) in &a.failed {
        println!("failed: {id}: {why}");
    }
    if a.failed.is_empty() {
        Ok(())
    } else {
        Err(anyhow::anyhow!(
            "{} sandbox(es) could not be paused or stopped; the node stays draining",
            a.failed.len()
        ))
    }
}

/// The `node ls` table.
pub fn render(list: &NodeList, now_ms: i64) -> String {
    let rows: Vec<Vec<String>> = list
        .nodes
        .iter()
        .map(|n| {
            let m = n.membership.clone().unwrap_or_default();
            let labels: Vec<String> = n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            vec![
                n.node.clone(),
                m.state.to_string(),
                match m.pool {
                    NodePool::Primary => "primary".into(),
                    NodePool::Overflow => "overflow".into(),
                },
                if m.joined { "joined" } else { "static" }.to_string(),
                format!(
                    "{}/{}",
                    n.sandboxes_running + n.sandboxes_paused,
                    n.capacity_sandboxes
                ),
                m.last_heartbeat_ms
                    .map(|t| format!("{:.1}s ago", (now_ms - t).max(0) as f64 / 1000.0))
                    .unwrap_or_else(|| "-".into()),
                if labels.is_empty() {
                    "-".into()
                } else {
                    labels.join(",")
                },
                n.url.clone(),
            ]
        })
        .collect();
    let mut out = crate::table::render(
        &[
            "NODE",
            "STATE",
            "POOL",
            "MEMBER",
            "SANDBOXES",
            "HEARTBEAT",
            "LABELS",
            "URL",
        ],
        &rows,
    );
    for n in &list.nodes {
        if let Some(d) = n.membership.as_ref().and_then(|m| m.detail.as_ref()) {
            out.push_str(&format!("{}: {d}\n", n.node));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::api::{NodeMembership, NodeState, NodeStatus};

    #[test]
    fn table_shows_state_pool_heartbeat_and_labels() {
        let list = NodeList {
            nodes: vec![NodeStatus {
                node: "n1".into(),
                url: "http://n1.dsec.test:1".into(),
                sandboxes_running: 2,
                capacity_sandboxes: 10,
                labels: [("zone".to_string(), "a".to_string())].into(),
                membership: Some(NodeMembership {
                    state: NodeState::Suspect,
                    pool: NodePool::Overflow,
                    joined: true,
                    last_heartbeat_ms: Some(1_000),
                    last_seen_ms: None,
                    detail: Some("no heartbeat for 6000 ms".into()),
                }),
                ..Default::default()
            }],
        };
        let t = render(&list, 3_500);
        for want in [
            "suspect",
            "overflow",
            "joined",
            "2/10",
            "2.5s ago",
            "zone=a",
            "n1: no heartbeat",
        ] {
            assert!(t.contains(want), "{want} missing in\n{t}");
        }
    }
}
