//! `GET /edge/v1/sandboxes/{id}/ports/{port}/tunnel` (`Upgrade: dsec-tunnel`): a byte stream
//! to a TCP port inside the sandbox, for the apiserver's exposed-port proxy.

use axum::extract::{Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;

use super::{ApiPath, AppState};
use crate::error::EdgeError;
use crate::ports::{self, PUBLIC_ONLY_HEADER, TUNNEL_PROTOCOL};

pub async fn tunnel(
    State(s): State<AppState>,
    ApiPath((id, port)): ApiPath<(String, u16)>,
    mut req: Request,
) -> Result<Response, EdgeError> {
    if port == 0 {
        return Err(EdgeError::BadRequest(
            "port 0 is not a TCP port (use 1..=65535)".into(),
        ));
    }
    let wants = req
        .headers()
        .get(header::UPGRADE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.eq_ignore_ascii_case(TUNNEL_PROTOCOL));
    if !wants {
        return Err(EdgeError::BadRequest(format!(
            "the port tunnel needs `Connection: upgrade` and `Upgrade: {TUNNEL_PROTOCOL}`"
        )));
    }
    let public_only = req.headers().contains_key(PUBLIC_ONLY_HEADER);
    let target = s.mgr.port_target(&id).await?;
    ports::check_public(&id, port, &target, public_only)?;
    // Connect before answering: a dead port is a 502 naming it, not a broken upgrade.
    let sock = ports::connect(&id, target.pid, port).await?;
    let upgrade = hyper::upgrade::on(&mut req);
    let gauge = s.mgr.metrics().port_tunnels_open.clone();
    let (mgr, live_id) = (s.mgr.clone(), id.clone());
    ports::bridge(
        gauge,
        move || mgr.is_live(&live_id),
        id,
        port,
        upgrade,
        sock,
    );
    let mut resp = Response::new(axum::body::Body::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let h = resp.headers_mut();
    h.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    h.insert(header::UPGRADE, HeaderValue::from_static(TUNNEL_PROTOCOL));
    Ok(resp)
}
