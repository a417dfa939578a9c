#!/usr/bin/env python3
"""Boot to first command result of a dsec microVM vs. a plain QEMU boot of the same kernel and
initramfs to a shell (issue 9). Same machine type, accelerator and memory in one run.

    DSEC_API_URL=... DSEC_API_KEY=... python3 bench/microvm.py [--runs 5]

The plain boot uses the cached guest initramfs with its /init replaced (a gzip'ed cpio appended,
which the kernel unpacks last) by a shell that prints a marker on the serial console and powers
off; the time is from QEMU's start until the marker appears. The dsec figure is
`run_microvm` (create, boot, aether Ready) + the first `run_shell("echo ok")`.
"""

from __future__ import annotations

import argparse
import gzip
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))
import dsec.sync  # noqa: E402
from dsec import DSecMicroVMRunArgs  # noqa: E402

GUEST = Path(os.environ.get("DSEC_GUEST_DIR") or Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "guest")
ACCEL = os.environ.get("DSEC_MICROVM_ACCEL", "tcg")
MACHINE = os.environ.get("DSEC_MICROVM_MACHINE", "pc")


def newc(name: str, data: bytes, mode: int) -> bytes:
    def hdr(ino, mode, size, name):
        f = [ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name) + 1, 0]
        h = b"070701" + b"".join(b"%08X" % x for x in f) + name.encode() + b"\0"
        return h + b"\0" * (-len(h) % 4)
    out = hdr(1, mode, len(data), name) + data + b"\0" * (-len(data) % 4)
    out += hdr(0, 0, 0, "TRAILER!!!")
    return out + b"\0" * (-len(out) % 512)


def plain_boot(tmp: Path, memory_mb: int) -> float:
    init = b"#!/bin/sh\n/bin/mount -t devtmpfs d /dev 2>/dev/null\necho DSEC-PLAIN-SHELL-UP > /dev/ttyS0\nexec /bin/sh -c 'echo ok > /dev/ttyS0; sleep 1000'\n"
    initrd = tmp / "plain-initrd.img"
    initrd.write_bytes((GUEST / "initrd.img").read_bytes() + gzip.compress(newc("init", init, 0o100755)))
    log = tmp / "plain-console.log"
    log.unlink(missing_ok=True)
    m = "microvm,pit=on,pic=on,rtc=on" if MACHINE == "microvm" else "pc"
    # The same CPU model as dsec's guests (RDRAND, see `Accel::cpu_model`).
    cpu = "host" if ACCEL == "kvm" else "qemu64,+rdrand"
    args = ["qemu-system-x86_64", "-M", m, "-accel", ACCEL, "-m", f"{memory_mb}M", "-smp", "1", "-cpu", cpu,
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-kernel", str(GUEST / "vmlinuz"), "-initrd", str(initrd),
            "-append", "console=ttyS0 panic=-1 quiet loglevel=4 random.trust_cpu=on no_timer_check",
            "-chardev", f"file,id=log,path={log}", "-serial", "chardev:log"]
    t0 = time.monotonic()
    p = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        while time.monotonic() - t0 < 120:
            if log.exists() and b"\nok" in log.read_bytes().replace(b"\r", b""):
                return time.monotonic() - t0
            time.sleep(0.005)
        raise RuntimeError("plain boot: no shell within 120 s")
    finally:
        p.kill()
        p.wait()


def dsec_boot(client, memory_mb: int) -> float:
    t0 = time.monotonic()
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=memory_mb), timeout=300)
    try:
        r = sb.run_shell("echo ok")
        assert r.stdout == "ok\n", r
        return time.monotonic() - t0
    finally:
        sb.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=256)
    a = ap.parse_args()
    client = dsec.sync.DSecClient()
    client.open()
    plain, ours = [], []
    with tempfile.TemporaryDirectory() as d:
        for _ in range(a.runs):  # interleaved, so both see the same machine load
            plain.append(plain_boot(Path(d), a.memory_mb))
            ours.append(dsec_boot(client, a.memory_mb))
    client.close()
    mp, mo = statistics.median(plain), statistics.median(ours)
    print(f"accelerator {ACCEL}, machine {MACHINE}, {a.memory_mb} MiB, {a.runs} runs each")
    print(f"plain QEMU boot to a shell:         median {mp:.2f} s  (min {min(plain):.2f}, max {max(plain):.2f})")
    print(f"dsec microVM boot to first result:  median {mo:.2f} s  (min {min(ours):.2f}, max {max(ours):.2f})")
    print(f"overhead: {100 * (mo - mp) / mp:+.1f}% of plain QEMU")


if __name__ == "__main__":
    main()
