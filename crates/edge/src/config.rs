//! Edge configuration: typed defaults, deserialized from the `[edge]` table of a TOML file (or
//! built in code), then checked once by [`EdgeConfig::validate`], which names the bad key.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// Configuration of one edge (one node).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EdgeConfig {
    /// Node id, `[a-z0-9]{1,16}`; encoded into every sandbox id.
    pub node_id: String,
    /// Root of the node's state; the edge uses `<data_dir>/edge/`.
    pub data_dir: PathBuf,
    /// Address the edge HTTP API listens on.
    pub listen: SocketAddr,
    /// URL under which the apiserver reaches this edge (default `http://<listen>`).
    pub advertise_url: Option<String>,
    /// Bearer token for `/edge/v1`. Generated (and kept in `<data_dir>/edge/token`) when absent.
    pub token: Option<String>,
    /// Path of the static `dsec-aether` binary; see [`EdgeConfig::resolve_aether_path`].
    pub aether_path: Option<PathBuf>,
    /// cgroup path below each controller's root (default `dsec/<node_id>`).
    pub cgroup_parent: Option<String>,
    pub default_memory_mb: u64,
    pub max_memory_mb: u64,
    pub default_cpu_cores: f64,
    pub max_cpu_cores: f64,
    pub default_pids: u64,
    pub max_pids: u64,
    /// Most sandboxes this node runs at once.
    pub capacity: u64,
    /// Cores this node offers (default: online CPUs of the machine).
    pub cpu_cores_total: Option<f64>,
    /// MiB of memory this node offers (default: `MemTotal` of the machine).
    pub memory_mb_total: Option<u64>,
    /// Allocated CPU may reach `cpu_cores_total * cpu_overcommit`.
    pub cpu_overcommit: f64,
    /// Allocated memory may reach `memory_mb_total * memory_overcommit`.
    pub memory_overcommit: f64,
    /// Command timeout in seconds when a request names none.
    pub default_timeout_s: f64,
    /// Longest command timeout a request may ask for, in seconds.
    pub max_timeout_s: f64,
    /// Size of each sandbox's /dev/shm in MiB.
    pub shm_mb: u64,
    /// Largest file upload in bytes.
    pub max_upload_bytes: u64,
    /// How many ended sandboxes are remembered so `GET` can say what happened.
    pub tombstones: usize,
    /// Labels reported in the node status (placement filters on them).
    pub labels: BTreeMap<String, String>,
    /// `[edge.trajectory]`: the per-sandbox call log (see [`dsec_trajectory`]).
    pub trajectory: dsec_trajectory::TrajectoryConfig,
    /// Where layer data blobs live: `local` (`<data_dir>/edge/images/blobs`), `local:/dir`,
    /// or `posix:/mounted/dir` (a distributed file system; blocks are read on demand), or
    /// `s3://bucket/prefix` (an S3-compatible object store, read through a node-local chunk
    /// cache; configured by `[edge.image_s3]`).
    pub image_blob_store: String,
    /// `[edge.image_s3]`: endpoint, region, credentials (each falls back to the environment)
    /// and the chunk cache's bound, chunk size, timeout and retries.
    pub image_s3: dsec_image::S3Config,
    /// PEM file of CA certificates every registry pull trusts (besides the system's roots and
    /// a request's own `ca_pem`), for registries behind a private CA.
    pub registry_ca_file: Option<PathBuf>,
    /// How long a sandbox's agent waits for a restarted edge to reattach after the edge died
    /// (milliseconds; 0: sandboxes die with the edge and are cleaned at the next start).
    pub reattach_grace_ms: u64,
    /// Give a paused sandbox's memory back to the host (page cache; anonymous memory where
    /// swap exists).
    pub reclaim_on_pause: bool,
    /// How often the TTL reaper looks for idle and expired sandboxes (milliseconds).
    pub ttl_check_ms: u64,
    /// Sandbox networking (`[edge.network]`): subnets, domain groups, static DNS table.
    pub network: dsec_network::NetworkConfig,
    /// Default size limit of a sandbox's writable layer in MiB (0: unlimited).
    pub default_disk_limit_mb: u64,
    /// Per-sandbox write and read bandwidth limit on the sandboxes' disk in MiB/s (0: none).
    pub disk_bps_limit_mb: u64,
    /// `[edge.functions]`: the pre-warmed function-call pools (see [`dsec_functions`]).
    pub functions: dsec_functions::FunctionConfig,
    /// `[edge.qos]`: default QoS class, overcommit floor (see [`dsec_node::qos`]).
    pub qos: dsec_node::qos::QosConfig,
    /// `[edge.reclaim]`: zram swap tier, cold-memory reclaim, node memory pressure (see
    /// [`dsec_node::reclaim`]).
    pub reclaim: dsec_node::reclaim::ReclaimConfig,
    /// `[edge.microvm]`: how microVMs run QEMU (see [`crate::vm_config`]).
    pub microvm: crate::vm_config::MicroVmSection,
    /// `[edge.vm]`: how full VMs run QEMU (see [`crate::vm_config`]).
    pub vm: crate::vm_config::VmSection,
}

