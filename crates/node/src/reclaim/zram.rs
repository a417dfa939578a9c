//! The compressed swap tier: one zram device the edge creates, swaps on, and removes again.
//!
//! Setup (idempotent): `hot_add` on `/sys/class/zram-control` returns a fresh device number N;
//! `comp_algorithm` (the first of the configured preferences the kernel lists), `disksize`,
//! `mkswap /dev/zramN`, `swapon -p <priority> /dev/zramN`. N is recorded in
//! `<edge>/reclaim/zram.json`; a restarted edge finds its device by that marker (and re-uses it
//! when it is still swapped on) instead of adding a second one. Teardown (`swapoff`,
//! `hot_remove`) touches only the recorded device.
//!
//! The sysfs root and `/proc/swaps` are parameters so the logic runs against fixture files.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum ZramError {
    #[error("zram is not available: {0}")]
    Unavailable(String),
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{cmd} failed: {msg}")]
    Command { cmd: String, msg: String },
    #[error("parse {path}: {what}")]
    Parse { path: PathBuf, what: String },
}

fn io(op: &'static str, path: &Path, source: std::io::Error) -> ZramError {
    ZramError::Io {
        op,
        path: path.to_path_buf(),
        source,
    }
}

/// The marker kept in the data dir.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ZramMarker {
    pub device: u32,
    pub disksize_bytes: u64,
    pub algorithm: String,
}

/// Where the kernel interfaces live (fixtures in tests).
#[derive(Debug, Clone)]
pub struct ZramHost {
    /// `/sys` normally.
    pub sys: PathBuf,
    /// `/dev` normally.
    pub dev: PathBuf,
    /// `/proc/swaps` normally.
    pub swaps: PathBuf,
    /// Run mkswap/swapon/swapoff (false in fixture tests).
    pub run_commands: bool,
}

impl Default for ZramHost {
    fn default() -> Self {
        Self {
            sys: PathBuf::from("/sys"),
            dev: PathBuf::from("/dev"),
            swaps: PathBuf::from("/proc/swaps"),
            run_commands: true,
        }
    }
}

/// The edge's swap device, as set up.
#[derive(Debug, Clone, PartialEq)]
pub struct ZramDevice {
    pub marker: ZramMarker,
    /// True when an earlier run's device was found and re-used.
    pub reused: bool,
}

impl ZramHost {
    fn control(&self) -> PathBuf {
        self.sys.join("class/zram-control")
    }

    fn block(&self, n: u32) -> PathBuf {
        self.sys.join(format!("block/zram{n}"))
    }

    pub fn dev_path(&self, n: u32) -> PathBuf {
        self.dev.join(format!("zram{n}"))
    }

    /// True when `/proc/swaps` lists `/dev/zram<n>`.
    pub fn is_swapped_on(&self, n: u32) -> bool {
        let name = format!("/dev/zram{n}");
        std::fs::read_to_string(&self.swaps)
            .map(|s| swaps_list(&s).iter().any(|d| *d == name))
            .unwrap_or(false)
    }

    /// Sets the device up (or re-uses the one the marker names). `marker_path` is written.
    pub fn setup(
        &self,
        marker_path: &Path,
        size_mb: u64,
        preferences: &[String],
        priority: i32,
    ) -> Result<ZramDevice, ZramError> {
        if let Some(m) = read_marker(marker_path) {
            if self.block(m.device).is_dir() && self.is_swapped_on(m.device) {
                tracing::info!(
                    device = m.device,
                    "zram: re-using the device of an earlier run"
                );
                return Ok(ZramDevice {
                    marker: m,
                    reused: true,
                });
            }
            // The recorded device exists but is not swapped on (crash mid-setup): remove it.
            if self.block(m.device).is_dir() {
                let _ = self.remove_device(m.device);
            }
            let _ = std::fs::remove_file(marker_path);
        }
        let control = self.control();
        if !control.is_dir() {
            return Err(ZramError::Unavailable(format!(
                "{} is missing (zram module not loaded or not built)",
                control.display()
            )));
        }
        let hot_add = control.join("hot_add");
        let text = std::fs::read_to_string(&hot_add).map_err(|e| io("read", &hot_add, e))?;
        let n: u32 = text.trim().parse().map_err(|_| ZramError::Parse {
            path: hot_add.clone(),
            what: format!("not a device number: {:?}", text.trim()),
        })?;
        // Record the device first: whatever happens next, a later run knows what is ours.
        let algorithm = match self.configure(n, size_mb, preferences) {
            Ok(a) => a,
            Err(e) => {
                let _ = self.remove_device(n);
                return Err(e);
            }
        };
        let marker = ZramMarker {
            device: n,
            disksize_bytes: size_mb * 1024 * 1024,
            algorithm,
        };
        write_marker(marker_path, &marker)?;
        if let Err(e) = self.swapon(n, priority) {
            let _ = self.remove_device(n);
            let _ = std::fs::remove_file(marker_path);
            return Err(e);
        }
        Ok(ZramDevice {
            marker,
            reused: false,
        })
    }

