//! `/edge/v1/images`: import (tar stream), list, remove, and actions (registry pull, fold).

use axum::body::Body;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use dsec_wire::api::{ImageActionEvent, ImageActionRequest, ImageInfo, ImageList};
use futures::TryStreamExt as _;

use super::{ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;

#[derive(Debug, serde::Deserialize)]
pub struct ImportQuery {
    /// `tar` (default), `docker-archive` or `oci` (a tar of an OCI image layout).
    #[serde(default)]
    format: Option<String>,
}

pub async fn import(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    ApiQuery(q): ApiQuery<ImportQuery>,
    body: Body,
) -> Result<(StatusCode, Json<ImageInfo>), EdgeError> {
    let reader =
        tokio_util::io::StreamReader::new(body.into_data_stream().map_err(std::io::Error::other));
    let format = match q.format.as_deref() {
        None => dsec_image::ArchiveFormat::Tar,
        Some(f) => dsec_image::ArchiveFormat::parse(f).ok_or_else(|| {
            EdgeError::BadRequest(format!(
                "unknown image format {f:?}: use tar, docker-archive or oci"
            ))
        })?,
    };
    let info = if format == dsec_image::ArchiveFormat::Tar {
        s.mgr.import_image(&name, reader).await?
    } else {
        s.mgr
            .image_store()
            .import_archive(&name, reader, format)
            .await
            .map_err(EdgeError::Image)?
    };
    Ok((StatusCode::CREATED, Json(info)))
}

pub async fn list(State(s): State<AppState>) -> Json<ImageList> {
    Json(s.mgr.list_images())
}

pub async fn remove(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
) -> Result<StatusCode, EdgeError> {
    s.mgr.remove_image(&name)?;
    Ok(StatusCode::NO_CONTENT)
}

/// Folds layers no larger than this by default (64 MiB).
pub const DEFAULT_FOLD_MAX_LAYER_BYTES: u64 = 64 << 20;

/// `POST /edge/v1/images/{name}`: pull from a registry, or fold layers. With
/// `accept: application/x-ndjson` the answer streams [`ImageActionEvent`] lines (progress, then
/// `done` or `error`); otherwise it is a 201 [`ImageInfo`] when the action is finished.
pub async fn action(
    State(s): State<AppState>,
    ApiPath(name): ApiPath<String>,
    headers: axum::http::HeaderMap,
    super::ApiJson(req): super::ApiJson<ImageActionRequest>,
) -> Result<axum::response::Response, EdgeError> {
    use axum::response::IntoResponse;
    let name = dsec_image::canonical_name(&name).map_err(EdgeError::Image)?;
    let streaming = headers
        .get(axum::http::header::ACCEPT)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("application/x-ndjson"));
    let store = s.mgr.image_store().clone();
    let ca_file = s.mgr.config().registry_ca_file.clone();
    if !streaming {
        let info = run_action(&store, ca_file.as_deref(), &name, req, &|_| {}).await?;
        return Ok((StatusCode::CREATED, Json(info)).into_response());
    }
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel::<ImageActionEvent>();
    tokio::spawn(async move {
        let progress_tx = tx.clone();
        let progress = move |p: dsec_image::PullProgress| {
            let _ = progress_tx.send(event_of(p));
        };
        let last = match run_action(&store, ca_file.as_deref(), &name, req, &progress).await {
            Ok(image) => ImageActionEvent::Done { image },
            Err(e) => {
                tracing::warn!(image = %name, error = %e, "image action failed");
                ImageActionEvent::Error { error: e.detail() }
            }
        };
        let _ = tx.send(last);
    });
    let lines = futures::stream::unfold(rx, |mut rx| async move {
        let ev = rx.recv().await?;
        let mut line = serde_json::to_vec(&ev).unwrap_or_default();
        line.push(b'\n');
        Some((Ok::<_, std::io::Error>(bytes::Bytes::from(line)), rx))
    });
    Ok((
        StatusCode::OK,
        [(axum::http::header::CONTENT_TYPE, "application/x-ndjson")],
        Body::from_stream(lines),
    )
        .into_response())
}

