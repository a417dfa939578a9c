//! The edge's end of the aether protocol: multiplexed request/reply over one byte stream.
//!
//! ```ignore
//! let client = AetherClient::new(stream);                 // spawns the reader task
//! let mut call = client.call(Request::Ping, Bytes::new()).await?;
//! while let Some((reply, body)) = call.next().await? { /* the last one is terminal */ }
//! client.send(call.id(), Request::WriteChunk, body).await?;   // follow-up frames on one id
//! client.closed().await;                                  // resolves when the channel breaks
//! ```
//!
//! One reader task demultiplexes frames by request id into a bounded channel per call
//! ([`CALL_QUEUE`] frames, i.e. at most ~16 MiB of 256 KiB chunks). When a call's queue is full
//! the reader waits, which pushes back on aether through the socket; so that one stalled
//! consumer cannot freeze every other call for ever, a call whose queue stays full for
//! [`STALL_LIMIT`] is dropped (its `next()` then fails with a protocol error). Dropping a
//! [`Call`] unregisters it: later frames for its id are discarded. Frames for unknown ids
//! (e.g. the `Done` of a fire-and-forget `TtyInput`) are discarded too.
//!
//! Writes are serialized behind an async mutex, whole frames at a time.
//!
//! A `CommandDone` (or any terminal reply) whose body is larger than one frame may be preceded
//! by `Data` frames carrying the leading part of the body; [`AetherClient::request`] and
//! [`AetherClient::run`] concatenate them.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use dsec_wire::aether::{self, CommandOutcome, Envelope, Msg, Reply, Request, MAX_BODY};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::sync::{mpsc, watch};

/// Frames buffered per call before the reader waits for the consumer.
pub const CALL_QUEUE: usize = 64;
/// How long the reader waits for a call whose queue is full before dropping that call.
pub const STALL_LIMIT: Duration = Duration::from_secs(30);

/// The channel to aether broke or aether answered something that makes no sense.
#[derive(Debug, thiserror::Error)]
pub enum ChannelError {
    #[error("the channel to the sandbox's agent is closed")]
    Closed,
    #[error("protocol error on the sandbox channel: {0}")]
    Protocol(String),
    #[error("sandbox agent error: {0:?}")]
    Aether(dsec_wire::aether::AetherError),
    #[error("i/o on the sandbox channel: {0}")]
    Io(#[from] std::io::Error),
}

type Item = (Reply, Bytes);

struct Slot {
    tx: mpsc::Sender<Item>,
    /// Set when the reader gave up on this call because its consumer stalled.
    stalled: Arc<AtomicBool>,
}

struct Inner {
    writer: tokio::sync::Mutex<Box<dyn AsyncWrite + Send + Unpin>>,
    calls: Mutex<HashMap<u64, Slot>>,
    next_id: AtomicU64,
    closed: AtomicBool,
    closed_tx: watch::Sender<bool>,
    /// The unsolicited id-0 `Ready` (bare mode and VMs), and later id-0 events.
    ready_tx: watch::Sender<Option<Reply>>,
}

impl Inner {
    fn lock_calls(&self) -> std::sync::MutexGuard<'_, HashMap<u64, Slot>> {
        self.calls.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn mark_closed(&self) {
        let mut calls = self.lock_calls();
        self.closed.store(true, Ordering::SeqCst);
        // Dropping the senders ends every pending call with `Closed`.
        calls.clear();
        drop(calls);
        self.closed_tx.send_replace(true);
    }
}

/// A cloneable handle to one aether channel.
#[derive(Clone)]
pub struct AetherClient {
    inner: Arc<Inner>,
}

/// The replies of one request, in order; ends after the terminal reply.
pub struct Call {
    id: u64,
    rx: mpsc::Receiver<Item>,
    stalled: Arc<AtomicBool>,
    done: bool,
    inner: Weak<Inner>,
}

impl Call {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Next reply and its body; `Ok(None)` after the terminal reply was returned.
    pub async fn next(&mut self) -> Result<Option<(Reply, Bytes)>, ChannelError> {
        if self.done {
            return Ok(None);
        }
        match self.rx.recv().await {
            Some((reply, body)) => {
                if reply.is_terminal() {
                    self.done = true;
                }
                Ok(Some((reply, body)))
            }
            None if self.stalled.load(Ordering::SeqCst) => {
                self.done = true;
                Err(ChannelError::Protocol(format!(
                    "call {} dropped: its replies were not consumed for {STALL_LIMIT:?}",
                    self.id
                )))
            }
            None => {
                self.done = true;
                Err(ChannelError::Closed)
            }
        }
    }
}

impl Drop for Call {
    fn drop(&mut self) {
        if let Some(inner) = self.inner.upgrade() {
            inner.lock_calls().remove(&self.id);
        }
    }
}

/// The kept output of a finished command.
#[derive(Debug, Clone)]
pub struct CommandOutput {
    pub outcome: CommandOutcome,
    pub stdout: Bytes,
    pub stderr: Bytes,
}

async fn read_frame<R: AsyncRead + Unpin>(r: &mut R) -> Result<(Envelope, Bytes), ChannelError> {
    let mut prefix = [0u8; 8];
    match r.read_exact(&mut prefix).await {
        Ok(_) => {}
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
            return Err(ChannelError::Closed)
        }
        Err(e) => return Err(e.into()),
    }
    let (hlen, blen) =
        aether::parse_prefix(prefix).map_err(|e| ChannelError::Protocol(e.to_string()))?;
    let mut header = vec![0u8; hlen];
    r.read_exact(&mut header).await?;
    let mut body = BytesMut::zeroed(blen);
    r.read_exact(&mut body).await?;
    let env = aether::parse_header(&header).map_err(|e| ChannelError::Protocol(e.to_string()))?;
    Ok((env, body.freeze()))
}

