"""Cold-memory reclaim and node memory pressure (issue 10, items 3 and 5), on a real `dsec up`
with `[edge.reclaim]` enabled: a zram swap tier, a 3 s cold time and a node memory budget.

- an idle best-effort sandbox's ~50 MB of touched anonymous memory moves to zram, and the
  Python process holding it still answers with its data intact;
- a latency-sensitive sandbox's memory is left alone (swappiness 0, nothing swapped);
- LS + BE memory hogs past the node budget: the BE sandboxes are reclaimed then paused (their
  info and trajectory say why), the LS process lives, nothing is OOM-killed;
- after `dsec up` exits: no zram device, no swap and no kdamond of ours are left.
"""

from __future__ import annotations

import os
import time

import pytest

from helpers import (
    DsecUp,
    debian_tar,
    force_cleanup,
    free_port,
    new_data_dir,
    remove_data_dir,
    sh,
    stop_quietly,
    wait_until,
)

NODE = f"rc{os.getpid() % 100000}"
COLD_S = 3
BUDGET_MB = 700

CONFIG = f"""
[edge]
reattach_grace_ms = 0

[edge.reclaim]
enabled = true
zram_mb = 1024
cold_s = {COLD_S}
interval_ms = 500
node_memory_budget_mb = {BUDGET_MB}
pressure_high_ratio = 0.85
pressure_psi_some_avg10 = 0.0
"""

# Holds MB of touched memory (1 KiB random + 3 KiB text per page: compressible like a heap),
# then sleeps; answers the sha256 of its data when /tmp/ask appears.
HOLDER = r"""
import hashlib, os, sys, time
mb = int(sys.argv[1]); touch = sys.argv[2] == "touch"
page = 4096
data = bytearray(mb << 20)
text = (b"agent state line %d\n" * 200)[:3072]
for off in range(0, len(data), page):
    data[off:off + 1024] = os.urandom(1024)
    data[off + 1024:off + page] = (text * 2)[:page - 1024]
digest = hashlib.sha256(data).hexdigest()
open("/tmp/digest", "w").write(digest)
open("/tmp/ready", "w").write(str(os.getpid()))
while True:
    if touch:
        for off in range(0, len(data), page):
            data[off] = (data[off] + 1) & 0xFF
    else:
        time.sleep(0.2)
    if os.path.exists("/tmp/ask"):
        os.remove("/tmp/ask")
        if not touch:
            open("/tmp/answer", "w").write(hashlib.sha256(data).hexdigest())
        else:
            open("/tmp/answer", "w").write("alive")
"""


def memcg(sid: str) -> str:
    return f"/sys/fs/cgroup/memory/dsec/{NODE}/{sid}"


def v1_memory() -> bool:
    return os.path.isdir("/sys/fs/cgroup/memory")


def stat(sid: str) -> dict:
    out = {}
    with open(os.path.join(memcg(sid), "memory.stat")) as f:
        for line in f:
            k, v = line.split()
            out[k] = int(v)
    return out


def read(path: str) -> str:
    with open(path) as f:
        return f.read().strip()


def swaps() -> list:
    with open("/proc/swaps") as f:
        return [l.split()[0] for l in f.read().splitlines()[1:] if l.strip()]


def nr_kdamonds() -> str:
    try:
        return read("/sys/kernel/mm/damon/admin/kdamonds/nr_kdamonds")
    except OSError:
        return "absent"


@pytest.fixture(scope="module")
def rnode(dsec_bin):
    if not os.path.isdir("/sys/class/zram-control"):
        pytest.skip("no /sys/class/zram-control: the kernel has no zram")
    if not v1_memory():
        pytest.skip("these checks read cgroup v1 memory.stat; the v2 paths are unit-tested")
    tar = debian_tar()
    if not tar.is_file():
        pytest.skip(f"{tar} is absent (build it with scripts/images/build-debian.sh)")
    data = new_data_dir("reclaim")
    os.makedirs(data, exist_ok=True)
    cfg = os.path.join(data, "dsec.toml")
    kdamonds_before = nr_kdamonds()
    swaps_before = swaps()
    edge_port = free_port()
    # `[edge] listen` must sit in the [edge] table: rewrite the file with it.
    with open(cfg, "w") as f:
        f.write(CONFIG.replace("[edge]\n", f'[edge]\nlisten = "127.0.0.1:{edge_port}"\n', 1))
    # DsecUp has no config option: a wrapper adds `--config` to `up`.
    wrapper = os.path.join(data, "dsec-wrapper.sh")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {dsec_bin} "$@" --config {cfg}; fi\nexec {dsec_bin} "$@"\n')
    os.chmod(wrapper, 0o755)
    up = DsecUp(wrapper, data, NODE)
    up.edge_url = f"http://127.0.0.1:{edge_port}"
    try:
        up.start()
    except RuntimeError as e:
        remove_data_dir(data)
        pytest.fail(str(e), pytrace=False)
    up.cli("image", "import", "debian", "--tar", str(tar), timeout=900)
    marker = os.path.join(data, "edge", "reclaim", "zram.json")
    up.zram_marker = marker
    yield up
    import json

    dev = None
    try:
        dev = json.load(open(marker))["device"]
    except (OSError, ValueError, KeyError):
        pass
    rc = up.stop()
    log = up.stderr_tail(200)
    force_cleanup(data, f"/{NODE}/")
    remove_data_dir(data)
    assert rc == 0, log
    # Nothing leaks: the zram device, its swap, a kdamond.
    assert swaps() == swaps_before, f"swap left after dsec up exited: {swaps()} (before: {swaps_before})\n{log}"
    if dev is not None:
        assert not os.path.exists(f"/sys/block/zram{dev}"), f"zram{dev} left after dsec up exited\n{log}"
    assert nr_kdamonds() == kdamonds_before, f"kdamonds {nr_kdamonds()} != {kdamonds_before} before"
    if not os.environ.get("DSEC_KEEP_LOGS"):
        up.remove_log()


