#!/usr/bin/env python3
"""microVM memory (issue 9 density hooks, measured for issue 10): host memory of N microVMs
from the same debian layers running the same Python task, with the layers as virtio-blk disks
vs. virtio-pmem regions mounted with DAX; and virtio-balloon free page reporting.

    python3 bench/microvm_memory.py [--vms 8] [--memory-mb 512]

Starts its own `dsec up` (temporary data dir, own port and node id) once per configuration,
with `DSEC_MICROVM_PMEM=0` / `1` (and `DSEC_MICROVM_BALLOON=0` for the balloon baseline),
imports debian from the cached tarball, then creates the VMs one after the other; each runs
`python3 -c 'import json, email, http.client, ...'` and idles.

Host memory of the VMs = sum over the QEMU processes of Pss_Anon + Pss_Shmem (their private
and shared RAM, shared pages split between sharers, from /proc/<pid>/smaps_rollup) + the host
page cache held by the layer files (`fincore` over the image store's layer and blob files and
the padded virtio-pmem copies) and the VMs' writable disks. Page cache of DAX-mapped files is
counted once there (it is Pss_File of the QEMUs, which is not added again).

Free page reporting: in one VM, QEMU's RSS before, after a guest process touched 200 MB, and
10 s after that process exited.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk" / "python"))
sys.path.insert(0, str(ROOT / "tests"))
from dsec import DSecMicroVMRunArgs  # noqa: E402
from helpers import DsecUp, new_data_dir, remove_data_dir  # noqa: E402
from vmfixture import qemu_pids_for as qemu_pids  # noqa: E402

CACHE = Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec"))
DEBIAN_TAR = CACHE / "debian-bookworm.tar"
PMEM_DIR = CACHE / "pmem-layers"
TASK = ("python3 -c 'import json, email, email.parser, http.client, xml.dom.minidom, sqlite3, "
        "decimal, argparse, logging, urllib.request; print(json.dumps({\"ok\": 1}))'")


def rollup(pid: int) -> dict:
    d = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        k, _, v = line.partition(":")
        parts = v.split()
        if parts and parts[0].isdigit():
            d[k.strip()] = int(parts[0]) * 1024
    return d


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def cached_bytes(paths) -> int:
    files = [str(p) for p in paths if Path(p).is_file()]
    if not files:
        return 0
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", *files], capture_output=True, text=True).stdout
    return sum(int(x) for x in out.split() if x.isdigit())


def layer_files(data_dir: str):
    files = []
    for base in (Path(data_dir), PMEM_DIR):
        if base.is_dir():
            files += [p for p in base.rglob("*") if p.suffix in (".erofs", ".blob", ".pmem", ".img") and p.is_file()]
    return files


def drop_file_cache(paths) -> None:
    """Evicts the page cache of these files (the import just wrote them): targeted, unlike
    drop_caches, so the figure starts from the VMs' own reads."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def tb_cache(pid: int) -> int:
    """Resident size of QEMU's TCG translation cache (its largest anonymous RWX mapping)."""
    best, cur, cur_rwx = 0, 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
            cur_rwx = line.split()[1].startswith("rwx")
        elif line.startswith("Rss:") and cur_rwx:
            best = max(best, int(line.split()[1]) * 1024)
    return best


def start_node(pmem: bool, balloon: bool, tag: str) -> tuple[DsecUp, str]:
    os.environ["DSEC_MICROVM_PMEM"] = "1" if pmem else "0"
    os.environ["DSEC_MICROVM_BALLOON"] = "1" if balloon else "0"
    # Every VM boots cold: clones restored from a template would load the template's memory
    # image (anonymous, per VM) and measure the snapshot, not the layers' sharing.
    os.environ["DSEC_MICROVM_TEMPLATES"] = "0"
    # virtio-pmem needs the `pc` machine (QEMU 7.2's `microvm` gives pmem regions no address):
    # both configurations run on `pc`, so the rows differ only in how the layers are attached.
    os.environ["DSEC_MICROVM_MACHINE"] = "pc"
    data = new_data_dir(tag)
    up = DsecUp(str(ROOT / "target/release/dsec"), data, f"{tag.replace('-', '')[:10]}{os.getpid() % 100000}").start()
    up.cli("image", "import", "debian", "--tar", str(DEBIAN_TAR), timeout=900)
    drop_file_cache(layer_files(data))
    return up, data


