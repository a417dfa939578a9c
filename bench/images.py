#!/usr/bin/env python3
"""Images on demand vs. cold pulls: a burst of sandboxes across distinct composed images.

Eight images = the Debian base (python3, git) + one of eight workspaces (a small Python
project: a module importing a realistic slice of the standard library, its unit tests, and
8-24 MB of data files it never reads) + one toolkit layer. 64 sandboxes (8 per image) each run
`python3 -m unittest` in their workspace. Three ways of getting the images onto a cold node:

  (a) on-demand: dsec with its blob store on sshfs (sshd on loopback); layer metadata is local,
      data blobs are read on demand through the page cache;
  (b) cold full pull: copy each image's layer archives from the store (the same sshfs mount;
      shared layers once, as a Docker node dedups by digest) and `tar -x` them, then run each
      task in a chroot over an overlay of the extracted layers;
  (c) per-sandbox `tar -x` of workspace + toolkit (copied from the store) onto a base that is
      already extracted on the node, then the same chroot run.

Page caches are dropped before each case. Local disk writes and store reads are measured
exactly with two loop devices: the node's local disk (dsec data dir, extraction dirs) and the
store's disk (the sshfs export) are each an ext4 image on their own loop device, so
/sys/block/loopN/stat counts only this benchmark's I/O.

Run as root from the repo root, after `bash scripts/build.sh`:
    python3 bench/images.py            # DSEC_BIN defaults to target/release/dsec
"""

from __future__ import annotations

import concurrent.futures
import io
import os
import shutil
import subprocess
import sys
import tarfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(REPO, "tests"))
sys.path.insert(0, HERE)

from common import DEBIAN_TAR, write_results  # noqa: E402
from helpers import DsecUp, mounts_under  # noqa: E402

N_IMAGES = int(os.environ.get("BENCH_IMAGES", "8"))
PER_IMAGE = int(os.environ.get("BENCH_PER_IMAGE", "8"))
PARALLEL = int(os.environ.get("BENCH_PARALLEL", "8"))
WORK = os.environ.get("DSEC_BENCH_DIR", "/var/tmp/dsec-bench-images")
TASK = "cd /work && python3 -m unittest -q test_app 2>&1 | tail -1 && git --version >/dev/null"

APP = '''import json, csv, decimal, fractions, statistics, email.parser, http.client, urllib.parse
import xml.etree.ElementTree as ET, sqlite3, hashlib, argparse, textwrap, difflib, unittest.mock
import logging, dataclasses, typing, collections, itertools, functools, re, datetime, zlib

SEED = {seed}

def score(rows):
    db = sqlite3.connect(":memory:")
    db.execute("create table t (k text, v real)")
    db.executemany("insert into t values (?, ?)", rows)
    return db.execute("select sum(v) from t").fetchone()[0]

def parse(doc):
    return [e.text for e in ET.fromstring(doc).iter("v")]

def digest(s):
    return hashlib.sha256(s.encode()).hexdigest()[:8] + str(SEED)
'''

TEST = '''import unittest, decimal, json
import app

class T(unittest.TestCase):
    def test_score(self):
        self.assertEqual(app.score([("a", 1.5), ("b", 2.5)]), 4.0)
    def test_parse(self):
        self.assertEqual(app.parse("<r><v>1</v><v>2</v></r>"), ["1", "2"])
    def test_digest(self):
        self.assertTrue(app.digest("x").endswith(str(app.SEED)))
    def test_json(self):
        self.assertEqual(json.loads(json.dumps({"d": str(decimal.Decimal("1.1"))})), {"d": "1.1"})
'''


def sh(*args, **kw):
    return subprocess.run(list(args), check=True, **kw)


def drop_caches():
    subprocess.run(["sync"], check=True)
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3\n")


