"""Lifecycle: stop cleans up everything, repeated cycles leak nothing, crash + restart recovers."""

from __future__ import annotations

import asyncio
import os

import pytest

import dsec
from dsec import DSecContainerRunArgs
from helpers import (
    DsecUp,
    dsec_cgroups,
    dsec_processes,
    force_cleanup,
    make_sandbox,
    mounts_under,
    new_data_dir,
    remove_data_dir,
    sh,
    wait_until,
)


def snapshot(node) -> dict:
    sandboxes = os.path.join(node.data_dir, "edge", "sandboxes")
    # A stopped sandbox's directory leaves sandboxes/ with one rename into trash/ and is
    # removed from there in the background: both must end up empty.
    trash = os.path.join(node.data_dir, "edge", "trash")
    return {
        "mounts": sorted(mounts_under(node.data_dir)),
        "cgroups": sorted(dsec_cgroups(f"/{node.node_id}/")),
        "procs": sorted(dsec_processes(f"/{node.node_id}/")),
        "dirs": sorted(os.listdir(sandboxes)) if os.path.isdir(sandboxes) else [],
        "trash": sorted(os.listdir(trash)) if os.path.isdir(trash) else [],
    }


def added(before: dict, after: dict) -> dict:
    """What `after` holds that `before` did not (a leak). Shared layer mounts of images no
    sandbox uses any more may go away meanwhile (idle unmount); that is not a leak."""
    return {k: sorted(set(after[k]) - set(before[k])) for k in after if set(after[k]) - set(before[k])}


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/task"))


def warm_up(client) -> None:
    """Create and stop one sandbox so that shared, cached state (layer mounts) exists."""
    sb = make_sandbox(client, "busybox")
    sh(sb, "true")
    sb.stop()


def test_stop_removes_everything(node, client):
    warm_up(client)
    before = snapshot(node)
    sb = make_sandbox(client, "busybox")
    sh(sb, "sleep 1000 >/dev/null 2>&1 & echo data > /tmp/f")
    sid = sb.id
    sb_dir = node.sandbox_dir(sid)
    assert os.path.isdir(sb_dir), f"sandbox dir {sb_dir} missing while running"
    cgs = dsec_cgroups(sid)
    procs = dsec_processes(sid)
    assert cgs, f"no cgroup containing {sid} under /sys/fs/cgroup/*/dsec"
    assert procs, f"no process in a cgroup of {sid}"
    info = sb.stop()
    assert info.state == "stopped"
    assert not os.path.exists(sb_dir), f"{sb_dir} left after stop: {os.listdir(sb_dir)}"
    assert not dsec_cgroups(sid), f"cgroups left after stop: {sorted(dsec_cgroups(sid))}"
    assert wait_until(lambda: not dsec_processes(sid), 5), f"processes left after stop: {dsec_processes(sid)}"
    for pid in procs:
        assert not os.path.exists(f"/proc/{pid}"), f"pid {pid} ({procs[pid]}) still alive after stop"
    # The directory's removal finishes right after the answer (background, from trash/).
    assert wait_until(lambda: not added(before, snapshot(node)), 5), \
        f"left after create+stop: {added(before, snapshot(node))}"
    try:
        again = client.get_sandbox(sid)
        assert again.state in ("stopped", "failed")
    except dsec.SandboxNotFound:
        pass
    with pytest.raises((dsec.SandboxNotFound, dsec.Conflict, dsec.SandboxDead)):
        sb.run_shell("echo should-fail")


