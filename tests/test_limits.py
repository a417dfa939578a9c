"""Resource limits: memory (OOM), pids (fork bomb), command time, output size."""

from __future__ import annotations

import os
import subprocess
import threading
import time

from helpers import dsec_cgroups, make_sandbox, sh, stop_quietly, vm_rss_kb, wait_until


def test_memory_hog_is_oom_killed_and_sandbox_survives(client, debian):
    sb = make_sandbox(client, debian, memory_limit_mb=128)
    try:
        hog = "python3 -c \"a=[]\nfor i in range(64): a.append(b'\\x01' * (16 << 20))\nprint('survived')\""
        r = sb.run_shell(hog, timeout=60)
        assert "survived" not in r.stdout, "allocating 1 GiB under a 128 MiB limit succeeded"
        assert r.oom_killed, f"result not flagged oom_killed: {r}"
        assert r.exit_code != 0
        assert sh(sb, "echo still-works") == "still-works\n"
        assert sh(sb, "python3 -c 'print(6*7)'") == "42\n"
    finally:
        stop_quietly(sb)


def pids_current(sandbox_id: str):
    """pids.current of the sandbox's user pids cgroup (``<id>/user``, which the limit applies
    to; aether sits above it with a reserve), or of the sandbox's cgroup; None when not found."""
    for cg in sorted(dsec_cgroups(sandbox_id), key=lambda p: (not p.endswith("/user"), p)):
        try:
            with open(os.path.join(cg, "pids.current")) as f:
                return int(f.read().strip())
        except (OSError, ValueError):
            continue
    return None


BOMB = """
import os, sys, time
end = time.time() + float(sys.argv[1])
while time.time() < end:
    try:
        os.fork()
    except OSError:
        time.sleep(0.01)
"""


def recovered(sb) -> bool:
    try:
        return sb.run_shell("echo ok", timeout=5).stdout == "ok\n"
    except Exception:
        return False


def process_count(sb) -> int:
    return int(sh(sb, "ls -d /proc/[0-9]* | wc -l").strip())


def test_fork_bomb_held_by_pids_limit(client, debian):
    """A bomb that retries failed forks and stops by itself after 6 s."""
    sb = make_sandbox(client, debian, pids_limit=64)
    try:
        sb.write_file("/tmp/bomb.py", BOMB)
        result = {}
        t = threading.Thread(target=lambda: result.update(r=sb.run_shell("python3 /tmp/bomb.py 6", timeout=60)))
        t.start()
        time.sleep(3)
        current = pids_current(sb.id)
        host_ok = subprocess.run(["true"]).returncode == 0
        # the control plane should still answer while the sandbox is saturated
        try:
            during = sb.read_file("/etc/hostname")
        except Exception as e:  # noqa: BLE001 - reported below
            during = e
        t.join(90)
        assert not t.is_alive(), "the bomb's command never returned"
        assert host_ok
        assert current is not None, f"no pids cgroup found for {sb.id}"
        assert current <= 64, f"pids.current={current} above pids_limit=64"
        assert current >= 48, f"pids.current={current}: the bomb did not saturate the limit"
        assert wait_until(lambda: recovered(sb), 30, 0.5), "sandbox did not recover after the bomb ended"
        assert wait_until(lambda: process_count(sb) < 16, 15), f"{process_count(sb)} processes left after the bomb"
        assert isinstance(during, bytes), f"reading a file during the fork bomb failed: {during}"
    finally:
        stop_quietly(sb)


def test_fork_bomb_in_timed_out_command(client, debian):
    """An endless bomb in the foreground, bounded only by the command timeout."""
    sb = make_sandbox(client, debian, pids_limit=64)
    try:
        sb.write_file("/tmp/bomb.py", BOMB)
        t0 = time.monotonic()
        r = sb.run_shell("python3 /tmp/bomb.py 100000", timeout=5)
        assert time.monotonic() - t0 < 60
        assert r.timed_out, f"bomb command not reported as timed out: exit {r.exit_code} stderr {r.stderr[:300]!r}"
        assert wait_until(lambda: recovered(sb), 30, 0.5), "sandbox did not recover after the bomb's command timed out"
        assert wait_until(lambda: process_count(sb) < 16, 15), \
            f"{process_count(sb)} processes survived the bomb command's timeout"
    finally:
        stop_quietly(sb)


def test_timed_out_command_dies_with_children(bb):
    r = bb.run_shell("sleep 2001 & (sleep 2002 &) ; sh -c 'sleep 2003' & sleep 2004", timeout=2)
    assert r.timed_out

    def gone() -> bool:
        out = bb.run_shell("cat /proc/[0-9]*/cmdline 2>/dev/null | tr '\\0' ' '").stdout
        return not any(f"sleep 200{i}" in out for i in range(1, 5))

    assert wait_until(gone, 5), "children of a timed-out command are still running: " + \
        bb.run_shell("ps -o pid,args").stdout


def test_huge_output_truncated_and_server_memory_bounded(node, bb):
    pid = node.pid
    base = vm_rss_kb(pid)
    peak = [base]
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            try:
                peak[0] = max(peak[0], vm_rss_kb(pid))
            except (OSError, RuntimeError):
                return
            time.sleep(0.1)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    try:
        r = bb.run_shell("yes 0123456789abcdef | head -c 1073741824; echo done >&2", timeout=300)
    finally:
        stop.set()
        t.join()
    assert not r.timed_out, "1 GiB of output did not finish within 300 s"
    assert r.exit_code == 0
    assert r.stdout_truncated
    assert len(r.stdout_bytes) <= 1024 * 1024, f"kept {len(r.stdout_bytes)} bytes, default limit is 1 MiB"
    assert len(r.stdout_bytes) > 0
    assert r.stdout_total_bytes == 1073741824, f"stdout_total_bytes={r.stdout_total_bytes}"
    assert r.stderr == "done\n"
    growth_mb = (peak[0] - base) / 1024
    assert growth_mb < 200, f"dsec up RSS grew by {growth_mb:.0f} MB while the sandbox printed 1 GiB"
    # a smaller explicit limit is honoured
    r = bb.run_shell("head -c 100000 /dev/zero", max_output_bytes=1000)
    assert r.stdout_truncated and len(r.stdout_bytes) == 1000
