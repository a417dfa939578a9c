//! Content-addressed store of large outputs (`<trajectories>/blobs/<sha256>`).

use std::io::Write as _;
use std::path::PathBuf;
use std::time::SystemTime;

use crate::error::TrajectoryError;
use crate::sha256_hex;

/// Content-addressed store of large outputs.
pub struct BlobStore {
    pub(crate) dir: PathBuf,
}

impl BlobStore {
    /// Blobs live in `dir` (created on first store).
    pub fn new(dir: PathBuf) -> Self {
        BlobStore { dir }
    }

    fn path(&self, digest: &str) -> Option<PathBuf> {
        (digest.len() == 64 && digest.bytes().all(|b| b.is_ascii_hexdigit()))
            .then(|| self.dir.join(digest))
    }

    /// Stores `data` (once per content) and answers its digest.
    pub fn put(&self, data: &[u8], sync: bool) -> std::io::Result<String> {
        let digest = sha256_hex(data);
        let path = self.dir.join(&digest);
        if path.exists() {
            // Refresh the retention clock of shared content.
            let _ = std::fs::File::options()
                .append(true)
                .open(&path)
                .and_then(|f| f.set_modified(SystemTime::now()));
            return Ok(digest);
        }
        std::fs::create_dir_all(&self.dir)?;
        let tmp = self
            .dir
            .join(format!(".{digest}.{}", rand::random::<u32>()));
        let mut f = std::fs::File::create(&tmp)?;
        f.write_all(data)?;
        if sync {
            f.sync_data()?;
        }
        std::fs::rename(&tmp, &path)?;
        Ok(digest)
    }

    /// The content stored as `digest`, checked against it.
    pub fn get(&self, digest: &str) -> Result<Vec<u8>, TrajectoryError> {
        let path = self
            .path(digest)
            .ok_or_else(|| TrajectoryError::BadDigest(digest.to_string()))?;
        let data = std::fs::read(&path)
            .map_err(|e| TrajectoryError::io(format!("read trajectory blob {digest}"), e))?;
        if sha256_hex(&data) != digest {
            return Err(TrajectoryError::DamagedBlob(digest.to_string()));
        }
        Ok(data)
    }
}
