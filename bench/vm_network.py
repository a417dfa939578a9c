#!/usr/bin/env python3
"""VM networking (issue 9 with issue 8): what `allowlist` networking adds to a microVM's
create → first command (with and without, interleaved in the same run), and the throughput of
an allowed TCP stream from a microVM against the same stream from a container (same image, same
Python sender and sink, same host-side rules).

    DSEC_BIN=target/release/dsec python3 bench/vm_network.py [--runs 3] [--mb 64]

Runs its own `dsec up` (network config of tests/netfixture.py with its own table, prefixes and
subnets) and the test servers' namespace (as root). microVM templates are off for the run
(`DSEC_MICROVM_TEMPLATES=0`): networked VMs always boot cold, so the baseline does too. Under
TCG (no working KVM here) the figures are software-emulation figures, not KVM ones.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from helpers import debian_tar, find_dsec_bin  # noqa: E402
from netfixture import PYPI, SRV_NS, NetUp, TestServers  # noqa: E402
from network import SEND, sink, sink_result  # noqa: E402  (bench/network.py)
from test_vm_network import own_config  # noqa: E402

import dsec  # noqa: E402

BENCH_TABLE = "dsecbvm"
BENCH_CONFIG = own_config(BENCH_TABLE, "dsb", 8)
ALLOW = {"mode": "allowlist", "rules": [{"cidr": f"{PYPI}/32", "ports": "9000", "protocol": "tcp"}]}


def boot_to_first_command(c, **kw) -> float:
    t = time.perf_counter()
    sb = c.run_microvm(dsec.DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=256, **kw), timeout=300)
    r = sb.run_shell("echo ok")
    secs = time.perf_counter() - t
    assert r.stdout == "ok\n", r
    sb.stop()
    return secs


def stream(sb, mb: int) -> float:
    """MiB/s of `mb` MiB from the sandbox to the sink in the test namespace."""
    n = mb << 20
    p = sink(SRV_NS, PYPI, 9000, n)
    r = sb.run_shell(f"python3 /tmp/send.py {PYPI} 9000 {mb}", timeout=600)
    got, secs = sink_result(p)
    assert got == n, (got, r.stdout, r.stderr)
    return mb / secs


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--mb", type=int, default=64)
    a = ap.parse_args()
    os.environ["DSEC_MICROVM_TEMPLATES"] = "0"
    print("load average before:", os.getloadavg())
    srv = TestServers().start()
    up = NetUp(find_dsec_bin(), "benchvmnet", config=BENCH_CONFIG, table=BENCH_TABLE, veth_prefix="dsb")
    up.start()
    c = up.client()
    try:
        none, allow = [], []
        for _ in range(a.runs):  # interleaved so both see the same machine state
            none.append(boot_to_first_command(c))
            allow.append(boot_to_first_command(c, network=ALLOW))
        load_boots = os.getloadavg()
        up.cli("image", "import", "debian", "--tar", str(debian_tar()), timeout=900)
        rates = {"microvm": [], "container": []}
        vm = c.run_microvm(dsec.DSecMicroVMRunArgs(container_image="debian", memory_limit_mb=512,
                                                   cpu_cores_limit=2, network=ALLOW), timeout=300)
        ct = c.run_container(dsec.DSecContainerRunArgs(container_image="debian", cpu_cores_limit=2,
                                                       network=ALLOW), timeout=60)
        try:
            for sb in (vm, ct):
                sb.write_file("/tmp/send.py", SEND)
            for _ in range(3):
                rates["microvm"].append(stream(vm, a.mb))
                rates["container"].append(stream(ct, a.mb))
        finally:
            vm.stop()
            ct.stop()
        m_none, m_allow = statistics.median(none), statistics.median(allow)
        vm_rate, ct_rate = statistics.median(rates["microvm"]), statistics.median(rates["container"])
        print(f"microVM create -> first command (TCG, busybox, 256 MiB): none {m_none:.2f} s, allowlist "
              f"{m_allow:.2f} s, added {m_allow - m_none:+.2f} s ({(m_allow / m_none - 1) * 100:+.1f} %) "
              f"(runs none {[round(x, 2) for x in none]}, allowlist {[round(x, 2) for x in allow]}; "
              f"load average after the boots {load_boots})")
        print(f"allowed TCP stream to the test host: microVM {vm_rate:.0f} MiB/s, container {ct_rate:.0f} MiB/s, "
              f"ratio {vm_rate / ct_rate * 100:.0f}% (medians of 3 x {a.mb} MiB, Python sender and sink, debian image, "
              f"2 vCPUs / 2 cores; rounds microVM {[round(x) for x in rates['microvm']]}, "
              f"container {[round(x) for x in rates['container']]})")
        print("load average after:", os.getloadavg())
        print(f"reproduce: DSEC_BIN=target/release/dsec python3 bench/vm_network.py --runs {a.runs} --mb {a.mb}")
    finally:
        c.close()
        up.finish()
        srv.stop()


if __name__ == "__main__":
    main()
