"""Fork across nodes (issue 17): 3 real edges (separate processes and data dirs) sharing one
`posix:` blob store directory, and an apiserver over them.

The parent's edge publishes the snapshot (its writable layer, 200 MB here, packed into a layer
on top of its layers) in the shared blob store; the other edges register it at the first create
that names it, so a fork of 16 is placed across the 3 nodes like any create. Checked from inside
the sandboxes: each child sees the parent's files at the snapshot, writes stay private, the
parent goes on, deleting the parent does not break the children, a fork past the cluster's room
makes exactly the children that fit (207) and nothing of the others, nothing is left after the
children end, and the snapshot's blob store objects go when the publishing node removes it (the
other nodes' registrations leave them alone)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from typing import Dict, List

import pytest

import dsec
import dsec.sync
from helpers import (
    dsec_cgroups,
    dsec_processes,
    find_aether,
    free_port,
    http,
    make_sandbox,
    sh,
    stop_quietly,
    wait_until,
)
from test_cluster import Proc, apiserver

CAPACITY = 7  # per edge: 21 sandboxes in all


class ForkCluster:
    def __init__(self, dsec_bin: str):
        self.dir = tempfile.mkdtemp(prefix="dsec-e2e-forkcluster-", dir="/var/tmp")
        self.blobs = os.path.join(self.dir, "shared-blobs")
        os.makedirs(self.blobs)
        self.token = "fork-cluster-token-0123456789"
        self.nodes = [f"fk{os.getpid() % 100000}x{i}" for i in range(3)]
        self.ports = {n: free_port() for n in self.nodes}
        self.edges: Dict[str, Proc] = {}
        self.api = None
        cfg = os.path.join(self.dir, "edge.toml")
        with open(cfg, "w") as f:
            f.write(f'[edge]\nimage_blob_store = "posix:{self.blobs}"\n')
        env = {"DSEC_AETHER": find_aether()} if find_aether() else {}
        for n in self.nodes:
            # One at a time: an edge opening the store clears unfinished puts (`.tmp-*`).
            self.edges[n] = Proc([dsec_bin, "edge", "--listen", f"127.0.0.1:{self.ports[n]}",
                                  "--data-dir", os.path.join(self.dir, n), "--node-id", n,
                                  "--token", self.token, "--config", cfg, "--capacity", str(CAPACITY)],
                                 ["DSEC_EDGE_URL"], env).start(timeout=180)
        self.api = apiserver(dsec_bin, os.path.join(self.dir, "iam.db"), os.path.join(self.dir, "env"),
                             [f"http://127.0.0.1:{self.ports[n]}#{self.token}" for n in self.nodes])
        self.url, self.key = self.api.first("DSEC_API_URL"), self.api.first("DSEC_API_KEY")

    def edge_url(self, node: str) -> str:
        return f"http://127.0.0.1:{self.ports[node]}"

    def edge_images(self, node: str) -> List[str]:
        st, raw = http("GET", f"{self.edge_url(node)}/edge/v1/images", self.token)
        assert st == 200, raw
        return [i["name"] for i in json.loads(raw)["images"]]

    def remove_image(self, node: str, name: str) -> int:
        st, _ = http("DELETE", f"{self.edge_url(node)}/edge/v1/images/{name}", self.token)
        return st

    def stop(self) -> None:
        if self.api is not None:
            self.api.kill(signal.SIGTERM)
        for e in self.edges.values():
            e.kill(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def fc(dsec_bin):
    c = None
    try:
        c = ForkCluster(dsec_bin)
    except RuntimeError as e:
        if c is not None:
            c.stop()
        pytest.fail(str(e), pytrace=False)
    yield c
    c.stop()


def md5(sb, path: str = "/root/big") -> str:
    return sh(sb, f"md5sum {path} | cut -d' ' -f1", timeout=120).strip()


def first_record(url: str, key: str, sandbox_id: str) -> dict:
    st, raw = http("GET", f"{url}/v1/sandboxes/{sandbox_id}/trajectory", key)
    assert st == 200, raw
    return json.loads(raw.decode().splitlines()[0])


def test_fork_of_16_across_3_edges_from_a_200mb_layer(fc):
    with dsec.sync.DSecClient(api_url=fc.url, api_key=fc.key, timeout=300) as c:
        assert wait_until(lambda: sum(1 for n in json.loads(http("GET", f"{fc.url}/v1/nodes", fc.key)[1])["nodes"]
                                      if n.get("healthy")) == 3, 20)
        parent = make_sandbox(c, "busybox", memory_limit_mb=256, labels={"job": "xfork"})
        owner = parent.refresh().node
        children: List = []
        extra: List = []
        try:
            digest = sh(parent, "dd if=/dev/urandom of=/root/big bs=1M count=200 2>/dev/null && "
                                "echo before > /root/marker && md5sum /root/big | cut -d' ' -f1",
                        timeout=300).strip()
            children = parent.fork(16, labels={"rollout": "x"}, timeout=900)
            assert len(children) == 16 and len({ch.id for ch in children}) == 16
            # The parent goes on; its later writes are its own.
            sh(parent, "echo after > /root/marker; echo only-parent > /root/later")
            infos = [ch.refresh() for ch in children]
            placed = {i.node for i in infos}
            assert placed == set(fc.nodes), f"children on {placed}, edges {fc.nodes}"
            snap = infos[0].image
            assert snap.startswith(f"snapshot/{parent.id}"), snap
            for n in fc.nodes:
                assert snap in fc.edge_images(n), (n, fc.edge_images(n))
            for i, ch in enumerate(children):
                assert infos[i].labels["dsec.fork_of"] == parent.id and infos[i].labels["rollout"] == "x"
                assert md5(ch) == digest, (ch.id, infos[i].node)
                assert sh(ch, "cat /root/marker; test -e /root/later && echo yes || echo no") == "before\nno\n"
                sh(ch, f"echo child{i} > /root/marker")
                rec = first_record(fc.url, fc.key, ch.id)
                assert rec["kind"] == "create", rec
                assert rec["request"]["labels"]["dsec.fork_of"] == parent.id, rec
                assert rec["request"]["labels"]["dsec.fork_step"] == "1", rec
            for i, ch in enumerate(children):
                assert sh(ch, "cat /root/marker") == f"child{i}\n"
            assert sh(parent, "cat /root/marker") == "after\n"

            # Past the cluster's room (21 = 1 parent + 16 children + 4): 4 made, 2 refused, and
            # the sandboxes that exist are exactly those the answer lists.
            st, raw = http("POST", f"{fc.url}/v1/sandboxes/{parent.id}/fork", fc.key, {"n": 6})
            body = json.loads(raw)
            extra = [c.attach(s["id"]) for s in body.get("children", [])]
            assert st == 207, (st, raw[:2000])
            assert len(body["children"]) == 4 and len(body["failed"]) == 2, body["failed"]
            assert all(f["error"]["code"] == "node_full" for f in body["failed"]), body["failed"]
            live = {s.id for s in c.list_sandboxes()}
            assert live == {parent.id} | {ch.id for ch in children} | {s.id for s in extra}, live
            for s in extra:
                assert sh(s, "cat /root/marker") == "after\n"  # the second snapshot's files

            # Deleting the parent does not break the children, wherever they run.
            parent.stop()
            for ch in children:
                assert md5(ch) == digest
        finally:
            for ch in children + extra:
                stop_quietly(ch)
            stop_quietly(parent)
        for ch in children + extra + [parent]:
            assert wait_until(lambda: not dsec_processes(ch.id), 15), dsec_processes(ch.id)
            assert wait_until(lambda: not dsec_cgroups(ch.id), 15), dsec_cgroups(ch.id)
        assert not c.list_sandboxes()

        # The snapshots are images: an adopting node's removal leaves the shared objects, the
        # publishing node's removal takes them (layers no other image of its uses).
        snaps = sorted({i.image for i in infos} | {i.refresh().image for i in extra})
        assert len(snaps) == 2, snaps
        objects = set(os.listdir(fc.blobs))
        manifests = {o for o in objects if o.endswith(".image")}
        assert len(manifests) == 2, objects
        for n in fc.nodes:
            if n != owner:
                for s in snaps:
                    if s in fc.edge_images(n):
                        assert fc.remove_image(n, s) in (200, 204)
                        assert s not in fc.edge_images(n)
        assert set(os.listdir(fc.blobs)) == objects
        for s in snaps:
            assert fc.remove_image(owner, s) in (200, 204)
            assert s not in fc.edge_images(owner)
        left = set(os.listdir(fc.blobs))
        assert not {o for o in left if o.endswith(".image")}, left
        assert len(left) < len(objects) and left, (objects, left)
        # The base image (busybox) of every node still works.
        again = make_sandbox(c, "busybox")
        assert sh(again, "echo ok") == "ok\n"
        again.stop()
