//! End-to-end tests of the container substrate on the real kernel: a busybox rootfs as the only
//! lower layer, aether as PID 1, commands through the aether channel.
//!
//! Need root, cgroups, overlayfs, /bin/busybox (busybox-static) and a built aether
//! (`DSEC_AETHER=/path`, or target/{x86_64-unknown-linux-gnu/release,release,debug}/dsec-aether);
//! each test skips with a printed reason otherwise.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use bytes::Bytes;
use dsec_runtime::aether_client::CommandOutput;
use dsec_runtime::cgroup::{Cgroup, CgroupRoot};
use dsec_runtime::container::{ContainerConfig, ContainerSandbox, ContainerSubstrate};
use dsec_runtime::substrate::{CreateSandboxError, SandboxSpec};
use dsec_wire::aether::Request;

/// Finds the aether binary or explains why the test cannot run.
fn aether_path() -> Result<PathBuf, String> {
    if let Ok(p) = std::env::var("DSEC_AETHER") {
        return Ok(PathBuf::from(p));
    }
    // The most recently built of the usual places.
    let target = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../target");
    ["x86_64-unknown-linux-gnu/release", "release", "debug"]
        .iter()
        .map(|sub| target.join(sub).join("dsec-aether"))
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
        .ok_or_else(|| {
            "no dsec-aether binary (cargo build -p dsec-aether, or set DSEC_AETHER)".into()
        })
}

fn preconditions() -> Result<PathBuf, String> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        return Err("needs root".into());
    }
    if !Path::new("/bin/busybox").is_file() {
        return Err("needs /bin/busybox (busybox-static)".into());
    }
    if !std::fs::read_to_string("/proc/filesystems")
        .unwrap_or_default()
        .contains("overlay")
    {
        return Err("needs overlayfs".into());
    }
    aether_path()
}

macro_rules! skip_unless_ready {
    () => {
        match preconditions() {
            Ok(p) => p,
            Err(why) => {
                eprintln!("skipping: {why}");
                return;
            }
        }
    };
}

/// A busybox root file system in a directory.
fn build_rootfs(root: &Path) {
    for d in [
        "bin",
        "sbin",
        "usr/bin",
        "usr/sbin",
        "etc",
        "proc",
        "sys",
        "dev",
        "tmp",
        "root",
        "home/user",
        "mnt",
    ] {
        std::fs::create_dir_all(root.join(d)).unwrap();
    }
    std::fs::copy("/bin/busybox", root.join("bin/busybox")).unwrap();
    let list = std::process::Command::new("/bin/busybox")
        .arg("--list-full")
        .output()
        .unwrap();
    for applet in String::from_utf8_lossy(&list.stdout).lines() {
        let link = root.join(applet);
        if applet.is_empty() || link.exists() || applet == "bin/busybox" {
            continue;
        }
        std::os::unix::fs::symlink("/bin/busybox", &link).unwrap();
    }
    std::fs::write(
        root.join("etc/passwd"),
        "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
    )
    .unwrap();
    std::fs::write(
        root.join("etc/group"),
        "root:x:0:\ntty:x:5:\nuser:x:1000:\n",
    )
    .unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(root.join("tmp"), std::fs::Permissions::from_mode(0o1777)).unwrap();
    std::os::unix::fs::chown(root.join("home/user"), Some(1000), Some(1000)).unwrap();
}

struct Env {
    _tmp: tempfile::TempDir,
    base: PathBuf,
    lower: PathBuf,
    substrate: ContainerSubstrate,
    parent: String,
}

impl Env {
    fn new(aether: PathBuf, tag: &str) -> Env {
        let tmp = tempfile::Builder::new()
            .prefix("dsec-ct-")
            .tempdir_in("/var/tmp")
            .unwrap();
        let base = tmp.path().to_path_buf();
        let lower = base.join("lower");
        build_rootfs(&lower);
        let parent = format!("dsec-test/{tag}-{}", std::process::id());
        let substrate = ContainerSubstrate::new(ContainerConfig {
            aether_path: aether,
            cgroup_parent: parent.clone(),
            shm_mb: 16,
        });
        Env {
            _tmp: tmp,
            base,
            lower,
            substrate,
            parent,
        }
    }

