//! Root integration tests of the image store against the real kernel: mkfs.erofs, file-backed
//! EROFS mounts, /proc/self/mountinfo. Each test skips with a printed reason when it cannot run.

mod common;

use std::fs;
use std::io::Write;
use std::os::unix::fs::{symlink, PermissionsExt};
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{mount_count, snapshot, TestStore};
use dsec_image::{ImageError, ImportOptions};
use nix::sys::stat::{self, Mode, SFlag};

/// A directory with one of every kind of file, odd modes, foreign owners and an xattr.
fn make_tree(root: &Path) {
    fs::create_dir_all(root.join("dir/sub")).unwrap();
    fs::write(root.join("reg"), b"hello world\n").unwrap();
    fs::set_permissions(root.join("reg"), fs::Permissions::from_mode(0o4751)).unwrap();
    fs::write(root.join("dir/secret"), vec![7u8; 100_000]).unwrap();
    fs::set_permissions(root.join("dir/secret"), fs::Permissions::from_mode(0o600)).unwrap();
    fs::write(root.join("empty"), b"").unwrap();
    fs::set_permissions(root.join("empty"), fs::Permissions::from_mode(0o000)).unwrap();
    fs::set_permissions(root.join("dir"), fs::Permissions::from_mode(0o710)).unwrap();
    fs::set_permissions(root.join("dir/sub"), fs::Permissions::from_mode(0o3775)).unwrap();
    symlink("reg", root.join("link")).unwrap();
    symlink("/nonexistent/target", root.join("dangling")).unwrap();
    fs::hard_link(root.join("reg"), root.join("hard")).unwrap();
    nix::unistd::mkfifo(&root.join("fifo"), Mode::from_bits_truncate(0o640)).unwrap();
    stat::mknod(
        &root.join("null"),
        SFlag::S_IFCHR,
        Mode::from_bits_truncate(0o666),
        stat::makedev(1, 3),
    )
    .unwrap();
    fs::write(root.join("owned"), b"mine").unwrap();
    nix::unistd::chown(&root.join("owned"), Some(1234.into()), Some(5678.into())).unwrap();
    nix::unistd::chown(&root.join("dir/sub"), Some(1000.into()), Some(1000.into())).unwrap();
    common::set_xattr(&root.join("reg"), "user.test", b"xattr value");
    common::set_xattr(&root.join("dir"), "user.dir", b"d");
    // Distinct mtimes (chmod after chown so set-id bits survive).
    fs::set_permissions(root.join("reg"), fs::Permissions::from_mode(0o4751)).unwrap();
    let t = nix::sys::time::TimeSpec::new(1_000_000_000, 0);
    for p in [
        "reg",
        "owned",
        "dir/secret",
        "dangling",
        "dir/sub",
        "dir",
        "",
    ] {
        stat::utimensat(
            None,
            &root.join(p),
            &t,
            &t,
            stat::UtimensatFlags::NoFollowSymlink,
        )
        .unwrap();
    }
}

#[tokio::test]
async fn import_dir_round_trips_every_kind_of_file() {
    skip_unless_capable!();
    let t = TestStore::new();
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    make_tree(&src);
    let info = t.store.import_dir("kinds:v1", &src).await.unwrap();
    assert_eq!(info.name, "kinds:v1");
    assert_eq!(info.layers.len(), 1);
    assert!(info.size_bytes > 0);
    assert_eq!(info.in_use, 0);

    let lease = t.store.acquire("kinds:v1").await.unwrap();
    assert_eq!(lease.image(), "kinds:v1");
    let lowers = lease.lowers();
    assert_eq!(
        lowers,
        vec![t.root().join("mnt").join(&info.layers[0].digest)]
    );
    assert_eq!(t.store.get("kinds:v1").unwrap().in_use, 1);

    let want = snapshot(&src);
    let got = snapshot(&lowers[0]);
    assert_eq!(
        want.keys().collect::<Vec<_>>(),
        got.keys().collect::<Vec<_>>()
    );
    for (path, w) in &want {
        assert_eq!(&got[path], w, "{} differs", path.display());
    }
    assert_eq!(got[Path::new("hard")].nlink, 2);
    assert_eq!(
        got[Path::new("reg")].xattrs.get("user.test").unwrap(),
        b"xattr value"
    );
    drop(lease);
}

