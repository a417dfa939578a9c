//! Files: HTTP bodies ↔ aether's chunked file requests.
//!
//! Uploads are streamed: the request body is cut into frames of at most
//! [`dsec_wire::aether::CHUNK`] bytes (`WriteBegin`, `WriteChunk`…, `WriteEnd`), so a file is
//! never held in memory whole. Downloads stream `Data` replies straight into the HTTP body.

use bytes::{Bytes, BytesMut};
use dsec_runtime::aether_client::AetherClient;
use dsec_wire::aether::{Reply, Request, CHUNK};
use dsec_wire::api::{FileInfo, FileKind, FileList};
use futures::stream::BoxStream;
use futures::{Stream, StreamExt as _};

use crate::commands::cancel_in_background;
use crate::error::{EdgeError, Subject};

/// Parses a mode given as octal text (`0644`, `644`, `0o644`).
pub fn parse_mode(text: &str) -> Result<u32, EdgeError> {
    let digits = text.strip_prefix("0o").unwrap_or(text);
    let mode = u32::from_str_radix(digits, 8)
        .ok()
        .filter(|m| *m <= 0o7777 && !digits.is_empty())
        .ok_or_else(|| {
            EdgeError::BadRequest(format!(
                "mode {text:?} must be octal permission bits like 0644"
            ))
        })?;
    Ok(mode)
}

/// Checks a path given by a client: absolute, no NUL, bounded length.
pub fn check_path(path: &str) -> Result<(), EdgeError> {
    if !path.starts_with('/') {
        return Err(EdgeError::BadRequest(format!(
            "path {path:?} must be absolute (start with /)"
        )));
    }
    if path.contains('\0') || path.len() > 4096 {
        return Err(EdgeError::BadRequest(
            "path must be at most 4096 bytes without NUL".into(),
        ));
    }
    Ok(())
}

fn unexpected(op: &str, reply: &Reply) -> EdgeError {
    EdgeError::Internal(format!("sandbox agent answered {op} with {reply:?}"))
}

/// A download: metadata for the headers and the body stream.
pub struct Download {
    pub mode: u32,
    /// Known size for `content-length` (regular files with a non-zero stat size).
    pub size: Option<u64>,
    pub body: BoxStream<'static, Result<Bytes, std::io::Error>>,
}

/// Cuts a byte stream into pieces of at most `max` bytes, coalescing small ones.
pub fn rechunk<S, E>(input: S, max: usize) -> impl Stream<Item = Result<Bytes, E>>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
{
    futures::stream::unfold(
        (input, BytesMut::new(), false),
        move |(mut input, mut buf, mut eof)| async move {
            loop {
                if buf.len() >= max {
                    let piece = buf.split_to(max).freeze();
                    return Some((Ok(piece), (input, buf, eof)));
                }
                if eof {
                    if buf.is_empty() {
                        return None;
                    }
                    let piece = buf.split().freeze();
                    return Some((Ok(piece), (input, buf, eof)));
                }
                match input.next().await {
                    Some(Ok(b)) => buf.extend_from_slice(&b),
                    Some(Err(e)) => return Some((Err(e), (input, buf, true))),
                    None => eof = true,
                }
            }
        },
    )
}

