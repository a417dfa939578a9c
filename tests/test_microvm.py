"""The microVM substrate (issue 9): a QEMU guest with its own kernel behind the same API.

Skips (with the reason) when QEMU or the guest artefacts (`scripts/vm/build-guest.sh`) are
absent. Under TCG (no working KVM in CI) a boot takes seconds, so the tests share little and
keep the number of VMs small.
"""

from __future__ import annotations

import os
import platform
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

import dsec
from dsec import DSecMicroVMRunArgs
from helpers import sh, stop_quietly
from vmfixture import missing, qemu_pids_for, skip_if

GUEST = Path(os.environ.get("DSEC_GUEST_DIR") or Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "guest")


@pytest.fixture(scope="module")
def vm_ok():
    skip_if(missing([os.environ.get("DSEC_QEMU", "qemu-system-x86_64")], [GUEST / "vmlinuz", GUEST / "initrd.img"],
                    "scripts/install-deps.sh installs qemu-system-x86", "scripts/vm/build-guest.sh"))


@pytest.fixture(scope="module")
def vm(vm_ok, client):
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=256), timeout=300)
    yield sb
    stop_quietly(sb)


def test_microvm_answers_run_shell(vm):
    assert vm.info.substrate == "microvm"
    r = vm.run_shell("echo hello from the guest; echo err >&2; exit 3")
    assert r.stdout == "hello from the guest\n"
    assert r.stderr == "err\n"
    assert r.exit_code == 3


def test_microvm_has_its_own_kernel(vm):
    guest = sh(vm, "uname -r").strip()
    assert guest and guest != platform.release(), f"guest kernel {guest!r} vs host {platform.release()!r}"
    # PID 1 is aether, not anything of the host.
    assert sh(vm, "cat /proc/1/comm").strip() in ("aether", "dsec-aether")


def test_microvm_file_round_trip(vm):
    data = os.urandom(300_000) + b"\x00\xff"
    vm.write_file("/tmp/blob.bin", data)
    assert vm.read_file("/tmp/blob.bin") == data
    # the root is the image's layers under a writable overlay
    sh(vm, "echo changed > /etc/dsec-test && cat /etc/dsec-test")
    assert vm.read_file("/etc/dsec-test") == b"changed\n"
    assert sh(vm, "wc -c < /tmp/blob.bin").strip() == str(len(data))


def test_microvm_stop_leaves_nothing(vm_ok, client, node):
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    assert vm_dir.is_dir()
    pids = qemu_pids_for(str(vm_dir))
    assert len(pids) == 1, f"expected one QEMU for {sb.id}, found {pids}"
    assert sh(sb, "echo up").strip() == "up"
    sb.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (qemu_pids_for(str(vm_dir)) or vm_dir.exists()):
        time.sleep(0.1)
    assert not qemu_pids_for(str(vm_dir)), "QEMU still running after stop"
    assert not vm_dir.exists(), f"{vm_dir} left after stop: {list(vm_dir.iterdir())}"


def _qemu_rss_kb(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    return 0


def _wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.05)
    return not any(Path(f"/proc/{p}").exists() for p in pids)


