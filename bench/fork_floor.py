#!/usr/bin/env python3
"""The floor of a process-per-call function worker: CPU of one fork() + _exit() of Python.

    python3 bench/fork_floor.py [--n 400]

Forks `--n` children from this interpreter with three import sets — none beyond the startup
set, the worker's protocol modules, and the fork-server's full warm set
(crates/edge/src/function/forkserver.py) — each child exiting at once (or first running the
benchmark's `print(sum(range(100)))` with `--run`), and prints wall and CPU per call for the
parent and the children. No sandbox is involved: this is the cost a warm call cannot avoid.
"""

import argparse
import gc
import importlib
import os
import subprocess
import sys
import time

SETS = {
    "startup": [],
    "protocol": "json base64 select signal socket struct traceback resource".split(),
    "warm": ("json base64 select signal socket struct traceback resource ctypes collections itertools "
             "functools heapq bisect math random re string fractions decimal statistics typing "
             "dataclasses operator copy io array enum datetime").split(),
}


def child_main(mods, n, run):
    for m in mods:
        importlib.import_module(m)
    gc.collect()
    gc.freeze()
    code = compile("print(sum(range(100)))", "call", "exec")
    devnull = os.open(os.devnull, os.O_WRONLY)
    t = time.perf_counter()
    c0 = os.times()
    for _ in range(n):
        pid = os.fork()
        if pid == 0:
            if run:
                os.dup2(devnull, 1)
                exec(code, {})
                sys.stdout.flush()
            os._exit(0)
        os.waitpid(pid, 0)
    dt = time.perf_counter() - t
    c1 = os.times()
    anon = [ln.split()[1] for ln in open("/proc/self/status") if ln.startswith("RssAnon")][0]
    print(f"{dt / n * 1e3:.3f} {((c1.user + c1.system) - (c0.user + c0.system)) / n * 1e3:.3f} "
          f"{((c1.children_user + c1.children_system) - (c0.children_user + c0.children_system)) / n * 1e3:.3f} {anon}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--run", action="store_true", help="children run print(sum(range(100))) first")
    ap.add_argument("--child", default="")
    a = ap.parse_args()
    if a.child:
        return child_main(SETS[a.child], a.n, a.run)
    print(f"{'imports':10} {'wall/call ms':>13} {'parent CPU ms':>14} {'child CPU ms':>13} {'RssAnon kB':>11}")
    for name in SETS:
        out = subprocess.run([sys.executable, __file__, "--n", str(a.n), "--child", name] + (["--run"] if a.run else []),
                             capture_output=True, text=True, check=True).stdout.split()
        print(f"{name:10} {float(out[0]):13.3f} {float(out[1]):14.3f} {float(out[2]):13.3f} {out[3]:>11}")
    print(f"reproduce: python3 bench/fork_floor.py --n {a.n}{' --run' if a.run else ''}")


if __name__ == "__main__":
    main()
