//! `dsec`: the command-line client and every server role in one binary.
//!
//! Owns argument parsing, output formatting and starting the server roles from their config.
//! It must stay thin: it must not implement API calls (they go through `dsec-client`) nor
//! lifecycle, image or network logic (they live in the library crates it starts).

mod cmd;
mod connect;
mod envfile;
mod join;
mod logging;
mod parse;
mod server;
mod table;
mod tarball;

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::{Args, Parser, Subcommand};

/// A usage error (exit code 2), as opposed to a failure (exit code 1).
#[derive(Debug)]
pub struct UsageError(pub String);

impl std::fmt::Display for UsageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}
impl std::error::Error for UsageError {}

/// Exit with this code, after printing nothing more (the command already reported).
#[derive(Debug)]
pub struct ExitCode(pub i32);
impl std::fmt::Display for ExitCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "exit code {}", self.0)
    }
}
impl std::error::Error for ExitCode {}

#[derive(Parser, Debug)]
#[command(
    name = "dsec",
    version,
    about = "dsec: elastic sandboxes for agentic RL",
    propagate_version = true
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Args, Debug, Clone)]
pub struct Global {
    /// API URL (default: $DSEC_API_URL, then /var/lib/dsec/env).
    #[arg(long, global = true, env = "DSEC_API_URL", hide_env_values = true)]
    pub url: Option<String>,
    /// API key (default: $DSEC_API_KEY, then /var/lib/dsec/env).
    #[arg(long, global = true, env = "DSEC_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// Log filter when RUST_LOG is unset (error, warn, info, debug, trace or a filter spec).
    #[arg(long, global = true)]
    pub log_level: Option<String>,
    /// Log as JSON lines (to stderr).
    #[arg(long, global = true)]
    pub log_json: bool,
}

#[derive(Subcommand, Debug)]
pub enum Command {
    /// Run apiserver + watcher + one edge in this process.
    Up(UpArgs),
    /// Run an edge only.
    Edge(EdgeArgs),
    /// Run an apiserver only.
    Apiserver(ApiserverArgs),
    /// Create a sandbox from IMAGE and print its id.
    Run(cmd::sandbox::RunArgs),
    /// Run a command in a sandbox, streaming its output; exits with its exit code.
    Exec(cmd::exec::ExecArgs),
    /// Open an interactive terminal in a sandbox.
    Shell(cmd::shell::ShellArgs),
    /// List sandboxes.
    Ps(cmd::sandbox::PsArgs),
    /// Stop sandboxes.
    Stop(cmd::sandbox::StopArgs),
    /// Pause sandboxes (by id, or every sandbox matching --label): freeze and give memory back.
    Pause(cmd::pause::PauseArgs),
    /// Resume paused sandboxes (by id or --label).
    Resume(cmd::pause::PauseArgs),
    /// Snapshot a container's files into an image (prints the snapshot id, an image name).
    Snapshot(cmd::snapshot::SnapshotArgs),
    /// Fork a sandbox into N new ones from one snapshot (prints the children's ids).
    Fork(cmd::snapshot::ForkArgs),
    /// The URL of a TCP port inside a sandbox (signed and expiring by default).
    Port(cmd::port::PortArgs),
    /// Named persistent volumes: create, ls, rm (mount with `dsec run --volume /data=NAME`).
    #[command(subcommand)]
    Volume(cmd::volume::VolumeCommand),
    /// Copy a file into or out of a sandbox (one side is ID:/path).
    Cp(cmd::cp::CpArgs),
    /// Background processes in a sandbox (process handles): start, ls, logs, wait, kill.
    #[command(subcommand)]
    Proc(cmd::proc_::ProcCommand),
    /// Function calls on pre-warmed workers (`dsec fn run --lang python FILE`).
    #[command(subcommand, name = "fn")]
    Fn(cmd::fn_::FnCommand),
    /// Manage images.
    #[command(subcommand)]
    Image(cmd::image::ImageCommand),
    /// List nodes (edges) as the apiserver sees them.
    Nodes(cmd::nodes::NodesArgs),
    /// Show a sandbox's trajectory log (every call and its result); `--path` tells which call
    /// last wrote a file.
    Trajectory(cmd::trajectory::TrajectoryArgs),
    /// Re-execute a trajectory (JSONL) in a fresh sandbox and report every step that differs.
    Replay(cmd::trajectory::ReplayArgs),
    /// Cluster membership (admin): `node ls`, `node cordon|uncordon|drain ID`, `node token create`.
    #[command(subcommand)]
    Node(cmd::node::NodeCommand),
    /// Projects and their delegated quotas (admin).
    #[command(subcommand)]
    Project(cmd::project::ProjectCommand),
    /// API keys (admin).
    #[command(subcommand)]
    Key(cmd::key::KeyCommand),
    /// Live cluster view: sandboxes, creation rate, utilisation per node.
    Top(cmd::top::TopArgs),
    /// Load generators for benchmarks.
    #[command(subcommand)]
    Bench(cmd::bench::BenchCommand),
    /// Full-VM disk images: `prepare-image` (inject aether), `image import|ls|rm`.
    #[command(subcommand)]
    Vm(cmd::vm::VmCommand),
}