def test_microvm_pause_snapshot_resume_chain(vm_ok, client, node):
    """Pause = snapshot to disk + QEMU ended (its memory back to the host); resume (transparent,
    by the next call) restores it: a background counter started before carries on (same pid,
    larger value), a file written before is intact and was on the host's writable disk. Twice."""
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=256), timeout=300)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    try:
        data = os.urandom(50_000)
        sb.write_file("/root/keep.bin", data)
        sh(sb, "cd /root && (i=0; while :; do i=$((i+1)); echo $i > /root/counter.new && mv /root/counter.new /root/counter; sleep 0.1; done) >/dev/null 2>&1 & echo $! > /root/loop.pid")
        sh(sb, "export KEPT=session-env; cd /etc")
        loop_pid = sh(sb, "cat /root/loop.pid").strip()
        time.sleep(1.0)
        for round_ in range(2):
            pids = qemu_pids_for(str(vm_dir))
            assert len(pids) == 1, pids
            rss_before = _qemu_rss_kb(pids[0])
            assert rss_before > 10_000, rss_before
            before = int(sh(sb, "cat /root/counter"))
            # A file that is not being rewritten: its bytes on the host disk are defined (the
            # counter's file is rewritten every 0.1 s, so its blocks on disk can be mid-update).
            sh(sb, f"echo round-{round_}-{before} > /root/marker")
            info = sb.pause()
            assert info.state == "paused"
            rep = info.last_pause
            assert rep is not None and rep["memory_after_bytes"] == 0 and rep["memory_before_bytes"] > 0, rep
            assert "snapshot" in rep["method"], rep["method"]
            # QEMU is gone (its memory with it), the snapshot is on disk.
            assert _wait_gone(pids), f"QEMU {pids} still running while paused"
            assert not qemu_pids_for(str(vm_dir))
            snap = vm_dir / "snapshot"
            assert snap.is_file() and snap.stat().st_size > 1_000_000, snap
            # The snapshot's size is a field of the report (the file on disk).
            assert rep["snapshot_bytes"] == snap.stat().st_size, (rep, snap.stat().st_size)
            assert client.get_sandbox(sb.id).state == "paused"
            # The writable layer is a file on the host: the guest's files are in it.
            if shutil.which("debugfs"):
                out = subprocess.run(["debugfs", "-R", "cat /upper/root/marker", str(vm_dir / "upper.img")],
                                     capture_output=True, text=True, timeout=30).stdout.strip()
                assert out == f"round-{round_}-{before}", out
            time.sleep(0.5)
            # Transparent resume by the next call.
            after = int(sh(sb, "cat /root/counter"))
            assert after >= before, (before, after)
            assert client.get_sandbox(sb.id).state == "running"
            assert not snap.exists(), "the used snapshot was not removed"
            new_pids = qemu_pids_for(str(vm_dir))
            assert len(new_pids) == 1 and new_pids != pids, (pids, new_pids)
            time.sleep(0.6)
            later = int(sh(sb, "cat /root/counter"))
            assert later > after, f"round {round_}: the counter did not continue ({after} -> {later})"
            assert sh(sb, "cat /root/loop.pid").strip() == loop_pid
            assert sh(sb, f"kill -0 {loop_pid} && echo alive").strip() == "alive", "the loop was restarted"
            # The shell session kept its state.
            assert sh(sb, 'echo "$KEPT $PWD"').strip() == "session-env /etc"
            assert sb.read_file("/root/keep.bin") == data
    finally:
        stop_quietly(sb)
    assert _wait_gone(qemu_pids_for(str(vm_dir)))
    assert not vm_dir.exists()


def test_microvm_stop_while_paused_leaves_nothing(vm_ok, client, node):
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    sh(sb, "echo x > /root/x")
    sb.pause()
    assert (vm_dir / "snapshot").is_file()
    sb.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and vm_dir.exists():
        time.sleep(0.1)
    assert not vm_dir.exists(), "VM dir (snapshot, disk) left after stop while paused"
    assert not qemu_pids_for(str(vm_dir))
    assert client.get_sandbox(sb.id).state == "stopped"


def test_microvm_pack_diff_becomes_a_layer(vm_ok, client, node):
    """The writable disk (ext4 image) of a running microVM is packed into a layer; a new
    sandbox (a container: any substrate can use the image) from parent + diff sees the files,
    deletions included; the VM keeps running."""
    name = f"vm-packed-{uuid.uuid4().hex[:8]}:v1"
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    try:
        sh(sb, "mkdir -p /data && echo from-the-vm > /data/file && rm /bin/vi && mkdir -p /skip && echo x > /skip/y")
        info = sb.pack_diff(name, exclude=["/skip"])
        assert info.parent == "busybox:latest", info
        assert sh(sb, "cat /data/file").strip() == "from-the-vm"
        assert not (vm_dir / "pack.mnt").exists(), "the host mount of the disk was left"
    finally:
        stop_quietly(sb)
    new = client.run_microvm(DSecMicroVMRunArgs(container_image=name), timeout=300)
    try:
        assert sh(new, "cat /data/file").strip() == "from-the-vm"
        assert new.run_shell("test -e /bin/vi").exit_code != 0, "the deletion (whiteout) was lost"
        assert new.run_shell("test -e /skip/y").exit_code != 0, "an excluded path was packed"
    finally:
        stop_quietly(new)


