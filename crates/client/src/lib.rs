//! Rust client for the dsec HTTP API (`/v1`, see `dsec_wire::api`).
//!
//! Owns the HTTP calls and their error mapping. It must not hold business rules (validation
//! lives in the servers, which answer 4xx) and must not depend on any server crate.
//!
//! ```ignore
//! let c = dsec_client::Client::from_env()?;
//! let sb = c.create(&CreateSandboxRequest { image: "busybox".into(), ..Default::default() }).await?;
//! let r = c.run_shell(&sb.id, &RunShellRequest { cmd: "echo hi".into(), ..Default::default() }).await?;
//! c.stop(&sb.id).await?;
//! ```
//!
//! Every call of the HTTP API the CLI makes goes through this crate: sandboxes, commands,
//! files, images, nodes, trajectory, TTY, function calls ([`functions`]) and the admin routes
//! ([`admin`]). `https://` URLs use rustls with the system's root certificates.

pub mod admin;
pub mod functions;
pub mod membership;
pub mod processes;

mod ports;
mod queue;

mod volumes;

use std::path::Path;
use std::pin::Pin;

use bytes::Bytes;
use dsec_wire::api::{
    CommandResult, CreateSandboxRequest, EndReason, ErrorBody, ExecRequest, FileInfo, FileList,
    ImageInfo, ImageList, ListSandboxesQuery, NodeList, RunShellRequest, SandboxInfo, SandboxList,
    StreamEvent,
};
use futures::{Stream, StreamExt, TryStreamExt};
use reqwest::{Method, RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;
use tokio::io::{AsyncRead, AsyncWrite, AsyncWriteExt};
use url::Url;

pub use tokio_tungstenite;

/// Environment variable holding the API URL.
pub const ENV_URL: &str = "DSEC_API_URL";
/// Environment variable holding the API key.
pub const ENV_KEY: &str = "DSEC_API_KEY";

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The API answered with an [`ErrorBody`] (or a non-JSON error).
    #[error("{message} ({code}, HTTP {status})")]
    Api {
        status: u16,
        code: String,
        message: String,
    },
    /// The request did not complete (connection refused, reset, TLS, ...).
    #[error("request to {url} failed: {message}")]
    Transport { url: String, message: String },
    /// The answer could not be decoded.
    #[error("decode answer: {0}")]
    Decode(String),
    /// Local file or stream I/O.
    #[error("{context}: {source}")]
    Io {
        context: String,
        source: std::io::Error,
    },
    /// Bad configuration (URL, key).
    #[error("{0}")]
    Config(String),
    /// A call reached a sandbox that has ended (410 `sandbox_dead`); `reason` says why, so a
    /// trainer can tell infrastructure failures ([`EndReason::is_infrastructure`]) from the
    /// agent's. [`ClientError::code`] is `sandbox_dead`, as for the plain API error.
    #[error("sandbox {id} ended ({reason}): {detail}")]
    SandboxEnded {
        id: String,
        reason: EndReason,
        detail: String,
    },
}

impl ClientError {
    /// The API error code, when the API answered with one.
    pub fn code(&self) -> Option<&str> {
        match self {
            ClientError::Api { code, .. } => Some(code),
            ClientError::SandboxEnded { .. } => Some(dsec_wire::api::codes::SANDBOX_DEAD),
            _ => None,
        }
    }
}

pub type Result<T> = std::result::Result<T, ClientError>;

/// A stream of events of a streamed command.
pub type EventStream = Pin<Box<dyn Stream<Item = Result<StreamEvent>> + Send>>;

/// The TTY WebSocket.
pub type TtySocket =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// How the HTTP client is built.
#[derive(Clone, Debug, Default)]
pub struct ClientOptions {
    /// Ignore `HTTP(S)_PROXY` variables (load generators talk to the apiserver directly).
    pub no_proxy: bool,
}

/// A client of one apiserver.
#[derive(Clone, Debug)]
pub struct Client {
    base: Url,
    key: String,
    http: reqwest::Client,
}

