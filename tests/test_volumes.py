"""Named persistent volumes (issue 18 item 2), from the SDK, checked from inside the sandboxes.

One `dsec up` of this module's own (its data dir and node id), so that the crash-and-restart test
can kill it and the leak checks at the end see only this module's volumes: after every sandbox
ended and the node shut down, no mount is left under its data dir and no loop device is
attached to a volume image.
"""

from __future__ import annotations

import json
import os
import subprocess

import pytest

import dsec
from helpers import (
    DsecUp,
    force_cleanup,
    http,
    make_sandbox,
    microvm_skip_reason,
    mounts_under,
    new_data_dir,
    remove_data_dir,
    sh,
    stop_quietly,
    wait_until,
)

NODE = f"vol{os.getpid() % 100000}"


def loop_devices_under(path: str):
    """Loop devices whose backing file is under ``path`` (``losetup -a``)."""
    out = subprocess.run(["losetup", "-a"], capture_output=True, text=True).stdout
    return [l for l in out.splitlines() if path in l]


def volume_mounts(up) -> list:
    return [m for m in mounts_under(up.data_dir) if "/edge/volumes/" in m]


class Node:
    """The module's `dsec up`; `restart_after_crash` swaps in a new process on the same data dir."""

    def __init__(self, binary: str):
        self.data = new_data_dir("volumes")
        self.binary = binary
        self.up = DsecUp(binary, self.data, NODE).start()
        self.client = self.up.client()

    def restart_after_crash(self) -> None:
        self.client.close()
        self.up.kill()
        self.up = DsecUp(self.binary, self.data, NODE).start()
        self.client = self.up.client()


@pytest.fixture(scope="module")
def node(dsec_bin):
    n = Node(dsec_bin)
    yield n
    n.client.close()
    rc = n.up.stop()
    mounts = mounts_under(n.data)
    loops = loop_devices_under(n.data)
    cleanup = force_cleanup(n.data, f"/{NODE}/") if mounts else []
    for l in loops:
        subprocess.run(["losetup", "-d", l.split(":")[0]], capture_output=True)
    remove_data_dir(n.data)
    assert rc == 0, f"dsec up exited {rc}\n{n.up.stderr_tail()}"
    assert not mounts, f"mounts left after dsec up exited: {mounts} (cleanup: {cleanup})"
    assert not loops, f"loop devices of volume images left: {loops}"
    n.up.remove_log()


def released(node, name: str) -> bool:
    """The volume is mounted by no sandbox and not on the host, and its loop device is gone."""
    info = node.client.get_volume(name)
    vol_dir = os.path.join(node.data, "edge", "volumes", info.id)
    return not info.used_by and not mounts_under(vol_dir) and not loop_devices_under(vol_dir)


def test_written_by_one_sandbox_read_by_the_next(node):
    c = node.client
    v = c.create_volume("shared", 32)
    assert (v.name, v.size_mb, v.node) == ("shared", 32, NODE)
    assert [x.name for x in c.list_volumes()] == ["shared"]
    a = make_sandbox(c, volumes={"/data": "shared"})
    try:
        sh(a, "echo from-a > /data/note && mkdir -p /data/d && echo deep > /data/d/f && sync")
        assert "/data" in sh(a, "cat /proc/mounts")
        assert c.get_volume("shared").used_by == [a.id]
    finally:
        a.stop()
    assert wait_until(lambda: released(node, "shared"), timeout=20), "volume still mounted after its sandbox ended"
    b = make_sandbox(c, volumes={"/mnt/data": "shared"})
    try:
        assert sh(b, "cat /mnt/data/note /mnt/data/d/f") == "from-a\ndeep\n"
    finally:
        b.stop()