def test_microvm_paused_survives_edge_restart(vm_ok, dsec_bin):
    """A paused microVM is re-adopted by a restarted edge (its snapshot is on disk) and resumes
    with its background loop; a running one is reported lost and cleaned."""
    from helpers import DsecUp, new_data_dir, remove_data_dir

    data = new_data_dir("vmrestart")
    up = DsecUp(dsec_bin, data, f"e2evm{os.getpid()}").start()
    try:
        with up.client() as c:
            paused = c.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
            sh(paused, "(i=0; while :; do i=$((i+1)); echo $i > /root/counter.new && mv /root/counter.new /root/counter; sleep 0.1; done) >/dev/null 2>&1 &")
            sh(paused, "cd /etc")
            time.sleep(0.5)
            paused.pause()
            running = c.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
            sh(running, "echo up")
        up.kill()
        up2 = DsecUp(dsec_bin, data, up.node_id).start()
        up = up2
        with up2.client() as c:
            assert c.get_sandbox(paused.id).state == "paused"
            lost = c.get_sandbox(running.id)
            assert lost.state == "failed", lost
            r = c.resume_sandbox(paused.id)
            assert r.state == "running"
            h = c.attach(paused.id)
            h._inner.auto_step = False  # its calls are new ones, not replays of earlier steps
            before = int(sh(h, "cat /root/counter"))
            time.sleep(0.5)
            assert int(sh(h, "cat /root/counter")) > before
            assert sh(h, "pwd").strip() == "/etc"
            h.stop()
        rc = up2.stop()
        assert rc == 0, up2.stderr_tail()
        assert not qemu_pids_for(data), "QEMU processes left"
        up2.remove_log()
    finally:
        if up.proc is not None and up.proc.poll() is None:
            try:
                up.stop()
            except AssertionError:
                pass
        for p in qemu_pids_for(data):
            os.kill(p, 9)
        remove_data_dir(data)


def test_microvm_from_debian_layers(vm_ok, client, debian):
    """The debian image's (split: metadata + data blob) layers as the guest's root."""
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image=debian, memory_limit_mb=512), timeout=300)
    try:
        assert sh(sb, "cat /etc/debian_version").strip()
        assert sh(sb, "uname -r").strip() != platform.release()
        r = sb.run_shell("ls /nonexistent")
        assert r.exit_code != 0 and "No such file" in r.stderr
        data = os.urandom(100_000)
        sb.write_file("/root/x.bin", data)
        assert sb.read_file("/root/x.bin") == data
        assert sh(sb, "sha256sum /root/x.bin | cut -c1-8").strip() == __import__("hashlib").sha256(data).hexdigest()[:8]
    finally:
        stop_quietly(sb)


def _qemu_cmdline(vm_dir: Path) -> list:
    return Path(f"/proc/{qemu_pids_for(str(vm_dir))[0]}/cmdline").read_bytes().decode().split("\0")


def test_microvm_layers_and_balloon(vm_ok, client, debian, node):
    """Density hooks on the node's default machine: a free-page-reporting balloon, and the
    debian layers as virtio-pmem regions mounted with DAX where the machine has them (`pc`;
    QEMU 7.2's `microvm` gives pmem no address, so there they are virtio-blk disks)."""
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image=debian, memory_limit_mb=512), timeout=300)
    try:
        vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
        argv = _qemu_cmdline(vm_dir)
        cmd = " ".join(argv)
        machine = argv[argv.index("-M") + 1].split(",")[0]
        assert "free-page-reporting=on" in cmd
        assert sh(sb, "cat /sys/bus/virtio/drivers/virtio_balloon/*/features >/dev/null && echo ok").strip() == "ok"
        if machine == "microvm" or os.environ.get("DSEC_MICROVM_PMEM") == "0":
            assert "virtio-pmem" not in cmd, cmd
            blk = "virtio-blk-device" if machine == "microvm" else "virtio-blk-pci"
            assert blk in cmd, cmd
        else:
            _assert_pmem_dax(sb, vm_dir, cmd)
        # Python from the layers works.
        assert sh(sb, "python3 -c 'import json; print(json.dumps([1]))'").strip() == "[1]"
    finally:
        stop_quietly(sb)


def _assert_pmem_dax(sb, vm_dir: Path, cmd: str) -> None:
    assert "virtio-pmem-pci" in cmd and "share=on,readonly=on" in cmd, cmd
    # Layer mounts are not visible after switch_root; the console log of /init says if DAX
    # was refused.
    console = (vm_dir / "console.log").read_text(errors="replace")
    assert "dsec-init" in console and "no DAX" not in console, console[-2000:]
    assert sh(sb, "ls /sys/block | grep -c pmem").strip() != "0"
    assert "overlay" in sh(sb, "cat /proc/mounts")


