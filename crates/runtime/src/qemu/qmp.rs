//! A small async QMP (QEMU Machine Protocol) client over QEMU's unix socket.
//!
//! QMP is line-delimited JSON: on connect QEMU sends a greeting (`{"QMP": {...}}`), the client
//! must send `qmp_capabilities` before anything else, then each `{"execute": .., "id": ..}` is
//! answered by `{"return": ..}` or `{"error": {"class", "desc"}}` carrying the same id.
//! Asynchronous events (`{"event": ..}`) may arrive in between; they are skipped.
//!
//! Used by the microVM substrate (pause by snapshot) and usable by any QEMU-based substrate:
//! ```no_run
//! # async fn f() -> Result<(), dsec_runtime::microvm::qmp::QmpError> {
//! use dsec_runtime::microvm::qmp::Qmp;
//! let mut q = Qmp::connect(std::path::Path::new("/run/vm/qmp.sock")).await?;
//! q.stop().await?;
//! q.migrate("exec:cat > /run/vm/snapshot").await?;
//! q.wait_migration(std::time::Duration::from_secs(60)).await?;
//! q.quit().await?;
//! # Ok(()) }
//! ```

use std::path::Path;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::unix::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::UnixStream;

/// Longest line accepted from QEMU (a `query-*` answer is a few KiB).
const MAX_LINE: usize = 4 << 20;

#[derive(Debug, thiserror::Error)]
pub enum QmpError {
    #[error("QMP socket {path}: {source}")]
    Connect {
        path: String,
        #[source]
        source: std::io::Error,
    },
    #[error("QMP I/O: {0}")]
    Io(#[from] std::io::Error),
    #[error("QMP: QEMU closed the connection")]
    Closed,
    #[error("QMP: malformed message from QEMU: {0}")]
    Protocol(String),
    #[error("QMP command {command} failed: {class}: {desc}")]
    Command {
        command: String,
        class: String,
        desc: String,
    },
    #[error("QMP: migration {status}{}", error.as_deref().map(|e| format!(": {e}")).unwrap_or_default())]
    MigrationFailed {
        status: String,
        error: Option<String>,
    },
    #[error("QMP: {0} timed out")]
    Timeout(String),
}

/// The state of an outgoing (or incoming) migration, from `query-migrate`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MigrationStatus {
    /// `none`, `setup`, `active`, `completed`, `failed`, `cancelled`, ...
    pub status: String,
    /// Bytes of RAM transferred so far (`ram.transferred`), when reported.
    pub ram_transferred: Option<u64>,
    pub error: Option<String>,
}

/// One QMP session (commands are sent one at a time).
pub struct Qmp {
    reader: BufReader<OwnedReadHalf>,
    writer: OwnedWriteHalf,
    next_id: u64,
}

impl std::fmt::Debug for Qmp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Qmp")
            .field("next_id", &self.next_id)
            .finish()
    }
}

impl Qmp {
    /// Connects, reads the greeting and negotiates capabilities (none).
    pub async fn connect(path: &Path) -> Result<Qmp, QmpError> {
        let stream = UnixStream::connect(path)
            .await
            .map_err(|source| QmpError::Connect {
                path: path.display().to_string(),
                source,
            })?;
        Qmp::handshake(stream).await
    }