class LoopDisk:
    """An ext4 file system on a loop device, mounted at `mnt`; counts its I/O exactly."""

    def __init__(self, name: str, size_gb: int):
        self.img = os.path.join(WORK, f"{name}.img")
        self.mnt = os.path.join(WORK, name)
        os.makedirs(self.mnt, exist_ok=True)
        with open(self.img, "wb") as f:
            f.truncate(size_gb << 30)
        sh("mkfs.ext4", "-q", "-F", self.img)
        self.dev = subprocess.run(["losetup", "--find", "--show", self.img], check=True,
                                  capture_output=True, text=True).stdout.strip()
        sh("mount", self.dev, self.mnt)
        self.name = os.path.basename(self.dev)

    def stat(self):
        """(bytes read, bytes written) so far."""
        with open(f"/sys/block/{self.name}/stat") as f:
            v = f.read().split()
        return int(v[2]) * 512, int(v[6]) * 512

    def close(self):
        subprocess.run(["umount", "-l", self.mnt], check=False)
        subprocess.run(["losetup", "-d", self.dev], check=False)
        try:
            os.unlink(self.img)
        except OSError:
            pass


def tar_bytes(root: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as t:
        t.add(root, arcname=".")
    return buf.getvalue()


def make_sources(src: str):
    """Workspace and toolkit trees; returns (workspace dirs, toolkit dir)."""
    wss = []
    for i in range(N_IMAGES):
        d = os.path.join(src, f"ws{i}")
        os.makedirs(os.path.join(d, "work", "data"), exist_ok=True)
        with open(os.path.join(d, "work", "app.py"), "w") as f:
            f.write(APP.format(seed=i))
        with open(os.path.join(d, "work", "test_app.py"), "w") as f:
            f.write(TEST)
        # Data the task never reads (fixtures, checkpoints, vendored assets).
        for j in range(4 + 2 * (i % 5)):
            with open(os.path.join(d, "work", "data", f"blob{j}.bin"), "wb") as f:
                f.write(os.urandom(2 << 20))
        wss.append(d)
    tk = os.path.join(src, "toolkit")
    os.makedirs(os.path.join(tk, "opt", "harness"), exist_ok=True)
    with open(os.path.join(tk, "opt", "harness", "run.sh"), "w") as f:
        f.write("#!/bin/sh\nexec \"$@\"\n")
    with open(os.path.join(tk, "opt", "harness", "tools.bin"), "wb") as f:
        f.write(os.urandom(4 << 20))
    return wss, tk


def chroot_run(lowers, upper_parent: str, idx: int) -> str:
    """overlay(lowers) + a fresh upper, then the task in a chroot (own mount namespace)."""
    up = os.path.join(upper_parent, f"s{idx}")
    for sub in ("upper", "work", "root"):
        os.makedirs(os.path.join(up, sub), exist_ok=True)
    script = (
        f"mount -t overlay overlay -o lowerdir={':'.join(lowers)},upperdir={up}/upper,workdir={up}/work {up}/root"
        f" && mount -t proc proc {up}/root/proc && exec chroot {up}/root /bin/sh -c '{TASK}'"
    )
    p = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                       capture_output=True, text=True)
    if p.returncode != 0 or "OK" not in p.stdout:
        raise RuntimeError(f"task failed: {p.stdout} {p.stderr}")
    return p.stdout


def run_burst(fn, n):
    with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
        return list(pool.map(fn, range(n)))


