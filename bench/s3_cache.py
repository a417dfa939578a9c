#!/usr/bin/env python3
"""Cold start of a task on the python+git Debian image with its data blobs on S3 (radosgw from
scripts/storage/ceph-dev.sh) read on demand through the node's chunk cache, vs. the same image
on local disk, vs. a full download of the image's objects before the start; then throughput of
reads from the chunk cache (through its FUSE file) vs. reads of the same blob from local disk.

Each cold start is a fresh node (its own data dir; for S3 a node that shares only the bucket
with the node that imported the image), page caches dropped, then `create` + one task
(`python3` importing a slice of the standard library, `git --version`), timed from the client.

Run as root from the repo root after `cargo build --release -p dsec`:
    DSEC_CEPH_DIR=/var/tmp/dsec-ceph python3 bench/s3_cache.py   # a running ceph-dev (else started)
    BENCH_RUNS=5 (default 3)
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)

from common import DEBIAN_TAR, pct, write_results  # noqa: E402
from helpers import DsecUp, mounts_under  # noqa: E402
from test_storage_s3 import _metrics, _objects, _s3  # noqa: E402

RUNS = int(os.environ.get("BENCH_RUNS", "3"))
WORK = os.environ.get("DSEC_BENCH_DIR", "/var/tmp/dsec-bench-s3")
CEPH_DEV = os.path.join(REPO, "scripts", "storage", "ceph-dev.sh")
TASK = ("python3 -c 'import json, sqlite3, email.parser, http.client, decimal, unittest.mock; print(1)'"
        " && git --version")
IMAGE = "bench-py:v1"


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


def node(dsec_bin, data, node_id, edge_toml):
    cfg = data + ".toml"
    with open(cfg, "w") as f:
        f.write("[edge]\n" + edge_toml)
    wrapper = data + ".dsec"
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {dsec_bin} "$@" --config {cfg}; fi\nexec {dsec_bin} "$@"\n')
    os.chmod(wrapper, 0o755)
    return DsecUp(wrapper, data, node_id)


def seed_index(data, records):
    os.makedirs(os.path.join(data, "edge", "images"), exist_ok=True)
    with open(os.path.join(data, "edge", "images", "index.json"), "w") as f:
        json.dump(records, f)


def cold_start(up) -> float:
    c = up.client()
    drop_caches()
    t0 = time.monotonic()
    sb = c.run_container(__import__("dsec").DSecContainerRunArgs(container_image=IMAGE), timeout=600)
    r = sb.run_shell(TASK, timeout=300)
    took = time.monotonic() - t0
    assert r.exit_code == 0 and "git version" in r.stdout, (r.stdout, r.stderr)
    sb.stop()
    c.close()
    return took


def read_throughput(path: str, runs: int = 5) -> float:
    """MB/s of reading `path` whole with 1 MiB reads, page cache dropped first (median)."""
    rates = []
    for _ in range(runs):
        drop_caches()
        t0 = time.monotonic()
        n = 0
        with open(path, "rb", buffering=0) as f:
            while True:
                b = f.read(1 << 20)
                if not b:
                    break
                n += len(b)
        rates.append(n / (time.monotonic() - t0) / 1e6)
    return statistics.median(rates)


def stats(v):
    return {"median_s": statistics.median(v), "p99_s": pct(v, 99), "runs": v}


def main():
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    dsec_bin = os.environ.get("DSEC_BIN", os.path.join(REPO, "target", "release", "dsec"))
    shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    ceph_dir = os.environ.get("DSEC_CEPH_DIR")
    started = False
    if not ceph_dir or subprocess.run(["bash", CEPH_DEV, "status", ceph_dir], capture_output=True).returncode:
        ceph_dir = os.path.join(WORK, "ceph")
        subprocess.run(["bash", CEPH_DEV, "start", ceph_dir], check=True, capture_output=True)
        started = True
    ceph = dict(line.split("=", 1) for line in open(os.path.join(ceph_dir, "env")).read().splitlines() if "=" in line)
    prefix = f"bench{os.getpid()}"
    s3_toml = (f'image_blob_store = "s3://{ceph["S3_BUCKET"]}/{prefix}"\n[edge.image_s3]\n'
               f'endpoint = "{ceph["S3_ENDPOINT"]}"\nregion = "{ceph["S3_REGION"]}"\n'
               f'access_key = "{ceph["S3_ACCESS_KEY"]}"\nsecret_key = "{ceph["S3_SECRET_KEY"]}"\n')
    ups = []
    out = {"local_disk": [], "s3_chunk_cache": [], "s3_full_download": [], "fetched_share": []}
    try:
        # ---- setup: import into S3 (node A) and onto local disk (node L)
        a = node(dsec_bin, os.path.join(WORK, "a"), "bencha", s3_toml)
        ups.append(a)
        a.start()
        c = a.client()
        info = c.import_image(IMAGE, DEBIAN_TAR, timeout=1800)
        c.close()
        image_bytes = sum(l["size_bytes"] for l in info.layers)
        blob_bytes = sum(l["blob_bytes"] for l in info.layers)
        with open(os.path.join(WORK, "a", "edge", "images", "index.json")) as f:
            index = json.load(f)
        records = {"version": index["version"], "images": {IMAGE: index["images"][IMAGE]}}
        loc = node(dsec_bin, os.path.join(WORK, "l"), "benchl", "")
        ups.append(loc)
        loc.start()
        c = loc.client()
        c.import_image(IMAGE, DEBIAN_TAR, timeout=1800)
        c.close()
        loc.stop()
        keys = [k for k in _objects(ceph, prefix) if k.rsplit(".", 1)[-1] in ("blob", "meta")]

        last_b = None
        for run in range(RUNS):
            # (1) local disk: a restarted node, nothing mounted, caches dropped
            loc.start()
            out["local_disk"].append(cold_start(loc))
            loc.stop()
            # (2) S3 through the chunk cache: a fresh node sharing only the bucket
            bdir = os.path.join(WORK, f"b{run}")
            seed_index(bdir, records)
            b = node(dsec_bin, bdir, f"benchb{run}", s3_toml)
            ups.append(b)
            b.start()
            out["s3_chunk_cache"].append(cold_start(b))
            m = _metrics(b.client())
            fetched = m["dsec_edge_blobcache_fetched_bytes_total"] + m["dsec_edge_blobstore_direct_get_bytes_total"]
            out["fetched_share"].append(fetched / image_bytes)
            if last_b is not None:
                last_b.stop()
            last_b = b
            # (3) full download of the image's objects, then a local-disk start
            ddir = os.path.join(WORK, f"d{run}")
            seed_index(ddir, records)
            d = node(dsec_bin, ddir, f"benchd{run}", "")
            ups.append(d)
            d.start()
            blobs = os.path.join(ddir, "edge", "images", "blobs")
            os.makedirs(blobs, exist_ok=True)
            drop_caches()
            t0 = time.monotonic()
            for k in keys:
                body = _s3(ceph, "GET", f"/{ceph['S3_BUCKET']}/{k}")
                with open(os.path.join(blobs, k.rsplit("/", 1)[-1]), "wb") as f:
                    f.write(body)
            dl = time.monotonic() - t0
            out["s3_full_download"].append(dl + cold_start(d))
            d.stop()
            print(f"run {run}: local {out['local_disk'][-1]:.2f} s, s3 cache {out['s3_chunk_cache'][-1]:.2f} s "
                  f"({out['fetched_share'][-1] * 100:.1f}% of the image fetched), "
                  f"full download {out['s3_full_download'][-1]:.2f} s", flush=True)

        # ---- cached reads vs local-disk reads of the same (largest) blob
        big = max(info.layers, key=lambda l: l["blob_bytes"])
        fuse_file = os.path.join(last_b.data_dir, "edge", "images", "blobfs", f"{big['digest']}.blob")
        with open(fuse_file, "rb") as f:  # fetch every chunk once
            while f.read(1 << 20):
                pass
        cached = read_throughput(fuse_file)
        # The same blob on local disk: the full-download node's copy of it.
        local_file = os.path.join(WORK, f"d{RUNS - 1}", "edge", "images", "blobs", f"{big['digest']}.blob")
        local = read_throughput(local_file)
        last_b.stop()
        res = {
            "image_bytes": image_bytes, "blob_bytes": blob_bytes, "runs": RUNS,
            "local_disk": stats(out["local_disk"]), "s3_chunk_cache": stats(out["s3_chunk_cache"]),
            "s3_full_download": stats(out["s3_full_download"]),
            "ratio_full_download_over_cache": statistics.median(out["s3_full_download"]) / statistics.median(out["s3_chunk_cache"]),
            "ratio_cache_over_local": statistics.median(out["s3_chunk_cache"]) / statistics.median(out["local_disk"]),
            "fetched_share_median": statistics.median(out["fetched_share"]),
            "cached_read_mb_s": cached, "local_read_mb_s": local, "cached_over_local": cached / local,
            "blob_read_bytes": big["blob_bytes"],
        }
        print(json.dumps(res, indent=2))
        write_results("s3_cache", res)
    finally:
        for u in ups:
            try:
                u.stop()
            except Exception:
                pass
        for k in _objects(ceph, prefix):
            _s3(ceph, "DELETE", f"/{ceph['S3_BUCKET']}/{k}")
        for m in sorted(mounts_under(WORK), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        if started:
            subprocess.run(["bash", CEPH_DEV, "stop", ceph_dir], check=False)
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