def test_read_only_mount_refuses_writes(node):
    c = node.client
    rw = make_sandbox(c, volumes={"/data": "shared"})
    ro = make_sandbox(c, volumes={"/data": {"name": "shared", "read_only": True}})
    try:
        r = ro.run_shell("echo x > /data/ro-write; echo rc=$?; touch /data/note 2>&1; echo rc=$?")
        assert "Read-only file system" in r.stdout + r.stderr, r
        assert "rc=0" not in r.stdout, r
        assert sh(ro, "cat /data/note") == "from-a\n"
        # The read-write sandbox writes; the read-only one sees it (one file system).
        sh(rw, "echo live > /data/live")
        assert sh(ro, "cat /data/live") == "live\n"
        assert sorted(c.get_volume("shared").used_by) == sorted([rw.id, ro.id])
    finally:
        stop_quietly(ro)
        stop_quietly(rw)


def test_full_volume_gives_enospc_and_nothing_else_breaks(node):
    c = node.client
    c.create_volume("small", 8)
    sb = make_sandbox(c, volumes={"/data": "small"})
    other = make_sandbox(c, volumes={"/data": "shared"})
    try:
        r = sb.run_shell("dd if=/dev/zero of=/data/big bs=1M count=32 2>&1; echo rc=$?")
        assert "No space left on device" in r.stdout, r
        assert "rc=0" not in r.stdout, r
        # The sandbox carries on: its own root, the shell, and the volume once space is freed.
        assert sh(sb, "echo root-ok > /tmp/x && cat /tmp/x") == "root-ok\n"
        sh(sb, "rm /data/big && echo again > /data/after && cat /data/after")
        # Others are untouched.
        assert sh(other, "echo fine > /data/other-ok && cat /data/other-ok") == "fine\n"
        plain = make_sandbox(c)
        try:
            assert sh(plain, "echo unrelated > /tmp/u && cat /tmp/u") == "unrelated\n"
        finally:
            plain.stop()
    finally:
        stop_quietly(sb)
        stop_quietly(other)


def test_volume_in_use_cannot_be_deleted(node):
    c = node.client
    vid = c.create_volume("busy", 8).id
    sb = make_sandbox(c, volumes={"/data": "busy"})
    try:
        with pytest.raises(dsec.Conflict) as e:
            c.delete_volume("busy")
        assert sb.id in str(e.value), e.value
        assert "busy" in [v.name for v in c.list_volumes()]
    finally:
        sb.stop()
    assert wait_until(lambda: released(node, "busy"), timeout=20)
    c.delete_volume("busy")
    assert "busy" not in [v.name for v in c.list_volumes()]
    assert not os.path.exists(os.path.join(node.data, "edge", "volumes", vid))
    with pytest.raises(dsec.NotFound):
        c.delete_volume("busy")


def test_another_projects_volume_cannot_be_mounted(node):
    up, c = node.up, node.client
    proj = f"vp{os.getpid() % 100000}"
    st, raw = http("POST", f"{up.url}/v1/projects", up.key, {"name": proj})
    assert st == 201, raw
    st, raw = http("POST", f"{up.url}/v1/keys", up.key, {"principal": f"agent-{proj}", "project": proj})
    assert st == 201, raw
    key = json.loads(raw)["key"]
    with dsec.sync.DSecClient(api_url=up.url, api_key=key, timeout=120) as user:
        # The user's project has no volume of that name: the admin's `default` one is not found.
        with pytest.raises(dsec.NotFound) as e:
            make_sandbox(user, volumes={"/data": "shared"})
        assert proj in str(e.value), e.value
        assert user.list_volumes() == []
        # Naming the other project outright is refused.
        with pytest.raises(dsec.Forbidden):
            user.list_volumes(project="default")
        with pytest.raises(dsec.Forbidden):
            user.run_container({"container_image": "busybox", "project": "default", "volumes": {"/data": "shared"}})
        with pytest.raises(dsec.NotFound):
            user.delete_volume("shared")
        # Its own volume works, and the same name may exist in both projects.
        mine = user.create_volume("shared", 8)
        assert mine.project == proj
        sb = make_sandbox(user, volumes={"/data": "shared"})
        try:
            assert sh(sb, "ls /data") == ""  # not the admin's files
        finally:
            sb.stop()
        assert wait_until(lambda: not user.get_volume("shared").used_by, timeout=20)
        user.delete_volume("shared")
    assert c.get_volume("shared").project == "default"