    /// Connects, retrying while the socket does not exist yet or refuses (QEMU starting), up to
    /// `timeout`.
    pub async fn connect_retry(path: &Path, timeout: Duration) -> Result<Qmp, QmpError> {
        let deadline = Instant::now() + timeout;
        loop {
            match UnixStream::connect(path).await {
                Ok(s) => return Qmp::handshake(s).await,
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                    ) && Instant::now() < deadline =>
                {
                    tokio::time::sleep(Duration::from_millis(10)).await
                }
                Err(source) => {
                    return Err(QmpError::Connect {
                        path: path.display().to_string(),
                        source,
                    })
                }
            }
        }
    }

    /// Runs the greeting + `qmp_capabilities` exchange on a connected stream.
    pub async fn handshake(stream: UnixStream) -> Result<Qmp, QmpError> {
        let (r, w) = stream.into_split();
        let mut q = Qmp {
            reader: BufReader::new(r),
            writer: w,
            next_id: 1,
        };
        let greeting = q.read_message().await?;
        if greeting.get("QMP").is_none() {
            return Err(QmpError::Protocol(format!(
                "expected the QMP greeting, got {greeting}"
            )));
        }
        q.execute("qmp_capabilities", None).await?;
        Ok(q)
    }

    async fn read_message(&mut self) -> Result<Value, QmpError> {
        let mut line = String::new();
        loop {
            line.clear();
            let n = (&mut self.reader)
                .take(MAX_LINE as u64)
                .read_line(&mut line)
                .await?;
            if n == 0 {
                return Err(QmpError::Closed);
            }
            if !line.ends_with('\n') && n >= MAX_LINE {
                return Err(QmpError::Protocol(format!(
                    "a line longer than {MAX_LINE} bytes"
                )));
            }
            let t = line.trim();
            if t.is_empty() {
                continue;
            }
            return serde_json::from_str(t)
                .map_err(|e| QmpError::Protocol(format!("{e}: {}", truncate(t))));
        }
    }

    /// Sends `command` (with `arguments` when given) and returns its `return` value; events and
    /// answers to other ids are skipped.
    pub async fn execute(
        &mut self,
        command: &str,
        arguments: Option<Value>,
    ) -> Result<Value, QmpError> {
        let id = self.next_id;
        self.next_id += 1;
        let mut msg = json!({ "execute": command, "id": id });
        if let Some(a) = arguments {
            msg["arguments"] = a;
        }
        let mut bytes = serde_json::to_vec(&msg)
            .map_err(|e| QmpError::Protocol(format!("encode {command}: {e}")))?;
        bytes.push(b'\n');
        self.writer.write_all(&bytes).await?;
        loop {
            let m = self.read_message().await?;
            if m.get("event").is_some() {
                continue;
            }
            if m.get("id").and_then(Value::as_u64) != Some(id) {
                continue;
            }
            if let Some(r) = m.get("return") {
                return Ok(r.clone());
            }
            if let Some(e) = m.get("error") {
                return Err(QmpError::Command {
                    command: command.to_string(),
                    class: e
                        .get("class")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_string(),
                    desc: e
                        .get("desc")
                        .and_then(Value::as_str)
                        .unwrap_or("?")
                        .to_string(),
                });
            }
            return Err(QmpError::Protocol(format!(
                "answer without return or error: {}",
                truncate(&m.to_string())
            )));
        }
    }

    /// Pauses the guest's vCPUs.
    pub async fn stop(&mut self) -> Result<(), QmpError> {
        self.execute("stop", None).await.map(drop)
    }

    /// Resumes the guest's vCPUs.
    pub async fn cont(&mut self) -> Result<(), QmpError> {
        self.execute("cont", None).await.map(drop)
    }

    /// Starts an outgoing migration to `uri` (`exec:<shell command>`; `file:<path>` needs
    /// QEMU ≥ 8.2). Returns at once; poll with [`Qmp::wait_migration`].
    pub async fn migrate(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Starts an incoming migration from `uri` (QEMU started with `-incoming defer`).
    pub async fn migrate_incoming(&mut self, uri: &str) -> Result<(), QmpError> {
        self.execute("migrate-incoming", Some(json!({ "uri": uri })))
            .await
            .map(drop)
    }

    /// Sets migration capabilities, e.g. `[("x-ignore-shared", true)]`.
    pub async fn set_capabilities(&mut self, caps: &[(&str, bool)]) -> Result<(), QmpError> {
        let list: Vec<Value> = caps
            .iter()
            .map(|(c, s)| json!({ "capability": c, "state": s }))
            .collect();
        self.execute(
            "migrate-set-capabilities",
            Some(json!({ "capabilities": list })),
        )
        .await
        .map(drop)
    }

    pub async fn query_migrate(&mut self) -> Result<MigrationStatus, QmpError> {
        let r = self.execute("query-migrate", None).await?;
        Ok(MigrationStatus {
            status: r
                .get("status")
                .and_then(Value::as_str)
                .unwrap_or("none")
                .to_string(),
            ram_transferred: r
                .get("ram")
                .and_then(|m| m.get("transferred"))
                .and_then(Value::as_u64),
            error: r
                .get("error-desc")
                .and_then(Value::as_str)
                .map(str::to_string),
        })
    }

    /// Polls `query-migrate` until `completed` (Ok) or `failed`/`cancelled` (Err), or `timeout`.
    pub async fn wait_migration(&mut self, timeout: Duration) -> Result<MigrationStatus, QmpError> {
        let deadline = Instant::now() + timeout;
        let mut delay = Duration::from_millis(5);
        loop {
            let s = self.query_migrate().await?;
            match s.status.as_str() {
                "completed" => return Ok(s),
                "failed" | "cancelled" => {
                    return Err(QmpError::MigrationFailed {
                        status: s.status,
                        error: s.error,
                    })
                }
                _ => {}
            }
            if Instant::now() >= deadline {
                return Err(QmpError::Timeout(format!(
                    "migration (status {})",
                    s.status
                )));
            }
            tokio::time::sleep(delay).await;
            delay = (delay * 2).min(Duration::from_millis(50));
        }
    }

    /// The VM's run state (`running`, `paused`, `inmigrate`, `postmigrate`, ...).
    pub async fn query_status(&mut self) -> Result<String, QmpError> {
        let r = self.execute("query-status", None).await?;
        r.get("status")
            .and_then(Value::as_str)
            .map(str::to_string)
            .ok_or_else(|| {
                QmpError::Protocol(format!("query-status: {}", truncate(&r.to_string())))
            })
    }

    /// Asks QEMU to exit. QEMU may close the socket before or after answering; both are success.
    pub async fn quit(&mut self) -> Result<(), QmpError> {
        match self.execute("quit", None).await {
            Ok(_) | Err(QmpError::Closed) => Ok(()),
            Err(QmpError::Io(e))
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
                ) =>
            {
                Ok(())
            }
            Err(e) => Err(e),
        }
    }
}

