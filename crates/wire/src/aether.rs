//! The edge ↔ aether protocol.
//!
//! A byte stream carries frames. Each frame is
//! `[u32 BE header length][u32 BE body length][header: JSON Envelope][body: raw bytes]`.
//! The header is at most [`MAX_HEADER`] bytes and the body at most [`MAX_BODY`] bytes; a peer
//! that sends more is broken and the stream is closed.
//!
//! Requests carry an id chosen by the edge; every frame aether sends about a request carries
//! the same id, so many calls run at once on one stream. A request ends with exactly one
//! terminal reply ([`Reply::is_terminal`]). Id 0 is reserved for unsolicited events from aether.
//!
//! The first exchange on a new container stream is `Setup` → `Ready` (or `Error`): aether sets up
//! the sandbox's root, masks and restrictions, then serves. For VMs the guest's aether does its
//! own setup and sends `Ready` unsolicited with id 0.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::api::{AgentStats, FileInfo, FileList, FsEvent, ProcessInfo, ProcessList};

pub const MAX_HEADER: u32 = 1024 * 1024;
pub const MAX_BODY: u32 = 4 * 1024 * 1024;
/// Chunk size used for streamed file bodies and output.
pub const CHUNK: usize = 256 * 1024;

/// The JSON header of a frame.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Envelope {
    pub id: u64,
    #[serde(flatten)]
    pub msg: Msg,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "dir", content = "m", rename_all = "snake_case")]
pub enum Msg {
    Request(Request),
    Reply(Reply),
}

/// Everything aether needs to turn its fresh namespaces into the sandbox.
#[derive(Debug, Clone, Serialize, Deserialize, Default)]
pub struct ContainerSetup {
    pub sandbox_id: String,
    pub hostname: String,
    /// Host paths of the read-only layer roots, top-most first (overlay `lowerdir` order).
    pub lowers: Vec<String>,
    /// Host paths of the per-sandbox writable dirs.
    pub upper: String,
    pub work: String,
    /// Host path where the overlay is mounted in the sandbox's mount namespace before pivot_root.
    pub rootfs: String,
    /// Files and dirs made unreadable inside (`/proc/kcore`, `/sys/firmware`, ...).
    pub masked_paths: Vec<String>,
    /// Made read-only inside (`/proc/sys`, `/proc/sysrq-trigger`, ...).
    pub readonly_paths: Vec<String>,
    /// User commands run as: name or uid, resolved against the image's /etc/passwd.
    pub user: String,
    /// Environment given to every command (PATH, HOME and TERM get defaults when absent).
    pub env: BTreeMap<String, String>,
    /// Size of the sandbox's /dev/shm and /tmp-like tmpfs mounts in MiB.
    pub shm_mb: u64,
    /// Milliseconds aether waits for an edge to reconnect on its listener fd after the channel
    /// breaks; 0 means the sandbox ends as soon as the channel breaks.
    pub reattach_grace_ms: u64,
    /// Paths inside the new root that stay read-only even to root (Landlock, enforced on aether
    /// itself and so on every command).
    #[serde(default)]
    pub protected_paths: Vec<String>,
    /// Host directories bound into the new root before the pivot (volumes).
    #[serde(default)]
    pub binds: Vec<BindSetup>,
}

/// One bind mount of [`ContainerSetup::binds`].
#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct BindSetup {
    /// Host path (valid in aether's mount namespace before the pivot).
    pub source: String,
    /// Absolute path inside the new root; made when missing, refused through a symlink.
    pub target: String,
    pub read_only: bool,
}

