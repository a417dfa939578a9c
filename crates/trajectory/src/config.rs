//! `[edge.trajectory]` configuration.

use serde::{Deserialize, Serialize};

use crate::log::FsyncPolicy;

/// `[edge.trajectory]` configuration.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TrajectoryConfig {
    /// Log sandboxes by default (a create may still say `trajectory: false`).
    pub enabled: bool,
    /// `batch` (default: group commit every `fsync_interval_ms`), `always` (fdatasync before
    /// answering) or `never`. Records are written before a call is answered under every
    /// policy, so an edge crash loses nothing; the policy decides what a machine crash may lose
    /// (and a machine crash also ends every sandbox, so fast-forward never depends on it).
    pub fsync: FsyncPolicy,
    pub fsync_interval_ms: u64,
    /// How long a log is kept after its sandbox ended, in hours (default 7 days).
    pub retention_hours: u64,
    /// Outputs up to this size are kept in the record; larger ones by digest.
    pub inline_output_bytes: usize,
    /// Largest file content a stepped `read_file` records (larger reads are not fast-forwarded).
    pub max_recorded_read_bytes: u64,
}

impl Default for TrajectoryConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            fsync: FsyncPolicy::Batch,
            fsync_interval_ms: 10,
            retention_hours: 7 * 24,
            inline_output_bytes: 4096,
            max_recorded_read_bytes: 64 * 1024 * 1024,
        }
    }
}

impl TrajectoryConfig {
    /// Checks the values; `Err((key, message))` names the bad key.
    pub fn validate(&self) -> Result<(), (&'static str, String)> {
        if self.fsync == FsyncPolicy::Batch && !(1..=60_000).contains(&self.fsync_interval_ms) {
            return Err((
                "trajectory.fsync_interval_ms",
                "must be between 1 and 60000 with fsync = \"batch\"".into(),
            ));
        }
        if self.retention_hours == 0 {
            return Err(("trajectory.retention_hours", "must be at least 1".into()));
        }
        if self.inline_output_bytes > 1024 * 1024 {
            return Err((
                "trajectory.inline_output_bytes",
                "must be at most 1 MiB".into(),
            ));
        }
        Ok(())
    }
}
