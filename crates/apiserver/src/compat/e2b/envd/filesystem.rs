//! `filesystem.Filesystem` onto dsec's native file API (`/v1/sandboxes/{id}/files...`,
//! `/watch`): Stat, MakeDir, Move, ListDir (with depth), Remove, WatchDir (a stream) and the
//! polled watchers (CreateWatcher / GetWatcherEvents / RemoveWatcher), whose events are
//! buffered here (bounded) while the native watch runs.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::http::Method;
use axum::response::Response;
use dsec_e2b_envd::connect::{Code, ConnectError};
use dsec_e2b_envd::pb::filesystem as pb;
use dsec_wire::api::{FileInfo, FileKind, FileList, FsEvent, FsEventKind};
use futures::{Stream, StreamExt};

use super::native::{q, Native};
use super::rpc::{self, Call};
use super::{resolve_path, Ctx};

/// Most entries a ListDir answers.
const MAX_LIST_ENTRIES: usize = 100_000;
/// Most events a polled watcher keeps between two polls (older ones are dropped).
const MAX_WATCHER_EVENTS: usize = 10_000;
/// Most polled watchers at once on this apiserver.
const MAX_WATCHERS: usize = 1_000;
const KEEPALIVE: Duration = Duration::from_secs(15);

/// User and group names by id, read from the sandbox's /etc/passwd and /etc/group.
#[derive(Default, Clone)]
pub struct Names {
    users: HashMap<u32, String>,
    groups: HashMap<u32, String>,
}

/// The `name:x:id:...` lines of a passwd or group file.
pub fn parse_id_file(text: &str) -> HashMap<u32, String> {
    text.lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            let name = f.next()?;
            let id = f.nth(1)?.parse().ok()?;
            Some((id, name.to_string()))
        })
        .collect()
}

fn names_cache() -> &'static Mutex<HashMap<String, (Names, Instant)>> {
    static N: std::sync::OnceLock<Mutex<HashMap<String, (Names, Instant)>>> =
        std::sync::OnceLock::new();
    N.get_or_init(|| Mutex::new(HashMap::new()))
}

async fn read_text(native: &Native<'_>, path: &str) -> String {
    match native
        .send(
            Method::GET,
            &format!("/files?path={}", q(path)),
            &Default::default(),
            crate::forward::ForwardBody::Empty,
        )
        .await
    {
        Ok(r) => r.text().await.unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// The sandbox's user and group names (cached for a minute).
pub async fn names(native: &Native<'_>) -> Names {
    if let Ok(c) = names_cache().lock() {
        if let Some((n, at)) = c.get(native.id()) {
            if at.elapsed() < Duration::from_secs(60) {
                return n.clone();
            }
        }
    }
    let n = Names {
        users: parse_id_file(&read_text(native, "/etc/passwd").await),
        groups: parse_id_file(&read_text(native, "/etc/group").await),
    };
    if let Ok(mut c) = names_cache().lock() {
        if c.len() > 10_000 {
            c.clear();
        }
        c.insert(native.id().to_string(), (n.clone(), Instant::now()));
    }
    n
}

/// `-rw-r--r--`-style permissions.
pub fn permissions(kind: FileKind, mode: u32) -> String {
    let mut s = String::with_capacity(10);
    s.push(match kind {
        FileKind::Dir => 'd',
        FileKind::Symlink => 'l',
        _ => '-',
    });
    for shift in [6, 3, 0] {
        let bits = (mode >> shift) & 7;
        s.push(if bits & 4 != 0 { 'r' } else { '-' });
        s.push(if bits & 2 != 0 { 'w' } else { '-' });
        s.push(if bits & 1 != 0 { 'x' } else { '-' });
    }
    s
}

/// A native file description as E2B's `EntryInfo`.
pub fn entry(f: &FileInfo, names: &Names) -> pb::EntryInfo {
    let r#type = match f.kind {
        FileKind::File => pb::FileType::File,
        FileKind::Dir => pb::FileType::Directory,
        FileKind::Symlink => pb::FileType::Symlink,
        FileKind::Other => pb::FileType::Unspecified,
    };
    pb::EntryInfo {
        name: f.name.clone(),
        r#type: r#type as i32,
        path: f.path.clone(),
        size: f.size as i64,
        mode: f.mode,
        permissions: permissions(f.kind, f.mode),
        owner: names
            .users
            .get(&f.uid)
            .cloned()
            .unwrap_or_else(|| f.uid.to_string()),
        group: names
            .groups
            .get(&f.gid)
            .cloned()
            .unwrap_or_else(|| f.gid.to_string()),
        modified_time: Some(dsec_e2b_envd::pbjson_types::Timestamp {
            seconds: f.mtime,
            nanos: 0,
        }),
        symlink_target: f.link_target.clone(),
        metadata: Default::default(),
        is_symlink: f.kind == FileKind::Symlink,
    }
}

async fn user_path(ctx: Ctx<'_>, native: &Native<'_>, path: &str) -> Result<String, ConnectError> {
    let user = super::effective_user(native, ctx.user.clone()).await?;
    resolve_path(path, &user)
}

async fn stat_native(native: &Native<'_>, path: &str) -> Result<FileInfo, ConnectError> {
    native
        .json(Method::GET, &format!("/files/stat?path={}", q(path)), None)
        .await
}

pub async fn stat(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::StatRequest = call.message().await?;
        let native = Native::new(ctx.st, ctx.id)?;
        let path = user_path(ctx, &native, &req.path).await?;
        let f = stat_native(&native, &path).await?;
        Ok(pb::StatResponse {
            entry: Some(entry(&f, &names(&native).await)),
        })
    }
    .await;
    rpc::unary(call.codec, r)
}

