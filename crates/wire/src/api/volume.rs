//! Named persistent volumes: an ext4 file system of a fixed size (a sparse image file on a
//! node), owned by a project, mounted read-write or read-only into sandboxes at create.
//!
//! Public routes (apiserver):
//!
//! | method | path | body | answer |
//! |---|---|---|---|
//! | POST | `/v1/volumes` | [`CreateVolumeRequest`] | 201 [`VolumeInfo`] |
//! | GET | `/v1/volumes?project=P` | | [`VolumeList`] (the caller's project, or `P`) |
//! | GET | `/v1/volumes/{name}?project=P` | | [`VolumeInfo`] |
//! | DELETE | `/v1/volumes/{name}?project=P` | | 204; 409 naming the sandboxes while it is mounted |
//!
//! A sandbox mounts volumes with [`crate::api::CreateSandboxRequest::volumes`]:
//! `{"/data": "vol1"}` or `{"/data": {"name": "vol1", "read_only": true}}`. A volume lives on
//! one node (node-local): a sandbox using it is placed there.
//!
//! The edge serves `POST /edge/v1/volumes` ([`EdgeCreateVolume`]), `GET /edge/v1/volumes`,
//! `GET|DELETE /edge/v1/volumes/{id}` with the node's own ids (`vol-` + 16 hex digits).

use serde::{Deserialize, Serialize};

/// Largest volume size in MiB (1 TiB): the image file is sparse, but the size is a promise.
pub const MAX_VOLUME_MB: u64 = 1 << 20;
/// Smallest volume size in MiB (ext4 needs a few MiB for its own metadata).
pub const MIN_VOLUME_MB: u64 = 4;

/// Body of `POST /v1/volumes`.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct CreateVolumeRequest {
    /// `[a-z0-9][a-z0-9-]{0,62}`, unique within the project.
    pub name: String,
    /// Size limit in MiB (4 ..= 1048576): writes past it fail with ENOSPC inside the sandbox.
    pub size_mb: u64,
    /// Project owning the volume (default: the caller's home project).
    #[serde(default)]
    pub project: Option<String>,
    /// Node to keep the volume on (default: chosen by the apiserver among healthy nodes).
    #[serde(default)]
    pub node: Option<String>,
}

/// One volume.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeInfo {
    /// The node's id of the volume (`vol-` + 16 hex digits).
    pub id: String,
    pub name: String,
    pub project: String,
    /// The node holding it (a sandbox mounting it runs there).
    pub node: String,
    pub size_mb: u64,
    /// RFC 3339 UTC.
    pub created_at: String,
    /// Live sandboxes that have it mounted (when the node was asked).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub used_by: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct VolumeList {
    pub volumes: Vec<VolumeInfo>,
}

/// Query of the volume routes: which project (default: the caller's home project).
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct VolumeQuery {
    #[serde(default)]
    pub project: Option<String>,
}

/// How one volume is mounted into a sandbox: a bare name (read-write) or the long form.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(untagged)]
pub enum VolumeMount {
    Name(String),
    Spec(VolumeMountSpec),
}

/// The long form of a [`VolumeMount`].
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct VolumeMountSpec {
    pub name: String,
    /// Writes inside fail with EROFS.
    #[serde(default)]
    pub read_only: bool,
}

impl VolumeMount {
    pub fn name(&self) -> &str {
        match self {
            VolumeMount::Name(n) => n,
            VolumeMount::Spec(s) => &s.name,
        }
    }

    pub fn read_only(&self) -> bool {
        matches!(self, VolumeMount::Spec(s) if s.read_only)
    }
}

/// Body of the edge's `POST /edge/v1/volumes` (the apiserver chose the id).
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
#[serde(deny_unknown_fields)]
pub struct EdgeCreateVolume {
    pub id: String,
    pub size_mb: u64,
}

/// What an edge knows about one of its volumes.
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EdgeVolumeInfo {
    pub id: String,
    pub size_mb: u64,
    /// Bytes in use on its file system (only while it is mounted on the node).
    #[serde(default)]
    pub used_bytes: Option<u64>,
    /// Live sandboxes of this node that have it mounted.
    #[serde(default)]
    pub used_by: Vec<String>,
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
#[cfg_attr(feature = "openapi", derive(utoipa::ToSchema))]
pub struct EdgeVolumeList {
    pub volumes: Vec<EdgeVolumeInfo>,
}

/// A node's volume id: `vol-` and 16 lowercase hex digits.
pub fn is_valid_volume_id(id: &str) -> bool {
    id.strip_prefix("vol-").is_some_and(|h| {
        h.len() == 16
            && h.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    })
}

/// Volume names: `[a-z0-9][a-z0-9-]{0,62}`.
pub fn is_valid_volume_name(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= 63
        && s.bytes()
            .next()
            .is_some_and(|b| b.is_ascii_lowercase() || b.is_ascii_digit())
        && s.bytes()
            .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
}

/// Checks a mount path inside the sandbox: absolute, normalised, not `/` and not under the
/// paths the platform mounts itself. The message says what to fix.
pub fn check_volume_path(p: &str) -> Result<(), String> {
    if !p.starts_with('/') || p.len() > 4096 || p.contains('\0') {
        return Err(format!("volume mount path {p:?} must be an absolute path"));
    }
    let parts: Vec<&str> = p.split('/').skip(1).collect();
    if parts
        .iter()
        .any(|c| c.is_empty() || *c == "." || *c == "..")
    {
        return Err(format!(
            "volume mount path {p:?} must be normalised (no empty, '.' or '..' components, no trailing '/')"
        ));
    }
    const RESERVED: &[&str] = &["proc", "sys", "dev"];
    if RESERVED.contains(&parts[0]) {
        return Err(format!(
            "volume mount path {p:?} is under /{}, which the sandbox's runtime mounts itself",
            parts[0]
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mounts_parse_in_both_forms() {
        let m: std::collections::BTreeMap<String, VolumeMount> =
            serde_json::from_str(r#"{"/a": "v1", "/b": {"name": "v2", "read_only": true}}"#)
                .unwrap();
        assert_eq!(m["/a"].name(), "v1");
        assert!(!m["/a"].read_only());
        assert_eq!(m["/b"].name(), "v2");
        assert!(m["/b"].read_only());
        assert!(serde_json::from_str::<VolumeMount>(r#"{"name": "v", "ro": true}"#).is_err());
    }

    #[test]
    fn ids_names_and_paths() {
        assert!(is_valid_volume_id("vol-0123456789abcdef"));
        assert!(!is_valid_volume_id("vol-0123456789ABCDEF"));
        assert!(!is_valid_volume_id("vol-../../etc/x"));
        assert!(is_valid_volume_name("data-1"));
        assert!(!is_valid_volume_name("Data"));
        assert!(!is_valid_volume_name("-x"));
        assert!(check_volume_path("/data").is_ok());
        assert!(check_volume_path("/mnt/cache").is_ok());
        for bad in ["data", "/", "/a/../b", "/a/", "/proc/x", "/dev", "/a//b"] {
            assert!(check_volume_path(bad).is_err(), "{bad}");
        }
    }
}
