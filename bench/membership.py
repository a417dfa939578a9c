#!/usr/bin/env python3
"""Membership benchmark (issue 22), real edges on this host's loopback (run as root).

1. Time for a joining edge to receive its first placement: `dsec edge --join` started next to
   a running apiserver (no restart), measured from the edge process's start and from the
   moment it printed its URL (joined), to the first create placed on it (the only node that
   takes placements). Baseline, side by side: the old way of adding a node -- restart the
   apiserver with the new node in its `--edge` list -- measured from the apiserver's restart
   to the first create placed on the node.
2. Time from partition to `suspect` and to `lost`: the edge is SIGSTOPped (it stops
   answering polls and heartbeating), `GET /v1/nodes` is polled every 50 ms. Shown against
   the configured bounds (`heartbeat_timeout_ms`, `node_lost_after_ms`), as a ratio.

Usage: DSEC_BIN=target/release/dsec DSEC_AETHER=target/release/dsec-aether \
       python3 bench/membership.py [--trials 5] [--lost-after-ms 5000]
Prints a JSON summary and a markdown table (median, p99 over the trials).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import tempfile
import time
import urllib.error
import urllib.request

DSEC = os.environ.get("DSEC_BIN", "target/release/dsec")
TOKEN = "membership-bench-join-token-01234"
HB_TIMEOUT_MS = 1500


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def call(method, url, key="", body=None, timeout=60.0):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    if key:
        req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            return r.status, (json.loads(raw) if raw else {})
    except urllib.error.HTTPError as e:
        try:
            return e.code, json.loads(e.read())
        except ValueError:
            return e.code, {}


def start(argv, want, log):
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=log, text=True)
    got = {}
    while not all(w in got for w in want):
        line = p.stdout.readline()
        if not line:
            raise RuntimeError(f"{argv[:3]} exited; see {log.name}")
        if "=" in line:
            k, v = line.strip().split("=", 1)
            got.setdefault(k, v)
    return p, got


def stop(p, sig=signal.SIGTERM):
    if p.poll() is None:
        p.send_signal(signal.SIGCONT)
        p.send_signal(sig)
        try:
            p.wait(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


class Bench:
    def __init__(self, lost_after_ms: int):
        self.dir = tempfile.mkdtemp(prefix="dsec-bench-membership-")
        self.log = open(os.path.join(self.dir, "log"), "w")
        self.lost_after_ms = lost_after_ms
        self.db = os.path.join(self.dir, "iam.db")
        self.cfg = os.path.join(self.dir, "api.toml")
        with open(self.cfg, "w") as f:
            f.write(f'[apiserver]\njoin_token = "{TOKEN}"\nnode_lost_after_ms = {lost_after_ms}\n'
                    f"heartbeat_period_ms = 300\nheartbeat_timeout_ms = {HB_TIMEOUT_MS}\n"
                    "membership_sync_ms = 100\nwatcher_period_ms = 200\n")
        self.api = None
        self.procs = []

    def start_api(self, edges=()):
        argv = [DSEC, "apiserver", "--config", self.cfg, "--listen", f"127.0.0.1:{free_port()}",
                "--db", self.db, "--env-file", os.path.join(self.dir, "env")]
        for e in edges:
            argv += ["--edge", e]
        self.api, v = start(argv, ["DSEC_API_URL", "DSEC_API_KEY"], self.log)
        self.url, self.key = v["DSEC_API_URL"], v["DSEC_API_KEY"]

    def edge(self, node, join=True):
        argv = [DSEC, "edge", "--listen", f"127.0.0.1:{free_port()}", "--data-dir",
                os.path.join(self.dir, node), "--node-id", node]
        argv += ["--join", self.url, "--token", TOKEN] if join else ["--token", TOKEN]
        t0 = time.monotonic()
        p, v = start(argv, ["DSEC_EDGE_URL"], self.log)
        self.procs.append(p)
        return p, v["DSEC_EDGE_URL"], t0, time.monotonic()

    def first_placement(self, node, deadline_s=60):
        while True:
            st, sb = call("POST", f"{self.url}/v1/sandboxes", self.key, {"image": "busybox"})
            if st == 201:
                assert sb["id"].split("-")[1] == node, sb
                call("DELETE", f"{self.url}/v1/sandboxes/{sb['id']}", self.key)
                return time.monotonic()
            if time.monotonic() > deadline_s + self.t_start:
                raise RuntimeError(f"no placement on {node}: {st} {sb}")
            time.sleep(0.02)

    def state(self, node):
        st, body = call("GET", f"{self.url}/v1/nodes", self.key)
        for n in body.get("nodes", []):
            if n["node"] == node:
                return n["membership"]["state"]
        return "absent"

    def close(self):
        for p in self.procs:
            stop(p)
        if self.api:
            stop(self.api)
        self.log.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--trials", type=int, default=5)
    ap.add_argument("--lost-after-ms", type=int, default=5000)
    a = ap.parse_args()
    join_from_start, join_from_joined, restart_baseline, to_suspect, to_lost = [], [], [], [], []
    for t in range(a.trials):
        b = Bench(a.lost_after_ms)
        try:
            # 1. join without restart
            b.start_api()
            node = f"bj{os.getpid() % 10000}x{t}"
            b.t_start = time.monotonic()
            p, _, t0, t_joined = b.edge(node)
            t_first = b.first_placement(node)
            join_from_start.append(t_first - t0)
            join_from_joined.append(t_first - t_joined)
            # 2. partition: SIGSTOP
            t_stop = time.monotonic()
            os.kill(p.pid, signal.SIGSTOP)
            seen_suspect = None
            while True:
                s = b.state(node)
                now = time.monotonic()
                if s in ("suspect", "lost") and seen_suspect is None:
                    seen_suspect = now - t_stop
                if s == "lost":
                    to_lost.append(now - t_stop)
                    break
                if now - t_stop > a.lost_after_ms / 1000 + 30:
                    raise RuntimeError(f"{node} not lost: {s}")
                time.sleep(0.05)
            to_suspect.append(seen_suspect)
            os.kill(p.pid, signal.SIGCONT)
            stop(p)
            b.procs.remove(p)
            stop(b.api)
            b.api = None
            # baseline: a static edge added by restarting the apiserver with it in --edge
            node2 = f"bs{os.getpid() % 10000}x{t}"
            p2, url2, _, _ = b.edge(node2, join=False)
            t0 = time.monotonic()
            b.t_start = t0
            b.start_api([f"{url2}#{TOKEN}"])
            restart_baseline.append(b.first_placement(node2) - t0)
        finally:
            b.close()
    med = statistics.median
    rows = [
        ("join: edge start -> first placement", join_from_start, None),
        ("join: joined -> first placement", join_from_joined, None),
        ("baseline: apiserver restart with --edge -> first placement", restart_baseline, None),
        ("SIGSTOP -> suspect", to_suspect, HB_TIMEOUT_MS / 1000),
        ("SIGSTOP -> lost", to_lost, a.lost_after_ms / 1000),
    ]
    summary = {name: {"median_s": med(xs), "p99_s": pct(xs, 0.99), "n": len(xs), "bound_s": bound}
               for name, xs, bound in rows}
    summary["ratio_join_vs_restart_median"] = med(join_from_joined) / med(restart_baseline)
    print(json.dumps(summary, indent=2))
    print("| measurement | median | p99 | configured bound | ratio median/bound |")
    print("| --- | --- | --- | --- | --- |")
    for name, xs, bound in rows:
        ratio = f"{med(xs) / bound:.2f}" if bound else "-"
        b_s = f"{bound:.1f} s" if bound else "-"
        print(f"| {name} | {med(xs):.2f} s | {pct(xs, 0.99):.2f} s | {b_s} | {ratio} |")
    print(f"joined -> first placement vs. restart baseline (median): "
          f"{summary['ratio_join_vs_restart_median']:.2f}x")


if __name__ == "__main__":
    main()