/// Streams `body` into `path` in the sandbox; answers the written file's info.
pub async fn upload<S>(
    client: &AetherClient,
    sandbox: &str,
    path: &str,
    mode: u32,
    make_parents: bool,
    body: S,
    max_bytes: u64,
) -> Result<FileInfo, EdgeError>
where
    S: Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin + 'static,
{
    check_path(path)?;
    let chan = |e| EdgeError::from_channel(sandbox, Subject::File, e);
    let req = Request::WriteBegin {
        path: path.to_string(),
        mode,
        make_parents,
    };
    let mut call = client.call(req, Bytes::new()).await.map_err(chan)?;
    let id = call.id();
    // The terminal reply may come early (an error on WriteBegin): watch for it while sending.
    let (tx, mut early) = tokio::sync::oneshot::channel();
    let watcher = tokio::spawn(async move {
        let r = loop {
            match call.next().await {
                Ok(Some((reply, _))) if reply.is_terminal() => break Ok(reply),
                Ok(Some(_)) => continue,
                Ok(None) => break Err(dsec_runtime::aether_client::ChannelError::Closed),
                Err(e) => break Err(e),
            }
        };
        let _ = tx.send(r);
    });
    let mut chunks = Box::pin(rechunk(body, CHUNK));
    let mut sent: u64 = 0;
    let cancel = |msg: EdgeError| {
        cancel_in_background(client.clone(), id);
        watcher.abort();
        msg
    };
    let finished = loop {
        tokio::select! {
            r = &mut early => break Some(r),
            next = chunks.next() => match next {
                Some(Ok(chunk)) => {
                    sent += chunk.len() as u64;
                    if sent > max_bytes {
                        return Err(cancel(EdgeError::PayloadTooLarge(format!(
                            "upload is larger than this node's limit of {max_bytes} bytes"
                        ))));
                    }
                    if let Err(e) = client.send(id, Request::WriteChunk, chunk).await {
                        return Err(cancel(chan(e)));
                    }
                }
                Some(Err(e)) => {
                    return Err(cancel(EdgeError::BadRequest(format!("reading the upload body failed: {e}"))));
                }
                None => break None,
            }
        }
    };
    let reply = match finished {
        Some(r) => r,
        None => {
            client
                .send(id, Request::WriteEnd, Bytes::new())
                .await
                .map_err(chan)?;
            early.await
        }
    };
    let reply = reply
        .map_err(|_| EdgeError::Internal("upload reply lost".into()))?
        .map_err(chan)?;
    match reply {
        Reply::Written(info) => Ok(info),
        Reply::Error(e) => Err(EdgeError::from_aether(Subject::File, e)),
        other => Err(unexpected("an upload", &other)),
    }
}

async fn single(client: &AetherClient, sandbox: &str, req: Request) -> Result<Reply, EdgeError> {
    client
        .request(req, Bytes::new())
        .await
        .map(|(reply, _)| reply)
        .map_err(|e| EdgeError::from_channel(sandbox, Subject::File, e))
}

pub async fn stat(client: &AetherClient, sandbox: &str, path: &str) -> Result<FileInfo, EdgeError> {
    check_path(path)?;
    match single(
        client,
        sandbox,
        Request::Stat {
            path: path.to_string(),
        },
    )
    .await?
    {
        Reply::Stat(info) => Ok(info),
        other => Err(unexpected("stat", &other)),
    }
}

pub async fn list(client: &AetherClient, sandbox: &str, path: &str) -> Result<FileList, EdgeError> {
    check_path(path)?;
    match single(
        client,
        sandbox,
        Request::ListDir {
            path: path.to_string(),
        },
    )
    .await?
    {
        Reply::Listed(list) => Ok(list),
        other => Err(unexpected("list", &other)),
    }
}

pub async fn remove(
    client: &AetherClient,
    sandbox: &str,
    path: &str,
    recursive: bool,
) -> Result<(), EdgeError> {
    check_path(path)?;
    if path == "/" {
        return Err(EdgeError::BadRequest("refusing to remove /".into()));
    }
    match single(
        client,
        sandbox,
        Request::Remove {
            path: path.to_string(),
            recursive,
        },
    )
    .await?
    {
        Reply::Done => Ok(()),
        other => Err(unexpected("remove", &other)),
    }
}

pub async fn mkdir(
    client: &AetherClient,
    sandbox: &str,
    path: &str,
    mode: u32,
    parents: bool,
) -> Result<FileInfo, EdgeError> {
    check_path(path)?;
    match single(
        client,
        sandbox,
        Request::Mkdir {
            path: path.to_string(),
            mode,
            parents,
        },
    )
    .await?
    {
        Reply::Stat(info) | Reply::Written(info) => Ok(info),
        Reply::Done => stat(client, sandbox, path).await,
        other => Err(unexpected("mkdir", &other)),
    }
}