def test_microvm_pc_machine_layers_on_pmem_with_dax(vm_ok, dsec_bin, monkeypatch):
    """On the `pc` machine (DSEC_MICROVM_MACHINE=pc) the layers are virtio-pmem regions mounted
    with DAX, so co-located VMs share the host's page cache of them."""
    from helpers import DsecUp, new_data_dir, remove_data_dir

    monkeypatch.setenv("DSEC_MICROVM_MACHINE", "pc")
    monkeypatch.setenv("DSEC_MICROVM_TEMPLATES", "0")
    data = new_data_dir("vmpc")
    up = DsecUp(dsec_bin, data, f"e2epc{os.getpid() % 100000}").start()
    try:
        with up.client() as c:
            sb = c.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
            try:
                vm_dir = Path(up.sandbox_dir(sb.id)) / "vm"
                argv = _qemu_cmdline(vm_dir)
                assert argv[argv.index("-M") + 1].split(",")[0] == "pc", argv
                _assert_pmem_dax(sb, vm_dir, " ".join(argv))
                assert sh(sb, "echo from-dax-layers").strip() == "from-dax-layers"
            finally:
                stop_quietly(sb)
    finally:
        up.stop()
        remove_data_dir(data)
        up.remove_log()


def test_microvm_disk_limit_sizes_the_writable_disk(vm_ok, client, node):
    """disk_limit_mb is the size of the VM's writable disk: writing past it fails with ENOSPC
    inside the guest (not an I/O error of the host file) and the VM stays usable."""
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", disk_limit_mb=64), timeout=300)
    try:
        img = Path(node.sandbox_dir(sb.id)) / "vm" / "upper.img"
        assert img.stat().st_size == 64 << 20, img.stat().st_size
        r = sb.run_shell("dd if=/dev/zero of=/root/big bs=1M count=100 2>&1; echo rc=$?", timeout=120)
        assert "No space left on device" in r.stdout, r.stdout
        assert "rc=0" not in r.stdout, r.stdout
        written = int(sh(sb, "stat -c %s /root/big").strip())
        assert 0 < written < 64 << 20, written
        # Still usable: free the space, write a file, read it back.
        sh(sb, "rm /root/big && echo still-here > /root/after && sync")
        assert sh(sb, "cat /root/after").strip() == "still-here"
        assert sb.run_shell("dmesg | grep -ci 'I/O error' || true").stdout.strip() in ("", "0")
    finally:
        stop_quietly(sb)


def test_microvm_hostname_and_refusals(vm_ok, client):
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", hostname="guest-1"), timeout=300)
    try:
        assert sh(sb, "hostname").strip() == "guest-1"
        # per-command env works
        assert sb.run_shell('echo "$FOO"', env={"FOO": "it's here"}).stdout.strip() == "it's here"
    finally:
        stop_quietly(sb)
    # a sandbox-wide env reaches every command (aether --env-file in the guest)
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", env={"FOO": "x y", "BAR": "1"}), timeout=300)
    try:
        assert sh(sb, 'echo "$FOO|$BAR"').strip() == "x y|1"
    finally:
        stop_quietly(sb)
    # a user the image does not have: the create fails saying so, no VM is left running
    with pytest.raises(dsec.DSecError, match="no-such-user"):
        client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", init_user="no-such-user"), timeout=300)


def test_microvm_whose_qemu_dies_is_reported_and_cleaned(vm_ok, client, node):
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    pids = qemu_pids_for(str(vm_dir))
    assert len(pids) == 1
    os.kill(pids[0], 9)
    deadline = time.monotonic() + 20
    info = client.get_sandbox(sb.id)
    while time.monotonic() < deadline and info.state not in ("failed", "stopped"):
        time.sleep(0.1)
        info = client.get_sandbox(sb.id)
    assert info.state == "failed", info
    while time.monotonic() < deadline and vm_dir.exists():
        time.sleep(0.1)
    assert not vm_dir.exists(), f"{vm_dir} left after QEMU died"
    assert not qemu_pids_for(str(vm_dir))


def test_microvm_create_stop_cycles_leak_nothing(vm_ok, client, node):
    """`DSEC_MICROVM_CYCLES` create/stop cycles (default 50, the issue's must-show)."""
    n = int(os.environ.get("DSEC_MICROVM_CYCLES", "50"))
    sandboxes_dir = Path(node.sandbox_dir("x")).parent
    before = set(qemu_pids_for(str(sandboxes_dir)))
    ids = []
    for _ in range(n):
        sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox"), timeout=300)
        ids.append(sb.id)
        assert sh(sb, "echo $((6*7))").strip() == "42"
        sb.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and set(qemu_pids_for(str(sandboxes_dir))) - before:
        time.sleep(0.1)
    assert not set(qemu_pids_for(str(sandboxes_dir))) - before, "QEMU processes left"
    # Only this test's sandboxes: other tests of the shared node may have live microVMs.
    left = [sandboxes_dir / i for i in ids if (sandboxes_dir / i).exists()]
    assert not left, f"VM directories left: {left}"