    fn spec(&self, n: u64) -> SandboxSpec {
        let id = dsec_wire::id::make_sandbox_id("t0", 0xabc0_0000_0000_0000 | n);
        let dir = self.base.join(&id);
        std::fs::create_dir_all(&dir).unwrap();
        SandboxSpec {
            hostname: format!("box-{n}"),
            id,
            lowers: vec![self.lower.clone()],
            dir,
            memory_limit_mb: 128,
            cpu_cores_limit: 1.0,
            pids_limit: 64,
            user: "root".into(),
            env: BTreeMap::new(),
            ..Default::default()
        }
    }

    async fn create(&self, spec: SandboxSpec) -> ContainerSandbox {
        match self.substrate.create(spec).await {
            Ok(sb) => sb,
            Err(e) => panic!("create sandbox: {e}"),
        }
    }

    /// Leftover cgroup dirs under this env's parent (all v1 hierarchies / v2).
    fn cgroup_children(&self) -> Vec<String> {
        Cgroup::list(&CgroupRoot::detect(), &self.parent).unwrap()
    }
}

impl Drop for Env {
    fn drop(&mut self) {
        // A failed test may leave sandboxes behind: kill them and remove their cgroups, then
        // the per-test cgroup parents. (Their mounts die with their mount namespaces.)
        let root = CgroupRoot::detect();
        for id in Cgroup::list(&root, &self.parent).unwrap_or_default() {
            if let Ok(cg) = Cgroup::open(&root, &self.parent, &id) {
                if let Err(e) = cg.destroy() {
                    eprintln!("cleanup {id}: {e}");
                }
            }
        }
        let mut dirs = Vec::new();
        match root.version {
            dsec_runtime::cgroup::CgroupVersion::V1 => {
                for c in ["memory", "cpu", "pids", "freezer"] {
                    dirs.push(root.path.join(c).join(&self.parent));
                }
            }
            dsec_runtime::cgroup::CgroupVersion::V2 => dirs.push(root.path.join(&self.parent)),
        }
        for d in dirs {
            let _ = std::fs::remove_dir(&d);
            let _ = d.parent().map(std::fs::remove_dir);
        }
    }
}

async fn sh(sb: &ContainerSandbox, cmd: &str) -> CommandOutput {
    let req = Request::RunShell {
        session: "main".into(),
        cmd: cmd.into(),
        timeout_ms: 30_000,
        env: BTreeMap::new(),
        cwd: None,
        max_output: 1 << 20,
        stream: false,
    };
    match sb.aether().run(req, Bytes::new()).await {
        Ok(o) => o,
        Err(e) => panic!("run {cmd:?}: {e}"),
    }
}

fn out(o: &CommandOutput) -> String {
    String::from_utf8_lossy(&o.stdout).trim().to_string()
}

fn all(o: &CommandOutput) -> String {
    format!(
        "stdout={:?} stderr={:?} exit={}",
        out(o),
        String::from_utf8_lossy(&o.stderr),
        o.outcome.exit_code
    )
}