fn tar_gz() -> Vec<u8> {
    let gz = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    let mut b = tar::Builder::new(gz);
    let header = |kind: tar::EntryType, mode: u32, uid: u64, gid: u64| {
        let mut h = tar::Header::new_ustar();
        h.set_entry_type(kind);
        h.set_mode(mode);
        h.set_uid(uid);
        h.set_gid(gid);
        h.set_mtime(1_234_567_890);
        h.set_size(0);
        h
    };
    let mut h = header(tar::EntryType::Directory, 0o755, 0, 0);
    b.append_data(&mut h, "./", &b""[..]).unwrap();
    let mut h = header(tar::EntryType::Directory, 0o750, 1234, 5678);
    b.append_data(&mut h, "./data/", &b""[..]).unwrap();
    // A file with an xattr, carried as a PAX extension.
    b.append_pax_extensions([("SCHILY.xattr.user.test", &b"from tar"[..])])
        .unwrap();
    let mut h = header(tar::EntryType::Regular, 0o640, 1234, 5678);
    h.set_size(5);
    b.append_data(&mut h, "./data/file", &b"12345"[..]).unwrap();
    let mut h = header(tar::EntryType::Symlink, 0o777, 0, 0);
    b.append_link(&mut h, "./data/link", "file").unwrap();
    let mut h = header(tar::EntryType::Link, 0o640, 1234, 5678);
    b.append_link(&mut h, "./data/hard", "data/file").unwrap();
    let mut h = header(tar::EntryType::Char, 0o620, 0, 5);
    h.set_device_major(4).unwrap();
    h.set_device_minor(2).unwrap();
    b.append_data(&mut h, "./dev/tty2", &b""[..]).unwrap();
    let mut h = header(tar::EntryType::Fifo, 0o600, 1000, 1000);
    b.append_data(&mut h, "./run/pipe", &b""[..]).unwrap();
    // OCI whiteouts.
    let mut h = header(tar::EntryType::Regular, 0o644, 0, 0);
    b.append_data(&mut h, "./data/.wh.gone", &b""[..]).unwrap();
    let mut h = header(tar::EntryType::Directory, 0o755, 0, 0);
    b.append_data(&mut h, "./opq/", &b""[..]).unwrap();
    let mut h = header(tar::EntryType::Regular, 0o644, 0, 0);
    b.append_data(&mut h, "./opq/.wh..wh..opq", &b""[..])
        .unwrap();
    let gz = b.into_inner().unwrap();
    gz.finish().unwrap()
}

#[tokio::test]
async fn import_tar_gz_preserves_metadata_and_converts_whiteouts() {
    skip_unless_capable!();
    let t = TestStore::new();
    let data = tar_gz();
    let info = t
        .store
        .import_tar("fromtar", std::io::Cursor::new(data))
        .await
        .unwrap();
    assert_eq!(info.name, "fromtar:latest");
    let lease = t.store.acquire("fromtar:latest").await.unwrap();
    let root = lease.lowers().remove(0);
    let snap = snapshot(&root);
    let n = |p: &str| {
        snap.get(Path::new(p))
            .unwrap_or_else(|| panic!("{p} missing: {snap:#?}"))
    };

    let d = n("data");
    assert_eq!(
        (d.kind, d.mode & 0o7777, d.uid, d.gid, d.mtime),
        ("dir", 0o750, 1234, 5678, 1_234_567_890)
    );
    let f = n("data/file");
    assert_eq!(
        (f.kind, f.mode & 0o7777, f.uid, f.gid, f.size, f.nlink),
        ("file", 0o640, 1234, 5678, 5, 2)
    );
    assert_eq!(f.mtime, 1_234_567_890);
    assert_eq!(
        f.xattrs.get("user.test").map(Vec::as_slice),
        Some(&b"from tar"[..])
    );
    assert_eq!(n("data/link").link.as_deref(), Some(Path::new("file")));
    let c = n("dev/tty2");
    assert_eq!(
        (c.kind, c.mode & 0o7777, c.gid, c.rdev),
        ("chr", 0o620, 5, stat::makedev(4, 2))
    );
    let p = n("run/pipe");
    assert_eq!((p.kind, p.uid), ("fifo", 1000));
    let w = n("data/gone");
    assert_eq!(
        (w.kind, w.rdev),
        ("chr", 0),
        "OCI whiteout becomes a 0:0 char device"
    );
    assert!(!snap.contains_key(Path::new("data/.wh.gone")));
    assert_eq!(
        n("opq")
            .xattrs
            .get("trusted.overlay.opaque")
            .map(Vec::as_slice),
        Some(&b"y"[..])
    );
    assert!(!snap.contains_key(Path::new("opq/.wh..wh..opq")));
    drop(lease);
}

