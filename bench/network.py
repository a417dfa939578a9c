#!/usr/bin/env python3
"""Cost of `allowlist` networking at create (p50 with and without, same run) and throughput of
an allowed TCP stream from a sandbox against plain host loopback.

    DSEC_BIN=target/release/dsec python3 bench/network.py [--n 45] [--background 200]

Runs its own `dsec up` with the network config of tests/netfixture.py and test servers in a
test namespace (as root). The throughput compares like with like: the same Python sender
(1 MiB `sendall`s) and sink (`recv_into`) on both paths, the sandbox (debian image, imported
from the cached tarball) at the host's CPU (2 cores), the test host's link at loopback's MTU
class (65520). `--background N` keeps N other `allowlist` sandboxes running during the create
rounds (a busy node: their chains and sets are in the same nftables ruleset)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from helpers import debian_tar, find_dsec_bin  # noqa: E402
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


SINK = """
import socket, sys, time
addr, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
l = socket.socket(); l.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); l.bind((addr, port)); l.listen(1)
print("ready", flush=True)
c, _ = l.accept(); got = 0; t0 = None; buf = bytearray(1 << 20)
while got < n:
    k = c.recv_into(buf)
    if not k:
        break
    if t0 is None:
        t0 = time.perf_counter()
    got += k
