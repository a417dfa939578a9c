"""A `dsec up` with sandbox networking configured, plus test servers for made-up `*.test`
domains in their own network namespace (never real hosts). Shared by tests/test_network.py
and tests/redteam/."""

from __future__ import annotations

import fcntl
import os
import queue
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import List

from helpers import DsecUp, mounts_under, new_data_dir, remove_data_dir

SRV_NS = "dsnt-srv"
HOST_IF = "dsnth0"
PYPI = "198.18.7.2"
NPM = "198.18.7.3"
PYPI6 = "fd42:7::2"
TABLE = "dsectest"

CONFIG = f"""
[edge]
default_disk_limit_mb = 0
disk_bps_limit_mb = 32

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

    # The servers have fixed names and addresses (the edge configs name them), so two suites on
    # one host (say tests/test_network.py and another engineer's VM networking tests) must not
    # run them at the same time: the second `start` would delete the first's namespace midway.
    # A host-wide lock serialises them; it is held from `start` to `stop`.
    LOCK = "/run/dsec-test-servers.lock"
    LOCK_WAIT_S = 1200

    def __init__(self) -> None:
        self.procs: List[subprocess.Popen] = []
        self.dir = tempfile.mkdtemp(prefix="dsec-srv-")
        self.lock_fd: "int | None" = None

    def _lock(self) -> None:
        fd = os.open(self.LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        deadline = time.monotonic() + self.LOCK_WAIT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    os.close(fd)
                    raise RuntimeError(f"test servers still in use by another suite after {self.LOCK_WAIT_S} s ({self.LOCK})")
                time.sleep(0.5)
        self.lock_fd = fd

    def start(self) -> "TestServers":
        self._lock()
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
            f"ip link add {HOST_IF} mtu 65520 type veth peer name eth0 mtu 65520 netns {SRV_NS}",
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
        shutil.rmtree(self.dir, ignore_errors=True)
        if self.lock_fd is not None:
            os.close(self.lock_fd)  # releases the flock
            self.lock_fd = None


def second_config(disk_bps_limit_mb: int = 0) -> str:
    """CONFIG for a second edge on the same host: its own table, prefixes, subnets and
    gateway (edges on one host must not share them: each reaps its own leftovers by prefix)."""
    return (CONFIG.replace(f'table = "{TABLE}"', 'table = "dsectest2"')
            .replace('veth_prefix = "dst"', 'veth_prefix = "dsu"')
            .replace('gateway_interface = "dsect0"', 'gateway_interface = "dsect1"')
            .replace("10.231.0.0/16", "10.232.0.0/16")
            .replace("fd00:d5ed::/64", "fd00:d5ee::/64")
            .replace("disk_bps_limit_mb = 32", f"disk_bps_limit_mb = {disk_bps_limit_mb}"))


class NetUp(DsecUp):
    """`dsec up --config <network config>` (a wrapper script adds the flag)."""

    def __init__(self, binary: str, tag: str, config: str = CONFIG, table: str = TABLE, veth_prefix: str = "dst") -> None:
        self.table = table
        self.veth_prefix = veth_prefix
        self.node_config = config
        data = new_data_dir(tag)
        os.makedirs(data, exist_ok=True)
        cfg = os.path.join(data, "dsec.toml")
        with open(cfg, "w") as f:
            f.write(config)
        wrapper = os.path.join(data, "dsec-wrapper.sh")
        with open(wrapper, "w") as f:
            f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {binary} "$@" --config {cfg}; fi\nexec {binary} "$@"\n')
        os.chmod(wrapper, 0o755)
        super().__init__(wrapper, data, tag)

    def kill(self) -> None:
        """SIGKILL (simulated crash); reports where the process hangs if it does not die."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pid = self.proc.pid
                state = sh(f"cat /proc/{pid}/status | grep State; cat /proc/{pid}/task/*/wchan; echo; cat /proc/{pid}/task/*/stack", check=False).stdout
                raise AssertionError(f"dsec up {pid} survived SIGKILL for 30 s: {state}")

    def restart(self) -> "NetUp":
        """Starts `dsec up` again on the same data dir and port (after a stop or a kill)."""
        self.url = ""
        self.key = ""
        time.sleep(0.2)  # the old process's stdout pump has put its end marker by now
        self._stdout_lines = queue.Queue()
        return self.start()

    def spares(self) -> dict:
        """The edge's spare namespaces (built ahead of demand, no sandbox in them yet)."""
        nss = [n for n in os.listdir("/run/netns") if n.startswith(self.table + "-pool")] if os.path.isdir("/run/netns") else []
        veths = [n for n in os.listdir("/sys/class/net") if n.startswith(self.veth_prefix + "p")]
        return {k: v for k, v in dict(netns=nss, veths=veths).items() if v}

    def leftovers(self, spares: bool = False) -> dict:
        """Per-sandbox kernel objects of this edge that exist now: namespaces, veths, nft
        chains, loop devices backed by files under the data dir, mounts under it. Spare
        namespaces that are not in use (`<table>-pool<n>`, `<prefix>p<n>` without a verdict map
        entry) count only with `spares=True` (after the edge stopped, nothing may remain)."""
        used = set(re.findall(r'"([^"]+)" : jump sb_', sh(f"nft list table inet {self.table}", check=False).stdout))
        nss = [n for n in os.listdir("/run/netns") if n.startswith(self.table + "-")] if os.path.isdir("/run/netns") else []
        veths = [n for n in os.listdir("/sys/class/net") if n.startswith(self.veth_prefix)]
        if not spares:
            idle = {v for v in veths if v.startswith(self.veth_prefix + "p") and v not in used}
            veths = [v for v in veths if v not in idle]
            idle_ns = {f"{self.table}-pool{v[len(self.veth_prefix) + 1:]}" for v in idle}
            nss = [n for n in nss if n not in idle_ns]
        chains = [l.split()[1] for l in sh(f"nft list table inet {self.table}", check=False).stdout.splitlines()
                  if l.strip().startswith("chain sb_")]
        loops = [l for l in sh("losetup -a", check=False).stdout.splitlines() if self.data_dir in l]
        mounts = mounts_under(os.path.join(self.data_dir, "edge", "sandboxes"))
        return {k: v for k, v in dict(netns=nss, veths=veths, chains=chains, loops=loops, mounts=mounts).items() if v}

    def finish(self) -> int:
        rc = self.stop()
        # Nothing of the namespaces, veths, chains, loop devices or mounts may stay behind, and
        # after a clean stop with no sandbox left neither may the edge's table and gateway
        # interface (a restarted edge makes them again).
        left = {}
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            left = self.leftovers(spares=True)
            if not left:
                break
            time.sleep(0.2)
        remove_data_dir(self.data_dir)
        assert not left, f"leftover per-sandbox objects: {left}"
        if rc == 0:
            m = re.search(r'gateway_interface = "([^"]+)"', self.node_config)
            node_left = {k: v for k, v in dict(
                table=sh(f"nft list table inet {self.table}", check=False).returncode == 0,
                gateway=bool(m) and os.path.exists(f"/sys/class/net/{m.group(1)}")).items() if v}
            assert not node_left, f"left after a clean stop with no sandbox: {node_left}"
        return rc