impl Default for EdgeConfig {
    fn default() -> Self {
        Self {
            node_id: "n0".to_string(),
            data_dir: PathBuf::from("/var/lib/dsec"),
            listen: SocketAddr::from(([127, 0, 0, 1], 7701)),
            advertise_url: None,
            token: None,
            aether_path: None,
            cgroup_parent: None,
            default_memory_mb: 1024,
            max_memory_mb: 64 * 1024,
            default_cpu_cores: 1.0,
            max_cpu_cores: 64.0,
            default_pids: 1024,
            max_pids: 65536,
            capacity: 5000,
            cpu_cores_total: None,
            memory_mb_total: None,
            cpu_overcommit: 25.0,
            memory_overcommit: 4.0,
            default_timeout_s: dsec_wire::api::limits::DEFAULT_TIMEOUT_S,
            max_timeout_s: 24.0 * 3600.0,
            shm_mb: 64,
            max_upload_bytes: 10 * 1024 * 1024 * 1024,
            tombstones: 512,
            labels: BTreeMap::new(),
            trajectory: Default::default(),
            image_blob_store: "local".to_string(),
            image_s3: Default::default(),
            registry_ca_file: None,
            reattach_grace_ms: 60_000,
            reclaim_on_pause: true,
            ttl_check_ms: 500,
            network: dsec_network::NetworkConfig::default(),
            default_disk_limit_mb: 0,
            disk_bps_limit_mb: 0,
            functions: Default::default(),
            qos: Default::default(),
            reclaim: Default::default(),
            microvm: Default::default(),
            vm: Default::default(),
        }
    }
}

/// A configuration value that cannot work; `key` is the TOML key.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
#[error("edge config: {key}: {message}")]
pub struct ConfigError {
    pub key: &'static str,
    pub message: String,
}

/// `[edge.network]` is validated by the network crate; its keys are already relative to
/// `edge`.
impl From<dsec_network::NetworkConfigError> for ConfigError {
    fn from(e: dsec_network::NetworkConfigError) -> Self {
        ConfigError {
            key: e.key,
            message: e.message,
        }
    }
}

impl From<crate::vm_config::VmConfigError> for ConfigError {
    fn from(e: crate::vm_config::VmConfigError) -> Self {
        ConfigError {
            key: e.key,
            message: e.message,
        }
    }
}

fn bad(key: &'static str, message: impl Into<String>) -> ConfigError {
    ConfigError {
        key,
        message: message.into(),
    }
}

/// True for a node id: `[a-z0-9]{1,16}`.
pub fn is_valid_node_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 16
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
}

