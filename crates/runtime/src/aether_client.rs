//! The edge's end of the aether protocol: multiplexed request/reply over one byte stream.
//!
//! ```ignore
//! let client = AetherClient::new(stream);                 // spawns the reader task
//! let mut call = client.call(Request::Ping, Bytes::new()).await?;
//! while let Some((reply, body)) = call.next().await? { /* the last one is terminal */ }
//! client.send(call.id(), Request::WriteChunk, body).await?;   // follow-up frames on one id
//! client.closed().await;                                  // resolves when the channel breaks
//! ```

use bytes::Bytes;
use dsec_wire::aether::{CommandOutcome, Reply, Request};

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

/// A cloneable handle to one aether channel.
#[derive(Clone)]
pub struct AetherClient {
    _private: (),
}

/// The replies of one request, in order; ends after the terminal reply.
pub struct Call {
    id: u64,
}

impl Call {
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Next reply and its body; `Ok(None)` after the terminal reply was returned.
    pub async fn next(&mut self) -> Result<Option<(Reply, Bytes)>, ChannelError> {
        todo!()
    }
}

/// The kept output of a finished command.
#[derive(Debug, Clone)]
pub struct CommandOutput {
    pub outcome: CommandOutcome,
    pub stdout: Bytes,
    pub stderr: Bytes,
}

impl AetherClient {
    /// Wraps a connected stream (a unix socket for containers, a serial/vsock stream for VMs)
    /// and spawns the task that reads replies.
    pub fn new<S>(_stream: S) -> Self
    where
        S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    {
        todo!()
    }

    /// Sends a request with a fresh id and returns its reply stream.
    pub async fn call(&self, _req: Request, _body: Bytes) -> Result<Call, ChannelError> {
        todo!()
    }

    /// Sends a follow-up frame (`WriteChunk`, `WriteEnd`, ...) on an existing request id.
    pub async fn send(&self, _id: u64, _req: Request, _body: Bytes) -> Result<(), ChannelError> {
        todo!()
    }

    /// Sends a request and waits for its terminal reply, collecting `Data` bodies.
    /// An `Error` reply becomes [`ChannelError::Aether`].
    pub async fn request(&self, _req: Request, _body: Bytes) -> Result<(Reply, Bytes), ChannelError> {
        todo!()
    }

    /// Runs a `RunShell` or `Exec` request to completion (non-streaming).
    pub async fn run(&self, _req: Request, _stdin: Bytes) -> Result<CommandOutput, ChannelError> {
        todo!()
    }

    /// Resolves when the channel is closed (aether exited or the stream broke).
    pub async fn closed(&self) {
        todo!()
    }

    pub fn is_closed(&self) -> bool {
        todo!()
    }
}
