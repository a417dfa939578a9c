"""Benchmark: pause/resume of idle sandboxes, memory released by a pause, job-level (label)
pause/resume of all of them.

    python3 bench/pause.py [--n 200] [--image busybox] [--mem-n 5]

Needs a running dsec (DSEC_API_URL / DSEC_API_KEY), as root (the baseline freezes a cgroup of
its own). Measures, over N idle sandboxes:
- pause and resume latency through the API (client wall time, one at a time), and the edge's
  own pause time (freeze + reclaim, `last_pause.pause_ms`);
- baseline in the same run: freezing and thawing a bare v1/v2 cgroup holding one sleeping
  process by writing the freezer file directly (the kernel's floor);
- memory released per paused sandbox (bytes and %) for sandboxes holding page cache (a 64 MiB
  file read back), anonymous memory (32 MiB in a shell variable) and both;
- time to pause and to resume all N by label (`POST /v1/jobs/pause|resume`).
"""

import argparse
import asyncio
import os
import subprocess
import time
import uuid

from common import print_table, summary, write_results
from dsec import DSecClient, DSecContainerRunArgs

PAGE_CACHE = "dd if=/dev/zero of=/root/big bs=1M count=64 2>/dev/null; cat /root/big >/dev/null; sync"
ANON = "(x=$(head -c 33554432 /dev/zero | tr '\\0' a); sleep 100000) >/dev/null 2>&1 & sleep 2"


def baseline_freeze(n):
    """Freeze/thaw a plain cgroup with one sleeping process, writing the files directly."""
    v1 = os.path.isdir("/sys/fs/cgroup/freezer")
    name = f"dsec-bench-freeze-{os.getpid()}"
    d = f"/sys/fs/cgroup/freezer/{name}" if v1 else f"/sys/fs/cgroup/{name}"
    os.makedirs(d, exist_ok=True)
    p = subprocess.Popen(["sleep", "1000"])
    freeze_ms, thaw_ms = [], []
    try:
        with open(f"{d}/cgroup.procs", "w") as f:
            f.write(str(p.pid))

        def set_state(frozen):
            if v1:
                want = "FROZEN" if frozen else "THAWED"
                with open(f"{d}/freezer.state", "w") as f:
                    f.write(want)
                while open(f"{d}/freezer.state").read().strip() != want:
                    pass
            else:
                with open(f"{d}/cgroup.freeze", "w") as f:
                    f.write("1" if frozen else "0")
                want = f"frozen {1 if frozen else 0}"
                while want not in open(f"{d}/cgroup.events").read():
                    pass

        for _ in range(n):
            t0 = time.perf_counter()
            set_state(True)
            t1 = time.perf_counter()
            set_state(False)
            t2 = time.perf_counter()
            freeze_ms.append((t1 - t0) * 1e3)
            thaw_ms.append((t2 - t1) * 1e3)
    finally:
        p.kill()
        p.wait()
        time.sleep(0.1)
        os.rmdir(d)
    return freeze_ms, thaw_ms


async def memory_case(client, image, name, setup, n):
    rows = []
    for _ in range(n):
        sb = await client.run_container(DSecContainerRunArgs(container_image=image, memory_limit_mb=256))
        try:
            r = await sb.run_shell(setup, timeout=60)
            assert r.exit_code == 0, r
            rep = (await sb.pause()).last_pause
            rows.append(rep)
            # Still intact after the resume.
            r = await sb.run_shell("echo ok")
            assert r.stdout == "ok\n", r
        finally:
            await sb.stop()
    def avg(k):
        return sum(r[k] for r in rows) / len(rows)
    before, after = avg("memory_before_bytes"), avg("memory_after_bytes")
    cb, ca = avg("page_cache_before_bytes"), avg("page_cache_after_bytes")
    ab, aa = avg("anon_before_bytes"), avg("anon_after_bytes")
    return {
        "case": name,
        "n": n,
        "memory_before_mib": round(before / 2**20, 1),
        "memory_after_mib": round(after / 2**20, 1),
        "released_mib": round((before - after) / 2**20, 1),
        "released_pct": round(100 * (before - after) / before, 1) if before else 0.0,
        "page_cache_before_mib": round(cb / 2**20, 1),
        "page_cache_released_pct": round(100 * (cb - ca) / cb, 1) if cb else 0.0,
        "anon_before_mib": round(ab / 2**20, 1),
        "anon_released_pct": round(100 * (ab - aa) / ab, 1) if ab else 0.0,
        "method": rows[0]["method"],
    }