#[tokio::test]
async fn concurrent_acquires_mount_once_and_grace_unmounts() {
    skip_unless_capable!();
    let t = TestStore::new();
    t.store.set_unmount_grace(Duration::from_millis(300));
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("f"), b"x").unwrap();
    t.store.import_dir("one", &src).await.unwrap();

    let (a, b, c) = tokio::join!(
        t.store.acquire("one"),
        t.store.acquire("one:latest"),
        t.store.acquire("one")
    );
    let (a, b, c) = (a.unwrap(), b.unwrap(), c.unwrap());
    let mnt = a.lowers()[0].clone();
    assert_eq!(b.lowers(), a.lowers());
    assert_eq!(mount_count(&mnt), 1, "one mount for three leases");
    assert_eq!(t.store.get("one").unwrap().in_use, 3);
    assert_eq!(fs::read(mnt.join("f")).unwrap(), b"x");

    drop(a);
    drop(b);
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(mount_count(&mnt), 1, "still one lease");
    drop(c);
    assert_eq!(t.store.get("one").unwrap().in_use, 0);
    assert_eq!(mount_count(&mnt), 1, "mounted during the grace period");

    // Re-acquiring within the grace period cancels the unmount.
    tokio::time::sleep(Duration::from_millis(150)).await;
    let d = t.store.acquire("one").await.unwrap();
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(mount_count(&mnt), 1, "re-acquired within the grace period");
    drop(d);
    tokio::time::sleep(Duration::from_millis(700)).await;
    assert_eq!(mount_count(&mnt), 0, "unmounted after the grace period");
    assert!(!mnt.exists(), "mount point removed");

    // And it mounts again on demand.
    let e = t.store.acquire("one").await.unwrap();
    assert_eq!(mount_count(&mnt), 1);
    drop(e);
}

#[tokio::test]
async fn remove_refuses_in_use_then_deletes_layers() {
    skip_unless_capable!();
    let t = TestStore::new();
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("f"), b"x").unwrap();
    let info = t.store.import_dir("gone:v1", &src).await.unwrap();
    let layer_file = t
        .root()
        .join("layers")
        .join(format!("{}.erofs", info.layers[0].digest));
    assert!(layer_file.exists());

    let lease = t.store.acquire("gone:v1").await.unwrap();
    let mnt = lease.lowers()[0].clone();
    match t.store.remove("gone:v1") {
        Err(ImageError::InUse { name, users }) => {
            assert_eq!((name.as_str(), users), ("gone:v1", 1))
        }
        other => panic!("expected InUse, got {other:?}"),
    }
    drop(lease);
    // The default 30 s grace is pending; remove unmounts right away.
    t.store.remove("gone:v1").unwrap();
    assert_eq!(mount_count(&mnt), 0);
    assert!(!layer_file.exists());
    assert!(t.store.list().is_empty());
    let err = t.store.get("gone:v1").unwrap_err();
    assert!(matches!(err, ImageError::NotFound(_)));
    let msg = err.to_string();
    assert!(
        msg.contains("gone:v1") && msg.contains("dsec image ls"),
        "{msg}"
    );
    assert!(matches!(
        t.store.acquire("gone:v1").await,
        Err(ImageError::NotFound(_))
    ));
    assert!(matches!(
        t.store.remove("gone:v1"),
        Err(ImageError::NotFound(_))
    ));
    assert!(matches!(
        t.store.get("Bad Name"),
        Err(ImageError::InvalidName(_))
    ));

    // The index survives reopening.
    t.store.import_dir("kept", &src).await.unwrap();
    let reopened = dsec_image::ImageStore::open(t.root()).unwrap();
    let names: Vec<String> = reopened.list().into_iter().map(|i| i.name).collect();
    assert_eq!(names, vec!["kept:latest".to_string()]);
}

