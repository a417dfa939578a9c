//! `[apiserver.e2b]`: the shape of sandboxes created through the E2B API.
//!
//! E2B's create has no CPU or memory fields (an E2B template carries them), so these give every
//! E2B sandbox its size; unset, the edges' defaults apply as for a native create that names
//! none.

use serde::{Deserialize, Serialize};

/// Typed `[apiserver.e2b]` table.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct E2bConfig {
    /// CPU limit of an E2B sandbox, cores (fractional allowed).
    pub cpu_cores: Option<f64>,
    /// Memory limit of an E2B sandbox, MiB.
    pub memory_mb: Option<u64>,
}

impl E2bConfig {
    /// The key of the first bad value and why.
    pub fn invalid(&self) -> Option<(&'static str, String)> {
        if let Some(c) = self.cpu_cores {
            if !(c.is_finite() && c > 0.0) {
                return Some((
                    "e2b.cpu_cores",
                    format!("{c} must be a number of cores > 0"),
                ));
            }
        }
        if self.memory_mb == Some(0) {
            return Some(("e2b.memory_mb", "must be > 0 MiB".into()));
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn validates() {
        assert!(E2bConfig::default().invalid().is_none());
        let c = E2bConfig {
            cpu_cores: Some(0.0),
            memory_mb: None,
        };
        assert_eq!(c.invalid().unwrap().0, "e2b.cpu_cores");
        let c = E2bConfig {
            cpu_cores: Some(0.5),
            memory_mb: Some(0),
        };
        assert_eq!(c.invalid().unwrap().0, "e2b.memory_mb");
    }
}
