//! Server roles: `dsec up` (edge + apiserver in one process), `dsec edge`, `dsec apiserver`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use dsec_apiserver::{ApiConfig, ApiServer, EdgeEndpoint};
use dsec_edge::{Edge, EdgeConfig};
use serde::Deserialize;
use tokio::task::JoinHandle;

use crate::{ApiserverArgs, EdgeArgs, UpArgs};

/// The TOML file: `[edge]` and `[apiserver]` tables, both optional.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileConfig {
    #[serde(default)]
    edge: Option<toml::Table>,
    #[serde(default)]
    apiserver: Option<toml::Table>,
}

struct Loaded {
    edge: EdgeConfig,
    api: ApiConfig,
    edge_listen_set: bool,
    api_db_set: bool,
}

fn load_config(path: Option<&Path>) -> anyhow::Result<Loaded> {
    let Some(path) = path else {
        return Ok(Loaded {
            edge: EdgeConfig::default(),
            api: ApiConfig::default(),
            edge_listen_set: false,
            api_db_set: false,
        });
    };
    let text =
        std::fs::read_to_string(path).with_context(|| format!("read config {}", path.display()))?;
    let file: FileConfig =
        toml::from_str(&text).with_context(|| format!("parse config {}", path.display()))?;
    let edge_listen_set = file.edge.as_ref().is_some_and(|t| t.contains_key("listen"));
    let api_db_set = file
        .apiserver
        .as_ref()
        .is_some_and(|t| t.contains_key("db_path"));
    let edge: EdgeConfig = match file.edge {
        Some(t) => t
            .try_into()
            .with_context(|| format!("config {}: [edge]", path.display()))?,
        None => EdgeConfig::default(),
    };
    let api: ApiConfig = match file.apiserver {
        Some(t) => t
            .try_into()
            .with_context(|| format!("config {}: [apiserver]", path.display()))?,
        None => ApiConfig::default(),
    };
    Ok(Loaded {
        edge,
        api,
        edge_listen_set,
        api_db_set,
    })
}

/// Binds the edge listener and serves the edge's router on it.
async fn serve_edge(edge: &Edge, listener: tokio::net::TcpListener) -> JoinHandle<()> {
    let router = edge.router();
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, router).await {
            tracing::error!(error = %e, "edge stopped serving");
        }
    })
}