def test_bad_requests_are_4xx(node):
    c = node.client
    with pytest.raises(dsec.BadRequest):
        c.create_volume("Bad_Name", 8)
    with pytest.raises(dsec.BadRequest):
        c.create_volume("tiny", 0)
    with pytest.raises(dsec.Conflict):
        c.create_volume("shared", 8)
    with pytest.raises(dsec.NotFound):
        make_sandbox(c, volumes={"/data": "no-such-volume"})
    with pytest.raises(dsec.BadRequest):
        make_sandbox(c, volumes={"/proc/x": "shared"})
    with pytest.raises(dsec.BadRequest):
        make_sandbox(c, volumes={"data": "shared"})


def test_failed_create_releases_its_volumes(node):
    c = node.client
    # The create fails inside the sandbox's setup (a protected path the image lacks), after the
    # edge mounted the volume: the rollback gives it back.
    with pytest.raises(dsec.BadRequest):
        make_sandbox(c, volumes={"/data": "small"}, protected_paths=["/no/such/path"])
    assert wait_until(lambda: released(node, "small"), timeout=20), "a failed create left its volume mounted"


def test_microvm_with_volumes_is_refused_clearly(node):
    reason = microvm_skip_reason()
    if reason:
        pytest.skip(reason)
    with pytest.raises(dsec.Unsupported) as e:
        node.client.run_microvm({"container_image": "busybox", "volumes": {"/data": "shared"}})
    assert "volume" in str(e.value), e.value
    assert released(node, "shared")


def test_edge_crash_and_restart_keeps_adopted_mounts_and_drops_the_rest(node):
    c = node.client
    keep = make_sandbox(c, volumes={"/data": "shared"})
    sh(keep, "echo before-crash > /data/crash && sync")
    keep_id = keep.id
    node.restart_after_crash()
    c = node.client
    info = c.get_sandbox(keep_id)
    assert info.state == "running", info
    h = c.attach(keep_id)
    h._inner.auto_step = False
    assert sh(h, "cat /data/crash; echo after > /data/after-crash; cat /data/after-crash") == "before-crash\nafter\n"
    assert c.get_volume("shared").used_by == [keep_id]
    assert not c.get_volume("small").used_by
    # A new sandbox shares the same mount (one loop device for the image).
    other = make_sandbox(c, volumes={"/data": "shared"})
    try:
        assert sh(other, "cat /data/after-crash") == "after\n"
        vol_dir = os.path.join(node.data, "edge", "volumes", c.get_volume("shared").id)
        assert len(loop_devices_under(vol_dir)) == 1, loop_devices_under(vol_dir)
    finally:
        other.stop()
        h.stop()
    assert wait_until(lambda: released(node, "shared"), timeout=20)
    assert not volume_mounts(node.up)


def test_cli_volume_create_ls_rm_and_run_with_a_volume(node):
    up = node.up
    assert up.cli("volume", "create", "cli-vol", "16").stdout.decode().strip() == "cli-vol"
    ls = json.loads(up.cli("volume", "ls", "--json").stdout)
    assert {"name": "cli-vol", "size_mb": 16}.items() <= next(v for v in ls if v["name"] == "cli-vol").items()
    sid = up.cli("run", "busybox", "--volume", "/data=cli-vol:ro").stdout.decode().strip()
    try:
        h = node.client.attach(sid)
        r = h.run_shell("touch /data/x 2>&1")
        assert r.exit_code != 0 and "Read-only file system" in r.stdout + r.stderr, r
        rm = up.cli("volume", "rm", "cli-vol", check=False)
        assert rm.returncode != 0 and sid in rm.stderr.decode(), rm
    finally:
        up.cli("stop", sid)
    assert wait_until(lambda: released(node, "cli-vol"), timeout=20)
    up.cli("volume", "rm", "cli-vol")
    assert "cli-vol" not in up.cli("volume", "ls").stdout.decode()
