#!/usr/bin/env python3
"""microVM memory (issue 9 density hooks, measured for issue 10): host memory of N microVMs
from the same layers running the same Python task, with the layers as virtio-blk disks vs.
virtio-pmem regions mounted with DAX; and virtio-balloon free page reporting.

    python3 bench/microvm_memory.py [--vms 8] [--memory-mb 512] [--task light|scipy|both]
                                    [--layers blk|pmem|both] [--tb-mb N] [--skip-fpr]

Two tasks, each run by N VMs of its own:
- `light`: `python3 -c 'import json, email, http.client, ...'` (stdlib only) on `debian`;
- `scipy`: a data-science verifier (pandas groupby, scipy.stats t-test, a scipy.linalg
  least-squares solve) on `debian` with the `scipy-toolkit` toolkit layer (numpy, pandas,
  scipy for the guest's CPython 3.11: scripts/images/build-scipy-toolkit.sh, cached under
  /var/cache/dsec/scipy-toolkit; the task is skipped with a message when it cannot be built).

Starts its own `dsec up` (temporary data dir, own port and node id) once per layer
configuration, with `DSEC_MICROVM_PMEM=0` / `1` (and `DSEC_MICROVM_BALLOON=0` for the balloon
baseline), imports debian from the cached tarball (and the toolkit from its directory), then
per task creates the VMs one after the other; each runs the task and idles. The VMs of a task
are stopped and the layer files' host page cache evicted before the next task's VMs start.

Per guest, after the task: its memory in use and page cache (/proc/meminfo) and the bytes it
read from the read-only layer disks (/sys/block/vd*/stat of the disks with serial dsec-m*/b*):
with virtio-blk that is the layer data each guest holds in its own page cache (L); with DAX
the guest reads none, and the layer pages it touched are the host's page cache of the pmem
copies (one copy for all VMs). B = per-VM host memory that is not layer data (QEMU anon+shmem
PSS per VM minus the guest's layer reads).

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
import tempfile
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
# The runtime keeps the padded virtio-pmem copies next to the guest artefacts.
PMEM_DIR = Path(os.environ["DSEC_GUEST_DIR"]).parent / "pmem-layers" if os.environ.get("DSEC_GUEST_DIR") \
    else CACHE / "pmem-layers"
# Where the nodes' data dirs (image store, VM disks) go: --data-root.
DATA_ROOT: list[str] = []
TOOLKIT_DIR = CACHE / "scipy-toolkit"
TOOLKIT = "scipy-toolkit"
LIGHT = ("python3 -c 'import json, email, email.parser, http.client, xml.dom.minidom, sqlite3, "
         "decimal, argparse, logging, urllib.request; print(json.dumps({\"ok\": 1}))'")
# A data-science verifier: the kind of check an RL environment runs on an agent's answer.
SCIPY = """\
import json
import numpy as np
import pandas as pd
import scipy.linalg as sla
import scipy.stats as st

rng = np.random.default_rng(0)
n = 20000
df = pd.DataFrame({"g": rng.integers(0, 8, n), "x": rng.normal(size=n)})
df["y"] = 2 * df["x"] + df["g"] + rng.normal(scale=0.5, size=n)
agg = df.groupby("g").agg(mx=("x", "mean"), my=("y", "mean"), n=("y", "size"))
t = st.ttest_ind(df.y[df.g == 0], df.y[df.g == 7])
a = np.c_[np.ones(n), df.x.to_numpy(), df.g.to_numpy()]
coef = sla.solve(a.T @ a, a.T @ df.y.to_numpy())
ok = len(agg) == 8 and abs(coef[1] - 2) < 0.05 and abs(coef[2] - 1) < 0.05 and t.pvalue < 1e-6
print(json.dumps({"ok": int(ok), "coef": [round(float(c), 3) for c in coef]}))
"""
TASKS = {
    "light": {"toolkits": None, "describe": LIGHT},
    "scipy": {"toolkits": [TOOLKIT],
              "describe": "python3 -c <pandas groupby + scipy.stats.ttest_ind + scipy.linalg.solve> "
                          "on debian + toolkit scipy-toolkit (numpy 1.26, pandas 2.2, scipy 1.13)"},
}
# In the guest: memory counters and, per virtio disk, its serial and the sectors read.
GUEST_STATS = ("grep -E '^(MemTotal|MemFree|Cached|Shmem):' /proc/meminfo; "
               "for b in /sys/block/vd*; do [ -e $b/serial ] && echo \"disk $(cat $b/serial) $(awk '{print $3}' $b/stat)\"; done; true")


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


def pmem_copies(pids) -> set[str]:
    """The virtio-pmem copies these QEMUs map (their `mem-path=`): the shared pmem directory
    also holds other nodes' copies, which are not counted."""
    out = set()
    for pid in pids:
        for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0"):
            for opt in a.decode(errors="replace").split(","):
                if opt.startswith("mem-path="):
                    out.add(opt[len("mem-path="):])
    return out