#[derive(Args, Debug)]
pub struct UpArgs {
    /// State directory (edge data, IAM database, env file).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Public API address.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Edge API address (loopback; port 0 picks a free one).
    #[arg(long)]
    pub edge_listen: Option<SocketAddr>,
    /// Node id of the edge.
    #[arg(long)]
    pub node_id: Option<String>,
    /// TOML file with `[edge]` and `[apiserver]` tables; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
}

#[derive(Args, Debug)]
pub struct EdgeArgs {
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    #[arg(long)]
    pub node_id: Option<String>,
    /// Bearer token the apiserver must present (default: generated, kept in <data-dir>/edge-token).
    #[arg(long, env = "DSEC_EDGE_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
    /// TOML file with an `[edge]` table; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Node label KEY=VALUE reported to placement (e.g. pool=overflow); repeat for several.
    #[arg(long = "label", value_name = "KEY=VALUE", value_parser = parse::parse_kv)]
    pub labels: Vec<(String, String)>,
    /// Most live sandboxes on this node.
    #[arg(long)]
    pub capacity: Option<u64>,
    /// TEST/BENCHMARK MODE: track sandboxes without running anything (commands answer
    /// `unsupported`). Needs no root, no image store, no data dir.
    #[arg(long)]
    pub simulated: bool,
    /// With --simulated: run this many simulated edges in this process, on consecutive ports
    /// from --listen's port, with node ids <node-id>0, <node-id>1, ...
    #[arg(long, requires = "simulated")]
    pub count: Option<u32>,
    /// Join the cluster at this apiserver URL (register, then heartbeat): no apiserver
    /// restart needed. Authorized by --join-token (or, when that is absent, --token, and the
    /// edge's own bearer token is then generated).
    #[arg(long, value_name = "API_URL", conflicts_with = "simulated")]
    pub join: Option<String>,
    /// Cluster join token for --join (`dsec node token create`, or the apiserver's
    /// `join_token`).
    #[arg(long, env = "DSEC_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// With --join: the pool this node is in (primary or overflow; overflow also labels it
    /// pool=overflow for placement).
    #[arg(long, requires = "join", value_parser = ["primary", "overflow"])]
    pub pool: Option<String>,
}

#[derive(Args, Debug)]
pub struct ApiserverArgs {
    /// File with one edge URL[#TOKEN] per line (blank lines and # comments ignored).
    #[arg(long)]
    pub edges_file: Option<PathBuf>,
    /// Placement strategy: power_of_k (default), random or least_loaded.
    #[arg(long)]
    pub placement: Option<String>,
    /// k of power-of-k-choices (default 2).
    #[arg(long)]
    pub placement_k: Option<usize>,
    /// Primary-pool utilisation above which eligible creates go to the overflow pool (0..1).
    #[arg(long)]
    pub overflow_threshold: Option<f64>,
    /// How often every edge is polled, in milliseconds.
    #[arg(long)]
    pub watcher_period_ms: Option<u64>,
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// An edge as URL[#token]; repeat for several.
    #[arg(long = "edge", value_name = "URL[#TOKEN]")]
    pub edges: Vec<String>,
    /// IAM database (default /var/lib/dsec/apiserver.db).
    #[arg(long)]
    pub db: Option<PathBuf>,
    /// Where the admin key is kept in plain text, 0600 (default: `env` next to the database).
    #[arg(long)]
    pub env_file: Option<PathBuf>,
    /// TOML file with an `[apiserver]` table; flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Cluster join token that `dsec edge --join` presents (at least 16 characters); tokens
    /// from `dsec node token create` work too.
    #[arg(long, env = "DSEC_JOIN_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
}