async def main(a):
    results = {}
    async with DSecClient() as client:
        job = f"bench-{uuid.uuid4().hex[:8]}"
        sem = asyncio.Semaphore(16)

        async def mk():
            async with sem:
                return await client.run_container(
                    DSecContainerRunArgs(container_image=a.image, memory_limit_mb=32, cpu_cores_limit=0.1,
                                         labels={"job": job})
                )

        print(f"creating {a.n} idle {a.image} sandboxes ...")
        sbs = await asyncio.gather(*(mk() for _ in range(a.n)))
        try:
            pause_ms, resume_ms, edge_pause_ms = [], [], []
            for sb in sbs:
                t0 = time.perf_counter()
                info = await sb.pause()
                t1 = time.perf_counter()
                await sb.resume()
                t2 = time.perf_counter()
                pause_ms.append((t1 - t0) * 1e3)
                resume_ms.append((t2 - t1) * 1e3)
                edge_pause_ms.append(info.last_pause["pause_ms"])
            # Transparent resume: first command on a paused sandbox vs on a running one.
            tr_ms, run_ms = [], []
            for sb in sbs[:50]:
                t0 = time.perf_counter()
                await sb.run_shell("true")
                run_ms.append((time.perf_counter() - t0) * 1e3)
                await sb.pause()
                t0 = time.perf_counter()
                await sb.run_shell("true")
                tr_ms.append((time.perf_counter() - t0) * 1e3)
            bf, bt = baseline_freeze(a.n)
            rows = [
                summary("baseline: bare cgroup freeze (kernel)", bf),
                summary("baseline: bare cgroup thaw (kernel)", bt),
                summary("dsec pause via API (client wall)", pause_ms),
                summary("dsec pause inside edge (freeze+reclaim)", edge_pause_ms),
                summary("dsec resume via API (client wall)", resume_ms),
                summary("run_shell(true) on a running sandbox", run_ms),
                summary("run_shell(true) on a paused one (resumes)", tr_ms),
            ]
            print_table(rows)
            results["latency"] = rows

            t0 = time.perf_counter()
            r = await client.pause(labels={"job": job})
            t_pause = time.perf_counter() - t0
            assert r.matched == a.n and r.succeeded == a.n, r
            t0 = time.perf_counter()
            r2 = await client.resume(labels={"job": job})
            t_resume = time.perf_counter() - t0
            assert r2.matched == a.n and r2.succeeded == a.n, r2
            results["by_label"] = {
                "n": a.n,
                "pause_all_s": round(t_pause, 3),
                "resume_all_s": round(t_resume, 3),
                "edge_pause_all_ms": round(r.duration_ms, 1),
                "edge_resume_all_ms": round(r2.duration_ms, 1),
            }
            print(f"pause all {a.n} by label: {t_pause * 1e3:.0f} ms; resume all: {t_resume * 1e3:.0f} ms")
        finally:
            await client.stop(labels={"job": job})

        mem = []
        for name, setup in [
            ("page cache (64 MiB file read)", PAGE_CACHE),
            ("anonymous (32 MiB shell variable)", ANON),
            ("both", PAGE_CACHE + "; " + ANON),
        ]:
            mem.append(await memory_case(client, a.image, name, setup, a.mem_n))
        print(f"{'memory case':36} {'before MiB':>10} {'after MiB':>10} {'released':>9} {'cache rel.':>10} {'anon rel.':>10}")
        for m in mem:
            print(f"{m['case']:36} {m['memory_before_mib']:>10} {m['memory_after_mib']:>10} "
                  f"{m['released_pct']:>8}% {m['page_cache_released_pct']:>9}% {m['anon_released_pct']:>9}%")
        print(f"reclaim method: {mem[0]['method']}")
        results["memory"] = mem
    write_results("pause", results)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--image", default="busybox")
    ap.add_argument("--mem-n", type=int, default=5)
    asyncio.run(main(ap.parse_args()))