def pmem_mapped(pids) -> int:
    """Pss of the virtio-pmem mappings over these QEMUs: the layer pages the guests touched
    through DAX, each counted once however many VMs map it."""
    total = 0
    for pid in pids:
        cur = False
        for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
            f = line.split()
            if f and "-" in f[0] and len(f) >= 5 and ":" not in f[0]:
                cur = len(f) >= 6 and f[5].startswith(str(PMEM_DIR))
            elif cur and f and f[0] == "Pss:":
                total += int(f[1]) * 1024
    return total


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
    best, cur_rwx = 0, False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        if "-" in line.split(" ", 1)[0] and len(line.split()) >= 5:
            cur_rwx = line.split()[1].startswith("rwx")
        elif line.startswith("Rss:") and cur_rwx:
            best = max(best, int(line.split()[1]) * 1024)
    return best


def build_toolkit() -> bool:
    """The toolkit's layer tree (cached); False with a message when pip cannot fetch it."""
    r = subprocess.run(["bash", str(ROOT / "scripts/images/build-scipy-toolkit.sh")], text=True,
                       capture_output=True)
    sys.stdout.write(r.stdout)
    sys.stderr.write(r.stderr if r.returncode else "")
    if r.returncode != 0:
        print(f"scipy task skipped: the toolkit could not be built (exit {r.returncode})", flush=True)
        return False
    return True


def start_node(pmem: bool, balloon: bool, tag: str, toolkit: bool = False) -> tuple[DsecUp, str]:
    env = {
        "DSEC_MICROVM_PMEM": "1" if pmem else "0",
        "DSEC_MICROVM_BALLOON": "1" if balloon else "0",
        # Every VM boots cold: clones restored from a template would load the template's memory
        # image (anonymous, per VM) and measure the snapshot, not the layers' sharing.
        "DSEC_MICROVM_TEMPLATES": "0",
        # virtio-pmem needs the `pc` machine (QEMU 7.2's `microvm` gives pmem regions no address):
        # both configurations run on `pc`, so the rows differ only in how the layers are attached.
        "DSEC_MICROVM_MACHINE": "pc",
    }
    data = tempfile.mkdtemp(prefix=f"dsec-e2e-{tag}-", dir=DATA_ROOT[0]) if DATA_ROOT else new_data_dir(tag)
    up = DsecUp(str(ROOT / "target/release/dsec"), data, f"{tag.replace('-', '')[:10]}{os.getpid() % 100000}",
                env=env).start()
    up.cli("image", "import", "debian", "--tar", str(DEBIAN_TAR), timeout=900)
    if toolkit:
        up.cli("image", "import", TOOLKIT, "--dir", str(TOOLKIT_DIR), timeout=900)
    drop_file_cache(layer_files(data))
    return up, data


def run_args(task: str, memory_mb: int) -> DSecMicroVMRunArgs:
    return DSecMicroVMRunArgs(container_image="debian", memory_limit_mb=memory_mb, toolkits=TASKS[task]["toolkits"])


def run_task(sb, task: str) -> None:
    if task == "light":
        r = sb.run_shell(LIGHT, timeout=900)
    else:
        r = sb.exec(["python3", "-c", SCIPY], timeout=900)
    assert r.exit_code == 0 and '"ok": 1' in r.stdout, r