    fn configure(&self, n: u32, size_mb: u64, prefs: &[String]) -> Result<String, ZramError> {
        let block = self.block(n);
        let alg_file = block.join("comp_algorithm");
        let avail = std::fs::read_to_string(&alg_file).map_err(|e| io("read", &alg_file, e))?;
        let (current, listed) = parse_algorithms(&avail);
        let algorithm = match prefs.iter().find(|p| listed.iter().any(|l| l == *p)) {
            Some(p) => {
                std::fs::write(&alg_file, p).map_err(|e| io("write", &alg_file, e))?;
                p.clone()
            }
            None => current.unwrap_or_default(),
        };
        let size = block.join("disksize");
        std::fs::write(&size, format!("{}", size_mb * 1024 * 1024))
            .map_err(|e| io("write", &size, e))?;
        Ok(algorithm)
    }

    fn swapon(&self, n: u32, priority: i32) -> Result<(), ZramError> {
        if !self.run_commands {
            return Ok(());
        }
        let dev = self.dev_path(n);
        // devtmpfs creates the node asynchronously after hot_add.
        let deadline = Instant::now() + Duration::from_secs(2);
        while !dev.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        run("mkswap", &[dev.to_string_lossy().as_ref()])?;
        run(
            "swapon",
            &["-p", &priority.to_string(), dev.to_string_lossy().as_ref()],
        )
    }

    /// `swapoff` (if swapped on), `reset` and `hot_remove` of device `n`.
    pub fn remove_device(&self, n: u32) -> Result<(), ZramError> {
        if self.run_commands && self.is_swapped_on(n) {
            run("swapoff", &[self.dev_path(n).to_string_lossy().as_ref()])?;
        }
        let block = self.block(n);
        if !block.is_dir() {
            return Ok(());
        }
        let reset = block.join("reset");
        let _ = std::fs::write(&reset, "1");
        let hot_remove = self.control().join("hot_remove");
        std::fs::write(&hot_remove, n.to_string()).map_err(|e| io("write", &hot_remove, e))
    }

    /// Tears down the device the marker names and removes the marker. Nothing recorded: no-op.
    pub fn teardown(&self, marker_path: &Path) -> Result<Option<u32>, ZramError> {
        let Some(m) = read_marker(marker_path) else {
            return Ok(None);
        };
        self.remove_device(m.device)?;
        let _ = std::fs::remove_file(marker_path);
        Ok(Some(m.device))
    }

    /// `mm_stat` of the device: (original bytes stored, compressed bytes, memory used).
    pub fn mm_stat(&self, n: u32) -> Option<(u64, u64, u64)> {
        let text = std::fs::read_to_string(self.block(n).join("mm_stat")).ok()?;
        let v: Vec<u64> = text
            .split_whitespace()
            .take(3)
            .filter_map(|s| s.parse().ok())
            .collect();
        (v.len() == 3).then(|| (v[0], v[1], v[2]))
    }
}

fn run(cmd: &str, args: &[&str]) -> Result<(), ZramError> {
    let out = Command::new(cmd)
        .args(args)
        .output()
        .map_err(|e| ZramError::Command {
            cmd: cmd.to_string(),
            msg: e.to_string(),
        })?;
    if out.status.success() {
        Ok(())
    } else {
        Err(ZramError::Command {
            cmd: format!("{cmd} {}", args.join(" ")),
            msg: String::from_utf8_lossy(&out.stderr).trim().to_string(),
        })
    }
}

pub fn read_marker(path: &Path) -> Option<ZramMarker> {
    let text = std::fs::read_to_string(path).ok()?;
    serde_json::from_str(&text).ok()
}

fn write_marker(path: &Path, m: &ZramMarker) -> Result<(), ZramError> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(|e| io("create", dir, e))?;
    }
    let tmp = path.with_extension("tmp");
    let text = serde_json::to_string(m).unwrap_or_default();
    std::fs::write(&tmp, text).map_err(|e| io("write", &tmp, e))?;
    std::fs::rename(&tmp, path).map_err(|e| io("rename", path, e))
}

