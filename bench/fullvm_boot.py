#!/usr/bin/env python3
"""Boot to first command result of a dsec full VM (issue 9, item 2) vs. a plain QEMU boot of the
same disk image through the same firmware and boot loader to its boot hook. Same machine type,
accelerator and memory, interleaved runs.

    DSEC_API_URL=... DSEC_API_KEY=... python3 bench/fullvm_boot.py [--runs 5] [--image debian]

Plain: `qemu-system-x86_64 -M q35` on a fresh qcow2 overlay of the image (SeaBIOS -> extlinux ->
kernel -> initramfs -> root -> /usr/local/sbin/dsec-init); the time is from QEMU's start until
the hook prints "looking for the dsec.aether port" on the serial console (the guest is up; aether
would start next). dsec: `run_vm` (overlay, QEMU, boot, aether Ready, hostname) + the first
`run_shell("echo ok")`.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))
import dsec.sync  # noqa: E402
from dsec import DSecVMRunArgs  # noqa: E402

CACHE = Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec"))
ACCEL = os.environ.get("DSEC_VM_ACCEL") or os.environ.get("DSEC_MICROVM_ACCEL") or "tcg"
MACHINE = os.environ.get("DSEC_VM_MACHINE", "q35")


def plain_boot(tmp: Path, disk: Path, memory_mb: int) -> float:
    overlay = tmp / "plain.qcow2"
    overlay.unlink(missing_ok=True)
    subprocess.run(["qemu-img", "create", "-q", "-f", "qcow2", "-F", "qcow2", "-b", str(disk), str(overlay)], check=True)
    log = tmp / "plain-console.log"
    log.unlink(missing_ok=True)
    args = ["qemu-system-x86_64", "-M", MACHINE, "-accel", ACCEL, "-m", f"{memory_mb}M", "-smp", "1",
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-chardev", f"file,id=log,path={log}", "-serial", "chardev:log",
            "-drive", f"id=disk0,file={overlay},format=qcow2,if=none",
            "-device", "virtio-blk-pci,drive=disk0,bootindex=0",
            "-device", "virtio-serial-pci"]
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < 180:
            if log.exists() and b"looking for the dsec.aether port" in log.read_bytes():
                return time.monotonic() - t0
            time.sleep(0.01)
        raise RuntimeError(f"plain boot: no hook line within 180 s: {log.read_bytes()[-500:]!r}")
    finally:
        p.kill()
        p.wait()


def dsec_boot(client, image: str, memory_mb: int) -> float:
    t0 = time.monotonic()
    sb = client.run_vm(DSecVMRunArgs(image=image, memory_limit_mb=memory_mb, cpu_cores_limit=1), timeout=600)
    try:
        r = sb.run_shell("echo ok")
        dt = time.monotonic() - t0
        assert r.stdout == "ok\n", r
        return dt
    finally:
        sb.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--image", default="debian")
    ap.add_argument("--memory-mb", type=int, default=512)
    ap.add_argument("--disk", default=str(CACHE / "vm" / "debian.qcow2"), help="the image file for the plain boot")
    a = ap.parse_args()
    client = dsec.sync.DSecClient()
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as t:
        for _ in range(a.runs):
            plain.append(plain_boot(Path(t), Path(a.disk), a.memory_mb))
            ours.append(dsec_boot(client, a.image, a.memory_mb))
    def row(name, xs):
        print(f"| {name} | {statistics.median(xs):.2f} s | {min(xs):.2f} s | {max(xs):.2f} s |")
    print(f"accelerator {ACCEL}, machine {MACHINE}, {a.memory_mb} MiB, 1 vCPU, {a.runs} interleaved runs")
    print("| what | median | min | max |\n|---|---|---|---|")
    row("plain QEMU: firmware + extlinux + kernel + initramfs + root to the boot hook", plain)
    row("dsec full VM: `run_vm` + first `run_shell(\"echo ok\")`", ours)
    m_p, m_o = statistics.median(plain), statistics.median(ours)
    print(f"overhead: {m_o - m_p:+.2f} s ({(m_o / m_p - 1) * 100:+.0f} %)")


if __name__ == "__main__":
    main()
