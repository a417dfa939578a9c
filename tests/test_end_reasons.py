"""End reasons (issue 17): every ended sandbox carries a machine-readable cause -- in GET, in the
list (`?end_reason=`), in `dsec ps --ended`, in the trajectory's last record, and as the typed
`SandboxEnded` exception (a `SandboxDead`) on the next call, sync and async.

One test per cause that this machine can produce: stopped_by_user, ttl_idle, ttl_total,
internal_error (the agent killed from outside), oom_killed_pid1, edge_restart_not_adopted,
preempted (the edge shut down), quota_revoked (key revoked with stop_sandboxes), node_lost
(the node silent past the apiserver's grace), memory_pressure (a paused best-effort sandbox
whose memory cannot be swapped out keeps the node short: `stop_on_pressure` ends it)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import tempfile
import time

import pytest

import dsec
import dsec.sync
from helpers import (
    DsecUp,
    dsec_processes,
    find_aether,
    free_port,
    http,
    make_sandbox,
    new_data_dir,
    remove_data_dir,
    sh,
    stop_quietly,
    wait_until,
)


def last_record(url: str, key: str, sandbox_id: str) -> dict:
    st, raw = http("GET", f"{url}/v1/sandboxes/{sandbox_id}/trajectory", key)
    assert st == 200, raw
    lines = [json.loads(l) for l in raw.decode().splitlines() if l.strip()]
    assert lines, f"empty trajectory of {sandbox_id}"
    return lines[-1]


def ended_with(client, sandbox_id: str, reason: str, timeout: float = 15.0):
    """Waits until the sandbox has ended with `reason`; its info."""
    assert wait_until(lambda: client.get_sandbox(sandbox_id).end_reason is not None, timeout), \
        client.get_sandbox(sandbox_id)
    info = client.get_sandbox(sandbox_id)
    assert info.end_reason == reason, info
    assert info.state in ("stopped", "failed"), info
    assert info.end_detail, info
    return info


def raises_ended(sb, reason: str) -> dsec.SandboxEnded:
    with pytest.raises(dsec.SandboxEnded) as ei:
        sb.run_shell("echo hi")
    e = ei.value
    assert isinstance(e, dsec.SandboxDead) and e.status == 410 and e.code == "sandbox_dead", repr(e)
    assert e.reason == reason and e.sandbox_id == sb.id and e.detail, vars(e)
    return e


def test_stopped_by_user_everywhere(node, client):
    sb = make_sandbox(client, "busybox", labels={"t": "end-user"})
    sh(sb, "echo x")
    assert sb.stop().state == "stopped"
    info = ended_with(client, sb.id, "stopped_by_user")
    assert not info.ended_by_infrastructure
    e = raises_ended(sb, "stopped_by_user")
    assert not e.infrastructure
    # The list: live by default, ended ones on request, filtered by reason.
    assert sb.id not in {s.id for s in client.list_sandboxes()}
    assert sb.id in {s.id for s in client.list_sandboxes(ended=True)}
    mine = {s.id: s for s in client.list_sandboxes(end_reason="stopped_by_user")}
    assert mine[sb.id].end_reason == "stopped_by_user"
    assert sb.id not in {s.id for s in client.list_sandboxes(end_reason="ttl_idle")}
    st, raw = http("GET", f"{node.url}/v1/sandboxes?end_reason=nonsense", node.key)
    assert st == 400, raw
    # The trajectory's last record says why.
    rec = last_record(node.url, node.key, sb.id)
    assert rec["kind"] == "stop" and rec["request"]["end_reason"] == "stopped_by_user", rec
    # The CLI.
    out = node.cli("ps", "--end-reason", "stopped_by_user").stdout.decode()
    line = next(l for l in out.splitlines() if sb.id in l)
    assert "stopped_by_user" in line and "END_REASON" in out, out
    # A caller cannot name another reason for its own stop: the query is dropped.
    other = make_sandbox(client, "busybox")
    st, raw = http("DELETE", f"{node.url}/v1/sandboxes/{other.id}?end_reason=node_lost", node.key)
    assert st == 200 and json.loads(raw)["end_reason"] == "stopped_by_user", raw


def test_ttl_idle_and_ttl_total_sync_and_async(node, client):
    idle = make_sandbox(client, "busybox", ttl_running_stop=1)
    total = make_sandbox(client, "busybox", ttl_total=1, ttl_running_stop=300)
    try:
        ended_with(client, idle.id, "ttl_idle")
        ended_with(client, total.id, "ttl_total")
        raises_ended(idle, "ttl_idle")
        assert last_record(node.url, node.key, total.id)["request"]["end_reason"] == "ttl_total"

        async def main():
            async with node.aclient() as c:
                sb = dsec.Sandbox(c, await c.get_sandbox(total.id))
                try:
                    await sb.run_shell("echo hi")
                except dsec.SandboxEnded as e:
                    return e
            return None

        e = asyncio.run(main())
        assert e is not None and e.reason == "ttl_total" and not e.infrastructure, e
    finally:
        stop_quietly(idle)
        stop_quietly(total)


def aether_pid(sandbox_id: str) -> int:
    pids = [p for p, (comm, _) in dsec_processes(sandbox_id).items() if comm == "dsec-aether"]
    assert len(pids) == 1, dsec_processes(sandbox_id)
    return pids[0]


def test_agent_killed_from_outside_is_internal_error(node, client):
    sb = make_sandbox(client, "busybox")
    sh(sb, "echo x")
    os.kill(aether_pid(sb.id), signal.SIGKILL)
    info = ended_with(client, sb.id, "internal_error")
    assert info.state == "failed" and info.ended_by_infrastructure, info
    e = raises_ended(sb, "internal_error")
    assert e.infrastructure
    rec = last_record(node.url, node.key, sb.id)
    assert rec["kind"] == "died" and rec["request"]["end_reason"] == "internal_error", rec


def test_oom_of_pid1(node, client):
    """The sandbox's memory limit OOM-kills its init (aether). The OOM killer of a memory cgroup
    kills the task with the highest badness: resident memory + swap + page tables, plus
    oom_score_adj x (the limit in pages) / 1000. aether lowers its own oom_score_adj to -1000
    when it may (then it is never chosen) and otherwise starts every command at 1000, so that a
    workload's own process always goes first. Memory charged to the cgroup but resident in no
    process -- tmpfs pages written with write(2), here /dev/shm -- counts for nobody; so with
    aether raised to 1000 (from the host: the sandbox cannot see its pid 1) a workload that fills
    /dev/shm past the limit makes aether, the largest process, the choice."""
    sb = make_sandbox(client, "busybox", memory_limit_mb=48)
    try:
        sh(sb, "echo x")
        pid = aether_pid(sb.id)
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write("1000")
        with open(f"/proc/{pid}/oom_score_adj") as f:
            assert f.read().strip() == "1000"
        try:
            sb.run_shell("dd if=/dev/zero of=/dev/shm/fill bs=1M count=60", timeout=60)
        except dsec.DSecError:
            pass  # the agent died under the call
        info = ended_with(client, sb.id, "oom_killed_pid1", timeout=30)
        assert info.state == "failed" and not info.ended_by_infrastructure, info
        assert "OOM" in info.end_detail, info
        raises_ended(sb, "oom_killed_pid1")
        rec = last_record(node.url, node.key, sb.id)
        assert rec["kind"] == "died" and rec["request"]["end_reason"] == "oom_killed_pid1", rec
    finally:
        stop_quietly(sb)


def test_quota_revoked(node, client):
    st, raw = http("POST", f"{node.url}/v1/keys", node.key, {"principal": f"agent-end{os.getpid()}"})
    assert st == 201, raw
    key = json.loads(raw)
    with dsec.sync.DSecClient(api_url=node.url, api_key=key["key"], timeout=120) as user:
        sb = make_sandbox(user, "busybox")
        sh(sb, "echo x")
    keep = make_sandbox(client, "busybox")  # the admin's: not touched
    try:
        out = node.cli("key", "revoke", key["key_id"], "--stop-sandboxes").stdout.decode()
        assert sb.id in json.loads(out)["stopped_sandboxes"], out
        ended_with(client, sb.id, "quota_revoked")
        e = raises_ended(client.attach(sb.id), "quota_revoked")
        assert e.infrastructure
        assert client.get_sandbox(keep.id).state == "running"
    finally:
        stop_quietly(keep)


def test_edge_restart_not_adopted_and_preempted(dsec_bin):
    data = new_data_dir("endreasons")
    node_id = f"end{os.getpid() % 100000}"
    up = DsecUp(dsec_bin, data, node_id).start()
    try:
        with up.client() as c:
            doomed = make_sandbox(c, "busybox")
            sh(doomed, "echo x")
            live = make_sandbox(c, "busybox")
        pids = list(dsec_processes(doomed.id))
        up.kill()
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        assert wait_until(lambda: not dsec_processes(doomed.id), 5)
        up = DsecUp(dsec_bin, data, node_id).start()
        with up.client() as c:
            info = c.get_sandbox(doomed.id)
            assert info.state == "failed" and info.end_reason == "edge_restart_not_adopted", info
            assert info.ended_by_infrastructure
            assert doomed.id in {s.id for s in c.list_sandboxes(end_reason="edge_restart_not_adopted")}
            rec = last_record(up.url, up.key, doomed.id)
            assert rec["request"]["end_reason"] == "edge_restart_not_adopted", rec
            assert c.get_sandbox(live.id).state == "running"
        # A clean shutdown of the edge ends what runs on it: preempted (the record survives in
        # the trajectory log, read after the next start).
        assert up.stop() == 0
        up = DsecUp(dsec_bin, data, node_id).start()
        rec = last_record(up.url, up.key, live.id)
        assert rec["kind"] == "stop" and rec["request"]["end_reason"] == "preempted", rec
    finally:
        up.stop()
        remove_data_dir(data)


class Proc:
    """A `dsec edge` or `dsec apiserver` process; reads KEY=VALUE lines until `want` are seen."""

    def __init__(self, argv, want, env=None):
        self.argv, self.want, self.env, self.vars = argv, want, env or {}, {}
        self.log = tempfile.NamedTemporaryFile(prefix="dsec-endreason-", suffix=".log", delete=False)
        self.p = None

    def start(self, timeout: float = 120.0) -> "Proc":
        self.vars = {}
        self.p = subprocess.Popen(self.argv, stdout=subprocess.PIPE, stderr=self.log, text=True,
                                  env={**os.environ, **self.env})
        deadline = time.time() + timeout
        while not all(w in self.vars for w in self.want):
            if time.time() > deadline or self.p.poll() is not None:
                raise RuntimeError(f"{self.argv[:2]} did not start: see {self.log.name}")
            line = self.p.stdout.readline()
            if "=" in line:
                k, v = line.strip().split("=", 1)
                self.vars[k] = v
        return self

    def kill(self, sig=signal.SIGKILL) -> None:
        if self.p and self.p.poll() is None:
            self.p.send_signal(sig)
            try:
                self.p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def test_node_lost_after_the_grace_and_back_when_it_rejoins(dsec_bin):
    tmp = tempfile.mkdtemp(prefix="dsec-e2e-nodelost-", dir="/var/tmp")
    node_id = f"nl{os.getpid() % 100000}"
    token = "end-reason-test-token-0123456789"
    port = free_port()
    env = {"DSEC_AETHER": find_aether()} if find_aether() else {}
    edge = Proc([dsec_bin, "edge", "--listen", f"127.0.0.1:{port}", "--data-dir", os.path.join(tmp, "edge"),
                 "--node-id", node_id, "--token", token], ["DSEC_EDGE_URL"], env)
    cfg = os.path.join(tmp, "api.toml")
    with open(cfg, "w") as f:
        f.write("[apiserver]\nnode_lost_after_ms = 1500\n")
    api = Proc([dsec_bin, "apiserver", "--listen", f"127.0.0.1:{free_port()}", "--db", os.path.join(tmp, "iam.db"),
                "--env-file", os.path.join(tmp, "env"), "--watcher-period-ms", "200", "--config", cfg,
                "--edge", f"http://127.0.0.1:{port}#{token}"], ["DSEC_API_URL", "DSEC_API_KEY"])
    try:
        edge.start()
        api.start()
        url, key = api.vars["DSEC_API_URL"], api.vars["DSEC_API_KEY"]
        with dsec.sync.DSecClient(api_url=url, api_key=key, timeout=120) as c:
            assert wait_until(lambda: any(n.get("healthy") for n in json.loads(http("GET", f"{url}/v1/nodes", key)[1])["nodes"]), 10)
            sb = make_sandbox(c, "busybox")
            sh(sb, "echo x")
            edge.kill()
            # Within the grace the node is only unavailable; after it, its sandboxes are lost.
            with pytest.raises(dsec.NodeUnavailable):
                sb.run_shell("echo hi")
            def lost():
                try:
                    return c.get_sandbox(sb.id).end_reason == "node_lost"
                except dsec.NodeUnavailable:
                    return False  # still within the grace

            assert wait_until(lost, 10)
            info = ended_with(c, sb.id, "node_lost")
            assert info.state == "failed" and info.ended_by_infrastructure, info
            raises_ended(sb, "node_lost")
            assert c.stop_sandbox(sb.id).end_reason == "node_lost"
            # Until node membership (issue 22) makes it final, a node that comes back still
            # has its sandboxes (re-adopted), and they answer again.
            edge.start()
            assert wait_until(lambda: c.get_sandbox(sb.id).state == "running", 15), c.get_sandbox(sb.id)
            assert sh(sb, "echo back") == "back\n"
            sb.stop()
    finally:
        api.kill(signal.SIGTERM)
        if edge.p is not None and edge.p.poll() is not None:
            edge.start()  # re-adopts what the killed edge left, so that its stop ends it
        edge.kill(signal.SIGTERM)
        remove_data_dir(tmp)


PRESSURE_CONFIG = """
[edge]
shm_mb = 320

