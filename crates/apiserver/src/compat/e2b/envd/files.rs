//! envd's plain HTTP endpoints: `/files` (GET download, POST upload as
//! `application/octet-stream` or `multipart/form-data` with one or many files, `path` and
//! `username` parameters, gzip `Content-Encoding` / `Accept-Encoding`), `/envs` and
//! `/metrics`, onto the native file, exec and metrics endpoints. Errors are E2B's plain shape
//! `{"code": <status>, "message"}`.

use std::io::Write;

use axum::body::Body;
use axum::extract::Request;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use dsec_e2b_envd::connect::ConnectError;
use dsec_wire::api::{CommandResult, FileInfo, SandboxMetrics};
use futures::{SinkExt, StreamExt};
use serde::Deserialize;
use serde_json::json;

use super::native::{q, Native};
use super::{resolve_path, Ctx};
use crate::forward::ForwardBody;

/// An error in envd's plain HTTP shape.
pub fn http_error(status: StatusCode, message: &str) -> Response {
    (
        status,
        [(header::CONTENT_TYPE, "application/json")],
        json!({ "code": status.as_u16(), "message": message }).to_string(),
    )
        .into_response()
}

fn from_connect(e: &ConnectError) -> Response {
    http_error(
        StatusCode::from_u16(e.code.http_status()).unwrap_or(StatusCode::BAD_GATEWAY),
        &e.message,
    )
}

#[derive(Deserialize, Default)]
struct FilesQuery {
    path: Option<String>,
    username: Option<String>,
}

fn files_query(req: &Request) -> Result<FilesQuery, String> {
    let Some(qs) = req.uri().query() else {
        return Ok(FilesQuery::default());
    };
    serde_urlencoded_lite(qs)
}

/// Parses `path` and `username` out of a query string (other parameters are ignored).
fn serde_urlencoded_lite(qs: &str) -> Result<FilesQuery, String> {
    let mut q = FilesQuery::default();
    for pair in qs.split('&').filter(|p| !p.is_empty()) {
        let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
        let v = percent_decode(v)
            .ok_or_else(|| format!("query parameter {k:?} is not valid percent-encoded UTF-8"))?;
        match k {
            "path" => q.path = Some(v),
            "username" => q.username = Some(v).filter(|u| !u.is_empty()),
            _ => {}
        }
    }
    Ok(q)
}

fn percent_decode(s: &str) -> Option<String> {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < b.len() => {
                let h = std::str::from_utf8(&b[i + 1..i + 3]).ok()?;
                out.push(u8::from_str_radix(h, 16).ok()?);
                i += 2;
            }
            b'%' => return None,
            c => out.push(c),
        }
        i += 1;
    }
    String::from_utf8(out).ok()
}

/// A streaming transformation of a body through a gzip encoder or decoder.
trait Gz: Write + Send + 'static {
    fn take(&mut self) -> Vec<u8>;
    fn end(self) -> std::io::Result<Vec<u8>>;
}

impl Gz for flate2::write::GzDecoder<Vec<u8>> {
    fn take(&mut self) -> Vec<u8> {
        std::mem::take(self.get_mut())
    }
    fn end(self) -> std::io::Result<Vec<u8>> {
        self.finish()
    }
}

impl Gz for flate2::write::GzEncoder<Vec<u8>> {
    fn take(&mut self) -> Vec<u8> {
        std::mem::take(self.get_mut())
    }
    fn end(self) -> std::io::Result<Vec<u8>> {
        self.finish()
    }
}

fn through_gz<G, S, E>(input: S, gz: G) -> Body
where
    G: Gz,
    S: futures::Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: std::fmt::Display,
{
    let out = futures::stream::unfold((input, Some(gz)), |(mut input, mut gz)| async move {
        loop {
            let g = gz.as_mut()?;
            match input.next().await {
                Some(Ok(chunk)) => {
                    if let Err(e) = g.write_all(&chunk) {
                        return Some((Err(e), (input, None)));
                    }
                    let out = g.take();
                    if !out.is_empty() {
                        return Some((Ok(Bytes::from(out)), (input, gz)));
                    }
                }
                Some(Err(e)) => {
                    return Some((Err(std::io::Error::other(e.to_string())), (input, None)));
                }
                None => {
                    let g = gz.take()?;
                    return Some((g.end().map(Bytes::from), (input, None)));
                }
            }
        }
    });
    Body::from_stream(out)
}

fn is_gzip(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.trim().eq_ignore_ascii_case("gzip"))
}

fn accepts_gzip(headers: &HeaderMap) -> bool {
    headers
        .get(header::ACCEPT_ENCODING)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| {
            v.split(',').any(|e| {
                e.split(';')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .eq_ignore_ascii_case("gzip")
            })
        })
}

