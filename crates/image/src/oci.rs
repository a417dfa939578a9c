//! Multi-layer imports: `docker save` archives and OCI image layouts (as a directory or a
//! tar of one). Each image layer becomes its own EROFS layer, applied in order; OCI
//! whiteouts (`.wh.NAME`, `.wh..wh..opq`) become overlayfs whiteouts and opaque dirs.

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use sha2::{Digest, Sha256};

/// The container format of an archive given to [`crate::ImageStore::import_archive`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ArchiveFormat {
    /// A plain root-file-system tar (or tar.gz): one layer.
    Tar,
    /// `docker save` output (`manifest.json` + layer tars).
    DockerArchive,
    /// A tar of an OCI image layout (`oci-layout`, `index.json`, `blobs/sha256/...`).
    Oci,
}

impl ArchiveFormat {
    /// `tar`, `docker-archive`, `oci`.
    pub fn parse(s: &str) -> Option<Self> {
        match s {
            "tar" | "" => Some(Self::Tar),
            "docker-archive" | "docker" => Some(Self::DockerArchive),
            "oci" | "oci-archive" => Some(Self::Oci),
            _ => None,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            Self::Tar => "tar",
            Self::DockerArchive => "docker-archive",
            Self::Oci => "oci",
        }
    }
}

#[derive(Deserialize)]
struct DockerManifestEntry {
    #[serde(rename = "Layers")]
    layers: Vec<String>,
}

#[derive(Deserialize)]
struct OciIndex {
    manifests: Vec<OciDescriptor>,
}

#[derive(Deserialize)]
pub(crate) struct OciDescriptor {
    #[serde(rename = "mediaType", default)]
    pub media_type: String,
    pub digest: String,
}

#[derive(Deserialize)]
pub(crate) struct OciManifest {
    #[serde(default)]
    pub manifests: Vec<OciDescriptor>,
    #[serde(default)]
    pub layers: Vec<OciDescriptor>,
}

/// Why an image archive (docker archive, OCI layout) or one of its blobs cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum ArchiveError {
    #[error("a plain tar has no layer list")]
    NoLayerList,
    /// A file of the archive's own layout (`manifest.json`, `index.json`, a manifest blob)
    /// could not be read: `what` names the format and the file.
    #[error("{what}: read {file}: {source}")]
    Read {
        what: &'static str,
        file: String,
        source: io::Error,
    },
    #[error("{what}: bad {file}: {source}")]
    Bad {
        what: &'static str,
        file: String,
        source: serde_json::Error,
    },
    #[error("docker archive: manifest.json lists no image")]
    NoImage,
    #[error("OCI layout: index.json lists no manifest")]
    NoManifest,
    #[error("empty index")]
    EmptyIndex,
    #[error("OCI layout: indexes nested too deeply")]
    NestedTooDeeply,
    #[error("bad digest {0:?}")]
    BadDigest(String),
    #[error("unsupported digest {0:?} (sha256 only)")]
    UnsupportedDigest(String),
    #[error("open blob {digest}: {source}")]
    OpenBlob { digest: String, source: io::Error },
    #[error("read blob {digest}: {source}")]
    ReadBlob { digest: String, source: io::Error },
    #[error("blob {digest} is corrupt (its sha256 is {got})")]
    CorruptBlob { digest: String, got: String },
    #[error("layer path {0:?} leaves the archive")]
    LeavesArchive(String),
    #[error("not a tar archive: {0}")]
    NotTar(io::Error),
    #[error("corrupt archive: {0}")]
    CorruptTar(io::Error),
    #[error("unpack archive entry: {0}")]
    Unpack(io::Error),
    #[error("archive entry escapes the archive")]
    EntryEscapes,
}

const DOCKER: &str = "docker archive";
const OCI: &str = "OCI layout";

