//! The apiserver against a tiny fake edge made with axum in this test (canned `/edge/v1`
//! answers). A unit-level test of auth, routing, streaming and error pass-through; end-to-end
//! tests with a real edge live elsewhere.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use axum::body::Body;
use axum::extract::ws::{Message, WebSocketUpgrade};
use axum::extract::{Path, Request, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get, post};
use axum::{Json, Router};
use bytes::Bytes;
use dsec_apiserver::{ApiConfig, ApiServer, EdgeEndpoint};
use dsec_wire::api::*;
use futures::{SinkExt, StreamExt};

const EDGE_TOKEN: &str = "edge-secret";
const NODE: &str = "n7";
const ID: &str = "sb-n7-00000000000000aa";

type ChunkRx = futures::channel::mpsc::Receiver<Result<Bytes, std::io::Error>>;

#[derive(Clone, Default)]
struct Fake {
    /// Authorization headers the fake edge saw.
    auths: Arc<Mutex<Vec<String>>>,
    /// Signals the first uploaded chunk.
    first_chunk: Arc<Mutex<Option<tokio::sync::oneshot::Sender<()>>>>,
    /// Feeds the download body.
    download: Arc<Mutex<Option<ChunkRx>>>,
    /// Paths requested.
    paths: Arc<Mutex<Vec<String>>>,
}

fn info(id: &str) -> SandboxInfo {
    SandboxInfo {
        id: id.to_string(),
        node: NODE.to_string(),
        state: SandboxState::Running,
        substrate: Substrate::Container,
        image: "busybox".into(),
        memory_limit_mb: 1024,
        cpu_cores_limit: 1.0,
        pids_limit: 1024,
        init_user: "root".into(),
        hostname: "h".into(),
        ttl_running_stop: None,
        ttl_total: None,
        network_rules: BTreeMap::new(),
        labels: BTreeMap::new(),
        created_at: "2024-01-01T00:00:00Z".into(),
        create_ms: Some(1.0),
        reason: None,
        ..Default::default()
    }
}

fn edge_err(status: StatusCode, code: &str, msg: &str) -> Response {
    (
        status,
        Json(ErrorBody {
            error: ErrorDetail {
                code: code.into(),
                message: msg.into(),
            },
        }),
    )
        .into_response()
}

async fn edge_auth(State(f): State<Fake>, req: Request, next: axum::middleware::Next) -> Response {
    let auth = req
        .headers()
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_string();
    f.auths.lock().unwrap().push(auth.clone());
    f.paths.lock().unwrap().push(
        req.uri()
            .path_and_query()
            .map(|p| p.to_string())
            .unwrap_or_default(),
    );
    if auth != format!("Bearer {EDGE_TOKEN}") {
        return edge_err(StatusCode::UNAUTHORIZED, "unauthorized", "bad edge token");
    }
    next.run(req).await
}

