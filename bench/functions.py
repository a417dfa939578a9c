"""Benchmark: function calls on warm pools vs. the cold paths, through the HTTP API.

    python3 bench/functions.py [--n 500] [--conc 8] [--cold-n 30] [--toolkit gxx]

Needs a running dsec (DSEC_API_URL / DSEC_API_KEY) with the `debian` image. For C++ it needs a
toolkit layer with g++ (`--toolkit`, default `gxx`): when the node has none of that name, the
bench builds one from the host's g++ packages (tests/helpers.py::gxx_toolkit_tree) and imports
it with `dsec image import` (DSEC_BIN, default target/release/dsec). Cases, in one run:
- warm python `print(sum(range(100)))`: latency (sequential, end to end through the apiserver)
  and sustained calls/s (`--conc` concurrent clients);
- warm python through one batch request (`call_functions`, POST /v1/functions/batch): calls/s
  with the batch's own bounded concurrency, the way a verifier submits a rollout's rewards;
- warm C++ compile-and-run of a small program;
- cold baseline 1: a fresh `bwrap --unshare-all` + `python3 -c` per call (local, no HTTP);
- cold baseline 2: a fresh container sandbox per call via create / run_shell / stop (HTTP).
Each cold baseline reports serial latency and calls/s with `--conc` at once, like the warm case.

With `--dsec-pid PID --node-id ID` (the `dsec up` process on this machine, its node id; run no
other sandboxes on that node meanwhile) the warm python runs also report
CPU time per call, split into the client (this process), dsec (apiserver + edge) and the
workers (every process of the function workers' pids cgroups, with their reaped children):
less sensitive to other load than wall time.
"""

import argparse
import asyncio
import glob
import os
import resource
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import sys
import tempfile

from common import bwrap_python_once, debian_rootfs, print_table, summary, write_results
from dsec import DSecClient, DSecContainerRunArgs

PY = "print(sum(range(100)))"
CPP = "#include <iostream>\nint main(){long s=0;for(int i=0;i<100;i++)s+=i;std::cout<<s<<std::endl;}"


TCK = os.sysconf("SC_CLK_TCK")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


async def ensure_toolkit(c, name: str) -> None:
    """Imports the g++ toolkit layer `name` when the node does not have it yet."""
    if any(i.name.split(":")[0] == name for i in await c.list_images()):
        return
    sys.path.insert(0, os.path.join(REPO, "tests"))
    from helpers import gxx_toolkit_tree

    root = tempfile.mkdtemp(prefix="bench-gxx-")
    try:
        why = gxx_toolkit_tree(root)
        if why:
            raise RuntimeError(why)
        dsec_bin = os.environ.get("DSEC_BIN", os.path.join(REPO, "target", "release", "dsec"))
        print(f"importing the g++ toolkit layer as {name} ...", flush=True)
        subprocess.run([dsec_bin, "image", "import", name, "--dir", root], check=True,
                       stdout=subprocess.DEVNULL)
    finally:
        shutil.rmtree(root, ignore_errors=True)


def _proc_cpu(stat_path, children=False):
    try:
        f = open(stat_path).read().rsplit(")", 1)[1].split()
    except OSError:
        return 0
    return sum(int(v) for v in f[11:15 if children else 13])


