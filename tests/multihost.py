"""A multi-host test bed on one machine (issue 22, "Must show"): every test host is a network
namespace of its own, with its own address on a veth link to a bridge in a "switch"
namespace, so servers bind to that address (nothing through 127.0.0.1) and traffic only flows
among the hosts the test created. `Host.partition()` drops the host's traffic with nftables in
its own namespace (a network partition), `heal()` removes the drop.

```python
bed = TestBed("mh", 3)                  # hosts mh0..mh2 at 10.<n>.0.1.. on one bridge
try:
    bed.hosts[1].popen(["dsec", "edge", "--listen", f"{bed.hosts[1].addr}:7701", ...])
    bed.hosts[1].partition(); ...; bed.hosts[1].heal()
finally:
    bed.close()                          # processes, namespaces, links: nothing left
```

Done: the hosts, links, partition/heal, cleanup (tests/test_multihost_bed.py). Not done yet:
the apiservers/edges/PostgreSQL placed on them and the fault-under-load tests.
"""

from __future__ import annotations

import os
import signal
import subprocess
from typing import List, Optional


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(list(argv), capture_output=True, text=True, check=check, timeout=30)


class Host:
    """One test host: a network namespace with one address."""

    def __init__(self, bed: "TestBed", name: str, addr: str):
        self.bed, self.name, self.addr = bed, name, addr
        self.procs: List[subprocess.Popen] = []

    def argv(self, argv: List[str]) -> List[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: List[str], check: bool = True, timeout: float = 60) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(argv), capture_output=True, text=True, check=check, timeout=timeout)

    def popen(self, argv: List[str], **kw) -> subprocess.Popen:
        p = subprocess.Popen(self.argv(argv), **kw)
        self.procs.append(p)
        return p

    def partition(self) -> None:
        """Drops every packet in and out of this host (loopback excepted)."""
        rules = ("table inet dsecpart {\n"
                 " chain in { type filter hook input priority -10; iifname != \"lo\" drop; }\n"
                 " chain out { type filter hook output priority -10; oifname != \"lo\" drop; }\n"
                 "}\n")
        subprocess.run(self.argv(["nft", "-f", "-"]), input=rules, capture_output=True, text=True,
                       check=True, timeout=30)

    def heal(self) -> None:
        self.run(["nft", "delete", "table", "inet", "dsecpart"], check=False)

    def stop_processes(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                try:
                    p.send_signal(signal.SIGCONT)
                    p.send_signal(signal.SIGTERM)
                    p.wait(timeout=30)
                except (subprocess.TimeoutExpired, ProcessLookupError):
                    p.kill()
                    p.wait(timeout=10)
        self.procs = []


class TestBed:
    """`count` hosts named `<prefix>0..` on one bridge (in namespace `<prefix>sw`), addresses
    10.<octet>.0.<i+1>/24 (octet derived from the pid unless given)."""

    __test__ = False

    def __init__(self, prefix: str, count: int, octet: Optional[int] = None):
        self.prefix = prefix
        self.switch = f"{prefix}sw"
        self.octet = octet if octet is not None else 100 + os.getpid() % 100
        self.hosts: List[Host] = []
        self._links: List[str] = []
        try:
            _run("ip", "netns", "add", self.switch)
            _run("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
            _run("ip", "-n", self.switch, "link", "set", "br0", "up")
            for i in range(count):
                self._add_host(i)
        except BaseException:
            self.close()
            raise

    def _add_host(self, i: int) -> None:
        name = f"{self.prefix}{i}"
        addr = f"10.{self.octet}.0.{i + 1}"
        _run("ip", "netns", "add", name)
        host_if, sw_if = f"{self.prefix}h{i}", f"{self.prefix}s{i}"
        _run("ip", "link", "add", host_if, "type", "veth", "peer", "name", sw_if)
        self._links.append(host_if)
        _run("ip", "link", "set", host_if, "netns", name)
        _run("ip", "link", "set", sw_if, "netns", self.switch)
        _run("ip", "-n", self.switch, "link", "set", sw_if, "master", "br0", "up")
        _run("ip", "-n", name, "addr", "add", f"{addr}/24", "dev", host_if)
        _run("ip", "-n", name, "link", "set", host_if, "up")
        _run("ip", "-n", name, "link", "set", "lo", "up")
        self.hosts.append(Host(self, name, addr))

    def close(self) -> None:
        for h in self.hosts:
            h.stop_processes()
            _run("ip", "netns", "del", h.name, check=False)
        _run("ip", "netns", "del", self.switch, check=False)
        for link in self._links:  # gone with their namespaces; this catches a half-built host
            _run("ip", "link", "del", link, check=False)
        self.hosts = []

    @staticmethod
    def namespaces() -> List[str]:
        r = _run("ip", "netns", "list", check=False)
        return [line.split()[0] for line in r.stdout.splitlines() if line.strip()]