class HostListener:
    """A TCP service of the host on every address (0.0.0.0 and ::), the way an operator's
    service or a mis-bound edge would listen; counts the connections it accepted."""

    __test__ = False

    def __init__(self) -> None:
        self.sock = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("::", 0))
        self.sock.listen(16)
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            try:
                conn.sendall(b"HTTP/1.0 200 OK\r\n\r\nhost-secret-service\n")
            finally:
                conn.close()

    def close(self) -> None:
        self.sock.close()


def get(url: str, timeout: int = 2) -> str:
    """A shell command fetching `url` (http://host[:port]/path, host a name, an IPv4 or a
    bracketed IPv6 address) inside a busybox sandbox with `nc` (busybox 1.35's `wget`
    segfaults, on the host as well). Exit status 0 and the body on stdout when it connects."""
    m = re.fullmatch(r"http://(\[[^\]]+\]|[^/:]+)(?::(\d+))?(/.*)?", url)
    if m is None:
        raise ValueError(url)
    host = m.group(1).strip("[]")
    port = m.group(2) or "80"
    path = m.group(3) or "/"
    return f"printf 'GET {path} HTTP/1.0\\r\\nHost: {host}\\r\\n\\r\\n' | nc -w {timeout} {host} {port}"


def denied(sb) -> int:
    return int(sb.network()["denied_packets"])


def run(sb, cmd: str, timeout: float = 30) -> tuple:
    r = sb.run_shell(cmd, timeout=timeout)
    return r.exit_code, r.stdout + r.stderr
