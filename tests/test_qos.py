"""QoS classes (issue 10): best-effort sandboxes run SCHED_IDLE with the lowest CPU weight,
latency-sensitive ones normally; the class is shown by the API, survives an edge restart, has a
configurable default; admission counts best-effort sandboxes by measured usage behind a
latency-sensitive floor; `dsec nodes` reports the kernel capabilities."""

from __future__ import annotations

import json
import os

import httpx
import pytest

import dsec
from helpers import DsecUp, make_sandbox, new_data_dir, remove_data_dir, sh, stop_quietly, wait_until

SCHED_OTHER, SCHED_IDLE = 0, 5

# Field 41 of /proc/<pid>/stat (policy), read by a shell in the sandbox: the fields after the
# command (field 2, in parentheses) start at field 3, so policy is the 39th of them.
POLICY = "sed 's/.*) //' /proc/self/stat | cut -d' ' -f39"


def cpu_dir(node_id: str, sid: str) -> str:
    v1 = f"/sys/fs/cgroup/cpu/dsec/{node_id}/{sid}"
    return v1 if os.path.isdir(v1) else f"/sys/fs/cgroup/dsec/{node_id}/{sid}"


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def get_info(up: DsecUp, sid: str) -> dict:
    r = httpx.get(f"{up.url}/v1/sandboxes/{sid}", headers={"authorization": f"Bearer {up.key}"}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def policies(sb) -> list:
    """Policy of the shell, of a grandchild, and of aether (pid 1 inside is hidden: the shell's
    parent chain is what the user gets)."""
    out = sh(sb, f"{POLICY}; sh -c \"{POLICY}\"; (sh -c \"{POLICY}\") | cat")
    return [int(x) for x in out.split()]


def assert_best_effort(up: DsecUp, sb) -> None:
    assert policies(sb) == [SCHED_IDLE] * 3, "best-effort processes must be SCHED_IDLE"
    d = cpu_dir(up.node_id, sb.id)
    if os.path.exists(os.path.join(d, "cpu.shares")):
        idle = read(os.path.join(d, "cpu.idle")) if os.path.exists(os.path.join(d, "cpu.idle")) else "0"
        # We write cpu.shares=2, then cpu.idle=1 where the v1 cpu controller has it: the kernel
        # then reports the idle group's weight as 3 (WEIGHT_IDLEPRIO).
        assert (idle, read(os.path.join(d, "cpu.shares"))) in {("0", "2"), ("1", "3")}, d
        assert idle == "1" or not os.path.exists(os.path.join(d, "cpu.idle"))
    else:
        assert read(os.path.join(d, "cpu.weight")) == "1"
        assert read(os.path.join(d, "cpu.idle")) == "1"


def test_best_effort_is_sched_idle_and_lowest_weight(node, client):
    sb = make_sandbox(client, "busybox", qos="best_effort")
    try:
        assert sb.info.qos == "best_effort"
        assert get_info(node, sb.id)["qos"] == "best_effort"
        assert_best_effort(node, sb)
        # RLIMIT_NICE is pinned to 0/0 (see test_best_effort_cannot_leave_sched_idle).
        assert "Max nice priority         0                    0" in sh(sb, "cat /proc/self/limits")
    finally:
        stop_quietly(sb)


def test_best_effort_default_shell_is_sched_idle_every_time(client, debian):
    """aether starts the `default` shell while the edge answers the create, i.e. while the edge
    applies the class: the shell must not escape SCHED_IDLE (a race the agent-first order and a
    second pass over the cgroup close; before, about one create in ten escaped)."""
    escaped = []
    for _ in range(25):
        sb = make_sandbox(client, debian, qos="best_effort")
        try:
            out = sh(sb, "chrt -p $$; grep 'Max nice' /proc/$$/limits")
            if "SCHED_IDLE" not in out or "Max nice priority         0                    0" not in out:
                escaped.append(out)
        finally:
            stop_quietly(sb)
    assert not escaped, escaped


def test_best_effort_cannot_leave_sched_idle(node, client, debian):
    """Leaving SCHED_IDLE needs CAP_SYS_NICE or an RLIMIT_NICE range: sandboxes have neither
    (aether drops CAP_SYS_NICE and CAP_SYS_RESOURCE; the edge pins RLIMIT_NICE to 0/0)."""
    sb = make_sandbox(client, debian, qos="best_effort")
    try:
        r = sb.run_shell("chrt -o -p 0 $$; echo rc=$?; chrt -p $$")
        assert "rc=1" in r.stdout and "Operation not permitted" in r.stderr, r
        assert "SCHED_IDLE" in r.stdout, r
        escape = "import os; os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))"
        for prefix in ("", "os.setgid(65534); os.setuid(65534); "):
            py = "import os; " + prefix + escape.split("; ", 1)[1]
            r = sb.run_shell(f'python3 -c "{py}"; echo rc=$?')
            assert "PermissionError" in r.stderr and "rc=1" in r.stdout, r
        # Raising the limit is refused too (no CAP_SYS_RESOURCE).
        r = sb.run_shell("prlimit --nice=40:40 --pid $$; echo rc=$?")
        assert "rc=1" in r.stdout and "Operation not permitted" in r.stderr, r
        assert policies(sb) == [SCHED_IDLE] * 3
    finally:
        stop_quietly(sb)


def test_latency_sensitive_is_normal(node, client):
    sb = make_sandbox(client, "busybox", qos="latency_sensitive")
    default = make_sandbox(client, "busybox")
    try:
        for s in (sb, default):
            assert get_info(node, s.id)["qos"] == "latency_sensitive"
            assert policies(s) == [SCHED_OTHER] * 3
            d = cpu_dir(node.node_id, s.id)
            if os.path.exists(os.path.join(d, "cpu.shares")):
                assert read(os.path.join(d, "cpu.shares")) == "1024"
            else:
                assert read(os.path.join(d, "cpu.weight")) == "100"
            if os.path.exists(os.path.join(d, "cpu.idle")):
                assert read(os.path.join(d, "cpu.idle")) == "0"
    finally:
        stop_quietly(sb)
        stop_quietly(default)


def test_bad_class_is_rejected(node):
    r = httpx.post(
        f"{node.url}/v1/sandboxes",
        headers={"authorization": f"Bearer {node.key}"},
        json={"image": "busybox", "qos": "gold"},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert "qos" in r.text or "gold" in r.text, r.text


def test_nodes_shows_capabilities(node):
    out = node.cli("nodes").stdout.decode()
    assert "capabilities: cgroup v1" in out or "capabilities: cgroup v2" in out, out
    assert "SCHED_IDLE: available" in out, out
    # This machine's kernel has no core scheduling: reported, not fatal.
    core = -1
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        cookie = ctypes.c_uint64(0)
        core = libc.prctl(62, 0, 0, 0, ctypes.byref(cookie))
        err = ctypes.get_errno()
    except OSError:
        err = 0
    if core != 0 and err == 22:
        assert "core scheduling: unavailable (EINVAL)" in out, out
    elif core == 0:
        assert "core scheduling: available" in out, out
    for name in ("PSI", "DAMON", "zram", "KSM", "cpu.idle", "SMT"):
        assert f"{name}: " in out, out
    assert "admission: memory used" in out, out
    doc = json.loads(node.cli("nodes", "--json").stdout)
    n = next(n for n in doc["nodes"] if n["node"] == node.node_id)
    assert n["capabilities"]["sched_idle"]["available"] is True
    assert "memory_mb_free_be" in n["admission"]


def admission(up: DsecUp) -> dict:
    doc = json.loads(up.cli("nodes", "--json").stdout)
    return (doc["nodes"][0].get("admission") or {}) if doc["nodes"] else {}


def dsec_up_with_config(dsec_bin: str, data: str, node_id: str, edge_toml: str) -> DsecUp:
    """A `dsec up` with an `[edge]` config: a wrapper script adds `--config` to `up`."""
    cfg = data + ".toml"
    with open(cfg, "w") as f:
        f.write("[edge]\n" + edge_toml)
    wrapper = data + ".dsec"
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {dsec_bin} "$@" --config {cfg}; fi\nexec {dsec_bin} "$@"\n')
    os.chmod(wrapper, 0o755)
    return DsecUp(wrapper, data, node_id)


def test_default_class_admission_and_restart(dsec_bin):
    """Node default `best_effort`; a 2 GiB node whose LS floor is half its memory: the second
    1 GiB LS sandbox is refused while 1 GiB best-effort ones keep being admitted (by measured
    use, their requests already exceed the node); the class survives kill -9 and re-adoption."""
    data = new_data_dir("qos")
    node_id = f"qos{os.getpid() % 100000}"
    up = dsec_up_with_config(
        dsec_bin,
        data,
        node_id,
        "memory_mb_total = 2048\nmemory_overcommit = 4.0\n[edge.qos]\ndefault_class = \"best_effort\"\nls_memory_ratio = 0.5\n",
    )
    sbs = []
    try:
        up.start()
        c = up.client()
        be = make_sandbox(c, "busybox", memory_limit_mb=1024)
        sbs.append(be)
        assert get_info(up, be.id)["qos"] == "best_effort", "the node's default class applies"
        assert_best_effort(up, be)
        ls = make_sandbox(c, "busybox", memory_limit_mb=1024, qos="latency_sensitive")
        sbs.append(ls)
        with pytest.raises(dsec.DSecError) as refused:
            sbs.append(make_sandbox(c, "busybox", memory_limit_mb=1024, qos="latency_sensitive"))
        assert "latency-sensitive floor" in str(refused.value), refused.value
        for _ in range(2):
            sbs.append(make_sandbox(c, "busybox", memory_limit_mb=1024, qos="best_effort"))
        # The apiserver shows the edge status its watcher polled last.
        assert wait_until(lambda: admission(up)["memory_mb_committed_be"] == 3072, 15), admission(up)
        a = admission(up)
        assert a["memory_mb_committed_ls"] == 1024 and a["memory_mb_committed_be"] == 3072, a
        # Requests sum to 4 GiB on a 2 GiB node; what counts is the LS floor + measured use.
        # (a starting sandbox counts by its reservation until measured, every qos.sample_ms)
        assert wait_until(lambda: admission(up)["memory_mb_used"] < 2048 * 0.9, 15), admission(up)
        # Edge crash and restart: the sandboxes are re-adopted with their class.
        up.kill()
        up = DsecUp(up.binary, data, node_id).start()
        c2 = up.client()
        info = get_info(up, be.id)
        assert (info["state"], info["qos"]) == ("running", "best_effort"), info
        assert get_info(up, ls.id)["qos"] == "latency_sensitive"
        again = c2.attach(be.id)
        assert_best_effort(up, again)
        assert wait_until(lambda: admission(up).get("memory_mb_committed_be") == 3072, 15), admission(up)
        for s in sbs:
            stop_quietly(c2.attach(s.id))
        c.close()
        c2.close()
    finally:
        rc = up.stop()
        remove_data_dir(data)
        for p in (data + ".toml", data + ".dsec"):
            try:
                os.unlink(p)
            except OSError:
                pass
        tail = up.stderr_tail()
        up.remove_log()
        assert rc == 0, f"dsec up exited {rc}\n{tail}"
