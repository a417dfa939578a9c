"""CephFS as dsec's blob store: a real single-node Ceph (scripts/storage/ceph-dev.sh: monitor,
manager, a BlueStore OSD, an MDS; CephFS mounted with ceph-fuse) and `dsec up` with
`image_blob_store = "posix:<cephfs>/dsec"`: import, on-demand reads through EROFS from blobs on
CephFS, layer verification, pack_diff, and a second node (own node id and data dir, same store)
running images the first imported, without importing them.

The cluster is started once for this module and stopped after it. When ``DSEC_CEPH_DIR`` names
a running ceph-dev (e.g. started by hand), that one is used and left running."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Dict, Iterator

import pytest

import dsec
from helpers import make_sandbox, mounts_under, new_data_dir, remove_data_dir, sh, stop_quietly
from test_images import _tar, dsec_up_with_config

CEPH_DEV = Path(__file__).resolve().parent.parent / "scripts" / "storage" / "ceph-dev.sh"
CEPH_PKGS = ("ceph-mon", "ceph-mgr", "ceph-osd", "ceph-mds", "radosgw", "ceph-fuse", "ceph-common")


def _installed(pkg: str) -> bool:
    r = subprocess.run(["dpkg-query", "-W", "-f=${Status}", pkg], capture_output=True, text=True)
    return "install ok installed" in r.stdout


def _read_env(data_dir: str) -> Dict[str, str]:
    env = {}
    for line in Path(data_dir, "env").read_text().splitlines():
        k, _, v = line.partition("=")
        env[k] = v
    return env


@pytest.fixture(scope="module")
def ceph() -> Iterator[Dict[str, str]]:
    if os.geteuid() != 0:
        pytest.skip("ceph-dev needs root")
    given = os.environ.get("DSEC_CEPH_DIR")
    if given and subprocess.run(["bash", str(CEPH_DEV), "status", given], capture_output=True).returncode == 0:
        yield _read_env(given)
        return
    data = new_data_dir("ceph")
    os.rmdir(data)  # ceph-dev creates it (and refuses a directory that is not its own)
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(CEPH_DEV), "start", data], capture_output=True, text=True, timeout=600)
    if r.returncode != 0:
        missing = [p for p in CEPH_PKGS if not _installed(p)]
        subprocess.run(["bash", str(CEPH_DEV), "stop", data], capture_output=True, timeout=120)
        if missing:
            pytest.skip(f"Ceph packages could not be installed ({' '.join(missing)}): {r.stderr[-500:]}")
        pytest.fail(f"ceph-dev.sh start failed (exit {r.returncode}):\n{r.stderr[-3000:]}")
    print(f"\n[ceph-dev] started in {time.monotonic() - t0:.1f} s", flush=True)
    try:
        yield _read_env(data)
    finally:
        t0 = time.monotonic()
        r = subprocess.run(["bash", str(CEPH_DEV), "stop", data], capture_output=True, text=True, timeout=300)
        print(f"\n[ceph-dev] stopped in {time.monotonic() - t0:.1f} s\n{r.stderr.strip()}", flush=True)
        assert r.returncode == 0, r.stderr
        assert not os.path.exists(data), f"ceph-dev left {data}"
        assert not mounts_under(data), mounts_under(data)
        left = [pid for pid in os.listdir("/proc") if pid.isdigit() and _cmdline_has(pid, data)]
        assert not left, f"ceph-dev stop left processes {left}"


def _cmdline_has(pid: str, needle: str) -> bool:
    try:
        return needle.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False


def test_ceph_dev_start_is_idempotent_and_status_reports(ceph):
    data = os.path.dirname(ceph["CEPH_CONF"])
    t0 = time.monotonic()
    r = subprocess.run(["bash", str(CEPH_DEV), "start", data], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "already running" in r.stderr and time.monotonic() - t0 < 30, r.stderr
    assert _read_env(data) == ceph, "a second start changed the cluster's endpoints or keys"
    r = subprocess.run(["bash", str(CEPH_DEV), "status", data], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "health: HEALTH_OK" in r.stdout, r.stdout
    assert f"cephfs: mounted on {ceph['CEPHFS_MOUNT']}" in r.stdout, r.stdout
    assert f"s3: answering at {ceph['S3_ENDPOINT']}" in r.stdout, r.stdout


def _cleanup(up, data: str) -> list:
    """Stops a `dsec up` (returns its exit code first) and removes its data dir and config."""
    rc = up.stop() if up.proc is not None else 0
    left = mounts_under(data)
    remove_data_dir(data)
    for p in (data + ".toml", data + ".dsec"):
        try:
            os.unlink(p)
        except OSError:
            pass
    return [rc, left]


def _drop_page_cache(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _cephfs_bytes_served(ceph: Dict[str, str]) -> int:
    """Bytes ceph-fuse has written to /dev/fuse: what this host's kernel read from CephFS (its
    replies to FUSE reads; ceph-fuse's network I/O uses sendmsg and is not counted)."""
    pid = Path(os.path.dirname(ceph["CEPH_CONF"]), "run", "ceph-fuse.pid").read_text().strip()
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError(f"no wchar in /proc/{pid}/io")