pub async fn download(ctx: Ctx<'_>, req: Request) -> Response {
    let query = match files_query(&req) {
        Ok(q) => q,
        Err(m) => return http_error(StatusCode::BAD_REQUEST, &m),
    };
    let gzip = accepts_gzip(req.headers());
    let r = async {
        let native = Native::new(ctx.st, ctx.id)?;
        let named = query.username.clone().or_else(|| ctx.user.clone());
        let user = super::effective_user(&native, named).await?;
        let path = resolve_path(query.path.as_deref().unwrap_or(""), &user)?;
        let resp = native
            .send(
                Method::GET,
                &format!("/files?path={}", q(&path)),
                &HeaderMap::new(),
                ForwardBody::Empty,
            )
            .await?;
        Ok::<_, ConnectError>((path, resp))
    }
    .await;
    let (path, resp) = match r {
        Ok(x) => x,
        Err(e) => return from_connect(&e),
    };
    let name = path.rsplit('/').next().unwrap_or("file").replace('"', "");
    let mut headers = HeaderMap::new();
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    if let Ok(v) = HeaderValue::from_str(&format!("attachment; filename=\"{name}\"")) {
        headers.insert(header::CONTENT_DISPOSITION, v);
    }
    let body = if gzip {
        headers.insert(header::CONTENT_ENCODING, HeaderValue::from_static("gzip"));
        through_gz(
            resp.bytes_stream(),
            flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()),
        )
    } else {
        if let Some(len) = resp.content_length() {
            headers.insert(header::CONTENT_LENGTH, HeaderValue::from(len));
        }
        Body::from_stream(resp.bytes_stream())
    };
    let mut out = Response::new(body);
    *out.headers_mut() = headers;
    out
}

/// Writes one file from a body stream, gives it to `user`, and answers its E2B description.
async fn write_one(
    native: &Native<'_>,
    user: &str,
    path: &str,
    body: Body,
) -> Result<serde_json::Value, ConnectError> {
    let mut h = HeaderMap::new();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/octet-stream"),
    );
    let resp = native
        .send(
            Method::PUT,
            &format!("/files?path={}&parents=true", q(path)),
            &h,
            ForwardBody::Stream(body),
        )
        .await?;
    let info: Option<FileInfo> = resp.json().await.ok();
    super::filesystem::chown(native, user, path).await?;
    let name = info
        .as_ref()
        .map(|i| i.name.clone())
        .unwrap_or_else(|| path.rsplit('/').next().unwrap_or("").to_string());
    Ok(json!({ "name": name, "type": "file", "path": path }))
}

pub async fn upload(ctx: Ctx<'_>, req: Request) -> Response {
    let query = match files_query(&req) {
        Ok(q) => q,
        Err(m) => return http_error(StatusCode::BAD_REQUEST, &m),
    };
    let native = match Native::new(ctx.st, ctx.id) {
        Ok(n) => n,
        Err(e) => return from_connect(&e),
    };
    let named = query.username.clone().or_else(|| ctx.user.clone());
    let user = match super::effective_user(&native, named).await {
        Ok(u) => u,
        Err(e) => return from_connect(&e),
    };
    let ct = req
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    if !ct.to_ascii_lowercase().starts_with("multipart/form-data") {
        // One file, the body is its content.
        let Some(p) = query.path.as_deref() else {
            return http_error(
                StatusCode::BAD_REQUEST,
                "an octet-stream upload needs the `path` query parameter",
            );
        };
        let path = match resolve_path(p, &user) {
            Ok(p) => p,
            Err(e) => return from_connect(&e),
        };
        let gzip = is_gzip(req.headers());
        let body = req.into_body();
        let body = if gzip {
            through_gz(
                body.into_data_stream(),
                flate2::write::GzDecoder::new(Vec::new()),
            )
        } else {
            body
        };
        return match write_one(&native, &user, &path, body).await {
            Ok(v) => axum::Json(json!([v])).into_response(),
            Err(e) => from_connect(&e),
        };
    }
    let boundary = match multer::parse_boundary(&ct) {
        Ok(b) => b,
        Err(e) => return http_error(StatusCode::BAD_REQUEST, &format!("multipart body: {e}")),
    };
    let mut mp = multer::Multipart::new(req.into_body().into_data_stream(), boundary);
    let mut written = Vec::new();
    let mut fields = 0usize;
    loop {
        let mut field = match mp.next_field().await {
            Ok(Some(f)) => f,
            Ok(None) => break,
            Err(e) => return http_error(StatusCode::BAD_REQUEST, &format!("multipart body: {e}")),
        };
        fields += 1;
        let name = field.file_name().map(str::to_string);
        // The query's path names a single file; with many, each part's file name is its path.
        let target = match (&query.path, name) {
            (Some(p), _) if fields == 1 => p.clone(),
            (_, Some(n)) if !n.is_empty() => n,
            _ => {
                return http_error(
                    StatusCode::BAD_REQUEST,
                    "a multipart part has no file name: give each file's path as its file name, or `path` for one file",
                )
            }
        };
        let path = match resolve_path(&target, &user) {
            Ok(p) => p,
            Err(e) => return from_connect(&e),
        };
        let (mut tx, rx) = futures::channel::mpsc::channel::<Result<Bytes, std::io::Error>>(8);
        // Owns the sender: the upload's body ends when the part does.
        let pump = async move {
            loop {
                match field.chunk().await {
                    Ok(Some(c)) => {
                        if tx.send(Ok(c)).await.is_err() {
                            return Ok(());
                        }
                    }
                    Ok(None) => return Ok(()),
                    Err(e) => {
                        let msg = format!("multipart body: {e}");
                        let _ = tx.send(Err(std::io::Error::other(msg.clone()))).await;
                        return Err(msg);
                    }
                }
            }
        };
        let send = write_one(&native, &user, &path, Body::from_stream(rx));
        let (pumped, sent) = tokio::join!(pump, send);
        if let Err(m) = pumped {
            return http_error(StatusCode::BAD_REQUEST, &m);
        }
        match sent {
            Ok(v) => written.push(v),
            Err(e) => return from_connect(&e),
        }
    }
    axum::Json(serde_json::Value::Array(written)).into_response()
}

