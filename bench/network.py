#!/usr/bin/env python3
"""Cost of `allowlist` networking at create (p50 with and without, same run) and throughput of
an allowed TCP stream from a sandbox against plain host loopback.

    DSEC_BIN=target/release/dsec python3 bench/network.py [--n 30]

Runs its own `dsec up` with the network config of tests/netfixture.py and test servers in a
test namespace (as root)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from helpers import find_dsec_bin  # noqa: E402
from netfixture import PYPI, SRV_NS, NetUp, TestServers  # noqa: E402

import dsec  # noqa: E402

MB = 256


def create_p50(c, n, **kw):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        sb = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", **kw), timeout=60)
        times.append((time.perf_counter() - t) * 1000)
        sb.stop()
    return statistics.median(times), times


def sink(ns, addr, port):
    """A TCP sink (busybox nc) that discards; returns the process."""
    pre = ["ip", "netns", "exec", ns] if ns else []
    return subprocess.Popen(pre + ["busybox", "nc", "-l", "-p", str(port), "-s", addr],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    a = ap.parse_args()
    srv = TestServers().start()
    up = NetUp(find_dsec_bin(), "bench-net")
    up.start()
    c = up.client()
    try:
        create_p50(c, 3)  # warm up
        rounds_none, rounds_allow = [], []
        for _ in range(3):  # interleaved so both see the same machine state
            rounds_none.append(create_p50(c, a.n // 3)[0])
            rounds_allow.append(create_p50(c, a.n // 3, network={"mode": "allowlist", "rules": [{"cidr": "198.18.7.0/24"}]})[0])
        p_none, p_allow = statistics.median(rounds_none), statistics.median(rounds_allow)
        # Throughput: sandbox -> allowed host in the test namespace vs host loopback.
        sb = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", network={"mode": "allowlist", "rules": [{"cidr": f"{PYPI}/32", "ports": "9000", "protocol": "tcp"}]}), timeout=60)
        p = sink(SRV_NS, PYPI, 9000)
        time.sleep(0.3)
        t = time.perf_counter()
        r = sb.run_shell(f"head -c {MB}m /dev/zero | nc {PYPI} 9000", timeout=120)
        sb_s = time.perf_counter() - t
        p.kill()
        sb.stop()
        p = sink(None, "127.0.0.1", 9001)
        time.sleep(0.3)
        t = time.perf_counter()
        subprocess.run(f"head -c {MB}m /dev/zero | busybox nc 127.0.0.1 9001", shell=True, check=False)
        lo_s = time.perf_counter() - t
        p.kill()
        print(f"create p50 without network: {p_none:.1f} ms, with allowlist: {p_allow:.1f} ms, added: {p_allow - p_none:.1f} ms (exit {r.exit_code})")
        print(f"allowed TCP stream: {MB / sb_s:.0f} MiB/s; host loopback: {MB / lo_s:.0f} MiB/s; ratio {lo_s / sb_s * 100:.0f}%")
    finally:
        c.close()
        up.finish()
        srv.stop()


if __name__ == "__main__":
    main()