async fn destroy(env: &Env, sb: &ContainerSandbox) {
    env.substrate.destroy(sb).await.expect("destroy sandbox");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn isolation_from_the_inside() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "iso");
    let marker = env.base.join("host-marker");
    std::fs::write(&marker, "secret").unwrap();
    let spec = env.spec(1);
    let dir = spec.dir.clone();
    let sb = env.create(spec).await;

    // aether is PID 1 (the session shell's parent), hidden from the sandbox's /proc
    // (hidepid=invisible: it is non-dumpable), and only the sandbox's processes are visible.
    let o = sh(
        &sb,
        "awk '/^PPid/{print $2}' /proc/$$/status; test -e /proc/1 && echo visible || echo hidden; ls /proc | grep -cE '^[0-9]+$'",
    )
    .await;
    let text = out(&o);
    let mut lines = text.lines();
    assert_eq!(lines.next(), Some("1"), "{}", all(&o));
    assert_eq!(lines.next(), Some("hidden"), "{}", all(&o));
    let host_status = std::fs::read_to_string(format!("/proc/{}/status", sb.pid())).unwrap();
    assert!(host_status.contains("Name:\tdsec-aether"), "{host_status}");
    assert!(
        host_status
            .lines()
            .any(|l| l.starts_with("NSpid:") && l.trim_end().ends_with("\t1")),
        "{host_status}"
    );
    let nprocs: u32 = lines.next().and_then(|l| l.parse().ok()).unwrap_or(999);
    assert!(nprocs < 8, "too many processes visible: {}", all(&o));

    assert_eq!(out(&sh(&sb, "hostname").await), "box-1");

    // Host paths are unreachable.
    let o = sh(&sb, &format!("cat {} || echo absent", marker.display())).await;
    assert_eq!(out(&o), "absent", "{}", all(&o));
    let o = sh(&sb, "ls / | tr '\\n' ' '").await;
    assert!(
        !out(&o).contains("work") && !out(&o).contains("var"),
        "{}",
        all(&o)
    );

    // Writes land in the upper dir; the lower is unchanged.
    let o = sh(&sb, "echo data > /root/new && rm /etc/group && echo ok").await;
    assert_eq!(out(&o), "ok", "{}", all(&o));
    assert_eq!(
        std::fs::read_to_string(dir.join("upper/root/new")).unwrap(),
        "data\n"
    );
    assert!(!env.lower.join("root/new").exists());
    assert!(env.lower.join("etc/group").exists());

    // Masked entries.
    let o = sh(
        &sb,
        "cat /proc/kcore | wc -c; cat /proc/kpagecgroup | wc -c; ls -A /sys/firmware | wc -l",
    )
    .await;
    assert_eq!(
        out(&o).split_whitespace().collect::<Vec<_>>(),
        ["0", "0", "0"],
        "{}",
        all(&o)
    );
    let o = sh(&sb, "echo h > /proc/sysrq-trigger && echo wrote; echo 1 > /proc/sys/kernel/panic && echo wrote2; true").await;
    assert!(!out(&o).contains("wrote"), "{}", all(&o));

    // Root inside cannot escape.
    for cmd in [
        "mount -t tmpfs none /mnt",
        "umount /proc",
        "umount -l /sys/firmware",
        "unshare -m true",
        "unshare -n true",
        "cat /proc/1/environ",
        // Listing /proc/1/fd works for uid 0 (the dir is root's 0500), but nothing in it
        // can be followed or read: aether is non-dumpable and nobody has CAP_SYS_PTRACE.
        "readlink /proc/1/fd/3",
        "cat /proc/1/fd/3 </dev/null",
        "ls /proc/1/root/",
        "readlink /proc/1/cwd",
        "head -c1 /proc/1/mem",
        "mknod /tmp/b b 8 0",
        "insmod /lib/modules/x.ko",
        "nsenter -t 1 -m true",
        "chroot / mount -t proc p /mnt",
        "hostname other",
    ] {
        let o = sh(&sb, &format!("{cmd} 2>/dev/null && echo ESCAPED")).await;
        assert!(!out(&o).contains("ESCAPED"), "{cmd}: {}", all(&o));
    }
    let o = sh(
        &sb,
        "grep -E '^(CapBnd|NoNewPrivs|Seccomp):' /proc/self/status",
    )
    .await;
    assert!(
        out(&o).contains("NoNewPrivs:\t1") && out(&o).contains("Seccomp:\t2"),
        "{}",
        all(&o)
    );
    assert!(out(&o).contains("CapBnd:\t00000000a00425fb"), "{}", all(&o));
    // The edge's stdio is not inherited: aether's fds 0-2 point at /dev/null (checked from
    // the host, since /proc/1/fd is unreadable inside).
    for fd in 0..=2 {
        let target = std::fs::read_link(format!("/proc/{}/fd/{fd}", sb.pid())).unwrap();
        assert_eq!(target, Path::new("/dev/null"), "fd {fd}");
    }

    destroy(&env, &sb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sandboxes_do_not_share_writes() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "two");
    let a = env.create(env.spec(1)).await;
    let b = env.create(env.spec(2)).await;
    assert_eq!(out(&sh(&a, "echo a > /tmp/only-a && echo ok").await), "ok");
    assert_eq!(
        out(&sh(&b, "test -e /tmp/only-a && echo seen || echo unseen").await),
        "unseen"
    );
    assert_eq!(out(&sh(&b, "hostname").await), "box-2");
    destroy(&env, &a).await;
    destroy(&env, &b).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_hog_is_oom_killed_and_sandbox_survives() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "oom");
    let mut spec = env.spec(1);
    spec.memory_limit_mb = 64;
    let sb = env.create(spec).await;
    assert_eq!(sb.usage().oom_kills, 0);
    let o = sh(
        &sb,
        "awk 'BEGIN { s = \"xxxxxxxxxxxxxxxx\"; while (1) s = s s }'; echo \"rc=$?\"",
    )
    .await;
    assert!(out(&o).contains("rc=137"), "{}", all(&o));
    assert!(sb.usage().oom_kills >= 1, "usage {:?}", sb.usage());
    assert_eq!(out(&sh(&sb, "echo alive").await), "alive");
    destroy(&env, &sb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_bomb_is_held_by_pids_limit() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "pids");
    let sb = env.create(env.spec(1)).await;
    // The loop runs in a child shell: ash gives up on the script once fork fails.
    let o = sh(
        &sb,
        "sh -c 'for i in $(seq 1 200); do sleep 60 & done' >/dev/null 2>&1; echo started",
    )
    .await;
    assert!(out(&o).contains("started"), "{}", all(&o));
    let pids = sb.usage().pids;
    assert!((50..=64).contains(&pids), "pids {pids}");
    // At the limit nothing can fork (not even pkill): the shell's builtin kill still works.
    let o = sh(&sb, "kill -9 -1; echo recovered").await;
    assert_eq!(out(&o), "recovered", "{}", all(&o));
    let mut usage = sb.usage();
    for _ in 0..50 {
        if usage.pids < 10 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        usage = sb.usage();
    }
    assert!(
        usage.pids < 10,
        "usage {usage:?}: {}",
        all(&sh(&sb, "ps -o pid,stat,comm | head -5").await)
    );
    assert_eq!(
        out(&sh(&sb, "ls / >/dev/null && echo forks").await),
        "forks"
    );
    destroy(&env, &sb).await;
}