#[tokio::test]
async fn shared_layers_survive_removal_of_one_image_and_reimport_replaces() {
    skip_unless_capable!();
    let t = TestStore::new();
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("f"), b"v1").unwrap();
    let v1 = t.store.import_dir("app", &src).await.unwrap();
    let old_file = t
        .root()
        .join("layers")
        .join(format!("{}.erofs", v1.layers[0].digest));
    let lease = t.store.acquire("app").await.unwrap();
    let old_mnt = lease.lowers()[0].clone();

    // Re-import under the same name while in use: the running lease keeps its layer.
    fs::write(src.join("f"), b"v2").unwrap();
    let v2 = t.store.import_dir("app", &src).await.unwrap();
    assert_ne!(v1.layers[0].digest, v2.layers[0].digest);
    assert_eq!(fs::read(old_mnt.join("f")).unwrap(), b"v1");
    assert!(old_file.exists(), "still in use");
    let lease2 = t.store.acquire("app").await.unwrap();
    assert_eq!(fs::read(lease2.lowers()[0].join("f")).unwrap(), b"v2");

    t.store.set_unmount_grace(Duration::from_millis(50));
    drop(lease);
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert_eq!(mount_count(&old_mnt), 0);
    assert!(!old_file.exists(), "replaced layer deleted once unused");
    drop(lease2);
}

#[tokio::test]
async fn cleanup_stale_mounts_after_a_leak() {
    skip_unless_capable!();
    let t = TestStore::new();
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("f"), b"x").unwrap();
    t.store.import_dir("leaky", &src).await.unwrap();
    let lease = t.store.acquire("leaky").await.unwrap();
    let mnt = lease.lowers()[0].clone();
    // Simulate a crash: the lease is never released and the process "restarts".
    std::mem::forget(lease);
    // A stray empty mount-point directory as well.
    let stray = t.root().join("mnt").join("stray");
    fs::create_dir(&stray).unwrap();

    let restarted = dsec_image::ImageStore::open(t.root()).unwrap();
    // Without cleanup, an acquire adopts the existing mount instead of stacking another.
    let l = restarted.acquire("leaky").await.unwrap();
    assert_eq!(mount_count(&mnt), 1);
    drop(l);
    restarted.unmount_all().unwrap();
    assert_eq!(mount_count(&mnt), 0);

    // Leak again, then clean up from a fresh store.
    let lease = t.store.acquire("leaky").await.unwrap();
    std::mem::forget(lease);
    // The first store believes it is still mounted; mount it behind its back to be sure.
    if mount_count(&mnt) == 0 {
        let file = t.root().join("layers").join(format!(
            "{}.erofs",
            mnt.file_name().unwrap().to_str().unwrap()
        ));
        fs::create_dir_all(&mnt).unwrap();
        nix::mount::mount(
            Some(&file),
            &mnt,
            Some("erofs"),
            nix::mount::MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .unwrap();
    }
    assert_eq!(mount_count(&mnt), 1);
    let fresh = dsec_image::ImageStore::open(t.root()).unwrap();
    fresh.cleanup_stale_mounts().unwrap();
    assert_eq!(mount_count(&mnt), 0, "stale mount removed");
    assert!(!mnt.exists(), "stale mount point removed");
    assert!(!stray.exists(), "empty stray directory removed");
}