fn fake_edge(f: Fake) -> Router {
    Router::new()
        .route(
            "/edge/v1/status",
            get(|| async {
                Json(NodeStatus {
                    node: NODE.into(),
                    url: "http://fake".into(),
                    healthy: true,
                    substrates: vec![Substrate::Container],
                    capacity_sandboxes: 10,
                    ..Default::default()
                })
            }),
        )
        .route(
            "/edge/v1/sandboxes",
            post(|Json(req): Json<CreateSandboxRequest>| async move {
                let mut i = info("sb-n7-00000000000000bb");
                i.image = req.image;
                (StatusCode::CREATED, Json(i))
            })
            .get(|| async {
                Json(SandboxList {
                    sandboxes: vec![info(ID)],
                })
            }),
        )
        .route(
            "/edge/v1/sandboxes/{id}",
            get(|Path(id): Path<String>| async move {
                if id == ID {
                    Json(info(&id)).into_response()
                } else {
                    edge_err(
                        StatusCode::NOT_FOUND,
                        "sandbox_not_found",
                        "the edge's own words",
                    )
                }
            }),
        )
        .route(
            "/edge/v1/sandboxes/{id}/shell",
            post(|body: Bytes| async move {
                let req: RunShellRequest = serde_json::from_slice(&body).unwrap();
                Json(CommandResult {
                    exit_code: 0,
                    stdout: format!("ran {}", req.cmd),
                    ..Default::default()
                })
            }),
        )
        .route(
            "/edge/v1/sandboxes/{id}/files",
            any(
                |State(f): State<Fake>, headers: HeaderMap, req: Request| async move {
                    if req.method() == axum::http::Method::PUT {
                        let declared = headers
                            .get("content-length")
                            .and_then(|v| v.to_str().ok())
                            .map(|s| s.to_string());
                        let mut stream = req.into_body().into_data_stream();
                        let mut n = 0u64;
                        while let Some(chunk) = stream.next().await {
                            let chunk = chunk.unwrap();
                            if n == 0 && !chunk.is_empty() {
                                if let Some(tx) = f.first_chunk.lock().unwrap().take() {
                                    let _ = tx.send(());
                                }
                            }
                            n += chunk.len() as u64;
                        }
                        Json(FileInfo {
                            path: declared.unwrap_or_default(),
                            name: "f".into(),
                            kind: FileKind::File,
                            size: n,
                            mode: 0o644,
                            uid: 0,
                            gid: 0,
                            mtime: 0,
                            link_target: None,
                        })
                        .into_response()
                    } else {
                        let rx = f.download.lock().unwrap().take().unwrap();
                        Response::builder()
                            .header("x-dsec-mode", "0755")
                            .header("content-type", "application/octet-stream")
                            .body(Body::from_stream(rx))
                            .unwrap()
                    }
                },
            ),
        )
        .route(
            "/edge/v1/sandboxes/{id}/tty",
            get(|ws: WebSocketUpgrade| async move {
                ws.on_upgrade(|mut socket| async move {
                    while let Some(Ok(msg)) = socket.recv().await {
                        match msg {
                            Message::Binary(b) => {
                                let mut out = b"echo:".to_vec();
                                out.extend_from_slice(&b);
                                if socket.send(Message::Binary(out.into())).await.is_err() {
                                    break;
                                }
                            }
                            Message::Text(t) if t.as_str().contains("resize") => {
                                let _ = socket
                                    .send(Message::Text(
                                        serde_json::to_string(&TtyControl::Exit { code: 3 })
                                            .unwrap()
                                            .into(),
                                    ))
                                    .await;
                                break;
                            }
                            Message::Close(_) => break,
                            _ => {}
                        }
                    }
                })
            }),
        )
        .route(
            "/edge/v1/images/{*name}",
            any(|Path(name): Path<String>| async move { Json(serde_json::json!({"name": name})) }),
        )
        .layer(axum::middleware::from_fn_with_state(f.clone(), edge_auth))
        .with_state(f)
}

async fn serve(router: Router) -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(l, router).await.unwrap() });
    addr
}

async fn free_port() -> SocketAddr {
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    l.local_addr().unwrap()
}

struct Setup {
    api: ApiServer,
    key: String,
    fake: Fake,
    _dir: tempfile::TempDir,
}

async fn setup() -> Setup {
    let fake = Fake::default();
    let edge = serve(fake_edge(fake.clone())).await;
    let dead = free_port().await; // nothing listens there
    let dir = tempfile::tempdir().unwrap();
    let cfg = ApiConfig {
        listen: "127.0.0.1:0".parse().unwrap(),
        db_path: dir.path().join("api.db"),
        edges: vec![
            EdgeEndpoint {
                node_id: None, // learned from status
                url: format!("http://{edge}"),
                token: EDGE_TOKEN.into(),
            },
            EdgeEndpoint {
                node_id: Some("n9".into()),
                url: format!("http://{dead}"),
                token: "x".into(),
            },
        ],
        watcher_period_ms: 200,
        ..Default::default()
    };
    let api = ApiServer::start(cfg).await.unwrap();
    let key = api.bootstrap_key().unwrap().to_string();
    Setup {
        api,
        key,
        fake,
        _dir: dir,
    }
}

async fn error_of(resp: reqwest::Response) -> (u16, ErrorDetail) {
    let status = resp.status().as_u16();
    let body: ErrorBody = resp.json().await.expect("ErrorBody");
    (status, body.error)
}