/// Polls `url` until it answers 200 or `timeout` passes.
async fn wait_http_ok(url: &str, timeout: Duration) -> anyhow::Result<()> {
    let http = reqwest::Client::builder()
        .no_proxy()
        .timeout(Duration::from_secs(2))
        .build()?;
    let deadline = Instant::now() + timeout;
    loop {
        match http.get(url).send().await {
            Ok(r) if r.status().is_success() => return Ok(()),
            r => {
                if Instant::now() > deadline {
                    bail!("{url} did not answer within {timeout:?}: {r:?}");
                }
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The admin key to print: a new one from a fresh database, else the one kept in `env_file`
/// (checked against the database), else a newly issued one.
async fn admin_key(api: &ApiServer, env_file: &Path) -> anyhow::Result<String> {
    if let Some(k) = api.bootstrap_key() {
        return Ok(k.to_string());
    }
    if let Ok(vars) = crate::envfile::read(env_file) {
        if let Some(k) = vars.get(dsec_client::ENV_KEY) {
            if api.verify_key(k).await {
                return Ok(k.clone());
            }
            tracing::warn!(file = %env_file.display(), "the stored admin key is not valid any more; issuing a new one");
        }
    }
    api.issue_admin_key()
        .context("issue an admin API key")?
        .ok_or_else(|| anyhow::anyhow!("the IAM database has no admin principal"))
}

fn print_env(env_file: &Path, vars: &[(&str, &str)]) -> anyhow::Result<()> {
    crate::envfile::write(env_file, vars)
        .with_context(|| format!("write {}", env_file.display()))?;
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    for (k, v) in vars {
        writeln!(out, "{k}={v}")?;
    }
    out.flush()?;
    Ok(())
}

/// Waits for SIGINT or SIGTERM.
async fn wait_for_signal() -> anyhow::Result<&'static str> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut int = signal(SignalKind::interrupt()).context("watch SIGINT")?;
    let mut term = signal(SignalKind::terminate()).context("watch SIGTERM")?;
    Ok(tokio::select! {
        _ = int.recv() => "SIGINT",
        _ = term.recv() => "SIGTERM",
    })
}

/// A second signal while shutting down exits at once.
fn exit_on_second_signal() {
    tokio::spawn(async {
        if wait_for_signal().await.is_ok() {
            eprintln!("dsec: second signal, exiting without finishing the shutdown");
            std::process::exit(130);
        }
    });
}

pub async fn up(a: UpArgs) -> anyhow::Result<()> {
    let Loaded {
        mut edge,
        mut api,
        edge_listen_set,
        api_db_set,
    } = load_config(a.config.as_deref())?;
    if let Some(d) = a.data_dir {
        edge.data_dir = d;
    }
    if let Some(n) = a.node_id {
        edge.node_id = n;
    }
    // Environment overrides of single keys, then every key checked before anything starts.
    edge.apply_env()?;
    edge.validate()?;
    let edge_listen = a
        .edge_listen
        .or(edge_listen_set.then_some(edge.listen))
        .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
    if let Some(l) = a.listen {
        api.listen = l;
    }
    let data_dir = edge.data_dir.clone();
    std::fs::create_dir_all(&data_dir).with_context(|| format!("create {}", data_dir.display()))?;
    if !api_db_set {
        api.db_path = data_dir.join("apiserver.db");
    }

    // The edge: its own loopback listener; the apiserver reaches it over HTTP.
    let listener = tokio::net::TcpListener::bind(edge_listen)
        .await
        .with_context(|| format!("listen on {edge_listen} for the edge"))?;
    edge.listen = listener.local_addr().context("edge listener address")?;
    if edge.token.is_none() {
        edge.token = Some(hex::encode(rand::random::<[u8; 24]>()));
    }
    let edge = Edge::start(edge).await.context("start the edge")?;
    let edge_task = serve_edge(&edge, listener).await;
    let edge_url = edge.config().url();
    wait_http_ok(&format!("{edge_url}/healthz"), Duration::from_secs(30))
        .await
        .context("wait for the edge")?;

    api.edges = vec![EdgeEndpoint {
        node_id: Some(edge.config().node_id.clone()),
        url: edge_url.clone(),
        token: edge.token().to_string(),
    }];
    let server = match ApiServer::start(api).await {
        Ok(s) => s,
        Err(e) => {
            edge.shutdown().await;
            return Err(e).context("start the apiserver");
        }
    };
    let api_url = server.url();
    wait_http_ok(&format!("{api_url}/healthz"), Duration::from_secs(30))
        .await
        .context("wait for the apiserver")?;
    let deadline = Instant::now() + Duration::from_secs(30);
    while !server.edges_healthy().await {
        if Instant::now() > deadline {
            tracing::warn!("the edge is not healthy yet; see `dsec nodes`");
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let key = admin_key(&server, &data_dir.join("env")).await?;
    print_env(
        &data_dir.join("env"),
        &[
            (dsec_client::ENV_URL, &api_url),
            (dsec_client::ENV_KEY, &key),
        ],
    )?;
    tracing::info!(api = %api_url, edge = %edge_url, node = %edge.config().node_id, "dsec is up");

    let sig = wait_for_signal().await?;
    tracing::info!(signal = sig, "shutting down: stopping every sandbox");
    exit_on_second_signal();
    server.shutdown().await;
    edge.shutdown().await;
    edge_task.abort();
    tracing::info!("stopped");
    Ok(())
}

pub async fn edge(a: EdgeArgs) -> anyhow::Result<()> {
    if a.simulated {
        return simulated_edges(a).await;
    }
    let Loaded { mut edge, .. } = load_config(a.config.as_deref())?;
    edge.labels.extend(a.labels.iter().cloned());
    let mut a = a;
    // With --join and no --join-token, --token is the cluster join token.
    let join_token = match (&a.join, a.join_token.take()) {
        (None, _) => None,
        (Some(_), Some(t)) => Some(t),
        (Some(_), None) => Some(a.token.take().ok_or_else(|| {
            crate::UsageError(
                "--join needs --join-token (or --token) with a cluster join token".into(),
            )
        })?),
    };
    let pool = match a.pool.as_deref() {
        Some("overflow") => {
            edge.labels.insert("pool".into(), "overflow".into());
            dsec_wire::api::NodePool::Overflow
        }
        _ => dsec_wire::api::NodePool::Primary,
    };
    if let Some(c) = a.capacity {
        edge.capacity = c;
    }
    if let Some(d) = a.data_dir {
        edge.data_dir = d;
    }
    if let Some(n) = a.node_id {
        edge.node_id = n;
    }
    if let Some(l) = a.listen {
        edge.listen = l;
    }
    if a.token.is_some() {
        edge.token = a.token;
    }
    edge.apply_env()?;
    edge.validate()?;
    let listener = tokio::net::TcpListener::bind(edge.listen)
        .await
        .with_context(|| format!("listen on {}", edge.listen))?;
    edge.listen = listener.local_addr().context("edge listener address")?;
    let edge = Edge::start(edge).await.context("start the edge")?;
    let task = serve_edge(&edge, listener).await;
    let url = edge.config().url();
    wait_http_ok(&format!("{url}/healthz"), Duration::from_secs(30))
        .await
        .context("wait for the edge")?;
    let heartbeat = match (&a.join, join_token) {
        (Some(api), Some(token)) => {
            let req = dsec_wire::api::JoinRequest {
                node_id: edge.config().node_id.clone(),
                url: url.clone(),
                token: edge.token().to_string(),
                capacity: edge.config().capacity,
                pool,
                labels: edge.config().labels.clone(),
            };
            match crate::join::join(api, &token, req, Duration::from_secs(60)).await {
                Ok(h) => Some(h),
                Err(e) => {
                    edge.shutdown().await;
                    task.abort();
                    return Err(e);
                }
            }
        }
        _ => None,
    };
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "DSEC_EDGE_URL={url}")?;
        writeln!(out, "DSEC_EDGE_TOKEN={}", edge.token())?;
        out.flush()?;
    }
    let sig = wait_for_signal().await?;
    tracing::info!(signal = sig, "shutting down: stopping every sandbox");
    exit_on_second_signal();
    if let Some(h) = heartbeat {
        h.abort();
    }
    edge.shutdown().await;
    task.abort();
    Ok(())
}

/// `dsec edge --simulated`: TEST/BENCHMARK MODE, see `dsec_simedge`.
async fn simulated_edges(a: EdgeArgs) -> anyhow::Result<()> {
    use dsec_simedge::{serve_many, url_of, SimConfig, SimulatedEdge};
    let count = a.count.unwrap_or(1).max(1);
    let base = a.listen.unwrap_or(SocketAddr::from(([127, 0, 0, 1], 0)));
    let prefix = a.node_id.clone().unwrap_or_else(|| "sim".into());
    let token = a
        .token
        .clone()
        .unwrap_or_else(|| hex::encode(rand::random::<[u8; 24]>()));
    let mut edges = Vec::new();
    for i in 0..count {
        let addr = if base.port() == 0 {
            base
        } else {
            let port = u16::try_from(u32::from(base.port()) + i)
                .map_err(|_| anyhow::anyhow!("port {} + {i} is past 65535", base.port()))?;
            SocketAddr::new(base.ip(), port)
        };
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .with_context(|| format!("listen on {addr} for simulated edge {i}"))?;
        let local = listener.local_addr().context("listener address")?;
        let node_id = if count == 1 {
            prefix.clone()
        } else {
            format!("{prefix}{i}")
        };
        let capacity = a.capacity.unwrap_or(5000);
        let edge = SimulatedEdge::new(SimConfig {
            node_id,
            capacity,
            // Enough CPU and memory (with the default overcommit) for `capacity` default-sized
            // sandboxes, so the sandbox count is the limit.
            cpu_cores_total: (capacity as f64 / 25.0).ceil().max(64.0),
            memory_mb_total: (capacity * 256).max(256 * 1024),
            labels: a.labels.iter().cloned().collect(),
            token: token.clone(),
            url: url_of(local),
            ..Default::default()
        });
        edges.push((edge, listener));
    }
    let urls: Vec<String> = edges.iter().map(|(e, _)| e.config().url.clone()).collect();
    let tasks = serve_many(edges);
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        for u in &urls {
            writeln!(out, "DSEC_EDGE_URL={u}")?;
        }
        writeln!(out, "DSEC_EDGE_TOKEN={token}")?;
        out.flush()?;
    }
    tracing::warn!(
        count,
        "SIMULATED edges (test/benchmark mode): sandboxes are tracked, nothing runs"
    );
    let sig = wait_for_signal().await?;
    tracing::info!(signal = sig, "shutting down simulated edges");
    for t in tasks {
        t.abort();
    }
    Ok(())
}

pub async fn apiserver(a: ApiserverArgs) -> anyhow::Result<()> {
    let Loaded { mut api, .. } = load_config(a.config.as_deref())?;
    if let Some(f) = &a.edges_file {
        let text = std::fs::read_to_string(f).with_context(|| format!("read {}", f.display()))?;
        for line in text
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
        {
            api.edges.push(
                EdgeEndpoint::parse(line).with_context(|| format!("{}: {line}", f.display()))?,
            );
        }
    }
    if let Some(p) = &a.placement {
        api.placement.strategy = p
            .parse()
            .map_err(|e: dsec_wire::admin::UnknownStrategy| crate::UsageError(e.to_string()))?;
    }
    if let Some(k) = a.placement_k {
        api.placement.k = k;
    }
    if let Some(t) = a.overflow_threshold {
        api.placement.overflow_threshold = t;
    }
    if let Some(p) = a.watcher_period_ms {
        api.watcher_period_ms = p;
    }
    if let Some(l) = a.listen {
        api.listen = l;
    }
    if let Some(db) = a.db {
        api.db_path = db;
    }
    for e in &a.edges {
        api.edges
            .push(EdgeEndpoint::parse(e).with_context(|| format!("--edge {e}"))?);
    }
    if let Some(t) = a.join_token.clone() {
        api.join_token = Some(t);
    }
    if api.edges.is_empty() && api.join_token.is_none() {
        return Err(crate::UsageError(
            "pass at least one --edge URL[#token], or --join-token so edges can join".into(),
        )
        .into());
    }
    let env_file: PathBuf = a.env_file.unwrap_or_else(|| default_env_file(&api.db_path));
    let server = ApiServer::start(api).await.context("start the apiserver")?;
    let url = server.url();
    wait_http_ok(&format!("{url}/healthz"), Duration::from_secs(30))
        .await
        .context("wait for the apiserver")?;
    let key = admin_key(&server, &env_file).await?;
    print_env(
        &env_file,
        &[(dsec_client::ENV_URL, &url), (dsec_client::ENV_KEY, &key)],
    )?;
    let sig = wait_for_signal().await?;
    tracing::info!(signal = sig, "shutting down");
    server.shutdown().await;
    Ok(())
}

/// Where `dsec apiserver` writes its env file when `--env-file` is not given: beside the SQLite
/// file `--db` names (a path or `sqlite:///path`), or in /var/lib/dsec for a PostgreSQL URL.
fn default_env_file(db: &Path) -> PathBuf {
    match dsec_apiserver::store::Target::from_path(db) {
        dsec_apiserver::store::Target::Postgres(_) => PathBuf::from("/var/lib/dsec/env"),
        dsec_apiserver::store::Target::Sqlite(file) => match file.parent() {
            Some(dir) if !dir.as_os_str().is_empty() => dir.join("env"),
            _ => PathBuf::from("env"),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn env_file_goes_beside_the_sqlite_file_in_every_form() {
        for db in ["/var/x/api.db", "sqlite:///var/x/api.db"] {
            assert_eq!(
                default_env_file(Path::new(db)),
                Path::new("/var/x/env"),
                "{db}"
            );
        }
        assert_eq!(default_env_file(Path::new("api.db")), Path::new("env"));
        assert_eq!(
            default_env_file(Path::new("sqlite://api.db")),
            Path::new("env")
        );
        assert_eq!(
            default_env_file(Path::new("postgres://u@db.dsec.test/dsec")),
            Path::new("/var/lib/dsec/env")
        );
    }

    #[test]
    fn config_file_tables() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("dsec.toml");
        std::fs::write(
            &p,
            "[edge]\nnode_id = \"n3\"\ncapacity = 7\n[apiserver]\nwatcher_period_ms = 250\n",
        )
        .unwrap();
        let l = load_config(Some(&p)).unwrap();
        assert_eq!(l.edge.node_id, "n3");
        assert_eq!(l.edge.capacity, 7);
        assert_eq!(l.api.watcher_period_ms, 250);
        assert!(!l.edge_listen_set);
        std::fs::write(&p, "[edge]\nbogus = 1\n").unwrap();
        let e = format!("{:#}", load_config(Some(&p)).err().unwrap());
        assert!(e.contains("bogus"), "{e}");
    }
}