/// Starts a download: stats the file, opens the read and waits for its first reply so that
/// errors (missing file, a directory) become proper HTTP answers before the body starts.
pub async fn download(
    client: &AetherClient,
    sandbox: &str,
    path: &str,
) -> Result<Download, EdgeError> {
    let info = stat(client, sandbox, path).await?;
    if info.kind == FileKind::Dir {
        return Err(EdgeError::BadRequest(format!(
            "{path} is a directory: list it with GET /files/list"
        )));
    }
    let chan = |e| EdgeError::from_channel(sandbox, Subject::File, e);
    let mut call = client
        .call(
            Request::ReadFile {
                path: path.to_string(),
            },
            Bytes::new(),
        )
        .await
        .map_err(chan)?;
    let first = call.next().await.map_err(chan)?;
    let first = match first {
        Some((Reply::Data, body)) => Some(body),
        Some((Reply::FileEnd { .. }, _)) | None => None,
        Some((Reply::Error(e), _)) => return Err(EdgeError::from_aether(Subject::File, e)),
        Some((other, _)) => return Err(unexpected("a read", &other)),
    };
    let size = (info.kind == FileKind::File && info.size > 0).then_some(info.size);
    let body = match first {
        None => futures::stream::empty().boxed(),
        Some(first) => {
            let guard = ReadGuard {
                client: client.clone(),
                target: call.id(),
                done: false,
            };
            let head = futures::stream::once(async move { Ok(first) });
            let rest = futures::stream::unfold((call, guard), |(mut call, mut guard)| async move {
                if guard.done {
                    return None;
                }
                match call.next().await {
                    Ok(Some((Reply::Data, body))) => Some((Ok(body), (call, guard))),
                    Ok(Some((Reply::FileEnd { .. }, _))) | Ok(None) => {
                        guard.disarm();
                        None
                    }
                    Ok(Some((other, _))) => {
                        guard.done = true;
                        Some((
                            Err(std::io::Error::other(format!("read failed: {other:?}"))),
                            (call, guard),
                        ))
                    }
                    Err(e) => {
                        guard.done = true;
                        Some((Err(std::io::Error::other(e.to_string())), (call, guard)))
                    }
                }
            });
            head.chain(rest).boxed()
        }
    };
    Ok(Download {
        mode: info.mode,
        size,
        body,
    })
}

/// Cancels a read whose HTTP client went away.
struct ReadGuard {
    client: AetherClient,
    target: u64,
    done: bool,
}

impl ReadGuard {
    fn disarm(&mut self) {
        self.done = true;
    }
}

impl Drop for ReadGuard {
    fn drop(&mut self) {
        if !self.done {
            cancel_in_background(self.client.clone(), self.target);
        }
    }
}

/// Renames (moves) `src` to `dst` in sandbox `sandbox`; answers the info of `dst`.
pub async fn rename(
    client: &AetherClient,
    sandbox: &str,
    src: &str,
    dst: &str,
    overwrite: bool,
) -> Result<FileInfo, EdgeError> {
    check_path(src)?;
    check_path(dst)?;
    let req = Request::Rename {
        src: src.to_string(),
        dst: dst.to_string(),
        overwrite,
    };
    match client.request(req, Bytes::new()).await {
        Ok((Reply::Stat(info), _)) => Ok(info),
        Ok((other, _)) => Err(unexpected("rename", &other)),
        Err(e) => Err(EdgeError::from_channel(sandbox, Subject::File, e)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0644").unwrap(), 0o644);
        assert_eq!(parse_mode("755").unwrap(), 0o755);
        assert_eq!(parse_mode("0o600").unwrap(), 0o600);
        assert_eq!(parse_mode("4755").unwrap(), 0o4755);
        for bad in ["", "0o", "9", "rwx", "17777", "-1"] {
            assert!(parse_mode(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn paths() {
        assert!(check_path("/etc/passwd").is_ok());
        assert!(check_path("etc").is_err());
        assert!(check_path("/a\0b").is_err());
    }

    #[tokio::test]
    async fn rechunking() {
        let input = futures::stream::iter(vec![
            Ok::<_, std::io::Error>(Bytes::from(vec![1u8; 10])),
            Ok(Bytes::from(vec![2u8; 3])),
            Ok(Bytes::from(vec![3u8; 1])),
        ]);
        let out: Vec<Bytes> = rechunk(input, 4).map(|r| r.unwrap()).collect().await;
        let sizes: Vec<usize> = out.iter().map(|b| b.len()).collect();
        assert_eq!(sizes, vec![4, 4, 4, 2]);
        let all: Vec<u8> = out.iter().flat_map(|b| b.to_vec()).collect();
        assert_eq!(all.len(), 14);
        assert_eq!(all[13], 3);
    }
}
