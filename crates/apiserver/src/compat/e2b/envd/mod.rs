//! E2B's in-sandbox API ("envd") on the apiserver, translated onto dsec's native sandbox API
//! (issue 19, part 2): the Connect RPC services `process.Process` and
//! `filesystem.Filesystem`, the HTTP `/files` endpoint (download, upload of one or many
//! files), `/health`, `/envs` and `/metrics`.
//!
//! The E2B dispatcher (`compat::e2b`) hands it the requests for a sandbox's envd port
//! (header `E2b-Sandbox-Id`, or the host `49983-{id}.{domain}`) with the `/e2b` prefix
//! already taken off the path. Every call but `/health` is checked by [`super::access`]. The
//! user a call acts as comes from `Authorization: Basic base64("user:")` (RPC) or the
//! `username` query parameter (`/files`), else the sandbox's `init_user`; relative paths are
//! resolved against that user's home. It must not run anything in a sandbox except through
//! the native API on the sandbox's edge.

pub mod files;
pub mod filesystem;
pub mod native;
pub mod process;
pub mod rpc;

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use axum::extract::Request;
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use base64::Engine as _;
use dsec_e2b_envd::connect::{Code, ConnectError};

use crate::routes::AppState;
use native::Native;

/// What a handler needs: the apiserver, the sandbox and the user named by the call.
#[derive(Clone, Copy)]
pub struct Ctx<'a> {
    pub st: &'a AppState,
    pub id: &'a str,
    pub user: &'a Option<String>,
}

/// Serves one envd request for `sandbox_id` (path without the `/e2b` prefix).
pub async fn serve(state: &AppState, sandbox_id: &str, req: Request) -> Response {
    let path = req.uri().path().to_string();
    if path == "/health" {
        return health(state, sandbox_id).await;
    }
    let rpc_call =
        path.starts_with("/process.Process/") || path.starts_with("/filesystem.Filesystem/");
    if let Err(e) = super::access::check(state, sandbox_id, req.headers()).await {
        let (status, code) = match e {
            super::access::EnvdAccessError::SandboxNotFound(_) => {
                (StatusCode::NOT_FOUND, Code::NotFound)
            }
            super::access::EnvdAccessError::Unavailable(_) => {
                (StatusCode::SERVICE_UNAVAILABLE, Code::Unavailable)
            }
            _ => (StatusCode::UNAUTHORIZED, Code::Unauthenticated),
        };
        tracing::info!(sandbox_id, %path, error = %e, "e2b envd call refused");
        return if rpc_call {
            rpc::unary_error(&ConnectError::new(code, e.to_string()))
        } else {
            files::http_error(status, &e.to_string())
        };
    }
    let user = basic_user(req.headers());
    let ctx_user = user;
    let ctx = Ctx {
        st: state,
        id: sandbox_id,
        user: &ctx_user,
    };
    if rpc_call {
        if req.method() != Method::POST {
            return rpc::unary_error(&ConnectError::new(
                Code::Unimplemented,
                format!("{} {path}: Connect calls are POST", req.method()),
            ));
        }
        let call = match rpc::call_of(req) {
            Ok(c) => c,
            Err(r) => return *r,
        };
        return match path.as_str() {
            "/process.Process/Start" => process::start(ctx, call).await,
            "/process.Process/Connect" => process::connect(ctx, call).await,
            "/process.Process/List" => process::list(ctx, call).await,
            "/process.Process/Update" => process::update(ctx, call).await,
            "/process.Process/StreamInput" => process::stream_input(ctx, call).await,
            "/process.Process/SendInput" => process::send_input(ctx, call).await,
            "/process.Process/SendSignal" => process::send_signal(ctx, call).await,
            "/process.Process/CloseStdin" => process::close_stdin(ctx, call).await,
            "/filesystem.Filesystem/Stat" => filesystem::stat(ctx, call).await,
            "/filesystem.Filesystem/MakeDir" => filesystem::make_dir(ctx, call).await,
            "/filesystem.Filesystem/Move" => filesystem::move_entry(ctx, call).await,
            "/filesystem.Filesystem/ListDir" => filesystem::list_dir(ctx, call).await,
            "/filesystem.Filesystem/Remove" => filesystem::remove(ctx, call).await,
            "/filesystem.Filesystem/WatchDir" => filesystem::watch_dir(ctx, call).await,
            "/filesystem.Filesystem/CreateWatcher" => filesystem::create_watcher(ctx, call).await,
            "/filesystem.Filesystem/GetWatcherEvents" => {
                filesystem::get_watcher_events(ctx, call).await
            }
            "/filesystem.Filesystem/RemoveWatcher" => filesystem::remove_watcher(ctx, call).await,
            other => rpc::error_for(
                call.kind,
                &ConnectError::new(Code::Unimplemented, format!("no RPC {other}")),
            ),
        };
    }
    match (req.method().clone(), path.as_str()) {
        (Method::GET, "/files") => files::download(ctx, req).await,
        (Method::POST, "/files") => files::upload(ctx, req).await,
        (Method::GET, "/envs") => files::envs(ctx).await,
        (Method::GET, "/metrics") => files::metrics(ctx).await,
        (m, p) => files::http_error(
            StatusCode::NOT_FOUND,
            &format!("no envd endpoint {m} {p} (the envd API has /files, /health, /envs, /metrics and the process.Process and filesystem.Filesystem RPCs)"),
        ),
    }
}