def cpu_now(dsec_pid, node_id):
    """(client, dsec, workers) CPU seconds so far."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    dsec = _proc_cpu(f"/proc/{dsec_pid}/stat")  # the whole process, exited threads included
    workers = 0
    for procs in glob.glob(f"/sys/fs/cgroup/pids/dsec/{node_id}/**/cgroup.procs", recursive=True):
        for pid in open(procs).read().split():
            workers += _proc_cpu(f"/proc/{pid}/stat", children=True)
    return r.ru_utime + r.ru_stime, dsec / TCK, workers / TCK


def cpu_per_call(before, after, n):
    return {k: round((b - a) / n * 1000, 3) for k, a, b in zip(("client", "dsec", "workers"), before, after)}


async def latency(c, n, keep=None, **body):
    out = []
    for _ in range(n):
        t = time.perf_counter()
        r = await c.call_function(**body)
        out.append((time.perf_counter() - t) * 1000)
        assert r.status == "ok" and r.stdout.strip() == "4950", r
        if keep is not None:
            keep.append(r)
    return out


async def throughput(c, n, conc, **body):
    todo = n
    lat = []

    async def worker():
        nonlocal todo
        while todo > 0:
            todo -= 1
            t = time.perf_counter()
            r = await c.call_function(**body)
            lat.append((time.perf_counter() - t) * 1000)
            assert r.status == "ok", r
    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(conc)])
    return n / (time.perf_counter() - t0), lat


def bwrap_cold(n, conc):
    """Serial latencies, then calls/s with `conc` at once (the fair throughput baseline)."""
    root = debian_rootfs()
    if shutil.which("bwrap") is None or root is None:
        return None, None
    lat = [bwrap_python_once(root, PY) for _ in range(n)]
    m = max(n, conc * 10)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(conc) as ex:
        list(ex.map(lambda _: bwrap_python_once(root, PY), range(m)))
    return lat, m / (time.perf_counter() - t0)


async def _container_once(c):
    t = time.perf_counter()
    sb = await c.run_container(DSecContainerRunArgs(container_image="debian"), timeout=120)
    try:
        r = await sb.run_shell(f"python3 -c '{PY}'")
    finally:
        await sb.stop()
    assert r.stdout.strip() == "4950", r
    return (time.perf_counter() - t) * 1000


async def container_cold(c, n, conc):
    """Serial latencies, then calls/s with `conc` sandboxes created at once."""
    lat = [await _container_once(c) for _ in range(n)]
    m = max(n, conc * 3)
    sem = asyncio.Semaphore(conc)

    async def one():
        async with sem:
            await _container_once(c)
    t0 = time.perf_counter()
    await asyncio.gather(*[one() for _ in range(m)])
    return lat, m / (time.perf_counter() - t0)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--conc", type=int, default=8)
    ap.add_argument("--cold-n", type=int, default=30)
    ap.add_argument("--toolkit", default="gxx")
    ap.add_argument("--dsec-pid", type=int, default=0, help="report CPU per call (see above)")
    ap.add_argument("--node-id", default="", help="with --dsec-pid: the node id of that dsec up")
    a = ap.parse_args()
    async with DSecClient() as c:
        await latency(c, 20, language="python", code=PY)  # warm the pool
        # ... and grow it to max_workers, as a batch workload leaves it (pools shrink only after
        # idle_shrink_s): a sequential caller then gets an idle worker while the one it used
        # last is still cleaning up after its answer.
        await throughput(c, a.conc * 10, a.conc, language="python", code=PY)
        rows, data = [], {}
        warm_res = []
        cpu0 = cpu_now(a.dsec_pid, a.node_id) if a.dsec_pid else None
        warm = await latency(c, a.n, language="python", code=PY, keep=warm_res)
        if cpu0:
            data["cpu_ms_per_call_sequential"] = cpu_per_call(cpu0, cpu_now(a.dsec_pid, a.node_id), a.n)
        rows.append(summary("warm python, sequential (HTTP end to end)", warm))
        # where the time goes: the run in the worker (wall_ms: from handing the run to its
        # (pre-forked) child to reaping it), and the HTTP round trip alone
        rows.append(summary("  of which: the run in the worker", [r.wall_ms for r in warm_res]))
        floor = []
        for _ in range(a.n):
            t = time.perf_counter()
            await c.function_pools()
            floor.append((time.perf_counter() - t) * 1000)
        rows.append(summary("  HTTP floor: GET /v1/functions/pools", floor))
        cpu0 = cpu_now(a.dsec_pid, a.node_id) if a.dsec_pid else None
        rate, lat = await throughput(c, a.n * 4, a.conc, language="python", code=PY)
        if cpu0:
            data["cpu_ms_per_call_concurrent"] = cpu_per_call(cpu0, cpu_now(a.dsec_pid, a.node_id), a.n * 4)
        rows.append(summary(f"warm python, {a.conc} concurrent", lat))
        data["warm_python_calls_per_s"] = round(rate, 1)
        batch_rate = None
        for bc in sorted({2, a.conc // 2 or 1, a.conc}):
            calls = [{"language": "python", "code": PY} for _ in range(a.n * 4)]
            t0 = time.perf_counter()
            res = await c.call_functions(calls, concurrency=bc)
            r_ = len(calls) / (time.perf_counter() - t0)
            bad = [x for x in res if getattr(x, "status", None) != "ok" or x.stdout.strip() != "4950"]
            assert not bad, bad[:3]
            data[f"warm_python_batch_calls_per_s_conc{bc}"] = round(r_, 1)
            batch_rate = max(batch_rate or 0.0, r_)
        data["warm_python_batch_calls_per_s"] = round(batch_rate, 1)
        cpp = None
        try:
            await ensure_toolkit(c, a.toolkit)
            await c.call_function("cpp", CPP, toolkits=[a.toolkit])
            cpp = await latency(c, max(a.n // 10, 20), language="cpp", code=CPP, toolkits=[a.toolkit])
            rows.append(summary("warm C++ compile+run, sequential", cpp))
            crate, _ = await throughput(c, max(a.n // 5, 40), a.conc, language="cpp", code=CPP, toolkits=[a.toolkit])
            data["warm_cpp_calls_per_s"] = round(crate, 1)
        except Exception as e:  # noqa: BLE001 - report and go on
            print(f"C++ case skipped: {e}")
        bw, bw_rate = bwrap_cold(a.cold_n, a.conc)
        if bw:
            rows.append(summary("cold: bwrap --unshare-all + python3 -c", bw))
            data["cold_bwrap_calls_per_s"] = round(bw_rate, 1)
        cc, cc_rate = await container_cold(c, max(a.cold_n // 3, 5), a.conc)
        rows.append(summary("cold: fresh container sandbox per call", cc))
        data["cold_container_calls_per_s"] = round(cc_rate, 1)
        print_table(rows, ref=rows[0])
        for k, v in data.items():
            print(f"{k}: {v}")
        if bw:
            print(f"warm/cold(bwrap) throughput: {rate / bw_rate:.1f}x (both {a.conc} concurrent)")
            print(f"warm batch/cold(bwrap) throughput: {batch_rate / bw_rate:.1f}x")
        print(f"warm/cold(container) throughput: {rate / cc_rate:.1f}x (both {a.conc} concurrent)")
        print("reproduce: python3 bench/functions.py " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in (("n", a.n), ("conc", a.conc), ("cold_n", a.cold_n))))
        write_results("functions", {"rows": rows, **data})


if __name__ == "__main__":
    asyncio.run(main())