async fn reader<R: AsyncRead + Unpin>(mut r: R, inner: Arc<Inner>) {
    loop {
        let (env, body) = match read_frame(&mut r).await {
            Ok(f) => f,
            Err(e) => {
                if !matches!(e, ChannelError::Closed) {
                    tracing::warn!(error = %e, "aether channel broke");
                }
                break;
            }
        };
        let reply = match env.msg {
            Msg::Reply(r) => r,
            Msg::Request(_) => {
                tracing::warn!(id = env.id, "aether sent a request; closing the channel");
                break;
            }
        };
        if env.id == 0 {
            inner.ready_tx.send_replace(Some(reply));
            continue;
        }
        let terminal = reply.is_terminal();
        let slot = {
            let calls = inner.lock_calls();
            calls
                .get(&env.id)
                .map(|s| (s.tx.clone(), s.stalled.clone()))
        };
        let Some((tx, stalled)) = slot else { continue };
        let delivered = match tx.try_send((reply, body)) {
            Ok(()) => true,
            Err(mpsc::error::TrySendError::Closed(_)) => false,
            Err(mpsc::error::TrySendError::Full(item)) => {
                match tokio::time::timeout(STALL_LIMIT, tx.send(item)).await {
                    Ok(Ok(())) => true,
                    Ok(Err(_)) => false,
                    Err(_) => {
                        stalled.store(true, Ordering::SeqCst);
                        false
                    }
                }
            }
        };
        if terminal || !delivered {
            inner.lock_calls().remove(&env.id);
        }
    }
    inner.mark_closed();
}

/// First request id of a new client: milliseconds since the epoch times 1024, so that a client
/// that reattaches to a running aether (after an edge restart) never reuses the id of a request
/// the previous client left running. Stays below 2^53 (exact in every JSON implementation).
fn id_base() -> u64 {
    let ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64);
    (ms << 10).clamp(1, (1 << 53) - (1 << 40))
}

