"""Benchmark: host memory per idle sandbox with one live shell session.

Creates N sandboxes (default 500), runs one `run_shell` in each (so the default session's
shell is alive), then measures MemAvailable and the sum of the sandboxes' memory cgroup
usage. Baseline in the same run: N bare isolated processes (`bwrap --unshare-all` running
`sleep`) on the same root, measured the same way.

    python3 bench/density.py [--n 500] [--image debian]
"""

import argparse
import asyncio
import glob
import os
import subprocess
import time

from common import debian_rootfs, write_results
from dsec import DSecClient, DSecContainerRunArgs


def mem_available_kib():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1])
    raise RuntimeError("no MemAvailable")


def settle():
    os.sync()
    time.sleep(2)


def cgroup_usage_bytes():
    total = 0
    for p in glob.glob("/sys/fs/cgroup/memory/dsec/*/*/memory.usage_in_bytes") + \
            glob.glob("/sys/fs/cgroup/dsec/*/*/memory.current"):
        try:
            total += int(open(p).read())
        except OSError:
            pass
    return total


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--image", default="debian")
    a = ap.parse_args()

    root = debian_rootfs()
    # Baseline: bare isolated processes.
    settle()
    before = mem_available_kib()
    procs = [subprocess.Popen(["bwrap", "--unshare-all", "--ro-bind", root, "/", "--proc", "/proc",
                               "--dev", "/dev", "--die-with-parent", "/bin/sleep", "infinity"]) for _ in range(a.n)]
    settle()
    bwrap_kib = (before - mem_available_kib()) / a.n
    for p in procs:
        p.kill()
    for p in procs:
        p.wait()

    client = DSecClient()
    await client.open()
    sandboxes = []
    try:
        settle()
        before = mem_available_kib()
        sem = asyncio.Semaphore(8)

        async def one():
            async with sem:
                # Idle agent sandboxes ask for little (the reference: ~90% use < 5% of their CPU).
                sb = await client.run_container(DSecContainerRunArgs(
                    container_image=a.image, memory_limit_mb=64, cpu_cores_limit=0.05))
                sandboxes.append(sb)
                r = await sb.run_shell("cd /tmp && export X=1")
                assert r.exit_code == 0

        await asyncio.gather(*(one() for _ in range(a.n)))
        settle()
        dsec_kib = (before - mem_available_kib()) / a.n
        cg = cgroup_usage_bytes() / a.n / 1024
        print(f"== host memory per idle sandbox, {a.n} sandboxes, image {a.image} ==")
        print(f"bwrap --unshare-all sleep (baseline): {bwrap_kib / 1024:6.2f} MiB (MemAvailable delta)")
        print(f"dsec sandbox + live shell session   : {dsec_kib / 1024:6.2f} MiB (MemAvailable delta), "
              f"{cg / 1024:6.2f} MiB (cgroup usage)")
        print(f"ratio dsec / bare process = {dsec_kib / bwrap_kib:.2f}")
        print(f"idle sandboxes that fit in 24 GiB at this rate: {int(24 * 1024 * 1024 / dsec_kib)}")
        print(f"reproduce: python3 bench/density.py --n {a.n} --image {a.image}")
        write_results("density", {"n": a.n, "bwrap_kib": bwrap_kib, "dsec_kib": dsec_kib,
                                  "dsec_cgroup_kib": cg})
    finally:
        await asyncio.gather(*(sb.stop() for sb in sandboxes), return_exceptions=True)
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
