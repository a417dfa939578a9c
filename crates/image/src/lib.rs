//! Images and their layers.
//!
//! Owns image names, the index, layer files (import, pull, fold, verify), the blob stores and
//! node-wide layer mounts. It must not know about sandboxes or substrates: callers hold an
//! [`ImageLease`] and do what they want with the mounted lowers or the layer files.
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
//!
//! On-disk layout under the store root:
//!
//! - `index.json` — image name → layers, rewritten atomically;
//! - `layers/<sha256>.erofs` — layer files;
//! - `mnt/<sha256>/` — where a layer is mounted while in use (and for a grace period after);
//! - `tmp/` — imports in progress, wiped at open.

pub mod blobstore;
mod busybox;
pub mod chunkcache;
mod fold;
mod import;
mod index;
mod mount;
mod name;
mod oci;
pub mod registry;
mod store;
mod time;

use std::path::PathBuf;

pub use blobstore::s3::{S3Config, StoreCacheStats};
pub use busybox::BUSYBOX_IMAGE;
pub use fold::clear_xattrs;
pub use import::{BuiltLayer, ImportOptions};
pub use name::canonical as canonical_name;
pub use oci::ArchiveFormat;
pub use registry::{PullOptions, PullProgress};
pub use store::{ImageLease, ImageStore, StoreStats, DEFAULT_UNMOUNT_GRACE};

#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error("image {0:?} not found; list images with `dsec image ls` or import one with `dsec image import`")]
    NotFound(String),
    #[error("invalid image name {0:?}: use [a-z0-9][a-z0-9._/-]* with an optional :tag of [A-Za-z0-9._-], at most 128 characters, no `..`")]
    InvalidName(String),
    #[error("image {name} is used by {users} sandbox(es); stop them first")]
    InUse { name: String, users: u64 },
    #[error("import {name}: {message}")]
    Import { name: String, message: String },
    #[error("mount layer {digest}: {source}")]
    Mount {
        digest: String,
        source: std::io::Error,
    },
    #[error("image store index {path} is corrupt ({message}); fix or remove it and re-import the images")]
    Corrupt { path: PathBuf, message: String },
    #[error("image store i/o: {0}")]
    Io(#[from] std::io::Error),
}
