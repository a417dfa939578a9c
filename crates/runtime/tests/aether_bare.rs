//! End-to-end tests of the real aether binary in bare mode, driven through [`AetherClient`] over
//! a socketpair. The binary comes from `$DSEC_AETHER`, or the workspace's `target/debug`,
//! `target/release` or `target/x86_64-unknown-linux-gnu/release`; without one the tests are
//! skipped with a printed reason (build it with `cargo build -p dsec-aether`).

use std::collections::BTreeMap;
use std::os::fd::AsRawFd;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use bytes::Bytes;
use dsec_runtime::aether_client::{AetherClient, ChannelError, CommandOutput};
use dsec_wire::aether::{AetherErrorKind, Reply, Request, Stream, CHUNK};
use dsec_wire::api::FileKind;

fn aether_path() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("DSEC_AETHER") {
        return Some(PathBuf::from(p));
    }
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..");
    [
        "target/debug/dsec-aether",
        "target/release/dsec-aether",
        "target/x86_64-unknown-linux-gnu/release/dsec-aether",
    ]
    .iter()
    .map(|p| root.join(p))
    .find(|p| p.exists())
}

struct Aether {
    child: std::process::Child,
    client: AetherClient,
    /// A second handle on our end of the socketpair, to break the channel on purpose.
    ctl: std::os::unix::net::UnixStream,
}

impl Aether {
    fn pid(&self) -> i32 {
        self.child.id() as i32
    }
}

impl Drop for Aether {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts aether in bare mode with one end of a socketpair as its fd 3.
async fn start() -> Option<Aether> {
    let Some(path) = aether_path() else {
        eprintln!(
            "SKIP: dsec-aether is not built (cargo build -p dsec-aether) and DSEC_AETHER is unset"
        );
        return None;
    };
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().expect("socketpair");
    let fd = theirs.as_raw_fd();
    let mut cmd = std::process::Command::new(&path);
    cmd.args(["--mode", "bare", "--fd", "3"]);
    // SAFETY: dup2 is async-signal-safe; it only duplicates an fd that stays open in the parent
    // until spawn returns. dup2 clears close-on-exec on the new fd 3 only.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().expect("spawn dsec-aether");
    drop(theirs);
    ours.set_nonblocking(true).unwrap();
    let ctl = ours.try_clone().unwrap();
    let client = AetherClient::new(tokio::net::UnixStream::from_std(ours).unwrap());
    let ready = tokio::time::timeout(Duration::from_secs(10), client.wait_ready())
        .await
        .expect("ready in time")
        .expect("ready");
    assert!(matches!(ready, Reply::Ready { .. }), "{ready:?}");
    Some(Aether { child, client, ctl })
}

fn shell(session: &str, cmd: &str) -> Request {
    Request::RunShell {
        session: session.into(),
        cmd: cmd.into(),
        timeout_ms: 20_000,
        env: BTreeMap::new(),
        cwd: None,
        max_output: 1 << 20,
        stream: false,
    }
}

fn shell_t(session: &str, cmd: &str, timeout_ms: u64) -> Request {
    Request::RunShell {
        session: session.into(),
        cmd: cmd.into(),
        timeout_ms,
        env: BTreeMap::new(),
        cwd: None,
        max_output: 1 << 20,
        stream: false,
    }
}

fn exec(argv: &[&str]) -> Request {
    Request::Exec {
        argv: argv.iter().map(|s| s.to_string()).collect(),
        timeout_ms: 20_000,
        env: BTreeMap::new(),
        cwd: None,
        user: None,
        max_output: 1 << 20,
        stream: false,
    }
}

async fn run(a: &Aether, req: Request) -> CommandOutput {
    a.client.run(req, Bytes::new()).await.expect("command runs")
}

fn text(b: &Bytes) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// True when the process is gone or a zombie.
fn gone(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        Ok(s) => s
            .rsplit(')')
            .next()
            .is_some_and(|r| r.trim_start().starts_with('Z')),
    }
}