impl EdgeConfig {
    /// Checks every value; the error names the first bad key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        self.network.validate()?;
        self.functions
            .validate()
            .map_err(|e| bad(e.key, e.message))?;
        for checked in [self.reclaim.validate(), self.qos.validate()] {
            if let Err(e) = checked {
                return Err(bad(e.key, e.message));
            }
        }
        crate::vm_config::validate(&self.microvm, &self.vm)?;
        if !is_valid_node_id(&self.node_id) {
            return Err(bad(
                "node_id",
                format!("{:?} must match [a-z0-9]{{1,16}}", self.node_id),
            ));
        }
        if !self.data_dir.is_absolute() {
            return Err(bad(
                "data_dir",
                format!("{} must be an absolute path", self.data_dir.display()),
            ));
        }
        if let Some(t) = &self.token {
            if t.len() < 16 || !t.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad(
                    "token",
                    "must be at least 16 printable ASCII characters without spaces",
                ));
            }
        }
        if let Some(p) = &self.registry_ca_file {
            let pem = std::fs::read_to_string(p).map_err(|e| {
                bad(
                    "registry_ca_file",
                    format!("cannot read {}: {e}", p.display()),
                )
            })?;
            dsec_image::registry::parse_ca_pem(&pem)
                .map_err(|m| bad("registry_ca_file", format!("{}: {m}", p.display())))?;
        }
        if let Some(p) = &self.aether_path {
            if !p.is_absolute() {
                return Err(bad(
                    "aether_path",
                    format!("{} must be an absolute path", p.display()),
                ));
            }
        }
        if let Some(c) = &self.cgroup_parent {
            let ok = !c.is_empty()
                && c.split('/').all(|part| {
                    !part.is_empty()
                        && part != "."
                        && part != ".."
                        && part
                            .bytes()
                            .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
                });
            if !ok {
                return Err(bad(
                    "cgroup_parent",
                    format!("{c:?} must be a relative path of [A-Za-z0-9._-] parts"),
                ));
            }
        }
        if let Err((key, message)) = self.trajectory.validate() {
            return Err(bad(key, message));
        }
        if self.default_memory_mb < 8 {
            return Err(bad("default_memory_mb", "must be at least 8"));
        }
        if self.max_memory_mb < self.default_memory_mb {
            return Err(bad("max_memory_mb", "must be at least default_memory_mb"));
        }
        if !(self.default_cpu_cores.is_finite() && self.default_cpu_cores > 0.0) {
            return Err(bad("default_cpu_cores", "must be a positive number"));
        }
        if !(self.max_cpu_cores.is_finite() && self.max_cpu_cores >= self.default_cpu_cores) {
            return Err(bad(
                "max_cpu_cores",
                "must be a number at least default_cpu_cores",
            ));
        }
        if self.default_pids < 8 {
            return Err(bad("default_pids", "must be at least 8"));
        }
        if self.max_pids < self.default_pids {
            return Err(bad("max_pids", "must be at least default_pids"));
        }
        if self.capacity == 0 {
            return Err(bad("capacity", "must be at least 1"));
        }
        if let Some(c) = self.cpu_cores_total {
            if !(c.is_finite() && c > 0.0) {
                return Err(bad("cpu_cores_total", "must be a positive number"));
            }
        }
        if self.memory_mb_total == Some(0) {
            return Err(bad("memory_mb_total", "must be positive"));
        }
        if !(self.cpu_overcommit.is_finite() && self.cpu_overcommit >= 1.0) {
            return Err(bad("cpu_overcommit", "must be a number >= 1.0"));
        }
        if !(self.memory_overcommit.is_finite() && self.memory_overcommit >= 1.0) {
            return Err(bad("memory_overcommit", "must be a number >= 1.0"));
        }
        if !(self.default_timeout_s.is_finite() && self.default_timeout_s > 0.0) {
            return Err(bad(
                "default_timeout_s",
                "must be a positive number of seconds",
            ));
        }
        if !(self.max_timeout_s.is_finite() && self.max_timeout_s >= self.default_timeout_s) {
            return Err(bad(
                "max_timeout_s",
                "must be a number of seconds at least default_timeout_s",
            ));
        }
        if self.shm_mb == 0 {
            return Err(bad("shm_mb", "must be at least 1"));
        }
        if self.max_upload_bytes == 0 {
            return Err(bad("max_upload_bytes", "must be positive"));
        }
        if !(50..=60_000).contains(&self.ttl_check_ms) {
            return Err(bad("ttl_check_ms", "must be between 50 and 60000"));
        }
        if self.tombstones == 0 {
            return Err(bad("tombstones", "must be at least 1"));
        }
        if let Some(u) = &self.advertise_url {
            if !(u.starts_with("http://") || u.starts_with("https://")) {
                return Err(bad(
                    "advertise_url",
                    format!("{u:?} must start with http:// or https://"),
                ));
            }
        }
        Ok(())
    }

    /// Applies the environment variables that override single keys (the `DSEC_*` variables of
    /// [`crate::vm_config::ENV_KEYS`]); [`EdgeConfig::validate`] then checks the result like
    /// values from the file. A value that is not of the key's type is an error naming the key.
    pub fn apply_env(&mut self) -> Result<(), ConfigError> {
        crate::vm_config::apply_env(&mut self.microvm, &mut self.vm, &|k| std::env::var(k).ok())
            .map_err(ConfigError::from)
    }

    /// `<data_dir>/edge`.
    pub fn edge_dir(&self) -> PathBuf {
        self.data_dir.join("edge")
    }

    /// `<data_dir>/edge/images`.
    pub fn images_dir(&self) -> PathBuf {
        self.edge_dir().join("images")
    }

    /// `<data_dir>/edge/sandboxes`.
    pub fn sandboxes_dir(&self) -> PathBuf {
        self.edge_dir().join("sandboxes")
    }

    /// The cgroup parent path (`dsec/<node_id>` unless configured).
    pub fn cgroup_parent(&self) -> String {
        self.cgroup_parent
            .clone()
            .unwrap_or_else(|| format!("dsec/{}", self.node_id))
    }

    /// The URL the edge advertises in its status.
    pub fn url(&self) -> String {
        self.advertise_url
            .clone()
            .unwrap_or_else(|| format!("http://{}", self.listen))
    }

    /// The node's size and overcommit ratios, as admission needs them.
    pub fn capacity(&self) -> dsec_node::qos::Capacity {
        dsec_node::qos::Capacity {
            memory_mb: self.memory_total_mb(),
            cpu: self.cpu_total(),
            memory_overcommit: self.memory_overcommit,
            cpu_overcommit: self.cpu_overcommit,
        }
    }

    /// Cores offered: configured, or the machine's online CPUs.
    pub fn cpu_total(&self) -> f64 {
        self.cpu_cores_total.unwrap_or_else(machine_cpus)
    }

    /// MiB offered: configured, or the machine's `MemTotal`.
    pub fn memory_total_mb(&self) -> u64 {
        self.memory_mb_total
            .unwrap_or_else(|| machine_meminfo_mb("MemTotal").unwrap_or(1024))
    }

    /// Finds the aether binary: `$DSEC_AETHER`, then `aether_path`, then next to the current
    /// executable, then `../x86_64-unknown-linux-gnu/release/dsec-aether` and
    /// `../../x86_64-unknown-linux-gnu/release/dsec-aether` relative to it, then
    /// `/usr/local/lib/dsec/dsec-aether`. Returns every place tried when none exists.
    pub fn resolve_aether_path(&self) -> Result<PathBuf, Vec<PathBuf>> {
        let env = std::env::var_os("DSEC_AETHER").map(PathBuf::from);
        let exe_dir = std::env::current_exe()
            .ok()
            .and_then(|p| p.parent().map(Path::to_path_buf));
        let candidates = aether_candidates(env, self.aether_path.clone(), exe_dir);
        match candidates.iter().find(|p| p.is_file()) {
            Some(p) => Ok(p.clone()),
            None => Err(candidates),
        }
    }
}