/// Parses `comp_algorithm`: `lzo [lz4] zstd` → (Some("lz4"), ["lzo","lz4","zstd"]).
pub fn parse_algorithms(text: &str) -> (Option<String>, Vec<String>) {
    let mut current = None;
    let mut all = Vec::new();
    for tok in text.split_whitespace() {
        if let Some(t) = tok.strip_prefix('[').and_then(|t| t.strip_suffix(']')) {
            current = Some(t.to_string());
            all.push(t.to_string());
        } else {
            all.push(tok.to_string());
        }
    }
    (current, all)
}

/// The device paths `/proc/swaps` lists.
pub fn swaps_list(text: &str) -> Vec<&str> {
    text.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn algorithms_and_swaps() {
        let (cur, all) = parse_algorithms("[lzo-rle] lzo lz4 \n");
        assert_eq!(cur.as_deref(), Some("lzo-rle"));
        assert_eq!(all, vec!["lzo-rle", "lzo", "lz4"]);
        let swaps = "Filename\tType\tSize\tUsed\tPriority\n/dev/zram3 partition 1024 0 100\n";
        assert_eq!(swaps_list(swaps), vec!["/dev/zram3"]);
        assert!(swaps_list("Filename Type\n").is_empty());
    }

    fn fixture() -> (tempfile::TempDir, ZramHost) {
        let d = tempfile::tempdir().unwrap();
        let sys = d.path().join("sys");
        std::fs::create_dir_all(sys.join("class/zram-control")).unwrap();
        std::fs::write(sys.join("class/zram-control/hot_add"), "4\n").unwrap();
        std::fs::write(sys.join("class/zram-control/hot_remove"), "").unwrap();
        std::fs::create_dir_all(sys.join("block/zram4")).unwrap();
        std::fs::write(
            sys.join("block/zram4/comp_algorithm"),
            "[lzo-rle] lzo lz4\n",
        )
        .unwrap();
        std::fs::write(sys.join("block/zram4/disksize"), "0\n").unwrap();
        std::fs::write(d.path().join("swaps"), "Filename Type Size Used Priority\n").unwrap();
        let host = ZramHost {
            sys,
            dev: d.path().join("dev"),
            swaps: d.path().join("swaps"),
            run_commands: false,
        };
        (d, host)
    }

    #[test]
    fn setup_records_marker_and_teardown_removes_only_ours() {
        let (d, host) = fixture();
        let marker = d.path().join("edge/reclaim/zram.json");
        let prefs = vec!["zstd".to_string(), "lz4".to_string()];
        let dev = host.setup(&marker, 64, &prefs, 100).unwrap();
        assert_eq!(dev.marker.device, 4);
        assert_eq!(dev.marker.algorithm, "lz4");
        assert!(!dev.reused);
        let blk = host.sys.join("block/zram4");
        assert_eq!(
            std::fs::read_to_string(blk.join("comp_algorithm")).unwrap(),
            "lz4"
        );
        assert_eq!(
            std::fs::read_to_string(blk.join("disksize")).unwrap(),
            (64u64 << 20).to_string()
        );
        assert_eq!(read_marker(&marker).unwrap().device, 4);
        // A restart finds the device swapped on: re-used, no second hot_add.
        std::fs::write(
            &host.swaps,
            "Filename Type Size Used Priority\n/dev/zram4 partition 65532 0 100\n",
        )
        .unwrap();
        std::fs::write(host.sys.join("class/zram-control/hot_add"), "5\n").unwrap();
        let again = host.setup(&marker, 64, &prefs, 100).unwrap();
        assert!(again.reused);
        assert_eq!(again.marker.device, 4);
        std::fs::write(&host.swaps, "Filename Type Size Used Priority\n").unwrap();
        assert_eq!(host.teardown(&marker).unwrap(), Some(4));
        assert_eq!(
            std::fs::read_to_string(host.sys.join("class/zram-control/hot_remove")).unwrap(),
            "4"
        );
        assert!(!marker.exists());
        // Idempotent.
        assert_eq!(host.teardown(&marker).unwrap(), None);
    }

    #[test]
    fn missing_control_is_unavailable() {
        let d = tempfile::tempdir().unwrap();
        let host = ZramHost {
            sys: d.path().to_path_buf(),
            dev: d.path().to_path_buf(),
            swaps: d.path().join("swaps"),
            run_commands: false,
        };
        let err = host.setup(&d.path().join("m.json"), 1, &[], 1).unwrap_err();
        assert!(matches!(err, ZramError::Unavailable(_)), "{err}");
    }
}
