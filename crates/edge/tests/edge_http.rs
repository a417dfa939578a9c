//! End-to-end test of the edge HTTP API on real containers: starts an edge on 127.0.0.1:0
//! with a temporary data dir, creates a `busybox` sandbox, runs commands (plain, streamed,
//! cancelled), round-trips files, opens a TTY, checks the error answers, kills a sandbox from
//! outside, stops, shuts down and restarts over leftovers — and checks that sandbox dirs,
//! cgroups and mounts are gone.
//!
//! Needs root and the static aether binary (`DSEC_AETHER`, or built by `scripts/build.sh`);
//! skips with a printed reason otherwise.

use std::path::{Path, PathBuf};
use std::time::Duration;

use base64::Engine as _;
use dsec_edge::{Edge, EdgeConfig};
use dsec_wire::api::{
    CommandResult, ErrorBody, FileInfo, FileList, NodeStatus, SandboxInfo, SandboxState,
    StreamEvent,
};
use futures::{SinkExt as _, StreamExt as _};
use serde_json::json;

fn skip_reason() -> Option<String> {
    if !nix::unistd::geteuid().is_root() {
        return Some("needs root (namespaces, cgroups, mounts)".into());
    }
    if let Err(tried) = EdgeConfig::default().resolve_aether_path() {
        return Some(format!("aether binary not built (set DSEC_AETHER or run scripts/build.sh); looked at {tried:?}"));
    }
    if !Path::new("/sys/fs/cgroup/memory").is_dir()
        && !Path::new("/sys/fs/cgroup/cgroup.controllers").exists()
    {
        return Some("no usable cgroup hierarchy".into());
    }
    None
}

/// Removes what a failed run could leave: the node's cgroups and mounts under the data dir.
struct Cleanup {
    node: String,
    data: PathBuf,
}

impl Drop for Cleanup {
    fn drop(&mut self) {
        for m in mounts_under(&self.data) {
            let _ = nix::mount::umount2(Path::new(&m), nix::mount::MntFlags::MNT_DETACH);
        }
        for c in cgroup_dirs(&self.node) {
            remove_cgroup_tree(&c);
        }
    }
}

/// Removes the network objects of earlier runs of this test that were killed before their
/// edge shut down (each run names its table `dsecr<pid>`, so no later edge reaps them): their
/// spare namespaces, gateway interface and nftables table, when that pid is gone.
fn reap_killed_runs() {
    let out = std::process::Command::new("ip")
        .args(["netns", "list"])
        .output();
    let Ok(out) = out else { return };
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Some(ns) = line.split_whitespace().next() else {
            continue;
        };
        let Some(pid) = ns
            .strip_prefix("dsecr")
            .and_then(|r| r.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        if pid == std::process::id() || Path::new(&format!("/proc/{pid}")).exists() {
            continue;
        }
        let run = |args: &[&str]| {
            let _ = std::process::Command::new(args[0])
                .args(&args[1..])
                .output();
        };
        run(&["ip", "netns", "delete", ns]);
        run(&["ip", "link", "delete", &format!("dsr{pid}")]);
        run(&["nft", "delete", "table", "inet", &format!("dsecr{pid}")]);
    }
}

