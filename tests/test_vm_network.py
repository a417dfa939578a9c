"""Network for microVMs and full VMs (issue 9 with issue 8): `network_mode` / `network_rules`
work for VMs as for containers, enforced on the host side.

The sandbox's network namespace (built by the edge as for a container, with the veth whose host
end carries the nftables chains, counters and the DNS proxy) becomes a bridge of the veth's
inner end and a tap; QEMU runs in that namespace and attaches the tap to a virtio-net device;
the guest carries the sandbox's own address (`crates/runtime/src/microvm/net.rs`).

Test servers for made-up `*.test` names live in a test network namespace (tests/netfixture.py).
Skips (with the reason) when QEMU or the guest artefacts are absent. Under TCG a boot costs
seconds of a core, so each VM runs many checks.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Optional

import pytest

import dsec
from dsec import DSecMicroVMRunArgs, DSecVMRunArgs
from helpers import find_dsec_bin, stop_quietly
from netfixture import CONFIG, NPM, PYPI, PYPI6, SRV_NS, TABLE, NetUp, TestServers, denied, get, run, sh
from vmfixture import missing, qemu_pids_for, skip_if

CACHE = Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec"))
GUEST = Path(os.environ.get("DSEC_GUEST_DIR") or CACHE / "guest")
VM_DISK = CACHE / "vm" / "debian.qcow2"
QEMU = os.environ.get("DSEC_QEMU", "qemu-system-x86_64")
BODY = "reference-solution-42"



def own_config(table: str, veth_prefix: str, n: int) -> str:
    """tests/netfixture.py's CONFIG with its own table, veth prefix, gateway interface
    (`dsect<n>`) and subnets (10.23<n>.0.0/16, fd00:d5e<n>::/64): edges on one host must not
    share them, so this edge can run beside another networked one."""
    return (CONFIG.replace(f'table = "{TABLE}"', f'table = "{table}"')
            .replace('veth_prefix = "dst"', f'veth_prefix = "{veth_prefix}"')
            .replace('gateway_interface = "dsect0"', f'gateway_interface = "dsect{n}"')
            .replace("10.231.0.0/16", f"10.23{n}.0.0/16")
            .replace("fd00:d5ed::/64", f"fd00:d5e{n}::/64"))


VM_TABLE = "dsectvm"
VM_CONFIG = own_config(VM_TABLE, "dsw", 9)
GATEWAY = "10.239.0.1"


@pytest.fixture(scope="module")
def vm_ok():
    skip_if(missing([QEMU], [GUEST / "vmlinuz", GUEST / "initrd.img"],
                    "scripts/install-deps.sh installs qemu-system-x86", "scripts/vm/build-guest.sh"))


@pytest.fixture(scope="module")
def servers(vm_ok):
    # The test servers' namespace and addresses are fixed (tests/netfixture.py): wait a while
    # for another run's servers to go before taking them over.
    deadline = time.monotonic() + 180
    while os.path.exists(f"/run/netns/{SRV_NS}") and time.monotonic() < deadline:
        time.sleep(1)
    s = TestServers().start()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def vnode(servers):
    b = find_dsec_bin()
    if b is None:
        pytest.skip("no dsec binary")
    up = NetUp(b, "vmnet", config=VM_CONFIG, table=VM_TABLE, veth_prefix="dsw")
    up.start()
    yield up
    assert up.finish() == 0


@pytest.fixture(scope="module")
def vclient(vnode):
    c = vnode.client()
    yield c
    c.close()


def ok(sb, cmd: str) -> bool:
    code, out = run(sb, cmd, timeout=60)
    return code == 0 and BODY in out


def host_links() -> set:
    return set(os.listdir("/sys/class/net"))


def netns_of(pid: int) -> Optional[str]:
    """The name under /run/netns of the network namespace process `pid` is in."""
    want = os.stat(f"/proc/{pid}/ns/net")
    for n in os.listdir("/run/netns"):
        st = os.stat(os.path.join("/run/netns", n))
        if (st.st_dev, st.st_ino) == (want.st_dev, want.st_ino):
            return n
    return None


def vm_dir_of(node, sb) -> Path:
    return Path(node.sandbox_dir(sb.id)) / "vm"


def wait_clean(node, vm_dir: Path, timeout: float = 15.0) -> dict:
    deadline = time.monotonic() + timeout
    left = {}
    while time.monotonic() < deadline:
        left = dict(node.leftovers())
        if qemu_pids_for(str(vm_dir)):
            left["qemu"] = qemu_pids_for(str(vm_dir))
        if vm_dir.exists():
            left["vm_dir"] = str(vm_dir)
        if not left:
            return {}
        time.sleep(0.2)
    return left


def test_microvm_allowlist_dns_rule_change_pause_and_cleanup(vclient, vnode):
    links_before = host_links()
    sb = vclient.run_microvm(DSecMicroVMRunArgs(
        container_image="busybox", memory_limit_mb=256,
        network={"mode": "allowlist", "rules": [{"cidr": f"{NPM}/32", "ports": "80", "protocol": "tcp"}]},
        network_rules={"pypi": True, "npm": False}), timeout=300)
    vm_dir = vm_dir_of(vnode, sb)
    try:
        st = sb.network()
        assert st["mode"] == "allowlist" and st["ipv4"].startswith("10.239."), st
        # The guest (its own kernel) carries the sandbox's address on its virtio NIC.
        code, out = run(sb, "ip -o addr show; ip route; cat /etc/resolv.conf")
        assert code == 0 and f"inet {st['ipv4']}/32" in out, out
        assert f"default via {GATEWAY}" in out and f"nameserver {GATEWAY}" in out, out
        # Host side: QEMU runs in the sandbox's namespace, which bridges the veth and the tap;
        # nothing of it is on the host's own interface list.
        pids = qemu_pids_for(str(vm_dir))
        assert len(pids) == 1, pids
        ns = netns_of(pids[0])
        assert ns is not None and ns.startswith(vnode.table + "-"), ns
        links = sh(f"ip -n {ns} -o link show").stdout
        assert "tap0:" in links and "br0:" in links and "master br0" in links, links
        assert not any(l.startswith("tap") for l in host_links() - links_before)

        # Allowed by the CIDR rule; an allowed host on another port is dropped and counted.
        assert ok(sb, get(f"http://{NPM}/"))
        d0 = denied(sb)
        assert not ok(sb, get(f"http://{PYPI}:8080/"))
        assert not ok(sb, get(f"http://{PYPI}/")), "pypi's address is not allowed before DNS grants it"
        assert denied(sb) > d0, "denied connections from the VM must be counted"

        # The DNS proxy: an allowed group's name resolves (and its address is granted), a
        # blocked group's name is refused.
        assert ok(sb, get("http://pypi.test/"))
        refused0 = sb.network()["dns_refused"]
        code, out = run(sb, "nslookup npm.test")
        assert NPM not in out, out
        assert sb.network()["dns_refused"] > refused0

        # A rule change in the middle of the session takes effect (host-side nft only).
        run(sb, "export MARK=kept; cd /tmp")
        t0 = time.monotonic()
        sb.set_network_rules([{"cidr": f"{PYPI}/32", "ports": "8080", "protocol": "tcp"}])
        assert ok(sb, get(f"http://{PYPI}:8080/"))
        assert time.monotonic() - t0 < 15
        assert not ok(sb, get(f"http://{NPM}/")), "the replaced CIDR rule must no longer allow"
        # IPv6 too (the guest's /128 behind fe80::1, the same host-side rules): the change
        # dropped pypi.test's DNS grants (its AAAA included); a v6 rule opens it again.
        assert not ok(sb, get(f"http://[{PYPI6}]/"))
        sb.set_network_rules([{"cidr": f"{PYPI}/32", "ports": "8080", "protocol": "tcp"},
                              {"cidr": "fd42:7::/64", "ports": "80", "protocol": "tcp"}])
        assert ok(sb, get(f"http://[{PYPI6}]/"))
        assert run(sb, "echo $MARK $(pwd)")[1].strip() == "kept /tmp"

        # Pause ends QEMU (the tap stays in the namespace); resume attaches a new QEMU to it.
        sb.pause()
        assert not qemu_pids_for(str(vm_dir)), "QEMU still running while paused"
        assert "tap0:" in sh(f"ip -n {ns} -o link show").stdout
        sb.resume()
        assert ok(sb, get(f"http://{PYPI}:8080/"))
        new = qemu_pids_for(str(vm_dir))
        assert len(new) == 1 and netns_of(new[0]) == ns
    finally:
        stop_quietly(sb)
    left = wait_clean(vnode, vm_dir)
    assert not left, f"left after stop: {left}"
    assert not os.path.exists(f"/run/netns/{ns}")
    assert not any(l.startswith(("tap", "br")) for l in host_links() - links_before)


def test_microvm_none_mode_has_no_nic(vclient, vnode):
    sb = vclient.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=256), timeout=300)
    vm_dir = vm_dir_of(vnode, sb)
    try:
        assert sb.network()["mode"] == "none"
        code, out = run(sb, "ls /sys/class/net")
        assert code == 0 and out.split() == ["lo"], out
        pids = qemu_pids_for(str(vm_dir))
        assert len(pids) == 1
        cmdline = Path(f"/proc/{pids[0]}/cmdline").read_bytes()
        assert b"-netdev" not in cmdline and b"virtio-net" not in cmdline
        assert not ok(sb, get(f"http://{NPM}/"))
        # Like a container in mode none, it cannot be opened later.
        with pytest.raises(dsec.DSecError):
            sb.set_network_rules([{"cidr": f"{NPM}/32"}], mode="allowlist")
    finally:
        stop_quietly(sb)
    assert not wait_clean(vnode, vm_dir)


PY_GET = ("python3 -c \"import sys,urllib.request;"
          "sys.stdout.write(urllib.request.urlopen('{url}',timeout=3).read().decode())\"")


def test_full_vm_allowed_and_denied(vclient, vnode):
    skip_if(missing([QEMU, "qemu-img"], [VM_DISK], "scripts/install-deps.sh", "scripts/vm/build-disk.sh"))
    sb = vclient.run_vm(DSecVMRunArgs(image="debian", memory_limit_mb=512, network={
        "mode": "allowlist", "rules": [{"cidr": f"{NPM}/32", "ports": "80", "protocol": "tcp"}]}), timeout=600)
    vm_dir = vm_dir_of(vnode, sb)
    try:
        st = sb.network()
        assert st["mode"] == "allowlist"
        code, out = run(sb, "cat /etc/resolv.conf; cat /proc/net/route")
        assert f"nameserver {GATEWAY}" in out, out
        assert ok(sb, PY_GET.format(url=f"http://{NPM}/"))
        d0 = denied(sb)
        assert not ok(sb, PY_GET.format(url=f"http://{PYPI}:8080/"))
        assert denied(sb) > d0
    finally:
        stop_quietly(sb)
    assert not wait_clean(vnode, vm_dir, timeout=30)


NET = {"mode": "allowlist", "rules": [{"cidr": f"{NPM}/32", "ports": "80", "protocol": "tcp"}]}


def test_repeated_cycles_failed_create_and_edge_crash_leave_nothing(vclient, vnode):
    """Last in the file: it kills and restarts the module's edge."""
    links_before = host_links()
    for _ in range(2):
        sb = vclient.run_microvm(DSecMicroVMRunArgs(container_image="busybox", network=NET), timeout=300)
        vm_dir = vm_dir_of(vnode, sb)
        try:
            assert ok(sb, get(f"http://{NPM}/"))
        finally:
            stop_quietly(sb)
        left = wait_clean(vnode, vm_dir)
        assert not left, f"left after stop: {left}"
    # A create that fails in the guest (aether refuses an unknown init_user before Ready): the
    # namespace, veth, chains and QEMU go with it.
    with pytest.raises(dsec.DSecError):
        vclient.run_microvm(DSecMicroVMRunArgs(container_image="busybox", network=NET, init_user="no-such-user"),
                            timeout=300)
    left = wait_clean(vnode, Path(vnode.data_dir) / "no-such-dir")
    assert not left and not qemu_pids_for(vnode.data_dir), f"left after a failed create: {left}"
    # The edge crashes with two networked microVMs: one paused, one running (mode open). The
    # restarted edge re-adopts the paused one, whose resume enters the same namespace again, and
    # reaps the running one's namespace, veth and chains (its QEMU ends with its channel).
    kept = vclient.run_microvm(DSecMicroVMRunArgs(container_image="busybox", network=NET), timeout=300)
    kept_dir = vm_dir_of(vnode, kept)
    assert ok(kept, get(f"http://{NPM}/"))
    kept_ns = netns_of(qemu_pids_for(str(kept_dir))[0])
    kept.pause()
    norm = lambda d: {k: sorted(v) for k, v in d.items()}  # noqa: E731
    with_kept = norm(vnode.leftovers())
    assert kept_ns in with_kept["netns"], with_kept
    sb = vclient.run_microvm(DSecMicroVMRunArgs(container_image="busybox", network={"mode": "open"}),
                             timeout=300)
    vm_dir = vm_dir_of(vnode, sb)
    assert ok(sb, get(f"http://{NPM}/")) and ok(sb, get(f"http://{PYPI}:8080/")), "mode open reaches any port"
    assert len(qemu_pids_for(str(vm_dir))) == 1
    vnode.kill()
    vnode.restart()
    deadline = time.monotonic() + 60
    left = {}
    while time.monotonic() < deadline:
        now = norm(vnode.leftovers())
        left = {} if now == with_kept else {"now": now, "expected": with_kept}
        if qemu_pids_for(str(vm_dir)):
            left["qemu"] = qemu_pids_for(str(vm_dir))
        if not left:
            break
        time.sleep(0.5)
    assert not left, f"left after an edge crash and restart: {left}"
    try:
        assert ok(kept, get(f"http://{NPM}/")), "the re-adopted VM's network after its resume"
        assert not ok(kept, get(f"http://{PYPI}:8080/"))
        assert netns_of(qemu_pids_for(str(kept_dir))[0]) == kept_ns
    finally:
        stop_quietly(kept)
    left = wait_clean(vnode, kept_dir)
    assert not left, f"left after stop: {left}"
    assert not any(l.startswith(("tap", "br")) for l in host_links() - links_before)