/// A request from the edge. Fields named `*_len` describe how the frame body is split.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Request {
    Setup(ContainerSetup),
    /// Liveness and a few numbers.
    Ping,
    /// Run `cmd` in the named persistent shell (created on first use). Body: stdin bytes.
    RunShell {
        session: String,
        cmd: String,
        timeout_ms: u64,
        env: BTreeMap<String, String>,
        cwd: Option<String>,
        max_output: u64,
        /// Send `Output` replies as output arrives (they do not count against the kept output).
        stream: bool,
    },
    /// Run an argv directly. Body: stdin bytes.
    Exec {
        argv: Vec<String>,
        timeout_ms: u64,
        env: BTreeMap<String, String>,
        cwd: Option<String>,
        user: Option<String>,
        max_output: u64,
        stream: bool,
    },
    /// End a shell session and everything it started.
    CloseSession {
        session: String,
    },
    /// Cancel a running request (kills its processes); the request still ends with its reply.
    Cancel {
        target: u64,
    },
    /// Start a file upload: truncate/create `path` with `mode` (owned by the sandbox user).
    /// Followed by `WriteChunk`s with the same id and a final `WriteEnd`.
    WriteBegin {
        path: String,
        mode: u32,
        make_parents: bool,
    },
    /// Body: the next bytes of the file.
    WriteChunk,
    WriteEnd,
    /// Read a file: aether answers `Data` chunks then `FileEnd`.
    ReadFile {
        path: String,
    },
    ListDir {
        path: String,
    },
    Stat {
        path: String,
    },
    Remove {
        path: String,
        recursive: bool,
    },
    Mkdir {
        path: String,
        mode: u32,
        parents: bool,
    },
    /// Open an interactive terminal running the session user's login shell.
    TtyOpen {
        rows: u16,
        cols: u16,
        cmd: Option<Vec<String>>,
        env: BTreeMap<String, String>,
    },
    /// Body: keyboard bytes for the TTY opened by request `target`.
    TtyInput {
        target: u64,
    },
    TtyResize {
        target: u64,
        rows: u16,
        cols: u16,
    },
    /// Orderly end of the sandbox: aether kills everything and exits.
    Shutdown,
    /// Start a process handle: `argv` runs in its own session and outlives this request.
    /// Answered with `Proc` at once; its output is kept in a ring of `buffer_bytes`.
    ProcStart {
        argv: Vec<String>,
        env: BTreeMap<String, String>,
        cwd: Option<String>,
        user: Option<String>,
        tag: Option<String>,
        /// Keep stdin open for `ProcInput` (else it is closed at once).
        stdin: bool,
        buffer_bytes: u64,
    },
    /// A handle's output from combined offset `offset`: `ProcOutput` replies, then
    /// `ProcOutputEnd`. With `follow`, streams until the process exits (or `Cancel`).
    ProcRead {
        pid: i32,
        offset: u64,
        follow: bool,
    },
    /// Body: bytes for the handle's stdin; `close` closes it after them. Answered with `Proc`.
    ProcInput {
        pid: i32,
        close: bool,
    },
    /// Signal the handle (its whole process group when `group`). Answered with `Proc`.
    ProcSignal {
        pid: i32,
        signal: i32,
        group: bool,
    },
    /// The handles: running ones, plus exited ones still kept when `all`.
    ProcList {
        all: bool,
    },
    /// Waits up to `timeout_ms` (0: not at all) for the handle to exit; answered with `Proc`.
    ProcWait {
        pid: i32,
        timeout_ms: u64,
    },
    /// What the agent measures from inside (root file system, network bytes); answered with
    /// `Stats`.
    Stats,
    /// Watch `path` (and every dir below it when `recursive`) with inotify: `FsEvents` replies
    /// (the first one empty: the watch is set up) until `Cancel`, then `Done`.
    Watch {
        path: String,
        recursive: bool,
    },
    /// Rename (move) `src` to `dst`; fails if `dst` exists unless `overwrite`. Answered with
    /// `Stat` of `dst`.
    Rename {
        src: String,
        dst: String,
        overwrite: bool,
    },
    /// VM guests restored from a template snapshot: take this guest's own identity. aether sets
    /// the kernel hostname, the wall clock (the restored guest's clock is the template's) and
    /// mixes the frame body (host randomness) into the kernel's pool, then forces a reseed of
    /// the kernel's CRNG, so clones of one snapshot never share random output. Only a guest's
    /// aether (bare mode, PID 1) accepts it. Answered with `Done`.
    SetIdentity {
        hostname: String,
        /// Wall clock: seconds and nanoseconds since the Unix epoch.
        unix_secs: i64,
        unix_nanos: u32,
    },
}

/// Which output stream a chunk belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Stream {
    Stdout,
    Stderr,
    Tty,
}

/// A reply from aether. Terminal replies end their request.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub enum Reply {
    /// Setup finished; aether serves requests from now on.
    Ready {
        pid_in_host: Option<i32>,
        aether_version: String,
    },
    Pong {
        sessions: u32,
        processes: u32,
    },
    /// Body: output bytes (streaming only).
    Output {
        stream: Stream,
    },
    /// Body: `stdout_len` bytes of kept stdout followed by `stderr_len` bytes of kept stderr.
    CommandDone(CommandOutcome),
    /// Body: bytes of a file being read.
    Data,
    FileEnd {
        size: u64,
        mode: u32,
    },
    Written(FileInfo),
    Listed(FileList),
    Stat(FileInfo),
    /// Generic success for requests with nothing else to say.
    Done,
    /// The TTY's shell exited.
    TtyExit {
        code: i32,
    },
    /// A process handle's state.
    Proc(ProcessInfo),
    ProcList(ProcessList),
    /// Body: output bytes of a handle starting at combined offset `offset` (non-terminal).
    ProcOutput {
        stream: Stream,
        offset: u64,
    },
    Stats(AgentStats),
    /// Filesystem events of a `Watch` (non-terminal), in the order the kernel reported them.
    FsEvents {
        events: Vec<FsEvent>,
    },
    /// The end of a `ProcRead`: resume at `offset`; `info` is the handle's state then.
    ProcOutputEnd {
        offset: u64,
        info: ProcessInfo,
    },
    Error(AetherError),
}

