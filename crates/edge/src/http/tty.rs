//! `GET /edge/v1/sandboxes/{id}/tty?rows=&cols=` (WebSocket).

use axum::extract::ws::{
    rejection::WebSocketUpgradeRejection, CloseFrame, Message, Utf8Bytes, WebSocketUpgrade,
};
use axum::extract::State;
use axum::response::Response;
use serde::Deserialize;

use super::{ApiPath, ApiQuery, AppState};
use crate::error::EdgeError;
use crate::tty::{self, DEFAULT_COLS, DEFAULT_ROWS};

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TtyQuery {
    rows: Option<u16>,
    cols: Option<u16>,
    /// Accepted for API compatibility; every TTY gets its own login shell.
    #[allow(dead_code)]
    session: Option<String>,
}

pub async fn open(
    State(s): State<AppState>,
    ApiPath(id): ApiPath<String>,
    ApiQuery(q): ApiQuery<TtyQuery>,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Result<Response, EdgeError> {
    let (rows, cols) = (
        q.rows.unwrap_or(DEFAULT_ROWS),
        q.cols.unwrap_or(DEFAULT_COLS),
    );
    let client = s.mgr.tty_channel(&id, rows, cols).await?;
    let ws = ws.map_err(|r| {
        EdgeError::BadRequest(format!("expected a WebSocket upgrade: {}", r.body_text()))
    })?;
    Ok(ws.on_upgrade(move |mut socket| async move {
        match tty::open(client, &id, rows, cols).await {
            Ok(t) => tty::bridge(socket, t).await,
            Err(e) => {
                let reason: String = e.to_string().chars().take(120).collect();
                let _ = socket
                    .send(Message::Close(Some(CloseFrame {
                        code: 1011,
                        reason: Utf8Bytes::from(reason),
                    })))
                    .await;
            }
        }
    }))
}
