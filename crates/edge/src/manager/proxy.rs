//! Calls passed to a sandbox's agent: commands (through the trajectory log), sessions, files
//! and TTYs.

use std::sync::Arc;

use bytes::Bytes;
use dsec_runtime::aether_client::AetherClient;
use dsec_wire::aether::Request;
use dsec_wire::api::{ExecRequest, FileInfo, FileList, RunShellRequest};
use futures::Stream;

use crate::commands::{self, CommandReply};
use crate::error::{EdgeError, Subject};
use crate::files::{self, Download};

use super::{Busy, Manager};

impl Manager {
    pub async fn shell(
        self: &Arc<Self>,
        id: &str,
        req: RunShellRequest,
    ) -> Result<CommandReply, EdgeError> {
        let e = self.touch(id).await?;
        let (r, stdin) = commands::shell_request(&req, self.cmd_defaults())?;
        self.metrics.commands.with_label_values(&["shell"]).inc();
        let key = crate::trajectory::hooks::shell_key(&req);
        self.logged_command(id, "shell", &req, key, (req.step, req.stream), e, r, stdin)
            .await
    }

    pub async fn exec(
        self: &Arc<Self>,
        id: &str,
        req: ExecRequest,
    ) -> Result<CommandReply, EdgeError> {
        let e = self.touch(id).await?;
        let (r, stdin) = commands::exec_request(&req, self.cmd_defaults())?;
        self.metrics.commands.with_label_values(&["exec"]).inc();
        let key = crate::trajectory::hooks::exec_key(&req, &stdin);
        self.logged_command(id, "exec", &req, key, (req.step, req.stream), e, r, stdin)
            .await
    }

    /// Runs a command through the trajectory log (fast-forward, recording).
    #[allow(clippy::too_many_arguments)]
    async fn logged_command<Q: serde::Serialize>(
        self: &Arc<Self>,
        id: &str,
        kind: &'static str,
        req: &Q,
        key: serde_json::Value,
        (step, stream): (Option<u64>, bool),
        e: Busy,
        r: Request,
        stdin: Bytes,
    ) -> Result<CommandReply, EdgeError> {
        use crate::trajectory::{hooks, request_value};
        let request = request_value(req);
        if stream && step.is_none() {
            return match self.run_command(e, r, stdin, true).await? {
                CommandReply::Stream(s) => Ok(CommandReply::Stream(hooks::record_stream(
                    &self.traj,
                    id,
                    kind,
                    request,
                    key,
                    s,
                    1 << 20,
                ))),
                other => Ok(other),
            };
        }
        let me = self.clone();
        let run = move || async move {
            match me.run_command(e, r, stdin, false).await? {
                CommandReply::Done(c) | CommandReply::Replayed(c) => Ok(c),
                CommandReply::Stream(_) => Err(EdgeError::Internal("unexpected stream".into())),
            }
        };
        let a = self.traj.call(id, step, kind, request, key, run).await?;
        Ok(hooks::command_reply(a, stream))
    }

    async fn run_command(
        &self,
        busy: Busy,
        r: Request,
        stdin: Bytes,
        stream: bool,
    ) -> Result<CommandReply, EdgeError> {
        let e = busy.0.clone();
        let oom_before = e.sandbox.oom_kills();
        let chan = |err| EdgeError::from_channel(&e.id, Subject::Other, err);
        let timeout_ms = commands::request_timeout_ms(&r);
        let call = e.aether.call(r, stdin).await.map_err(chan)?;
        if stream {
            let probe_entry = e.clone();
            let probe: commands::OomProbe = Arc::new(move || probe_entry.sandbox.oom_kills());
            let s = commands::stream_call(e.aether.clone(), call, e.id.clone(), probe, oom_before);
            // The sandbox stays busy until the stream ends.
            let s = futures::StreamExt::map(s, move |chunk| {
                let _busy = &busy;
                chunk
            });
            return Ok(CommandReply::Stream(Box::pin(s)));
        }
        let deadline = std::time::Duration::from_millis(timeout_ms) + commands::AGENT_GRACE;
        let out = commands::collect_call(e.aether.clone(), call, &e.id, deadline).await?;
        let oom = e.sandbox.oom_kills() > oom_before;
        Ok(CommandReply::Done(commands::output_result(&out, oom)))
    }

    pub async fn close_session(&self, id: &str, session: &str) -> Result<(), EdgeError> {
        let e = self.touch(id).await?;
        if !commands::is_valid_session(session) {
            return Err(EdgeError::BadRequest(format!(
                "session {session:?} must match [A-Za-z0-9._-]{{1,64}}"
            )));
        }
        e.aether
            .request(
                Request::CloseSession {
                    session: session.to_string(),
                },
                Bytes::new(),
            )
            .await
            .map(|_| ())
            .map_err(|err| EdgeError::from_channel(id, Subject::Session, err))
    }

