//! Tests against a real S3 service (e.g. `scripts/storage/ceph-dev.sh start`'s radosgw):
//! run with `DSEC_S3_TEST_ENV=<ceph-dev data dir>/env`; skipped (with a printed reason)
//! otherwise. The FUSE part needs root.

use std::collections::HashMap;
use std::fs;
use std::os::unix::fs::FileExt;

use super::*;

fn live_config() -> Option<(S3Config, String)> {
    let Some(path) = std::env::var_os("DSEC_S3_TEST_ENV") else {
        eprintln!("skipped: DSEC_S3_TEST_ENV (a ceph-dev env file) is not set");
        return None;
    };
    let env: HashMap<String, String> = fs::read_to_string(path)
        .expect("read DSEC_S3_TEST_ENV")
        .lines()
        .filter_map(|l| {
            l.split_once('=')
                .map(|(k, v)| (k.to_string(), v.to_string()))
        })
        .collect();
    let bucket = env
        .get("S3_BUCKET")
        .cloned()
        .unwrap_or_else(|| "dsec".into());
    Some((
        S3Config {
            endpoint: env.get("S3_ENDPOINT").cloned(),
            region: env.get("S3_REGION").cloned(),
            access_key: env.get("S3_ACCESS_KEY").cloned(),
            secret_key: env.get("S3_SECRET_KEY").cloned(),
            chunk_kib: 256,
            cache_mb: 1,
            timeout_ms: 10_000,
            retries: 1,
        },
        bucket,
    ))
}

fn pseudo_random(n: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

#[test]
fn live_put_multipart_read_cache_corruption_remove() {
    let Some((cfg, bucket)) = live_config() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let prefix = format!("live-{}", std::process::id());
    let store = S3Store::open(&format!("//{bucket}/{prefix}"), d.path(), &cfg).unwrap();

    // A blob above the part size goes up in parts, with its chunk manifest.
    let data = pseudo_random((PART_SIZE + 3 * 1024 * 1024 + 123) as usize, 7);
    let src = d.path().join("src");
    fs::write(&src, &data).unwrap();
    let digest = hex::encode(Sha256::digest(&data));
    let key = format!("{digest}.blob");
    store.put(&key, &src).unwrap();
    store.put(&key, &src).unwrap(); // kept
    assert_eq!(store.size(&key).unwrap(), Some(data.len() as u64));
    assert!(store.uploads_in_progress().unwrap().is_empty());
    let mut keys = store.keys().unwrap();
    keys.sort();
    assert_eq!(keys, vec![key.clone(), format!("{digest}.chunks")]);
    let mut buf = vec![0u8; 1000];
    assert_eq!(store.read_at(&key, 5_000_000, &mut buf).unwrap(), 1000);
    assert_eq!(buf, data[5_000_000..5_001_000]);
    let dst = d.path().join("dst");
    assert_eq!(store.fetch(&key, &dst).unwrap(), data.len() as u64);
    assert_eq!(fs::read(&dst).unwrap(), data);

    if nix::unistd::geteuid().is_root() {
        // Through FUSE and the chunk cache (cap 1 MiB, chunks of 256 KiB).
        let path = store.mount_source(&key).unwrap();
        let f = fs::File::open(&path).unwrap();
        assert_eq!(f.metadata().unwrap().len(), data.len() as u64);
        let mut b = vec![0u8; 4096];
        f.read_exact_at(&mut b, 10_000_000).unwrap();
        assert_eq!(b, data[10_000_000..10_004_096]);
        let st = store.cache.stats();
        assert_eq!(st.fetched_chunks, 1, "{st:?}");
        assert_eq!(st.fetched_bytes, 256 * 1024);
        // Reading everything stays under the cap.
        let mut all = vec![0u8; data.len()];
        f.read_exact_at(&mut all, 0).unwrap();
        assert!(all == data, "content through FUSE differs");
        let st = store.cache.stats();
        assert!(
            st.cached_bytes <= st.cap_bytes && st.evictions > 0,
            "{st:?}"
        );
        drop(f);

        // An object changed behind dsec's back: its chunks are refused (EIO), counted.
        let mut bad = data.clone();
        bad[0] ^= 0xff;
        let bad_src = d.path().join("bad");
        fs::write(&bad_src, &bad).unwrap();
        store.cache.forget(&digest);
        store
            .put_object(&store.object(&key).unwrap(), &bad_src)
            .unwrap();
        // A fresh name (the kernel's page cache holds the old pages of the first file).
        let f = fs::File::open(&path).unwrap();
        let mut b = vec![0u8; 4096];
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg("echo 1 > /proc/sys/vm/drop_caches")
            .status();
        let e = f.read_exact_at(&mut b, 0).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::EIO), "{e}");
        let st = store.cache.stats();
        assert!(st.digest_mismatches >= 2 && st.read_errors >= 1, "{st:?}");
        // Chunks the change did not touch still read fine.
        f.read_exact_at(&mut b, 2_000_000).unwrap();
        assert_eq!(b, data[2_000_000..2_004_096]);
        drop(f);
        store.shutdown();
        let mounts = fs::read_to_string("/proc/self/mounts").unwrap();
        assert!(
            !mounts.contains(&d.path().to_string_lossy().to_string()),
            "FUSE mount left"
        );
    }

    store.remove(&key).unwrap();
    store.remove(&key).unwrap();
    assert!(store.keys().unwrap().is_empty());
}

#[test]
fn live_failed_multipart_upload_is_aborted() {
    let Some((cfg, bucket)) = live_config() else {
        return;
    };
    let d = tempfile::tempdir().unwrap();
    let prefix = format!("live-abort-{}", std::process::id());
    let store = S3Store::open(&format!("//{bucket}/{prefix}"), d.path(), &cfg).unwrap();
    // Claims more bytes than the file has: the second part's read fails mid-upload.
    let src = d.path().join("short");
    fs::write(&src, vec![1u8; (PART_SIZE + 10) as usize]).unwrap();
    let object = store.object(&format!("{}.blob", "c".repeat(64))).unwrap();
    let e = store
        .put_multipart(&object, &src, 2 * PART_SIZE + 10)
        .unwrap_err();
    assert!(e.to_string().contains("read"), "{e}");
    assert!(
        store.uploads_in_progress().unwrap().is_empty(),
        "a failed upload was left behind"
    );
    assert_eq!(fs::read_dir(&store.journal).unwrap().count(), 0);
    assert_eq!(
        store.size(&format!("{}.blob", "c".repeat(64))).unwrap(),
        None
    );

    // One that could not be aborted (recorded in the journal) is aborted at the next open.
    let (c, o) = (store.client.clone(), object.clone());
    let id = store
        .run(async move { c.create_multipart(&o).await })
        .unwrap();
    fs::write(store.journal.join("x"), format!("{object}\n{id}")).unwrap();
    assert_eq!(store.uploads_in_progress().unwrap().len(), 1);
    drop(store);
    let store = S3Store::open(&format!("//{bucket}/{prefix}"), d.path(), &cfg).unwrap();
    assert!(store.uploads_in_progress().unwrap().is_empty());
    assert_eq!(fs::read_dir(&store.journal).unwrap().count(), 0);
}
