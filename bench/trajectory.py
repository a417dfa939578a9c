#!/usr/bin/env python3
"""Trajectory log benchmark (issue 7).

1. Overhead per call: `run_shell("true")` in a sandbox with the log on and in one created with
   `trajectory: false`, interleaved in the same run (same node, same moment), unstepped and with
   step ids (the SDK default; stepped calls run detached and record before answering).
2. Fast-forward: 1,000 completed steps replayed by a restarted client (`client.attach`) — the
   SDK prefetches the log once and answers them locally — and, for comparison, 1,000 replayed
   steps answered by the edge one request each.

Usage (as root, after `bash scripts/build.sh`):
    python3 bench/trajectory.py [--calls 2000] [--steps 1000] [--fsync always|batch|never]
Starts its own `dsec up` on a scratch data dir.
"""

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "tests"))

from helpers import DsecUp, find_dsec_bin, force_cleanup, make_sandbox, new_data_dir, remove_data_dir  # noqa: E402
from common import summary, print_table  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=2000)
    ap.add_argument("--steps", type=int, default=1000)
    ap.add_argument("--fsync", default="always", choices=["always", "batch", "never"])
    a = ap.parse_args()
    binary = find_dsec_bin()
    if not binary:
        raise SystemExit("no dsec binary: run scripts/build.sh")
    data = new_data_dir("bench-traj")
    cfg = os.path.join(data, "dsec.toml")
    os.makedirs(data, exist_ok=True)
    with open(cfg, "w") as f:
        f.write(f'[edge.trajectory]\nfsync = "{a.fsync}"\n')
    up = DsecUp(binary, data, "bt")
    up_args_patch(up, cfg)
    up.start()
    rows = []
    try:
        c = up.client()
        on = make_sandbox(c, "busybox")
        off = make_sandbox(c, "busybox", trajectory=False)
        for sb in (on, off):
            sb.auto_step = False
            for _ in range(50):
                sb.run_shell("true")
        t = {"on": [], "off": [], "on_step": [], "off_step": []}
        step = 0
        for i in range(a.calls):
            for name, sb in (("on", on), ("off", off)) if i % 2 else (("off", off), ("on", on)):
                s = time.perf_counter()
                sb.run_shell("true")
                t[name].append((time.perf_counter() - s) * 1000)
            step += 1
            for name, sb in (("on_step", on), ("off_step", off)) if i % 2 else (("off_step", off), ("on_step", on)):
                s = time.perf_counter()
                sb.run_shell("true", step=10_000_000 + step)
                t[name].append((time.perf_counter() - s) * 1000)
        for k in ("off", "on", "off_step", "on_step"):
            rows.append(summary(f"run_shell true, log {'on ' if 'on' in k[:2] else 'off'}{' (step ids)' if 'step' in k else ''}", t[k]))

        # Fast-forward: a fresh sandbox, N completed steps, then a "restarted trainer".
        ff = make_sandbox(c, "busybox")
        script = [f"echo step-{n} >> /tmp/log" for n in range(1, a.steps + 1)]
        for cmd in script:
            ff.run_shell(cmd)
        s = time.perf_counter()
        h = c.attach(ff.id)
        for cmd in script:
            r = h.run_shell(cmd)
            assert r.replayed
        ff_local = (time.perf_counter() - s) * 1000
        # The same through the edge, one request per step (no prefetch).
        h2 = c.attach(ff.id)
        h2._inner._ff = None
        s = time.perf_counter()
        for cmd in script:
            r = h2.run_shell(cmd)
            assert r.replayed
        ff_edge = (time.perf_counter() - s) * 1000
        assert ff.run_shell("wc -l < /tmp/log").stdout.strip() == str(a.steps)
        for sb in (on, off, ff):
            sb.stop()
        c.close()
    finally:
        up.stop()
        force_cleanup(data, "/bt/")
        remove_data_dir(data)
    print(f"fsync policy: {a.fsync}; {a.calls} calls per case, interleaved")
    print_table(rows, ref=rows[0])
    on, off, on_s, off_s = rows[1], rows[0], rows[3], rows[2]
    print(f"overhead p50, unstepped: {on['p50_ms'] - off['p50_ms']:+.3f} ms ({(on['p50_ms'] / off['p50_ms'] - 1) * 100:+.1f}%)")
    print(f"overhead p50, step ids:  {on_s['p50_ms'] - off_s['p50_ms']:+.3f} ms ({(on_s['p50_ms'] / off_s['p50_ms'] - 1) * 100:+.1f}%)")
    print(f"fast-forward of {a.steps} completed steps after attach (SDK, prefetched): {ff_local:.1f} ms")
    print(f"fast-forward of {a.steps} completed steps answered by the edge one by one: {ff_edge:.1f} ms")
    print(json.dumps({"rows": rows, "ff_local_ms": ff_local, "ff_edge_ms": ff_edge, "fsync": a.fsync}))


def up_args_patch(up, cfg):
    """Passes `--config cfg` to `dsec up` (DsecUp has no option for it)."""
    orig = up.start

    import subprocess
    real_popen = subprocess.Popen

    def popen(cmd, *args, **kw):
        if isinstance(cmd, list) and len(cmd) > 1 and cmd[1] == "up":
            cmd = cmd + ["--config", cfg]
        return real_popen(cmd, *args, **kw)

    def start():
        subprocess.Popen = popen
        try:
            return orig()
        finally:
            subprocess.Popen = real_popen

    up.start = start


if __name__ == "__main__":
    main()
