//! Process handles (`/v1/sandboxes/{id}/processes...`) and file rename.

use std::pin::Pin;

use dsec_wire::api::{
    FileInfo, ProcessEvent, ProcessInfo, ProcessInputRequest, ProcessList, SignalProcessRequest,
    StartProcessRequest,
};
use futures::{Stream, StreamExt, TryStreamExt};
use reqwest::Method;
use url::Url;

use crate::{check, json, Client, ClientError, Result};

/// NDJSON [`ProcessEvent`]s of a process's output.
pub type ProcessEventStream = Pin<Box<dyn Stream<Item = Result<ProcessEvent>> + Send>>;

fn with_query(mut u: Url, query: &[(&str, String)]) -> Url {
    {
        let mut q = u.query_pairs_mut();
        for (k, v) in query {
            q.append_pair(k, v);
        }
    }
    u
}

impl Client {
    fn process_url(&self, id: &str, pid: &str, rest: &[&str]) -> Result<Url> {
        let mut seg = vec!["processes", pid];
        seg.extend_from_slice(rest);
        self.sandbox_url(id, &seg)
    }

    /// `POST .../processes`: starts a process that outlives the call.
    pub async fn start_process(&self, id: &str, req: &StartProcessRequest) -> Result<ProcessInfo> {
        let (b, u) = self.request(Method::POST, self.sandbox_url(id, &["processes"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `GET .../processes`: running handles (`all`: also exited ones still kept).
    pub async fn processes(&self, id: &str, all: bool) -> Result<ProcessList> {
        let u = with_query(
            self.sandbox_url(id, &["processes"])?,
            &[("all", all.to_string())],
        );
        json(self.send(self.request(Method::GET, u)).await?).await
    }

    /// `GET .../processes/{pid}`: one handle by pid or tag.
    pub async fn process(&self, id: &str, pid_or_tag: &str) -> Result<ProcessInfo> {
        let u = self.process_url(id, pid_or_tag, &[])?;
        json(self.send(self.request(Method::GET, u)).await?).await
    }

    /// `POST .../processes/{pid}/wait`: waits up to `timeout_s` for the exit.
    pub async fn wait_process(&self, id: &str, pid: &str, timeout_s: f64) -> Result<ProcessInfo> {
        let u = with_query(
            self.process_url(id, pid, &["wait"])?,
            &[("timeout", timeout_s.to_string())],
        );
        json(self.send(self.request(Method::POST, u)).await?).await
    }

    /// `GET .../processes/{pid}/output`: output events from `offset` (until exit if `follow`).
    pub async fn process_output(
        &self,
        id: &str,
        pid: &str,
        offset: u64,
        follow: bool,
    ) -> Result<ProcessEventStream> {
        let u = with_query(
            self.process_url(id, pid, &["output"])?,
            &[
                ("offset", offset.to_string()),
                ("follow", follow.to_string()),
            ],
        );
        let resp = check(self.send(self.request(Method::GET, u)).await?).await?;
        Ok(ndjson_process_events(resp.bytes_stream()))
    }

    /// `POST .../processes/{pid}/stdin`.
    pub async fn process_stdin(
        &self,
        id: &str,
        pid: &str,
        req: &ProcessInputRequest,
    ) -> Result<ProcessInfo> {
        let (b, u) = self.request(Method::POST, self.process_url(id, pid, &["stdin"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `POST .../processes/{pid}/signal`.
    pub async fn signal_process(
        &self,
        id: &str,
        pid: &str,
        req: &SignalProcessRequest,
    ) -> Result<ProcessInfo> {
        let (b, u) = self.request(Method::POST, self.process_url(id, pid, &["signal"])?);
        json(self.send((b.json(req), u)).await?).await
    }

    /// `POST .../processes/{pid}/kill`: SIGKILL to the whole process group.
    pub async fn kill_process(&self, id: &str, pid: &str) -> Result<ProcessInfo> {
        let u = self.process_url(id, pid, &["kill"])?;
        json(self.send(self.request(Method::POST, u)).await?).await
    }

    /// `POST .../files/rename?src=&dst=&overwrite=`.
    pub async fn rename(
        &self,
        id: &str,
        src: &str,
        dst: &str,
        overwrite: bool,
    ) -> Result<FileInfo> {
        let u = with_query(
            self.sandbox_url(id, &["files", "rename"])?,
            &[
                ("src", src.to_string()),
                ("dst", dst.to_string()),
                ("overwrite", overwrite.to_string()),
            ],
        );
        json(self.send(self.request(Method::POST, u)).await?).await
    }
}

/// Splits a byte stream into NDJSON [`ProcessEvent`]s.
pub fn ndjson_process_events<S, E>(bytes: S) -> ProcessEventStream
where
    S: Stream<Item = std::result::Result<bytes::Bytes, E>> + Send + 'static,
    E: std::fmt::Display + Send + 'static,
{
    let bytes = bytes.map_err(|e| ClientError::Decode(format!("read stream: {e}")));
    let lines = futures::stream::unfold(
        (Box::pin(bytes), Vec::<u8>::new(), false),
        |(mut src, mut buf, done)| async move {
            loop {
                if let Some(pos) = buf.iter().position(|&b| b == b'\n') {
                    let line: Vec<u8> = buf.drain(..=pos).collect();
                    return Some((Ok(line), (src, buf, done)));
                }
                if done {
                    if buf.is_empty() {
                        return None;
                    }
                    let rest = std::mem::take(&mut buf);
                    return Some((Ok(rest), (src, buf, true)));
                }
                match src.next().await {
                    Some(Ok(chunk)) => buf.extend_from_slice(&chunk),
                    Some(Err(e)) => return Some((Err(e), (src, buf, true))),
                    None => {
                        if buf.is_empty() {
                            return None;
                        }
                        let rest = std::mem::take(&mut buf);
                        return Some((Ok(rest), (src, buf, true)));
                    }
                }
            }
        },
    );
    let events = lines.filter_map(|line| async move {
        match line {
            Err(e) => Some(Err(e)),
            Ok(l) if l.iter().all(|b| b.is_ascii_whitespace()) => None,
            Ok(l) => Some(
                serde_json::from_slice::<ProcessEvent>(&l)
                    .map_err(|e| ClientError::Decode(format!("process event: {e}"))),
            ),
        }
    });
    Box::pin(events)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn events_split_across_chunks() {
        let chunks: Vec<std::result::Result<bytes::Bytes, String>> = vec![
            Ok(bytes::Bytes::from_static(
                b"{\"type\":\"stdout\",\"offset\":0,\"da",
            )),
            Ok(bytes::Bytes::from_static(
                b"ta\":\"hi\"}\n\n{\"type\":\"truncated\",\"from\":2,\"to\":5}\n",
            )),
        ];
        let evs: Vec<ProcessEvent> = ndjson_process_events(futures::stream::iter(chunks))
            .try_collect()
            .await
            .unwrap();
        assert_eq!(
            evs,
            vec![
                ProcessEvent::Stdout {
                    offset: 0,
                    data: "hi".into(),
                    data_b64: None
                },
                ProcessEvent::Truncated { from: 2, to: 5 },
            ]
        );
    }
}
