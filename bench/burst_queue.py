#!/usr/bin/env python3
"""Burst queueing benchmark (issue 22): creates/s and p50/p99 of queued (`wait_s`) against
unqueued bursts through one apiserver onto simulated edges (test/benchmark mode), same run.

1. Room for the whole burst (no waiting needed): `--total` creates+deletes, `--concurrency` in
   flight, without `wait_s` (baseline) and with it, alternated `--rounds` times: what the queue
   costs when nothing has to wait.
2. A burst past capacity (room for `--room` sandboxes, each deleted once placed): unqueued, most
   creates are refused `node_full`; queued, every one is placed: creates/s placed, and the time
   creates waited in the queue (p50/p99).

Usage: DSEC_BIN=target/release/dsec python3 bench/burst_queue.py [--total 32000] [--concurrency 1024]
       [--room 200] [--rounds 3]
Prints a JSON summary and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from cluster import cluster, load, stop  # noqa: E402


def row(name: str, s: dict) -> dict:
    return {
        "case": name,
        "created": s["created"],
        "refused": sum(s["refused"].values()),
        "creates_per_s": round(s["achieved_creates_per_s"]),
        "p50_ms": round(s["create_p50_ms"], 2),
        "p99_ms": round(s["create_p99_ms"], 2),
        "queue_wait_p50_ms": s.get("queue_wait_p50_ms"),
        "queue_wait_p99_ms": s.get("queue_wait_p99_ms"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--total", type=int, default=32000)
    ap.add_argument("--concurrency", type=int, default=1024)
    ap.add_argument("--room", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dsec-bench-burstq-")
    out = {"with_room": [], "past_capacity": []}
    common = ["--total", str(a.total), "--concurrency", str(a.concurrency), "--delete"]
    # 1. Room for everything: 8 edges x 5000.
    edges, api, url, key = cluster(8, 5000, "power_of_k", tmp)
    try:
        for _ in range(a.rounds):
            out["with_room"].append(row("unqueued", load(url, key, *common)))
            out["with_room"].append(row("queued (wait_s=300)", load(url, key, *common, "--wait-s", "300")))
    finally:
        stop(api)
        stop(edges)
    # 2. Past capacity: room for --room at once.
    per = max(1, a.room // 2)
    edges, api, url, key = cluster(2, per, "least_loaded", tmp)
    try:
        out["past_capacity"].append(row(f"unqueued, room {2 * per}", load(url, key, *common)))
        out["past_capacity"].append(row(f"queued, room {2 * per}", load(url, key, *common, "--wait-s", "300")))
    finally:
        stop(api)
        stop(edges)
    print(json.dumps(out, indent=2))

    def med(case: str, field: str) -> float:
        return statistics.median(r[field] for r in out["with_room"] if r["case"] == case)

    print("\n| case | created | refused | creates/s | p50 ms | p99 ms | queue wait p50 / p99 ms |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for case in ("unqueued", "queued (wait_s=300)"):
        print(f"| {case}, room for all (median of {a.rounds}) | {a.total} | 0 | {med(case, 'creates_per_s'):.0f} "
              f"| {med(case, 'p50_ms'):.2f} | {med(case, 'p99_ms'):.2f} | |")
    print(f"| ratio queued / unqueued | | | {med('queued (wait_s=300)', 'creates_per_s') / med('unqueued', 'creates_per_s'):.2f} "
          f"| {med('queued (wait_s=300)', 'p50_ms') / med('unqueued', 'p50_ms'):.2f} "
          f"| {med('queued (wait_s=300)', 'p99_ms') / med('unqueued', 'p99_ms'):.2f} | |")
    for r in out["past_capacity"]:
        qw = (f"{r['queue_wait_p50_ms']:.0f} / {r['queue_wait_p99_ms']:.0f}"
              if r["queue_wait_p50_ms"] is not None else "")
        print(f"| {r['case']} | {r['created']} | {r['refused']} | {r['creates_per_s']} | {r['p50_ms']} "
              f"| {r['p99_ms']} | {qw} |")


if __name__ == "__main__":
    main()
