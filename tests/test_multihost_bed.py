"""The multi-host test bed itself (tests/multihost.py): hosts reach each other by their own
addresses, a partition cuts a host off and healing restores it, and closing leaves no
namespace behind."""

from __future__ import annotations

import os

import pytest

from multihost import Host, TestBed


def probe(client: Host, server: Host) -> bool:
    code = f"import urllib.request as u; u.urlopen('http://{server.addr}:18080/', timeout=2)"
    return client.run(["python3", "-c", code], check=False).returncode == 0


def test_hosts_reach_each_other_partition_and_heal():
    if os.geteuid() != 0:
        pytest.skip("network namespaces need root")
    prefix = f"mh{os.getpid() % 10000}x"
    bed = TestBed(prefix, 3)
    try:
        a, b, c = bed.hosts
        for h in (a, b):  # servers bound to the hosts' own addresses
            h.popen(["python3", "-m", "http.server", "--bind", h.addr, "18080"])
        assert any(probe(c, b) for _ in range(20)), "the server on host b did not answer host c"
        assert any(probe(c, a) for _ in range(20)), "the server on host a did not answer host c"
        b.partition()
        assert not probe(c, b), "a partitioned host still answered"
        assert probe(c, a), "the partition cut other hosts too"
        b.heal()
        assert probe(c, b), "healing did not restore host b"
    finally:
        bed.close()
    left = [n for n in TestBed.namespaces() if n.startswith(prefix)]
    assert not left, f"namespaces left: {left}"
