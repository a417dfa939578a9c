"""Pause/resume, transparent resume, idle TTL, job-level (label) operations, and re-adoption of
live and paused sandboxes after `kill -9` of `dsec up`."""

from __future__ import annotations

import asyncio
import os
import time
import uuid

import dsec
from helpers import (
    DsecUp,
    dsec_cgroups,
    dsec_processes,
    make_sandbox,
    mounts_under,
    new_data_dir,
    remove_data_dir,
    sh,
    stop_quietly,
    wait_until,
)

COUNTER = "(i=0; while true; do i=$((i+1)); echo $i > /root/count; sleep 0.05; done) >/dev/null 2>&1 &"


def upper_file(node, sid: str, path: str) -> str:
    """Reads a file of the sandbox's writable layer from the host (no request, no resume)."""
    with open(os.path.join(node.sandbox_dir(sid), "upper", path.lstrip("/"))) as f:
        return f.read()


def freezer_state(node_id: str, sid: str) -> str:
    p = f"/sys/fs/cgroup/freezer/dsec/{node_id}/{sid}/freezer.state"
    if os.path.exists(p):
        return open(p).read().strip()
    events = f"/sys/fs/cgroup/dsec/{node_id}/{sid}/cgroup.events"
    return "FROZEN" if "frozen 1" in open(events).read() else "THAWED"


def attach(c, sid: str):
    """A handle on an existing sandbox that sends no trajectory step ids (its calls are new)."""
    h = c.attach(sid)
    h._inner.auto_step = False
    return h


def count(node, sid: str) -> int:
    try:
        return int(upper_file(node, sid, "/root/count").strip() or "0")
    except (FileNotFoundError, ValueError):  # not written yet, or caught mid-write
        return 0


