"""Restore-from-template microVM boots (issue 9).

The first create of a VM shape boots cold and has the edge build a template of that shape in the
background (one VM booted to Ready, synced, snapshotted); later creates of the shape restore the
template's snapshot and get their own identity (hostname, clock, fresh kernel randomness) over the
aether protocol. The module runs its own `dsec up` (templates on, the default) so that its
templates are its own and its stop can be checked: no QEMU, socket, snapshot or disk left.

Timing is not asserted here (bench/microvm.py measures it). Under TCG every boot costs seconds of
a core: the module boots two VMs cold (the first create and the template), restores the rest.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import pytest

from dsec import DSecMicroVMRunArgs
from helpers import DsecUp, find_dsec_bin, new_data_dir, remove_data_dir, sh, stop_quietly, wait_until
from vmfixture import qemu_pids_for

from helpers import microvm_skip_reason

# A shape no other test uses (the memory size is part of the shape).
MEMORY_MB = 288


def _create(client):
    return client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=MEMORY_MB), timeout=300)


@pytest.fixture(scope="module")
def tnode():
    reason = microvm_skip_reason()
    if reason:
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)
    binary = os.environ.get("DSEC_BIN") or find_dsec_bin()
    if not binary:
        pytest.skip("no dsec binary")
    data = new_data_dir("vmtpl")
    up = DsecUp(binary, data, f"tpl{os.getpid() % 100000}")
    try:
        up.start()
    except RuntimeError as e:
        remove_data_dir(data)
        pytest.fail(str(e), pytrace=False)
    up.templates_dir = Path(data) / "edge" / "microvm-templates"
    yield up
    if up.proc is not None and up.proc.poll() is None:
        up.stop()
    remove_data_dir(data)
    up.remove_log()


@pytest.fixture(scope="module")
def client(tnode):
    c = tnode.client()
    yield c
    c.close()


def _ready_templates(d: Path):
    if not d.is_dir():
        return []
    return [p for p in d.iterdir() if (p / "template.json").is_file() and not p.name.startswith(".")]


@pytest.fixture(scope="module")
def template(tnode, client):
    """The first create (cold) and the template it leads to (built in the background)."""
    first = _create(client)
    try:
        assert first.info.raw.get("boot") == "cold", first.info.raw
        assert sh(first, "echo ok").strip() == "ok"
        failed = lambda: "template build failed" in tnode.stderr_tail(200)  # noqa: E731
        wait_until(lambda: len(_ready_templates(tnode.templates_dir)) == 1 or failed(), timeout=240, interval=0.5)
        assert len(_ready_templates(tnode.templates_dir)) == 1, (
            f"no template built: {list(tnode.templates_dir.iterdir()) if tnode.templates_dir.exists() else None}\n"
            f"{tnode.stderr_tail(30)}"
        )
    finally:
        stop_quietly(first)
    t = _ready_templates(tnode.templates_dir)[0]
    print(f"\ntemplate {t.name}: snapshot {(t / 'snapshot').stat().st_size} bytes, "
          f"disk {(t / 'upper.img').stat().st_blocks * 512} bytes allocated")
    return t


@pytest.fixture(scope="module")
def clones(template, client, tnode):
    a, b = _create(client), _create(client)
    yield a, b
    if tnode.proc is not None and tnode.proc.poll() is None:  # else the edge stopped them
        stop_quietly(a)
        stop_quietly(b)


def test_second_create_is_templated(template, clones):
    meta = json.loads((template / "template.json").read_text())
    assert meta["key"] == template.name and "mem=288" in meta["shape"], meta
    for sb in clones:
        assert sb.info.raw.get("boot") == "template", sb.info.raw
        assert sh(sb, "echo ok").strip() == "ok"


def _templates_api(tnode, method="GET"):
    req = urllib.request.Request(f"{tnode.url}/v1/microvm/templates", method=method,
                                 headers={"Authorization": f"Bearer {tnode.key}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_templates_are_listed(template, clones, tnode):
    doc = _templates_api(tnode)
    assert [t["key"] for t in doc["templates"]] == [template.name], doc
    t = doc["templates"][0]
    assert t["uses"] >= 2 and t["bytes"] > 1_000_000 and "mem=288" in t["shape"], t
    assert doc["boots"]["cold"] >= 1 and doc["boots"]["template"] >= 2, doc
    assert doc["built"] == 1 and doc["build_failures"] == 0, doc


def test_clones_have_their_own_identity(clones):
    a, b = clones
    # Kernel randomness: reseeded per clone (never the template's stream).
    ua, ub = sh(a, "cat /proc/sys/kernel/random/uuid").strip(), sh(b, "cat /proc/sys/kernel/random/uuid").strip()
    assert ua and ub and ua != ub
    ra = sh(a, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").strip()
    rb = sh(b, "head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \\n'").strip()
    assert len(ra) == 64 and ra != rb
    # Hostname: the sandbox's own, in the kernel and in the shell's environment.
    ha, hb = sh(a, "hostname").strip(), sh(b, "hostname").strip()
    assert ha == a.info.hostname and hb == b.info.hostname and ha != hb and ha != "dsec-template"
    assert sh(a, "echo $HOSTNAME").strip() == ha
    # Wall clock: the host's now, not the template's snapshot time.
    guest = int(sh(a, "date +%s").strip())
    assert abs(guest - time.time()) < 10, (guest, time.time())


def test_clones_files_are_isolated(clones):
    a, b = clones
    a.write_file("/root/only-in-a", b"a's file\n")
    sh(a, "echo also > /etc/only-in-a")
    assert a.read_file("/root/only-in-a") == b"a's file\n"
    assert sh(b, "test -e /root/only-in-a || test -e /etc/only-in-a; echo $?").strip() == "1"
    b.write_file("/root/only-in-b", b"b\n")
    assert sh(a, "test -e /root/only-in-b; echo $?").strip() == "1"


def test_templated_vm_counter_pause_resume(clones, tnode):
    a, _ = clones
    vm_dir = Path(tnode.sandbox_dir(a.id)) / "vm"
    sh(a, "(i=0; while :; do i=$((i+1)); echo $i > /root/counter.new && mv /root/counter.new /root/counter; sleep 0.1; done) >/dev/null 2>&1 & echo started")
    assert wait_until(lambda: sh(a, "cat /root/counter 2>/dev/null || echo 0").strip() not in ("", "0"), timeout=10)
    before = int(sh(a, "cat /root/counter"))
    pids = qemu_pids_for(str(vm_dir))
    assert len(pids) == 1, pids
    info = a.pause()
    assert info.state == "paused"
    assert wait_until(lambda: not qemu_pids_for(str(vm_dir)), timeout=10), "QEMU still running while paused"
    assert (vm_dir / "snapshot").is_file()
    a.resume()
    time.sleep(0.5)
    after = int(sh(a, "cat /root/counter"))
    assert after > before, (before, after)
    assert sh(a, "echo ok").strip() == "ok"


def test_stop_of_templated_vm_leaves_nothing(template, client, tnode):
    sb = _create(client)
    assert sb.info.raw.get("boot") == "template", sb.info.raw
    vm_dir = Path(tnode.sandbox_dir(sb.id)) / "vm"
    assert len(qemu_pids_for(str(vm_dir))) == 1
    sb.stop()
    assert wait_until(lambda: not qemu_pids_for(str(vm_dir)) and not vm_dir.exists(), timeout=10), (
        f"left after stop: QEMU {qemu_pids_for(str(vm_dir))}, files {list(vm_dir.iterdir()) if vm_dir.exists() else []}"
    )
    # The template itself stays (immutable) for the next create.
    assert (template / "snapshot").is_file() and (template / "upper.img").is_file()


def test_corrupt_template_falls_back_to_cold_boot(template, client, tnode):
    # Runs after the other clones (module order): the template's snapshot is made garbage.
    snap = template / "snapshot"
    with open(snap, "r+b") as f:
        f.truncate(4096)
        f.seek(0)
        f.write(os.urandom(4096))
    sb = _create(client)
    try:
        assert sb.info.raw.get("boot") == "cold-fallback", sb.info.raw
        assert sh(sb, "echo ok").strip() == "ok"
        # The bad template was dropped (a new one of the shape may be under construction).
        assert not snap.exists() or snap.stat().st_size != 4096
    finally:
        stop_quietly(sb)


def test_edge_restart_after_crash_reuses_templates(tnode, clones):
    # The corrupt-template test's cold fallback rebuilt the shape's template: wait for it.
    assert wait_until(lambda: len(_ready_templates(tnode.templates_dir)) == 1, timeout=240, interval=0.5)
    key = _ready_templates(tnode.templates_dir)[0].name
    old_clone_dirs = [str(Path(tnode.sandbox_dir(sb.id)) / "vm") for sb in clones]
    # A crash: nothing is cleaned up.
    os.kill(tnode.pid, signal.SIGKILL)
    try:
        tnode.proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        stacks = {t: Path(f"/proc/{tnode.pid}/task/{t}/stack").read_text() for t in os.listdir(f"/proc/{tnode.pid}/task")}
        pytest.fail(f"dsec up did not exit within 60 s of SIGKILL: {stacks}")
    # The same node (data dir, id, port) starts again: fresh URL/key and stdout queue.
    tnode.url = tnode.key = ""
    tnode._stdout_lines = queue.Queue()
    tnode.start()
    # The crashed edge's running VMs end with their channel (not re-adoptable).
    assert wait_until(lambda: not any(qemu_pids_for(d) for d in old_clone_dirs), timeout=30)
    c = tnode.client()
    try:
        sb = _create(c)
        try:
            assert sb.info.raw.get("boot") == "template", sb.info.raw
            assert sh(sb, "echo ok").strip() == "ok"
            assert [t["key"] for t in _templates_api(tnode)["templates"]] == [key]
        finally:
            stop_quietly(sb)
    finally:
        c.close()


def test_templates_removed_on_request(tnode):
    assert _templates_api(tnode, "DELETE") == {"removed": 1}
    assert _ready_templates(tnode.templates_dir) == [] and _templates_api(tnode)["templates"] == []


def test_edge_stop_removes_templates(tnode, template):
    d = tnode.templates_dir
    rc = tnode.stop()
    assert rc == 0, tnode.stderr_tail()
    assert not d.exists(), f"templates left after the edge stopped: {list(d.iterdir())}"
    assert not qemu_pids_for(tnode.data_dir), f"QEMU left: {qemu_pids_for(tnode.data_dir)}"