fn wait_gone(pid: i32) -> bool {
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(5) {
        if gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    false
}

fn pids(out: &Bytes) -> Vec<i32> {
    text(out)
        .split_whitespace()
        .filter_map(|w| w.parse().ok())
        .collect()
}

fn vm_hwm_kib(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let line = s.lines().find(|l| l.starts_with("VmHWM:")).unwrap();
    line.split_whitespace().nth(1).unwrap().parse().unwrap()
}

#[tokio::test]
async fn session_state_persists() {
    let Some(a) = start().await else { return };
    let o = run(&a, shell("s", "cd /tmp; export FOO=bar; f() { echo fn-$1; }; alias hi='echo alias-ok'; sleep 1000 & echo $!")).await;
    assert_eq!(o.outcome.exit_code, 0, "{o:?}");
    assert!(!o.outcome.session_restarted);
    let bg = pids(&o.stdout)[0];
    let o = run(
        &a,
        shell(
            "s",
            &format!("pwd; echo $FOO; f x; hi; kill -0 {bg} && echo alive"),
        ),
    )
    .await;
    assert_eq!(
        text(&o.stdout),
        "/tmp\nbar\nfn-x\nalias-ok\nalive\n",
        "{o:?}"
    );
    assert!(!o.outcome.session_restarted);
    // A second session is independent.
    let o = run(&a, shell("other", "pwd; echo \"[$FOO]\"")).await;
    assert_ne!(text(&o.stdout).lines().next(), Some("/tmp"));
    assert!(text(&o.stdout).ends_with("[]\n"), "{o:?}");
    // cwd and per-call env.
    let mut env = BTreeMap::new();
    env.insert("ONLY".to_string(), "once".to_string());
    let req = Request::RunShell {
        session: "s".into(),
        cmd: "pwd; echo $ONLY".into(),
        timeout_ms: 5000,
        env,
        cwd: Some("/".into()),
        max_output: 1024,
        stream: false,
    };
    assert_eq!(text(&run(&a, req).await.stdout), "/\nonce\n");
    // Per-call cwd and env apply to that call only: the session is back where it was.
    assert_eq!(
        text(&run(&a, shell("s", "pwd; echo \"[$ONLY]\"")).await.stdout),
        "/tmp\n[]\n"
    );
    let r = a.client.request(Request::Ping, Bytes::new()).await.unwrap();
    assert!(
        matches!(r.0, Reply::Pong { sessions: 2, processes } if processes >= 3),
        "{r:?}"
    );
    // `exit` ends the shell; the next call gets a fresh one.
    let o = run(&a, shell("s", "echo bye; exit 3")).await;
    assert_eq!(
        (o.outcome.exit_code, text(&o.stdout).as_str()),
        (3, "bye\n")
    );
    let o = run(&a, shell("s", "echo again")).await;
    assert!(o.outcome.session_restarted);
    assert_eq!(text(&o.stdout), "again\n");
    // CloseSession kills the session's background jobs.
    let o = run(&a, shell("c", "sleep 1000 & echo $!")).await;
    let job = pids(&o.stdout)[0];
    a.client
        .request(
            Request::CloseSession {
                session: "c".into(),
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert!(wait_gone(job));
    assert!(wait_gone(bg));
}

#[tokio::test]
async fn outputs_exit_codes_and_stdin() {
    let Some(a) = start().await else { return };
    let o = run(
        &a,
        shell("s", "printf '\\377\\376\\000abc'; echo err >&2; (exit 7)"),
    )
    .await;
    assert_eq!(&o.stdout[..], b"\xff\xfe\x00abc");
    assert_eq!(&o.stderr[..], b"err\n");
    assert_eq!(o.outcome.exit_code, 7);
    let o = run(&a, shell("s", "printf 'no newline'")).await;
    assert_eq!(&o.stdout[..], b"no newline");
    assert_eq!(run(&a, shell("s", "false")).await.outcome.exit_code, 1);
    let input = Bytes::from_static(b"line1\nbinary\x00\xff\nlast");
    let o = a
        .client
        .run(shell("s", "cat; echo; wc -c"), input.clone())
        .await
        .unwrap();
    // wc sees no input left: cat consumed it.
    assert_eq!(&o.stdout[..], b"line1\nbinary\x00\xff\nlast\n0\n");
    let o = run(&a, shell("s", "cat")).await;
    assert_eq!(o.stdout.len(), 0, "empty body is /dev/null");
}

#[tokio::test]
async fn timeout_kills_new_processes_only() {
    let Some(a) = start().await else { return };
    let old = pids(&run(&a, shell("s", "sleep 1000 & echo $!")).await.stdout)[0];
    let t = Instant::now();
    let o = run(
        &a,
        shell_t(
            "s",
            "sleep 1000 & echo $!; sh -c 'echo $$; exec sleep 1000'",
            500,
        ),
    )
    .await;
    assert!(o.outcome.timed_out, "{o:?}");
    assert_eq!((o.outcome.exit_code, o.outcome.signal), (-1, Some(9)));
    assert!(!o.outcome.session_restarted);
    assert!(t.elapsed() < Duration::from_secs(5));
    let killed = pids(&o.stdout);
    assert_eq!(killed.len(), 2, "{o:?}");
    for p in killed {
        assert!(wait_gone(p), "pid {p} survived the timeout");
    }
    assert!(!gone(old), "a background job of an earlier call was killed");
    let o = run(&a, shell("s", "echo still here")).await;
    assert_eq!(text(&o.stdout), "still here\n");
    assert!(!o.outcome.session_restarted);
}

#[tokio::test]
async fn builtin_loop_is_abandoned_and_session_kept() {
    let Some(a) = start().await else { return };
    run(&a, shell("s", "cd /tmp && export KEPT=yes")).await;
    let o = run(
        &a,
        shell_t("s", "echo looping; while :; do :; done; echo never", 300),
    )
    .await;
    assert!(o.outcome.timed_out && !o.outcome.session_restarted, "{o:?}");
    assert_eq!(text(&o.stdout), "looping\n");
    // The shell's state survived: the loop ran inside it and was abandoned, not killed.
    let o = run(&a, shell("s", "pwd; echo $KEPT")).await;
    assert_eq!(text(&o.stdout), "/tmp\nyes\n");
}

#[tokio::test]
async fn cancel_kills_command() {
    let Some(a) = start().await else { return };
    let mut call = a
        .client
        .call(shell("s", "sleep 1000"), Bytes::new())
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(200)).await;
    a.client
        .request(Request::Cancel { target: call.id() }, Bytes::new())
        .await
        .unwrap();
    let (r, _) = call.next().await.unwrap().unwrap();
    let Reply::CommandDone(out) = r else {
        panic!("{r:?}")
    };
    assert_eq!(
        (out.exit_code, out.signal, out.timed_out),
        (-1, Some(9), false)
    );
}

#[tokio::test]
async fn huge_output_is_capped_in_bounded_memory() {
    let Some(a) = start().await else { return };
    let req = Request::RunShell {
        session: "s".into(),
        cmd: "yes | head -c 1G; echo tail >&2".into(),
        timeout_ms: 60_000,
        env: BTreeMap::new(),
        cwd: None,
        max_output: 1 << 20,
        stream: false,
    };
    let o = run(&a, req).await;
    assert_eq!(o.outcome.exit_code, 0);
    assert_eq!(o.outcome.stdout_total, 1 << 30);
    assert!(o.outcome.stdout_truncated);
    assert_eq!(o.stdout.len(), 1 << 20);
    assert!(o.stdout.starts_with(b"y\ny\n"));
    assert_eq!(&o.stderr[..], b"tail\n");
    let hwm = vm_hwm_kib(a.pid());
    eprintln!("aether VmHWM after 1 GiB of output: {hwm} KiB");
    assert!(hwm < 32 * 1024, "aether peak RSS {hwm} KiB");
}

#[tokio::test]
async fn streaming_chunks_arrive_early() {
    let Some(a) = start().await else { return };
    let req = Request::RunShell {
        session: "s".into(),
        cmd: "echo first; sleep 1; echo second; echo e >&2".into(),
        timeout_ms: 10_000,
        env: BTreeMap::new(),
        cwd: None,
        max_output: 1 << 20,
        stream: true,
    };
    let t = Instant::now();
    let mut call = a.client.call(req, Bytes::new()).await.unwrap();
    let mut streamed = Vec::new();
    let mut first_at = None;
    let outcome = loop {
        let (r, body) = call.next().await.unwrap().unwrap();
        match r {
            Reply::Output {
                stream: Stream::Stdout,
            } => {
                first_at.get_or_insert(t.elapsed());
                streamed.extend_from_slice(&body);
            }
            Reply::Output { .. } => {}
            Reply::CommandDone(o) => break (o, t.elapsed()),
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(streamed, b"first\nsecond\n");
    assert!(
        first_at.unwrap() + Duration::from_millis(500) < outcome.1,
        "first chunk at {first_at:?}, done at {:?}",
        outcome.1
    );
    assert_eq!(outcome.0.stdout_len, 13);
}

#[tokio::test]
async fn exec_argv() {
    let Some(a) = start().await else { return };
    let o = run(&a, exec(&["printf", "%s|%s", "a b", "c'd"])).await;
    assert_eq!(
        (o.outcome.exit_code, text(&o.stdout).as_str()),
        (0, "a b|c'd")
    );
    let o = run(&a, exec(&["no-such-command-xyz"])).await;
    assert_eq!(o.outcome.exit_code, 127);
    assert!(text(&o.stderr).contains("no-such-command-xyz"));
    let o = run(&a, exec(&["/no/such/file"])).await;
    assert_eq!(o.outcome.exit_code, 127);
    let o = a
        .client
        .run(exec(&["cat"]), Bytes::from_static(b"in\x00put"))
        .await
        .unwrap();
    assert_eq!(&o.stdout[..], b"in\x00put");
    let o = run(&a, exec(&["sh", "-c", "kill -9 $$"])).await;
    assert_eq!((o.outcome.exit_code, o.outcome.signal), (-1, Some(9)));
    let mut env = BTreeMap::new();
    env.insert("V".into(), "x".into());
    let req = Request::Exec {
        argv: vec![
            "sh".into(),
            "-c".into(),
            "pwd; echo $V; sleep 1000 & echo $!; sleep 1000".into(),
        ],
        timeout_ms: 400,
        env,
        cwd: Some("/tmp".into()),
        user: None,
        max_output: 100,
        stream: false,
    };
    let o = run(&a, req).await;
    assert!(o.outcome.timed_out);
    let out = text(&o.stdout);
    assert!(out.starts_with("/tmp\nx\n"), "{out}");
    let bg = pids(&o.stdout)[0];
    assert!(wait_gone(bg));
    let err = a.client.run(exec(&[]), Bytes::new()).await.unwrap_err();
    assert!(matches!(err, ChannelError::Aether(e) if e.kind == AetherErrorKind::BadRequest));
}

#[tokio::test]
async fn file_round_trip() {
    let Some(a) = start().await else { return };
    let dir = tempfile::tempdir().unwrap();
    let base = dir.path().to_string_lossy().into_owned();
    // 3 MiB + a bit of pseudo-random bytes.
    let mut data = Vec::with_capacity(3 << 20);
    let mut x: u64 = 0x9e3779b97f4a7c15;
    while data.len() < (3 << 20) + 123 {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        data.push((x >> 24) as u8);
    }
    let path = format!("{base}/sub/deeper/blob.bin");
    let call = a
        .client
        .call(
            Request::WriteBegin {
                path: path.clone(),
                mode: 0o751,
                make_parents: true,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    for chunk in data.chunks(CHUNK) {
        a.client
            .send(
                call.id(),
                Request::WriteChunk,
                Bytes::copy_from_slice(chunk),
            )
            .await
            .unwrap();
    }
    a.client
        .send(call.id(), Request::WriteEnd, Bytes::new())
        .await
        .unwrap();
    let (r, _) = dsec_runtime::aether_client::collect(call).await.unwrap();
    let Reply::Written(info) = r else {
        panic!("{r:?}")
    };
    assert_eq!(
        (info.size, info.mode, info.kind),
        (data.len() as u64, 0o751, FileKind::File)
    );
    let (r, body) = a
        .client
        .request(Request::ReadFile { path: path.clone() }, Bytes::new())
        .await
        .unwrap();
    assert!(
        matches!(r, Reply::FileEnd { size, mode: 0o751 } if size == data.len() as u64),
        "{r:?}"
    );
    assert!(body[..] == data[..], "read back differs");
    // list, stat, symlink, mkdir, remove
    std::os::unix::fs::symlink("blob.bin", format!("{base}/sub/deeper/link")).unwrap();
    let (r, _) = a
        .client
        .request(
            Request::ListDir {
                path: format!("{base}/sub/deeper"),
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    let Reply::Listed(l) = r else { panic!() };
    let names: Vec<_> = l
        .entries
        .iter()
        .map(|e| (e.name.as_str(), e.kind))
        .collect();
    assert_eq!(
        names,
        vec![("blob.bin", FileKind::File), ("link", FileKind::Symlink)]
    );
    let (r, _) = a
        .client
        .request(
            Request::Stat {
                path: format!("{base}/sub/deeper/link"),
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert!(
        matches!(r, Reply::Stat(ref i) if i.link_target.as_deref() == Some("blob.bin")),
        "{r:?}"
    );
    let (r, _) = a
        .client
        .request(
            Request::Mkdir {
                path: format!("{base}/m/n/o"),
                mode: 0o700,
                parents: true,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert!(
        matches!(r, Reply::Stat(ref i) if i.kind == FileKind::Dir && i.mode == 0o700),
        "{r:?}"
    );
    let err = a
        .client
        .request(
            Request::Remove {
                path: format!("{base}/sub"),
                recursive: false,
            },
            Bytes::new(),
        )
        .await
        .unwrap_err();
    assert!(
        matches!(err, ChannelError::Aether(ref e) if e.kind == AetherErrorKind::WrongKind),
        "{err:?}"
    );
    a.client
        .request(
            Request::Remove {
                path: format!("{base}/sub"),
                recursive: true,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    assert!(!std::path::Path::new(&path).exists());
    // errors name the path
    for req in [
        Request::ReadFile {
            path: format!("{base}/missing"),
        },
        Request::Stat {
            path: format!("{base}/missing"),
        },
        Request::ListDir {
            path: format!("{base}/missing"),
        },
    ] {
        let err = a.client.request(req, Bytes::new()).await.unwrap_err();
        assert!(
            matches!(err, ChannelError::Aether(ref e) if e.kind == AetherErrorKind::NotFound && e.message.contains("missing")),
            "{err:?}"
        );
    }
    let err = a
        .client
        .request(Request::ReadFile { path: base.clone() }, Bytes::new())
        .await
        .unwrap_err();
    assert!(
        matches!(err, ChannelError::Aether(ref e) if e.kind == AetherErrorKind::WrongKind),
        "{err:?}"
    );
}

#[tokio::test]
async fn tty_echo_round_trip() {
    let Some(a) = start().await else { return };
    let req = Request::TtyOpen {
        rows: 24,
        cols: 80,
        cmd: Some(vec!["/bin/sh".into()]),
        env: BTreeMap::new(),
    };
    let mut call = a.client.call(req, Bytes::new()).await.unwrap();
    let tty = call.id();
    a.client
        .request(
            Request::TtyResize {
                target: tty,
                rows: 40,
                cols: 100,
            },
            Bytes::new(),
        )
        .await
        .unwrap();
    a.client
        .request(
            Request::TtyInput { target: tty },
            Bytes::from_static(b"echo hel''lo; stty size; exit 5\n"),
        )
        .await
        .unwrap();
    let mut seen = Vec::new();
    let code = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            match call.next().await.unwrap() {
                Some((
                    Reply::Output {
                        stream: Stream::Tty,
                    },
                    b,
                )) => seen.extend_from_slice(&b),
                Some((Reply::TtyExit { code }, _)) => break code,
                other => panic!("{other:?}"),
            }
        }
    })
    .await
    .expect("tty exits");
    let s = String::from_utf8_lossy(&seen);
    assert!(s.contains("hello\r\n"), "{s:?}");
    assert!(s.contains("40 100"), "{s:?}");
    assert_eq!(code, 5);
}

#[tokio::test]
async fn shutdown_kills_children() {
    let Some(mut a) = start().await else { return };
    let job = pids(&run(&a, shell("s", "sleep 1000 & echo $!")).await.stdout)[0];
    let (r, _) = a
        .client
        .request(Request::Shutdown, Bytes::new())
        .await
        .unwrap();
    assert!(matches!(r, Reply::Done));
    assert!(wait_gone(job));
    let st = a.child.wait().unwrap();
    assert_eq!(st.code(), Some(0));
    a.client.closed().await;
}

#[tokio::test]
async fn channel_close_kills_children() {
    let Some(mut a) = start().await else { return };
    let job = pids(
        &run(&a, shell("s", "setsid sleep 1000 & echo $!"))
            .await
            .stdout,
    )[0];
    let mut exec_call = a
        .client
        .call(
            exec(&["sh", "-c", "echo $$; exec sleep 1000"]),
            Bytes::new(),
        )
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Break the channel: shutdown acts on the socket itself, not just this descriptor.
    a.ctl.shutdown(std::net::Shutdown::Both).unwrap();
    assert!(matches!(exec_call.next().await, Err(ChannelError::Closed)));
    a.client.closed().await;
    for _ in 0..100 {
        if a.child.try_wait().unwrap().is_some() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        a.child.try_wait().unwrap().is_some(),
        "aether did not exit on channel close"
    );
    assert!(wait_gone(job));
}

#[tokio::test]
async fn exec_as_other_user() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP: switching users needs root");
        return;
    }
    let Some(a) = start().await else { return };
    let req = Request::Exec {
        argv: vec!["id".into(), "-u".into()],
        timeout_ms: 5000,
        env: BTreeMap::new(),
        cwd: Some("/".into()),
        user: Some("nobody".into()),
        max_output: 100,
        stream: false,
    };
    let o = run(&a, req).await;
    assert_eq!(text(&o.stdout), "65534\n", "{o:?}");
    let req = Request::Exec {
        argv: vec!["true".into()],
        timeout_ms: 5000,
        env: BTreeMap::new(),
        cwd: None,
        user: Some("no-such-user-xyz".into()),
        max_output: 100,
        stream: false,
    };
    let err = a.client.run(req, Bytes::new()).await.unwrap_err();
    assert!(
        matches!(err, ChannelError::Aether(ref e) if e.kind == AetherErrorKind::BadRequest),
        "{err:?}"
    );
}

/// Raw frames, without the client: an unknown op is a bad request, garbage ends the channel.
#[test]
fn bad_frames() {
    use std::io::{Read, Write};
    let Some(path) = aether_path() else {
        eprintln!("SKIP: dsec-aether is not built");
        return;
    };
    let (mut ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let fd = theirs.as_raw_fd();
    let mut cmd = std::process::Command::new(&path);
    cmd.args(["--mode", "bare", "--fd", "3"]);
    // SAFETY: dup2 is async-signal-safe and `fd` stays open until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 {
                Err(std::io::Error::last_os_error())
            } else {
                Ok(())
            }
        });
    }
    let mut child = cmd.spawn().unwrap();
    drop(theirs);
    ours.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let read_frame = |s: &mut std::os::unix::net::UnixStream| -> serde_json::Value {
        let mut pre = [0u8; 8];
        s.read_exact(&mut pre).unwrap();
        let h = u32::from_be_bytes(pre[..4].try_into().unwrap()) as usize;
        let b = u32::from_be_bytes(pre[4..].try_into().unwrap()) as usize;
        let mut buf = vec![0u8; h + b];
        s.read_exact(&mut buf).unwrap();
        serde_json::from_slice(&buf[..h]).unwrap()
    };
    let ready = read_frame(&mut ours);
    assert_eq!(ready["m"]["op"], "ready");
    let header = br#"{"id":5,"dir":"request","m":{"op":"frobnicate"}}"#;
    let mut f = Vec::new();
    f.extend_from_slice(&(header.len() as u32).to_be_bytes());
    f.extend_from_slice(&0u32.to_be_bytes());
    f.extend_from_slice(header);
    ours.write_all(&f).unwrap();
    let r = read_frame(&mut ours);
    assert_eq!(
        (
            r["id"].as_u64(),
            r["m"]["op"].as_str(),
            r["m"]["kind"].as_str()
        ),
        (Some(5), Some("error"), Some("bad_request")),
        "{r}"
    );
    // A header length over the limit is a broken peer: aether exits.
    ours.write_all(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0])
        .unwrap();
    let t = Instant::now();
    while child.try_wait().unwrap().is_none() {
        assert!(
            t.elapsed() < Duration::from_secs(5),
            "aether survived a malformed frame"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[tokio::test]
async fn reattach_keeps_sessions() {
    let Some(path) = aether_path() else {
        eprintln!("SKIP: dsec-aether is not built");
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let sock = dir.path().join("reattach.sock");
    let listener = std::os::unix::net::UnixListener::bind(&sock).unwrap();
    let (ours, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    let (fd, lfd) = (theirs.as_raw_fd(), listener.as_raw_fd());
    let mut cmd = std::process::Command::new(&path);
    cmd.args(["--mode", "bare", "--fd", "3", "--reattach-grace-ms", "5000"]);
    // SAFETY: dup2 is async-signal-safe; both fds stay open in the parent until spawn returns.
    unsafe {
        cmd.pre_exec(move || {
            if libc::dup2(fd, 3) < 0 || libc::dup2(lfd, 4) < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    let child = cmd.spawn().unwrap();
    drop((theirs, listener));
    ours.set_nonblocking(true).unwrap();
    let ctl = ours.try_clone().unwrap();
    let client = AetherClient::new(tokio::net::UnixStream::from_std(ours).unwrap());
    client.wait_ready().await.unwrap();
    let mut a = Aether { child, client, ctl };
    run(&a, shell("s", "cd /tmp; export KEEP=me")).await;
    a.ctl.shutdown(std::net::Shutdown::Both).unwrap();
    a.client.closed().await;
    // The "restarted edge" connects to the listener and carries on with the same session.
    let stream = tokio::net::UnixStream::connect(&sock).await.unwrap();
    a.client = AetherClient::new(stream);
    let r = tokio::time::timeout(Duration::from_secs(5), a.client.wait_ready())
        .await
        .unwrap()
        .unwrap();
    assert!(matches!(r, Reply::Ready { .. }));
    let o = run(&a, shell("s", "pwd; echo $KEEP")).await;
    assert_eq!(text(&o.stdout), "/tmp\nme\n");
    assert!(!o.outcome.session_restarted);
}