fn tmp_is_empty(store_root: &Path) -> bool {
    fs::read_dir(store_root.join("tmp"))
        .unwrap()
        .next()
        .is_none()
}

#[tokio::test]
async fn bad_tars_fail_cleanly() {
    skip_unless_capable!();
    let t = TestStore::new();
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        ("garbage", vec![b'x'; 4096], "import bad1:latest"),
        ("empty", Vec::new(), "empty"),
        (
            "truncated gz",
            tar_gz()[..60].to_vec(),
            "import bad3:latest",
        ),
        ("escape", escaping_tar(), "escapes the image root"),
    ];
    for (i, (what, data, needle)) in cases.into_iter().enumerate() {
        let name = format!("bad{}", i + 1);
        let err = t
            .store
            .import_tar(&name, std::io::Cursor::new(data))
            .await
            .expect_err(what);
        let msg = err.to_string();
        println!("{what}: {msg}");
        assert!(matches!(err, ImageError::Import { .. }), "{what}: {err:?}");
        assert!(msg.contains(needle), "{what}: {msg:?} lacks {needle:?}");
        assert!(tmp_is_empty(&t.root()), "{what}: temp files left behind");
        assert!(t.store.get(&name).is_err());
    }
    assert!(fs::read_dir(t.root().join("layers"))
        .unwrap()
        .next()
        .is_none());
    assert!(!t.dir.path().join("evil").exists());

    // Not a directory.
    let file = t.dir.path().join("plain");
    fs::write(&file, b"x").unwrap();
    let err = t.store.import_dir("nodir", &file).await.unwrap_err();
    assert!(err.to_string().contains("not a directory"), "{err}");
    assert!(tmp_is_empty(&t.root()));
}

fn escaping_tar() -> Vec<u8> {
    let mut data = Vec::new();
    {
        let mut b = tar::Builder::new(&mut data);
        let mut h = tar::Header::new_gnu();
        h.set_size(2);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        let name = b"../../evil";
        h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name);
        h.set_cksum();
        b.append(&h, &b"hi"[..]).unwrap();
        b.finish().unwrap();
    }
    data
}