async fn exec(sb: &ContainerSandbox, argv: &[&str]) -> CommandOutput {
    let req = Request::Exec {
        argv: argv.iter().map(|a| a.to_string()).collect(),
        timeout_ms: 30_000,
        env: BTreeMap::new(),
        cwd: None,
        user: None,
        max_output: 1 << 20,
        stream: false,
    };
    match sb.aether().run(req, Bytes::new()).await {
        Ok(o) => o,
        Err(e) => panic!("exec {argv:?}: {e}"),
    }
}

/// Polls `sb.usage().pids` until `ok` holds (10 s at most); returns the last value.
async fn wait_pids(sb: &ContainerSandbox, ok: impl Fn(u64) -> bool) -> u64 {
    let mut pids = sb.usage().pids;
    for _ in 0..100 {
        if ok(pids) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        pids = sb.usage().pids;
    }
    pids
}

/// Reads /tmp/f and execs `echo alive` `n` times; checks both; median milliseconds of each.
async fn read_and_exec_ms(sb: &ContainerSandbox, n: usize) -> (f64, f64) {
    let (mut reads, mut execs) = (Vec::new(), Vec::new());
    for round in 0..n {
        let t = std::time::Instant::now();
        let (r, body) = sb
            .aether()
            .request(
                Request::ReadFile {
                    path: "/tmp/f".into(),
                },
                Bytes::new(),
            )
            .await
            .unwrap_or_else(|e| panic!("read (round {round}): {e}"));
        reads.push(t.elapsed().as_secs_f64() * 1e3);
        assert!(
            matches!(r, dsec_wire::aether::Reply::FileEnd { .. }),
            "{r:?}"
        );
        assert_eq!(&body[..], b"marker\n");
        let t = std::time::Instant::now();
        let o = exec(sb, &["/bin/busybox", "echo", "alive"]).await;
        execs.push(t.elapsed().as_secs_f64() * 1e3);
        assert_eq!(out(&o), "alive", "round {round}: {}", all(&o));
    }
    let median = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    (median(&mut reads), median(&mut execs))
}