print(got, time.perf_counter() - t0, flush=True)
c.close()
"""


SEND = "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2]))); b=bytes(1<<20)\nfor _ in range(int(sys.argv[3])): s.sendall(b)\ns.close()"


def sink(ns, addr, port, n):
    """A TCP sink that reads `n` bytes, closes, and prints (bytes, seconds from the first byte)."""
    pre = ["ip", "netns", "exec", ns] if ns else []
    p = subprocess.Popen(pre + [sys.executable, "-c", SINK, addr, str(port), str(n)],
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    return p


def sink_result(p):
    got, secs = p.stdout.readline().split()
    p.wait(timeout=30)
    return int(got), float(secs)


def nft_scale(counts):
    """Time of one sandbox's attach transaction through libnftables (what the edge does per
    networked create) with N sandboxes already in the table, for the per-sandbox layout before
    this change (four interval sets holding the static allows) and the current one (one rule per
    allow, only the two DNS-grant sets, which have no intervals). Scratch table, removed after."""
    import ctypes
    lib = ctypes.CDLL("libnftables.so.1")
    lib.nft_ctx_new.restype = ctypes.c_void_p
    lib.nft_run_cmd_from_buffer.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
    lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
    ctx = lib.nft_ctx_new(0)
    lib.nft_ctx_buffer_output(ctx)
    lib.nft_ctx_buffer_error(ctx)

    def run(script):
        t = time.perf_counter()
        rc = lib.nft_run_cmd_from_buffer(ctx, script.encode())
        assert rc == 0, script
        return (time.perf_counter() - t) * 1000

    def attach(t, k, interval):
        sets = [("d4", "ipv4_addr . inet_service; flags timeout;"), ("d6", "ipv6_addr . inet_service; flags timeout;")]
        if interval:
            sets += [("a4", "ipv4_addr . inet_proto . inet_service; flags interval;"),
                     ("a6", "ipv6_addr . inet_proto . inet_service; flags interval;"),
                     ("i4", "ipv4_addr; flags interval;"), ("i6", "ipv6_addr; flags interval;")]
        s = f"add counter inet {t} sb_{k}_denied\n" + "".join(f"add set inet {t} sb_{k}_{n} {{ type {ty} }}\n" for n, ty in sets)
        s += f"add chain inet {t} sb_{k}\nadd chain inet {t} sb_{k}_in\n"
        if interval:
            s += f"add element inet {t} sb_{k}_a4 {{ 198.18.7.0/24 . tcp . 1-65535 }}\n"
            s += f"add rule inet {t} sb_{k} ip daddr . meta l4proto . th dport @sb_{k}_a4 accept\n"
        else:
            s += f"add rule inet {t} sb_{k} ip daddr 198.18.7.0/24 meta l4proto tcp th dport 1-65535 accept\n"
        s += f"add rule inet {t} sb_{k} ip daddr . tcp dport @sb_{k}_d4 accept\n"
        s += f"add rule inet {t} sb_{k} counter name sb_{k}_denied drop\n"
        return s + f"add element inet {t} vf {{ \"v{k}\" : jump sb_{k} }}\n"

    for interval in (True, False):
        t = f"dsecbench{os.getpid()}"
        run(f"add table inet {t}\nadd map inet {t} vf {{ type ifname : verdict; }}\n")
        try:
            n, out = 0, []
            for target in counts:
                while n < target:
                    run(attach(t, f"x{n}", interval))
                    n += 1
                times = sorted(run(attach(t, f"p{target}_{i}", interval)) for i in range(5))
                out.append(f"{target}: {times[2]:.2f} ms")
            print(("interval sets (before)" if interval else "plain rules (now)") + " - attach p50 with N sandboxes in the table: " + ", ".join(out), flush=True)
        finally:
            run(f"delete table inet {t}\n")
    print(f"reproduce: python3 bench/network.py --nft-scale {','.join(map(str, counts))} (load average {os.getloadavg()})")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--background", type=int, default=0,
                    help="networked sandboxes kept running during the create rounds")
    ap.add_argument("--nft-scale", default="",
                    help="only time the nftables attach with N sandboxes in the table, e.g. 0,100,300")
    a = ap.parse_args()
    if a.nft_scale:
        nft_scale([int(x) for x in a.nft_scale.split(",")])
        return
    print("load average before:", os.getloadavg())
    srv = TestServers().start()
    up = NetUp(find_dsec_bin(), "benchnet")
    up.start()
    c = up.client()
    background = []
    done = False
    try:
        for i in range(a.background):
            background.append(c.run_container(dsec.DSecContainerRunArgs(
                container_image="busybox", memory_limit_mb=32, cpu_cores_limit=0.05,
                network={"mode": "allowlist", "rules": [{"cidr": f"198.18.{8 + i // 250}.{i % 250}/32", "ports": "443"}]}), timeout=60))
        create_p50(c, 3)  # warm up
        rounds_none, rounds_allow = [], []
        for _ in range(3):  # interleaved so both see the same machine state
            rounds_none.append(create_p50(c, a.n // 3)[0])
            rounds_allow.append(create_p50(c, a.n // 3, network={"mode": "allowlist", "rules": [{"cidr": "198.18.7.0/24"}]})[0])
        p_none, p_allow = statistics.median(rounds_none), statistics.median(rounds_allow)
        load_creates = os.getloadavg()
        for sb in background:
            sb.stop()
        background = []
        # Throughput: sandbox -> allowed host in the test namespace vs host loopback.
        up.cli("image", "import", "debian", "--tar", str(debian_tar()), timeout=900)
        sb = c.run_container(dsec.DSecContainerRunArgs(
            container_image="debian", cpu_cores_limit=2,
            network={"mode": "allowlist", "rules": [{"cidr": f"{PYPI}/32", "ports": "9000", "protocol": "tcp"}]}), timeout=60)
        sb.write_file("/tmp/send.py", SEND)
        n = MB << 20
        results = {"sandbox": [], "loopback": []}
        for _ in range(5):
            p = sink(SRV_NS, PYPI, 9000, n)
            r = sb.run_shell(f"python3 /tmp/send.py {PYPI} 9000 {MB}", timeout=120)
            got, secs = sink_result(p)
            assert got == n, (got, r.stdout, r.stderr)
            results["sandbox"].append(MB / secs)
            p = sink(None, "127.0.0.1", 9001, n)
            subprocess.run([sys.executable, "-c", SEND, "127.0.0.1", "9001", str(MB)], check=True)
            got, secs = sink_result(p)
            assert got == n
            results["loopback"].append(MB / secs)
        sb.stop()
        sb_rate = statistics.median(results["sandbox"])
        lo_rate = statistics.median(results["loopback"])
        print(f"create p50 without network: {p_none:.1f} ms, with allowlist: {p_allow:.1f} ms, added: {p_allow - p_none:.1f} ms "
              f"(rounds: none {[round(x, 1) for x in rounds_none]}, allowlist {[round(x, 1) for x in rounds_allow]}; "
              f"{a.background} other networked sandboxes running; load average after the creates {load_creates})")
        print(f"allowed TCP stream sandbox -> test host: {sb_rate:.0f} MiB/s; host loopback: {lo_rate:.0f} MiB/s; "
              f"ratio {sb_rate / lo_rate * 100:.0f}% (medians of 5 x {MB} MiB, Python senders and sinks; rounds sandbox {[round(x) for x in results['sandbox']]}, loopback {[round(x) for x in results['loopback']]})")
        print("load average after:", os.getloadavg())
        done = True
        print(f"reproduce: DSEC_BIN=target/release/dsec python3 bench/network.py --n {a.n}"
              + (f" --background {a.background}" if a.background else ""))
    finally:
        for sb in background:
            try:
                sb.stop()
            except Exception as e:  # noqa: BLE001 - best effort before the edge stops
                print("stop background sandbox:", e, file=sys.stderr)
        c.close()
        up.finish()
        srv.stop()
        if done:
            up.remove_log()  # kept when the run failed


if __name__ == "__main__":
    main()
