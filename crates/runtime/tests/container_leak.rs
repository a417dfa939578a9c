//! 50 create/destroy cycles of the container substrate leak nothing: no mounts, no cgroup
//! dirs, no fds in the edge process, no processes, no per-sandbox dirs.
//!
//! Needs root, overlayfs, /bin/busybox and a built aether (see container_e2e.rs); skips
//! with a printed reason otherwise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use dsec_runtime::cgroup::{Cgroup, CgroupRoot};
use dsec_runtime::container::{ContainerConfig, ContainerSubstrate};
use dsec_runtime::substrate::SandboxSpec;
use dsec_wire::aether::Request;

fn aether_path() -> Option<PathBuf> {
    if let Ok(p) = std::env::var("DSEC_AETHER") {
        return Some(PathBuf::from(p));
    }
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    ["x86_64-unknown-linux-gnu/release", "release", "debug"]
        .iter()
        .map(|sub| target.join(sub).join("dsec-aether"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

fn mount_lines_mentioning(p: &Path) -> usize {
    let needle = p.to_string_lossy().to_string();
    std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter(|l| l.contains(&needle))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fifty_cycles_leak_nothing() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        eprintln!("skipping: needs root");
        return;
    }
    if !Path::new("/bin/busybox").is_file() {
        eprintln!("skipping: needs /bin/busybox (busybox-static)");
        return;
    }
    let Some(aether) = aether_path() else {
        eprintln!(
            "skipping: no dsec-aether binary (cargo build -p dsec-aether, or set DSEC_AETHER)"
        );
        return;
    };
    let tmp = tempfile::Builder::new()
        .prefix("dsec-leak-")
        .tempdir_in("/var/tmp")
        .unwrap();
    let lower = tmp.path().join("lower");
    for d in ["bin", "etc", "proc", "sys", "dev", "tmp", "root"] {
        std::fs::create_dir_all(lower.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", lower.join("bin/busybox")).unwrap();
    std::os::unix::fs::symlink("busybox", lower.join("bin/sh")).unwrap();
    std::os::unix::fs::symlink("busybox", lower.join("bin/echo")).unwrap();
    std::fs::write(lower.join("etc/passwd"), "root:x:0:0:root:/root:/bin/sh\n").unwrap();
    std::fs::write(lower.join("etc/group"), "root:x:0:\n").unwrap();

    let parent = format!("dsec-test/leak-{}", std::process::id());
    let substrate = ContainerSubstrate::new(ContainerConfig {
        aether_path: aether,
        cgroup_parent: parent.clone(),
        shm_mb: 8,
    });
    let root = CgroupRoot::detect();

    // Warm up once so lazily created runtime fds (epoll, blocking pool) exist before counting.
    let mounts_before = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .count();
    let mut fds_before = None;
    let mut pids = Vec::new();
    for i in 0..51u64 {
        let id = dsec_wire::id::make_sandbox_id("t0", 0x1eaf_0000_0000_0000 | i);
        let dir = tmp.path().join(&id);
        std::fs::create_dir_all(&dir).unwrap();
        let spec = SandboxSpec {
            id: id.clone(),
            hostname: "leak".into(),
            lowers: vec![lower.clone()],
            dir: dir.clone(),
            memory_limit_mb: 64,
            cpu_cores_limit: 0.5,
            pids_limit: 32,
            user: "root".into(),
            env: BTreeMap::new(),
            ..Default::default()
        };
        let sb = substrate
            .create(spec)
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: create: {e}"));
        pids.push(sb.pid());
        let req = Request::RunShell {
            session: "s".into(),
            cmd: "echo hi > /tmp/x; echo ok".into(),
            timeout_ms: 10_000,
            env: BTreeMap::new(),
            cwd: None,
            max_output: 4096,
            stream: false,
        };
        let out = sb
            .aether()
            .run(req, Bytes::new())
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: run: {e}"));
        assert_eq!(
            String::from_utf8_lossy(&out.stdout).trim(),
            "ok",
            "cycle {i}"
        );
        substrate
            .destroy(&sb)
            .await
            .unwrap_or_else(|e| panic!("cycle {i}: destroy: {e}"));
        drop(sb);
        assert!(
            !dir.join("upper").exists()
                && !dir.join("work").exists()
                && !dir.join("rootfs").exists()
        );
        std::fs::remove_dir(&dir).unwrap();
        if i == 0 {
            fds_before = Some(fd_count());
        }
    }
    // Let the runtime drop any finished watcher tasks.
    tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    let fds_after = fd_count();
    let mounts_after = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap()
        .lines()
        .count();
    eprintln!(
        "fds {fds_before:?} -> {fds_after}, mountinfo lines {mounts_before} -> {mounts_after}"
    );
    assert_eq!(Some(fds_after), fds_before, "fd leak");
    assert_eq!(
        mount_lines_mentioning(tmp.path()),
        0,
        "a sandbox mount is visible on the host"
    );
    assert!(
        Cgroup::list(&root, &parent).unwrap().is_empty(),
        "cgroup dirs left"
    );
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "aether pid {pid} still exists"
        );
    }
    // Remove the test's cgroup parents.
    for c in ["memory", "cpu", "pids", "freezer", ""] {
        let d = root.path.join(c).join(&parent);
        let _ = std::fs::remove_dir(&d);
        let _ = d.parent().map(std::fs::remove_dir);
    }
}