/// Kills every process left in a cgroup tree, then removes it bottom-up.
fn remove_cgroup_tree(dir: &Path) {
    if let Ok(entries) = std::fs::read_dir(dir) {
        for e in entries.flatten() {
            if e.file_type().map(|t| t.is_dir()).unwrap_or(false) {
                remove_cgroup_tree(&e.path());
            }
        }
    }
    for _ in 0..50 {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        let pids: Vec<i32> = procs
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .collect();
        for pid in &pids {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(*pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        if std::fs::remove_dir(dir).is_ok() || !dir.exists() {
            return;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn cgroup_dirs(node: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(entries) = std::fs::read_dir("/sys/fs/cgroup") {
        for e in entries.flatten() {
            let p = e.path().join("dsec").join(node);
            if p.exists() {
                out.push(p);
            }
        }
    }
    out
}

fn mounts_under(dir: &Path) -> Vec<String> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let prefix = dir.to_string_lossy().to_string();
    text.lines()
        .filter_map(|l| l.split(' ').nth(4).map(str::to_string))
        .filter(|m| m.starts_with(&prefix))
        .collect()
}

struct Api {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Api {
    fn url(&self, p: &str) -> String {
        format!("{}{}", self.base, p)
    }
    fn get(&self, p: &str) -> reqwest::RequestBuilder {
        self.http.get(self.url(p)).bearer_auth(&self.token)
    }
    fn post(&self, p: &str) -> reqwest::RequestBuilder {
        self.http.post(self.url(p)).bearer_auth(&self.token)
    }
    fn put(&self, p: &str) -> reqwest::RequestBuilder {
        self.http.put(self.url(p)).bearer_auth(&self.token)
    }
    fn delete(&self, p: &str) -> reqwest::RequestBuilder {
        self.http.delete(self.url(p)).bearer_auth(&self.token)
    }
    async fn shell(&self, id: &str, body: serde_json::Value) -> CommandResult {
        let r = self
            .post(&format!("/edge/v1/sandboxes/{id}/shell"))
            .json(&body)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 200, "{:?}", r.text().await);
        r.json().await.unwrap()
    }
}

async fn expect_error(r: reqwest::Response, status: u16, code: &str) -> String {
    assert_eq!(r.status().as_u16(), status);
    let body: ErrorBody = r.json().await.expect("error body is an ErrorBody");
    assert_eq!(body.error.code, code, "{}", body.error.message);
    assert!(!body.error.message.is_empty());
    body.error.message
}

async fn start(cfg: EdgeConfig) -> (Edge, Api, tokio::task::JoinHandle<()>) {
    let edge = Edge::start(cfg).await.expect("edge starts");
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let router = edge.router();
    let server = tokio::spawn(async move {
        axum::serve(listener, router).await.unwrap();
    });
    let api = Api {
        http: reqwest::Client::new(),
        base: format!("http://{addr}"),
        token: edge.token().to_string(),
    };
    (edge, api, server)
}

async fn wait_for<F: Fn() -> bool>(what: &str, f: F) {
    for _ in 0..200 {
        if f() {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("timed out waiting for {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn edge_http_end_to_end() {
    if let Some(why) = skip_reason() {
        eprintln!("SKIPPED edge_http_end_to_end: {why}");
        return;
    }
    reap_killed_runs();
    let tmp = tempfile::tempdir().unwrap();
    let node = format!("e{}", std::process::id() % 1_000_000);
    let _cleanup = Cleanup {
        node: node.clone(),
        data: tmp.path().to_path_buf(),
    };
    // Network objects named apart from any other edge on the host (a `dsec up` of the README's
    // setup holds the default table `dsec`; one edge per table gets networking).
    let pid = std::process::id();
    let b36 = |n: u32| char::from(b"0123456789abcdefghijklmnopqrstuvwxyz"[(n % 36) as usize]);
    let network = dsec_network::NetworkConfig {
        subnet_v4: format!("10.{}.0.0/16", 150 + pid % 50),
        subnet_v6: format!("fd00:e2f:{:x}::/64", pid % 65536),
        table: format!("dsecr{pid}"),
        veth_prefix: format!("y{}{}", b36(pid / 36), b36(pid)), // no host interface starts with y
        gateway_interface: format!("dsr{pid}"),
        ..Default::default()
    };
    let cfg = EdgeConfig {
        node_id: node.clone(),
        data_dir: tmp.path().to_path_buf(),
        network,
        ..Default::default()
    };
    let (edge, api, server) = start(cfg.clone()).await;

    // --- open routes, auth ---
    let r = api.http.get(api.url("/healthz")).send().await.unwrap();
    assert_eq!(r.status(), 200);
    let r = api
        .http
        .get(api.url("/edge/v1/status"))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 401, "unauthorized").await;
    assert!(msg.contains("Authorization"), "{msg}");
    let r = api
        .http
        .get(api.url("/edge/v1/status"))
        .bearer_auth("wrong-token-wrong-token")
        .send()
        .await
        .unwrap();
    expect_error(r, 401, "unauthorized").await;
    let status: NodeStatus = api
        .get("/edge/v1/status")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(status.node, node);
    assert!(
        status.images.iter().any(|i| i.starts_with("busybox")),
        "{:?}",
        status.images
    );

    // --- create errors ---
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "no-such-image"}))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 404, "image_not_found").await;
    assert!(
        msg.contains("no-such-image") && msg.contains("import"),
        "{msg}"
    );
    let r = api
        .post("/edge/v1/sandboxes")
        .header("content-type", "application/json")
        .body("{\"image\": \"busybox\",")
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 400, "bad_request").await;
    assert!(msg.contains("line") || msg.contains("EOF"), "{msg}");
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "memroy": 1}))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 400, "bad_request").await;
    assert!(msg.contains("memroy"), "{msg}");
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "substrate": "function"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 501, "unsupported").await;
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "memory_limit_mb": 1u64 << 40}))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 400, "bad_request").await;
    assert!(msg.contains("memory_limit_mb"), "{msg}");

    let r = api
        .post("/edge/v1/sandboxes")
        .header("content-type", "text/plain")
        .body("{\"image\": \"busybox\"}")
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 400, "bad_request").await;
    assert!(msg.contains("application/json"), "{msg}");
    let r = api.get("/edge/v1/nope").send().await.unwrap();
    expect_error(r, 404, "not_found").await;

    // --- a create that fails inside (unknown user) leaves nothing behind ---
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "init_user": "nosuchuser"}))
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let text = r.text().await.unwrap();
    assert!(status >= 400, "{status} {text}");
    assert!(
        text.contains("nosuchuser"),
        "the error names the user: {text}"
    );
    let left: Vec<_> = std::fs::read_dir(tmp.path().join("edge/sandboxes"))
        .unwrap()
        .collect();
    assert!(left.is_empty(), "failed create left {left:?}");
    let st: NodeStatus = api
        .get("/edge/v1/status")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!((st.memory_mb_allocated, st.sandboxes_running), (0, 0));
    for d in cgroup_dirs(&node) {
        let children: Vec<_> = std::fs::read_dir(&d)
            .unwrap()
            .flatten()
            .filter(|e| e.path().is_dir())
            .collect();
        assert!(
            children.is_empty(),
            "failed create left cgroups in {}",
            d.display()
        );
    }

    // --- create ---
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "memory_limit_mb": 256, "cpu_cores_limit": 0.5, "labels": {"job": "t"},
                      "ttl_running_stop": 300, "network_rules": {"pypi": true}}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    let info: SandboxInfo = r.json().await.unwrap();
    assert_eq!(info.state, SandboxState::Running);
    assert_eq!(dsec_wire::id::node_of(&info.id), Some(node.as_str()));
    assert!(info.create_ms.unwrap() > 0.0);
    assert_eq!(info.ttl_running_stop, Some(300));
    let id = info.id.clone();
    let sb_dir = tmp.path().join("edge/sandboxes").join(&id);
    assert!(sb_dir.join("record.json").is_file());
    let got: SandboxInfo = api
        .get(&format!("/edge/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(got.labels.get("job").map(String::as_str), Some("t"));

    // --- shell ---
    let res = api
        .shell(
            &id,
            json!({"cmd": "echo hello; echo err >&2; cd /tmp; (exit 3)"}),
        )
        .await;
    assert_eq!(res.exit_code, 3);
    assert_eq!(res.stdout, "hello\n");
    assert_eq!(res.stderr, "err\n");
    let res = api.shell(&id, json!({"cmd": "pwd"})).await;
    assert_eq!(res.stdout, "/tmp\n", "the session keeps its cwd");
    let res = api
        .shell(&id, json!({"cmd": "printf '\\377\\376ok'"}))
        .await;
    assert_eq!(
        res.stdout_b64.as_deref(),
        Some(
            base64::engine::general_purpose::STANDARD
                .encode(b"\xff\xfeok")
                .as_str()
        )
    );
    assert!(res.stdout.ends_with("ok"));
    assert!(res.stdout_b64.is_some() && res.stderr_b64.is_none());

    // --- exec ---
    let r = api
        .post(&format!("/edge/v1/sandboxes/{id}/exec"))
        .json(&json!({"argv": ["cat"], "stdin_b64": base64::engine::general_purpose::STANDARD.encode(b"from stdin")}))
        .send()
        .await
        .unwrap();
    let res: CommandResult = r.json().await.unwrap();
    assert_eq!(res.stdout, "from stdin");
    let r = api
        .post(&format!("/edge/v1/sandboxes/{id}/exec"))
        .json(&json!({"argv": []}))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, "bad_request").await;

    // --- size limits ---
    let big = "x".repeat(1024 * 1024);
    let r = api
        .post(&format!("/edge/v1/sandboxes/{id}/shell"))
        .json(&json!({"cmd": big}))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 413, "payload_too_large").await;
    assert!(
        msg.contains(&dsec_wire::api::limits::MAX_JSON_BODY.to_string()),
        "{msg}"
    );
    let r = api
        .post(&format!("/edge/v1/sandboxes/{id}/shell"))
        .json(&json!({"cmd": "x".repeat(300 * 1024)}))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 413, "payload_too_large").await;
    assert!(
        msg.contains(&dsec_wire::api::limits::MAX_CMD_BYTES.to_string()),
        "{msg}"
    );

    // --- streaming ---
    let r = api
        .post(&format!("/edge/v1/sandboxes/{id}/shell"))
        .json(&json!({"cmd": "echo a; sleep 0.2; echo b >&2; (exit 4)", "stream": true}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let text = r.text().await.unwrap();
    let events: Vec<StreamEvent> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert!(
        matches!(&events[0], StreamEvent::Stdout { data, .. } if data == "a\n"),
        "{text}"
    );
    assert!(
        events
            .iter()
            .any(|e| matches!(e, StreamEvent::Stderr { data, .. } if data == "b\n")),
        "{text}"
    );
    assert!(
        matches!(events.last(), Some(StreamEvent::Exit { result }) if result.exit_code == 4),
        "{text}"
    );

    // A client that goes away mid-stream cancels the command.
    let mut r = api
        .post(&format!("/edge/v1/sandboxes/{id}/shell"))
        .json(&json!({"cmd": "echo started; sleep 977", "stream": true, "session": "s2"}))
        .send()
        .await
        .unwrap();
    let first = r.chunk().await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&first).contains("started"));
    let probe = json!({"cmd": "ps -o args | grep -c '^sleep 977' || true", "session": "probe"});
    assert_eq!(
        api.shell(&id, probe.clone()).await.stdout.trim(),
        "1",
        "the command runs"
    );
    drop(r);
    let mut gone = false;
    for _ in 0..100 {
        if api.shell(&id, probe.clone()).await.stdout.trim() == "0" {
            gone = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        gone,
        "the streamed command was not cancelled after the client disconnected"
    );

    // --- the memory limit's OOM kills are reported ---
    let res = api
        .shell(&id, json!({"cmd": "head -c 400m /dev/zero | sort > /dev/null", "session": "oom", "timeout": 60}))
        .await;
    assert!(res.oom_killed, "{res:?}");
    let list: dsec_wire::api::SandboxList = api
        .get("/edge/v1/sandboxes")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(list.sandboxes.len(), 1);
    assert_eq!(
        list.sandboxes[0].state,
        SandboxState::Running,
        "the sandbox survives an OOM kill"
    );

    // --- sessions ---
    let r = api
        .delete(&format!("/edge/v1/sandboxes/{id}/sessions/s2"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);

    // --- files ---
    let data: Vec<u8> = (0..(700 * 1024u32)).map(|i| (i % 251) as u8).collect();
    let r = api
        .put(&format!(
            "/edge/v1/sandboxes/{id}/files?path=/work/sub/blob.bin&mode=0640"
        ))
        .body(data.clone())
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let fi: FileInfo = r.json().await.unwrap();
    assert_eq!(fi.size, data.len() as u64);
    assert_eq!(fi.mode, 0o640);
    let r = api
        .get(&format!(
            "/edge/v1/sandboxes/{id}/files?path=/work/sub/blob.bin"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    assert_eq!(r.headers().get("x-dsec-mode").unwrap(), "0640");
    assert_eq!(
        r.headers().get("content-length").unwrap(),
        &data.len().to_string()
    );
    let back = r.bytes().await.unwrap();
    assert!(back[..] == data[..], "file round trip differs");
    let st: FileInfo = api
        .get(&format!(
            "/edge/v1/sandboxes/{id}/files/stat?path=/work/sub/blob.bin"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(st.size, data.len() as u64);
    let ls: FileList = api
        .get(&format!(
            "/edge/v1/sandboxes/{id}/files/list?path=/work/sub"
        ))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(ls.entries.iter().any(|e| e.name == "blob.bin"));
    let r = api
        .post(&format!(
            "/edge/v1/sandboxes/{id}/files/mkdir?path=/work/a/b&parents=true"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{:?}", r.text().await);
    let r = api
        .delete(&format!(
            "/edge/v1/sandboxes/{id}/files?path=/work/sub/blob.bin"
        ))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = api
        .get(&format!(
            "/edge/v1/sandboxes/{id}/files?path=/work/sub/blob.bin"
        ))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "file_not_found").await;
    let r = api
        .get(&format!("/edge/v1/sandboxes/{id}/files?path=relative"))
        .send()
        .await
        .unwrap();
    expect_error(r, 400, "bad_request").await;
    let res = api.shell(&id, json!({"cmd": "ls /work/a"})).await;
    assert_eq!(res.stdout, "b\n");

    // --- tty ---
    {
        use tokio_tungstenite::tungstenite::client::IntoClientRequest as _;
        use tokio_tungstenite::tungstenite::Message;
        let mut req = format!(
            "{}/edge/v1/sandboxes/{id}/tty?rows=30&cols=100",
            api.base.replace("http", "ws")
        )
        .into_client_request()
        .unwrap();
        req.headers_mut().insert(
            "authorization",
            format!("Bearer {}", api.token).parse().unwrap(),
        );
        let (mut ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .expect("tty websocket");
        ws.send(Message::Text(
            r#"{"type":"resize","rows":40,"cols":120}"#.into(),
        ))
        .await
        .unwrap();
        ws.send(Message::Binary(
            b"echo tty-$((40+2)); stty size; exit 7\n".to_vec().into(),
        ))
        .await
        .unwrap();
        let mut out = Vec::new();
        let mut exit = None;
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        while tokio::time::Instant::now() < deadline {
            match tokio::time::timeout(Duration::from_secs(10), ws.next()).await {
                Ok(Some(Ok(Message::Binary(b)))) => out.extend_from_slice(&b),
                Ok(Some(Ok(Message::Text(t)))) => {
                    exit = Some(t.to_string());
                }
                Ok(Some(Ok(Message::Close(_)))) | Ok(None) => break,
                Ok(Some(Ok(_))) => {}
                Ok(Some(Err(e))) => panic!("tty websocket error: {e}"),
                Err(_) => break,
            }
        }
        let out = String::from_utf8_lossy(&out);
        assert!(out.contains("tty-42"), "tty output: {out}");
        assert!(out.contains("40 120"), "resize reached the terminal: {out}");
        let exit = exit.expect("an exit control frame");
        assert!(exit.contains("\"exit\"") && exit.contains('7'), "{exit}");
    }

    // --- unknown sandboxes ---
    let unknown = dsec_wire::id::make_sandbox_id(&node, 1);
    let r = api
        .get(&format!("/edge/v1/sandboxes/{unknown}"))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "sandbox_not_found").await;
    let r = api
        .post("/edge/v1/sandboxes/not-an-id/shell")
        .json(&json!({"cmd": "true"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "sandbox_not_found").await;

    // --- images: import a tar stream, list, remove; in-use images are refused ---
    let mut tarball = tar::Builder::new(Vec::new());
    let content = b"hello from a layer\n";
    let mut h = tar::Header::new_gnu();
    h.set_size(content.len() as u64);
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(0);
    h.set_cksum();
    tarball
        .append_data(&mut h, "etc/greeting", &content[..])
        .unwrap();
    let tarball = tarball.into_inner().unwrap();
    let r = api
        .put("/edge/v1/images/test%2Fmini%3Av1")
        .header("content-type", "application/x-tar")
        .body(tarball)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "{:?}", r.text().await);
    let img: dsec_wire::api::ImageInfo = r.json().await.unwrap();
    assert_eq!(img.name, "test/mini:v1");
    let list: dsec_wire::api::ImageList = api
        .get("/edge/v1/images")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(list.images.iter().any(|i| i.name == "test/mini:v1"));
    let r = api.delete("/edge/v1/images/busybox").send().await.unwrap();
    expect_error(r, 409, "conflict").await;
    let r = api
        .delete("/edge/v1/images/test%2Fmini%3Av1")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 204);
    let r = api
        .delete("/edge/v1/images/test%2Fmini%3Av1")
        .send()
        .await
        .unwrap();
    expect_error(r, 404, "image_not_found").await;

    // --- stop ---
    let cgroups_of = |id: &str| -> Vec<PathBuf> {
        cgroup_dirs(&node)
            .into_iter()
            .map(|d| d.join(id))
            .filter(|p| p.exists())
            .collect()
    };
    assert!(!cgroups_of(&id).is_empty(), "a running sandbox has cgroups");
    assert!(
        Path::new(&format!("/sys/fs/cgroup/memory/dsec/{node}/{id}")).exists()
            || !Path::new("/sys/fs/cgroup/memory").exists()
    );
    let r = api
        .delete(&format!("/edge/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let stopped: SandboxInfo = r.json().await.unwrap();
    assert_eq!(stopped.state, SandboxState::Stopped);
    assert!(!sb_dir.exists(), "sandbox dir removed");
    assert!(
        cgroups_of(&id).is_empty(),
        "cgroups removed: {:?}",
        cgroups_of(&id)
    );
    assert!(mounts_under(&sb_dir).is_empty());
    let again: SandboxInfo = api
        .get(&format!("/edge/v1/sandboxes/{id}"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(again.state, SandboxState::Stopped);
    let r = api
        .post(&format!("/edge/v1/sandboxes/{id}/shell"))
        .json(&json!({"cmd": "true"}))
        .send()
        .await
        .unwrap();
    expect_error(r, 410, "sandbox_dead").await;

    // --- a sandbox killed from outside is cleaned up and reported failed ---
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "memory_limit_mb": 64}))
        .send()
        .await
        .unwrap();
    let victim: SandboxInfo = r.json().await.unwrap();
    let vdir = tmp.path().join("edge/sandboxes").join(&victim.id);
    let rec: serde_json::Value =
        serde_json::from_slice(&std::fs::read(vdir.join("record.json")).unwrap()).unwrap();
    let pid = rec["pid"].as_i64().unwrap() as i32;
    assert!(pid > 1);
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(pid),
        nix::sys::signal::Signal::SIGKILL,
    )
    .unwrap();
    wait_for("the dead sandbox's dir to go", || !vdir.exists()).await;
    let mut dead = None;
    for _ in 0..100 {
        let i: SandboxInfo = api
            .get(&format!("/edge/v1/sandboxes/{}", victim.id))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        if i.state == SandboxState::Failed {
            dead = Some(i);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let dead = dead.expect("killed sandbox reported failed");
    assert!(dead.reason.unwrap().contains("unexpectedly"));
    assert!(cgroups_of(&victim.id).is_empty());

    // --- metrics ---
    let text = api
        .http
        .get(api.url("/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(text.contains("dsec_edge_sandboxes_created_total"), "{text}");
    assert!(text.contains("dsec_edge_http_requests_total"), "{text}");
    assert!(
        text.contains("dsec_edge_sandboxes_failed_total{node=\"") && text.contains("} 1"),
        "{text}"
    );

    // --- shutdown stops everything and unmounts layers ---
    let r = api
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "memory_limit_mb": 64}))
        .send()
        .await
        .unwrap();
    let last: SandboxInfo = r.json().await.unwrap();
    assert!(
        !mounts_under(tmp.path()).is_empty(),
        "image layers are mounted"
    );
    edge.shutdown().await;
    server.abort();
    assert!(!tmp.path().join("edge/sandboxes").join(&last.id).exists());
    assert!(cgroups_of(&last.id).is_empty());
    assert!(
        mounts_under(tmp.path()).is_empty(),
        "mounts left: {:?}",
        mounts_under(tmp.path())
    );
    drop(edge);

    // --- restart over leftovers of a "crashed" run: reaped, not re-adopted ---
    let ghost = dsec_wire::id::make_sandbox_id(&node, 0xdead);
    let gdir = tmp.path().join("edge/sandboxes").join(&ghost);
    std::fs::create_dir_all(gdir.join("upper/etc")).unwrap();
    let mut rec = rec.clone();
    rec["info"]["id"] = json!(ghost);
    rec["pid"] = json!(0);
    std::fs::write(gdir.join("record.json"), serde_json::to_vec(&rec).unwrap()).unwrap();
    let cfg2 = EdgeConfig { capacity: 1, ..cfg };
    let (edge2, api2, server2) = start(cfg2).await;
    assert_eq!(edge2.reaped(), std::slice::from_ref(&ghost));
    assert!(!gdir.exists());
    assert_eq!(edge2.token(), api.token, "the generated token is kept");
    // A recorded sandbox that could not be re-adopted is reported, not forgotten.
    let r = api2
        .get(&format!("/edge/v1/sandboxes/{ghost}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let gone: SandboxInfo = r.json().await.unwrap();
    assert_eq!(gone.state, SandboxState::Failed, "{gone:?}");
    assert!(
        gone.reason.as_deref().is_some_and(|m| !m.is_empty()),
        "{gone:?}"
    );

    // --- idempotency and admission (capacity 1) ---
    let body = json!({"image": "busybox", "memory_limit_mb": 64, "idempotency_key": "k1"});
    let a: SandboxInfo = api2
        .post("/edge/v1/sandboxes")
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let b: SandboxInfo = api2
        .post("/edge/v1/sandboxes")
        .json(&body)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(
        a.id, b.id,
        "a retried create with the same key returns the same sandbox"
    );
    let r = api2
        .post("/edge/v1/sandboxes")
        .json(&json!({"image": "busybox", "memory_limit_mb": 64}))
        .send()
        .await
        .unwrap();
    let msg = expect_error(r, 503, "node_full").await;
    assert!(msg.contains("1 of 1"), "{msg}");
    let st: NodeStatus = api2
        .get("/edge/v1/status")
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(st.sandboxes_running, 1);
    assert_eq!(st.memory_mb_allocated, 64);
    edge2.shutdown().await;
    assert!(cgroups_of(&a.id).is_empty());
    server2.abort();
    assert!(mounts_under(tmp.path()).is_empty());
}
