//! `dsec run`, `dsec ps`, `dsec stop`.

use std::collections::BTreeMap;

use anyhow::Context;
use clap::Args;
use dsec_client::Client;
use dsec_wire::api::CreateSandboxRequest;

use crate::parse::parse_kv;

#[derive(Args, Debug)]
pub struct RunArgs {
    /// Image name (`name` or `name:tag`).
    pub image: String,
    /// Memory limit in MiB.
    #[arg(long)]
    pub memory: Option<u64>,
    /// CPU limit in cores (fractions allowed).
    #[arg(long)]
    pub cpus: Option<f64>,
    /// Maximum number of processes.
    #[arg(long)]
    pub pids: Option<u64>,
    /// User commands run as (`root`, a name or a uid of the image).
    #[arg(long)]
    pub user: Option<String>,
    /// Hostname inside the sandbox.
    #[arg(long)]
    pub hostname: Option<String>,
    /// Stop (or pause, see --ttl-action) after this many idle seconds.
    #[arg(long)]
    pub ttl: Option<u64>,
    /// What the idle TTL does: stop or pause.
    #[arg(long, value_parser = ["stop", "pause"])]
    pub ttl_action: Option<String>,
    /// Hard lifetime in seconds.
    #[arg(long)]
    pub ttl_total: Option<u64>,
    /// Environment for every command (repeatable).
    #[arg(long = "env", short = 'e', value_name = "K=V", value_parser = parse_kv)]
    pub env: Vec<(String, String)>,
    /// Labels (repeatable).
    #[arg(long = "label", short = 'l', value_name = "K=V", value_parser = parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Wait up to this many seconds in the apiserver's queue for a node with room instead of
    /// being refused with node_full.
    #[arg(long)]
    pub wait_s: Option<f64>,

    /// Mount a volume (repeatable): `PATH=NAME`, or `PATH=NAME:ro` read-only.
    #[arg(long = "volume", short = 'v', value_name = "PATH=NAME[:ro]", value_parser = parse_volume)]
    pub volumes: Vec<(String, dsec_wire::api::VolumeMount)>,
    /// Print the whole sandbox as JSON instead of its id.
    #[arg(long)]
    pub json: bool,
}

/// `PATH=NAME[:ro]` of `--volume`.
fn parse_volume(s: &str) -> Result<(String, dsec_wire::api::VolumeMount), String> {
    let (path, name) = s
        .split_once('=')
        .ok_or_else(|| format!("--volume {s:?}: give PATH=NAME or PATH=NAME:ro"))?;
    let (name, read_only) = match name.strip_suffix(":ro") {
        Some(n) => (n, true),
        None => (name.strip_suffix(":rw").unwrap_or(name), false),
    };
    let mount = dsec_wire::api::VolumeMount::Spec(dsec_wire::api::VolumeMountSpec {
        name: name.to_string(),
        read_only,
    });
    Ok((path.to_string(), mount))
}

pub async fn run(c: &Client, a: RunArgs) -> anyhow::Result<()> {
    let req = CreateSandboxRequest {
        image: a.image.clone(),
        memory_limit_mb: a.memory,
        cpu_cores_limit: a.cpus,
        pids_limit: a.pids,
        init_user: a.user,
        hostname: a.hostname,
        ttl_running_stop: a.ttl,
        ttl_total: a.ttl_total,
        ttl_action: match a.ttl_action.as_deref() {
            Some("pause") => Some(dsec_wire::api::TtlAction::Pause),
            Some(_) => Some(dsec_wire::api::TtlAction::Stop),
            None => None,
        },
        env: a.env.into_iter().collect::<BTreeMap<_, _>>(),
        labels: a.labels.into_iter().collect::<BTreeMap<_, _>>(),
        volumes: a.volumes.into_iter().collect(),
        ..Default::default()
    };
    if let Some(w) = a.wait_s {
        let q = c
            .create_waiting(&req, w)
            .await
            .with_context(|| format!("create a sandbox from {} (waiting up to {w} s)", a.image))?;
        if a.json {
            super::print_json(&q)?;
        } else {
            println!("{}", q.info.id);
        }
        return Ok(());
    }
    let info = c
        .create(&req)
        .await
        .with_context(|| format!("create a sandbox from {}", a.image))?;
    if a.json {
        super::print_json(&info)?;
    } else {
        println!("{}", info.id);
    }
    Ok(())
}

#[derive(Args, Debug)]
pub struct PsArgs {
    /// Print JSON for scripts.
    #[arg(long)]
    pub json: bool,
    /// Also list ended sandboxes the nodes remember, with their end reason.
    #[arg(long, short = 'a')]
    pub ended: bool,
    /// Only ended sandboxes that ended for this reason (e.g. `ttl_idle`, `node_lost`).
    #[arg(long)]
    pub end_reason: Option<dsec_wire::api::EndReason>,
}

pub async fn ps(c: &Client, a: PsArgs) -> anyhow::Result<()> {
    let with_ended = a.ended || a.end_reason.is_some();
    let list = if with_ended {
        c.list_with(&dsec_wire::api::ListSandboxesQuery {
            ended: Some(true),
            end_reason: a.end_reason,
        })
        .await
    } else {
        c.list().await
    }
    .context("list sandboxes")?;
    if a.json {
        return super::print_json(&list);
    }
    let mut rows: Vec<Vec<String>> = list
        .sandboxes
        .iter()
        .map(|s| {
            vec![
                s.id.clone(),
                serde_json::to_value(s.state)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default(),
                s.image.clone(),
                s.node.clone(),
                format!("{}M", s.memory_limit_mb),
                format!("{}", s.cpu_cores_limit),
                super::pause::idle_ttl_column(s),
                super::pause::total_ttl_column(s),
                s.created_at.clone(),
                s.end_reason.map_or("-".to_string(), |r| r.to_string()),
            ]
        })
        .collect();
    rows.sort_by(|a, b| a[8].cmp(&b[8]));
    let mut header = vec![
        "ID",
        "STATE",
        "IMAGE",
        "NODE",
        "MEMORY",
        "CPUS",
        "IDLE/TTL",
        "TTL_TOTAL",
        "CREATED",
    ];
    if with_ended {
        header.push("END_REASON");
    } else {
        for r in &mut rows {
            r.pop();
        }
    }
    print!("{}", crate::table::render(&header, &rows));
    Ok(())
}

#[derive(Args, Debug)]
pub struct StopArgs {
    /// Sandbox ids.
    #[arg(required = true)]
    pub ids: Vec<String>,
}

pub async fn stop(c: &Client, a: StopArgs) -> anyhow::Result<()> {
    let results = futures::future::join_all(a.ids.iter().map(|id| c.stop(id))).await;
    let mut failed = 0;
    for (id, r) in a.ids.iter().zip(results) {
        match r {
            Ok(_) => println!("{id}"),
            Err(e) => {
                eprintln!("dsec: stop {id}: {e}");
                failed += 1;
            }
        }
    }
    if failed > 0 {
        return Err(crate::ExitCode(1).into());
    }
    Ok(())
}
