//! Questions asked of a log: records passing a filter, provenance of a path, a blob it keeps.

use std::path::Path;

use dsec_wire::api::TrajectoryRecord;

use crate::error::{CallError, TrajectoryError};
use crate::lock;
use crate::reader;
use crate::store::Trajectories;

/// The inode change time (Unix ns) of `path` in a sandbox's writable layer, refusing `..` and
/// symlinks on the way (the agent controls that tree).
pub fn changed_ns_in_upper(upper: &Path, path: &str) -> Option<i128> {
    use std::os::unix::fs::MetadataExt as _;
    let comps: Vec<&str> = path
        .split('/')
        .filter(|c| !c.is_empty() && *c != ".")
        .collect();
    let mut p = upper.to_path_buf();
    let mut m = std::fs::symlink_metadata(&p).ok()?;
    for (i, comp) in comps.iter().enumerate() {
        if *comp == ".." {
            return None;
        }
        p.push(comp);
        m = std::fs::symlink_metadata(&p).ok()?;
        // An intermediate symlink may point anywhere on the host: stop there.
        if m.file_type().is_symlink() && i + 1 < comps.len() {
            return None;
        }
    }
    Some(m.ctime() as i128 * 1_000_000_000 + m.ctime_nsec() as i128)
}

impl<E: CallError> Trajectories<E> {
    /// Records of `id` passing `f`; with `f.path`, the calls that last wrote that path.
    pub fn query(
        &self,
        id: &str,
        f: &reader::Filter,
        sandboxes_dir: &Path,
    ) -> Result<Vec<TrajectoryRecord>, TrajectoryError> {
        let all = self.read(id)?;
        let picked: Vec<TrajectoryRecord> = match &f.path {
            Some(path) => {
                if !path.starts_with('/') {
                    return Err(TrajectoryError::RelativePath(path.clone()));
                }
                let live = lock(&self.logs).contains_key(id);
                let upper = sandboxes_dir.join(id).join("upper");
                let changed = live.then(|| changed_ns_in_upper(&upper, path)).flatten();
                reader::provenance(&all, path, changed)
            }
            None => all,
        };
        Ok(picked.into_iter().filter(|r| f.matches(r)).collect())
    }

    /// A blob referenced by `id`'s log.
    pub fn blob_of(&self, id: &str, digest: &str) -> Result<Vec<u8>, TrajectoryError> {
        let referenced = self
            .read(id)?
            .iter()
            .any(|r| r.blobs.values().any(|d| d == digest));
        if !referenced {
            return Err(TrajectoryError::BlobNotReferenced {
                sandbox: id.to_string(),
                digest: digest.to_string(),
            });
        }
        self.blobs.get(digest)
    }
}