def main():
    if os.geteuid() != 0:
        raise SystemExit("run as root")
    dsec_bin = os.environ.get("DSEC_BIN", os.path.join(REPO, "target", "release", "dsec"))
    if not os.path.exists(dsec_bin):
        raise SystemExit(f"{dsec_bin} missing: run scripts/build.sh")
    if os.path.exists(WORK):
        for m in sorted(mounts_under(WORK), key=len, reverse=True):
            subprocess.run(["umount", "-l", m], check=False)
        shutil.rmtree(WORK, ignore_errors=True)
    os.makedirs(WORK)
    local = LoopDisk("local", 24)
    storedisk = LoopDisk("storedisk", 16)
    from test_images import SshfsStore
    store = SshfsStore()
    store.export = os.path.join(storedisk.mnt, "export")
    os.makedirs(store.export)
    up = None
    results = {}
    try:
        store.start()
        # ---- setup (not timed): sources, archives in the store, dsec images
        src = os.path.join(WORK, "src")
        wss, tk = make_sources(src)
        arch = os.path.join(store.mnt, "archives")
        os.makedirs(arch)
        shutil.copy(DEBIAN_TAR, os.path.join(arch, "base.tar"))
        for i, d in enumerate(wss):
            with open(os.path.join(arch, f"ws{i}.tar"), "wb") as f:
                f.write(tar_bytes(d))
        with open(os.path.join(arch, "toolkit.tar"), "wb") as f:
            f.write(tar_bytes(tk))

        data = os.path.join(local.mnt, "dsec")
        os.makedirs(data)
        os.makedirs(os.path.join(store.mnt, "blobs"))
        cfg = data + ".toml"
        with open(cfg, "w") as f:
            f.write(f'[edge]\nimage_blob_store = "posix:{store.mnt}/blobs"\n')
        wrapper = data + ".dsec"
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {dsec_bin} "$@" --config {cfg}; fi\nexec {dsec_bin} "$@"\n')
        os.chmod(wrapper, 0o755)
        up = DsecUp(wrapper, data, "bimg").start()
        c = up.client()
        c.import_image("bench-base:v1", DEBIAN_TAR, timeout=1800)
        for i, d in enumerate(wss):
            c.import_image(f"bench-ws{i}:v1", tar_bytes(d))
        c.import_image("bench-tk:v1", tar_bytes(tk))
        images = {i.name: i for i in c.list_images()}
        used = ["bench-base:v1", "bench-tk:v1"] + [f"bench-ws{i}:v1" for i in range(N_IMAGES)]
        image_bytes = sum(l["size_bytes"] for n in used for l in images[n].layers)
        per_image = [sum(l["size_bytes"] for n in ("bench-base:v1", "bench-tk:v1", f"bench-ws{i}:v1")
                         for l in images[n].layers) for i in range(N_IMAGES)]
        # A node that never ran these images: no local metadata, nothing mounted.
        c.close()
        up.stop()
        for f in os.listdir(os.path.join(data, "edge", "images", "layers")):
            os.unlink(os.path.join(data, "edge", "images", "layers", f))
        n = N_IMAGES * PER_IMAGE

        # ---- (a) on-demand
        up = DsecUp(wrapper, data, "bimg").start()
        c = up.client()
        drop_caches()
        r0, w0 = storedisk.stat()[0], local.stat()[1]
        t0 = time.monotonic()

        def one(k):
            sb = c.run_container(__import__("dsec").DSecContainerRunArgs(
                container_image="bench-base:v1", workspace=f"bench-ws{k % N_IMAGES}:v1", toolkits=["bench-tk:v1"]),
                timeout=600)
            try:
                r = sb.run_shell(TASK, timeout=300)
                if r.exit_code != 0 or "OK" not in r.stdout:
                    raise RuntimeError(f"task failed: {r.stdout} {r.stderr}")
            finally:
                sb.stop()

        run_burst(one, n)
        subprocess.run(["sync"], check=True)
        print(f"case a: monotonic {t0:.3f} .. {time.monotonic():.3f}", file=sys.stderr)
        results["a_on_demand"] = {"wall_s": time.monotonic() - t0, "store_read": storedisk.stat()[0] - r0,
                                  "local_written": local.stat()[1] - w0}
        c.close()
        up.stop()
        up = None

        # ---- (b) cold full pull: copy + extract each distinct layer once, then run
        pulled = os.path.join(local.mnt, "pulled")
        os.makedirs(pulled)
        drop_caches()
        r0, w0 = storedisk.stat()[0], local.stat()[1]
        t0 = time.monotonic()

        def pull(name):
            dst = os.path.join(pulled, name)
            os.makedirs(dst)
            sh("cp", os.path.join(arch, f"{name}.tar"), dst + ".tar")
            sh("tar", "-xf", dst + ".tar", "-C", dst)
            return dst

        names = ["base", "toolkit"] + [f"ws{i}" for i in range(N_IMAGES)]
        with concurrent.futures.ThreadPoolExecutor(PARALLEL) as pool:
            dirs = dict(zip(names, pool.map(pull, names)))
        uppers = os.path.join(local.mnt, "uppers-b")
        run_burst(lambda k: chroot_run([dirs["toolkit"], dirs[f"ws{k % N_IMAGES}"], dirs["base"]], uppers, k), n)
        subprocess.run(["sync"], check=True)
        print(f"case b: monotonic {t0:.3f} .. {time.monotonic():.3f}", file=sys.stderr)
        results["b_cold_full_pull"] = {"wall_s": time.monotonic() - t0, "store_read": storedisk.stat()[0] - r0,
                                       "local_written": local.stat()[1] - w0}

        # ---- (c) per-sandbox tar -x of workspace + toolkit onto a base already on the node
        base_dir = dirs["base"]
        for nm in names[1:]:
            shutil.rmtree(dirs[nm], ignore_errors=True)
            os.unlink(dirs[nm] + ".tar")
        os.unlink(base_dir + ".tar")
        shutil.rmtree(uppers, ignore_errors=True)
        per_sb = os.path.join(local.mnt, "per-sandbox")
        drop_caches()
        r0, w0 = storedisk.stat()[0], local.stat()[1]
        t0 = time.monotonic()

        def extract_and_run(k):
            d = os.path.join(per_sb, f"s{k}", "layer")
            os.makedirs(d)
            for nm in (f"ws{k % N_IMAGES}", "toolkit"):
                sh("tar", "-xf", os.path.join(arch, f"{nm}.tar"), "-C", d)
            return chroot_run([d, base_dir], os.path.join(per_sb, f"s{k}"), k)

        run_burst(extract_and_run, n)
        subprocess.run(["sync"], check=True)
        print(f"case c: monotonic {t0:.3f} .. {time.monotonic():.3f}", file=sys.stderr)
        results["c_per_sandbox_tar"] = {"wall_s": time.monotonic() - t0, "store_read": storedisk.stat()[0] - r0,
                                        "local_written": local.stat()[1] - w0}

        a, b, cc = results["a_on_demand"], results["b_cold_full_pull"], results["c_per_sandbox_tar"]
        summary = {
            "sandboxes": n, "images": N_IMAGES, "parallel": PARALLEL,
            "distinct_image_bytes": image_bytes, "mean_image_bytes": sum(per_image) / len(per_image),
            "cases": results,
            "speedup_vs_full_pull": b["wall_s"] / a["wall_s"],
            "speedup_vs_tar": cc["wall_s"] / a["wall_s"],
            "write_reduction_vs_full_pull_pct": 100 * (1 - a["local_written"] / max(1, b["local_written"])),
            "write_ratio_tar_over_on_demand": cc["local_written"] / max(1, a["local_written"]),
            "on_demand_read_pct_of_image_bytes": 100 * a["store_read"] / image_bytes,
        }
        mb = 1 << 20
        print(f"{n} sandboxes over {N_IMAGES} images ({PARALLEL} at a time); distinct image bytes "
              f"{image_bytes / mb:.0f} MiB (one image: {summary['mean_image_bytes'] / mb:.0f} MiB)")
        print(f"{'case':28} {'wall s':>8} {'store read MiB':>15} {'local written MiB':>18}")
        for k, v in results.items():
            print(f"{k:28} {v['wall_s']:8.1f} {v['store_read'] / mb:15.1f} {v['local_written'] / mb:18.1f}")
        print(f"on-demand vs cold full pull: {summary['speedup_vs_full_pull']:.2f}x faster, "
              f"{summary['write_reduction_vs_full_pull_pct']:.0f}% fewer disk writes (reference: 1.71x, 57%)")
        print(f"on-demand vs per-sandbox tar: {summary['speedup_vs_tar']:.2f}x faster, "
              f"{summary['write_ratio_tar_over_on_demand']:.1f}x fewer writes (reference: 1.76x, 5.5x)")
        print(f"on-demand read {summary['on_demand_read_pct_of_image_bytes']:.1f}% of the image bytes (target <= 15%)")
        write_results("images", summary)
    finally:
        if up is not None:
            up.stop()
        for m in sorted(mounts_under(WORK), key=len, reverse=True):
            if m not in (local.mnt, storedisk.mnt, store.mnt):
                subprocess.run(["umount", "-l", m], check=False)
        store.stop()
        local.close()
        storedisk.close()
        shutil.rmtree(WORK, ignore_errors=True)


if __name__ == "__main__":
    main()