fn main() {
    let cli = match Cli::try_parse() {
        Ok(c) => c,
        Err(e) => {
            let code = if e.use_stderr() { 2 } else { 0 };
            let _ = e.print();
            std::process::exit(code);
        }
    };
    let server = matches!(
        cli.command,
        Command::Up(_) | Command::Edge(_) | Command::Apiserver(_)
    );
    let default_level = if server { "info" } else { "warn" };
    if let Err(e) = logging::init(
        cli.global.log_level.as_deref().unwrap_or(default_level),
        cli.global.log_json,
    ) {
        eprintln!("dsec: {e:#}");
        std::process::exit(2);
    }
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("dsec: start async runtime: {e}");
            std::process::exit(1);
        }
    };
    let result = rt.block_on(run(cli));
    let code = match result {
        Ok(()) => 0,
        Err(e) => {
            if let Some(ExitCode(c)) = e.downcast_ref::<ExitCode>() {
                *c
            } else if let Some(u) = e.downcast_ref::<UsageError>() {
                eprintln!("dsec: {u}");
                2
            } else {
                eprintln!("dsec: {e:#}");
                1
            }
        }
    };
    // Do not wait for blocking threads (e.g. a stdin reader of `dsec shell`).
    rt.shutdown_timeout(std::time::Duration::from_millis(100));
    std::process::exit(code);
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let g = cli.global;
    match cli.command {
        Command::Up(a) => server::up(a).await,
        Command::Edge(a) => server::edge(a).await,
        Command::Apiserver(a) => server::apiserver(a).await,
        Command::Run(a) => cmd::sandbox::run(&connect::client(&g)?, a).await,
        Command::Exec(a) => cmd::exec::exec(&connect::client(&g)?, a).await,
        Command::Shell(a) => cmd::shell::shell(&connect::client(&g)?, a).await,
        Command::Ps(a) => cmd::sandbox::ps(&connect::client(&g)?, a).await,
        Command::Stop(a) => cmd::sandbox::stop(&connect::client(&g)?, a).await,
        Command::Pause(a) => cmd::pause::pause(&connect::client(&g)?, a).await,
        Command::Resume(a) => cmd::pause::resume(&connect::client(&g)?, a).await,
        Command::Snapshot(a) => cmd::snapshot::snapshot(&connect::client(&g)?, a).await,
        Command::Fork(a) => cmd::snapshot::fork(&connect::client(&g)?, a).await,
        Command::Port(a) => cmd::port::port(&connect::client(&g)?, a).await,
        Command::Volume(c) => cmd::volume::volume(&connect::client(&g)?, c).await,
        Command::Cp(a) => cmd::cp::cp(&connect::client(&g)?, a).await,
        Command::Proc(c) => cmd::proc_::run(&connect::client(&g)?, c).await,
        Command::Fn(c) => cmd::fn_::run(&connect::client(&g)?, c).await,
        Command::Image(c) => cmd::image::image(&connect::client(&g)?, c).await,
        Command::Nodes(a) => cmd::nodes::nodes(&connect::client(&g)?, a).await,
        Command::Trajectory(a) => cmd::trajectory::trajectory(&connect::client(&g)?, a).await,
        Command::Replay(a) => cmd::trajectory::replay(&connect::client(&g)?, a).await,
        Command::Node(c) => cmd::node::node(&connect::client(&g)?, c).await,
        Command::Project(c) => cmd::project::project(&connect::client(&g)?, c).await,
        Command::Key(c) => cmd::key::key(&connect::client(&g)?, c).await,
        Command::Top(a) => cmd::top::top(&connect::client(&g)?, a).await,
        Command::Bench(c) => cmd::bench::bench(&g, c).await,
        Command::Vm(c) => cmd::vm::vm(c).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cli_is_consistent() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
    }

    #[test]
    fn exec_parses_trailing_command() {
        let cli = Cli::try_parse_from([
            "dsec",
            "exec",
            "sb-n0-0000000000000000",
            "--timeout",
            "5",
            "--",
            "ls",
            "-la",
        ])
        .unwrap();
        match cli.command {
            Command::Exec(a) => {
                assert_eq!(a.cmd, vec!["ls", "-la"]);
                assert_eq!(a.timeout, Some(5.0));
            }
            other => panic!("{other:?}"),
        }
        assert!(Cli::try_parse_from([
            "dsec",
            "exec",
            "x",
            "--session",
            "s",
            "--no-shell",
            "--",
            "ls"
        ])
        .is_err());
        assert!(Cli::try_parse_from(["dsec", "run", "busybox", "--env", "novalue"]).is_err());
        assert!(Cli::try_parse_from(["dsec", "image", "import", "x", "--dir", "d"]).is_ok());
        assert!(Cli::try_parse_from(["dsec", "image", "import", "x"]).is_err());
        assert!(
            Cli::try_parse_from(["dsec", "image", "import", "x", "--dir", "d", "--tar", "t"])
                .is_err()
        );
    }
}
