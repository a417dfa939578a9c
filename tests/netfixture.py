"""A `dsec up` with sandbox networking configured, plus test servers for made-up `*.test`
domains in their own network namespace (never real hosts). Shared by tests/test_network.py
and tests/redteam/."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import List

from helpers import DsecUp, new_data_dir, remove_data_dir

SRV_NS = "dsnt-srv"
HOST_IF = "dsnth0"
PYPI = "198.18.7.2"
NPM = "198.18.7.3"
PYPI6 = "fd42:7::2"
TABLE = "dsectest"

CONFIG = f"""
[edge]
default_disk_limit_mb = 0

[edge.network]
subnet_v4 = "10.231.0.0/16"
subnet_v6 = "fd00:d5ed::/64"
table = "{TABLE}"
veth_prefix = "dst"
gateway_interface = "dsect0"
dns_ttl_s = 30
domain_ports = [80]

[edge.network.groups]
pypi = ["pypi.test", "*.pypi.test"]
npm = ["npm.test"]

[edge.network.hosts]
"pypi.test" = "{PYPI}, {PYPI6}"
"files.pypi.test" = "{PYPI}"
"npm.test" = "{NPM}"
"""


def sh(cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, shell=True, capture_output=True, text=True, check=check)


class TestServers:
    __test__ = False

    """HTTP servers on 198.18.7.2 (:80, :8080), 198.18.7.3 (:80) and [fd42:7::2]:80."""

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []
        self.dir = tempfile.mkdtemp(prefix="dsec-srv-")

    def start(self) -> "TestServers":
        self.stop_ns()
        try:
            self._start()
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self) -> None:
        for c in [
            f"ip netns add {SRV_NS}",
            f"ip link add {HOST_IF} type veth peer name eth0 netns {SRV_NS}",
            f"ip addr add 198.18.7.1/24 dev {HOST_IF}",
            f"ip -6 addr add fd42:7::1/64 dev {HOST_IF} nodad",
            f"ip link set {HOST_IF} up",
            f"ip -n {SRV_NS} addr add {PYPI}/24 dev eth0",
            f"ip -n {SRV_NS} addr add {NPM}/24 dev eth0",
            f"ip -n {SRV_NS} -6 addr add {PYPI6}/64 dev eth0 nodad",
            f"ip -n {SRV_NS} link set eth0 up",
            f"ip -n {SRV_NS} link set lo up",
            f"ip -n {SRV_NS} route add default via 198.18.7.1",
            f"ip -n {SRV_NS} -6 route add default via fd42:7::1",
        ]:
            sh(c)
        with open(os.path.join(self.dir, "index.html"), "w") as f:
            f.write("reference-solution-42\n")
        servers = [(PYPI, 80), (PYPI, 8080), (NPM, 80), (PYPI6, 80)]
        for addr, port in servers:
            with open(os.path.join(self.dir, f"server-{port}-{addr.replace(':', '_')}.log"), "wb") as log:
                p = subprocess.Popen(
                    ["ip", "netns", "exec", SRV_NS, sys.executable, "-m", "http.server", str(port), "--bind", addr,
                     "--directory", self.dir],
                    cwd=self.dir, stdout=subprocess.DEVNULL, stderr=log,
                )
            self.procs.append(p)
        # Probed from the host (through the veth) with a plain connect: python startup is slow
        # on a loaded machine, so wait generously.
        deadline = time.monotonic() + 60
        for (addr, port), p in zip(servers, self.procs):
            while True:
                if p.poll() is not None:
                    with open(os.path.join(self.dir, f"server-{port}-{addr.replace(':', '_')}.log"), errors="replace") as f:
                        err = f.read()
                    raise RuntimeError(f"test server {addr}:{port} exited {p.returncode}: {err[-2000:]}")
                try:
                    with socket.create_connection((addr, port), timeout=1):
                        break
                except OSError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"test server {addr}:{port} did not come up within 60 s")
                time.sleep(0.1)

    def stop_ns(self) -> None:
        sh(f"ip link del {HOST_IF}", check=False)
        sh(f"ip netns del {SRV_NS}", check=False)

    def stop(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=5)
            except subprocess.TimeoutExpired:
                p.kill()
        self.stop_ns()


class NetUp(DsecUp):
    """`dsec up --config <network config>` (a wrapper script adds the flag)."""

    def __init__(self, binary: str, tag: str) -> None:
        data = new_data_dir(tag)
        os.makedirs(data, exist_ok=True)
        cfg = os.path.join(data, "dsec.toml")
        with open(cfg, "w") as f:
            f.write(CONFIG)
        wrapper = os.path.join(data, "dsec-wrapper.sh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {binary} "$@" --config {cfg}; fi\nexec {binary} "$@"\n')
        os.chmod(wrapper, 0o755)
        super().__init__(wrapper, data, tag)

    def finish(self) -> int:
        rc = self.stop()
        remove_data_dir(self.data_dir)
        # Nothing of the table, namespaces or veths may stay behind.
        left = sh(f"nft list table inet {TABLE}", check=False).returncode == 0
        nss = [n for n in os.listdir("/run/netns") if n.startswith(TABLE + "-")] if os.path.isdir("/run/netns") else []
        veths = [n for n in os.listdir("/sys/class/net") if n.startswith("dst")]
        assert not nss and not veths, f"leftover namespaces {nss} veths {veths}"
        _ = left  # the base table may stay (an edge owns it across runs); sandbox chains are gone
        return rc


def denied(sb) -> int:
    return int(sb.network()["denied_packets"])


def run(sb, cmd: str, timeout: float = 30) -> tuple:
    r = sb.run_shell(cmd, timeout=timeout)
    return r.exit_code, r.stdout + r.stderr
