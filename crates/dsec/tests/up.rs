//! End-to-end: `dsec up` (real edge, real containers) driven through the `dsec` CLI.
//! Needs root and the static aether binary; skips with a printed reason otherwise.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

const DSEC: &str = env!("CARGO_BIN_EXE_dsec");

fn aether_available() -> bool {
    if std::env::var_os("DSEC_AETHER").is_some() {
        return true;
    }
    let exe_dir = Path::new(DSEC).parent().unwrap().to_path_buf();
    [
        exe_dir.join("dsec-aether"),
        exe_dir.join("../x86_64-unknown-linux-gnu/release/dsec-aether"),
        exe_dir.join("../../x86_64-unknown-linux-gnu/release/dsec-aether"),
        PathBuf::from("/usr/local/lib/dsec/dsec-aether"),
    ]
    .iter()
    .any(|p| p.exists())
}

/// A running `dsec up`; SIGTERMed and reaped on drop (also when a test panics).
struct Up {
    child: Option<Child>,
    url: String,
    key: String,
}

impl Up {
    fn start(data: &Path) -> Up {
        let mut child = Command::new(DSEC)
            .args([
                "up",
                "--listen",
                "127.0.0.1:0",
                "--node-id",
                "t5",
                "--data-dir",
            ])
            .arg(data)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawn dsec up");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut lines = BufReader::new(stdout).lines();
            let a = lines.next().and_then(|l| l.ok());
            let b = lines.next().and_then(|l| l.ok());
            let _ = tx.send((a, b));
            for _ in lines {}
        });
        let mut up = Up {
            child: Some(child),
            url: String::new(),
            key: String::new(),
        };
        let (a, b) = rx
            .recv_timeout(Duration::from_secs(60))
            .expect("dsec up printed its two lines");
        up.url = a
            .unwrap()
            .strip_prefix("DSEC_API_URL=")
            .expect("url line")
            .to_string();
        up.key = b
            .unwrap()
            .strip_prefix("DSEC_API_KEY=")
            .expect("key line")
            .to_string();
        up
    }

    fn cli(&self, args: &[&str]) -> Output {
        Command::new(DSEC)
            .args(args)
            .env("DSEC_API_URL", &self.url)
            .env("DSEC_API_KEY", &self.key)
            .output()
            .expect("run dsec")
    }

    fn ok(&self, args: &[&str]) -> String {
        let o = self.cli(args);
        assert!(
            o.status.success(),
            "dsec {args:?}: {:?}\nstdout: {}\nstderr: {}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        String::from_utf8(o.stdout).unwrap()
    }

    /// SIGTERM and wait; returns the exit code.
    fn stop(&mut self) -> Option<i32> {
        let mut child = self.child.take()?;
        // SAFETY: plain kill(2) on the pid of our own child process.
        unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            if let Ok(Some(st)) = child.try_wait() {
                return st.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Up {
    fn drop(&mut self) {
        self.stop();
    }
}

#[test]
fn up_run_exec_cp_stop() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("SKIP up_run_exec_cp_stop: needs root");
        return;
    }
    if !aether_available() {
        eprintln!(
            "SKIP up_run_exec_cp_stop: dsec-aether not built (set DSEC_AETHER or build it static)"
        );
        return;
    }
    let data = tempfile::tempdir().unwrap();
    let mut up = Up::start(data.path());
    assert!(up.key.starts_with("dsk_"));
    let env = std::fs::read_to_string(data.path().join("env")).unwrap();
    assert!(env.contains(&up.key));

    let nodes: serde_json::Value = serde_json::from_str(&up.ok(&["nodes", "--json"])).unwrap();
    assert_eq!(nodes["nodes"][0]["node"], "t5");
    assert_eq!(nodes["nodes"][0]["healthy"], true);

    let id = up
        .ok(&["run", "busybox", "--memory", "128", "--env", "FOO=bar"])
        .trim()
        .to_string();
    assert!(id.starts_with("sb-t5-"), "{id}");

    let o = up.cli(&[
        "exec",
        &id,
        "--",
        "sh",
        "-c",
        "echo out; echo err >&2; echo $FOO; exit 3",
    ]);
    assert_eq!(o.status.code(), Some(3));
    assert_eq!(String::from_utf8_lossy(&o.stdout), "out\nbar\n");
    assert_eq!(String::from_utf8_lossy(&o.stderr), "err\n");

    up.ok(&[
        "exec",
        &id,
        "--session",
        "s",
        "--",
        "cd",
        "/tmp",
        "&&",
        "export",
        "X=1",
    ]);
    assert_eq!(
        up.ok(&["exec", &id, "--session", "s", "--", "pwd; echo $X"]),
        "/tmp\n1\n"
    );

    // cp both ways keeps bytes and mode.
    let local = data.path().join("blob");
    let bytes: Vec<u8> = (0..3_000_000u32).map(|i| (i * 7 % 251) as u8).collect();
    std::fs::write(&local, &bytes).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&local, std::fs::Permissions::from_mode(0o751)).unwrap();
    up.ok(&["cp", local.to_str().unwrap(), &format!("{id}:/tmp/blob")]);
    let back = data.path().join("back");
    up.ok(&["cp", &format!("{id}:/tmp/blob"), back.to_str().unwrap()]);
    assert_eq!(std::fs::read(&back).unwrap(), bytes);
    assert_eq!(
        std::fs::metadata(&back).unwrap().permissions().mode() & 0o7777,
        0o751
    );
    // A missing remote file: exit 1, clear message, no local file.
    let o = up.cli(&[
        "cp",
        &format!("{id}:/nope"),
        data.path().join("x").to_str().unwrap(),
    ]);
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("file_not_found"));
    assert!(!data.path().join("x").exists());

    let ps: serde_json::Value = serde_json::from_str(&up.ok(&["ps", "--json"])).unwrap();
    assert!(ps["sandboxes"]
        .as_array()
        .unwrap()
        .iter()
        .any(|s| s["id"] == id.as_str()));
    up.ok(&["stop", &id]);
    let o = up.cli(&["exec", &id, "--", "true"]);
    assert_eq!(o.status.code(), Some(1));

    // A sandbox left running is stopped by SIGTERM; exit code 0.
    let id2 = up.ok(&["run", "busybox"]).trim().to_string();
    assert_eq!(up.stop(), Some(0));
    assert!(!data.path().join("edge/sandboxes").join(&id2).exists());

    // Restart: the same admin key is printed again.
    let key = up.key.clone();
    let mut up2 = Up::start(data.path());
    assert_eq!(up2.key, key);
    assert_eq!(up2.stop(), Some(0));
}