def density(pmem: bool, n: int, memory_mb: int) -> dict:
    up, data = start_node(pmem, True, "vmmem-pmem" if pmem else "vmmem-blk")
    sbs = []
    try:
        with up.client() as c:
            # Warm-up VM: the padded virtio-pmem copies of the layers are made once per layer
            # (this copy reads the whole blob); the figures are for VMs after that.
            c.run_microvm(DSecMicroVMRunArgs(container_image="debian", memory_limit_mb=memory_mb), timeout=600).stop()
            drop_file_cache(layer_files(data))
            t0 = time.monotonic()
            guest = []
            for _ in range(n):
                sb = c.run_microvm(DSecMicroVMRunArgs(container_image="debian", memory_limit_mb=memory_mb), timeout=600)
                sbs.append(sb)
                r = sb.run_shell(TASK, timeout=600)
                assert r.exit_code == 0 and '"ok": 1' in r.stdout, r
                m = sb.run_shell("grep -E '^(MemTotal|MemFree|Cached):' /proc/meminfo").stdout.split()
                kv = {m[i].rstrip(":"): int(m[i + 1]) * 1024 for i in range(0, len(m), 3)}
                guest.append(kv)
            elapsed = time.monotonic() - t0
            time.sleep(3)
            pids = qemu_pids(data)
            assert len(pids) == n, pids
            rolls = [rollup(p) for p in pids]
            anon = sum(r.get("Pss_Anon", 0) + r.get("Pss_Shmem", 0) for r in rolls)
            pss_file = sum(r.get("Pss_File", 0) for r in rolls)
            cache = cached_bytes(layer_files(data))
            res = {"vms": n, "anon_shmem": anon, "pss_file": pss_file, "page_cache": cache,
                   "total": anon + cache, "rss_sum": sum(rss(p) for p in pids), "create_and_task_s": elapsed,
                   "tb_cache": sum(tb_cache(p) for p in pids),
                   "guest_used": sum(g["MemTotal"] - g["MemFree"] for g in guest) / n,
                   "guest_cached": sum(g["Cached"] for g in guest) / n}
            for sb in sbs:
                sb.stop()
            return res
    finally:
        up.stop()
        remove_data_dir(data)


def free_page_reporting(balloon: bool) -> dict:
    up, data = start_node(True, balloon, "vmmem-fpr" if balloon else "vmmem-nofpr")
    try:
        with up.client() as c:
            sb = c.run_microvm(DSecMicroVMRunArgs(container_image="debian", memory_limit_mb=512), timeout=600)
            sb.run_shell(TASK, timeout=600)
            time.sleep(3)
            pid = qemu_pids(data)[0]
            before = rss(pid)
            r = sb.run_shell("python3 -c 'b = bytearray(200 << 20)\nfor i in range(0, len(b), 4096): b[i] = 1\nprint(len(b))'", timeout=600)
            assert r.exit_code == 0, r
            peak = rss(pid)
            time.sleep(10)
            after = rss(pid)
            sb.stop()
            return {"before": before, "peak": peak, "after": after}
    finally:
        up.stop()
        remove_data_dir(data)


def mb(x: int) -> str:
    return f"{x / 1e6:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--skip-density", action="store_true")
    args = ap.parse_args()
    accel = os.environ.get("DSEC_MICROVM_ACCEL", "tcg")
    print(f"accelerator: {accel}; {args.vms} microVMs x {args.memory_mb} MB from debian, each ran: {TASK}")
    if not args.skip_density:
        rows = {}
        for pmem in (False, True):
            rows[pmem] = density(pmem, args.vms, args.memory_mb)
            r = rows[pmem]
            print(f"{'virtio-pmem + DAX' if pmem else 'virtio-blk':>18}: total {mb(r['total'])} MB = QEMU anon+shmem PSS "
                  f"{mb(r['anon_shmem'])} MB + layer/disk page cache {mb(r['page_cache'])} MB "
                  f"(QEMU file PSS {mb(r['pss_file'])} MB, RSS sum {mb(r['rss_sum'])} MB, of which TCG translation cache "
                  f"{mb(r['tb_cache'])} MB; per guest: used {mb(r['guest_used'])} MB, page cache {mb(r['guest_cached'])} MB; "
                  f"create+task {r['create_and_task_s']:.0f} s)",
                  flush=True)
            ex = r["total"] - r["tb_cache"]
            print(f"{'':>18}  without the TCG translation cache (absent under KVM): {mb(ex)} MB", flush=True)
            r["total_ex_tb"] = ex
        a, b = rows[False]["total"], rows[True]["total"]
        print(f"pmem/DAX vs blk: {100 * (b - a) / a:+.0f}% host memory", flush=True)
        a, b = rows[False]["total_ex_tb"], rows[True]["total_ex_tb"]
        print(f"pmem/DAX vs blk without the TCG translation cache: {100 * (b - a) / a:+.0f}%", flush=True)
    for balloon in (True, False):
        f = free_page_reporting(balloon)
        print(f"free page reporting {'on ' if balloon else 'off'}: QEMU RSS before {mb(f['before'])} MB, "
              f"after touching 200 MB {mb(f['peak'])} MB, 10 s after freeing {mb(f['after'])} MB", flush=True)


if __name__ == "__main__":
    main()