/// With the user pids cgroup full (as in a fork bomb), aether, outside it with a reserve, still
/// serves file reads and starts new commands, and the sandbox recovers after a kill.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fork_bomb_leaves_aether_in_control() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "bomb");
    let sb = env.create(env.spec(1)).await;
    let user_procs = sb
        .cgroup()
        .user_procs_file()
        .expect("a user cgroup (pids hierarchy mounted)");
    let o = sh(&sb, "echo marker > /tmp/f; echo ok").await;
    assert_eq!(out(&o), "ok", "{}", all(&o));
    // Commands run in the user cgroup, aether does not.
    let members = std::fs::read_to_string(&user_procs).unwrap();
    assert!(!members.trim().is_empty(), "user cgroup empty");
    assert!(
        !members.lines().any(|l| l.trim() == sb.pid().to_string()),
        "aether {} is in the user cgroup: {members}",
        sb.pid()
    );

    let idle = read_and_exec_ms(&sb, 20).await;
    let status = std::fs::read_to_string(format!("/proc/{}/status", sb.pid())).unwrap();
    let field = |k: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(k))
            .map(|v| v.trim().trim_end_matches(" kB").to_string())
            .unwrap_or_default()
    };
    let (threads, rss_kb) = (field("Threads:"), field("VmRSS:"));

    // Fill the user cgroup to exactly its limit: the loop forks sleepers until fork fails and
    // then dies, the session's shell takes the slot it frees. (A self-sustaining bomb is not
    // possible with busybox sh, which exits when fork fails.)
    let o = sh(
        &sb,
        "sh -c 'for i in $(seq 1 200); do sleep 600 & done' >/dev/null 2>&1; echo started",
    )
    .await;
    assert_eq!(out(&o), "started", "{}", all(&o));
    let o = sh(&sb, "sleep 600 & echo filled").await;
    assert_eq!(out(&o), "filled", "{}", all(&o));
    let pids = wait_pids(&sb, |p| p == 64).await;
    assert_eq!(pids, 64, "the user cgroup is not full");

    // During the bomb: file reads and new commands through aether work, repeatedly.
    let full = read_and_exec_ms(&sb, 20).await;
    assert!(sb.usage().pids <= 64, "user limit exceeded");
    eprintln!(
        "pids split: user cgroup full (64/64): read {:.2} ms, exec {:.2} ms (median of 20); idle: read {:.2} ms, exec {:.2} ms; aether idle: {} threads, VmRSS {} kB",
        full.0, full.1, idle.0, idle.1, threads, rss_kb
    );

    // Kill everything from a new command (kill(-1) spares PID 1 and the caller).
    let o = exec(&sb, &["/bin/busybox", "kill", "-9", "-1"]).await;
    assert_eq!(o.outcome.exit_code, 0, "{}", all(&o));
    let pids = wait_pids(&sb, |p| p < 5).await;
    assert!(pids < 5, "bomb survived the kill: {pids} tasks");
    // Recovered: the shell (restarted if the kill took it) forks again.
    let o = sh(&sb, "ls / >/dev/null && cat /tmp/f").await;
    assert_eq!(out(&o), "marker", "{}", all(&o));
    destroy(&env, &sb).await;
    assert!(!user_procs.exists(), "user cgroup left behind");
    assert!(env.cgroup_children().is_empty());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn destroy_leaves_nothing() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "dst");
    let spec = env.spec(1);
    let dir = spec.dir.clone();
    let sb = env.create(spec).await;
    let o = sh(&sb, "sleep 1000 & sleep 1000 & echo bg").await;
    assert_eq!(out(&o), "bg");
    let pids = sb.cgroup().procs().unwrap();
    assert!(pids.len() >= 3, "{pids:?}");
    assert_eq!(env.cgroup_children().len(), 1);
    let exited = sb.exited();
    destroy(&env, &sb).await;
    let status = exited.await;
    eprintln!("aether ended: {status:?}");
    for pid in pids {
        assert!(
            !Path::new(&format!("/proc/{pid}")).exists(),
            "pid {pid} survived"
        );
    }
    assert!(
        env.cgroup_children().is_empty(),
        "{:?}",
        env.cgroup_children()
    );
    for d in ["upper", "work", "rootfs"] {
        assert!(!dir.join(d).exists(), "{d} left behind");
    }
    assert!(dir.exists(), "the edge's sandbox dir must stay");
    // Idempotent.
    destroy(&env, &sb).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn failed_setup_rolls_back() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "fail");
    let spec = env.spec(1);
    // aether refuses a relative masked path, after the cgroup, dirs and process exist.
    let substrate = env
        .substrate
        .clone()
        .mask_more(["relative/path".to_string()]);
    let dir = spec.dir.clone();
    let err = match substrate.create(spec).await {
        Ok(sb) => {
            destroy(&env, &sb).await;
            panic!("setup with a relative masked path should fail");
        }
        Err(e) => e,
    };
    eprintln!("create failed as expected: {err}");
    assert!(matches!(err, CreateSandboxError::Setup(_)), "{err}");
    assert!(env.cgroup_children().is_empty());
    assert!(!dir.join("upper").exists() && !dir.join("work").exists());

    // A missing aether binary fails at exec and rolls back too.
    let spec = env.spec(2);
    let dir = spec.dir.clone();
    let broken = ContainerSubstrate::new(ContainerConfig {
        aether_path: env.base.join("no-such-aether"),
        cgroup_parent: env.parent.clone(),
        shm_mb: 16,
    });
    let err = broken.create(spec).await.err().expect("create must fail");
    eprintln!("create failed as expected: {err}");
    assert!(matches!(err, CreateSandboxError::Spawn(_)), "{err}");
    assert!(err.to_string().contains("exec aether"), "{err}");
    assert!(env.cgroup_children().is_empty());
    assert!(!dir.join("upper").exists());
}