def test_state_survives_pause_resume(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        sh(sb, f"mkdir -p /root/work && cd /root/work && export KEEP=kept-value && echo hello > note.txt; {COUNTER}")
        assert wait_until(lambda: count(node, sb.id) > 3, 5)
        info = sb.pause()
        assert info.state == "paused" and info.paused_at
        rep = info.last_pause
        assert rep and rep["memory_before_bytes"] > 0 and "method" in rep, rep
        assert freezer_state(node.node_id, sb.id) == "FROZEN"
        frozen_at = count(node, sb.id)
        time.sleep(1.0)
        assert count(node, sb.id) == frozen_at, "the counter ran while paused"
        assert client.get_sandbox(sb.id).state == "paused", "a GET must not resume"
        info = sb.resume()
        assert info.state == "running" and info.paused_at is None
        assert wait_until(lambda: count(node, sb.id) > frozen_at + 3, 5), "the background counter did not continue"
        assert sh(sb, "pwd; echo $KEEP; cat note.txt") == "/root/work\nkept-value\nhello\n"
    finally:
        stop_quietly(sb)


def test_pause_releases_page_cache(node, client):
    sb = make_sandbox(client, "busybox", memory_limit_mb=256)
    try:
        sh(sb, "dd if=/dev/zero of=/root/big bs=1M count=64 2>/dev/null; cat /root/big >/dev/null; sync")
        rep = sb.pause().last_pause
        before, after = rep["page_cache_before_bytes"], rep["page_cache_after_bytes"]
        assert before >= 48 << 20, rep
        assert after <= before * 0.1, f"less than 90% of the page cache released: {rep}"
        assert rep["memory_after_bytes"] < rep["memory_before_bytes"], rep
        assert sh(sb, "wc -c < /root/big") == f"{64 << 20}\n"
    finally:
        stop_quietly(sb)


def test_transparent_resume_on_exec_and_file_read(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        sh(sb, f"echo data > /root/f; {COUNTER}")
        sb.pause()
        r = sb.exec(["cat", "/root/f"])
        assert r.exit_code == 0 and r.stdout == "data\n"
        assert client.get_sandbox(sb.id).state == "running"
        assert freezer_state(node.node_id, sb.id) == "THAWED"
        sb.pause()
        assert sb.read_file("/root/f") == b"data\n"
        assert client.get_sandbox(sb.id).state == "running"
        sb.pause()
        assert sh(sb, "echo via-shell") == "via-shell\n"
        sb.pause()
        assert sb.stat("/root/f").size == 5
        assert client.get_sandbox(sb.id).state == "running"
    finally:
        stop_quietly(sb)


def test_pause_and_resume_are_idempotent_and_stop_works_while_paused(client):
    sb = make_sandbox(client, "busybox")
    sb.pause()
    assert sb.pause().state == "paused"
    assert sb.resume().state == "running"
    assert sb.resume().state == "running"
    sb.pause()
    assert sb.stop().state == "stopped"


def test_ttl_stop_after_idle(client):
    sb = make_sandbox(client, "busybox", ttl_running_stop=2)
    try:
        # Requests reset the idle clock.
        for _ in range(4):
            time.sleep(0.8)
            assert sh(sb, "echo poke") == "poke\n"
        assert client.get_sandbox(sb.id).state == "running"
        # A command longer than the TTL holds the clock.
        assert sh(sb, "sleep 3; echo long", timeout=30) == "long\n"
        assert client.get_sandbox(sb.id).state == "running"
        assert wait_until(lambda: client.get_sandbox(sb.id).state == "stopped", 10)
        info = client.get_sandbox(sb.id)
        assert "idle" in (info.reason or ""), info.reason
    finally:
        stop_quietly(sb)


def test_ttl_pause_after_idle_then_transparent_resume(client):
    sb = make_sandbox(client, "busybox", ttl_running_stop=2, ttl_action="pause")
    try:
        sh(sb, "cd /root && export K=v")
        assert wait_until(lambda: client.get_sandbox(sb.id).state == "paused", 10)
        info = client.get_sandbox(sb.id)
        assert info.ttl_action == "pause" and info.last_pause
        assert sh(sb, "pwd; echo $K") == "/root\nv\n"
        assert client.get_sandbox(sb.id).state == "running"
    finally:
        stop_quietly(sb)


def test_ttl_total_is_a_hard_lifetime(client):
    sb = make_sandbox(client, "busybox", ttl_total=2)
    try:
        assert wait_until(lambda: client.get_sandbox(sb.id).state == "stopped", 10)
        assert "ttl_total" in (client.get_sandbox(sb.id).reason or "")
    finally:
        stop_quietly(sb)


def test_ps_shows_ttls(node, client):
    sb = make_sandbox(client, "busybox", ttl_running_stop=300, ttl_total=3600, ttl_action="pause")
    try:
        out = node.cli("ps").stdout.decode()
        line = next(l for l in out.splitlines() if sb.id in l)
        assert "/300s pause" in line and "/3600s" in line, out
        assert "IDLE/TTL" in out and "TTL_TOTAL" in out
        node.cli("pause", sb.id)
        assert client.get_sandbox(sb.id).state == "paused"
        assert "paused" in node.cli("ps").stdout.decode()
        node.cli("resume", sb.id)
        assert client.get_sandbox(sb.id).state == "running"
    finally:
        stop_quietly(sb)


def test_label_pause_resume_stop_200(node):
    job = f"job-{uuid.uuid4().hex[:8]}"
    n = 200

    async def main():
        async with node.aclient() as c:
            sem = asyncio.Semaphore(16)

            async def mk(i):
                async with sem:
                    return await c.run_container(
                        dsec.DSecContainerRunArgs(
                            container_image="busybox",
                            memory_limit_mb=32,
                            cpu_cores_limit=0.1,
                            labels={"job": job, "rollout": str(i % 4)},
                        )
                    )

            sbs = await asyncio.gather(*(mk(i) for i in range(n)))
            try:
                await asyncio.gather(*(s.run_shell("cd /root; export R=ok") for s in sbs[:10]))
                r = await c.pause(labels={"job": job})
                assert (r.matched, r.succeeded, r.failed) == (n, n, []), r
                states = {i.state for i in await c.list_sandboxes() if i.labels.get("job") == job}
                assert states == {"paused"}, states
                # A narrower selector acts on its subset only.
                r = await c.resume(labels={"job": job, "rollout": "0"})
                assert (r.matched, r.succeeded) == (n // 4, n // 4), r
                r = await c.resume(labels={"job": job})
                assert (r.matched, r.succeeded, r.failed) == (n, n, []), r
                states = {i.state for i in await c.list_sandboxes() if i.labels.get("job") == job}
                assert states == {"running"}, states
                outs = await asyncio.gather(*(s.run_shell("pwd; echo $R") for s in sbs[:10]))
                assert all(o.stdout == "/root\nok\n" for o in outs), outs
                # No match is not an error; an empty selector is.
                r = await c.pause(labels={"job": "no-such-job"})
                assert (r.matched, r.succeeded) == (0, 0)
                try:
                    await c._job("pause", {"": ""}, 60)
                except dsec.DSecError:
                    pass
            finally:
                r = await c.stop(labels={"job": job})
                assert r.matched == n and r.succeeded == n, r
            states = {i.state for i in await c.list_sandboxes() if i.labels.get("job") == job}
            assert not states, states

    asyncio.run(main())


def test_sigkill_restart_readopts_live_and_paused(dsec_bin):
    data = new_data_dir("pausecrash")
    node_id = "e2epause"
    up = DsecUp(dsec_bin, data, node_id).start()
    try:
        with up.client() as c:
            live = make_sandbox(c, "busybox")
            sh(live, f"cd /root && export KEEP=live; {COUNTER}")
            paused = make_sandbox(c, "busybox")
            sh(paused, f"cd /tmp && export KEEP=paused; {COUNTER}")
            paused.pause()
            doomed = make_sandbox(c, "busybox")
            sh(doomed, "echo x")
            ids = [live.id, paused.id, doomed.id]
        doomed_pids = dsec_processes(doomed.id)
        up.kill()
        # The sandboxes outlive the edge (reattach grace); one of them dies while it is down.
        assert dsec_processes(live.id), "the live sandbox died with the edge"
        for pid in doomed_pids:
            try:
                os.kill(pid, 9)
            except ProcessLookupError:
                pass
        assert wait_until(lambda: not dsec_processes(doomed.id), 5)
        frozen_count = count(up, paused.id)

        up2 = DsecUp(dsec_bin, data, node_id).start()
        up = up2
        with up2.client() as c:
            got = {s.id: s.state for s in c.list_sandboxes()}
            assert got.get(live.id) == "running", got
            assert got.get(paused.id) == "paused", got
            d = c.get_sandbox(doomed.id)
            assert d.state == "failed" and "restart" in (d.reason or ""), d
            assert not os.path.exists(up2.sandbox_dir(doomed.id))
            assert not dsec_cgroups(doomed.id), sorted(dsec_cgroups(doomed.id))
            # Paused stays paused across the restart.
            assert freezer_state(node_id, paused.id) == "FROZEN"
            time.sleep(0.5)
            assert count(up2, paused.id) == frozen_count
            # Sessions still answer, background processes still run.
            before = count(up2, live.id)
            assert sh(attach(c, live.id), "pwd; echo $KEEP") == "/root\nlive\n"
            assert wait_until(lambda: count(up2, live.id) > before, 5)
            assert sh(attach(c, paused.id), "pwd; echo $KEEP") == "/tmp\npaused\n"
            assert c.get_sandbox(paused.id).state == "running"
            assert wait_until(lambda: count(up2, paused.id) > frozen_count, 5)
            # Pause/resume still works on an adopted sandbox, and so does stop.
            assert c.pause_sandbox(live.id).state == "paused"
            assert c.resume_sandbox(live.id).state == "running"
        rc = up2.stop()
        assert rc == 0, f"restarted dsec up exited {rc}\n{up2.stderr_tail()}"
        for sid in ids:
            assert not dsec_processes(sid), f"processes of {sid} left: {dsec_processes(sid)}"
            assert not dsec_cgroups(sid), f"cgroups of {sid} left"
        assert not mounts_under(data), f"mounts left: {mounts_under(data)}"
        up2.remove_log()
    finally:
        if up.proc is not None and up.proc.poll() is None:
            try:
                up.stop()
            except AssertionError:
                pass
        remove_data_dir(data)
