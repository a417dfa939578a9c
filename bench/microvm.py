#!/usr/bin/env python3
"""Boot to first command result of a dsec microVM vs. a plain QEMU boot of the same kernel and
initramfs to a shell (issue 9): cold boots and restore-from-template creates, each against the
plain boot in the same run (interleaved: plain, cold, templated, plain, ...). Same machine type,
accelerator and memory.

    DSEC_BIN=target/release/dsec python3 bench/microvm.py [--runs 5] [--machine microvm|pc]

`--machine` (default: $DSEC_MICROVM_MACHINE, else microvm, dsec's default) is the QEMU machine
type of both the plain boot and dsec's VMs (the edges get DSEC_MICROVM_MACHINE); every dsec VM's
command line is checked to have used it (no silent fallback to pc).

Starts two `dsec up` of its own (temporary data dirs, own ports and node ids, stopped at the end):
one with `DSEC_MICROVM_TEMPLATES=0` (every create boots cold) and one with templates on (the
default), where one create of the shape first boots cold and the template is awaited before the
timed creates, which restore it.

The plain boot uses the cached guest initramfs with its /init replaced (a gzip'ed cpio appended,
which the kernel unpacks last) by a shell that prints a marker on the serial console and powers
off; the time is from QEMU's start until the marker appears. A dsec figure is `run_microvm`
(create, boot or restore, aether Ready / identity set) + the first `run_shell("echo ok")`.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "sdk" / "python"))
sys.path.insert(0, str(ROOT / "tests"))
from dsec import DSecMicroVMRunArgs  # noqa: E402
from helpers import DsecUp, new_data_dir, remove_data_dir  # noqa: E402

GUEST = Path(os.environ.get("DSEC_GUEST_DIR") or Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "guest")
ACCEL = os.environ.get("DSEC_MICROVM_ACCEL", "tcg")
MACHINE = os.environ.get("DSEC_MICROVM_MACHINE", "microvm")
# Kernel arguments dsec adds for the machine (microvm under TCG: the TSC frequency, without
# which the guest's PIT calibration can fail under load and hang the boot), taken from the
# first dsec VM's command line so that the plain boot gets exactly the same.
MACHINE_APPEND: list = []


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
    # The machine option exactly as dsec passes it (`Machine::as_str`: microvm's defaults).
    m = MACHINE
    # The same CPU model as dsec's guests (RDRAND, see `Accel::cpu_model`).
    cpu = "host" if ACCEL == "kvm" else "qemu64,+rdrand"
    args = ["qemu-system-x86_64", "-M", m, "-accel", ACCEL, "-m", f"{memory_mb}M", "-smp", "1", "-cpu", cpu,
            "-nodefaults", "-no-user-config", "-nographic", "-no-reboot",
            "-kernel", str(GUEST / "vmlinuz"), "-initrd", str(initrd),
            "-append", " ".join(["console=ttyS0 panic=-1 quiet loglevel=4 random.trust_cpu=on no_timer_check"] + MACHINE_APPEND),
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


def dsec_boot(up: DsecUp, client, memory_mb: int, expect_boot: str) -> float:
    t0 = time.monotonic()
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=memory_mb), timeout=300)
    try:
        r = sb.run_shell("echo ok")
        took = time.monotonic() - t0
        assert r.stdout == "ok\n", r
        boot = sb.info.raw.get("boot")
        assert boot == expect_boot, f"expected a {expect_boot} boot, got {boot!r}"
        args = (Path(up.sandbox_dir(sb.id)) / "vm" / "qemu.args").read_text()
        assert f'"-M","{MACHINE}"' in args, f"the VM did not run on {MACHINE}: {args[:200]}"
        if not MACHINE_APPEND:
            append = json.loads(args)["args"]
            append = append[append.index("-append") + 1].split()
            MACHINE_APPEND.extend(a for a in append if a.startswith(("tsc_early_khz=", "tsc=")))
        return took
    finally:
        sb.stop()


def start_edge(binary: str, tag: str, templates: bool) -> DsecUp:
    env = {"DSEC_MICROVM_TEMPLATES": "1" if templates else "0", "DSEC_MICROVM_MACHINE": MACHINE}
    return DsecUp(binary, new_data_dir(tag), f"bvm{tag}{os.getpid() % 10000}", env=env).start()


def wait_template(up: DsecUp, timeout: float = 300) -> None:
    d = Path(up.data_dir) / "edge" / "microvm-templates"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if d.is_dir() and any((p / "template.json").is_file() for p in d.iterdir()):
            return
        time.sleep(0.2)
    raise SystemExit(f"no template was built within {timeout:.0f} s; see {up.stderr_path}")


def fmt(name: str, v, base=None) -> str:
    m = statistics.median(v)
    line = f"{name:44} median {m:5.2f} s  (min {min(v):.2f}, max {max(v):.2f})"
    if base is not None:
        line += f"  {100 * (m - base) / base:+6.1f}% of plain QEMU"
    return line


def main() -> None:
    global MACHINE
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--memory-mb", type=int, default=256)
    ap.add_argument("--machine", choices=["microvm", "pc"], default=MACHINE)
    a = ap.parse_args()
    MACHINE = a.machine
    binary = os.environ.get("DSEC_BIN", str(ROOT / "target" / "release" / "dsec"))
    cold_up = start_edge(binary, "c", templates=False)
    tpl_up = start_edge(binary, "t", templates=True)
    plain, cold, tpl = [], [], []
    loads = []
    try:
        cold_c, tpl_c = cold_up.client(), tpl_up.client()
        # The shape's first create on the template edge boots cold; its template is built
        # in the background: wait for it before timing.
        dsec_boot(tpl_up, tpl_c, a.memory_mb, "cold")
        wait_template(tpl_up)
        with tempfile.TemporaryDirectory() as d:
            for _ in range(a.runs):  # interleaved, so all three see the same machine load
                loads.append(os.getloadavg()[0])
                plain.append(plain_boot(Path(d), a.memory_mb))
                cold.append(dsec_boot(cold_up, cold_c, a.memory_mb, "cold"))
                tpl.append(dsec_boot(tpl_up, tpl_c, a.memory_mb, "template"))
        cold_c.close()
        tpl_c.close()
    finally:
        for up, dd in ((cold_up, cold_up.data_dir), (tpl_up, tpl_up.data_dir)):
            up.stop()
            remove_data_dir(dd)
            up.remove_log()
    mp = statistics.median(plain)
    print(f"reproduce: DSEC_BIN={binary} python3 bench/microvm.py --runs {a.runs} --memory-mb {a.memory_mb} --machine {MACHINE}")
    print(f"accelerator {ACCEL}, machine {MACHINE}, {a.memory_mb} MiB, 1 vCPU, busybox, {a.runs} runs each; "
          f"machine kernel args (dsec's and the plain boot's): {' '.join(MACHINE_APPEND) or '-'}")
    print(f"load average (1 min) during the runs: {min(loads):.2f}-{max(loads):.2f}; at the end: "
          f"{' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(fmt("plain QEMU boot to a shell:", plain))
    print(fmt("dsec microVM, cold boot to first result:", cold, mp))
    print(fmt("dsec microVM, from template to first result:", tpl, mp))


if __name__ == "__main__":
    main()
