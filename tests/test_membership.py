"""Cluster membership (issue 22): edges join a running apiserver (`dsec edge --join URL
--token T`) and heartbeat; cordon and drain; an edge that stops answering (SIGSTOP) goes
`suspect` then `lost`, its sandboxes report `failed` / `node_lost` and their quota is released
exactly once -- after the loss and again after its late return, when its sandboxes are stopped;
an edge back within the grace is healthy again with its sandboxes.

One apiserver (SQLite, no static edges) and two real edges (separate processes, data dirs and
loopback ports) for the whole module."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from typing import Dict, List

import pytest

from helpers import find_aether, free_port, wait_until
from test_cluster import Proc, call

JOIN_TOKEN = "membership-test-join-token-0123"
LOST_AFTER_MS = 8000


class Bed:
    def __init__(self, dsec: str):
        self.dsec = dsec
        self.dir = tempfile.mkdtemp(prefix="dsec-membership-")
        self.api: Proc = None  # type: ignore[assignment]
        self.edges: Dict[str, Proc] = {}
        tag = os.getpid() % 100000
        self.a, self.b = f"ma{tag}", f"mb{tag}"

    def start_api(self) -> None:
        cfg = os.path.join(self.dir, "api.toml")
        with open(cfg, "w") as f:
            f.write("[apiserver]\n"
                    f'join_token = "{JOIN_TOKEN}"\n'
                    f"node_lost_after_ms = {LOST_AFTER_MS}\n"
                    "heartbeat_period_ms = 300\n"
                    "heartbeat_timeout_ms = 1500\n"
                    "membership_sync_ms = 200\n"
                    "watcher_period_ms = 200\n"
                    "reconcile_period_ms = 1000\n")
        self.api = Proc([self.dsec, "apiserver", "--config", cfg, "--listen", f"127.0.0.1:{free_port()}",
                         "--db", os.path.join(self.dir, "iam.db"),
                         "--env-file", os.path.join(self.dir, "env")],
                        ["DSEC_API_URL", "DSEC_API_KEY"]).start()
        self.url, self.key = self.api.first("DSEC_API_URL"), self.api.first("DSEC_API_KEY")

    def edge_argv(self, node: str, token: str) -> List[str]:
        return [self.dsec, "edge", "--listen", f"127.0.0.1:{free_port()}",
                "--data-dir", os.path.join(self.dir, node), "--node-id", node,
                "--join", self.url, "--token", token]

    def start_edge(self, node: str, token: str = JOIN_TOKEN) -> Proc:
        env = {}
        a = find_aether()
        if a:
            env["DSEC_AETHER"] = a
        p = Proc(self.edge_argv(node, token), ["DSEC_EDGE_URL"], env).start(timeout=120)
        self.edges[node] = p
        return p

    def nodes(self) -> Dict[str, dict]:
        st, body, _ = call("GET", f"{self.url}/v1/nodes", self.key)
        assert st == 200, body
        return {n["node"]: n for n in body["nodes"]}

    def state(self, node: str) -> str:
        n = self.nodes().get(node)
        return n["membership"]["state"] if n else "absent"

    def create(self, **kw) -> dict:
        body = {"image": "busybox"}
        body.update(kw)
        st, sb, _ = call("POST", f"{self.url}/v1/sandboxes", self.key, body)
        assert st == 201, sb
        return sb

    def used_sandboxes(self) -> int:
        st, body, _ = call("GET", f"{self.url}/v1/projects", self.key)
        assert st == 200, body
        return next(p for p in body["projects"] if p["name"] == "default")["usage"]["sandboxes"]

    def live_ids(self) -> List[str]:
        st, body, _ = call("GET", f"{self.url}/v1/sandboxes", self.key)
        assert st == 200, body
        return sorted(s["id"] for s in body["sandboxes"] if s["state"] in ("running", "paused"))

    def stop(self) -> None:
        for p in self.edges.values():
            if p.p and p.p.poll() is None:
                p.p.send_signal(signal.SIGCONT)
            p.kill(signal.SIGTERM)
        if self.api:
            self.api.kill(signal.SIGTERM)
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="module")
def bed(dsec_bin):
    if os.geteuid() != 0:
        pytest.skip("real edges need root")
    b = Bed(dsec_bin)
    try:
        b.start_api()
    except RuntimeError as e:
        b.stop()
        pytest.fail(str(e), pytrace=False)
    yield b
    b.stop()


def node_of(sb: dict) -> str:
    return sb["id"].split("-")[1]


def test_join_without_restart_and_first_placement(bed):
    # No edge yet: a create is refused with a clear 503, not a 500.
    st, body, _ = call("POST", f"{bed.url}/v1/sandboxes", bed.key, {"image": "busybox"})
    assert st == 503, body
    # A wrong join token is refused with 401; an edge given one exits saying so.
    st, body, _ = call("POST", f"{bed.url}/v1/nodes/join", "wrong-token-0000000000",
                       {"node_id": "zz", "url": "http://127.0.0.1:9", "token": "t"})
    assert st == 401 and body["error"]["code"] == "unauthorized", body
    env = dict(os.environ)
    if find_aether():
        env["DSEC_AETHER"] = find_aether()
    r = subprocess.run(bed.edge_argv("mzbad", "wrong-token-0000000000"), capture_output=True, text=True,
                       timeout=120, env=env)
    assert r.returncode != 0 and "401" in r.stderr, r.stderr[-2000:]
    assert "mzbad" not in bed.nodes()

    t0 = time.monotonic()
    bed.start_edge(bed.a)
    assert wait_until(lambda: bed.state(bed.a) == "healthy", 15), bed.nodes()
    sb = bed.create()
    took = time.monotonic() - t0
    assert node_of(sb) == bed.a, sb
    st, out, _ = call("POST", f"{bed.url}/v1/sandboxes/{sb['id']}/exec", bed.key, {"argv": ["echo", "hi"]})
    assert st == 200 and out["stdout"] == "hi\n", out
    print(f"edge start + join + first placement: {took:.1f} s")

    # A token issued through the API works as well (admin only).
    st, tok, _ = call("POST", f"{bed.url}/v1/nodes/tokens", bed.key)
    assert st == 201 and tok["token"].startswith("dsj_"), tok
    bed.start_edge(bed.b, tok["token"])
    assert wait_until(lambda: bed.state(bed.b) == "healthy", 15), bed.nodes()
    n = bed.nodes()[bed.b]
    assert n["membership"]["joined"] and n["membership"]["last_heartbeat_ms"], n
    # `dsec node ls` shows both, with state and heartbeat.
    r = subprocess.run([bed.dsec, "node", "ls", "--url", bed.url, "--api-key", bed.key],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert bed.a in r.stdout and bed.b in r.stdout and "healthy" in r.stdout and "joined" in r.stdout, r.stdout
    call("DELETE", f"{bed.url}/v1/sandboxes/{sb['id']}", bed.key)


def test_cordon_then_drain(bed):
    st, body, _ = call("POST", f"{bed.url}/v1/nodes/{bed.a}/cordon", bed.key)
    assert st == 200 and body["state"] == "cordoned", body
    on_b = [bed.create() for _ in range(3)]
    assert {node_of(s) for s in on_b} == {bed.b}, "a cordoned node took a placement"
    st, body, _ = call("POST", f"{bed.url}/v1/nodes/{bed.a}/uncordon", bed.key)
    assert st == 200 and body["state"] == "healthy", body
    # Unknown node / bad policy: 4xx saying what to fix.
    st, body, _ = call("POST", f"{bed.url}/v1/nodes/nosuchnode/cordon", bed.key)
    assert st == 404 and "not known" in body["error"]["message"], body
    st, body, _ = call("POST", f"{bed.url}/v1/nodes/{bed.b}/drain", bed.key, {"policy": "explode"})
    assert st == 400, body

    r = subprocess.run([bed.dsec, "node", "drain", bed.b, "--policy", "stop", "--url", bed.url,
                        "--api-key", bed.key], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "drained" in r.stdout, r.stdout
    for s in on_b:
        st, info, _ = call("GET", f"{bed.url}/v1/sandboxes/{s['id']}", bed.key)
        assert info["state"] == "stopped" and info["end_reason"] == "preempted", info
    assert bed.state(bed.b) == "drained"
    again = [bed.create() for _ in range(2)]
    assert {node_of(s) for s in again} == {bed.a}, "a drained node took a placement"
    assert bed.used_sandboxes() == len(bed.live_ids()) == 2
    for s in again:
        call("DELETE", f"{bed.url}/v1/sandboxes/{s['id']}", bed.key)
    st, body, _ = call("POST", f"{bed.url}/v1/nodes/{bed.b}/uncordon", bed.key)
    assert st == 200 and body["state"] == "healthy", body


def place_on(bed, node: str, n: int) -> List[dict]:
    """n sandboxes on `node` (the other node cordoned meanwhile)."""
    other = bed.a if node == bed.b else bed.b
    call("POST", f"{bed.url}/v1/nodes/{other}/cordon", bed.key)
    try:
        out = [bed.create() for _ in range(n)]
    finally:
        call("POST", f"{bed.url}/v1/nodes/{other}/uncordon", bed.key)
    assert {node_of(s) for s in out} == {node}
    return out


def place_on_b(bed, n: int) -> List[dict]:
    return place_on(bed, bed.b, n)


def test_return_within_grace_keeps_the_sandboxes(bed):
    on_b = place_on_b(bed, 1)[0]
    used = bed.used_sandboxes()
    pid = bed.edges[bed.b].p.pid
    os.kill(pid, signal.SIGSTOP)
    try:
        assert wait_until(lambda: bed.state(bed.b) == "suspect", 6, 0.1), bed.nodes()[bed.b]
        # No placements on a suspect node.
        assert node_of(bed.create()) == bed.a
    finally:
        os.kill(pid, signal.SIGCONT)
    assert wait_until(lambda: bed.state(bed.b) == "healthy", 10), bed.nodes()[bed.b]
    st, out, _ = call("POST", f"{bed.url}/v1/sandboxes/{on_b['id']}/exec", bed.key, {"argv": ["echo", "back"]})
    assert st == 200 and out["stdout"] == "back\n", out
    assert bed.used_sandboxes() == used + 1 == len(bed.live_ids())
    for s in bed.live_ids():
        call("DELETE", f"{bed.url}/v1/sandboxes/{s}", bed.key)


def test_stopped_edge_goes_suspect_then_lost_and_quota_is_released_once(bed):
    keep = place_on(bed, bed.a, 1)[0]  # stays live throughout
    lost_sbs = place_on_b(bed, 2)
    assert bed.used_sandboxes() == 3
    pid = bed.edges[bed.b].p.pid
    os.kill(pid, signal.SIGSTOP)
    t0 = time.monotonic()
    try:
        assert wait_until(lambda: bed.state(bed.b) in ("suspect", "lost"), 8, 0.1)
        t_suspect = time.monotonic() - t0
        assert wait_until(lambda: bed.state(bed.b) == "lost", LOST_AFTER_MS / 1000 + 10, 0.2), bed.nodes()[bed.b]
        t_lost = time.monotonic() - t0
        print(f"SIGSTOP -> suspect {t_suspect:.1f} s, -> lost {t_lost:.1f} s (node_lost_after_ms = {LOST_AFTER_MS})")
        for s in lost_sbs:
            st, info, _ = call("GET", f"{bed.url}/v1/sandboxes/{s['id']}", bed.key)
            assert st == 200 and info["state"] == "failed" and info["end_reason"] == "node_lost", info
            st, body, _ = call("POST", f"{bed.url}/v1/sandboxes/{s['id']}/exec", bed.key, {"argv": ["true"]})
            assert st == 410, body
        # Quota: only the live sandbox on a is charged (released once, not twice).
        assert wait_until(lambda: bed.used_sandboxes() == 1, 5), bed.used_sandboxes()
        # Placements go to a only.
        extra = bed.create()
        assert node_of(extra) == bed.a
        assert bed.used_sandboxes() == 2
    finally:
        os.kill(pid, signal.SIGCONT)
    # The late return: its sandboxes are stopped (node_lost), then it takes placements again.
    assert wait_until(lambda: bed.state(bed.b) == "healthy", 20), bed.nodes()[bed.b]
    for s in lost_sbs:
        st, info, _ = call("GET", f"{bed.url}/v1/sandboxes/{s['id']}", bed.key)
        assert st == 200 and info["state"] in ("stopped", "failed") and info["end_reason"] == "node_lost", info
    time.sleep(1.5)  # a reconciliation pass: must not charge or release anything again
    assert bed.used_sandboxes() == 2 == len(bed.live_ids()), (bed.used_sandboxes(), bed.live_ids())
    for s in (keep, extra):
        call("DELETE", f"{bed.url}/v1/sandboxes/{s['id']}", bed.key)
    # Eventually, not at once: under load (the full suite) a reconciliation pass that listed
    # a sandbox just before its DELETE has been seen to hold its charge for one pass.
    assert wait_until(lambda: bed.used_sandboxes() == 0, 5), bed.used_sandboxes()