@pytest.fixture(scope="module")
def rclient(rnode):
    c = rnode.client()
    yield c
    c.close()


def make(client, qos: str, memory_mb: int = 1024):
    return client.run_container({"image": "debian", "qos": qos, "memory_limit_mb": memory_mb}, timeout=120)


def start_holder(sb, mb: int, touch: bool = False) -> None:
    sh(sb, f"cat > /tmp/holder.py <<'EOF'\n{HOLDER}\nEOF")
    sh(sb, f"nohup python3 /tmp/holder.py {mb} {'touch' if touch else 'idle'} >/tmp/holder.log 2>&1 &")


def upper(rnode, sid: str, path: str) -> str:
    p = os.path.join(rnode.sandbox_dir(sid), "upper", path.lstrip("/"))
    try:
        return read(p)
    except OSError:
        return ""


def test_swap_tier_is_up(rnode):
    import json

    dev = json.load(open(rnode.zram_marker))["device"]
    assert f"/dev/zram{dev}" in swaps()
    assert int(read(f"/sys/block/zram{dev}/disksize")) == 1024 << 20
    assert read(f"/sys/fs/cgroup/memory/dsec/{NODE}/memory.limit_in_bytes") == str(BUDGET_MB << 20)


def test_idle_best_effort_memory_moves_to_zram_and_ls_is_untouched(rnode, rclient):
    be = make(rclient, "best_effort")
    ls = make(rclient, "latency_sensitive")
    try:
        for sb in (be, ls):
            start_holder(sb, 50)
        # Wait for the data to be written, from the host (no request: the idle clock runs).
        assert wait_until(lambda: upper(rnode, be.id, "/tmp/ready") and upper(rnode, ls.id, "/tmp/ready"), 60)
        assert wait_until(lambda: read(os.path.join(memcg(be.id), "memory.swappiness")) == "100", 5)
        assert read(os.path.join(memcg(ls.id), "memory.swappiness")) == "0"
        ls_before = stat(ls.id)
        assert ls_before["total_rss"] >= 45 << 20, ls_before
        # Cold after COLD_S without a request; the policy runs every 0.5 s.
        ok = wait_until(lambda: stat(be.id).get("total_swap", 0) >= 40 << 20, COLD_S + 20, 0.5)
        be_after = stat(be.id)
        assert ok, f"best-effort memory not moved out: {be_after}\n{rnode.stderr_tail(40)}"
        assert be_after["total_rss"] < 20 << 20, be_after
        ls_after = stat(ls.id)
        assert ls_after.get("total_swap", 0) == 0, ls_after
        assert ls_after["total_rss"] >= ls_before["total_rss"] * 0.9, (ls_before, ls_after)
        # The sandbox still works and the data is intact.
        digest = upper(rnode, be.id, "/tmp/digest")
        sh(be, "rm -f /tmp/answer; touch /tmp/ask")
        assert wait_until(lambda: upper(rnode, be.id, "/tmp/answer") == digest, 20), "holder did not answer its digest"
        assert sh(be, "echo ok") == "ok\n"
        recs = be.trajectory(kind="reclaim")
        assert recs and "cold" in recs[0]["request"]["reason"], recs
        metrics = [l for l in rnode_metrics(rnode).splitlines() if l.startswith("dsec_edge_reclaimed_bytes_total{") and be.id in l]
        assert metrics and float(metrics[0].split()[-1]) >= 40 << 20, metrics
    finally:
        stop_quietly(be)
        stop_quietly(ls)


def rnode_metrics(rnode) -> str:
    import urllib.request

    with urllib.request.urlopen(f"{rnode.edge_url}/metrics", timeout=10) as r:
        return r.read().decode()