impl AetherClient {
    /// Wraps a connected stream (a unix socket for containers, a serial/vsock stream for VMs)
    /// and spawns the task that reads replies. Must be called inside a tokio runtime.
    pub fn new<S>(stream: S) -> Self
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        let (r, w) = tokio::io::split(stream);
        let (closed_tx, _) = watch::channel(false);
        let (ready_tx, _) = watch::channel(None);
        let inner = Arc::new(Inner {
            writer: tokio::sync::Mutex::new(Box::new(w)),
            calls: Mutex::new(HashMap::new()),
            next_id: AtomicU64::new(id_base()),
            closed: AtomicBool::new(false),
            closed_tx,
            ready_tx,
        });
        tokio::spawn(reader(r, inner.clone()));
        AetherClient { inner }
    }

    async fn write_frame(&self, id: u64, req: Request, body: &[u8]) -> Result<(), ChannelError> {
        if body.len() > MAX_BODY as usize {
            return Err(ChannelError::Protocol(format!(
                "request body of {} bytes exceeds the {MAX_BODY}-byte frame limit",
                body.len()
            )));
        }
        if self.is_closed() {
            return Err(ChannelError::Closed);
        }
        let frame = aether::encode_frame(
            &Envelope {
                id,
                msg: Msg::Request(req),
            },
            body,
        );
        let mut w = self.inner.writer.lock().await;
        let res = async {
            w.write_all(&frame).await?;
            w.flush().await
        }
        .await;
        if let Err(e) = res {
            drop(w);
            if matches!(
                e.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            ) {
                self.inner.mark_closed();
                return Err(ChannelError::Closed);
            }
            return Err(e.into());
        }
        Ok(())
    }

    /// Sends a request with a fresh id and returns its reply stream.
    pub async fn call(&self, req: Request, body: Bytes) -> Result<Call, ChannelError> {
        let id = self.inner.next_id.fetch_add(1, Ordering::SeqCst);
        let (tx, rx) = mpsc::channel(CALL_QUEUE);
        let stalled = Arc::new(AtomicBool::new(false));
        {
            let mut calls = self.inner.lock_calls();
            if self.inner.closed.load(Ordering::SeqCst) {
                return Err(ChannelError::Closed);
            }
            calls.insert(
                id,
                Slot {
                    tx,
                    stalled: stalled.clone(),
                },
            );
        }
        let call = Call {
            id,
            rx,
            stalled,
            done: false,
            inner: Arc::downgrade(&self.inner),
        };
        self.write_frame(id, req, &body).await?;
        Ok(call)
    }

    /// Sends a follow-up frame (`WriteChunk`, `WriteEnd`, ...) on an existing request id.
    /// Also usable with a fresh id for fire-and-forget requests whose reply nobody awaits.
    pub async fn send(&self, id: u64, req: Request, body: Bytes) -> Result<(), ChannelError> {
        self.write_frame(id, req, &body).await
    }

    /// Sends a request and waits for its terminal reply, collecting `Data` bodies.
    /// An `Error` reply becomes [`ChannelError::Aether`].
    pub async fn request(&self, req: Request, body: Bytes) -> Result<(Reply, Bytes), ChannelError> {
        let call = self.call(req, body).await?;
        collect(call).await
    }

    /// Runs a `RunShell` or `Exec` request to completion (non-streaming).
    pub async fn run(&self, req: Request, stdin: Bytes) -> Result<CommandOutput, ChannelError> {
        let (reply, body) = self.request(req, stdin).await?;
        command_output(reply, body)
    }

    /// Waits for the unsolicited `Ready` (id 0) that aether sends in bare mode and in VMs.
    pub async fn wait_ready(&self) -> Result<Reply, ChannelError> {
        let mut rx = self.inner.ready_tx.subscribe();
        let mut closed = self.inner.closed_tx.subscribe();
        loop {
            if let Some(r) = rx.borrow_and_update().clone() {
                return Ok(r);
            }
            if *closed.borrow_and_update() {
                return Err(ChannelError::Closed);
            }
            tokio::select! {
                r = rx.changed() => if r.is_err() { return Err(ChannelError::Closed) },
                r = closed.changed() => if r.is_err() { return Err(ChannelError::Closed) },
            }
        }
    }

    /// Resolves when the channel is closed (aether exited or the stream broke).
    pub async fn closed(&self) {
        let mut rx = self.inner.closed_tx.subscribe();
        let _ = rx.wait_for(|c| *c).await;
    }

    pub fn is_closed(&self) -> bool {
        self.inner.closed.load(Ordering::SeqCst)
    }
}

/// Reads a call to its end: (terminal reply, `Data` bodies followed by the terminal body).
pub async fn collect(mut call: Call) -> Result<(Reply, Bytes), ChannelError> {
    let mut data = BytesMut::new();
    while let Some((reply, body)) = call.next().await? {
        match reply {
            Reply::Data => data.extend_from_slice(&body),
            Reply::Output { .. } => {}
            Reply::Error(e) => return Err(ChannelError::Aether(e)),
            terminal if terminal.is_terminal() => {
                if data.is_empty() {
                    return Ok((terminal, body));
                }
                data.extend_from_slice(&body);
                return Ok((terminal, data.freeze()));
            }
            _ => {}
        }
    }
    Err(ChannelError::Protocol(format!(
        "call {} ended without a terminal reply",
        call.id()
    )))
}