/// Gives `path` to `user` (the native file calls act as root).
pub async fn chown(native: &Native<'_>, user: &str, path: &str) -> Result<(), ConnectError> {
    if user == "root" {
        return Ok(());
    }
    let r: dsec_wire::api::CommandResult = native
        .json(
            Method::POST,
            "/exec",
            Some(serde_json::json!({
                "argv": ["chown", format!("{user}:"), path],
                "user": "root",
                "timeout": 30.0,
            })),
        )
        .await?;
    if r.exit_code != 0 {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            format!("cannot give {path} to user {user:?}: {}", r.stderr.trim()),
        ));
    }
    Ok(())
}

pub async fn make_dir(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::MakeDirRequest = call.message().await?;
        let native = Native::new(ctx.st, ctx.id)?;
        let user = super::effective_user(&native, ctx.user.clone()).await?;
        let path = resolve_path(&req.path, &user)?;
        match stat_native(&native, &path).await {
            Ok(_) => {
                return Err(ConnectError::new(
                    Code::AlreadyExists,
                    format!("{path} already exists"),
                ))
            }
            Err(e) if e.code == Code::NotFound => {}
            Err(e) => return Err(e),
        }
        let f: FileInfo = native
            .json(
                Method::POST,
                &format!("/files/mkdir?path={}&parents=true", q(&path)),
                None,
            )
            .await?;
        chown(&native, &user, &path).await?;
        let f = stat_native(&native, &path).await.unwrap_or(f);
        Ok(pb::MakeDirResponse {
            entry: Some(entry(&f, &names(&native).await)),
        })
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn move_entry(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::MoveRequest = call.message().await?;
        let native = Native::new(ctx.st, ctx.id)?;
        let user = super::effective_user(&native, ctx.user.clone()).await?;
        let src = resolve_path(&req.source, &user)?;
        let dst = resolve_path(&req.destination, &user)?;
        let f: FileInfo = native
            .json(
                Method::POST,
                &format!(
                    "/files/rename?src={}&dst={}&overwrite=true",
                    q(&src),
                    q(&dst)
                ),
                None,
            )
            .await?;
        Ok(pb::MoveResponse {
            entry: Some(entry(&f, &names(&native).await)),
        })
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn list_dir(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::ListDirRequest = call.message().await?;
        let native = Native::new(ctx.st, ctx.id)?;
        let path = user_path(ctx, &native, &req.path).await?;
        let depth = req.depth.max(1);
        let root = stat_native(&native, &path).await?;
        if root.kind != FileKind::Dir {
            return Err(ConnectError::new(
                Code::InvalidArgument,
                format!("{path} is not a directory"),
            ));
        }
        let names = names(&native).await;
        let mut out = Vec::new();
        let mut level = vec![path];
        for _ in 0..depth {
            let mut next = Vec::new();
            for dir in level {
                let l: FileList = match native
                    .json(Method::GET, &format!("/files/list?path={}", q(&dir)), None)
                    .await
                {
                    Ok(l) => l,
                    // A directory removed or unreadable while walking is skipped.
                    Err(e) if !out.is_empty() && e.code != Code::Unavailable => continue,
                    Err(e) => return Err(e),
                };
                for f in l.entries {
                    if f.kind == FileKind::Dir {
                        next.push(f.path.clone());
                    }
                    out.push(entry(&f, &names));
                    if out.len() >= MAX_LIST_ENTRIES {
                        return Err(ConnectError::new(
                            Code::ResourceExhausted,
                            format!(
                                "more than {MAX_LIST_ENTRIES} entries; list with a smaller depth"
                            ),
                        ));
                    }
                }
            }
            level = next;
        }
        Ok(pb::ListDirResponse { entries: out })
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn remove(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::RemoveRequest = call.message().await?;
        let native = Native::new(ctx.st, ctx.id)?;
        let path = user_path(ctx, &native, &req.path).await?;
        native
            .call(
                Method::DELETE,
                &format!("/files?path={}&recursive=true", q(&path)),
                None,
            )
            .await?;
        Ok(pb::RemoveResponse {})
    }
    .await;
    rpc::unary(call.codec, r)
}

/// E2B's events for one native event, names relative to the watched `root`.
pub fn fs_events(root: &str, ev: &FsEvent) -> Vec<pb::FilesystemEvent> {
    let rel = |p: &str| {
        p.strip_prefix(root)
            .map(|r| r.trim_start_matches('/'))
            .filter(|r| !r.is_empty())
            .unwrap_or(p)
            .to_string()
    };
    let one = |t: pb::EventType, p: &str| pb::FilesystemEvent {
        name: rel(p),
        r#type: t as i32,
        entry: None,
    };
    match ev.kind {
        FsEventKind::Create => vec![one(pb::EventType::Create, &ev.path)],
        FsEventKind::Write => vec![one(pb::EventType::Write, &ev.path)],
        FsEventKind::Remove => vec![one(pb::EventType::Remove, &ev.path)],
        FsEventKind::Chmod => vec![one(pb::EventType::Chmod, &ev.path)],
        FsEventKind::Rename => {
            let mut v = vec![one(pb::EventType::Rename, &ev.path)];
            if let Some(to) = &ev.to {
                v.push(one(pb::EventType::Create, to));
            }
            v
        }
        FsEventKind::Ready | FsEventKind::Overflow => vec![],
    }
}

type Events = std::pin::Pin<Box<dyn Stream<Item = Result<FsEvent, ConnectError>> + Send>>;

/// Opens a native watch and waits for its `ready` event.
async fn open_watch(
    native: &Native<'_>,
    path: &str,
    recursive: bool,
) -> Result<Events, ConnectError> {
    let f = stat_native(native, path).await?;
    if f.kind != FileKind::Dir {
        return Err(ConnectError::new(
            Code::InvalidArgument,
            format!("{path} is not a directory"),
        ));
    }
    let mut s: Events = Box::pin(
        native
            .ndjson::<FsEvent>(&format!("/watch?path={}&recursive={recursive}", q(path)))
            .await?,
    );
    match s.next().await {
        Some(Ok(ev)) if ev.kind == FsEventKind::Ready => Ok(s),
        Some(Err(e)) => Err(e),
        _ => Err(ConnectError::new(
            Code::Unavailable,
            format!("the watch of {path} ended before it was in place"),
        )),
    }
}

pub async fn watch_dir(ctx: Ctx<'_>, mut call: Call) -> Response {
    let req: pb::WatchDirRequest = match call.message().await {
        Ok(r) => r,
        Err(e) => return rpc::error_for(call.kind, &e),
    };
    let st = ctx.st.clone();
    let id = ctx.id.to_string();
    let user = ctx.user.clone();
    rpc::server_stream(call.codec, call.timeout, move |mut sink| async move {
        let native = Native::new(&st, &id)?;
        let user = super::effective_user(&native, user).await?;
        let path = resolve_path(&req.path, &user)?;
        let mut events = open_watch(&native, &path, req.recursive).await?;
        let start = pb::WatchDirResponse {
            event: Some(pb::watch_dir_response::Event::Start(
                pb::watch_dir_response::StartEvent {},
            )),
        };
        if !sink.send(&start).await {
            return Ok(());
        }
        loop {
            let next = tokio::select! {
                n = events.next() => n,
                _ = tokio::time::sleep(KEEPALIVE) => {
                    let ka = pb::WatchDirResponse {
                        event: Some(pb::watch_dir_response::Event::Keepalive(
                            pb::watch_dir_response::KeepAlive {},
                        )),
                    };
                    if !sink.send(&ka).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            let Some(ev) = next else {
                return Ok(());
            };
            for e in fs_events(&path, &ev?) {
                let m = pb::WatchDirResponse {
                    event: Some(pb::watch_dir_response::Event::Filesystem(e)),
                };
                if !sink.send(&m).await {
                    return Ok(());
                }
            }
        }
    })
}

struct Watcher {
    sandbox: String,
    events: Arc<Mutex<(VecDeque<pb::FilesystemEvent>, Option<ConnectError>)>>,
    task: tokio::task::JoinHandle<()>,
}

fn watchers() -> &'static Mutex<HashMap<String, Watcher>> {
    static W: std::sync::OnceLock<Mutex<HashMap<String, Watcher>>> = std::sync::OnceLock::new();
    W.get_or_init(|| Mutex::new(HashMap::new()))
}

fn no_watcher(id: &str) -> ConnectError {
    ConnectError::new(Code::NotFound, format!("watcher {id:?} not found"))
}

pub async fn create_watcher(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::CreateWatcherRequest = call.message().await?;
        if watchers().lock().map(|w| w.len()).unwrap_or(0) >= MAX_WATCHERS {
            return Err(ConnectError::new(
                Code::ResourceExhausted,
                format!("{MAX_WATCHERS} watchers are open on this server; remove some first"),
            ));
        }
        let native = Native::new(ctx.st, ctx.id)?;
        let path = user_path(ctx, &native, &req.path).await?;
        let mut events = open_watch(&native, &path, req.recursive).await?;
        let buf = Arc::new(Mutex::new((VecDeque::new(), None)));
        let sink = buf.clone();
        let task = tokio::spawn(async move {
            while let Some(ev) = events.next().await {
                let Ok(mut b) = sink.lock() else { return };
                match ev {
                    Ok(ev) => {
                        for e in fs_events(&path, &ev) {
                            if b.0.len() >= MAX_WATCHER_EVENTS {
                                b.0.pop_front();
                            }
                            b.0.push_back(e);
                        }
                    }
                    Err(e) => {
                        b.1 = Some(e);
                        return;
                    }
                }
            }
            if let Ok(mut b) = sink.lock() {
                b.1.get_or_insert_with(|| {
                    ConnectError::new(Code::NotFound, "the watched directory or sandbox is gone")
                });
            }
        });
        let wid = format!("w-{}", hex::encode(rand::random::<[u8; 8]>()));
        if let Ok(mut w) = watchers().lock() {
            w.insert(
                wid.clone(),
                Watcher {
                    sandbox: ctx.id.to_string(),
                    events: buf,
                    task,
                },
            );
        }
        Ok(pb::CreateWatcherResponse { watcher_id: wid })
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn get_watcher_events(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::GetWatcherEventsRequest = call.message().await?;
        let w = watchers()
            .lock()
            .map_err(|_| ConnectError::new(Code::Internal, "watcher table poisoned"))?;
        let watcher = w
            .get(&req.watcher_id)
            .filter(|w| w.sandbox == ctx.id)
            .ok_or_else(|| no_watcher(&req.watcher_id))?;
        let mut b = watcher
            .events
            .lock()
            .map_err(|_| ConnectError::new(Code::Internal, "watcher buffer poisoned"))?;
        let events: Vec<_> = b.0.drain(..).collect();
        if events.is_empty() {
            if let Some(e) = b.1.clone() {
                return Err(e);
            }
        }
        Ok(pb::GetWatcherEventsResponse { events })
    }
    .await;
    rpc::unary(call.codec, r)
}

pub async fn remove_watcher(ctx: Ctx<'_>, mut call: Call) -> Response {
    let r = async {
        let req: pb::RemoveWatcherRequest = call.message().await?;
        let mut w = watchers()
            .lock()
            .map_err(|_| ConnectError::new(Code::Internal, "watcher table poisoned"))?;
        match w.get(&req.watcher_id) {
            Some(x) if x.sandbox == ctx.id => {}
            _ => return Err(no_watcher(&req.watcher_id)),
        }
        if let Some(x) = w.remove(&req.watcher_id) {
            x.task.abort();
        }
        Ok(pb::RemoveWatcherResponse {})
    }
    .await;
    rpc::unary(call.codec, r)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_carry_names_permissions_and_types() {
        let names = Names {
            users: parse_id_file(
                "root:x:0:0:root:/root:/bin/bash\nuser:x:1000:1000::/home/user:/bin/bash\n",
            ),
            groups: parse_id_file("root:x:0:\nuser:x:1000:\n"),
        };
        let f = FileInfo {
            path: "/home/user/a".into(),
            name: "a".into(),
            kind: FileKind::Dir,
            size: 4096,
            mode: 0o755,
            uid: 1000,
            gid: 1000,
            mtime: 1_700_000_000,
            link_target: None,
        };
        let e = entry(&f, &names);
        assert_eq!(e.r#type, pb::FileType::Directory as i32);
        assert_eq!(e.permissions, "drwxr-xr-x");
        assert_eq!((e.owner.as_str(), e.group.as_str()), ("user", "user"));
        assert_eq!(e.modified_time.unwrap().seconds, 1_700_000_000);
        let e = entry(&FileInfo { uid: 4242, ..f }, &names);
        assert_eq!(e.owner, "4242");
        assert_eq!(permissions(FileKind::File, 0o640), "-rw-r-----");
    }

    #[test]
    fn watch_events_are_relative_to_the_watched_directory() {
        let ev = |kind, path: &str, to: Option<&str>| FsEvent {
            kind,
            path: path.into(),
            to: to.map(Into::into),
            is_dir: false,
        };
        let v = fs_events("/w", &ev(FsEventKind::Create, "/w/sub/a.txt", None));
        assert_eq!(v[0].name, "sub/a.txt");
        assert_eq!(v[0].r#type, pb::EventType::Create as i32);
        let v = fs_events("/w", &ev(FsEventKind::Rename, "/w/a", Some("/w/b")));
        assert_eq!(v.len(), 2);
        assert_eq!((v[0].name.as_str(), v[1].name.as_str()), ("a", "b"));
        assert!(fs_events("/w", &ev(FsEventKind::Ready, "/w", None)).is_empty());
    }
}