fn transport(url: &Url, e: reqwest::Error) -> ClientError {
    let mut message = e.to_string();
    let mut cur = std::error::Error::source(&e);
    while let Some(c) = cur {
        let t = c.to_string();
        if !message.contains(&t) {
            message.push_str(": ");
            message.push_str(&t);
        }
        cur = c.source();
    }
    ClientError::Transport {
        url: url.to_string(),
        message,
    }
}

/// The sandbox id of a `/v1/sandboxes/{id}/...` URL.
fn sandbox_of(url: &Url) -> Option<String> {
    let mut seg = url.path_segments()?;
    while let Some(s) = seg.next() {
        if s == "sandboxes" {
            return seg
                .next()
                .filter(|id| dsec_wire::id::is_valid_sandbox_id(id))
                .map(str::to_string);
        }
    }
    None
}

/// Turns a non-success answer into `ClientError::Api`.
async fn check(resp: Response) -> Result<Response> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let text = resp.text().await.unwrap_or_default();
    Err(match serde_json::from_str::<ErrorBody>(&text) {
        Ok(b) => ClientError::Api {
            status: status.as_u16(),
            code: b.error.code,
            message: b.error.message,
        },
        Err(_) => ClientError::Api {
            status: status.as_u16(),
            code: if status == StatusCode::NOT_FOUND {
                "not_found".into()
            } else {
                "internal".into()
            },
            message: if text.trim().is_empty() {
                format!("HTTP {status}")
            } else {
                text.trim().to_string()
            },
        },
    })
}

async fn json<T: DeserializeOwned>(resp: Response) -> Result<T> {
    let resp = check(resp).await?;
    let bytes = resp
        .bytes()
        .await
        .map_err(|e| ClientError::Decode(e.to_string()))?;
    serde_json::from_slice(&bytes).map_err(|e| ClientError::Decode(e.to_string()))
}

/// Splits a byte stream into NDJSON [`StreamEvent`]s.
pub fn ndjson_events<S, E>(bytes: S) -> EventStream
where
    S: Stream<Item = std::result::Result<Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let bytes = bytes.map_err(|e| ClientError::Decode(format!("read stream: {e}")));
    let s = futures::stream::unfold(
        (Box::pin(bytes), Vec::<u8>::new(), false),
        |(mut src, mut buf, done)| async move {
            loop {
                if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=pos).collect();
                    let line = &line[..line.len() - 1];
                    if line.iter().all(|b| b.is_ascii_whitespace()) {
                        continue;
                    }
                    let ev = serde_json::from_slice::<StreamEvent>(line)
                        .map_err(|e| ClientError::Decode(format!("stream event: {e}")));
                    return Some((ev, (src, buf, done)));
                }
                if done {
                    if buf.iter().all(|b| b.is_ascii_whitespace()) {
                        return None;
                    }
                    let rest = std::mem::take(&mut buf);
                    let ev = serde_json::from_slice::<StreamEvent>(&rest)
                        .map_err(|e| ClientError::Decode(format!("stream event: {e}")));
                    return Some((ev, (src, buf, true)));
                }
                match src.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => return Some((Err(e), (src, buf, true))),
                    None => {
                        return if buf.is_empty() {
                            None
                        } else {
                            let rest = std::mem::take(&mut buf);
                            let ev = serde_json::from_slice::<StreamEvent>(&rest)
                                .map_err(|e| ClientError::Decode(format!("stream event: {e}")));
                            Some((ev, (src, buf, true)))
                        }
                    }
                }
            }
        },
    );
    Box::pin(s)
}

impl Client {
    /// A client of the apiserver at `url` using API key `key`.
    pub fn new(url: &str, key: &str) -> Result<Client> {
        Client::with_options(url, key, &ClientOptions::default())
    }

