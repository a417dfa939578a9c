"""S3 (Ceph's radosgw from scripts/storage/ceph-dev.sh) as dsec's blob store:
`image_blob_store = "s3://bucket/prefix"` with `[edge.image_s3]`.

An image imported through edge A runs on edge B that shares only the bucket (B is told about
the image's index records, as a shared catalog would): B reads the data blob on demand, by
ranged GETs into its node-local chunk cache exposed to EROFS through FUSE. Counted with B's
`/metrics`: a small read fetches a small part of the blob, a second sandbox fetches nothing
new, and three images larger than the cache's cap used in turn keep it under the cap. Failures:
radosgw stopped (SIGSTOP: connections hang, as with a partition) fails an uncached read with
EIO within the configured bound while a sandbox on cached chunks keeps reading, and reads
succeed once it runs again (SIGCONT); an object changed in the bucket behind dsec's back is
refused (digest recorded at import) and read again once it is right. Nothing leaks: no
multipart upload left, objects and cache files of removed images gone, no FUSE mount left.

Ceph is started once for this module (the `ceph` fixture of test_storage_ceph) and stopped after
it; with ``DSEC_CEPH_DIR`` naming a running ceph-dev, that one is used and left running."""

from __future__ import annotations

import base64
import email.utils
import hashlib
import hmac
import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Dict, List, Optional

import pytest

from helpers import make_sandbox, mounts_under, new_data_dir, sh, stop_quietly
from test_images import _tar, dsec_up_with_config
from test_storage_ceph import _cleanup, ceph  # noqa: F401  (the module-scoped Ceph fixture)

CACHE_MB = 16
CHUNK_KIB = 256
TIMEOUT_MS = 2000
RETRIES = 1
# One failing chunk read answers EIO after (RETRIES + 1) attempts of TIMEOUT_MS; the kernel
# re-issues a failed read a few times (readahead, then the page read itself: about 5 in all
# here, 20 s measured idle), each paying that bound once; and the reader's own binary may
# page-fault on the same store (up to twice as many re-issued reads: 32.8 s measured under
# load). The point is a bound, never a hang: 12 re-issues' worth plus slack.
EIO_BOUND_S = (RETRIES + 1) * TIMEOUT_MS / 1000 * 12 + 5



def io_failed(stderr: str) -> bool:
    """The reader was told its read failed: EIO from read(2), or SIGBUS when the page belonged
    to a mapping (busybox's cat copies with sendfile/mmap) — both are the kernel's report that
    the image's page could not be read."""
    return "Input/output error" in stderr or "Bus error" in stderr

def _s3(ceph: Dict[str, str], method: str, path: str, query: str = "", body: Optional[bytes] = None,
        subresource: str = "") -> bytes:
    """One S3 request signed with signature v2 (radosgw accepts it), as ceph-dev.sh does."""
    date = email.utils.formatdate(usegmt=True)
    ctype = "application/octet-stream" if body is not None else ""
    resource = path + (f"?{subresource}" if subresource else "")
    to_sign = f"{method}\n\n{ctype}\n{date}\n{resource}"
    sig = base64.b64encode(hmac.new(ceph["S3_SECRET_KEY"].encode(), to_sign.encode(), hashlib.sha1).digest())
    qs = "&".join(q for q in (subresource, query) if q)
    req = urllib.request.Request(ceph["S3_ENDPOINT"] + path + (f"?{qs}" if qs else ""), data=body, method=method)
    req.add_header("Date", date)
    req.add_header("Authorization", f"AWS {ceph['S3_ACCESS_KEY']}:{sig.decode()}")
    if ctype:
        req.add_header("Content-Type", ctype)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.read()


def _objects(ceph, prefix: str) -> List[str]:
    xml = _s3(ceph, "GET", f"/{ceph['S3_BUCKET']}", query=f"prefix={prefix}/").decode()
    return re.findall(r"<Key>([^<]+)</Key>", xml)


def _uploads(ceph, prefix: str) -> List[str]:
    xml = _s3(ceph, "GET", f"/{ceph['S3_BUCKET']}", query=f"prefix={prefix}/", subresource="uploads").decode()
    return re.findall(r"<UploadId>([^<]+)</UploadId>", xml)