[edge.reclaim]
enabled = true
zram_mb = 0
interval_ms = 300
node_memory_budget_mb = 480
pressure_high_ratio = 0.5
stop_on_pressure = true
"""


def test_memory_pressure_ends_a_paused_best_effort_sandbox(dsec_bin):
    data = new_data_dir("endpressure")
    up = DsecUp(dsec_bin, data, f"mp{os.getpid() % 100000}", config=PRESSURE_CONFIG).start()
    try:
        with up.client() as c:
            ls = make_sandbox(c, "busybox", qos="latency_sensitive", memory_limit_mb=64)
            be = make_sandbox(c, "busybox", qos="best_effort", memory_limit_mb=360)
            # 300 MB of tmpfs (shmem) against a 240 MB pressure line, and no swap tier: reclaim
            # cannot move it, the pause does not free it, so the policy ends the sandbox.
            try:
                be.run_shell("dd if=/dev/zero of=/dev/shm/fill bs=1M count=300", timeout=120)
            except dsec.DSecError:
                pass  # paused then ended under the call
            info = ended_with(c, be.id, "memory_pressure", timeout=60)
            assert info.ended_by_infrastructure and "memory pressure" in info.end_detail, info
            raises_ended(be, "memory_pressure")
            st, raw = http("GET", f"{up.url}/v1/sandboxes/{be.id}/trajectory", up.key)
            recs = [json.loads(l) for l in raw.decode().splitlines() if l.strip()]
            assert any(r["kind"] == "memory_pressure" and r["request"].get("action") == "pause"
                       for r in recs), [r["kind"] for r in recs]
            rec = last_record(up.url, up.key, be.id)
            assert rec["request"]["end_reason"] == "memory_pressure", rec
            # The latency-sensitive sandbox was spared and the node recovers.
            assert c.get_sandbox(ls.id).state == "running"
            assert sh(ls, "echo fine") == "fine\n"
            ls.stop()
    finally:
        up.stop()
        remove_data_dir(data)