fn truncate(s: &str) -> String {
    if s.len() <= 200 {
        s.to_string()
    } else {
        let mut end = 200;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        format!("{}...", &s[..end])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fake QEMU speaking the wire format, to test framing, ids and event skipping.
    async fn fake_qemu(server: UnixStream) {
        let (r, mut w) = server.into_split();
        let mut r = BufReader::new(r);
        w.write_all(b"{\"QMP\": {\"version\": {}, \"capabilities\": []}}\r\n")
            .await
            .unwrap();
        let mut polls = 0;
        let mut line = String::new();
        loop {
            line.clear();
            if r.read_line(&mut line).await.unwrap() == 0 {
                return;
            }
            let m: Value = serde_json::from_str(line.trim()).unwrap();
            let id = m["id"].clone();
            let cmd = m["execute"].as_str().unwrap().to_string();
            let reply = match cmd.as_str() {
                "qmp_capabilities" | "stop" | "migrate" => json!({"return": {}, "id": id}),
                "query-migrate" => {
                    polls += 1;
                    // An event in between, and an answer to an unrelated id first.
                    w.write_all(b"{\"event\": \"STOP\", \"timestamp\": {}}\n")
                        .await
                        .unwrap();
                    let st = if polls < 3 { "active" } else { "completed" };
                    json!({"return": {"status": st, "ram": {"transferred": 42}}, "id": id})
                }
                "quit" => {
                    w.write_all(format!("{}\n", json!({"return": {}, "id": id})).as_bytes())
                        .await
                        .unwrap();
                    return;
                }
                _ => json!({"error": {"class": "CommandNotFound", "desc": "nope"}, "id": id}),
            };
            w.write_all(format!("{reply}\n").as_bytes()).await.unwrap();
        }
    }

    #[tokio::test]
    async fn commands_events_and_errors() {
        let (a, b) = UnixStream::pair().unwrap();
        let server = tokio::spawn(fake_qemu(b));
        let mut q = Qmp::handshake(a).await.unwrap();
        q.stop().await.unwrap();
        q.migrate("exec:cat > /dev/null").await.unwrap();
        let s = q.wait_migration(Duration::from_secs(5)).await.unwrap();
        assert_eq!(s.status, "completed");
        assert_eq!(s.ram_transferred, Some(42));
        match q.execute("bogus", None).await {
            Err(QmpError::Command { class, .. }) => assert_eq!(class, "CommandNotFound"),
            other => panic!("{other:?}"),
        }
        q.quit().await.unwrap();
        server.await.unwrap();
    }

    #[tokio::test]
    async fn closed_before_greeting() {
        let (a, mut b) = UnixStream::pair().unwrap();
        drop(b.read(&mut [0u8; 1]));
        b.shutdown().await.unwrap();
        drop(b);
        assert!(matches!(Qmp::handshake(a).await, Err(QmpError::Closed)));
    }
}
