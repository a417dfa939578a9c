"""Shared helpers for the benchmarks: percentiles, baseline bundles, printing."""

import json
import os
import shutil
import statistics
import subprocess
import time

CACHE = os.environ.get("DSEC_CACHE", "/var/cache/dsec")
DEBIAN_TAR = os.path.join(CACHE, "debian-bookworm.tar")
WORK = os.environ.get("DSEC_BENCH_DIR", "/var/tmp/dsec-bench")


def pct(values, p):
    """The p-th percentile (nearest rank) of a non-empty list."""
    v = sorted(values)
    k = max(0, min(len(v) - 1, int(round(p / 100.0 * len(v) + 0.5)) - 1))
    return v[k]


def summary(name, values_ms):
    return {
        "name": name,
        "n": len(values_ms),
        "p50_ms": round(statistics.median(values_ms), 3),
        "p99_ms": round(pct(values_ms, 99), 3),
        "mean_ms": round(statistics.fmean(values_ms), 3),
    }


def print_table(rows, ref=None):
    print(f"{'case':44} {'n':>5} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9}" + ("  ratio p50" if ref else ""))
    for r in rows:
        line = f"{r['name']:44} {r['n']:>5} {r['p50_ms']:>9.2f} {r['p99_ms']:>9.2f} {r['mean_ms']:>9.2f}"
        if ref:
            line += f"  {r['p50_ms'] / ref['p50_ms']:9.2f}x"
        print(line)


def debian_rootfs():
    """Extracts the debian image tarball once into a plain directory for the baselines."""
    root = os.path.join(WORK, "rootfs")
    if not os.path.exists(os.path.join(root, "bin")):
        if not os.path.exists(DEBIAN_TAR):
            raise SystemExit(f"{DEBIAN_TAR} missing: run scripts/images/build-debian.sh")
        shutil.rmtree(root, ignore_errors=True)
        os.makedirs(root)
        subprocess.run(["tar", "-xf", DEBIAN_TAR, "-C", root], check=True)
    return root


def runc_bundle(args):
    """A runc bundle over the debian rootfs running `args`, no terminal."""
    bundle = os.path.join(WORK, "runc-bundle")
    os.makedirs(bundle, exist_ok=True)
    root = debian_rootfs()
    cfg_path = os.path.join(bundle, "config.json")
    if os.path.exists(cfg_path):
        os.remove(cfg_path)
    subprocess.run(["runc", "spec"], cwd=bundle, check=True)
    with open(cfg_path) as f:
        cfg = json.load(f)
    cfg["root"] = {"path": root, "readonly": True}
    cfg["process"]["args"] = args
    cfg["process"]["terminal"] = False
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return bundle


def write_results(name, data):
    os.makedirs(os.path.join(os.path.dirname(__file__), "results"), exist_ok=True)
    path = os.path.join(os.path.dirname(__file__), "results", name + ".json")
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    print(f"results written to {path}")


def bwrap_python_once(root, code="print(sum(range(100)))", expect=b"4950"):
    """One cold `python3 -c code` in a fresh bubblewrap sandbox of `root` (the baseline the
    function benchmarks compare against); returns its latency in ms."""
    t = time.perf_counter()
    p = subprocess.run(["bwrap", "--unshare-all", "--die-with-parent", "--ro-bind", root, "/",
                        "--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp",
                        "python3", "-c", code], capture_output=True)
    assert p.stdout.strip() == expect, p
    return (time.perf_counter() - t) * 1000