    /// Like [`Client::new`], with [`ClientOptions`].
    pub fn with_options(url: &str, key: &str, opts: &ClientOptions) -> Result<Client> {
        let mut base = Url::parse(url)
            .map_err(|e| ClientError::Config(format!("invalid API URL {url:?}: {e}")))?;
        if !matches!(base.scheme(), "http" | "https") {
            return Err(ClientError::Config(format!(
                "invalid API URL {url:?}: use http:// or https://"
            )));
        }
        if !base.path().ends_with('/') {
            let p = format!("{}/", base.path());
            base.set_path(&p);
        }
        let mut b = reqwest::Client::builder().tcp_nodelay(true);
        if opts.no_proxy {
            b = b.no_proxy();
        }
        let http = b
            .build()
            .map_err(|e| ClientError::Config(format!("build HTTP client: {e}")))?;
        Ok(Client {
            base,
            key: key.to_string(),
            http,
        })
    }

    /// A client from `DSEC_API_URL` and `DSEC_API_KEY`.
    pub fn from_env() -> Result<Client> {
        let url = std::env::var(ENV_URL)
            .map_err(|_| ClientError::Config(format!("{ENV_URL} is not set")))?;
        let key = std::env::var(ENV_KEY)
            .map_err(|_| ClientError::Config(format!("{ENV_KEY} is not set")))?;
        Client::new(&url, &key)
    }

    pub fn base_url(&self) -> &Url {
        &self.base
    }

    /// `base` + path segments (each percent-encoded, so `/` inside a segment is kept).
    fn url(&self, segments: &[&str]) -> Result<Url> {
        let mut u = self.base.clone();
        {
            let mut s = u
                .path_segments_mut()
                .map_err(|_| ClientError::Config("API URL cannot be a base".into()))?;
            s.pop_if_empty();
            s.extend(segments);
        }
        Ok(u)
    }

    fn sandbox_url(&self, id: &str, rest: &[&str]) -> Result<Url> {
        let mut seg = vec!["v1", "sandboxes", id];
        seg.extend_from_slice(rest);
        self.url(&seg)
    }

    fn request(&self, method: Method, url: Url) -> (RequestBuilder, Url) {
        (
            self.http
                .request(method, url.clone())
                .bearer_auth(&self.key),
            url,
        )
    }

    async fn send(&self, (req, url): (RequestBuilder, Url)) -> Result<Response> {
        let resp = req.send().await.map_err(|e| transport(&url, e))?;
        if resp.status() == StatusCode::GONE {
            if let Some(id) = sandbox_of(&url) {
                return Err(self.ended(&id, resp).await);
            }
        }
        Ok(resp)
    }

    /// The error for a 410 answer of a call to sandbox `id`: [`ClientError::SandboxEnded`]
    /// with the reason its info gives, else the API error as it came.
    async fn ended(&self, id: &str, resp: Response) -> ClientError {
        let err = match check(resp).await {
            Err(e) => e,
            Ok(_) => return ClientError::Decode("410 answer without an error".into()),
        };
        if err.code() != Some(dsec_wire::api::codes::SANDBOX_DEAD) {
            return err;
        }
        let Ok(u) = self.sandbox_url(id, &[]) else {
            return err;
        };
        let got = self.http.get(u).bearer_auth(&self.key).send().await;
        let info: Option<SandboxInfo> = match got {
            Ok(r) if r.status().is_success() => r.json().await.ok(),
            _ => None,
        };
        match info.and_then(|i| i.end_reason.map(|r| (r, i.end_detail.or(i.reason)))) {
            Some((reason, detail)) => ClientError::SandboxEnded {
                id: id.to_string(),
                reason,
                detail: detail.unwrap_or_default(),
            },
            None => err,
        }
    }

    // ---- sandboxes

    pub async fn create(&self, req: &CreateSandboxRequest) -> Result<SandboxInfo> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "sandboxes"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    pub async fn get(&self, id: &str) -> Result<SandboxInfo> {
        json(
            self.send(self.request(Method::GET, self.sandbox_url(id, &[])?))
                .await?,
        )
        .await
    }