async fn run_action(
    store: &dsec_image::ImageStore,
    ca_file: Option<&std::path::Path>,
    name: &str,
    req: ImageActionRequest,
    progress: &dsec_image::registry::ProgressFn,
) -> Result<ImageInfo, EdgeError> {
    match req {
        ImageActionRequest::Pull {
            reference,
            insecure,
            username,
            password,
            ca_pem,
        } => {
            let mut pems = Vec::new();
            if let Some(f) = ca_file {
                // Checked at start-up; read again so a rotated CA file needs no restart.
                let pem = tokio::fs::read_to_string(f).await.map_err(|e| {
                    EdgeError::internal(
                        "read registry_ca_file",
                        &std::io::Error::new(e.kind(), format!("{}: {e}", f.display())),
                    )
                })?;
                pems.push(pem);
            }
            pems.extend(ca_pem);
            let opts = dsec_image::PullOptions {
                insecure,
                username,
                password,
                ca_pem: pems,
            };
            store
                .pull(name, &reference, &opts, progress)
                .await
                .map_err(EdgeError::Image)
        }
        ImageActionRequest::Alias { target } => {
            store.alias(name, &target).await.map_err(EdgeError::Image)
        }
        ImageActionRequest::Fold {
            max_layer_bytes,
            into,
        } => {
            let max = max_layer_bytes.unwrap_or(DEFAULT_FOLD_MAX_LAYER_BYTES);
            store
                .fold(name, max, into.as_deref())
                .await
                .map_err(EdgeError::Image)
        }
    }
}

fn event_of(p: dsec_image::PullProgress) -> ImageActionEvent {
    use dsec_image::PullProgress as P;
    match p {
        P::Manifest {
            digest,
            layers,
            bytes,
        } => ImageActionEvent::Manifest {
            digest,
            layers: layers as u64,
            bytes,
        },
        P::Download {
            layer,
            digest,
            done,
            total,
        } => ImageActionEvent::Download {
            layer: layer as u64,
            digest,
            done,
            total,
        },
        P::Build { layer } => ImageActionEvent::Build {
            layer: layer as u64,
        },
    }
}

/// The image store's counters in the Prometheus text format (appended to `/metrics`).
pub fn metrics_text(st: &dsec_image::StoreStats) -> String {
    let mut out = String::new();
    for (name, kind, help, v) in [
        (
            "dsec_edge_image_layer_mounts_total",
            "counter",
            "EROFS layer mounts made by the image store",
            st.layer_mounts,
        ),
        (
            "dsec_edge_image_meta_fetches_total",
            "counter",
            "Layer metadata images copied from the blob store to local disk",
            st.meta_fetches,
        ),
        (
            "dsec_edge_image_meta_fetch_bytes_total",
            "counter",
            "Bytes of layer metadata images copied from the blob store",
            st.meta_fetch_bytes,
        ),
        (
            "dsec_edge_image_blob_verifications_total",
            "counter",
            "Data blobs checked before a first mount",
            st.blob_verifications,
        ),
        (
            "dsec_edge_image_layers_mounted",
            "gauge",
            "Layers mounted right now",
            st.layers_mounted,
        ),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    }
    out
}

/// Prometheus text for the chunk cache of an object-store blob store (empty for other
/// stores).
pub fn cache_metrics_text(st: Option<dsec_image::StoreCacheStats>) -> String {
    let Some(st) = st else {
        return String::new();
    };
    let c = st.cache;
    let mut out = String::new();
    for (name, kind, help, v) in [
        ("dsec_edge_blobcache_fetched_chunks_total", "counter", "Data-blob chunks fetched from the object store", c.fetched_chunks),
        ("dsec_edge_blobcache_fetched_bytes_total", "counter", "Bytes of data-blob chunks fetched from the object store", c.fetched_bytes),
        ("dsec_edge_blobcache_hits_total", "counter", "Reads served from cached chunks only", c.hits),
        ("dsec_edge_blobcache_misses_total", "counter", "Chunk lookups that fetched or waited for a fetch", c.misses),
        ("dsec_edge_blobcache_evictions_total", "counter", "Chunks evicted to keep the cache under its bound", c.evictions),
        ("dsec_edge_blobcache_digest_mismatches_total", "counter", "Fetched chunks refused because they did not match the digest recorded at import", c.digest_mismatches),
        ("dsec_edge_blobcache_fetch_errors_total", "counter", "Failed chunk fetch attempts (timeouts, connection or HTTP errors, bad digests)", c.fetch_errors),
        ("dsec_edge_blobcache_read_errors_total", "counter", "Reads answered with EIO because a chunk stayed unavailable", c.read_errors),
        ("dsec_edge_blobcache_bytes", "gauge", "Bytes in the chunk cache", c.cached_bytes),
        ("dsec_edge_blobcache_cap_bytes", "gauge", "Bound of the chunk cache in bytes", c.cap_bytes),
        ("dsec_edge_blobstore_direct_get_bytes_total", "counter", "Bytes read from the object store outside the chunk cache (metadata images, verification samples)", st.direct_get_bytes),
    ] {
        out.push_str(&format!(
            "# HELP {name} {help}\n# TYPE {name} {kind}\n{name} {v}\n"
        ));
    }
    out
}