#[tokio::test]
async fn auth_routing_and_errors() {
    let s = setup().await;
    let url = s.api.url();
    let http = reqwest::Client::new();

    // 401 without / with a wrong key, on every kind of route.
    for path in ["/v1/sandboxes", "/v1/nodes", &format!("/v1/sandboxes/{ID}")] {
        let (st, e) = error_of(http.get(format!("{url}{path}")).send().await.unwrap()).await;
        assert_eq!((st, e.code.as_str()), (401, "unauthorized"), "{path}");
        assert!(e.message.contains("DSEC_API_KEY"), "{}", e.message);
        let (st, _) = error_of(
            http.get(format!("{url}{path}"))
                .bearer_auth("dsk_00000000000000000000000000000000")
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!(st, 401);
    }
    // Unauthenticated routes.
    assert_eq!(
        http.get(format!("{url}/healthz"))
            .send()
            .await
            .unwrap()
            .status(),
        200
    );
    let m = http
        .get(format!("{url}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(m.contains("dsec_api_requests_total"), "{m}");

    let c = dsec_client::Client::new(&url, &s.key).unwrap();
    // Routing by node id, with the edge's token.
    let got = c.get(ID).await.unwrap();
    assert_eq!(got.id, ID);
    assert!(s
        .fake
        .auths
        .lock()
        .unwrap()
        .iter()
        .all(|a| a == &format!("Bearer {EDGE_TOKEN}")));
    // Edge ErrorBody passes through unchanged.
    let e = c.get("sb-n7-00000000000000cc").await.unwrap_err();
    match e {
        dsec_client::ClientError::Api {
            status,
            code,
            message,
        } => {
            assert_eq!(
                (status, code.as_str(), message.as_str()),
                (404, "sandbox_not_found", "the edge's own words")
            );
        }
        other => panic!("{other:?}"),
    }
    // Malformed id: 404 here.
    for bad in ["nope", "sb-N7-00000000000000aa", "sb-n7-xyz"] {
        let (st, e) = error_of(
            http.get(format!("{url}/v1/sandboxes/{bad}"))
                .bearer_auth(&s.key)
                .send()
                .await
                .unwrap(),
        )
        .await;
        assert_eq!((st, e.code.as_str()), (404, "sandbox_not_found"), "{bad}");
    }
    // A node no configured edge is: the sandbox does not exist (404). A known edge that
    // does not answer: 503 node_unavailable.
    let e = c.get("sb-n5-00000000000000aa").await.unwrap_err();
    assert_eq!(e.code(), Some("sandbox_not_found"), "{e}");
    let e = c.get("sb-n9-00000000000000aa").await.unwrap_err();
    assert_eq!(e.code(), Some("node_unavailable"), "{e}");
    if let dsec_client::ClientError::Api {
        status, message, ..
    } = e
    {
        assert_eq!(status, 503);
        assert!(message.contains("unreachable"), "{message}");
    }
    // Create goes to the healthy edge; the list merges (the dead edge is flagged).
    let created = c
        .create(&CreateSandboxRequest {
            image: "busybox".into(),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(created.node, NODE);
    let resp = http
        .get(format!("{url}/v1/sandboxes"))
        .bearer_auth(&s.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.headers().get("x-dsec-partial").unwrap(), "n9");
    let list: SandboxList = resp.json().await.unwrap();
    assert_eq!(list.sandboxes.len(), 1);
    // Bad create body: our ErrorBody 400 with serde's message.
    let (st, e) = error_of(
        http.post(format!("{url}/v1/sandboxes"))
            .bearer_auth(&s.key)
            .header("content-type", "application/json")
            .body(r#"{"image":"x","bogus":1}"#)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((st, e.code.as_str()), (400, "bad_request"));
    assert!(e.message.contains("bogus"), "{}", e.message);
    // 1 MB shell command: 413 at the apiserver.
    let big = serde_json::to_vec(&RunShellRequest {
        cmd: "x".repeat(1 << 20),
        ..Default::default()
    })
    .unwrap();
    let (st, e) = error_of(
        http.post(format!("{url}/v1/sandboxes/{ID}/shell"))
            .bearer_auth(&s.key)
            .header("content-type", "application/json")
            .body(big)
            .send()
            .await
            .unwrap(),
    )
    .await;
    assert_eq!((st, e.code.as_str()), (413, "payload_too_large"));
    // A normal shell call.
    let r = c
        .run_shell(
            ID,
            &RunShellRequest {
                cmd: "echo hi".into(),
                ..Default::default()
            },
        )
        .await
        .unwrap();
    assert_eq!(r.stdout, "ran echo hi");
    // Images: names with '/' and ':' reach the edge encoded, and come back decoded.
    let v: serde_json::Value = http
        .delete(format!("{url}/v1/images/swe%2Fsphinx:official"))
        .bearer_auth(&s.key)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(v["name"], "swe/sphinx:official");
    // Nodes: the watcher's view.
    let nodes = c.nodes().await.unwrap();
    let n7 = nodes.nodes.iter().find(|n| n.node == NODE).unwrap();
    assert!(n7.healthy);
    let n9 = nodes.nodes.iter().find(|n| n.node == "n9").unwrap();
    assert!(!n9.healthy);
    // Unknown route: ErrorBody 404.
    let (st, e) = error_of(http.get(format!("{url}/v2/x")).send().await.unwrap()).await;
    assert_eq!((st, e.code.as_str()), (404, "not_found"));
    s.api.shutdown().await;
}

#[tokio::test]
async fn bodies_stream_without_buffering() {
    let s = setup().await;
    let url = s.api.url();
    let http = reqwest::Client::new();

    // Upload: the edge must see the first chunk while the client still holds the rest.
    let (first_tx, first_rx) = tokio::sync::oneshot::channel();
    *s.fake.first_chunk.lock().unwrap() = Some(first_tx);
    let (mut body_tx, body_rx) =
        futures::channel::mpsc::channel::<Result<Bytes, std::io::Error>>(1);
    const CHUNK: usize = 1 << 20;
    const CHUNKS: usize = 64; // 64 MiB in total
    let upload = tokio::spawn({
        let http = http.clone();
        let url = format!("{url}/v1/sandboxes/{ID}/files?path=/big&mode=0644");
        let key = s.key.clone();
        async move {
            http.put(url)
                .bearer_auth(key)
                .header("content-length", (CHUNK * CHUNKS).to_string())
                .body(reqwest::Body::wrap_stream(body_rx))
                .send()
                .await
                .unwrap()
        }
    });
    body_tx
        .send(Ok(Bytes::from(vec![7u8; CHUNK])))
        .await
        .unwrap();
    tokio::time::timeout(Duration::from_secs(10), first_rx)
        .await
        .expect("edge saw the first chunk before the upload finished (no buffering)")
        .unwrap();
    for _ in 1..CHUNKS {
        body_tx
            .send(Ok(Bytes::from(vec![7u8; CHUNK])))
            .await
            .unwrap();
    }
    drop(body_tx);
    let resp = upload.await.unwrap();
    assert_eq!(resp.status(), 200);
    let fi: FileInfo = resp.json().await.unwrap();
    assert_eq!(fi.size, (CHUNK * CHUNKS) as u64);
    assert_eq!(
        fi.path,
        (CHUNK * CHUNKS).to_string(),
        "content-length passed on"
    );

    // Download: the client gets the first chunk while the edge still holds the rest.
    let (mut down_tx, down_rx) = futures::channel::mpsc::channel(1);
    *s.fake.download.lock().unwrap() = Some(down_rx);
    down_tx
        .send(Ok(Bytes::from_static(b"first")))
        .await
        .unwrap();
    let resp = http
        .get(format!("{url}/v1/sandboxes/{ID}/files?path=/big"))
        .bearer_auth(&s.key)
        .send()
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    assert_eq!(resp.headers().get("x-dsec-mode").unwrap(), "0755");
    let mut stream = resp.bytes_stream();
    let first = tokio::time::timeout(Duration::from_secs(10), stream.next())
        .await
        .expect("first chunk arrives before the edge finished (no buffering)")
        .unwrap()
        .unwrap();
    assert_eq!(&first[..], b"first");
    down_tx
        .send(Ok(Bytes::from_static(b"second")))
        .await
        .unwrap();
    drop(down_tx);
    let rest: Vec<u8> = stream.map(|c| c.unwrap().to_vec()).concat().await;
    assert_eq!(&rest[..], b"second");
    // Query strings reach the edge unchanged.
    assert!(s
        .fake
        .paths
        .lock()
        .unwrap()
        .iter()
        .any(|p| p == &format!("/edge/v1/sandboxes/{ID}/files?path=/big&mode=0644")));
    s.api.shutdown().await;
}

#[tokio::test]
async fn tty_websocket_is_pumped() {
    let s = setup().await;
    let c = dsec_client::Client::new(&s.api.url(), &s.key).unwrap();
    let mut ws = c.tty(ID, 24, 80, None).await.unwrap();
    use dsec_client::tokio_tungstenite::tungstenite::Message as M;
    ws.send(M::binary(b"ls\n".to_vec())).await.unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    assert_eq!(got.into_data().as_ref(), b"echo:ls\n");
    ws.send(M::text(
        serde_json::to_string(&TtyControl::Resize { rows: 1, cols: 2 }).unwrap(),
    ))
    .await
    .unwrap();
    let got = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    let ctl: TtyControl = serde_json::from_str(got.to_text().unwrap()).unwrap();
    assert!(matches!(ctl, TtyControl::Exit { code: 3 }));
    // Errors before the upgrade come back as ErrorBody.
    let e = c.tty("sb-n7-zz", 24, 80, None).await.unwrap_err();
    assert_eq!(e.code(), Some("sandbox_not_found"));
    s.api.shutdown().await;
}

#[tokio::test]
async fn openapi_lists_every_route() {
    let s = setup().await;
    let doc: serde_json::Value = reqwest::get(format!("{}/openapi.json", s.api.url()))
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let paths = doc["paths"].as_object().unwrap();
    let expect = [
        ("/v1/sandboxes", &["post", "get"][..]),
        ("/v1/sandboxes/{id}", &["get", "delete"]),
        ("/v1/sandboxes/{id}/shell", &["post"]),
        ("/v1/sandboxes/{id}/exec", &["post"]),
        ("/v1/sandboxes/{id}/sessions/{name}", &["delete"]),
        ("/v1/sandboxes/{id}/files", &["put", "get", "delete"]),
        ("/v1/sandboxes/{id}/files/list", &["get"]),
        ("/v1/sandboxes/{id}/files/stat", &["get"]),
        ("/v1/sandboxes/{id}/files/mkdir", &["post"]),
        ("/v1/sandboxes/{id}/tty", &["get"]),
        ("/v1/images", &["get"]),
        ("/v1/images/{name}", &["put", "delete"]),
        ("/v1/nodes", &["get"]),
        ("/openapi.json", &["get"]),
        ("/healthz", &["get"]),
        ("/metrics", &["get"]),
    ];
    for (p, methods) in expect {
        let item = paths.get(p).unwrap_or_else(|| panic!("{p} missing"));
        for m in methods {
            assert!(item.get(*m).is_some(), "{m} {p} missing");
        }
    }
    // Routes added by later features (pause, jobs, network, trajectory, pack_diff, ...) are
    // documented too: each must be a public path with at least one operation and a response.
    for (p, item) in paths {
        assert!(
            p.starts_with("/v1/")
                || p.starts_with("/sandboxfusion/")
                || p.starts_with("/e2b/")
                || expect.iter().any(|(e, _)| e == p),
            "unexpected path {p}"
        );
        let ops = item.as_object().unwrap();
        assert!(
            ops.values().any(|op| op.get("responses").is_some()),
            "{p} has no operation with responses"
        );
    }
    // Every $ref resolves.
    let text = doc.to_string();
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for part in text.split("#/components/schemas/").skip(1) {
        let name: String = part.chars().take_while(|c| c.is_alphanumeric()).collect();
        assert!(schemas.contains_key(&name), "dangling $ref {name}");
    }
    s.api.shutdown().await;
}
