//! File watch: `Watch` in the sandbox's agent → NDJSON [`FsEvent`] lines.
//!
//! The stream's first line is a `ready` event (the agent's inotify watch is in place), so a
//! client can start changing files as soon as it has read it. Dropping the stream (the client
//! closed the connection) cancels the agent's watch, which closes its inotify instance.

use bytes::Bytes;
use dsec_runtime::aether_client::Call;
use dsec_wire::aether::{Reply, Request};
use dsec_wire::api::{ErrorDetail, FsEvent, FsEventKind};
use futures::stream::BoxStream;
use futures::StreamExt as _;

use crate::commands::cancel_in_background;
use crate::error::{EdgeError, Subject};
use crate::files::check_path;
use crate::manager::AgentLease;

/// An error line at the end of a watch stream.
#[derive(serde::Serialize)]
struct ErrorLine {
    kind: &'static str,
    error: ErrorDetail,
}

fn lines(events: &[FsEvent]) -> Bytes {
    let mut out = Vec::new();
    for e in events {
        if let Ok(v) = serde_json::to_vec(e) {
            out.extend_from_slice(&v);
            out.push(b'\n');
        }
    }
    Bytes::from(out)
}

fn error_line(e: EdgeError) -> Bytes {
    let mut v = serde_json::to_vec(&ErrorLine {
        kind: "error",
        error: e.detail(),
    })
    .unwrap_or_default();
    v.push(b'\n');
    Bytes::from(v)
}

struct WatchState {
    call: Call,
    lease: AgentLease,
    done: bool,
}

impl WatchState {
    /// The agent ended the watch: nothing to cancel.
    fn finish(&mut self) {
        self.done = true;
    }
}

impl Drop for WatchState {
    fn drop(&mut self) {
        if !self.done {
            tracing::debug!(sandbox = %self.lease.sandbox, "watch client went away; ending the watch");
            cancel_in_background(self.lease.client.clone(), self.call.id());
        }
    }
}

/// Starts watching `path`; answers once the watch is in place (or with the agent's error).
pub async fn watch(
    lease: AgentLease,
    path: &str,
    recursive: bool,
) -> Result<BoxStream<'static, Bytes>, EdgeError> {
    check_path(path)?;
    let req = Request::Watch {
        path: path.to_string(),
        recursive,
    };
    let chan = |e| EdgeError::from_channel(&lease.sandbox, Subject::File, e);
    let call = lease.client.call(req, Bytes::new()).await.map_err(chan)?;
    let mut st = WatchState {
        call,
        lease,
        done: false,
    };
    match st.call.next().await {
        Ok(Some((Reply::FsEvents { .. }, _))) => {}
        Ok(Some((Reply::Error(e), _))) => {
            st.done = true;
            return Err(EdgeError::from_aether(Subject::File, e));
        }
        Ok(Some((other, _))) => {
            st.done = true;
            return Err(EdgeError::Internal(format!(
                "sandbox agent answered a watch with {other:?}"
            )));
        }
        Ok(None) => {
            st.done = true;
            return Err(EdgeError::Internal(
                "the watch ended before it started".into(),
            ));
        }
        Err(e) => {
            st.done = true;
            return Err(EdgeError::from_channel(&st.lease.sandbox, Subject::File, e));
        }
    }
    let ready = lines(&[FsEvent {
        kind: FsEventKind::Ready,
        path: path.to_string(),
        to: None,
        is_dir: true,
    }]);
    let rest = futures::stream::unfold(st, |mut st| async move {
        if st.done {
            return None;
        }
        loop {
            match st.call.next().await {
                Ok(Some((Reply::FsEvents { events }, _))) => {
                    if events.is_empty() {
                        continue;
                    }
                    return Some((lines(&events), st));
                }
                Ok(Some((Reply::Done, _))) | Ok(None) => {
                    st.finish();
                    return None;
                }
                Ok(Some((Reply::Error(e), _))) => {
                    st.done = true;
                    return Some((error_line(EdgeError::from_aether(Subject::File, e)), st));
                }
                Ok(Some((other, _))) => {
                    if other.is_terminal() {
                        st.finish();
                        return None;
                    }
                }
                Err(e) => {
                    st.done = true;
                    let err = EdgeError::from_channel(&st.lease.sandbox, Subject::File, e);
                    return Some((error_line(err), st));
                }
            }
        }
    });
    Ok(futures::stream::once(async move { ready })
        .chain(rest)
        .boxed())
}