/// The layer files (bottom first) of an unpacked archive in `dir`.
pub fn layer_files(dir: &Path, format: ArchiveFormat) -> Result<Vec<PathBuf>, ArchiveError> {
    let read = |what, file: &str| {
        fs::read(dir.join(file)).map_err(|source| ArchiveError::Read {
            what,
            file: file.to_string(),
            source,
        })
    };
    let bad = |what, file: &str| {
        let file = file.to_string();
        move |source| ArchiveError::Bad { what, file, source }
    };
    match format {
        ArchiveFormat::Tar => Err(ArchiveError::NoLayerList),
        ArchiveFormat::DockerArchive => {
            let text = read(DOCKER, "manifest.json")?;
            let m: Vec<DockerManifestEntry> =
                serde_json::from_slice(&text).map_err(bad(DOCKER, "manifest.json"))?;
            let first = m.into_iter().next().ok_or(ArchiveError::NoImage)?;
            first
                .layers
                .iter()
                .map(|l| inside(dir, l))
                .collect::<Result<Vec<_>, _>>()
        }
        ArchiveFormat::Oci => {
            let text = read(OCI, "index.json")?;
            let idx: OciIndex = serde_json::from_slice(&text).map_err(bad(OCI, "index.json"))?;
            let mut desc = idx
                .manifests
                .into_iter()
                .next()
                .ok_or(ArchiveError::NoManifest)?;
            // Follow nested indexes (multi-platform images): take the first manifest.
            for _ in 0..4 {
                let blob = oci_blob(dir, &desc.digest)?;
                let m: OciManifest =
                    serde_json::from_slice(&fs::read(&blob).map_err(|source| {
                        ArchiveError::Read {
                            what: OCI,
                            file: desc.digest.clone(),
                            source,
                        }
                    })?)
                    .map_err(bad(OCI, &format!("manifest {}", desc.digest)))?;
                if m.layers.is_empty() && !m.manifests.is_empty() {
                    desc = m
                        .manifests
                        .into_iter()
                        .next()
                        .ok_or(ArchiveError::EmptyIndex)?;
                    continue;
                }
                let _ = desc.media_type;
                return m
                    .layers
                    .iter()
                    .map(|l| {
                        let p = oci_blob(dir, &l.digest)?;
                        verify_sha256(&p, &l.digest)?;
                        Ok(p)
                    })
                    .collect();
            }
            Err(ArchiveError::NestedTooDeeply)
        }
    }
}

/// `blobs/<alg>/<hex>` for a digest `sha256:<hex>`.
pub(crate) fn oci_blob(dir: &Path, digest: &str) -> Result<PathBuf, ArchiveError> {
    let (alg, hex) = digest
        .split_once(':')
        .ok_or_else(|| ArchiveError::BadDigest(digest.to_string()))?;
    if alg != "sha256" || !crate::name::is_digest(hex) {
        return Err(ArchiveError::UnsupportedDigest(digest.to_string()));
    }
    Ok(dir.join("blobs").join(alg).join(hex))
}

/// Checks that the file's sha256 is `digest` (`sha256:<hex>`).
pub(crate) fn verify_sha256(p: &Path, digest: &str) -> Result<(), ArchiveError> {
    let mut f = fs::File::open(p).map_err(|source| ArchiveError::OpenBlob {
        digest: digest.to_string(),
        source,
    })?;
    let mut h = Sha256::new();
    io::copy(&mut f, &mut h).map_err(|source| ArchiveError::ReadBlob {
        digest: digest.to_string(),
        source,
    })?;
    let got = format!("sha256:{}", hex::encode(h.finalize()));
    if got != digest {
        return Err(ArchiveError::CorruptBlob {
            digest: digest.to_string(),
            got,
        });
    }
    Ok(())
}

/// `dir/rel`, refusing paths that leave `dir`.
fn inside(dir: &Path, rel: &str) -> Result<PathBuf, ArchiveError> {
    let p = Path::new(rel);
    if p.is_absolute()
        || p.components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(ArchiveError::LeavesArchive(rel.to_string()));
    }
    Ok(dir.join(p))
}

/// Unpacks an archive's outer tar (no whiteout handling: these are the archive's own files).
pub fn unpack_outer<R: io::Read>(reader: R, dir: &Path) -> Result<(), ArchiveError> {
    let mut ar = tar::Archive::new(reader);
    for entry in ar.entries().map_err(ArchiveError::NotTar)? {
        let mut e = entry.map_err(ArchiveError::CorruptTar)?;
        let kind = e.header().entry_type();
        if !(kind.is_file() || kind.is_dir()) {
            continue;
        }
        if !e.unpack_in(dir).map_err(ArchiveError::Unpack)? {
            return Err(ArchiveError::EntryEscapes);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_and_paths() {
        assert_eq!(ArchiveFormat::parse("oci"), Some(ArchiveFormat::Oci));
        assert_eq!(
            ArchiveFormat::parse("docker-archive"),
            Some(ArchiveFormat::DockerArchive)
        );
        assert_eq!(ArchiveFormat::parse("zip"), None);
        let d = Path::new("/x");
        assert!(inside(d, "../etc").is_err());
        assert!(inside(d, "/etc").is_err());
        assert_eq!(inside(d, "a/layer.tar").unwrap(), d.join("a/layer.tar"));
        assert!(oci_blob(d, "md5:abc").is_err());
        assert!(oci_blob(d, "sha256:../../x").is_err());
    }

    #[test]
    fn docker_manifest() {
        let t = tempfile::tempdir().unwrap();
        fs::write(
            t.path().join("manifest.json"),
            r#"[{"Config":"c.json","RepoTags":["x:1"],"Layers":["a/layer.tar","b/layer.tar"]}]"#,
        )
        .unwrap();
        let l = layer_files(t.path(), ArchiveFormat::DockerArchive).unwrap();
        assert_eq!(
            l,
            vec![t.path().join("a/layer.tar"), t.path().join("b/layer.tar")]
        );
    }
}