def test_many_cycles_leak_nothing(node, client):
    warm_up(client)
    before = snapshot(node)
    fds0, threads0 = fd_count(node.pid), thread_count(node.pid)
    cycles, workers = 200, 4

    async def worker(aclient, n, errors):
        for _ in range(n):
            sb = await aclient.run_container(DSecContainerRunArgs(container_image="busybox"))
            try:
                r = await sb.run_shell("echo cycle")
                if r.stdout != "cycle\n":
                    errors.append(r)
            finally:
                await sb.stop()

    async def main():
        errors = []
        async with node.aclient() as aclient:
            await asyncio.gather(*(worker(aclient, cycles // workers, errors) for _ in range(workers)))
        return errors

    errors = asyncio.run(main())
    assert not errors, f"{len(errors)} cycles gave wrong output, first: {errors[0]}"
    assert wait_until(lambda: not added(before, snapshot(node)), 10), \
        f"leak after {cycles} cycles: {added(before, snapshot(node))}"
    fds1, threads1 = fd_count(node.pid), thread_count(node.pid)
    assert fds1 - fds0 < 32, f"dsec up fds grew from {fds0} to {fds1} over {cycles} cycles"
    assert threads1 - threads0 < 32, f"dsec up threads grew from {threads0} to {threads1}"


def test_sigkill_and_restart_readopts_and_leaves_no_orphans(dsec_bin):
    """`kill -9` of dsec up: the sandboxes outlive it and the restarted edge re-adopts them
    (same processes, state intact); a clean shutdown afterwards leaves nothing behind."""
    data = new_data_dir("crash")
    node_id = "e2ecrash"
    up = DsecUp(dsec_bin, data, node_id).start()
    old_ids = []
    try:
        with up.client() as c:
            for _ in range(2):
                sb = make_sandbox(c, "busybox")
                sh(sb, "sleep 1000 >/dev/null 2>&1 & echo x > /tmp/state")
                old_ids.append(sb.id)
        old_procs = {sid: dsec_processes(sid) for sid in old_ids}
        assert all(old_procs.values()), f"sandbox processes not found before the crash: {old_procs}"
        key = up.key
        up.kill()

        up2 = DsecUp(dsec_bin, data, node_id).start()
        up = up2
        assert up2.key == key, "the admin key changed across a restart on the same data dir"
        with up2.client() as c:
            for sid in old_ids:
                info = c.get_sandbox(sid)
                assert info.state == "running", f"{sid} reported {info.state} after the restart: {info.reason}"
                h = c.attach(sid)
                h._inner.auto_step = False  # new calls, not a replay of the old ones
                assert sh(h, "cat /tmp/state") == "x\n"
                for pid in old_procs[sid]:
                    assert os.path.exists(f"/proc/{pid}"), f"re-adopted sandbox lost pid {pid} {old_procs[sid][pid]}"
            sb = make_sandbox(c, "busybox")
            assert sh(sb, "echo new-works") == "new-works\n"
            sb.stop()
        rc = up2.stop()
        assert rc == 0, f"restarted dsec up exited {rc}\n{up2.stderr_tail()}"
        assert not mounts_under(data), f"mounts left after shutdown: {mounts_under(data)}"
        left = {c for c in dsec_cgroups(f"/{node_id}/") if "/sb-" in c}
        assert not left, f"sandbox cgroups left after shutdown: {sorted(left)}"
        assert not dsec_processes(f"/{node_id}/"), f"processes left: {dsec_processes(f'/{node_id}/')}"
        trash = os.path.join(data, "edge", "trash")
        assert not os.path.isdir(trash) or not os.listdir(trash), f"trash left: {os.listdir(trash)}"
        up2.remove_log()
    finally:
        if up.proc is not None and up.proc.poll() is None:
            try:
                up.stop()
            except AssertionError:
                pass
        done = force_cleanup(data, f"/{node_id}/")
        if done:
            print(f"crash test cleanup: {done}")
        remove_data_dir(data)


def test_cgroup_favordynmods_is_on(node):
    """The edge turns the node's cgroup `favordynmods` setting on at start (cheap cgroup.procs
    moves) and reports it; on a v1 host the kernel shows the option on the edge's hierarchy."""
    import json
    import subprocess
    import tempfile

    doc = json.loads(node.cli("nodes", "--json").stdout)
    n = next(n for n in doc["nodes"] if n["node"] == node.node_id)
    cap = n["capabilities"]["cgroup_favordynmods"]
    assert cap["available"] is True, cap
    if n["capabilities"]["cgroup_version"] != "v1":
        assert any(
            " - cgroup2 " in l and "favordynmods" in l for l in open("/proc/self/mountinfo")
        ), cap
        return
    # A second mount of the edge's named hierarchy, made WITHOUT asking for the option, shows
    # the options of the existing hierarchy: the one the edge holds with favordynmods.
    d = tempfile.mkdtemp(prefix="dsec-favor-")
    try:
        subprocess.run(["mount", "-t", "cgroup", "-o", "none,name=dsec_favordynmods", "cgroup", d],
                       check=True, capture_output=True)
        try:
            line = next(l for l in open("/proc/self/mountinfo") if l.split(" ")[4] == d)
            assert "favordynmods" in line, line
        finally:
            subprocess.run(["umount", d], check=True)
    finally:
        os.rmdir(d)