/// The places the aether binary is looked for, in order.
pub fn aether_candidates(
    env: Option<PathBuf>,
    configured: Option<PathBuf>,
    exe_dir: Option<PathBuf>,
) -> Vec<PathBuf> {
    if let Some(p) = env {
        return vec![p];
    }
    let mut out = Vec::new();
    out.extend(configured);
    if let Some(dir) = exe_dir {
        out.push(dir.join("dsec-aether"));
        out.push(dir.join("../x86_64-unknown-linux-gnu/release/dsec-aether"));
        out.push(dir.join("../../x86_64-unknown-linux-gnu/release/dsec-aether"));
    }
    out.push(PathBuf::from("/usr/local/lib/dsec/dsec-aether"));
    out
}

/// Online CPUs of this machine.
pub fn machine_cpus() -> f64 {
    std::thread::available_parallelism()
        .map(|n| n.get() as f64)
        .unwrap_or(1.0)
}

/// A `/proc/meminfo` field in MiB (`MemTotal`, `MemAvailable`, ...).
pub fn machine_meminfo_mb(field: &str) -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_meminfo_mb(&text, field)
}

fn parse_meminfo_mb(text: &str, field: &str) -> Option<u64> {
    text.lines().find_map(|line| {
        let (name, rest) = line.split_once(':')?;
        if name.trim() != field {
            return None;
        }
        let kb: u64 = rest.split_whitespace().next()?.parse().ok()?;
        Some(kb / 1024)
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_are_valid() {
        EdgeConfig::default().validate().unwrap();
    }

    #[test]
    fn bad_values_name_their_key() {
        type Edit = Box<dyn Fn(&mut EdgeConfig)>;
        let cases: Vec<(&str, Edit)> = vec![
            ("node_id", Box::new(|c| c.node_id = "Node-1".into())),
            ("node_id", Box::new(|c| c.node_id = "a".repeat(17))),
            ("data_dir", Box::new(|c| c.data_dir = "relative".into())),
            ("token", Box::new(|c| c.token = Some("short".into()))),
            ("max_memory_mb", Box::new(|c| c.max_memory_mb = 1)),
            (
                "default_cpu_cores",
                Box::new(|c| c.default_cpu_cores = f64::NAN),
            ),
            ("capacity", Box::new(|c| c.capacity = 0)),
            ("cpu_overcommit", Box::new(|c| c.cpu_overcommit = 0.5)),
            (
                "cgroup_parent",
                Box::new(|c| c.cgroup_parent = Some("../escape".into())),
            ),
            (
                "advertise_url",
                Box::new(|c| c.advertise_url = Some("edge:1".into())),
            ),
            (
                "microvm.accel",
                Box::new(|c| c.microvm.accel = "kvmm".into()),
            ),
            ("vm.accel", Box::new(|c| c.vm.accel = Some("hvf".into()))),
        ];
        for (key, f) in cases {
            let mut c = EdgeConfig::default();
            f(&mut c);
            let err = c.validate().unwrap_err();
            assert_eq!(err.key, key, "{err}");
            assert!(err.to_string().contains(key));
        }
    }

    #[test]
    fn toml_partial_and_unknown_keys() {
        let c: EdgeConfig = toml::from_str("node_id = \"n7\"\ncapacity = 10\n").unwrap();
        assert_eq!(c.node_id, "n7");
        assert_eq!(c.capacity, 10);
        assert_eq!(c.default_memory_mb, 1024);
        let c: EdgeConfig =
            toml::from_str("[microvm]\naccel = \"kvm\"\n[vm]\nmachine = \"pc\"\n").unwrap();
        assert_eq!(c.microvm.accel, "kvm");
        assert_eq!(c.vm.machine.as_deref(), Some("pc"));
        let err = toml::from_str::<EdgeConfig>("capacty = 10\n").unwrap_err();
        assert!(err.to_string().contains("capacty"), "{err}");
    }

    #[test]
    fn aether_lookup_order() {
        let env = aether_candidates(Some("/x/a".into()), Some("/y/b".into()), Some("/z".into()));
        assert_eq!(env, vec![PathBuf::from("/x/a")]);
        let c = aether_candidates(None, None, Some("/t/debug".into()));
        assert_eq!(c[0], PathBuf::from("/t/debug/dsec-aether"));
        assert_eq!(
            c[1],
            PathBuf::from("/t/debug/../x86_64-unknown-linux-gnu/release/dsec-aether")
        );
        assert_eq!(
            c[2],
            PathBuf::from("/t/debug/../../x86_64-unknown-linux-gnu/release/dsec-aether")
        );
        assert_eq!(c[3], PathBuf::from("/usr/local/lib/dsec/dsec-aether"));
    }

    #[test]
    fn meminfo() {
        let t = "MemTotal:       24576000 kB\nMemAvailable:   1024000 kB\n";
        assert_eq!(parse_meminfo_mb(t, "MemTotal"), Some(24000));
        assert_eq!(parse_meminfo_mb(t, "MemAvailable"), Some(1000));
        assert_eq!(parse_meminfo_mb(t, "Nope"), None);
    }
}
