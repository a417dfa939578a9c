"""Benchmark: density and time-integrated memory with cold-memory reclaim off vs on (issue 10).

Each run starts its own `dsec up` (own data dir, port, node id) with `[edge.reclaim]` off, then
on (zram swap tier, cold time --cold-s, cgroup-driven or DAMON mechanism as the edge chooses),
and in each:

1. Density: creates best-effort sandboxes (debian), each with a live shell that started a
   Python process holding 20 MB of touched memory (per 4 KiB page 1 KiB random + 3 KiB text,
   compressible like a heap, not like zeros), until --n sandboxes, --max, or host MemAvailable
   under --floor-gib. After --settle-s (longer than the cold time) it measures the node's
   memory: the sandboxes' parent memory cgroup usage + the zram device's memory
   (`mm_stat` mem_used_total; compressed pages live outside the cgroups) + the `dsec up`
   process's RSS. Per-sandbox cost = node memory / sandboxes; the most sandboxes the machine
   holds = (MemAvailable at start − floor) / per-sandbox cost (extrapolated when --n is smaller
   than that; the output says so).
2. Mixed workload: --mixed-n sandboxes like the above, --mixed-active of them active (every 2 s
   a shell request makes the Python process read all its data), the rest idle; node memory is
   sampled every second for --mixed-s seconds from the first create and integrated (GiB·s).

    python3 bench/density_reclaim.py [--n 300] [--mixed-n 40] [--mixed-active 10] [--mixed-s 120]

Needs root, the release `dsec` (DSEC_BIN, default target/release/dsec) and the debian image
tarball. Prints per-mode figures, ratios and medians; writes bench/results/density_reclaim.json.
"""

import argparse
import asyncio
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from common import DEBIAN_TAR, WORK, write_results  # noqa: E402
from dsec import DSecClient  # noqa: E402
from dsec.errors import NodeFull  # noqa: E402

HOLDER = r"""
import hashlib, os, sys, time
data = bytearray(int(sys.argv[1]) << 20)
text = (b"agent state line %d\n" * 200)[:3072]
for off in range(0, len(data), 4096):
    data[off:off + 1024] = os.urandom(1024)
    data[off + 1024:off + 4096] = (text * 2)[:3072]
open("/tmp/ready", "w").write(str(os.getpid()))
while True:
    time.sleep(0.5)
    if os.path.exists("/tmp/ask"):
        os.remove("/tmp/ask")
        open("/tmp/answer", "w").write(hashlib.sha256(data).hexdigest())
"""

START = "cat > /tmp/h.py <<'EOF'\n" + HOLDER + "\nEOF\nnohup python3 /tmp/h.py 20 >/dev/null 2>&1 &\nwhile [ ! -e /tmp/ready ]; do sleep 0.05; done; cd /tmp && export X=1"


def meminfo_kib(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field)


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


class Node:
    def __init__(self, binary, mode, cold_s, zram_mb):
        self.mode = mode
        self.node_id = f"bdr{mode}{os.getpid() % 10000}"
        self.data = os.path.join(WORK, f"reclaim-{mode}")
        shutil.rmtree(self.data, ignore_errors=True)
        os.makedirs(self.data)
        self.port = free_port()
        cfg = os.path.join(self.data, "dsec.toml")
        with open(cfg, "w") as f:
            f.write(
                "[edge]\nreattach_grace_ms = 0\ncapacity = 6000\nmemory_overcommit = 100.0\n"
                "default_memory_mb = 256\ncpu_overcommit = 1000.0\n\n[edge.reclaim]\n"
                f"enabled = {'true' if mode == 'on' else 'false'}\nzram_mb = {zram_mb}\n"
                f"cold_s = {cold_s}\ninterval_ms = 1000\n"
            )
        env = dict(os.environ, RUST_LOG="info")
        self.log = open(os.path.join(WORK, f"reclaim-{mode}.log"), "wb")
        self.proc = subprocess.Popen(
            [binary, "up", "--data-dir", self.data, "--listen", f"127.0.0.1:{self.port}",
             "--node-id", self.node_id, "--config", cfg],
            stdout=subprocess.PIPE, stderr=self.log, env=env, start_new_session=True,
        )
        self.url = self.key = None
        for raw in self.proc.stdout:
            line = raw.decode().strip()
            if line.startswith("DSEC_API_URL="):
                self.url = line.split("=", 1)[1]
            elif line.startswith("DSEC_API_KEY="):
                self.key = line.split("=", 1)[1]
            if self.url and self.key:
                break
        if not (self.url and self.key):
            raise SystemExit(f"dsec up ({mode}) did not start; see {self.log.name}")
        env = dict(os.environ, DSEC_API_URL=self.url, DSEC_API_KEY=self.key)
        subprocess.run([binary, "image", "import", "debian", "--tar", DEBIAN_TAR], env=env, check=True,
                       capture_output=True, timeout=900)
        if os.path.isdir("/sys/fs/cgroup/memory"):
            self.parent = f"/sys/fs/cgroup/memory/dsec/{self.node_id}"
        else:
            self.parent = f"/sys/fs/cgroup/dsec/{self.node_id}"

    def zram_bytes(self):
        try:
            dev = json.load(open(os.path.join(self.data, "edge", "reclaim", "zram.json")))["device"]
            return int(open(f"/sys/block/zram{dev}/mm_stat").read().split()[2])
        except (OSError, ValueError, KeyError, IndexError):
            return 0

    def cgroup_bytes(self):
        for f in ("memory.usage_in_bytes", "memory.current"):
            try:
                return int(open(os.path.join(self.parent, f)).read())
            except OSError:
                continue
        return 0

    def rss_bytes(self):
        with open(f"/proc/{self.proc.pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        return 0

    def memory(self):
        """(total, cgroup, zram, edge rss) in bytes."""
        c, z, r = self.cgroup_bytes(), self.zram_bytes(), self.rss_bytes()
        return c + z + r, c, z, r

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=600)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()
        shutil.rmtree(self.data, ignore_errors=True)


