//! The quota ledger and IAM against both storage backends: SQLite (a shared file) and
//! PostgreSQL (a private server started here: initdb + pg_ctl as the `postgres` user, on a free
//! loopback port, stopped by its PID and removed afterwards). Two ledgers on one database stand
//! in for two apiserver replicas. The PostgreSQL half is skipped, with the reason printed, when
//! the server binaries or the `postgres` user are absent.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use dsec_apiserver::db::Db;
use dsec_apiserver::iam::ledger::{EdgeLive, Ledger, Reservation, Reserved};
use dsec_apiserver::iam::{admin, IamError, Quota};
use dsec_apiserver::store::Target;

/// A throwaway PostgreSQL server.
struct PgServer {
    dir: tempfile::TempDir,
    port: u16,
    pid: Option<i32>,
}

fn pg_bindir() -> Result<PathBuf, String> {
    let mut dirs: Vec<PathBuf> = std::env::var_os("DSEC_PG_BINDIR")
        .map(PathBuf::from)
        .into_iter()
        .collect();
    if let Ok(rd) = std::fs::read_dir("/usr/lib/postgresql") {
        let mut v: Vec<PathBuf> = rd.flatten().map(|e| e.path().join("bin")).collect();
        v.sort();
        v.reverse();
        dirs.extend(v);
    }
    dirs.into_iter()
        .find(|d| {
            ["initdb", "pg_ctl", "postgres"]
                .iter()
                .all(|b| d.join(b).is_file())
        })
        .ok_or_else(|| {
            "PostgreSQL server binaries absent (install Debian's `postgresql`)".to_string()
        })
}

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("bind a free loopback port")
}

fn as_postgres(dir: &Path, argv: &[&str]) -> Result<(), String> {
    let out = Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .args(argv)
        .current_dir(dir)
        .output()
        .map_err(|e| format!("runuser: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{argv:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        ));
    }
    Ok(())
}

impl PgServer {
    fn start() -> Result<PgServer, String> {
        let bin = pg_bindir()?;
        if !nix::unistd::geteuid().is_root() {
            return Err("not root: cannot run the server as the `postgres` user".into());
        }
        let user = nix::unistd::User::from_name("postgres")
            .ok()
            .flatten()
            .ok_or("no `postgres` user")?;
        let dir = tempfile::Builder::new()
            .prefix("dsec-pg-")
            .tempdir()
            .map_err(|e| e.to_string())?;
        nix::unistd::chown(dir.path(), Some(user.uid), Some(user.gid))
            .map_err(|e| e.to_string())?;
        let port = free_port();
        let data = dir.path().join("data");
        let s = |p: &Path| p.to_string_lossy().into_owned();
        as_postgres(
            dir.path(),
            &[
                &s(&bin.join("initdb")),
                "-D",
                &s(&data),
                "-U",
                "dsec",
                "--auth=trust",
                "-E",
                "UTF8",
                "--no-sync",
            ],
        )?;
        let opts = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1 -c fsync=off -c synchronous_commit=off",
            dir.path().display()
        );
        let mut srv = PgServer {
            dir,
            port,
            pid: None,
        };
        as_postgres(
            srv.dir.path(),
            &[
                &s(&bin.join("pg_ctl")),
                "-D",
                &s(&data),
                "-l",
                &s(&srv.dir.path().join("log")),
                "-o",
                &opts,
                "-w",
                "-t",
                "60",
                "start",
            ],
        )?;
        let pidfile = std::fs::read_to_string(data.join("postmaster.pid"))
            .map_err(|e| format!("postmaster.pid: {e}"))?;
        srv.pid = pidfile.lines().next().and_then(|l| l.trim().parse().ok());
        Ok(srv)
    }

    /// A fresh database; its URL.
    fn create_db(&self, name: &str) -> String {
        let url = format!("postgres://dsec@127.0.0.1:{}/postgres", self.port);
        let db = name.to_string();
        // The blocking client must not run inside the test's runtime: a thread of its own.
        std::thread::spawn(move || {
            let mut c = postgres::Client::connect(&url, postgres::NoTls).expect("connect");
            c.batch_execute(&format!("CREATE DATABASE \"{db}\""))
                .expect("create database");
        })
        .join()
        .expect("create database thread");
        format!("postgres://dsec@127.0.0.1:{}/{name}", self.port)
    }
}