async fn health(st: &AppState, id: &str) -> Response {
    let r = async { Native::new(st, id)?.sandbox().await }.await;
    match r {
        Ok(_) => StatusCode::NO_CONTENT.into_response(),
        Err(e) => files::http_error(
            StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::BAD_GATEWAY),
            &e.message,
        ),
    }
}

/// The user of `Authorization: Basic base64("user:")`.
pub fn basic_user(headers: &HeaderMap) -> Option<String> {
    let v = headers.get(header::AUTHORIZATION)?.to_str().ok()?.trim();
    let (scheme, rest) = v.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("basic") {
        return None;
    }
    let raw = base64::engine::general_purpose::STANDARD
        .decode(rest.trim())
        .ok()?;
    let s = String::from_utf8(raw).ok()?;
    let user = s.split(':').next().unwrap_or("").trim().to_string();
    (!user.is_empty()).then_some(user)
}

/// The home directory E2B assumes for a user.
pub fn home(user: &str) -> String {
    if user == "root" {
        "/root".into()
    } else {
        format!("/home/{user}")
    }
}

/// An absolute path: relative paths and `~` resolve against the user's home.
pub fn resolve_path(path: &str, user: &str) -> Result<String, ConnectError> {
    if path.is_empty() {
        return Err(ConnectError::new(Code::InvalidArgument, "path is empty"));
    }
    let home = home(user);
    Ok(if path == "~" {
        home
    } else if let Some(rest) = path.strip_prefix("~/") {
        format!("{home}/{rest}")
    } else if path.starts_with('/') {
        path.to_string()
    } else {
        format!("{home}/{path}")
    })
}

const USER_TTL: Duration = Duration::from_secs(300);

fn init_users() -> &'static Mutex<HashMap<String, (String, Instant)>> {
    static U: std::sync::OnceLock<Mutex<HashMap<String, (String, Instant)>>> =
        std::sync::OnceLock::new();
    U.get_or_init(|| Mutex::new(HashMap::new()))
}

/// The user a call acts as: the one it names, else the sandbox's `init_user`.
pub async fn effective_user(
    native: &Native<'_>,
    named: Option<String>,
) -> Result<String, ConnectError> {
    if let Some(u) = named {
        return Ok(u);
    }
    if let Ok(m) = init_users().lock() {
        if let Some((u, at)) = m.get(native.id()) {
            if at.elapsed() < USER_TTL {
                return Ok(u.clone());
            }
        }
    }
    let info = native.sandbox().await?;
    let user = if info.init_user.is_empty() {
        "root".to_string()
    } else {
        info.init_user
    };
    if let Ok(mut m) = init_users().lock() {
        if m.len() > 10_000 {
            m.clear();
        }
        m.insert(native.id().to_string(), (user.clone(), Instant::now()));
    }
    Ok(user)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn users_and_paths() {
        let mut h = HeaderMap::new();
        assert_eq!(basic_user(&h), None);
        h.insert(header::AUTHORIZATION, "Basic dXNlcjo=".parse().unwrap());
        assert_eq!(basic_user(&h).as_deref(), Some("user"));
        h.insert(header::AUTHORIZATION, "Bearer dsk_x".parse().unwrap());
        assert_eq!(basic_user(&h), None);
        assert_eq!(resolve_path("a/b", "user").unwrap(), "/home/user/a/b");
        assert_eq!(resolve_path("~/x", "root").unwrap(), "/root/x");
        assert_eq!(resolve_path("/etc", "user").unwrap(), "/etc");
        assert!(resolve_path("", "user").is_err());
    }
}