impl Reply {
    /// True for replies that end a request.
    pub fn is_terminal(&self) -> bool {
        !matches!(
            self,
            Reply::Output { .. } | Reply::Data | Reply::ProcOutput { .. } | Reply::FsEvents { .. }
        )
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, Default, PartialEq)]
pub struct CommandOutcome {
    pub exit_code: i32,
    pub signal: Option<i32>,
    pub stdout_len: u64,
    pub stderr_len: u64,
    pub stdout_total: u64,
    pub stderr_total: u64,
    pub stdout_truncated: bool,
    pub stderr_truncated: bool,
    pub timed_out: bool,
    pub duration_ms: f64,
    pub session_restarted: bool,
}

/// Errors aether reports; `kind` maps onto the API's error codes.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct AetherError {
    pub kind: AetherErrorKind,
    pub message: String,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "snake_case")]
pub enum AetherErrorKind {
    /// The caller asked for something invalid (bad path, unknown user, empty argv, ...).
    BadRequest,
    NotFound,
    PermissionDenied,
    /// The path exists but is the wrong kind (a dir where a file was expected, ...).
    WrongKind,
    /// Setup of the sandbox failed.
    Setup,
    Internal,
    /// aether could not take the request: the sandbox is at its process limit (retryable).
    Busy,
}

/// Encodes one frame.
pub fn encode_frame(env: &Envelope, body: &[u8]) -> Vec<u8> {
    let header = serde_json::to_vec(env).expect("envelope serializes");
    let mut out = Vec::with_capacity(8 + header.len() + body.len());
    out.extend_from_slice(&(header.len() as u32).to_be_bytes());
    out.extend_from_slice(&(body.len() as u32).to_be_bytes());
    out.extend_from_slice(&header);
    out.extend_from_slice(body);
    out
}

/// Why a frame could not be decoded.
#[derive(Debug, PartialEq)]
pub enum FrameError {
    TooLarge { header: u32, body: u32 },
    BadHeader(String),
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::TooLarge { header, body } => write!(
                f,
                "frame too large: header {header} bytes, body {body} bytes"
            ),
            FrameError::BadHeader(e) => write!(f, "bad frame header: {e}"),
        }
    }
}

impl std::error::Error for FrameError {}

/// Parses the 8-byte frame prefix into (header length, body length), checking the limits.
pub fn parse_prefix(prefix: [u8; 8]) -> Result<(usize, usize), FrameError> {
    let header = u32::from_be_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
    let body = u32::from_be_bytes([prefix[4], prefix[5], prefix[6], prefix[7]]);
    if header > MAX_HEADER || body > MAX_BODY {
        return Err(FrameError::TooLarge { header, body });
    }
    Ok((header as usize, body as usize))
}

/// Parses a frame header.
pub fn parse_header(bytes: &[u8]) -> Result<Envelope, FrameError> {
    serde_json::from_slice(bytes).map_err(|e| FrameError::BadHeader(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frame_round_trip() {
        let env = Envelope {
            id: 7,
            msg: Msg::Request(Request::Stat {
                path: "/etc".into(),
            }),
        };
        let bytes = encode_frame(&env, b"xyz");
        let (h, b) = parse_prefix(bytes[..8].try_into().unwrap()).unwrap();
        assert_eq!(b, 3);
        let back = parse_header(&bytes[8..8 + h]).unwrap();
        assert_eq!(back.id, 7);
        assert!(matches!(back.msg, Msg::Request(Request::Stat { ref path }) if path == "/etc"));
        assert_eq!(&bytes[8 + h..], b"xyz");
    }

    #[test]
    fn oversized_frames_rejected() {
        let mut p = [0u8; 8];
        p[..4].copy_from_slice(&(MAX_HEADER + 1).to_be_bytes());
        assert!(parse_prefix(p).is_err());
    }

    #[test]
    fn terminal_replies() {
        assert!(!Reply::Data.is_terminal());
        assert!(!Reply::Output {
            stream: Stream::Stdout
        }
        .is_terminal());
        assert!(Reply::Done.is_terminal());
    }
}