    /// Uploads a file; with a `step` the body is buffered (hashed before it runs or is
    /// fast-forwarded). Answers whether the result was replayed from the trajectory log.
    pub async fn write_file<S>(
        &self,
        id: &str,
        path: &str,
        (mode, parents, step): (u32, bool, Option<u64>),
        body: S,
    ) -> Result<(FileInfo, bool), EdgeError>
    where
        S: Stream<Item = Result<Bytes, axum::Error>> + Send + Unpin + 'static,
    {
        use crate::trajectory::{hooks, Written};
        let e = self.touch(id).await?;
        let max = self.cfg.max_upload_bytes;
        let request = serde_json::json!({"path": path, "mode": mode, "parents": parents});
        let (p, aether) = (path.to_string(), e.0.aether.clone());
        let a = if step.is_some() {
            let data =
                hooks::buffer_body(body, max.min(self.traj.config().max_recorded_read_bytes))
                    .await?;
            let sha256 = crate::trajectory::sha256_hex(&data);
            let key = serde_json::json!({"path": path, "mode": mode, "sha256": sha256});
            let size = data.len() as u64;
            let id2 = id.to_string();
            let run = move || async move {
                let _busy = e;
                let body = futures::stream::iter([Ok::<_, axum::Error>(data.clone())]);
                let info = files::upload(&aether, &id2, &p, mode, parents, body, max).await?;
                let data = Some(data);
                Ok(Written {
                    info,
                    sha256,
                    size,
                    data,
                })
            };
            self.traj
                .call(id, step, "write_file", request.clone(), key, run)
                .await?
        } else {
            let (body, hashed) = hooks::hashing(body);
            let id2 = id.to_string();
            let run = move || async move {
                let _busy = e;
                let info = files::upload(&aether, &id2, &p, mode, parents, body, max).await?;
                let (sha256, size) = hashed.finish();
                Ok(Written {
                    info,
                    sha256,
                    size,
                    data: None,
                })
            };
            self.traj
                .call(id, None, "write_file", request.clone(), request, run)
                .await?
        };
        Ok((a.value.info, a.replayed))
    }

    /// Downloads a file; with a `step` the content is read whole and recorded so that the
    /// step answers the same bytes again.
    pub async fn read_file(
        &self,
        id: &str,
        path: &str,
        step: Option<u64>,
    ) -> Result<(Download, bool), EdgeError> {
        use crate::trajectory::hooks;
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path});
        if step.is_none() {
            let r = files::download(&e.0.aether, id, path).await;
            let result = r
                .as_ref()
                .map(|d| serde_json::json!({"mode": d.mode, "size": d.size}));
            self.traj.note(id, "read_file", request, result);
            return r.map(|d| (d, false));
        }
        let max = self.traj.config().max_recorded_read_bytes;
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move {
            let d = files::download(&e.0.aether, &id2, &p).await?;
            hooks::collect_download(d, max).await
        };
        let a = self
            .traj
            .call(id, step, "read_file", request.clone(), request, run)
            .await?;
        Ok((hooks::content_download(a.value), a.replayed))
    }

    pub async fn stat_file(
        &self,
        id: &str,
        path: &str,
        step: Option<u64>,
    ) -> Result<(FileInfo, bool), EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::stat(&e.0.aether, &id2, &p).await };
        let a = self
            .traj
            .call(id, step, "stat", request.clone(), request, run)
            .await?;
        Ok((a.value, a.replayed))
    }

    pub async fn list_dir(
        &self,
        id: &str,
        path: &str,
        step: Option<u64>,
    ) -> Result<(FileList, bool), EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::list(&e.0.aether, &id2, &p).await };
        let a = self
            .traj
            .call(id, step, "list_files", request.clone(), request, run)
            .await?;
        Ok((a.value, a.replayed))
    }

    pub async fn remove_file(
        &self,
        id: &str,
        path: &str,
        recursive: bool,
        step: Option<u64>,
    ) -> Result<bool, EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path, "recursive": recursive});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::remove(&e.0.aether, &id2, &p, recursive).await };
        let a = self
            .traj
            .call(id, step, "remove", request.clone(), request, run)
            .await?;
        Ok(a.replayed)
    }

    pub async fn mkdir(
        &self,
        id: &str,
        path: &str,
        (mode, parents): (u32, bool),
        step: Option<u64>,
    ) -> Result<(FileInfo, bool), EdgeError> {
        let e = self.touch(id).await?;
        let request = serde_json::json!({"path": path, "mode": mode, "parents": parents});
        let (p, id2) = (path.to_string(), id.to_string());
        let run = move || async move { files::mkdir(&e.0.aether, &id2, &p, mode, parents).await };
        let a = self
            .traj
            .call(id, step, "mkdir", request.clone(), request, run)
            .await?;
        Ok((a.value, a.replayed))
    }

    /// Checks a TTY request and returns the channel to open it on (after the upgrade).
    pub async fn tty_channel(
        &self,
        id: &str,
        rows: u16,
        cols: u16,
    ) -> Result<AetherClient, EdgeError> {
        let e = self.touch(id).await?;
        crate::tty::check_size(rows, cols)?;
        Ok(e.aether.clone())
    }
}