#[tokio::test]
async fn cancelled_import_leaves_nothing_behind() {
    skip_unless_capable!();
    let t = TestStore::new();
    let (mut writer, reader) = tokio::io::duplex(1 << 16);
    let data = tar_gz();
    // Send half of the archive, then stall.
    tokio::io::AsyncWriteExt::write_all(&mut writer, &data[..data.len() / 2])
        .await
        .unwrap();
    let res = tokio::time::timeout(
        Duration::from_millis(300),
        t.store.import_tar("stalled", reader),
    )
    .await;
    assert!(res.is_err(), "import should still be waiting for input");
    drop(writer);
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !tmp_is_empty(&t.root()) {
        assert!(
            std::time::Instant::now() < deadline,
            "temp dir not cleaned after cancel"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(t.store.get("stalled").is_err());
}

#[tokio::test]
async fn compressed_layers_work() {
    skip_unless_capable!();
    let t = TestStore::new();
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    let mut f = fs::File::create(src.join("big")).unwrap();
    for i in 0..20_000 {
        writeln!(f, "line {i} of a very compressible file").unwrap();
    }
    drop(f);
    let opts = ImportOptions {
        compression: Some("lz4hc".into()),
        ..ImportOptions::default()
    };
    let info = t
        .store
        .import_dir_with("packed", &src, &opts)
        .await
        .unwrap();
    let plain = t.store.import_dir("plain", &src).await.unwrap();
    assert!(
        info.size_bytes < plain.size_bytes,
        "{} !< {}",
        info.size_bytes,
        plain.size_bytes
    );
    let bad = ImportOptions {
        compression: Some("lz4 --all-root".into()),
        ..ImportOptions::default()
    };
    let err = t
        .store
        .import_dir_with("bad", &src, &bad)
        .await
        .unwrap_err();
    assert!(
        matches!(err, ImageError::Import { .. }) && err.to_string().contains("bad compression"),
        "{err}"
    );
    let bad = ImportOptions {
        compression: Some("zstd".into()),
        ..ImportOptions::default()
    };
    let err = t
        .store
        .import_dir_with("bad", &src, &bad)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("mkfs.erofs failed"), "{err}");
    assert!(tmp_is_empty(&t.root()));
    let lease = t.store.acquire("packed").await.unwrap();
    assert_eq!(
        fs::read(lease.lowers()[0].join("big")).unwrap(),
        fs::read(src.join("big")).unwrap()
    );
}

#[tokio::test]
async fn busybox_image_is_built_once_and_runs() {
    skip_unless_capable!();
    if !Path::new("/bin/busybox").exists() {
        println!("SKIPPED: /bin/busybox missing (apt-get install busybox-static)");
        return;
    }
    let t = TestStore::new();
    t.store.ensure_busybox().await.unwrap();
    let first = t.store.get("busybox").unwrap();
    t.store.ensure_busybox().await.unwrap();
    let again = t.store.get("busybox:latest").unwrap();
    assert_eq!(
        first.layers[0].digest, again.layers[0].digest,
        "not rebuilt"
    );

    let lease = t.store.acquire("busybox").await.unwrap();
    let root: PathBuf = lease.lowers().remove(0);
    let snap = snapshot(&root);
    assert_eq!(
        snap[Path::new("bin/sh")].link.as_deref(),
        Some(Path::new("/bin/busybox"))
    );
    assert_eq!(snap[Path::new("tmp")].mode & 0o7777, 0o1777);
    assert_eq!(snap[Path::new("home/user")].uid, 1000);
    for d in ["proc", "sys", "dev", "dev/pts", "dev/shm", "run", "root"] {
        assert_eq!(snap[Path::new(d)].kind, "dir", "{d}");
    }
    let passwd = fs::read_to_string(root.join("etc/passwd")).unwrap();
    assert!(passwd.contains("user:x:1000:1000::/home/user:/bin/sh"));
    let out = common::chroot_run(
        &root,
        "echo hi from $(cat /etc/hostname); test -L /usr/bin/env && echo env ok",
    );
    assert_eq!(out, "hi from dsec\nenv ok\n");

    // A non-static binary is refused with a hint.
    let t2 = TestStore::new();
    t2.store
        .set_busybox_binary(std::env::current_exe().unwrap());
    let err = t2.store.ensure_busybox().await.unwrap_err().to_string();
    assert!(err.contains("busybox-static"), "{err}");
    assert!(tmp_is_empty(&t2.root()));
}

#[tokio::test]
async fn debian_tarball_imports() {
    skip_unless_capable!();
    let cache = std::env::var("DSEC_CACHE").unwrap_or_else(|_| "/var/cache/dsec".into());
    let tarball = Path::new(&cache).join("debian-bookworm.tar");
    if !tarball.exists() {
        println!(
            "SKIPPED: {} absent; build it with scripts/images/build-debian.sh",
            tarball.display()
        );
        return;
    }
    let t = TestStore::new();
    let file = tokio::fs::File::open(&tarball).await.unwrap();
    let started = std::time::Instant::now();
    let info = t.store.import_tar("debian", file).await.unwrap();
    println!(
        "imported {} ({} bytes) in {:?}",
        info.name,
        info.size_bytes,
        started.elapsed()
    );
    let lease = t.store.acquire("debian").await.unwrap();
    let root = lease.lowers().remove(0);
    let out = common::chroot_run(
        &root,
        "python3 -c 'print(6*7)'; id user; test -x /usr/bin/git && echo git ok; \
         gcc --version | head -n1; stat -c '%U %a' /usr/bin/passwd /tmp; stat -c '%F %t:%T' /dev/null",
    );
    println!("{out}");
    assert!(out.starts_with("42\n"), "{out}");
    assert!(out.contains("uid=1000(user) gid=1000(user)"), "{out}");
    // (Running git needs a writable /dev/null; layers are mounted nodev on the host, and
    // sandboxes get their own /dev.)
    assert!(
        out.contains("git ok") && out.contains("gcc (Debian"),
        "{out}"
    );
    assert!(
        out.contains("character special file 1:3"),
        "device nodes kept: {out}"
    );
    assert!(out.contains("root 4755"), "setuid passwd kept: {out}");
    assert!(out.contains("root 1777"), "sticky /tmp kept: {out}");
    drop(lease);
}

/// The point of the whiteout conversion: stacked in an overlay, a tar layer's OCI whiteouts
/// hide files of the layers below.
#[tokio::test]
async fn overlay_honours_converted_whiteouts() {
    skip_unless_capable!();
    let t = TestStore::new();
    let base = t.dir.path().join("base");
    fs::create_dir_all(base.join("d")).unwrap();
    fs::write(base.join("a"), b"a").unwrap();
    fs::write(base.join("keep"), b"k").unwrap();
    fs::write(base.join("d/x"), b"x").unwrap();
    t.store.import_dir("base", &base).await.unwrap();

    let mut b = tar::Builder::new(Vec::new());
    let mut h = tar::Header::new_ustar();
    h.set_mode(0o644);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(1);
    h.set_size(0);
    b.append_data(&mut h.clone(), ".wh.a", &b""[..]).unwrap();
    b.append_data(&mut h.clone(), "d/.wh..wh..opq", &b""[..])
        .unwrap();
    h.set_size(1);
    b.append_data(&mut h, "d/y", &b"y"[..]).unwrap();
    let top = b.into_inner().unwrap();
    t.store
        .import_tar("top", std::io::Cursor::new(top))
        .await
        .unwrap();

    let lb = t.store.acquire("base").await.unwrap();
    let lt = t.store.acquire("top").await.unwrap();
    let lower = format!("{}:{}", lt.lowers()[0].display(), lb.lowers()[0].display());
    let merged = t.dir.path().join("merged");
    fs::create_dir(&merged).unwrap();
    nix::mount::mount(
        Some("overlay"),
        &merged,
        Some("overlay"),
        nix::mount::MsFlags::MS_RDONLY,
        Some(format!("lowerdir={lower}").as_str()),
    )
    .unwrap();
    let mut names: Vec<String> = fs::read_dir(&merged)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut in_d: Vec<String> = fs::read_dir(merged.join("d"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    in_d.sort();
    nix::mount::umount2(&merged, nix::mount::MntFlags::MNT_DETACH).unwrap();
    assert_eq!(names, vec!["d", "keep"], "whiteout hides `a`");
    assert_eq!(in_d, vec!["y"], "opaque directory hides `d/x`");
}

/// 16 concurrent composed acquires of an image whose layer metadata is not on local disk yet
/// (a fresh node): one metadata fetch from the blob store, one blob check, one mount.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_cold_acquires_fetch_and_mount_once() {
    skip_unless_capable!();
    let t = TestStore::new();
    let src = t.dir.path().join("src");
    fs::create_dir(&src).unwrap();
    fs::write(src.join("data"), vec![3u8; 500_000]).unwrap();
    let info = t.store.import_dir("cold:v1", &src).await.unwrap();
    let digest = info.layers[0].digest.clone();
    // A node that has never used the layer: its metadata image is only in the blob store.
    fs::remove_file(t.root().join("layers").join(format!("{digest}.erofs"))).unwrap();
    let before = t.store.stats();
    let mut set = tokio::task::JoinSet::new();
    for _ in 0..16 {
        let s = t.store.clone();
        set.spawn(async move { s.acquire_composed("cold:v1", None, &[]).await });
    }
    let mut leases = Vec::new();
    while let Some(r) = set.join_next().await {
        leases.push(r.unwrap().unwrap());
    }
    let after = t.store.stats();
    assert_eq!(after.layer_mounts - before.layer_mounts, 1, "{after:?}");
    assert_eq!(after.meta_fetches - before.meta_fetches, 1, "{after:?}");
    assert_eq!(after.blob_verifications - before.blob_verifications, 1);
    assert_eq!(mount_count(&leases[0].lowers()[0]), 1);
    assert_eq!(t.store.get("cold:v1").unwrap().layers[0].users, 16);
    drop(leases);
}