def _metrics(client) -> Dict[str, float]:
    with urllib.request.urlopen(f"{client.list_nodes()[0]['url']}/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for line in text.splitlines():
        if line.startswith(("dsec_edge_blobcache_", "dsec_edge_blobstore_")):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def _rgw_pid(ceph) -> int:
    return int(Path(os.path.dirname(ceph["CEPH_CONF"]), "run", "rgw.pid").read_text().strip())


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def test_s3_blob_store_across_nodes_cache_failures_and_leaks(dsec_bin, ceph):  # noqa: F811
    prefix = f"t{os.getpid()}"
    spec = (
        f'image_blob_store = "s3://{ceph["S3_BUCKET"]}/{prefix}"\n'
        "[edge.image_s3]\n"
        f'endpoint = "{ceph["S3_ENDPOINT"]}"\nregion = "{ceph["S3_REGION"]}"\n'
        f'access_key = "{ceph["S3_ACCESS_KEY"]}"\nsecret_key = "{ceph["S3_SECRET_KEY"]}"\n'
        f"cache_mb = {CACHE_MB}\nchunk_kib = {CHUNK_KIB}\ntimeout_ms = {TIMEOUT_MS}\nretries = {RETRIES}\n"
    )
    data_a, data_b = new_data_dir("s3-a"), new_data_dir("s3-b")
    up_a = dsec_up_with_config(dsec_bin, data_a, "s3a", spec)
    up_b = dsec_up_with_config(dsec_bin, data_b, "s3b", spec)
    results = {}
    stopped_rgw = False
    try:
        up_a.start()
        a = up_a.client()
        # ---- import on A: blobs (multipart above 16 MiB) and chunk manifests go to the bucket
        main = os.urandom(8 << 20)
        big = {n: os.urandom(20 << 20) for n in ("big1", "big2", "big3")}  # each > the cache cap
        later = os.urandom(3 << 20)   # first read on B while radosgw is stopped
        small = os.urandom(1 << 20)   # changed in the bucket behind dsec's back
        images = {
            "s3-main:v1": [("data", None), ("data/blob.bin", main), ("data/small", b"small\n")],
            "s3-later:v1": [("later", None), ("later/f", later)],
            "s3-small:v1": [("small", None), ("small/f", small)],
        }
        images.update({f"s3-{n}:v1": [(n, None), (f"{n}/f", p)] for n, p in big.items()})
        digests = {}
        t0 = time.monotonic()
        for name, files in images.items():
            digests[name] = a.import_image(name, _tar(files)).layers[-1]["digest"]
        print(f"\n[s3] imported {len(images)} images ({sum(len(p) for _, p in sum(images.values(), []) if p) >> 20} MiB) "
              f"in {time.monotonic() - t0:.1f} s", flush=True)
        objs = set(_objects(ceph, prefix))
        for d in digests.values():
            assert {f"{prefix}/{d}.blob", f"{prefix}/{d}.chunks", f"{prefix}/{d}.meta"} <= objs, (d, objs)
        assert not _uploads(ceph, prefix), "multipart uploads left after the imports"
        assert not os.path.exists(os.path.join(data_a, "edge", "images", "blobs", f"{digests['s3-main:v1']}.blob"))
        sb = make_sandbox(a, "busybox", workspace="s3-main:v1")
        try:
            assert sh(sb, "sha256sum /data/blob.bin").split()[0] == _sha(main)
        finally:
            stop_quietly(sb)
        a.close()

        # ---- node B shares only the bucket: it is given the index records, imports nothing
        index_a = json.loads(Path(data_a, "edge", "images", "index.json").read_text())
        os.makedirs(os.path.join(data_b, "edge", "images"))
        Path(data_b, "edge", "images", "index.json").write_text(json.dumps(
            {"version": index_a["version"], "images": {n: index_a["images"][n] for n in images}}))
        up_b.start()
        b = up_b.client()
        m0 = _metrics(b)
        assert m0["dsec_edge_blobcache_cap_bytes"] == CACHE_MB << 20, m0
        s1 = make_sandbox(b, "busybox", workspace="s3-main:v1")
        s2 = None
        try:
            assert sh(s1, "cat /data/small") == "small\n"
            m1 = _metrics(b)
            sh(s1, "dd if=/data/blob.bin of=/dev/null bs=4096 count=1 skip=1000 2>/dev/null")
            m2 = _metrics(b)
            partial = m2["dsec_edge_blobcache_fetched_bytes_total"] - m1["dsec_edge_blobcache_fetched_bytes_total"]
            assert 0 < partial <= len(main) // 8, f"a 4 KiB read fetched {partial} bytes"
            assert sh(s1, "sha256sum /data/blob.bin").split()[0] == _sha(main)
            m3 = _metrics(b)
            total = m3["dsec_edge_blobcache_fetched_bytes_total"]
            assert total >= len(main) * 0.9, m3
            print(f"[s3] node B: 4 KiB read fetched {partial:.0f} B; whole 8 MiB file {total:.0f} B "
                  f"(+{m3['dsec_edge_blobstore_direct_get_bytes_total']:.0f} B metadata/verification)", flush=True)
            # A second sandbox of the same image fetches nothing new.
            s2 = make_sandbox(b, "busybox", workspace="s3-main:v1")
            assert sh(s2, "sha256sum /data/blob.bin").split()[0] == _sha(main)
            m4 = _metrics(b)
            assert m4["dsec_edge_blobcache_fetched_bytes_total"] == total, (m3, m4)
            stop_quietly(s2)
            s2 = None

            # ---- three images, each larger than the cap, used in turn: the cache stays under it
            for n, p in big.items():
                s = make_sandbox(b, "busybox", workspace=f"s3-{n}:v1")
                try:
                    assert sh(s, f"sha256sum /{n}/f").split()[0] == _sha(p)
                    m = _metrics(b)
                    assert m["dsec_edge_blobcache_bytes"] <= CACHE_MB << 20, m
                finally:
                    stop_quietly(s)
            m5 = _metrics(b)
            assert m5["dsec_edge_blobcache_evictions_total"] > 0, m5
            cache_dir = os.path.join(data_b, "edge", "images", "chunkcache")
            # Allocated blocks: the cache keeps one sparse file per blob, eviction punches holes.
            files = os.listdir(cache_dir)
            on_disk = sum(os.stat(os.path.join(cache_dir, f)).st_blocks * 512 for f in files)
            # A blob's last chunk ends mid-block: one file system block of rounding per file.
            assert on_disk <= (CACHE_MB << 20) + 4096 * len(files), (on_disk, len(files))

            # ---- radosgw stopped: a cached image keeps working, an uncached read gets EIO in bound
            fuse_file = os.path.join(data_b, "edge", "images", "blobfs", f"{digests['s3-main:v1']}.blob")
            in_layer = os.path.join(data_b, "edge", "images", "mnt", digests["s3-main:v1"], "data", "blob.bin")
            # Read main again past the page cache, so all its chunks are in the chunk cache again.
            _drop_page_cache(in_layer)
            _drop_page_cache(fuse_file)
            assert sh(s1, "sha256sum /data/blob.bin").split()[0] == _sha(main)
            s2 = make_sandbox(b, "busybox", workspace="s3-later:v1")  # mounted (metadata, verification) while the store is up
            before = _metrics(b)
            os.kill(_rgw_pid(ceph), signal.SIGSTOP)
            stopped_rgw = True
            # s1's next read goes to the chunk cache: drop the page cache of the file in the layer
            # (EROFS) and of the blob under it (FUSE).
            _drop_page_cache(in_layer)
            _drop_page_cache(fuse_file)
            hits0 = _metrics(b)["dsec_edge_blobcache_hits_total"]
            t0 = time.monotonic()
            assert sh(s1, "sha256sum /data/blob.bin").split()[0] == _sha(main)
            assert time.monotonic() - t0 < 10, "reads of cached chunks waited for the stopped store"
            assert _metrics(b)["dsec_edge_blobcache_hits_total"] > hits0, "the re-read did not reach the chunk cache"
            t0 = time.monotonic()
            r = s2.run_shell("cat /later/f > /dev/null", timeout=120)
            took = time.monotonic() - t0
            assert r.exit_code != 0 and io_failed(r.stderr), (r.exit_code, r.stderr)
            assert took < EIO_BOUND_S, f"EIO after {took:.1f} s (bound {EIO_BOUND_S} s)"
            after = _metrics(b)
            assert after["dsec_edge_blobcache_read_errors_total"] > before["dsec_edge_blobcache_read_errors_total"]
            assert after["dsec_edge_blobcache_fetch_errors_total"] >= before["dsec_edge_blobcache_fetch_errors_total"] + RETRIES + 1
            assert "chunk unavailable" in up_b.stderr_tail(400), up_b.stderr_tail(40)
            print(f"[s3] radosgw stopped: EIO after {took:.1f} s; cached image kept reading", flush=True)
            os.kill(_rgw_pid(ceph), signal.SIGCONT)
            stopped_rgw = False
            assert sh(s2, "sha256sum /later/f").split()[0] == _sha(later)

            # ---- an object changed in the bucket behind dsec's back is refused, then read again
            obj = f"/{ceph['S3_BUCKET']}/{prefix}/{digests['s3-small:v1']}.blob"
            original = _s3(ceph, "GET", obj)
            s3s = make_sandbox(b, "busybox", workspace="s3-small:v1")
            try:
                changed = bytearray(original)
                for i in range(0, len(changed), 4096):
                    changed[i] ^= 0xFF
                _s3(ceph, "PUT", obj, body=bytes(changed))
                before = _metrics(b)
                r = s3s.run_shell("cat /small/f > /dev/null", timeout=120)
                assert r.exit_code != 0 and io_failed(r.stderr), (r.exit_code, r.stderr)
                after = _metrics(b)
                assert after["dsec_edge_blobcache_digest_mismatches_total"] >= before["dsec_edge_blobcache_digest_mismatches_total"] + RETRIES + 1
                _s3(ceph, "PUT", obj, body=original)
                assert sh(s3s, "sha256sum /small/f").split()[0] == _sha(small)
            finally:
                stop_quietly(s3s)
        finally:
            if stopped_rgw:
                os.kill(_rgw_pid(ceph), signal.SIGCONT)
            stop_quietly(s1)
            if s2 is not None:
                stop_quietly(s2)

        # ---- removing images: objects leave the bucket, B's cache keeps no chunk of them
        main_digest = digests["s3-main:v1"]
        assert any(f.startswith(main_digest) for f in os.listdir(cache_dir))
        deadline = time.monotonic() + 60
        while True:  # the layer stays mounted for the unmount grace after its last user
            try:
                b.remove_image("s3-main:v1")
                break
            except Exception:
                if time.monotonic() > deadline:
                    raise
                time.sleep(1)
        assert not any(f.startswith(main_digest) for f in os.listdir(cache_dir)), "cache files of a removed image"
        assert not any(main_digest in o for o in _objects(ceph, prefix)), "objects of a removed image"
        b.close()
    finally:
        results["b"] = _cleanup(up_b, data_b)
        results["a"] = _cleanup(up_a, data_a)
        for o in _objects(ceph, prefix):
            _s3(ceph, "DELETE", f"/{ceph['S3_BUCKET']}/{o}")
    for node, (rc, left) in results.items():
        assert rc == 0, (node, up_a.stderr_tail() if node == "a" else up_b.stderr_tail())
        assert not left, (node, left)  # no FUSE or EROFS mount left under the data dirs
    assert not _uploads(ceph, prefix)
    up_a.remove_log()
    up_b.remove_log()


def test_image_crate_live_tests_against_radosgw(ceph, tmp_path):  # noqa: F811
    """The image crate's own tests against this module's radosgw (skipped by a plain
    `cargo test`): signed requests, a multipart upload aborted on failure, and the chunk cache
    through FUSE with a 1 MB bound — chunks evicted (holes punched in the blob's cache file)
    and fetched again, a corrupted object refused by its digests."""
    env_file = tmp_path / "s3.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in ceph.items()))
    root = Path(__file__).resolve().parent.parent
    r = subprocess.run(["cargo", "test", "--release", "-p", "dsec-image", "--lib", "live_tests"],
                       cwd=root, env={**os.environ, "DSEC_S3_TEST_ENV": str(env_file)},
                       capture_output=True, text=True, timeout=1800)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 passed" in r.stdout and "skipped" not in r.stdout + r.stderr, r.stdout[-2000:]
