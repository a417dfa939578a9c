#!/usr/bin/env python3
"""Cluster benchmark (issue 5): 160 simulated edges (test/benchmark mode, one process), one
apiserver, the Rust load generator `dsec bench create-load`.

1. create+delete at increasing offered rates: achieved creates/s, p50/p99 create latency;
2. fill to 380,000 live sandboxes: apiserver RSS;
3. load spread (max/mean sandboxes per node) of power_of_k (k=2), random and least_loaded,
   each on fresh edges with the same number of creates.

Usage: DSEC_BIN=target/release/dsec python3 bench/cluster.py [--rates 1000,2500,5000] [--live 380000]
Prints a JSON summary and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import socket
import subprocess
import sys
import tempfile
import time

DSEC = os.environ.get("DSEC_BIN", "target/release/dsec")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(argv, want):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    vars_ = {}
    while not all(w in vars_ for w in want):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{argv[:3]} exited")
        if "=" in line:
            k, v = line.strip().split("=", 1)
            vars_.setdefault(k, []).append(v)
    return p, vars_


def stop(p):
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=30)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


def cpu_s(pid: int) -> float:
    """utime + stime of a process, seconds."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def children_cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def cluster(count: int, capacity: int, strategy: str, tmp: str):
    edges, ev = start([DSEC, "edge", "--simulated", "--count", str(count), "--capacity", str(capacity),
                       "--listen", "127.0.0.1:0", "--node-id", "b", "--log-level", "warn"],
                      ["DSEC_EDGE_TOKEN"])
    tok = ev["DSEC_EDGE_TOKEN"][0]
    ef = os.path.join(tmp, f"edges-{strategy}")
    with open(ef, "w") as f:
        for u in ev["DSEC_EDGE_URL"]:
            f.write(f"{u}#{tok}\n")
    api, av = start([DSEC, "apiserver", "--listen", f"127.0.0.1:{free_port()}", "--edges-file", ef,
                     "--db", os.path.join(tmp, f"iam-{strategy}.db"), "--env-file", os.path.join(tmp, f"env-{strategy}"),
                     "--placement", strategy, "--log-level", "warn"],
                    ["DSEC_API_URL", "DSEC_API_KEY"])
    return edges, api, av["DSEC_API_URL"][0], av["DSEC_API_KEY"][0]


def load(url, key, *args):
    out = subprocess.run([DSEC, "bench", "create-load", *args],
                         env=dict(os.environ, DSEC_API_URL=url, DSEC_API_KEY=key),
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="1000,2500,5000,7500")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--live", type=int, default=380_000)
    ap.add_argument("--spread-creates", type=int, default=16_000)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dsec-bench-cluster-")
    res = {"edges": 160, "rates": [], "live": None, "spread": {}}
    edges, api, url, key = cluster(160, 2500, "power_of_k", tmp)
    try:
        for r in [float(x) for x in a.rates.split(",") if x]:
            before = (cpu_s(api.pid), cpu_s(edges.pid), children_cpu_s())
            s = load(url, key, "--rate", str(r), "--total", str(int(r * a.seconds)), "--concurrency", "1024", "--delete")
            after = (cpu_s(api.pid), cpu_s(edges.pid), children_cpu_s())
            s.pop("per_node", None)
            # CPU per create+delete (less sensitive to other load on the machine than latency).
            ops = max(s["created"], 1)
            s["cpu_us_per_op"] = {name: (after[i] - before[i]) * 1e6 / ops
                                  for i, name in enumerate(("apiserver", "sim_edges", "load_generator"))}
            s["loadavg_1m"] = os.getloadavg()[0]
            res["rates"].append(s)
            print(f"rate {r:.0f}/s: achieved {s['achieved_creates_per_s']:.0f}/s p50 {s['create_p50_ms']:.1f} ms "
                  f"p99 {s['create_p99_ms']:.1f} ms refused {s['refused']} cpu/op "
                  + " ".join(f"{k} {v:.0f} us" for k, v in s["cpu_us_per_op"].items())
                  + f" load {s['loadavg_1m']:.1f}", file=sys.stderr)
        rss0 = rss_mb(api.pid)
        s = load(url, key, "--total", str(a.live), "--concurrency", "512")
        time.sleep(2)
        res["live"] = {"created": s["created"], "refused": s["refused"], "seconds": s["seconds"],
                       "creates_per_s": s["achieved_creates_per_s"], "p50_ms": s["create_p50_ms"],
                       "p99_ms": s["create_p99_ms"], "apiserver_rss_mb_before": rss0,
                       "apiserver_rss_mb": rss_mb(api.pid), "sim_edges_rss_mb": rss_mb(edges.pid)}
        print(f"live {s['created']}: apiserver RSS {res['live']['apiserver_rss_mb']:.0f} MiB", file=sys.stderr)
    finally:
        stop(api)
        stop(edges)
    for strategy in ("power_of_k", "random", "least_loaded"):
        edges, api, url, key = cluster(160, 5000, strategy, tmp)
        try:
            s = load(url, key, "--total", str(a.spread_creates), "--concurrency", "512")
            counts = list(s["per_node"].values()) + [0] * (160 - len(s["per_node"]))
            mean = sum(counts) / 160
            res["spread"][strategy] = {"max": max(counts), "min": min(counts), "mean": mean,
                                       "max_over_mean": max(counts) / mean if mean else 0,
                                       "creates_per_s": s["achieved_creates_per_s"], "p99_ms": s["create_p99_ms"]}
            print(f"{strategy}: max/mean {res['spread'][strategy]['max_over_mean']:.3f}", file=sys.stderr)
        finally:
            stop(api)
            stop(edges)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
