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

/// The layer files (bottom first) of an unpacked archive in `dir`.
pub fn layer_files(dir: &Path, format: ArchiveFormat) -> Result<Vec<PathBuf>, String> {
    match format {
        ArchiveFormat::Tar => Err("a plain tar has no layer list".into()),
        ArchiveFormat::DockerArchive => {
            let text = fs::read(dir.join("manifest.json"))
                .map_err(|e| format!("docker archive: read manifest.json: {e}"))?;
            let m: Vec<DockerManifestEntry> = serde_json::from_slice(&text)
                .map_err(|e| format!("docker archive: bad manifest.json: {e}"))?;
            let first = m
                .into_iter()
                .next()
                .ok_or("docker archive: manifest.json lists no image")?;
            first
                .layers
                .iter()
                .map(|l| inside(dir, l))
                .collect::<Result<Vec<_>, _>>()
        }
        ArchiveFormat::Oci => {
            let text = fs::read(dir.join("index.json"))
                .map_err(|e| format!("OCI layout: read index.json: {e}"))?;
            let idx: OciIndex = serde_json::from_slice(&text)
                .map_err(|e| format!("OCI layout: bad index.json: {e}"))?;
            let mut desc = idx
                .manifests
                .into_iter()
                .next()
                .ok_or("OCI layout: index.json lists no manifest")?;
            // Follow nested indexes (multi-platform images): take the first manifest.
            for _ in 0..4 {
                let blob = oci_blob(dir, &desc.digest)?;
                let m: OciManifest = serde_json::from_slice(
                    &fs::read(&blob)
                        .map_err(|e| format!("OCI layout: read {}: {e}", desc.digest))?,
                )
                .map_err(|e| format!("OCI layout: bad manifest {}: {e}", desc.digest))?;
                if m.layers.is_empty() && !m.manifests.is_empty() {
                    desc = m.manifests.into_iter().next().ok_or("empty index")?;
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
            Err("OCI layout: indexes nested too deeply".into())
        }
    }
}

/// `blobs/<alg>/<hex>` for a digest `sha256:<hex>`.
pub(crate) fn oci_blob(dir: &Path, digest: &str) -> Result<PathBuf, String> {
    let (alg, hex) = digest
        .split_once(':')
        .ok_or_else(|| format!("bad digest {digest:?}"))?;
    if alg != "sha256" || !crate::name::is_digest(hex) {
        return Err(format!("unsupported digest {digest:?} (sha256 only)"));
    }
    Ok(dir.join("blobs").join(alg).join(hex))
}

/// Checks that the file's sha256 is `digest` (`sha256:<hex>`).
pub(crate) fn verify_sha256(p: &Path, digest: &str) -> Result<(), String> {
    let mut f = fs::File::open(p).map_err(|e| format!("open blob {digest}: {e}"))?;
    let mut h = Sha256::new();
    io::copy(&mut f, &mut h).map_err(|e| format!("read blob {digest}: {e}"))?;
    let got = format!("sha256:{}", hex::encode(h.finalize()));
    if got != digest {
        return Err(format!("blob {digest} is corrupt (its sha256 is {got})"));
    }
    Ok(())
}

/// `dir/rel`, refusing paths that leave `dir`.
fn inside(dir: &Path, rel: &str) -> Result<PathBuf, String> {
    let p = Path::new(rel);
    if p.is_absolute()
        || p.components()
            .any(|c| !matches!(c, std::path::Component::Normal(_)))
    {
        return Err(format!("layer path {rel:?} leaves the archive"));
    }
    Ok(dir.join(p))
}

/// Unpacks an archive's outer tar (no whiteout handling: these are the archive's own files).
pub fn unpack_outer<R: io::Read>(reader: R, dir: &Path) -> Result<(), String> {
    let mut ar = tar::Archive::new(reader);
    for entry in ar
        .entries()
        .map_err(|e| format!("not a tar archive: {e}"))?
    {
        let mut e = entry.map_err(|e| format!("corrupt archive: {e}"))?;
        let kind = e.header().entry_type();
        if !(kind.is_file() || kind.is_dir()) {
            continue;
        }
        if !e
            .unpack_in(dir)
            .map_err(|err| format!("unpack archive entry: {err}"))?
        {
            return Err("archive entry escapes the archive".into());
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
