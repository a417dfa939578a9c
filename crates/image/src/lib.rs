//! Images and their layers.
//!
//! An image is an ordered list of layers (bottom first); a layer is an EROFS image file named
//! by its content digest. Layers are mounted once per node (read-only, file-backed EROFS) and
//! shared by every sandbox using them, with a reference count.
//!
//! Interface used by the edge:
//!
//! ```ignore
//! let store = ImageStore::open(data_dir.join("images"))?;   // index + layer files + mounts
//! store.cleanup_stale_mounts()?;                               // after a crash, before use
//! store.ensure_busybox().await?;                               // built-in image, no network
//! let info = store.import_tar("debian", reader).await?;       // tar or tar.gz stream
//! let info = store.import_dir("mine:v1", Path::new("/some/rootfs")).await?;
//! let lease = store.acquire("debian").await?;                 // mounts layers if needed
//! let lowers: Vec<PathBuf> = lease.lowers();                    // top-most first
//! drop(lease);                                                  // releases the references
//! store.list(); store.remove("mine:v1")?;                     // refuses while in use
//! store.unmount_all()?;                                        // at shutdown
//! ```

use std::path::{Path, PathBuf};

use dsec_wire::api::ImageInfo;

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {0:?} not found; list images with `dsec image ls` or import one with `dsec image import`")]
    NotFound(String),
    #[error("invalid image name {0:?}: use [a-z0-9._/-]+ with an optional :tag")]
    InvalidName(String),
    #[error("image {name} is used by {users} sandbox(es); stop them first")]
    InUse { name: String, users: u64 },
    #[error("import {name}: {message}")]
    Import { name: String, message: String },
    #[error("mount layer {digest}: {source}")]
    Mount { digest: String, source: std::io::Error },
    #[error("image store i/o: {0}")]
    Io(#[from] std::io::Error),
}

/// The node's image store.
pub struct ImageStore {
    _root: PathBuf,
}

/// A hold on an image's mounted layers; dropping it releases the references.
pub struct ImageLease {
    _private: (),
}

impl ImageLease {
    /// Mounted layer roots, top-most first (overlay `lowerdir` order).
    pub fn lowers(&self) -> Vec<PathBuf> {
        todo!()
    }
    /// The image's `name:tag`.
    pub fn image(&self) -> &str {
        todo!()
    }
}

impl ImageStore {
    pub fn open(_root: impl Into<PathBuf>) -> Result<Self, ImageError> {
        todo!()
    }
    pub fn cleanup_stale_mounts(&self) -> Result<(), ImageError> {
        todo!()
    }
    pub async fn ensure_busybox(&self) -> Result<(), ImageError> {
        todo!()
    }
    pub async fn import_tar<R>(&self, _name: &str, _reader: R) -> Result<ImageInfo, ImageError>
    where
        R: tokio::io::AsyncRead + Send + Unpin + 'static,
    {
        todo!()
    }
    pub async fn import_dir(&self, _name: &str, _dir: &Path) -> Result<ImageInfo, ImageError> {
        todo!()
    }
    pub fn get(&self, _name: &str) -> Result<ImageInfo, ImageError> {
        todo!()
    }
    pub fn list(&self) -> Vec<ImageInfo> {
        todo!()
    }
    pub fn remove(&self, _name: &str) -> Result<(), ImageError> {
        todo!()
    }
    pub async fn acquire(&self, _name: &str) -> Result<ImageLease, ImageError> {
        todo!()
    }
    pub fn unmount_all(&self) -> Result<(), ImageError> {
        todo!()
    }
}