    pub async fn list(&self) -> Result<SandboxList> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "sandboxes"])?))
                .await?,
        )
        .await
    }

    /// The list with ended sandboxes too (`ended`), or only those ended for `end_reason`.
    pub async fn list_with(&self, q: &ListSandboxesQuery) -> Result<SandboxList> {
        let mut u = self.url(&["v1", "sandboxes"])?;
        {
            let mut p = u.query_pairs_mut();
            if let Some(e) = q.ended {
                p.append_pair("ended", if e { "true" } else { "false" });
            }
            if let Some(r) = q.end_reason {
                p.append_pair("end_reason", r.as_str());
            }
        }
        json(self.send(self.request(Method::GET, u)).await?).await
    }

    /// Snapshots a container's files into an image (the answer's `id`, which a create names
    /// as its image); the sandbox goes on.
    pub async fn snapshot(
        &self,
        id: &str,
        req: &dsec_wire::api::SnapshotRequest,
    ) -> Result<dsec_wire::api::SnapshotInfo> {
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["snapshot"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// Forks a sandbox into `req.n` new ones from one snapshot. A partial failure is an `Ok`
    /// whose `failed` is not empty (those in `children` exist).
    pub async fn fork(
        &self,
        id: &str,
        req: &dsec_wire::api::ForkRequest,
    ) -> Result<dsec_wire::api::ForkResult> {
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["fork"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// Pauses a sandbox (freeze + memory reclaim); any later request resumes it.
    pub async fn pause(&self, id: &str) -> Result<SandboxInfo> {
        json(
            self.send(self.request(Method::POST, self.sandbox_url(id, &["pause"])?))
                .await?,
        )
        .await
    }

    pub async fn resume(&self, id: &str) -> Result<SandboxInfo> {
        json(
            self.send(self.request(Method::POST, self.sandbox_url(id, &["resume"])?))
                .await?,
        )
        .await
    }

    /// `op` (`pause`, `resume`, `stop`) on every sandbox whose labels include `labels`.
    pub async fn job_op(
        &self,
        op: &str,
        labels: &std::collections::BTreeMap<String, String>,
    ) -> Result<dsec_wire::api::JobOpResult> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "jobs", op])?);
        let body = dsec_wire::api::LabelSelector {
            labels: labels.clone(),
        };
        json(self.send((b.json(&body), u)).await?).await
    }

    pub async fn stop(&self, id: &str) -> Result<SandboxInfo> {
        json(
            self.send(self.request(Method::DELETE, self.sandbox_url(id, &[])?))
                .await?,
        )
        .await
    }

    // ---- commands

    /// Runs `req.cmd` in a persistent shell session and waits for the result.
    pub async fn run_shell(&self, id: &str, req: &RunShellRequest) -> Result<CommandResult> {
        let mut req = req.clone();
        req.stream = false;
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["shell"])?);
        json(self.send((b.json(&req), u)).await?).await
    }

    /// Like [`Client::run_shell`] but streams output events as they arrive.
    pub async fn run_shell_stream(&self, id: &str, req: &RunShellRequest) -> Result<EventStream> {
        let mut req = req.clone();
        req.stream = true;
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["shell"])?);
        let resp = check(self.send((b.json(&req), u)).await?).await?;
        Ok(ndjson_events(resp.bytes_stream()))
    }

    /// Runs an argv directly (no shell) and waits for the result.
    pub async fn exec(&self, id: &str, req: &ExecRequest) -> Result<CommandResult> {
        let mut req = req.clone();
        req.stream = false;
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["exec"])?);
        json(self.send((b.json(&req), u)).await?).await
    }

    /// Like [`Client::exec`] but streams output events as they arrive. Dropping the stream
    /// closes the connection, which cancels the command.
    pub async fn exec_stream(&self, id: &str, req: &ExecRequest) -> Result<EventStream> {
        let mut req = req.clone();
        req.stream = true;
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["exec"])?);
        let resp = check(self.send((b.json(&req), u)).await?).await?;
        Ok(ndjson_events(resp.bytes_stream()))
    }

    /// Ends a shell session.
    pub async fn close_session(&self, id: &str, session: &str) -> Result<()> {
        check(
            self.send(self.request(
                Method::DELETE,
                self.sandbox_url(id, &["sessions", session])?,
            ))
            .await?,
        )
        .await?;
        Ok(())
    }

    // ---- files

    fn files_url(&self, id: &str, rest: &[&str], query: &[(&str, String)]) -> Result<Url> {
        let mut seg = vec!["files"];
        seg.extend_from_slice(rest);
        let mut u = self.sandbox_url(id, &seg)?;
        {
            let mut q = u.query_pairs_mut();
            for (k, v) in query {
                q.append_pair(k, v);
            }
        }
        Ok(u)
    }

    /// Writes a file from a stream; `len` (when known) is sent as `content-length`.
    pub async fn write_file<R>(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        reader: R,
        len: Option<u64>,
    ) -> Result<FileInfo>
    where
        R: AsyncRead + Send + 'static,
    {
        let mut q = vec![("path", path.to_string())];
        if let Some(m) = mode {
            q.push(("mode", format!("{:04o}", m & 0o7777)));
        }
        let (mut b, u) = self.request(Method::PUT, self.files_url(id, &[], &q)?);
        b = b.header(reqwest::header::CONTENT_TYPE, "application/octet-stream");
        if let Some(len) = len {
            b = b.header(reqwest::header::CONTENT_LENGTH, len);
        }
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
            reader,
            256 * 1024,
        ));
        json(self.send((b.body(body), u)).await?).await
    }

    /// Writes a local file into the sandbox (mode defaults to the local file's).
    pub async fn write_file_from_path(
        &self,
        id: &str,
        path: &str,
        local: &Path,
        mode: Option<u32>,
    ) -> Result<FileInfo> {
        let io = |source| ClientError::Io {
            context: format!("open {}", local.display()),
            source,
        };
        let f = tokio::fs::File::open(local).await.map_err(io)?;
        let meta = f.metadata().await.map_err(io)?;
        use std::os::unix::fs::PermissionsExt;
        let mode = mode.unwrap_or(meta.permissions().mode() & 0o7777);
        self.write_file(id, path, Some(mode), f, Some(meta.len()))
            .await
    }

    /// Starts a download; returns the answer (checked) and the file's mode (`x-dsec-mode`).
    async fn open_file(&self, id: &str, path: &str) -> Result<(Response, Option<u32>, Url)> {
        let url = self.files_url(id, &[], &[("path", path.to_string())])?;
        let resp = check(self.send(self.request(Method::GET, url.clone())).await?).await?;
        let mode = resp
            .headers()
            .get("x-dsec-mode")
            .and_then(|v| v.to_str().ok())
            .and_then(parse_mode);
        Ok((resp, mode, url))
    }

    async fn copy_body<W>(resp: Response, url: &Url, writer: &mut W) -> Result<u64>
    where
        W: AsyncWrite + Unpin,
    {
        let mut stream = resp.bytes_stream();
        let mut n = 0u64;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| transport(url, e))?;
            writer
                .write_all(&chunk)
                .await
                .map_err(|source| ClientError::Io {
                    context: "write downloaded data".into(),
                    source,
                })?;
            n += chunk.len() as u64;
        }
        writer.flush().await.map_err(|source| ClientError::Io {
            context: "flush downloaded data".into(),
            source,
        })?;
        Ok(n)
    }

    /// Streams a file out of the sandbox into `writer`; returns its mode (from `x-dsec-mode`)
    /// and the number of bytes written.
    pub async fn read_file<W>(
        &self,
        id: &str,
        path: &str,
        writer: &mut W,
    ) -> Result<(Option<u32>, u64)>
    where
        W: AsyncWrite + Unpin,
    {
        let (resp, mode, url) = self.open_file(id, path).await?;
        let n = Self::copy_body(resp, &url, writer).await?;
        Ok((mode, n))
    }

    /// Downloads a file into a local path, keeping its mode. The local file is created only
    /// once the sandbox has answered (a missing remote file leaves the local side untouched).
    pub async fn read_file_to_path(&self, id: &str, path: &str, local: &Path) -> Result<u64> {
        let io = |context: String| move |source| ClientError::Io { context, source };
        let (resp, mode, url) = self.open_file(id, path).await?;
        let mut f = tokio::fs::File::create(local)
            .await
            .map_err(io(format!("create {}", local.display())))?;
        let n = Self::copy_body(resp, &url, &mut f).await?;
        if let Some(mode) = mode {
            use std::os::unix::fs::PermissionsExt;
            tokio::fs::set_permissions(local, std::fs::Permissions::from_mode(mode))
                .await
                .map_err(io(format!("chmod {}", local.display())))?;
        }
        Ok(n)
    }

    /// Reads a whole (small) file into memory.
    pub async fn read_file_bytes(&self, id: &str, path: &str) -> Result<Vec<u8>> {
        let mut buf = Vec::new();
        self.read_file(id, path, &mut buf).await?;
        Ok(buf)
    }

    pub async fn list_files(&self, id: &str, path: &str) -> Result<FileList> {
        let url = self.files_url(id, &["list"], &[("path", path.to_string())])?;
        json(self.send(self.request(Method::GET, url)).await?).await
    }

    pub async fn stat(&self, id: &str, path: &str) -> Result<FileInfo> {
        let url = self.files_url(id, &["stat"], &[("path", path.to_string())])?;
        json(self.send(self.request(Method::GET, url)).await?).await
    }

    pub async fn remove(&self, id: &str, path: &str, recursive: bool) -> Result<()> {
        let url = self.files_url(
            id,
            &[],
            &[
                ("path", path.to_string()),
                ("recursive", recursive.to_string()),
            ],
        )?;
        check(self.send(self.request(Method::DELETE, url)).await?).await?;
        Ok(())
    }

    pub async fn mkdir(
        &self,
        id: &str,
        path: &str,
        mode: Option<u32>,
        parents: bool,
    ) -> Result<FileInfo> {
        let mut q = vec![("path", path.to_string()), ("parents", parents.to_string())];
        if let Some(m) = mode {
            q.push(("mode", format!("{:04o}", m & 0o7777)));
        }
        let url = self.files_url(id, &["mkdir"], &q)?;
        json(self.send(self.request(Method::POST, url)).await?).await
    }

    // ---- images

    pub async fn images(&self) -> Result<ImageList> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "images"])?))
                .await?,
        )
        .await
    }

    /// Imports an image from a tar (or tar.gz) stream.
    pub async fn import_image<R>(&self, name: &str, tar: R) -> Result<ImageInfo>
    where
        R: AsyncRead + Send + 'static,
    {
        self.import_image_as(name, "tar", tar).await
    }

    /// Imports an archive of `format`: `tar` (a root file system), `docker-archive`
    /// (`docker save` output) or `oci` (a tar of an OCI image layout).
    pub async fn import_image_as<R>(&self, name: &str, format: &str, tar: R) -> Result<ImageInfo>
    where
        R: AsyncRead + Send + 'static,
    {
        let mut url = self.url(&["v1", "images", name])?;
        if format != "tar" {
            url.query_pairs_mut().append_pair("format", format);
        }
        let (b, u) = self.request(Method::PUT, url);
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
            tar,
            256 * 1024,
        ));
        json(
            self.send((
                b.header(reqwest::header::CONTENT_TYPE, "application/x-tar")
                    .body(body),
                u,
            ))
            .await?,
        )
        .await
    }

    /// Runs an image action (registry pull, fold) and waits for the result.
    pub async fn image_action(
        &self,
        name: &str,
        req: &dsec_wire::api::ImageActionRequest,
    ) -> Result<ImageInfo> {
        let (b, u) = self.request(Method::POST, self.url(&["v1", "images", name])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// Runs an image action, calling `on_event` for each progress event; returns the image.
    pub async fn image_action_progress(
        &self,
        name: &str,
        req: &dsec_wire::api::ImageActionRequest,
        mut on_event: impl FnMut(&dsec_wire::api::ImageActionEvent) + Send,
    ) -> Result<ImageInfo> {
        use dsec_wire::api::ImageActionEvent as E;
        let (b, u) = self.request(Method::POST, self.url(&["v1", "images", name])?);
        let req = b
            .header(reqwest::header::ACCEPT, "application/x-ndjson")
            .json(req);
        let mut resp = check(self.send((req, u.clone())).await?).await?;
        let mut buf: Vec<u8> = Vec::new();
        loop {
            while let Some(nl) = buf.iter().position(|&c| c == b'\n') {
                let line: Vec<u8> = buf.drain(..=nl).collect();
                if line.iter().all(|c| c.is_ascii_whitespace()) {
                    continue;
                }
                let ev: E = serde_json::from_slice(&line)
                    .map_err(|e| ClientError::Decode(format!("image progress line: {e}")))?;
                match ev {
                    E::Done { image } => return Ok(image),
                    E::Error { error } => {
                        return Err(ClientError::Api {
                            status: dsec_wire::api::status_for_code(&error.code),
                            code: error.code,
                            message: error.message,
                        })
                    }
                    other => on_event(&other),
                }
            }
            match resp.chunk().await.map_err(|e| transport(&u, e))? {
                Some(c) => buf.extend_from_slice(&c),
                None => {
                    return Err(ClientError::Decode(
                        "the image action ended without a result".into(),
                    ))
                }
            }
        }
    }

    pub async fn remove_image(&self, name: &str) -> Result<()> {
        check(
            self.send(self.request(Method::DELETE, self.url(&["v1", "images", name])?))
                .await?,
        )
        .await?;
        Ok(())
    }

    // ---- nodes

    // ---- trajectory

    /// A sandbox's trajectory log; `query` takes `from`, `to`, `kind`, `since`, `until`, `path`.
    pub async fn trajectory(
        &self,
        id: &str,
        query: &[(&str, String)],
    ) -> Result<Vec<dsec_wire::api::TrajectoryRecord>> {
        let mut url = self.sandbox_url(id, &["trajectory"])?;
        if !query.is_empty() {
            url.query_pairs_mut()
                .extend_pairs(query.iter().map(|(k, v)| (*k, v.as_str())));
        }
        let resp = check(self.send(self.request(Method::GET, url.clone())).await?).await?;
        let text = resp.text().await.map_err(|e| transport(&url, e))?;
        text.lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                serde_json::from_str(l).map_err(|e| {
                    ClientError::Config(format!("bad trajectory line from the server: {e}"))
                })
            })
            .collect()
    }

    pub async fn last_step(&self, id: &str) -> Result<dsec_wire::api::LastStep> {
        let url = self.sandbox_url(id, &["trajectory", "last_step"])?;
        json(self.send(self.request(Method::GET, url)).await?).await
    }

    /// Content a trajectory record keeps by digest (`record.blobs`).
    pub async fn trajectory_blob(&self, id: &str, digest: &str) -> Result<Vec<u8>> {
        let url = self.sandbox_url(id, &["trajectory", "blobs", digest])?;
        let resp = check(self.send(self.request(Method::GET, url.clone())).await?).await?;
        Ok(resp.bytes().await.map_err(|e| transport(&url, e))?.to_vec())
    }

    pub async fn nodes(&self) -> Result<NodeList> {
        json(
            self.send(self.request(Method::GET, self.url(&["v1", "nodes"])?))
                .await?,
        )
        .await
    }

    // ---- tty

    /// Opens the interactive terminal WebSocket (binary frames = terminal bytes, text frames =
    /// `TtyControl`).
    pub async fn tty(
        &self,
        id: &str,
        rows: u16,
        cols: u16,
        session: Option<&str>,
    ) -> Result<TtySocket> {
        let mut u = self.sandbox_url(id, &["tty"])?;
        {
            let mut q = u.query_pairs_mut();
            q.append_pair("rows", &rows.to_string());
            q.append_pair("cols", &cols.to_string());
            if let Some(s) = session {
                q.append_pair("session", s);
            }
        }
        let scheme = if u.scheme() == "https" { "wss" } else { "ws" };
        u.set_scheme(scheme)
            .map_err(|_| ClientError::Config("cannot build WebSocket URL".into()))?;
        use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest, http::HeaderValue};
        let mut req = u
            .as_str()
            .into_client_request()
            .map_err(|e| ClientError::Config(format!("tty url {u}: {e}")))?;
        let auth = HeaderValue::from_str(&format!("Bearer {}", self.key))
            .map_err(|_| ClientError::Config("API key is not a valid header value".into()))?;
        req.headers_mut().insert("authorization", auth);
        match tokio_tungstenite::connect_async(req).await {
            Ok((ws, _)) => Ok(ws),
            Err(tungstenite::Error::Http(resp)) => {
                let status = resp.status().as_u16();
                let body = resp.body().clone().unwrap_or_default();
                Err(match serde_json::from_slice::<ErrorBody>(&body) {
                    Ok(b) => ClientError::Api {
                        status,
                        code: b.error.code,
                        message: b.error.message,
                    },
                    Err(_) => ClientError::Api {
                        status,
                        code: "internal".into(),
                        message: String::from_utf8_lossy(&body).into_owned(),
                    },
                })
            }
            Err(e) => Err(ClientError::Transport {
                url: u.to_string(),
                message: e.to_string(),
            }),
        }
    }
}

