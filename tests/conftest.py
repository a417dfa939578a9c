"""End-to-end suite: runs the real `dsec up` binary and drives it through the Python SDK and CLI.

Run as root from the repository root: ``python3 -m pytest tests``.

Environment:
- ``DSEC_BIN``: the dsec binary (default ``target/release/dsec``, then ``target/debug/dsec``).
- ``DSEC_CACHE``: where ``debian-bookworm.tar`` lives (default ``/var/cache/dsec``; built by
  ``scripts/images/build-debian.sh``). Tests that need ``debian`` skip when it is absent.
- ``DSEC_AETHER``: the aether binary given to ``dsec up`` (default: the static release build
  ``target/x86_64-unknown-linux-gnu/release/dsec-aether`` when present).
"""

from __future__ import annotations

import os
import sys
from typing import Dict

import pytest

from helpers import (
    DsecUp,
    debian_tar,
    dsec_cgroups,
    dsec_processes,
    find_dsec_bin,
    force_cleanup,
    make_microvm,
    make_sandbox,
    microvm_skip_reason,
    mounts_under,
    new_data_dir,
    remove_data_dir,
    stop_quietly,
)


# ---------------------------------------------------------------------------------------------
# whole-suite gate


def pytest_collection_modifyitems(config, items):
    if os.geteuid() != 0:
        reason = "the dsec end-to-end suite needs root (namespaces, mounts, cgroups); run it as root"
        print(f"\nSKIP: {reason}", file=sys.stderr)
        for item in items:
            item.add_marker(pytest.mark.skip(reason=reason))


# ---------------------------------------------------------------------------------------------
# fixtures


@pytest.fixture(scope="session")
def dsec_bin() -> str:
    b = find_dsec_bin()
    if b is None:
        pytest.skip("no dsec binary: set DSEC_BIN or run `cargo build --release -p dsec` (and build dsec-aether)")
    return b


def _b36(n: int) -> str:
    digits = "0123456789abcdefghijklmnopqrstuvwxyz"
    return digits[n // 36 % 36] + digits[n % 36]


# The suite's node names its network objects apart from any other edge on the host (a `dsec up`
# of the README's setup, another run of this suite): one edge per nftables table and name
# prefixes, a second one is refused networking.
_P = os.getpid()
MAIN_NODE_CONFIG = f"""
[edge.network]
subnet_v4 = "10.{100 + _P % 50}.0.0/16"
subnet_v6 = "fd00:e2e:{_P % 65536:x}::/64"
table = "dsece{_P}"
veth_prefix = "z{_b36(_P)}"  # no host interface starts with z
gateway_interface = "dsg{_P}"
[apiserver]
sandbox_domain = "sbx.dsec.test"  # exposed ports by host name (test_ports.py)
[apiserver.e2b]
cpu_cores = 0.25  # sandboxes made through the E2B API (test_e2b_api.py makes 64 at once)
memory_mb = 256
"""


@pytest.fixture(scope="session")
def node(dsec_bin):
    """The suite's shared `dsec up` (node id `e2e<pid>`, unique so that concurrent runs of the
    suite never reap each other's sandboxes), stopped with SIGTERM at the end."""
    data = new_data_dir("main")
    node_id = f"e2e{os.getpid()}"
    up = DsecUp(dsec_bin, data, node_id, config=MAIN_NODE_CONFIG)
    try:
        up.start()
    except RuntimeError as e:
        remove_data_dir(data)
        pytest.fail(str(e), pytrace=False)
    yield up
    rc = up.stop()
    leftover_mounts = mounts_under(data)
    # the node's parent cgroup (dsec/e2e) may stay, like a runtime's top-level dir; sandbox ones may not
    leftover_cgroups = {c for c in dsec_cgroups(f"/{node_id}/") if "/sb-" in c}
    leftover_procs = dsec_processes(f"/{node_id}/")
    cleanup = force_cleanup(data, f"/{node_id}/") if (leftover_mounts or leftover_cgroups or leftover_procs) else []
    remove_data_dir(data)
    assert rc == 0, f"dsec up exited {rc} after SIGTERM\nstderr:\n{up.stderr_tail()}"
    assert not leftover_mounts, f"mounts left after dsec up exited: {leftover_mounts} (cleanup: {cleanup})"
    assert not leftover_cgroups, f"cgroups left after dsec up exited: {sorted(leftover_cgroups)} (cleanup: {cleanup})"
    assert not leftover_procs, f"processes left after dsec up exited: {leftover_procs}"
    up.remove_log()  # kept only when something above failed


@pytest.fixture(scope="session")
def client(node):
    c = node.client()
    yield c
    c.close()


_debian_state: Dict[str, str] = {}


@pytest.fixture(scope="session")
def debian(node) -> str:
    """Imports `debian` from the cached tarball once; skips tests when the tarball is absent."""
    tar = debian_tar()
    if not tar.is_file():
        pytest.skip(f"{tar} is absent (build it with scripts/images/build-debian.sh); skipping debian tests")
    if "error" in _debian_state:
        pytest.fail(_debian_state["error"], pytrace=False)
    if "ok" not in _debian_state:
        proc = node.cli("image", "import", "debian", "--tar", str(tar), timeout=900, check=False)
        if proc.returncode != 0:
            _debian_state["error"] = (
                f"`dsec image import debian --tar {tar}` exited {proc.returncode}: "
                f"{proc.stderr.decode(errors='replace')[-3000:]}"
            )
            pytest.fail(_debian_state["error"], pytrace=False)
        _debian_state["ok"] = "debian"
    return "debian"


@pytest.fixture
def bb(client):
    """A fresh busybox sandbox, stopped afterwards."""
    sb = make_sandbox(client, "busybox")
    yield sb
    stop_quietly(sb)


@pytest.fixture
def deb(client, debian):
    """A fresh debian sandbox, stopped afterwards."""
    sb = make_sandbox(client, debian)
    yield sb
    stop_quietly(sb)


# ---------------------------------------------------------------------------------------------
# substrates (issue 9): a module's tests against a busybox container and a debian microVM
#
# A module uses them by taking `sb` (or `substrate`): pytest then runs each of its tests once per
# substrate, ids `[container]` / `[microvm]`. The microVM variant shares one VM per module (a
# boot under TCG costs seconds): before each test the sessions it may have used are closed, so
# every test starts with fresh shells (and their processes gone); files stay.

SESSIONS_USED = ("default", "a", "b", "s0", "s1", "s2")


@pytest.fixture(scope="session")
def microvm_ok():
    reason = microvm_skip_reason()
    if reason:
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)


@pytest.fixture(scope="module", params=["container", "microvm"])
def substrate(request) -> str:
    """`container` or `microvm`; the microvm param skips (with the reason) where no microVM can run."""
    if request.param == "microvm":
        request.getfixturevalue("microvm_ok")
    return request.param


@pytest.fixture(scope="module")
def module_vm(microvm_ok, client, debian):
    """One microVM booted from `debian` (512 MB), shared by a module's microvm-param tests."""
    sb = make_microvm(client, debian, memory_limit_mb=512)
    yield sb
    stop_quietly(sb)


@pytest.fixture
def sb(substrate, request, client):
    """The sandbox under test: a fresh busybox container, or the module's debian microVM with
    fresh sessions."""
    if substrate == "container":
        s = make_sandbox(client, "busybox")
        yield s
        stop_quietly(s)
        return
    vm = request.getfixturevalue("module_vm")
    for name in SESSIONS_USED:
        vm.close_session(name)
    yield vm