async def make(c, sem):
    async with sem:
        # Admission counts measured CPU: creating Python processes on a busy 2-core machine can
        # briefly fill it (node_full); wait and retry.
        for attempt in range(120):
            try:
                sb = await c.run_container({"image": "debian", "qos": "best_effort", "memory_limit_mb": 256})
                break
            except NodeFull:
                if attempt == 119:
                    raise
                await asyncio.sleep(1.0)
        r = await sb.run_shell(START, timeout=120)
        if r.exit_code != 0:
            raise RuntimeError(f"holder did not start: {r.stderr[-500:]}")
        return sb


async def stop_all(sbs):
    sem = asyncio.Semaphore(16)

    async def one(sb):
        async with sem:
            try:
                await sb.stop()
            except Exception:  # noqa: BLE001 - best effort at the end of a run
                pass

    await asyncio.gather(*(one(sb) for sb in sbs))


async def density(node, a):
    c = DSecClient(api_url=node.url, api_key=node.key, timeout=300)
    avail0 = meminfo_kib("MemAvailable") * 1024
    floor = int(a.floor_gib * (1 << 30))
    sem = asyncio.Semaphore(a.concurrency)
    sbs = []
    t0 = time.monotonic()
    stopped_by = f"--n {a.n}"
    while len(sbs) < min(a.n, a.max):
        if meminfo_kib("MemAvailable") * 1024 < floor:
            stopped_by = f"host MemAvailable under {a.floor_gib} GiB"
            break
        # With reclaim on, do not run ahead of it: creating is faster than reclaiming (~4/s here),
        # and an un-reclaimed backlog of 20 MB sandboxes would eat the machine meanwhile.
        while node.mode == "on" and node.cgroup_bytes() > len(sbs) * (2 << 20) + int(a.backlog_gib * (1 << 30)):
            await asyncio.sleep(1.0)
        batch = min(a.concurrency * 2, min(a.n, a.max) - len(sbs))
        sbs += await asyncio.gather(*(make(c, sem) for _ in range(batch)))
    create_s = time.monotonic() - t0
    await asyncio.sleep(a.settle_s)
    # Let reclaim finish the backlog: until node memory stops falling (at most 10 min).
    if node.mode == "on":
        last = node.memory()[0]
        for _ in range(60):
            await asyncio.sleep(10)
            now = node.memory()[0]
            if now > last * 0.99:
                break
            last = now
    total, cg, z, rss = node.memory()
    avail1 = meminfo_kib("MemAvailable") * 1024
    n = len(sbs)
    per = total / n
    out = {
        "mode": node.mode, "sandboxes": n, "stopped_by": stopped_by, "create_s": round(create_s, 1),
        "node_bytes": total, "cgroup_bytes": cg, "zram_bytes": z, "edge_rss_bytes": rss,
        "per_sandbox_mib": round(per / (1 << 20), 2),
        "memavailable_delta_per_sandbox_mib": round((avail0 - avail1) / n / (1 << 20), 2),
        "most_sandboxes": int(max(0, avail0 - floor) / per) + 0,
        "extrapolated": n < a.max and stopped_by.startswith("--n"),
    }
    # Samples per sandbox: cgroup usage, for medians.
    per_sb = []
    for sb in sbs:
        for f in ("memory.usage_in_bytes", "memory.current"):
            try:
                per_sb.append(int(open(os.path.join(node.parent, sb.id, f)).read()))
                break
            except OSError:
                continue
    out["median_sandbox_cgroup_mib"] = round(statistics.median(per_sb) / (1 << 20), 2) if per_sb else None
    await stop_all(sbs)
    await c.close()
    return out


