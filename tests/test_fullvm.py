"""The full-VM substrate (issue 9, item 2): a QEMU PC booting a whole Linux disk image through
the firmware (SeaBIOS -> extlinux -> kernel), on a per-VM copy-on-write overlay, behind the
same API as containers.

The disk image is built by `scripts/vm/build-disk.sh` (CI runs it) into
`${DSEC_CACHE:-/var/cache/dsec}/vm/debian.qcow2`; the tests skip, printing why, when QEMU or the
image is absent. Under TCG a boot takes seconds: the tests share one VM where they can.
"""

from __future__ import annotations

import hashlib
import os
import platform
import select
import shutil
import subprocess
import time
import uuid
from pathlib import Path

import pytest

import dsec
from dsec import DSecVMRunArgs
from helpers import sh, stop_quietly
from vmfixture import missing, qemu_pids_for, skip_if

CACHE = Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec"))
VMDIR = CACHE / "vm"
IMAGE = VMDIR / "debian.qcow2"


@pytest.fixture(scope="module")
def fv_ok():
    skip_if(missing([os.environ.get("DSEC_QEMU", "qemu-system-x86_64"), "qemu-img"], [IMAGE],
                    "scripts/install-deps.sh installs qemu-system-x86, qemu-utils", "scripts/vm/build-disk.sh"))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _wait_gone(pids, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(Path(f"/proc/{p}").exists() for p in pids):
        time.sleep(0.05)
    return not any(Path(f"/proc/{p}").exists() for p in pids)


@pytest.fixture(scope="module")
def image_sum(fv_ok):
    return sha256(IMAGE)


@pytest.fixture(scope="module")
def vm(fv_ok, image_sum, client, node):
    t0 = time.monotonic()
    sb = client.run_vm(DSecVMRunArgs(image="debian", memory_limit_mb=512, cpu_cores_limit=1), timeout=600)
    first = sb.run_shell("echo first")
    print(f"\nfull VM: create + first command {time.monotonic() - t0:.2f} s (accel {os.environ.get('DSEC_VM_ACCEL', 'tcg')})")
    assert first.stdout == "first\n"
    yield sb
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    stop_quietly(sb)
    # No QEMU, socket or overlay left after stop.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (qemu_pids_for(str(vm_dir)) or vm_dir.exists()):
        time.sleep(0.1)
    assert not qemu_pids_for(str(vm_dir)), "QEMU still running after stop"
    assert not vm_dir.exists(), f"{vm_dir} left after stop"


def test_vm_booted_through_the_firmware_answers_run_shell(vm, node):
    assert vm.info.substrate == "vm"
    assert vm.info.image == "debian"
    r = vm.run_shell("echo hello from the VM; echo err >&2; exit 3")
    assert (r.stdout, r.stderr, r.exit_code) == ("hello from the VM\n", "err\n", 3)
    # Its own kernel: the one build-disk.sh put on the disk, not the host's.
    guest = sh(vm, "uname -r").strip()
    assert guest == (VMDIR / "kernel-version").read_text().strip()
    assert guest != platform.release()
    # Booted by extlinux from the disk (it adds BOOT_IMAGE=), the root is the virtio disk.
    cmdline = sh(vm, "cat /proc/cmdline")
    assert "BOOT_IMAGE=" in cmdline and "root=/dev/vda1" in cmdline, cmdline
    assert "/dev/vda1 / ext4" in sh(vm, "cat /proc/mounts")
    # The firmware and the boot loader printed on the serial console.
    console = (Path(node.sandbox_dir(vm.id)) / "vm" / "console.log").read_bytes()
    assert b"SeaBIOS" in console and b"SYSLINUX" in console, console[:500]
    # The sandbox's hostname; Debian's userland.
    assert sh(vm, "hostname").strip() == vm.info.hostname
    assert "bookworm" in sh(vm, "cat /etc/os-release")


def test_vm_files_and_the_image_stays_unchanged(vm, node, image_sum):
    data = os.urandom(300_000) + b"\x00\xff"
    vm.write_file("/root/blob.bin", data)
    assert vm.read_file("/root/blob.bin") == data
    sh(vm, "echo changed > /etc/dsec-test && sync")
    assert vm.read_file("/etc/dsec-test") == b"changed\n"
    assert sh(vm, "sha256sum /root/blob.bin").split()[0] == hashlib.sha256(data).hexdigest()
    # The writes went to the VM's overlay; the base image is bit for bit the same.
    overlay = Path(node.sandbox_dir(vm.id)) / "vm" / "overlay.qcow2"
    info = subprocess.run(["qemu-img", "info", "-U", str(overlay)], capture_output=True, text=True, check=True).stdout
    assert str(IMAGE) in info, info
    assert sha256(IMAGE) == image_sum, "the base image changed"


def test_vm_interactive_terminal(vm, node):
    """`dsec shell` (the TTY route) gets a real terminal in the guest."""
    master, slave = os.openpty()
    p = subprocess.Popen([node.binary, "shell", vm.id], env=node.env(), stdin=slave, stdout=slave,
                         stderr=slave, start_new_session=True)
    os.close(slave)
    out = b""
    try:
        os.write(master, b"tty; echo TTY-OK-$((6*7)); exit\r")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and b"TTY-OK-42" not in out:
            r, _, _ = select.select([master], [], [], 0.5)
            if r:
                try:
                    out += os.read(master, 65536)
                except OSError:
                    break
        assert b"TTY-OK-42" in out, out[-1000:]
        assert b"/dev/pts/" in out, out[-1000:]
        p.wait(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        os.close(master)


def test_vm_pause_snapshot_resume_keeps_files_and_a_counter(vm, client, node):
    vm_dir = Path(node.sandbox_dir(vm.id)) / "vm"
    vm.write_file("/root/keep.txt", b"kept across the pause\n")
    sh(vm, "(i=0; while :; do i=$((i+1)); echo $i > /root/counter.new && mv /root/counter.new /root/counter; sleep 0.2; done) >/dev/null 2>&1 & echo $! > /root/loop.pid")
    loop_pid = sh(vm, "cat /root/loop.pid").strip()
    time.sleep(1.0)
    for _ in range(2):  # chainable: a resumed VM pauses again
        pids = qemu_pids_for(str(vm_dir))
        assert len(pids) == 1, pids
        before = int(sh(vm, "cat /root/counter"))
        info = vm.pause()
        assert info.state == "paused"
        rep = info.last_pause
        assert rep is not None and rep["memory_after_bytes"] == 0 and rep["memory_before_bytes"] > 0, rep
        assert _wait_gone(pids), f"QEMU {pids} still running while paused"
        assert (vm_dir / "snapshot").is_file()
        assert client.get_sandbox(vm.id).state == "paused"
        # Transparent resume by the next call.
        after = int(sh(vm, "cat /root/counter"))
        assert after >= before
        assert client.get_sandbox(vm.id).state == "running"
        assert not (vm_dir / "snapshot").exists(), "the used snapshot was not removed"
        time.sleep(0.8)
        later = int(sh(vm, "cat /root/counter"))
        assert later > after, f"the counter did not continue ({after} -> {later})"
        assert sh(vm, f"kill -0 {loop_pid} && echo alive").strip() == "alive", "the loop was restarted"
        assert vm.read_file("/root/keep.txt") == b"kept across the pause\n"


def test_vm_refusals(fv_ok, client, vm):
    with pytest.raises(dsec.ImageNotFound):
        client.run_vm(DSecVMRunArgs(image="no-such-vm-image-e2e"), timeout=60)
    with pytest.raises(dsec.BadRequest, match="VM image name"):
        client.run_vm(DSecVMRunArgs(image="../etc/passwd"), timeout=60)
    with pytest.raises(dsec.BadRequest, match="env"):
        client.run_vm({"image": "debian", "env": {"A": "b"}}, timeout=60)
    with pytest.raises(dsec.BadRequest, match="workspace"):
        client.run_vm({"image": "debian", "toolkits": ["busybox"]}, timeout=60)
    with pytest.raises(dsec.BadRequest, match="disk_limit_mb"):
        client.run_vm({"image": "debian", "disk_limit_mb": 512}, timeout=60)
    # Network modes work for full VMs (tests/test_vm_network.py), so they are no refusal.
    # What a full VM cannot do is refused, not ignored.
    with pytest.raises(dsec.Unsupported, match="pack_diff"):
        vm.pack_diff(f"fv-pack-{uuid.uuid4().hex[:6]}")


def test_vm_direct_kernel_boot_of_an_imported_image(fv_ok, client, node, dsec_bin):
    direct = VMDIR / "direct"
    if not (direct / "vmlinuz").is_file():
        pytest.skip(f"{direct}/vmlinuz is absent: run scripts/vm/build-disk.sh")
    name = f"fvt-direct-{uuid.uuid4().hex[:6]}"
    cmdline = "root=/dev/vda1 rw console=ttyS0 panic=-1 quiet init=/usr/local/sbin/dsec-init dsec.boot=direct"
    subprocess.run([dsec_bin, "vm", "image", "import", name, str(IMAGE), "--data-dir", node.data_dir,
                    "--kernel", str(direct / "vmlinuz"), "--initrd", str(direct / "initrd.img"),
                    "--cmdline", cmdline], check=True, capture_output=True, timeout=300)
    try:
        ls = subprocess.run([dsec_bin, "vm", "image", "ls", "--data-dir", node.data_dir],
                            check=True, capture_output=True, text=True).stdout
        assert name in ls
        sb = client.run_vm(DSecVMRunArgs(image=name, memory_limit_mb=384), timeout=600)
        try:
            got = sh(sb, "cat /proc/cmdline")
            assert "dsec.boot=direct" in got and "BOOT_IMAGE=" not in got, got
            assert sh(sb, "echo direct").strip() == "direct"
        finally:
            stop_quietly(sb)
    finally:
        subprocess.run([dsec_bin, "vm", "image", "rm", name, "--data-dir", node.data_dir], check=False)
    assert not list(Path(node.data_dir, "vm-images").glob(f"{name}.*"))


def test_vm_stop_while_paused_leaves_nothing(fv_ok, client, node):
    sb = client.run_vm(DSecVMRunArgs(image="debian", memory_limit_mb=256), timeout=600)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    sh(sb, "echo x > /root/x")
    sb.pause()
    assert (vm_dir / "snapshot").is_file() and not qemu_pids_for(str(vm_dir))
    sb.stop()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and vm_dir.exists():
        time.sleep(0.1)
    assert not vm_dir.exists(), "VM dir (snapshot, overlay) left after stop while paused"
    assert client.get_sandbox(sb.id).state == "stopped"


def test_prepare_image_injects_aether_and_leaves_the_input_alone(fv_ok, dsec_bin, tmp_path):
    """`dsec vm prepare-image` on a small partitioned qcow2 image (built here): the output has
    aether and the boot hook in the root partition; the input's checksum is unchanged."""
    for t in ("sfdisk", "mkfs.ext4", "debugfs"):
        if shutil.which(t) is None:
            pytest.skip(f"{t} is not installed")
    raw = tmp_path / "small.raw"
    with open(raw, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["sfdisk", "-q", str(raw)], input=b"start=2048, size=20480, type=83\nstart=22528, type=83\n", check=True)
    # Partition 1: no root (a data partition); partition 2: the root.
    for i, (start, size) in enumerate(((2048, 20480), (22528, (64 << 11) - 22528))):
        part = tmp_path / f"p{i}.img"
        with open(part, "wb") as f:
            f.truncate(size * 512)
        root = tmp_path / f"root{i}"
        (root / "etc").mkdir(parents=True)
        if i == 1:
            (root / "etc" / "os-release").write_text("ID=test\n")
        subprocess.run(["mkfs.ext4", "-q", "-F", "-d", str(root), str(part)], check=True)
        subprocess.run(["dd", f"if={part}", f"of={raw}", "bs=512", f"seek={start}", "conv=notrunc", "status=none"], check=True)
    src = tmp_path / "small.qcow2"
    subprocess.run(["qemu-img", "convert", "-f", "raw", "-O", "qcow2", str(raw), str(src)], check=True)
    before = sha256(src)
    out = tmp_path / "out.raw"
    p = subprocess.run([dsec_bin, "vm", "prepare-image", "--in", str(src), "--out", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert "partition 2" in p.stdout, p.stdout
    assert sha256(src) == before, "prepare-image modified its input"
    assert not list(tmp_path.glob(".dsec-prepare*")), "scratch files left"
    # Read partition 2 of the output without mounting it.
    part2 = tmp_path / "out-p2.img"
    subprocess.run(["dd", f"if={out}", f"of={part2}", "bs=512", "skip=22528", "status=none"], check=True)
    ls = subprocess.run(["debugfs", "-R", "ls -l /usr/local/sbin", str(part2)], capture_output=True, text=True).stdout
    assert "dsec-aether" in ls and "dsec-init" in ls, ls
    hook = subprocess.run(["debugfs", "-R", "cat /usr/local/sbin/dsec-init", str(part2)], capture_output=True).stdout
    assert b"--mode bare --fd 3" in hook


def test_vm_whose_qemu_is_killed_is_reported_dead_and_cleaned(fv_ok, client, node):
    sb = client.run_vm(DSecVMRunArgs(image="debian", memory_limit_mb=384), timeout=600)
    vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
    assert sh(sb, "echo up").strip() == "up"
    pids = qemu_pids_for(str(vm_dir))
    assert len(pids) == 1, pids
    assert (vm_dir / "overlay.qcow2").is_file() and (vm_dir / "aether.sock").exists()
    os.kill(pids[0], 9)
    deadline = time.monotonic() + 20
    info = client.get_sandbox(sb.id)
    while time.monotonic() < deadline and info.state not in ("failed", "stopped"):
        time.sleep(0.1)
        info = client.get_sandbox(sb.id)
    assert info.state == "failed", info
    while time.monotonic() < deadline and vm_dir.exists():
        time.sleep(0.1)
    assert not vm_dir.exists(), f"{vm_dir} (overlay, sockets) left after QEMU died"
    assert not qemu_pids_for(str(vm_dir))


def test_vm_create_stop_cycles_leak_nothing(fv_ok, client, node):
    """Create/stop cycles (DSEC_FULLVM_CYCLES, default 5: each boots a VM under emulation) leave
    no QEMU process, socket, overlay or VM directory behind."""
    n = int(os.environ.get("DSEC_FULLVM_CYCLES", "5"))
    sandboxes = Path(node.data_dir) / "edge" / "sandboxes"
    before = set(qemu_pids_for(str(sandboxes)))
    ids = []
    for _ in range(n):
        sb = client.run_vm(DSecVMRunArgs(image="debian", memory_limit_mb=256), timeout=600)
        ids.append(sb.id)
        assert sh(sb, "echo ok").strip() == "ok"
        sb.stop()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and set(qemu_pids_for(str(sandboxes))) - before:
        time.sleep(0.1)
    assert not set(qemu_pids_for(str(sandboxes))) - before, "QEMU processes left"
    left = [i for i in ids if (Path(node.sandbox_dir(i)) / "vm").exists()]
    assert not left, f"VM directories (overlay, sockets) left: {left}"


# --- a user image prepared with `dsec vm prepare-image`: its boot hook brings the network up;
# --- a paused full VM survives an edge crash (re-adopted), a running one is cleaned up.
# The networked edge and test servers of tests/test_vm_network.py (imported, not copied).
from netfixture import denied  # noqa: E402
from test_vm_network import GATEWAY, NPM, PY_GET, PYPI, ok, servers, vclient, vm_ok, vnode, wait_clean  # noqa: E402,F401

KVER_FILE = VMDIR / "kernel-version"


def _user_image(tmp: Path, dsec_bin: str) -> Path:
    """A "user-supplied" Linux disk whose own initramfs does not configure the network: the
    dsec disk with its initramfs' network part cut out (and qemu_fw_cfg no longer loaded by it),
    the image's own kernel modules (qemu_fw_cfg, virtio_net) in /lib/modules and an `ip` and
    `modprobe` of its own (busybox) — then `dsec vm prepare-image` on it."""
    for t in ("losetup", "depmod", "dpkg-deb", "cpio", "gzip"):
        if shutil.which(t) is None:
            pytest.skip(f"{t} is not installed")
    busybox = Path("/bin/busybox")
    kver = KVER_FILE.read_text().strip()
    debs = sorted((CACHE / "guest-debs").glob(f"linux-image-{kver}_*.deb"))
    if not busybox.is_file() or not debs:
        pytest.skip("needs /bin/busybox (busybox-static) and the guest kernel .deb (scripts/vm/build-guest.sh)")
    raw = tmp / "user.raw"
    subprocess.run(["qemu-img", "convert", "-f", "qcow2", "-O", "raw", str(IMAGE), str(raw)], check=True)
    kdir = tmp / "k"
    ird = tmp / "initrd"
    subprocess.run(["dpkg-deb", "-x", str(debs[0]), str(kdir)], check=True)
    mnt = tmp / "mnt"
    mnt.mkdir()
    loop = subprocess.run(["losetup", "-f", "--show", "-o", str(2048 * 512), str(raw)], check=True,
                          capture_output=True, text=True).stdout.strip()
    try:
        subprocess.run(["mount", loop, str(mnt)], check=True)
        try:
            mods = mnt / "usr" / "lib" / "modules" / kver
            for m in ("drivers/firmware/qemu_fw_cfg.ko", "drivers/net/virtio_net.ko",
                      "drivers/net/net_failover.ko", "net/core/failover.ko"):
                (mods / "kernel" / m).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(kdir / "lib" / "modules" / kver / "kernel" / m, mods / "kernel" / m)
            subprocess.run(["depmod", "-b", str(mnt / "usr"), kver], check=True)
            bb = mnt / "usr" / "local" / "bin" / "busybox"
            bb.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(busybox, bb)
            for a in ("ip", "modprobe"):
                os.symlink("/usr/local/bin/busybox", mnt / "usr" / "local" / "sbin" / a)
            # The initramfs without its network part.
            ird.mkdir()
            data = subprocess.run(["gzip", "-dc", str(mnt / "boot" / "initrd.img")], check=True,
                                  capture_output=True).stdout
            subprocess.run(["cpio", "-idm", "--quiet"], input=data, cwd=ird, check=True)
            init = (ird / "init").read_text()
            line = "netcfg_file=/sys/firmware/qemu_fw_cfg/by_name/opt/dsec/net/raw"
            assert line in init, "the dsec disk's initramfs changed: adapt this test"
            (ird / "init").write_text(init.replace(line, "netcfg_file=/nonexistent"))
            order = (ird / "modules.order").read_text().splitlines()
            (ird / "modules.order").write_text("".join(f"{l}\n" for l in order if "qemu_fw_cfg" not in l))
            files = subprocess.run("find . -print0 | sort -z", shell=True, cwd=ird, check=True,
                                   capture_output=True).stdout
            packed = subprocess.run(["cpio", "--null", "-o", "-H", "newc", "--quiet", "-R", "0:0"], input=files,
                                    cwd=ird, check=True, capture_output=True).stdout
            (mnt / "boot" / "initrd.img").write_bytes(subprocess.run(["gzip", "-1"], input=packed, check=True,
                                                                      capture_output=True).stdout)
        finally:
            subprocess.run(["umount", str(mnt)], check=True)
    finally:
        subprocess.run(["losetup", "-d", loop], check=True)
    out = tmp / "user.qcow2"
    subprocess.run([dsec_bin, "vm", "prepare-image", "--in", str(raw), "--out", str(out)], check=True,
                   capture_output=True, timeout=600)
    raw.unlink()
    # pytest keeps the last runs' tmp_path: leave no kernel tree or initramfs there.
    shutil.rmtree(kdir)
    shutil.rmtree(ird)
    return out


def test_prepared_image_network_and_edge_crash_readoption(fv_ok, vclient, vnode, dsec_bin, tmp_path):
    """A prepared user image whose initramfs knows nothing of dsec gets its NIC configured by
    the boot hook (fw_cfg opt/dsec/net, its own modules and `ip`): allowed server reached,
    denied one not. Then the edge is SIGKILLed with that VM paused and another full VM running:
    the restarted edge lists the paused one, which resumes with its files, processes and network
    intact; the running one (a networked VM whose initramfs configured the NIC, so the hook
    leaves it) has its QEMU ended and nothing of it is left."""
    name = f"fvt-user-{uuid.uuid4().hex[:6]}"
    name2 = f"fvt-deb-{uuid.uuid4().hex[:6]}"
    disk = _user_image(tmp_path, dsec_bin)
    subprocess.run([dsec_bin, "vm", "image", "import", name, str(disk), "--data-dir", vnode.data_dir],
                   check=True, capture_output=True, timeout=300)
    disk.unlink()
    running = None
    sb = vclient.run_vm(DSecVMRunArgs(image=name, memory_limit_mb=384, network={
        "mode": "allowlist", "rules": [{"cidr": f"{NPM}/32", "ports": "80", "protocol": "tcp"}]}), timeout=600)
    vm_dir = Path(vnode.sandbox_dir(sb.id)) / "vm"
    try:
        st = sb.network()
        console = (vm_dir / "console.log").read_text(errors="replace")
        assert "dsec-init: network on" in console and "already configured" not in console, console[-2000:]
        out = sh(sb, "cat /etc/resolv.conf; ip addr; cat /proc/modules")
        assert f"nameserver {GATEWAY}" in out and f"inet {st['ipv4']}/32" in out, out
        assert "virtio_net" in out and "qemu_fw_cfg" in out, out
        assert ok(sb, PY_GET.format(url=f"http://{NPM}/"))
        d0 = denied(sb)
        assert not ok(sb, PY_GET.format(url=f"http://{PYPI}:8080/"))
        assert denied(sb) > d0

        # Crash with this VM paused and another one running.
        sb.write_file("/root/keep.txt", b"kept across the crash\n")
        sh(sb, "(i=0; while :; do i=$((i+1)); echo $i > /root/counter.new && mv /root/counter.new /root/counter; sleep 0.2; done) >/dev/null 2>&1 & echo $! > /root/loop.pid")
        loop_pid = sh(sb, "cat /root/loop.pid").strip()
        time.sleep(0.6)
        before = int(sh(sb, "cat /root/counter"))
        sb.pause()
        assert not qemu_pids_for(str(vm_dir))
        norm = lambda d: {k: sorted(v) for k, v in d.items()}  # noqa: E731
        with_paused = norm(vnode.leftovers())
        # The running one: the dsec disk prepared again (today's hook) — its initramfs brings
        # the NIC up first, the hook sees that and leaves it.
        subprocess.run([dsec_bin, "vm", "prepare-image", "--in", str(IMAGE), "--out", str(disk)], check=True,
                       capture_output=True, timeout=600)
        subprocess.run([dsec_bin, "vm", "image", "import", name2, str(disk), "--data-dir", vnode.data_dir],
                       check=True, capture_output=True, timeout=300)
        disk.unlink()
        running = vclient.run_vm(DSecVMRunArgs(image=name2, memory_limit_mb=256, network={
            "mode": "allowlist", "rules": [{"cidr": f"{NPM}/32", "ports": "80", "protocol": "tcp"}]}), timeout=600)
        run_dir = Path(vnode.sandbox_dir(running.id)) / "vm"
        console = (run_dir / "console.log").read_text(errors="replace")
        assert "already configured" in console, console[-2000:]
        assert ok(running, PY_GET.format(url=f"http://{NPM}/"))
        run_pids = qemu_pids_for(str(run_dir))
        assert len(run_pids) == 1, run_pids
        vnode.kill()
        vnode.restart()
        # The running one: QEMU ended, its files, namespace, veth and chains gone, reported failed.
        assert _wait_gone(run_pids, 30), f"QEMU {run_pids} of the running VM survived the edge restart"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and (run_dir.exists() or norm(vnode.leftovers()) != with_paused):
            time.sleep(0.2)
        assert not run_dir.exists(), f"{run_dir} left after the edge restart"
        assert norm(vnode.leftovers()) == with_paused, "the running VM's network objects left after the restart"
        assert vclient.get_sandbox(running.id).state == "failed"
        running = None
        # The paused one: listed, resumable, its state intact.
        listed = {s.id: s.state for s in vclient.list_sandboxes()}
        assert listed.get(sb.id) == "paused", listed
        after = int(sh(sb, "cat /root/counter"))
        assert after >= before
        time.sleep(0.8)
        assert int(sh(sb, "cat /root/counter")) > after, "the counter did not continue after the re-adopted resume"
        assert sh(sb, f"kill -0 {loop_pid} && echo alive").strip() == "alive"
        assert sb.read_file("/root/keep.txt") == b"kept across the crash\n"
        assert vclient.get_sandbox(sb.id).state == "running"
        assert ok(sb, PY_GET.format(url=f"http://{NPM}/")), "network after the re-adopted resume"
        assert not ok(sb, PY_GET.format(url=f"http://{PYPI}:8080/"))
    finally:
        stop_quietly(sb)
        if running is not None:
            stop_quietly(running)
        for n in (name, name2):
            subprocess.run([dsec_bin, "vm", "image", "rm", n, "--data-dir", vnode.data_dir], check=False,
                           capture_output=True)
    assert not wait_clean(vnode, vm_dir, timeout=30)