/// Whether `pid` exists and is not a zombie.
fn running(pid: i32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Ok(stat) => !matches!(
            stat.rsplit(')')
                .next()
                .and_then(|r| r.split_whitespace().next()),
            Some("Z") | Some("X")
        ),
        Err(_) => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reap_orphans_removes_unknown_cgroups() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "reap");
    let keep = env.create(env.spec(1)).await;
    let orphan = env.create(env.spec(2)).await;
    let orphan_pids = orphan.cgroup().procs().unwrap();
    let reaped = env.substrate.reap_orphans(&[keep.id().to_string()]).await;
    assert_eq!(reaped, vec![orphan.id().to_string()]);
    for pid in orphan_pids {
        // Killed is enough: a zombie (this test process is the orphan's parent and reaps it
        // in its own time) is dead. The kernel may need a moment to finish the kill.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while running(pid) && std::time::Instant::now() < deadline {
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert!(!running(pid), "pid {pid} survived");
    }
    assert_eq!(out(&sh(&keep, "echo still").await), "still");
    destroy(&env, &orphan).await;
    destroy(&env, &keep).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn freeze_and_thaw() {
    let aether = skip_unless_ready!();
    let env = Env::new(aether, "frz");
    let sb = env.create(env.spec(1)).await;
    assert_eq!(out(&sh(&sb, "echo before").await), "before");
    let cg = sb.cgroup().clone();
    tokio::task::spawn_blocking(move || cg.freeze())
        .await
        .unwrap()
        .expect("freeze");
    // While frozen, a command does not complete.
    let frozen = tokio::time::timeout(
        std::time::Duration::from_millis(300),
        sh(&sb, "echo during"),
    )
    .await;
    assert!(frozen.is_err(), "a command completed in a frozen sandbox");
    let cg = sb.cgroup().clone();
    tokio::task::spawn_blocking(move || cg.thaw())
        .await
        .unwrap()
        .expect("thaw");
    assert_eq!(out(&sh(&sb, "echo after").await), "after");
    destroy(&env, &sb).await;
}