/// Splits a `CommandDone` body into stdout and stderr.
pub fn command_output(reply: Reply, body: Bytes) -> Result<CommandOutput, ChannelError> {
    let Reply::CommandDone(outcome) = reply else {
        return Err(ChannelError::Protocol(format!(
            "expected command_done, got {reply:?}"
        )));
    };
    let (o, e) = (outcome.stdout_len as usize, outcome.stderr_len as usize);
    if o.checked_add(e) != Some(body.len()) {
        return Err(ChannelError::Protocol(format!(
            "command_done says {o}+{e} output bytes but the body has {}",
            body.len()
        )));
    }
    let stdout = body.slice(..o);
    let stderr = body.slice(o..);
    Ok(CommandOutput {
        outcome,
        stdout,
        stderr,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use dsec_wire::aether::{AetherError, AetherErrorKind};

    async fn reply_frames(
        peer: &mut tokio::net::UnixStream,
        id: u64,
        replies: Vec<(Reply, &[u8])>,
    ) {
        for (r, b) in replies {
            let f = aether::encode_frame(
                &Envelope {
                    id,
                    msg: Msg::Reply(r),
                },
                b,
            );
            peer.write_all(&f).await.unwrap();
        }
    }

    async fn read_request(peer: &mut tokio::net::UnixStream) -> (u64, Request, Bytes) {
        let (env, body) = read_frame(peer).await.unwrap();
        match env.msg {
            Msg::Request(r) => (env.id, r, body),
            Msg::Reply(_) => panic!("expected a request"),
        }
    }

    #[tokio::test]
    async fn demux_data_and_errors() {
        let (a, mut peer) = tokio::net::UnixStream::pair().unwrap();
        let client = AetherClient::new(a);
        let c2 = client.clone();
        let t = tokio::spawn(async move {
            c2.request(Request::ReadFile { path: "/x".into() }, Bytes::new())
                .await
        });
        let (id, _, _) = read_request(&mut peer).await;
        reply_frames(&mut peer, 999, vec![(Reply::Done, b"")]).await; // unknown id: ignored
        reply_frames(
            &mut peer,
            id,
            vec![
                (Reply::Data, b"ab"),
                (Reply::Data, b"cd"),
                (
                    Reply::FileEnd {
                        size: 4,
                        mode: 0o644,
                    },
                    b"",
                ),
            ],
        )
        .await;
        let (r, body) = t.await.unwrap().unwrap();
        assert!(matches!(r, Reply::FileEnd { size: 4, .. }));
        assert_eq!(&body[..], b"abcd");

        let c2 = client.clone();
        let t = tokio::spawn(async move {
            c2.request(
                Request::Stat {
                    path: "/nope".into(),
                },
                Bytes::new(),
            )
            .await
        });
        let (id, _, _) = read_request(&mut peer).await;
        let err = AetherError {
            kind: AetherErrorKind::NotFound,
            message: "stat /nope".into(),
        };
        reply_frames(&mut peer, id, vec![(Reply::Error(err.clone()), b"")]).await;
        assert!(matches!(t.await.unwrap(), Err(ChannelError::Aether(e)) if e == err));
    }

    #[tokio::test]
    async fn close_fails_pending_calls() {
        let (a, mut peer) = tokio::net::UnixStream::pair().unwrap();
        let client = AetherClient::new(a);
        reply_frames(
            &mut peer,
            0,
            vec![(
                Reply::Ready {
                    pid_in_host: None,
                    aether_version: "t".into(),
                },
                b"",
            )],
        )
        .await;
        assert!(matches!(
            client.wait_ready().await.unwrap(),
            Reply::Ready { .. }
        ));
        let mut call = client.call(Request::Ping, Bytes::new()).await.unwrap();
        let _ = read_request(&mut peer).await;
        drop(peer);
        assert!(matches!(call.next().await, Err(ChannelError::Closed)));
        client.closed().await;
        assert!(client.is_closed());
        assert!(matches!(
            client.call(Request::Ping, Bytes::new()).await,
            Err(ChannelError::Closed)
        ));
    }

    #[test]
    fn split_output() {
        let out = CommandOutcome {
            stdout_len: 2,
            stderr_len: 1,
            ..Default::default()
        };
        let o =
            command_output(Reply::CommandDone(out.clone()), Bytes::from_static(b"abc")).unwrap();
        assert_eq!((&o.stdout[..], &o.stderr[..]), (&b"ab"[..], &b"c"[..]));
        assert!(command_output(Reply::CommandDone(out), Bytes::from_static(b"ab")).is_err());
    }
}