def _layer_lines(digest: str):
    with open("/proc/self/mountinfo") as f:
        return [line for line in f if digest in line and " erofs " in line]


def test_cephfs_blob_store_import_run_verify_pack_diff_second_node(dsec_bin, ceph):
    mnt = ceph["CEPHFS_MOUNT"]
    with open("/proc/self/mounts") as f:
        assert any(f" {mnt} fuse.ceph-fuse " in line for line in f), "CephFS not mounted with ceph-fuse"
    store = os.path.join(mnt, f"dsec-{os.getpid()}")
    os.makedirs(store)
    spec = f'image_blob_store = "posix:{store}"\n'
    data_a = new_data_dir("ceph-a")
    data_b = new_data_dir("ceph-b")
    up_a = dsec_up_with_config(dsec_bin, data_a, "cepha", spec)
    up_b = dsec_up_with_config(dsec_bin, data_b, "cephb", spec)
    results = {}
    try:
        up_a.start()
        a = up_a.client()

        # ---- import: the data blob is written to CephFS, only metadata stays local
        payload = os.urandom(8 << 20)
        info = a.import_image("ceph-img:v1", _tar([
            ("data", None), ("data/blob.bin", payload), ("data/small", b"small\n"),
        ]))
        layer = info.layers[-1]
        digest = layer["digest"]
        assert layer["blob_bytes"] >= len(payload) and layer["meta_bytes"] < 64 * 1024, layer
        on_ceph = os.path.join(store, f"{digest}.blob")
        assert os.path.getsize(on_ceph) == layer["blob_bytes"]
        assert not os.path.exists(os.path.join(data_a, "edge", "images", "blobs", f"{digest}.blob"))

        # ---- a sandbox reads the files through EROFS from the blob on CephFS
        sb = make_sandbox(a, "busybox", workspace="ceph-img:v1")
        try:
            assert sh(sb, "cat /data/small") == "small\n"
            assert sh(sb, "sha256sum /data/blob.bin").split()[0] == hashlib.sha256(payload).hexdigest()
            assert _layer_lines(digest), "layer not mounted"

            # ---- pack_diff: the diff becomes a layer whose blob also goes to CephFS
            sh(sb, "head -c 400000 /data/blob.bin > /data/diff.bin && echo packed > /data/note")
            diff_payload = payload[:400_000]
            packed = sb.pack_diff("ceph-packed:v1")
        finally:
            stop_quietly(sb)
        # base + workspace + the diff, as one image
        assert packed.parent == "busybox:latest", packed
        assert digest in [l["digest"] for l in packed.layers], packed
        top = packed.layers[-1]
        assert top["blob_bytes"] >= len(diff_payload), top
        assert os.path.getsize(os.path.join(store, f"{top['digest']}.blob")) == top["blob_bytes"]

        # ---- verification: a blob truncated on CephFS fails the first mount, naming the layer
        a.import_image("ceph-damaged:v1", _tar([("big", os.urandom(500_000))]))
        dmg = next(i for i in a.list_images() if i.name == "ceph-damaged:v1").layers[-1]
        dmg_blob = os.path.join(store, f"{dmg['digest']}.blob")
        with open(dmg_blob, "r+b") as f:
            f.truncate(os.path.getsize(dmg_blob) - 4096)
        t0 = time.monotonic()
        with pytest.raises(dsec.DSecError) as e:
            make_sandbox(a, "busybox", workspace="ceph-damaged:v1")
        assert time.monotonic() - t0 < 60
        assert "data blob" in str(e.value) and "truncated" in str(e.value), e.value
        a.close()

        # ---- a second node on the same store: it is told about the images (their index
        # records, as a shared catalog would), never imports them, and fetches their metadata
        # images from CephFS before its first mount.
        index_a = json.loads(Path(data_a, "edge", "images", "index.json").read_text())
        shared = {n: index_a["images"][n] for n in ("ceph-img:v1", "ceph-packed:v1")}
        os.makedirs(os.path.join(data_b, "edge", "images"))
        Path(data_b, "edge", "images", "index.json").write_text(
            json.dumps({"version": index_a["version"], "images": shared}))
        up_b.start()
        b = up_b.client()
        layers_b = os.path.join(data_b, "edge", "images", "layers")
        assert not os.path.exists(os.path.join(layers_b, f"{digest}.erofs"))
        names_b = {i.name for i in b.list_images()}
        assert {"ceph-img:v1", "ceph-packed:v1"} <= names_b, names_b
        # Nothing of the blobs in this host's page cache: B's reads go to CephFS (ceph-fuse).
        for d in (digest, top["digest"]):
            _drop_page_cache(os.path.join(store, f"{d}.blob"))
        sb = make_sandbox(b, "ceph-packed:v1")
        try:
            assert sh(sb, "cat /data/note /data/small") == "packed\nsmall\n"
            # On demand: 4 KiB from the middle of an 8 MiB file reads a small part of its blob.
            w0 = _cephfs_bytes_served(ceph)
            sh(sb, "dd if=/data/blob.bin of=/dev/null bs=4096 count=1 skip=1000 2>/dev/null")
            partial = _cephfs_bytes_served(ceph) - w0
            assert partial < len(payload) // 8, f"a 4 KiB read fetched {partial} bytes from CephFS"
            w0 = _cephfs_bytes_served(ceph)
            assert sh(sb, "sha256sum /data/blob.bin").split()[0] == hashlib.sha256(payload).hexdigest()
            full = _cephfs_bytes_served(ceph) - w0
            # ... and reading all of it fetches (about) all of it: the counter sees the reads.
            assert full >= len(payload) * 0.8, f"reading {len(payload)} bytes fetched only {full} from CephFS"
            print(f"\n[ceph] node B: 4 KiB read fetched {partial} B, full 8 MiB read fetched {full} B", flush=True)
            assert sh(sb, "sha256sum /data/diff.bin").split()[0] == hashlib.sha256(diff_payload).hexdigest()
        finally:
            stop_quietly(sb)
        # Node B fetched the metadata images from the store and has no local copy of the blobs.
        assert os.path.exists(os.path.join(layers_b, f"{digest}.erofs"))
        assert os.path.exists(os.path.join(layers_b, f"{top['digest']}.erofs"))
        blobs_b = os.path.join(data_b, "edge", "images", "blobs")
        assert not (os.path.isdir(blobs_b) and any(f.endswith(".blob") for f in os.listdir(blobs_b)))
        b.close()
    finally:
        results["b"] = _cleanup(up_b, data_b)
        results["a"] = _cleanup(up_a, data_a)
        subprocess.run(["rm", "-rf", store], check=False)
    for node, (rc, left) in results.items():
        assert rc == 0, (node, up_a.stderr_tail() if node == "a" else up_b.stderr_tail())
        assert not left, (node, left)
    up_a.remove_log()
    up_b.remove_log()
