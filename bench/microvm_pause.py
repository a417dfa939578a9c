#!/usr/bin/env python3
"""microVM pause/resume by snapshot (issue 9): pause and resume time, snapshot size, and host
memory (QEMU's RSS) before and after the pause, for 256 MB and 1 GB guests.

    DSEC_API_URL=... DSEC_API_KEY=... python3 bench/microvm_pause.py [--runs 3]

Per guest size two guests: one idle after boot, one that first wrote 100 MB of random data to
its /dev/shm (a dirty working set: random bytes do not compress, zero pages would). Each run is
pause (API call wall time; the report's own pause_ms) then resume (API call wall time) then the
first command. The snapshot size and QEMU's RSS before the pause come from the pause report;
after the pause QEMU is gone (0). The accelerator is whatever the node's edge uses
(`DSEC_MICROVM_ACCEL`, TCG unless set to kvm).
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "sdk" / "python"))
import dsec.sync  # noqa: E402
from dsec import DSecMicroVMRunArgs  # noqa: E402

ACCEL = os.environ.get("DSEC_MICROVM_ACCEL", "tcg")


def one_guest(client, memory_mb: int, dirty_mb: int, runs: int) -> dict:
    sb = client.run_microvm(DSecMicroVMRunArgs(container_image="busybox", memory_limit_mb=memory_mb), timeout=600)
    try:
        if dirty_mb:
            r = sb.run_shell(f"dd if=/dev/urandom of=/dev/shm/fill bs=1M count={dirty_mb} 2>/dev/null && echo done", timeout=600)
            assert r.stdout.strip() == "done", r
        sb.run_shell("(i=0; while :; do i=$((i+1)); echo $i > /root/counter; sleep 0.1; done) >/dev/null 2>&1 &")
        rows = []
        for _ in range(runs):
            time.sleep(0.5)
            t0 = time.monotonic()
            info = sb.pause()
            pause_s = time.monotonic() - t0
            rep = info.last_pause
            m = re.search(r"\((\d+) bytes\)", rep["method"])
            snap = int(m.group(1)) if m else 0
            t1 = time.monotonic()
            sb.resume()
            resume_s = time.monotonic() - t1
            t2 = time.monotonic()
            r = sb.run_shell("cat /root/counter")
            first_s = time.monotonic() - t2
            assert r.exit_code == 0 and r.stdout.strip().isdigit(), r
            rows.append({
                "pause_ms": pause_s * 1000, "pause_report_ms": rep["pause_ms"], "resume_ms": resume_s * 1000,
                "first_cmd_ms": first_s * 1000, "snapshot_mb": snap / 1e6,
                "rss_before_mb": rep["memory_before_bytes"] / 1e6, "rss_after_mb": rep["memory_after_bytes"] / 1e6,
            })
        return {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    finally:
        sb.stop()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--sizes", default="256,1024")
    args = ap.parse_args()
    client = dsec.sync.DSecClient()
    print(f"accelerator: {ACCEL}; medians of {args.runs} pause/resume cycles per guest")
    print(f"{'guest':>18} {'pause ms':>9} {'(report)':>9} {'resume ms':>10} {'1st cmd ms':>10} {'snapshot MB':>12} {'QEMU RSS MB before/after':>26}")
    for mb in [int(x) for x in args.sizes.split(",")]:
        for dirty in (0, 100):
            r = one_guest(client, mb, dirty, args.runs)
            label = f"{mb} MB {'idle' if not dirty else '+100MB dirty'}"
            print(f"{label:>18} {r['pause_ms']:9.0f} {r['pause_report_ms']:9.0f} {r['resume_ms']:10.0f} "
                  f"{r['first_cmd_ms']:10.0f} {r['snapshot_mb']:12.1f} {r['rss_before_mb']:14.0f} / {r['rss_after_mb']:.0f}", flush=True)


if __name__ == "__main__":
    main()