/// Parses an octal mode such as `0644` or `644`.
pub fn parse_mode(s: &str) -> Option<u32> {
    let s = s.trim();
    let s = s.strip_prefix("0o").unwrap_or(s);
    u32::from_str_radix(s, 8).ok().filter(|m| *m <= 0o7777)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_encode_segments() {
        let c = Client::new("http://127.0.0.1:7480", "dsk_x").unwrap();
        assert_eq!(
            c.url(&["v1", "images", "swe/sphinx:official"])
                .unwrap()
                .as_str(),
            "http://127.0.0.1:7480/v1/images/swe%2Fsphinx:official"
        );
        let u = c
            .files_url(
                "sb-n0-0000000000000000",
                &["stat"],
                &[("path", "/a b&c".into())],
            )
            .unwrap();
        assert_eq!(
            u.as_str(),
            "http://127.0.0.1:7480/v1/sandboxes/sb-n0-0000000000000000/files/stat?path=%2Fa+b%26c"
        );
        let c = Client::new("http://h:1/prefix", "k").unwrap();
        assert_eq!(
            c.url(&["v1", "nodes"]).unwrap().as_str(),
            "http://h:1/prefix/v1/nodes"
        );
        assert!(Client::new("h:1", "k").is_err());
    }

    #[test]
    fn modes() {
        assert_eq!(parse_mode("0644"), Some(0o644));
        assert_eq!(parse_mode("755"), Some(0o755));
        assert_eq!(parse_mode("x"), None);
        assert_eq!(parse_mode("77777"), None);
    }

    #[tokio::test]
    async fn ndjson_split_across_chunks() {
        let chunks: Vec<std::result::Result<Bytes, std::io::Error>> = vec![
            Ok(Bytes::from_static(b"{\"type\":\"stdout\",\"da")),
            Ok(Bytes::from_static(b"ta\":\"hi\\n\"}\n\n{\"type\":\"exit\",\"result\":")),
            Ok(Bytes::from_static(
                b"{\"exit_code\":3,\"stdout\":\"\",\"stderr\":\"\",\"stdout_truncated\":false,\"stderr_truncated\":false,\"timed_out\":false,\"duration_ms\":1.0}}",
            )),
        ];
        let evs: Vec<_> = ndjson_events(futures::stream::iter(chunks)).collect().await;
        assert_eq!(evs.len(), 2);
        match &evs[0] {
            Ok(StreamEvent::Stdout { data, .. }) => assert_eq!(data, "hi\n"),
            other => panic!("{other:?}"),
        }
        match &evs[1] {
            Ok(StreamEvent::Exit { result }) => assert_eq!(result.exit_code, 3),
            other => panic!("{other:?}"),
        }
    }
}