impl Drop for PgServer {
    fn drop(&mut self) {
        let Some(pid) = self.pid.take() else { return };
        let pid = nix::unistd::Pid::from_raw(pid);
        // Fast shutdown, then wait for the postmaster to go (SIGKILL after 30 s).
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let t = Instant::now();
        while nix::sys::signal::kill(pid, None).is_ok() {
            if t.elapsed() > Duration::from_secs(30) {
                let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGKILL);
                break;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

fn res(project: &str, key: Option<&str>) -> Reservation {
    Reservation {
        res_id: format!("r{:016x}", rand::random::<u64>()),
        project: project.into(),
        home: None,
        cpu_cores: 0.5,
        memory_mb: 256,
        idempotency_key: key.map(str::to_string),
    }
}

fn quota(n: u64) -> Quota {
    Quota {
        max_sandboxes: Some(n),
        ..Default::default()
    }
}

/// Everything the ledger promises, on one database shared by two "replicas".
async fn exercise(target: Target) {
    let what = target.describe();
    let db = Db::connect(target.clone()).unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(db.bootstrap().unwrap().is_some(), "{what}: fresh database");
    // A second replica opening the same database: schema and bootstrap are idempotent.
    let db2 = Db::connect(target).unwrap();
    assert!(db2.bootstrap().unwrap().is_none());
    let key = admin::create_key(&db, "agent", Some("default"), None)
        .await
        .unwrap();
    let p = db2
        .principal_for(dsec_apiserver::auth::hash_key(&key.key))
        .await
        .unwrap()
        .expect("key visible to the other replica");
    assert_eq!((p.name.as_str(), p.project.as_str()), ("agent", "default"));

    admin::create_project(&db, "team", None, Some(quota(10)))
        .await
        .unwrap();
    admin::create_project(&db2, "a", Some("team"), Some(quota(10)))
        .await
        .unwrap();
    admin::create_project(&db, "b", Some("team"), Some(quota(4)))
        .await
        .unwrap();
    let e = admin::create_project(&db, "c", Some("team"), Some(quota(11)))
        .await
        .unwrap_err();
    assert!(matches!(e, IamError::Invalid(_)), "{what}: {e}");
    let e = admin::create_project(&db2, "a", None, None)
        .await
        .unwrap_err();
    assert!(matches!(e, IamError::Conflict(_)), "{what}: {e}");

    // Two replicas, 120 concurrent creates into `a` and `b` (their parent `team` allows 10,
    // `b` alone 4): never more than the quotas, whatever the interleaving.
    let (l1, l2) = (Ledger::open(&db).unwrap(), Ledger::open(&db2).unwrap());
    let mut tasks = Vec::new();
    for i in 0..120 {
        let l = if i % 2 == 0 { l1.clone() } else { l2.clone() };
        let project = if i % 3 == 0 { "b" } else { "a" };
        tasks.push(tokio::spawn(async move {
            (project, l.reserve(res(project, None)).await)
        }));
    }
    let (mut a_ok, mut b_ok) = (0, 0);
    for t in tasks {
        match t.await.unwrap() {
            (p, Ok(Reserved::New)) => *(if p == "a" { &mut a_ok } else { &mut b_ok }) += 1,
            (_, Err(IamError::QuotaExceeded(_))) => {}
            (p, other) => panic!("{what}: {p}: {other:?}"),
        }
    }
    assert_eq!(a_ok + b_ok, 10, "{what}: team's quota is exactly filled");
    assert!(b_ok <= 4, "{what}: b over its quota: {b_ok}");
    let usage = |list: dsec_apiserver::iam::ProjectList, name: &str| {
        list.projects
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.usage)
            .unwrap()
    };
    let list = admin::list_projects(&db2).await.unwrap();
    assert_eq!(usage(list.clone(), "team").sandboxes, 10, "{what}");
    assert_eq!(usage(list.clone(), "team").memory_mb, 10 * 256, "{what}");
    assert_eq!(usage(list.clone(), "root").sandboxes, 10, "{what}");
    assert!((usage(list, "team").cpu_cores - 5.0).abs() < 1e-9, "{what}");

    // Quota set below what a child was delegated: refused; raising works on the other replica.
    assert!(admin::set_quota(&db, "team", quota(3)).await.is_err());
    admin::set_quota(&db2, "team", quota(12)).await.unwrap();

    // Idempotency across replicas: concurrent creates with one key → one reservation.
    let mut tasks = Vec::new();
    for i in 0..10 {
        let l = if i % 2 == 0 { l1.clone() } else { l2.clone() };
        tasks.push(tokio::spawn(async move {
            let r = res("a", Some("same-key"));
            let id = r.res_id.clone();
            (id, l.reserve(r).await)
        }));
    }
    let mut winner = None;
    for t in tasks {
        match t.await.unwrap() {
            (id, Ok(Reserved::New)) => {
                assert!(winner.is_none(), "{what}: two reservations for one key");
                winner = Some(id);
            }
            (_, Ok(Reserved::InFlight)) => {}
            (_, other) => panic!("{what}: {other:?}"),
        }
    }
    let winner = winner.expect("one reservation for the key");
    l1.bind(&winner, "sb-n0-00000000000000aa", "n0");
    // The bind is fire-and-forget on replica 1: replica 2 sees it once it committed.
    let t = Instant::now();
    loop {
        match l2.reserve(res("a", Some("same-key"))).await.unwrap() {
            Reserved::InFlight if t.elapsed() < Duration::from_secs(5) => {
                tokio::time::sleep(Duration::from_millis(10)).await
            }
            r => {
                assert_eq!(
                    r,
                    Reserved::Existing {
                        sandbox_id: "sb-n0-00000000000000aa".into()
                    },
                    "{what}"
                );
                break;
            }
        }
    }

    // Reconcile on one replica releases what the edge no longer has; usage goes back to 10.
    let n = l2
        .reconcile(
            vec![EdgeLive {
                node: "n0".into(),
                sandboxes: vec![],
            }],
            dsec_apiserver::iam::ledger::now_ms() + 1000,
            dsec_apiserver::iam::ledger::now_ms() + 1000,
        )
        .await
        .unwrap();
    assert_eq!(
        n, 11,
        "{what}: the bound one and the 10 never-bound reservations"
    );
    let list = admin::list_projects(&db).await.unwrap();
    assert_eq!(usage(list, "team").sandboxes, 0, "{what}");
    assert_eq!(
        l1.reserve(res("b", None)).await.unwrap(),
        Reserved::New,
        "{what}"
    );

    // Keys: revoke on one replica, gone on the other.
    admin::revoke_key(&db2, &key.key_id).await.unwrap();
    assert!(db
        .principal_for(dsec_apiserver::auth::hash_key(&key.key))
        .await
        .unwrap()
        .is_none());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ledger_on_sqlite() {
    let dir = tempfile::tempdir().unwrap();
    exercise(Target::Sqlite(dir.path().join("iam.db"))).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ledger_on_postgres() {
    let srv = match PgServer::start() {
        Ok(s) => s,
        Err(why) => {
            eprintln!("SKIP ledger_on_postgres: {why}");
            return;
        }
    };
    let url = srv.create_db("ledger_test");
    exercise(Target::parse(&url)).await;

    // Connections lost (server restart, network): the next call after the failed one works.
    let url = srv.create_db("reconnect_test");
    let db = Db::connect(Target::parse(&url)).unwrap();
    db.bootstrap().unwrap();
    let l = Ledger::open(&db).unwrap();
    assert_eq!(
        l.reserve(res("default", None)).await.unwrap(),
        Reserved::New
    );
    let admin_url = format!("postgres://dsec@127.0.0.1:{}/postgres", srv.port);
    std::thread::spawn(move || {
        let mut c = postgres::Client::connect(&admin_url, postgres::NoTls).expect("connect");
        c.batch_execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity
             WHERE datname = 'reconnect_test' AND pid <> pg_backend_pid()",
        )
        .expect("terminate");
    })
    .join()
    .unwrap();
    let _ = l.reserve(res("default", None)).await; // may fail: the connection is gone
    let _ = admin::list_projects(&db).await;
    assert_eq!(
        l.reserve(res("default", None)).await.unwrap(),
        Reserved::New
    );
    let list = admin::list_projects(&db).await.unwrap();
    assert!(list.projects.iter().any(|p| p.name == "default"));
    drop(srv);
}

/// A bad URL fails clearly, naming the server without its password.
#[tokio::test]
async fn unreachable_postgres_is_a_clear_error() {
    let port = free_port();
    let url = format!("postgres://dsec:secret@127.0.0.1:{port}/nope");
    let e = match Db::connect(Target::parse(&url)) {
        Ok(_) => panic!("connected to nothing"),
        Err(e) => e.to_string(),
    };
    assert!(e.contains("connect to IAM database"), "{e}");
    assert!(!e.contains("secret"), "{e}");
}

/// Admission throughput of the ledger on one backend: two replicas' ledgers, `conc` tasks each
/// looping reserve → bind → release for `secs`; returns (admissions/s, p50 ms, p99 ms).
async fn throughput(target: Target, conc: usize, secs: f64) -> (f64, f64, f64) {
    let db = Db::connect(target).unwrap();
    db.bootstrap().unwrap();
    admin::create_project(&db, "bench", None, Some(quota(1_000_000)))
        .await
        .unwrap();
    let ledgers = [Ledger::open(&db).unwrap(), Ledger::open(&db).unwrap()];
    let start = Instant::now();
    let deadline = start + Duration::from_secs_f64(secs);
    let mut tasks = Vec::new();
    for i in 0..conc {
        let l = ledgers[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::new();
            let mut n = 0u64;
            while Instant::now() < deadline {
                let r = res("bench", None);
                let id = r.res_id.clone();
                let t = Instant::now();
                assert_eq!(l.reserve(r).await.unwrap(), Reserved::New);
                lat.push(t.elapsed().as_secs_f64() * 1000.0);
                n += 1;
                let sb = format!("sb-n{}-{:016x}", i % 8, rand::random::<u64>());
                l.bind(&id, &sb, &format!("n{}", i % 8));
                l.release_sandbox(&sb);
            }
            (n, lat)
        }));
    }
    let mut all = Vec::new();
    let mut total = 0;
    for t in tasks {
        let (n, lat) = t.await.unwrap();
        total += n;
        all.extend(lat);
    }
    let elapsed = start.elapsed().as_secs_f64();
    all.sort_by(|a, b| a.total_cmp(b));
    let pct = |p: f64| all[((all.len() as f64 * p) as usize).min(all.len() - 1)];
    (total as f64 / elapsed, pct(0.5), pct(0.99))
}

/// `cargo test --release -p dsec-apiserver --test ledger_backends -- --ignored --nocapture`
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "benchmark"]
async fn bench_ledger_backends() {
    let secs: f64 = std::env::var("LEDGER_BENCH_SECS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(5.0);
    let dir = tempfile::tempdir().unwrap();
    let pg = PgServer::start();
    if let Err(why) = &pg {
        eprintln!("SKIP postgres half: {why}");
    }
    for conc in [64usize, 512] {
        let (rate, p50, p99) = throughput(
            Target::Sqlite(dir.path().join(format!("b{conc}.db"))),
            conc,
            secs,
        )
        .await;
        println!(
            "sqlite   conc={conc:4}: {rate:8.0} admissions/s  p50 {p50:6.2} ms  p99 {p99:6.2} ms"
        );
        if let Ok(pg) = &pg {
            let url = pg.create_db(&format!("bench{conc}"));
            let (rate, p50, p99) = throughput(Target::parse(&url), conc, secs).await;
            println!(
                "postgres conc={conc:4}: {rate:8.0} admissions/s  p50 {p50:6.2} ms  p99 {p99:6.2} ms"
            );
        }
    }
}
