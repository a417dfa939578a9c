"""Benchmark: CPU QoS — step latency of a latency-sensitive sandbox next to CPU loaders.

    python3 bench/qos.py [--steps 300] [--compute-ms 5] [--sleep-ms 20] [--loads 10,30,50]

Needs a running dsec (DSEC_API_URL / DSEC_API_KEY) with the `debian` image (python3).

After the reference's experiment: a latency-sensitive (LS) sandbox runs a fixed step loop like an
interactive agent — a fixed amount of computation (calibrated to ~5 ms when alone), then a 20 ms
wait — and records each step's compute wall time. It runs alone, then next to loader sandboxes
that keep 10%, 30% and 50% of the node busy: one loader per core, each a busy loop bounded by
`cpu_cores_limit` = load (so the loaders together use load x cores). Each load runs twice: with
no QoS (loaders are latency-sensitive too) and with QoS (loaders are `best_effort`: SCHED_IDLE,
lowest cgroup weight, cpu.idle). Reported: median and p99 step compute time, and their inflation
against the alone run. The cases are interleaved: `--rounds` rounds, each running every case
(alone included) for steps/rounds steps in a shuffled order, so that load from other users of
the host spreads over all cases; the machine's load average is printed with the results.
"""

import argparse
import json
import os
import random
import statistics
import time

from common import pct, write_results
from dsec import DSecContainerRunArgs
from dsec.sync import DSecClient

STEP_LOOP = r"""
import json, sys, time
steps, iters, sleep_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
def work(n):
    x = 0
    for i in range(n):
        x += i * i
    return x
work(iters)  # warm up
out = []
for _ in range(steps):
    t0 = time.perf_counter()
    work(iters)
    out.append((time.perf_counter() - t0) * 1000.0)
    time.sleep(sleep_s)
print(json.dumps(out))
"""

CALIBRATE = r"""
import sys, time
def work(n):
    x = 0
    for i in range(n):
        x += i * i
    return x
n = 20000
best = []
for _ in range(30):
    t0 = time.perf_counter(); work(n); best.append(time.perf_counter() - t0)
    time.sleep(0.02)
best.sort()
per = best[len(best) // 2] / n
print(int(float(sys.argv[1]) / 1000.0 / per))
"""


def run_steps(sb, steps, iters, sleep_ms):
    r = sb.run_shell(
        f"cat > /tmp/steps.py <<'EOF'\n{STEP_LOOP}\nEOF\npython3 /tmp/steps.py {steps} {iters} {sleep_ms / 1000.0}",
        timeout=600,
    )
    if r.exit_code != 0:
        raise RuntimeError(f"step loop failed: {r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def stats(values):
    return {"p50_ms": statistics.median(values), "p99_ms": pct(values, 99), "mean_ms": statistics.fmean(values)}


def loadavg():
    with open("/proc/loadavg") as f:
        return " ".join(f.read().split()[:3])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--image", default="debian")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--compute-ms", type=float, default=5.0)
    ap.add_argument("--sleep-ms", type=float, default=20.0)
    ap.add_argument("--loads", default="10,30,50", help="node load of the loaders, percent")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="loaders (one per core)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (host noise spreads over all cases)")
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    loads = [int(x) for x in a.loads.split(",")]
    c = DSecClient(timeout=600)
    ls = c.run_container(
        DSecContainerRunArgs(container_image=a.image, memory_limit_mb=256, cpu_cores_limit=1.0, qos="latency_sensitive"),
        timeout=300,
    )
    results = {"config": vars(a), "loadavg_before": loadavg(), "runs": []}
    rows = []
    try:
        r = ls.run_shell(f"cat > /tmp/cal.py <<'EOF'\n{CALIBRATE}\nEOF\npython3 /tmp/cal.py {a.compute_ms}")
        iters = int(r.stdout.strip())
        results["iterations"] = iters
        print(f"calibrated: {iters} iterations ~ {a.compute_ms} ms; load average before: {results['loadavg_before']}")

        def record(name, mode, load, values):
            s = stats(values)
            results["runs"].append({"name": name, "mode": mode, "load_pct": load, **s, "values": values})
            rows.append((name, mode, load, s))
            print(f"  {name:28} p50 {s['p50_ms']:7.2f} ms  p99 {s['p99_ms']:7.2f} ms", flush=True)

        # Loaders for every (load, mode), created up front; their loops start and stop per run.
        loaders = {}
        for load in loads:
            for mode in ("no_qos", "qos"):
                qos = "best_effort" if mode == "qos" else "latency_sensitive"
                loaders[(load, mode)] = [
                    c.run_container(
                        DSecContainerRunArgs(
                            container_image="busybox", memory_limit_mb=32, cpu_cores_limit=load / 100.0, qos=qos
                        ),
                        timeout=120,
                    )
                    for _ in range(a.cores)
                ]
        configs = [(0, "alone")] + [(load, mode) for load in loads for mode in ("no_qos", "qos")]
        per_round = max(1, a.steps // a.rounds)
        collected = {cfg: [] for cfg in configs}
        rng = random.Random(a.seed)
        try:
            for rnd in range(a.rounds):
                order = configs[:]
                rng.shuffle(order)
                for load, mode in order:
                    group = loaders.get((load, mode), [])
                    for ld in group:
                        ld.run_shell("(while :; do :; done) >/dev/null 2>&1 & echo $! > /tmp/loop.pid")
                    try:
                        if group:
                            time.sleep(0.5)
                        collected[(load, mode)] += run_steps(ls, per_round, iters, a.sleep_ms)
                    finally:
                        for ld in group:
                            ld.run_shell("kill $(cat /tmp/loop.pid)")
                print(f"round {rnd + 1}/{a.rounds} done; load average {loadavg()}", flush=True)
        finally:
            for group in loaders.values():
                for ld in group:
                    try:
                        ld.stop()
                    except Exception as e:  # noqa: BLE001 - keep stopping the others
                        print(f"stop loader {ld.id}: {e}")
        for load, mode in configs:
            name = "alone" if mode == "alone" else f"{load}% load, {mode}"
            record(name, mode, load, collected[(load, mode)])
    finally:
        ls.stop()
        c.close()
    results["loadavg_after"] = loadavg()
    base = next(s for (_, m, _, s) in rows if m == "alone")
    results["alone_ms"] = base
    print()
    print(f"alone: p50 {base['p50_ms']:.2f} ms, p99 {base['p99_ms']:.2f} ms")
    print(f"{'load':>5} {'mode':>7} {'p50 ms':>8} {'p50 infl':>9} {'p99 ms':>8} {'p99 infl':>9}")
    table = []
    for name, mode, load, s in rows:
        if mode == "alone":
            continue
        i50 = s["p50_ms"] / base["p50_ms"] - 1
        i99 = s["p99_ms"] / base["p99_ms"] - 1
        table.append({"load_pct": load, "mode": mode, "p50_ms": s["p50_ms"], "p50_inflation": i50, "p99_ms": s["p99_ms"], "p99_inflation": i99})
        print(f"{load:>4}% {mode:>7} {s['p50_ms']:8.2f} {i50 * 100:+8.1f}% {s['p99_ms']:8.2f} {i99 * 100:+8.1f}%")
    results["table"] = table
    print(f"load average before {results['loadavg_before']}, after {results['loadavg_after']}")
    write_results("qos", results)


if __name__ == "__main__":
    main()
