"""Benchmark: create -> first run_shell result -> stop, through the Python SDK.

Baselines in the same run: `runc run` and `bwrap --unshare-all` of /bin/true on the same
debian root. Then the sustained rate of create + `true` + stop with several in flight.

    python3 bench/lifecycle.py [--n 200] [--image debian] [--concurrency 8] [--rate-n 600]
                               [--dsec-pid PID]

Needs a running dsec (DSEC_API_URL / DSEC_API_KEY) and scripts/images/build-debian.sh's tarball.
With --dsec-pid (the `dsec up` process), the sustained run also prints its CPU time per sandbox:
its own (apiserver, edge, runtime threads) and that of the children it reaped (aether and the
sandbox processes aether reaped), from /proc/PID/stat; the SDK client's own CPU comes from
getrusage. CPU time, unlike the rate, holds up on a machine that other work shares.
"""

import argparse
import asyncio
import os
import resource
import subprocess
import time

from common import print_table, runc_bundle, debian_rootfs, summary, write_results
from dsec import DSecClient, DSecContainerRunArgs


async def dsec_cycles(client, image, n):
    create_ms, first_ms, cycle_ms, shell_ms, stop_ms = [], [], [], [], []
    for _ in range(n):
        t0 = time.perf_counter()
        sb = await client.run_container(DSecContainerRunArgs(container_image=image))
        t1 = time.perf_counter()
        r = await sb.run_shell("true")
        assert r.exit_code == 0, r
        t2 = time.perf_counter()
        await sb.stop()
        t3 = time.perf_counter()
        create_ms.append((t1 - t0) * 1e3)
        first_ms.append((t2 - t0) * 1e3)
        cycle_ms.append((t3 - t0) * 1e3)
        shell_ms.append((t2 - t1) * 1e3)
        stop_ms.append((t3 - t2) * 1e3)
    return create_ms, first_ms, cycle_ms, shell_ms, stop_ms


def proc_cpu_s(pid):
    """(own, reaped children's) CPU seconds of process `pid` (utime+stime, cutime+cstime)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    hz = os.sysconf("SC_CLK_TCK")
    utime, stime, cutime, cstime = (int(x) / hz for x in fields[11:15])
    return utime + stime, cutime + cstime


def own_cpu_s():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


async def dsec_rate(client, image, total, concurrency):
    sem = asyncio.Semaphore(concurrency)
    lat = []

    async def one():
        async with sem:
            t0 = time.perf_counter()
            sb = await client.run_container(DSecContainerRunArgs(container_image=image))
            r = await sb.run_shell("true")
            assert r.exit_code == 0, r
            await sb.stop()
            lat.append((time.perf_counter() - t0) * 1e3)

    t0 = time.perf_counter()
    await asyncio.gather(*(one() for _ in range(total)))
    return total / (time.perf_counter() - t0), lat


def timed(cmd, n):
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def rate_of(cmd, total, concurrency):
    t0 = time.perf_counter()
    running = []
    done = 0
    while done < total:
        while len(running) < concurrency and done + len(running) < total:
            running.append(subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        running.pop(0).wait()
        done += 1
    return total / (time.perf_counter() - t0)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--image", default="debian")
    ap.add_argument("--concurrency", type=int, default=8)
    ap.add_argument("--rate-n", type=int, default=600)
    ap.add_argument("--dsec-pid", type=int, default=None,
                    help="pid of `dsec up`: print its CPU time per sandbox in the sustained run")
    a = ap.parse_args()

    root = debian_rootfs()
    bundle = runc_bundle(["/bin/true"])
    runc = ["runc", "run", "--bundle", bundle, "dsec-bench-runc"]
    bwrap = ["bwrap", "--unshare-all", "--ro-bind", root, "/", "--proc", "/proc", "--dev", "/dev", "/bin/true"]

    load0 = os.getloadavg()
    client = DSecClient()
    await client.open()
    try:
        await dsec_cycles(client, a.image, 10)  # warm the layer mount and page cache
        create_ms, first_ms, cycle_ms, shell_ms, stop_ms = await dsec_cycles(client, a.image, a.n)
        runc_ms = timed(runc, a.n)
        bwrap_ms = timed(bwrap, a.n)
        rows = [summary("runc run /bin/true", runc_ms),
                summary("bwrap --unshare-all /bin/true", bwrap_ms),
                summary("dsec create (to ready)", create_ms),
                summary("dsec create -> first run_shell result", first_ms),
                summary("dsec create -> run_shell -> stop", cycle_ms),
                summary("  phase: first run_shell(true)", shell_ms),
                summary("  phase: stop", stop_ms)]
        print(f"\n== single cycles, {a.n} each, image {a.image} ==")
        print_table(rows, ref=rows[0])
        cpu0 = proc_cpu_s(a.dsec_pid) if a.dsec_pid else None
        py0 = own_cpu_s()
        rate, lat = await dsec_rate(client, a.image, a.rate_n, a.concurrency)
        py1 = own_cpu_s()
        cpu = None
        if cpu0:
            cpu1 = proc_cpu_s(a.dsec_pid)
            cpu = {"dsec_up_ms": (cpu1[0] - cpu0[0]) * 1e3 / a.rate_n,
                   "reaped_children_ms": (cpu1[1] - cpu0[1]) * 1e3 / a.rate_n,
                   "sdk_client_ms": (py1 - py0) * 1e3 / a.rate_n}
        bwrap_rate = rate_of(bwrap, a.rate_n, a.concurrency)
        print(f"\n== sustained create + true + stop, {a.rate_n} sandboxes, {a.concurrency} in flight ==")
        print(f"dsec : {rate:8.1f} sandboxes/s  (cycle p50 {summary('x', lat)['p50_ms']:.2f} ms, "
              f"p99 {summary('x', lat)['p99_ms']:.2f} ms)")
        print(f"bwrap: {bwrap_rate:8.1f} runs/s of /bin/true")
        if cpu:
            print(f"CPU per sandbox: dsec up {cpu['dsec_up_ms']:.2f} ms, its reaped children (aether, "
                  f"sandbox processes) {cpu['reaped_children_ms']:.2f} ms, SDK client {cpu['sdk_client_ms']:.2f} ms")
        print(f"\nratio dsec whole cycle p50 / runc p50 = {rows[4]['p50_ms'] / rows[0]['p50_ms']:.2f}")
        load1 = os.getloadavg()
        print("load average (1/5/15 min): at start %.2f %.2f %.2f, at end %.2f %.2f %.2f"
              % (*load0, *load1))
        print("reproduce: python3 bench/lifecycle.py --n %d --image %s --concurrency %d --rate-n %d%s"
              % (a.n, a.image, a.concurrency, a.rate_n,
                 " --dsec-pid PID" if a.dsec_pid else ""))
        write_results("lifecycle", {"rows": rows, "rate_per_s": rate, "bwrap_rate_per_s": bwrap_rate,
                                    "rate_cycle": summary("rate", lat), "rate_cpu": cpu, "args": vars(a),
                                    "loadavg_start": load0, "loadavg_end": load1})
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
