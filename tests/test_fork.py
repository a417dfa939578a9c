"""Snapshot and fork of containers (issue 17), checked from inside the sandboxes.

A snapshot is the parent's files (its writable layer packed, frozen, into a layer on top of its
layers, registered as an image); a fork is one snapshot and N creates from it. Children see the
parent's files as of the snapshot, their writes stay private, the parent goes on, deleting the
parent does not break them, and nothing is left after they end. A fork that cannot place every
child reports the ones that exist and leaves nothing of the others."""

from __future__ import annotations

import json
import os

import pytest

import dsec
from helpers import (
    DsecUp,
    dsec_cgroups,
    dsec_processes,
    http,
    make_sandbox,
    new_data_dir,
    remove_data_dir,
    sh,
    stop_quietly,
    wait_until,
)


def first_record(url: str, key: str, sandbox_id: str) -> dict:
    st, raw = http("GET", f"{url}/v1/sandboxes/{sandbox_id}/trajectory", key)
    assert st == 200, raw
    return json.loads(raw.decode().splitlines()[0])


def test_snapshot_and_fork_of_4(node, client):
    parent = make_sandbox(client, "busybox", memory_limit_mb=256, labels={"job": "forktest"})
    children = []
    snap_child = None
    try:
        digest = sh(parent, "dd if=/dev/urandom of=/root/big bs=1M count=24 2>/dev/null && "
                            "echo before > /root/marker && md5sum /root/big | cut -d' ' -f1").strip()
        assert parent.run_shell("echo step-two").exit_code == 0
        # A snapshot is an image a create starts from; it names the last completed step.
        snap = parent.snapshot()
        assert snap["sandbox"] == parent.id and snap["id"].startswith("snapshot/"), snap
        assert snap["step"] == 2, snap
        assert snap["id"] in {i.name for i in client.list_images()}
        snap_child = client.create(from_snapshot=snap["id"])
        assert sh(snap_child, "md5sum /root/big | cut -d' ' -f1").strip() == digest
        # Fork 4: children see the parent's files at the fork, not its later writes.
        children = parent.fork(4, labels={"rollout": "r1"})
        assert len(children) == 4 and len({c.id for c in children}) == 4
        sh(parent, "echo after > /root/marker; echo only-parent > /root/later")
        for i, c in enumerate(children):
            info = c.refresh()
            assert info.labels.get("dsec.fork_of") == parent.id and info.labels.get("rollout") == "r1", info.labels
            assert info.labels.get("job") == "forktest" and info.memory_limit_mb == 256, info
            assert sh(c, "md5sum /root/big | cut -d' ' -f1").strip() == digest
            assert sh(c, "cat /root/marker") == "before\n"
            assert sh(c, "test -e /root/later && echo yes || echo no") == "no\n"
            sh(c, f"echo child{i} > /root/mine; echo child{i} > /root/marker")
            # The child's trajectory starts with its create, naming the parent and the step.
            rec = first_record(node.url, node.key, c.id)
            labels = rec["request"]["labels"]
            assert rec["kind"] == "create" and labels["dsec.fork_of"] == parent.id, rec
            assert labels["dsec.fork_step"] == str(snap["step"]), (labels, snap)
        # Writes stay private: to siblings and to the parent.
        for i, c in enumerate(children):
            assert sh(c, "cat /root/mine /root/marker") == f"child{i}\nchild{i}\n"
        assert sh(parent, "cat /root/marker; test -e /root/mine && echo yes || echo no") == "after\nno\n"
        # Deleting the parent does not break the children.
        parent.stop()
        for c in children:
            assert sh(c, "md5sum /root/big | cut -d' ' -f1").strip() == digest
        # The snapshot's image is in use while a child runs; removable once they ended.
        with pytest.raises(dsec.DSecError):
            client.remove_image(snap["id"])
    finally:
        for c in children + ([snap_child] if snap_child else []):
            stop_quietly(c)
        stop_quietly(parent)
    for c in children:
        assert wait_until(lambda: not dsec_processes(c.id), 10), dsec_processes(c.id)
        assert wait_until(lambda: not dsec_cgroups(c.id), 10), dsec_cgroups(c.id)
    forks = [i.name for i in client.list_images() if i.name.startswith(f"snapshot/{parent.id}")]
    for name in forks:
        client.remove_image(name)
    assert not [i.name for i in client.list_images() if i.name.startswith(f"snapshot/{parent.id}")]


def test_fork_bad_requests(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        for body in ({"n": 0}, {"n": 101}, {"n": 2, "labels": {"dsec.fork_of": "x"}}, {"n": 1, "bogus": True}):
            st, raw = http("POST", f"{node.url}/v1/sandboxes/{sb.id}/fork", node.key, body)
            assert st == 400, (body, raw)
            assert json.loads(raw)["error"]["code"] == "bad_request"
        with pytest.raises(dsec.Unsupported):
            sb.snapshot(memory=True)
    finally:
        stop_quietly(sb)


def test_fork_past_the_nodes_capacity_leaves_no_half_made_child(dsec_bin):
    data = new_data_dir("forkfull")
    up = DsecUp(dsec_bin, data, f"ff{os.getpid() % 100000}", config="[edge]\ncapacity = 3\n").start()
    try:
        with up.client() as c:
            parent = make_sandbox(c, "busybox")
            sh(parent, "echo hi > /root/f")
            with pytest.raises(dsec.ForkFailed) as ei:
                parent.fork(4)
            e = ei.value
            assert len(e.children) == 2 and len(e.failed) == 2, (e.children, e.failed)
            assert all(f["error"]["code"] == "node_full" for f in e.failed), e.failed
            live = {s.id for s in c.list_sandboxes()}
            assert live == {parent.id} | {ch.id for ch in e.children}, live
            for ch in e.children:
                assert sh(ch, "cat /root/f") == "hi\n"
                ch.stop()
            parent.stop()
            assert not c.list_sandboxes()
    finally:
        up.stop()
        remove_data_dir(data)