/// `GET /envs`: the environment a command starts with, as a JSON object.
pub async fn envs(ctx: Ctx<'_>) -> Response {
    let r = async {
        let native = Native::new(ctx.st, ctx.id)?;
        let user = super::effective_user(&native, ctx.user.clone()).await?;
        let out: CommandResult = native
            .json(
                Method::POST,
                "/exec",
                Some(json!({ "argv": ["env", "-0"], "user": user, "timeout": 30.0 })),
            )
            .await?;
        Ok::<_, ConnectError>(parse_env0(&out.stdout))
    }
    .await;
    match r {
        Ok(m) => axum::Json(m).into_response(),
        Err(e) => from_connect(&e),
    }
}

/// `NAME=value\0...` as a map.
pub fn parse_env0(s: &str) -> std::collections::BTreeMap<String, String> {
    s.split('\0')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

/// `GET /metrics`: the latest sample in envd's shape.
pub async fn metrics(ctx: Ctx<'_>) -> Response {
    let r = async {
        let native = Native::new(ctx.st, ctx.id)?;
        let m: SandboxMetrics = native.json(Method::GET, "/metrics", None).await?;
        Ok::<_, ConnectError>(m)
    }
    .await;
    match r {
        Ok(m) => {
            let Some(s) = m.samples.last() else {
                return axum::Json(json!({})).into_response();
            };
            let cores = s.cpu_limit_cores.max(0.0);
            axum::Json(json!({
                "ts": s.time_ms / 1000,
                "cpu_count": cores.ceil() as u64,
                "cpu_used_pct": if cores > 0.0 { s.cpu_percent / cores } else { s.cpu_percent },
                "mem_total": s.memory_limit_bytes,
                "mem_used": s.memory_bytes,
                "disk_used": s.disk_used_bytes,
                "disk_total": s.disk_limit_bytes,
            }))
            .into_response()
        }
        Err(e) => from_connect(&e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn query_and_env_parsing() {
        let q = serde_urlencoded_lite("path=%2Fhome%2Fuser%2Fa+b.txt&username=user&x=1").unwrap();
        assert_eq!(q.path.as_deref(), Some("/home/user/a b.txt"));
        assert_eq!(q.username.as_deref(), Some("user"));
        assert!(serde_urlencoded_lite("path=%zz").is_err());
        assert!(serde_urlencoded_lite("path=%2").is_err());
        let m = parse_env0("A=1\0B=x=y\0\0");
        assert_eq!(m.get("B").map(String::as_str), Some("x=y"));
        assert_eq!(m.len(), 2);
    }

    #[tokio::test]
    async fn gzip_streams_both_ways() {
        let data: Vec<u8> = (0..200_000u32).map(|i| (i % 251) as u8).collect();
        let chunks: Vec<Result<Bytes, std::io::Error>> = data
            .chunks(7000)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let enc = through_gz(
            futures::stream::iter(chunks),
            flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast()),
        );
        let gz = axum::body::to_bytes(enc, usize::MAX).await.unwrap();
        let mut plain = Vec::new();
        flate2::read::GzDecoder::new(&gz[..])
            .read_to_end(&mut plain)
            .unwrap();
        assert_eq!(plain, data);
        let parts: Vec<Result<Bytes, std::io::Error>> = gz
            .chunks(333)
            .map(|c| Ok(Bytes::copy_from_slice(c)))
            .collect();
        let dec = through_gz(
            futures::stream::iter(parts),
            flate2::write::GzDecoder::new(Vec::new()),
        );
        assert_eq!(axum::body::to_bytes(dec, usize::MAX).await.unwrap(), data);
        // Not gzip: the stream fails instead of passing garbage on.
        let bad = through_gz(
            futures::stream::iter(vec![Ok::<_, std::io::Error>(Bytes::from_static(
                b"plain text",
            ))]),
            flate2::write::GzDecoder::new(Vec::new()),
        );
        assert!(axum::body::to_bytes(bad, usize::MAX).await.is_err());
    }
}