def guest_stats(sb) -> dict:
    """Guest memory counters and bytes read from its read-only layer disks / its upper disk."""
    out = sb.run_shell(GUEST_STATS, timeout=120).stdout
    g = {"layer_read": 0, "upper_read": 0}
    for line in out.splitlines():
        f = line.split()
        if len(f) >= 3 and f[0].endswith(":") and f[1].isdigit():
            g[f[0].rstrip(":")] = int(f[1]) * 1024
        elif len(f) == 3 and f[0] == "disk" and f[2].isdigit():
            if f[1].startswith(("dsec-m", "dsec-b")):
                g["layer_read"] += int(f[2]) * 512
            elif f[1] == "dsec-upper":
                g["upper_read"] += int(f[2]) * 512
    return g


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process, in seconds."""
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


def density_task(c, data: str, task: str, n: int, memory_mb: int) -> dict:
    drop_file_cache(layer_files(data))
    sbs = []
    try:
        t0 = time.monotonic()
        guest, task_s = [], []
        boot_task_cpu = []
        for _ in range(n):
            old = set(qemu_pids(data))
            sb = c.run_microvm(run_args(task, memory_mb), timeout=900)
            sbs.append(sb)
            before = guest_stats(sb)
            t1 = time.monotonic()
            run_task(sb, task)
            task_s.append(time.monotonic() - t1)
            # CPU time of this VM's QEMU for its boot and the task (under TCG: translating
            # and running guest code), before it idles.
            boot_task_cpu += [cpu_seconds(p) for p in set(qemu_pids(data)) - old]
            g = guest_stats(sb)
            g["task_layer_read"] = g["layer_read"] - before["layer_read"]
            guest.append(g)
        elapsed = time.monotonic() - t0
        time.sleep(3)
        pids = qemu_pids(data)
        assert len(pids) == n, pids
        rolls = [rollup(p) for p in pids]
        anon = sum(r.get("Pss_Anon", 0) + r.get("Pss_Shmem", 0) for r in rolls)
        pss_file = sum(r.get("Pss_File", 0) for r in rolls)
        files = [f for f in layer_files(data) if not str(f).startswith(str(PMEM_DIR))]
        cache_layers = cached_bytes([f for f in files if f.suffix != ".img"] + sorted(pmem_copies(pids)))
        cache_disks = cached_bytes([f for f in files if f.suffix == ".img"])
        avg = lambda k: sum(g.get(k, 0) for g in guest) / n  # noqa: E731
        res = {"vms": n, "anon_shmem": anon, "pss_file": pss_file, "page_cache": cache_layers + cache_disks,
               "cache_layers": cache_layers, "cache_disks": cache_disks,
               "total": anon + cache_layers + cache_disks, "rss_sum": sum(rss(p) for p in pids),
               "create_and_task_s": elapsed, "task_s": sum(task_s) / n,
               "qemu_cpu_s": sum(cpu_seconds(p) for p in pids) / n,
               "boot_task_cpu_s": sum(boot_task_cpu) / max(len(boot_task_cpu), 1),
               "tb_cache": sum(tb_cache(p) for p in pids), "pmem_mapped": pmem_mapped(pids),
               "guest_used": avg("MemTotal") - avg("MemFree"), "guest_cached": avg("Cached"),
               "layer_read": avg("layer_read"), "task_layer_read": avg("task_layer_read"),
               "loadavg": os.getloadavg()}
        # B: per-VM host memory that is not layer data; L: layer data per guest (its own copy
        # with virtio-blk; with DAX the guest holds none, the host's shared copy is cache_layers).
        res["L"] = res["layer_read"]
        res["B"] = anon / n - res["L"]
        return res
    finally:
        for sb in sbs:
            try:
                sb.stop()
            except Exception as e:  # noqa: BLE001 - a stop failure must not hide the figures
                print(f"stop {sb}: {e}", file=sys.stderr)


def density(pmem: bool, tasks: list[str], n: int, memory_mb: int) -> dict:
    up, data = start_node(pmem, True, "vmmem-pmem" if pmem else "vmmem-blk", toolkit="scipy" in tasks)
    try:
        with up.client() as c:
            # Warm-up VMs: the padded virtio-pmem copies of the layers are made once per layer
            # (this copy reads the whole blob); the figures are for VMs after that.
            for task in tasks:
                c.run_microvm(run_args(task, memory_mb), timeout=900).stop()
            return {task: density_task(c, data, task, n, memory_mb) for task in tasks}
    finally:
        up.stop()
        remove_data_dir(data)


def free_page_reporting(balloon: bool) -> dict:
    up, data = start_node(True, balloon, "vmmem-fpr" if balloon else "vmmem-nofpr")
    try:
        with up.client() as c:
            sb = c.run_microvm(DSecMicroVMRunArgs(container_image="debian", memory_limit_mb=512), timeout=600)
            sb.run_shell(LIGHT, timeout=600)
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


def mb(x: float) -> str:
    return f"{x / 1e6:.0f}"


def report(name: str, r: dict) -> None:
    la = " ".join(f"{x:.2f}" for x in r["loadavg"])
    print(f"{name:>18}: total {mb(r['total'])} MB = QEMU anon+shmem PSS {mb(r['anon_shmem'])} MB "
          f"+ layer page cache {mb(r['cache_layers'])} MB + VM disk page cache {mb(r['cache_disks'])} MB "
          f"(QEMU file PSS {mb(r['pss_file'])} MB, RSS sum {mb(r['rss_sum'])} MB, of which TCG translation cache "
          f"{mb(r['tb_cache'])} MB; layer pages mapped through DAX {mb(r['pmem_mapped'])} MB)", flush=True)
    print(f"{'':>18}  per guest: used {mb(r['guest_used'])} MB, page cache {mb(r['guest_cached'])} MB, "
          f"read from layer disks {mb(r['layer_read'])} MB (task alone {mb(r['task_layer_read'])} MB); "
          f"per VM: B {mb(r['B'])} MB, L {mb(r['L'])} MB; QEMU CPU for boot+task {r['boot_task_cpu_s']:.1f} s/VM "
          f"(at the end {r['qemu_cpu_s']:.0f} s/VM), "
          f"task {r['task_s']:.1f} s/VM, create+task {r['create_and_task_s']:.0f} s; load average {la}", flush=True)
    r["total_ex_tb"] = r["total"] - r["tb_cache"]
    print(f"{'':>18}  without the TCG translation cache (absent under KVM): {mb(r['total_ex_tb'])} MB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--vms", type=int, default=8)
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--task", choices=["light", "scipy", "both"], default="both")
    ap.add_argument("--layers", choices=["blk", "pmem", "both"], default="both")
    ap.add_argument("--tb-mb", type=int, default=None,
                    help="TCG translation cache per VM in MiB (DSEC_MICROVM_TCG_TB_MB; 0: QEMU's default "
                         "of 1 GiB); default: the runtime's")
    ap.add_argument("--data-root", help="directory for the nodes' data dirs (default /var/tmp)")
    ap.add_argument("--skip-density", action="store_true")
    ap.add_argument("--skip-fpr", action="store_true", help="skip the free page reporting figure")
    args = ap.parse_args()
    if args.data_root:
        DATA_ROOT.append(args.data_root)
    if args.tb_mb is not None:
        os.environ["DSEC_MICROVM_TCG_TB_MB"] = str(args.tb_mb)
    accel = os.environ.get("DSEC_MICROVM_ACCEL", "tcg")
    tb = os.environ.get("DSEC_MICROVM_TCG_TB_MB", "runtime default")
    env = " ".join(f"{k}={os.environ[k]}" for k in ("DSEC_GUEST_DIR", "DSEC_QEMU", "DSEC_MICROVM_ACCEL")
                   if os.environ.get(k))
    cmd = (env + " " if env else "") + "python3 bench/microvm_memory.py " + " ".join(sys.argv[1:])
    print(f"reproduce: {cmd}")
    ra = {}
    for d in (PMEM_DIR, Path(args.data_root or "/var/tmp")):
        try:
            dev = os.stat(d if d.exists() else d.parent).st_dev
            ra[str(d)] = Path(f"/sys/dev/block/{os.major(dev)}:{os.minor(dev)}/queue/read_ahead_kb").read_text().strip()
        except OSError:
            ra[str(d)] = "?"
    print(f"host read-ahead (KiB) of the filesystems holding the pmem copies and the layer files: {ra}")
    print(f"accelerator: {accel} (translation cache MiB: {tb}); {args.vms} microVMs x {args.memory_mb} MB; "
          f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    tasks = ["light", "scipy"] if args.task == "both" else [args.task]
    if "scipy" in tasks and not build_toolkit():
        tasks.remove("scipy")
    for t in tasks:
        print(f"task {t}: {TASKS[t]['describe']}", flush=True)
    layers = {"blk": [False], "pmem": [True], "both": [False, True]}[args.layers]
    if not args.skip_density and tasks:
        n_vms = args.vms
        rows = {pmem: density(pmem, tasks, n_vms, args.memory_mb) for pmem in layers}
        for task in tasks:
            print(f"--- task {task}", flush=True)
            for pmem in layers:
                report("virtio-pmem + DAX" if pmem else "virtio-blk", rows[pmem][task])
        if len(layers) == 2:
            saving = {}
            for task in tasks:
                a, b = rows[False][task], rows[True][task]
                saving[task] = 100 * (b["total"] - a["total"]) / a["total"]
                ex = 100 * (b["total_ex_tb"] - a["total_ex_tb"]) / a["total_ex_tb"]
                print(f"task {task}: pmem/DAX vs blk: {saving[task]:+.1f}% host memory "
                      f"({mb(a['total'])} -> {mb(b['total'])} MB); without the TCG translation cache: {ex:+.1f}%; "
                      f"L/B (blk) = {a['L'] / a['B']:.2f}", flush=True)
            if len(tasks) == 2:
                saved = {t: (rows[False][t]["total"] - rows[True][t]["total"]) / n_vms for t in tasks}
                ratio = f"; ratio scipy/light {saved['scipy'] / saved['light']:.1f}x" if saved["light"] > 1e6 else ""
                print(f"saved by pmem/DAX per VM: light {mb(saved['light'])} MB, scipy {mb(saved['scipy'])} MB; "
                      f"relative: light {saving['light']:+.1f}%, scipy {saving['scipy']:+.1f}%{ratio}", flush=True)
    if not args.skip_fpr:
        for balloon in (True, False):
            f = free_page_reporting(balloon)
            print(f"free page reporting {'on ' if balloon else 'off'}: QEMU RSS before {mb(f['before'])} MB, "
                  f"after touching 200 MB {mb(f['peak'])} MB, 10 s after freeing {mb(f['after'])} MB", flush=True)
    print(f"reproduce: {cmd}; load average at the end {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)


if __name__ == "__main__":
    main()