async def mixed(node, a):
    c = DSecClient(api_url=node.url, api_key=node.key, timeout=300)
    base = node.memory()[0]
    samples = []
    stop = asyncio.Event()

    async def sampler():
        while not stop.is_set():
            samples.append(node.memory()[0] - base)
            try:
                await asyncio.wait_for(stop.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    t0 = time.monotonic()
    task = asyncio.create_task(sampler())
    sem = asyncio.Semaphore(a.concurrency)
    sbs = await asyncio.gather(*(make(c, sem) for _ in range(a.mixed_n)))
    active = sbs[: a.mixed_active]
    lat = []

    async def drive(sb):
        while time.monotonic() - t0 < a.mixed_s:
            s = time.monotonic()
            await sb.run_shell("rm -f /tmp/answer; touch /tmp/ask; while [ ! -e /tmp/answer ]; do sleep 0.05; done")
            lat.append((time.monotonic() - s) * 1000)
            await asyncio.sleep(2.0)

    await asyncio.gather(*(drive(sb) for sb in active))
    stop.set()
    await task
    await stop_all(sbs)
    await c.close()
    integral = sum(max(0, s) for s in samples)  # 1 s samples: byte·s
    return {
        "mode": node.mode, "sandboxes": a.mixed_n, "active": a.mixed_active, "seconds": len(samples),
        "integrated_gib_s": round(integral / (1 << 30), 2),
        "median_node_mib": round(statistics.median(samples) / (1 << 20), 1),
        "peak_node_mib": round(max(samples) / (1 << 20), 1),
        "active_request_p50_ms": round(statistics.median(lat), 1) if lat else None,
        "active_request_p99_ms": round(sorted(lat)[max(0, int(len(lat) * 0.99) - 1)], 1) if lat else None,
    }


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=300)
    ap.add_argument("--max", type=int, default=5000)
    ap.add_argument("--floor-gib", type=float, default=3.0)
    ap.add_argument("--backlog-gib", type=float, default=1.5, help="reclaim on: most un-reclaimed memory before creating more")
    ap.add_argument("--concurrency", type=int, default=6)
    ap.add_argument("--cold-s", type=int, default=10)
    ap.add_argument("--settle-s", type=int, default=30)
    ap.add_argument("--zram-mb", type=int, default=8192)
    ap.add_argument("--mixed-n", type=int, default=40, help="0 skips the mixed workload")
    ap.add_argument("--mixed-active", type=int, default=10)
    ap.add_argument("--mixed-s", type=int, default=120)
    ap.add_argument("--modes", default="off,on")
    a = ap.parse_args()
    binary = os.environ.get("DSEC_BIN", os.path.join(os.path.dirname(__file__), "..", "target", "release", "dsec"))
    os.makedirs(WORK, exist_ok=True)
    results = {"args": vars(a), "density": [], "mixed": []}
    for mode in a.modes.split(","):
        node = Node(binary, mode, a.cold_s, a.zram_mb)
        try:
            d = await density(node, a)
            print(json.dumps(d), flush=True)
            results["density"].append(d)
            if a.mixed_n > 0:
                m = await mixed(node, a)
                print(json.dumps(m), flush=True)
                results["mixed"].append(m)
        finally:
            node.stop()
    dens = {d["mode"]: d for d in results["density"]}
    mix = {m["mode"]: m for m in results["mixed"]}
    print()
    print(f"{'mode':6} {'sandboxes':>9} {'MiB/sandbox':>12} {'median cg MiB':>14} {'most sandboxes':>15} {'mixed GiB*s':>12} {'median MiB':>11}")
    for mode in dens:
        d, m = dens[mode], mix.get(mode, {})
        most = f"{d['most_sandboxes']}{'*' if d['extrapolated'] else ''}"
        print(f"{mode:6} {d['sandboxes']:>9} {d['per_sandbox_mib']:>12} {str(d['median_sandbox_cgroup_mib']):>14} {most:>15} "
              f"{m.get('integrated_gib_s', ''):>12} {m.get('median_node_mib', ''):>11}")
    if "off" in dens and "on" in dens:
        r = dens["on"]["per_sandbox_mib"] / dens["off"]["per_sandbox_mib"]
        print(f"per-sandbox memory on/off: {r:.3f} ({(1 - r) * 100:.1f}% less)")
        if "off" in mix and "on" in mix and mix["off"]["integrated_gib_s"] > 0:
            ri = mix["on"]["integrated_gib_s"] / mix["off"]["integrated_gib_s"]
            print(f"mixed integrated memory on/off: {ri:.3f} ({(1 - ri) * 100:.1f}% less)")
            results["integrated_ratio"] = ri
        results["per_sandbox_ratio"] = r
    print("* extrapolated from the sandboxes created (limit = (MemAvailable at start - floor) / per-sandbox cost)")
    print("command: python3 bench/density_reclaim.py " + " ".join(sys.argv[1:]))
    write_results("density_reclaim" + ("" if a.modes == "off,on" else "_" + a.modes.replace(",", "_")), results)


if __name__ == "__main__":
    asyncio.run(main())