def test_pressure_reclaims_then_pauses_best_effort_and_spares_ls(rnode, rclient):
    ls = make(rclient, "latency_sensitive")
    bes = [make(rclient, "best_effort") for _ in range(2)]
    try:
        start_holder(ls, 250, touch=False)
        assert wait_until(lambda: upper(rnode, ls.id, "/tmp/ready"), 60)
        for sb in bes:
            start_holder(sb, 250, touch=True)
        # 750 MB of hogs against a 700 MB budget: BE sandboxes are reclaimed, then paused.
        def both_paused():
            return all(rclient.get_sandbox(sb.id).state == "paused" for sb in bes)

        paused = wait_until(lambda: any(rclient.get_sandbox(sb.id).state == "paused" for sb in bes), 90, 1.0)
        assert paused, f"no best-effort sandbox paused under pressure\n{rnode.stderr_tail(60)}"
        for sb in bes:
            info = rclient.get_sandbox(sb.id)
            if info.state == "paused":
                assert info.reason and "memory pressure" in info.reason, info.reason
        # The LS sandbox was never reclaimed, paused or OOM-killed.
        assert rclient.get_sandbox(ls.id).state == "running"
        assert "oom_kill 0" in read(os.path.join(memcg(ls.id), "memory.oom_control"))
        assert stat(ls.id).get("total_swap", 0) == 0
        pid = upper(rnode, ls.id, "/tmp/ready")
        assert sh(ls, f"kill -0 {pid} && echo alive") == "alive\n"
        digest = upper(rnode, ls.id, "/tmp/digest")
        sh(ls, "rm -f /tmp/answer; touch /tmp/ask")
        assert wait_until(lambda: upper(rnode, ls.id, "/tmp/answer") == digest, 20)
        # The lifecycle events say why.
        for sb in bes:
            kinds = [r["kind"] for r in sb.trajectory(kind=["reclaim", "memory_pressure"])]
            assert "reclaim" in kinds, kinds
        paused_ids = [sb for sb in bes if rclient.get_sandbox(sb.id).state == "paused"]
        recs = paused_ids[0].trajectory(kind="memory_pressure")
        assert recs and recs[0]["request"]["action"] == "pause", recs
        assert "memory pressure" in recs[0]["request"]["reason"]
        ls_recs = ls.trajectory(kind=["reclaim", "memory_pressure"])
        assert ls_recs == [], ls_recs
        # Resuming ends the pause and its reason; the hog is still there.
        info = paused_ids[0].resume()
        assert info.state == "running" and not info.reason, (info.state, info.reason)
        sh(paused_ids[0], "rm -f /tmp/answer; touch /tmp/ask")
        assert wait_until(lambda: upper(rnode, paused_ids[0].id, "/tmp/answer") == "alive", 20)
        # The node carries on: a new sandbox works.
        bb = rclient.run_container({"image": "debian"}, timeout=120)
        assert sh(bb, "echo fine") == "fine\n"
        stop_quietly(bb)
    finally:
        for sb in bes + [ls]:
            stop_quietly(sb)


def test_zram_device_survives_an_edge_crash_and_goes_at_shutdown(dsec_bin):
    """kill -9 of `dsec up` leaves the device swapped on; the restarted edge finds it by its
    marker and re-uses it (no second device); SIGTERM then removes it."""
    if not os.path.isdir("/sys/class/zram-control"):
        pytest.skip("no /sys/class/zram-control: the kernel has no zram")
    import json

    node = f"rz{os.getpid() % 100000}"
    data = new_data_dir("reclaim-restart")
    os.makedirs(data, exist_ok=True)
    cfg = os.path.join(data, "dsec.toml")
    with open(cfg, "w") as f:
        f.write("[edge]\nreattach_grace_ms = 0\n\n[edge.reclaim]\nenabled = true\nzram_mb = 64\ncold_s = 60\n")
    wrapper = os.path.join(data, "dsec-wrapper.sh")
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {dsec_bin} "$@" --config {cfg}; fi\nexec {dsec_bin} "$@"\n')
    os.chmod(wrapper, 0o755)
    marker = os.path.join(data, "edge", "reclaim", "zram.json")
    swaps_before = swaps()
    up = DsecUp(wrapper, data, node)
    try:
        up.start()
        dev = json.load(open(marker))["device"]
        assert f"/dev/zram{dev}" in swaps()
        up.kill()
        assert f"/dev/zram{dev}" in swaps(), "the device went with the crashed edge"
        up2 = DsecUp(wrapper, data, node)
        up2.start()
        assert json.load(open(marker))["device"] == dev
        assert [s for s in swaps() if s.startswith("/dev/zram")] == [s for s in swaps_before if s.startswith("/dev/zram")] + [f"/dev/zram{dev}"]
        assert up2.stop() == 0
        assert swaps() == swaps_before
        assert not os.path.exists(f"/sys/block/zram{dev}")
        assert not os.path.exists(marker)
        up.remove_log()
        up2.remove_log()
    finally:
        up.kill()
        force_cleanup(data, f"/{node}/")
        remove_data_dir(data)
