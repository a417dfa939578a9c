#!/usr/bin/env python3
"""Benchmark (issue 17): fork of N containers against N plain creates from the same image and
one `pack_diff` of the same writable layer, side by side in one run.

    python3 bench/sandbox_fork.py [--n 16] [--rounds 5] [--image busybox] [--layer-mb 64]

Needs a running dsec (DSEC_API_URL / DSEC_API_KEY). Per round:
- a parent with `--layer-mb` MiB written into its writable layer;
- baseline A: N plain creates of `--image` (concurrent, through the API), wall time;
- baseline B: one `pack_diff` of the parent (the snapshot's floor);
- fork: `sandbox.fork(N)` (one snapshot + N creates from it), wall time.
Target: fork <= 1.3 x (A + B). Prints median and p99 over the rounds and the ratio.
"""

import argparse
import asyncio
import time
import uuid

from common import print_table, summary, write_results
from dsec import DSecClient, DSecContainerRunArgs


async def plain_creates(c, image, n):
    t = time.perf_counter()
    sbs = await asyncio.gather(*[c.run_container(DSecContainerRunArgs(container_image=image)) for _ in range(n)])
    ms = (time.perf_counter() - t) * 1e3
    await asyncio.gather(*[s.stop() for s in sbs])
    return ms


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--image", default="busybox")
    ap.add_argument("--layer-mb", type=int, default=64)
    a = ap.parse_args()
    plain, pack, fork, per_child = [], [], [], []
    async with DSecClient() as c:
        for r in range(a.rounds):
            parent = await c.run_container(DSecContainerRunArgs(container_image=a.image))
            try:
                await parent.run_shell(f"dd if=/dev/urandom of=/root/layer bs=1M count={a.layer_mb} 2>/dev/null")
                plain.append(await plain_creates(c, a.image, a.n))
                t = time.perf_counter()
                name = f"bench/pack-{uuid.uuid4().hex[:8]}"
                await parent.pack_diff(name)
                pack.append((time.perf_counter() - t) * 1e3)
                await c.remove_image(name)
                t = time.perf_counter()
                children = await parent.fork(a.n)
                ms = (time.perf_counter() - t) * 1e3
                fork.append(ms)
                per_child.append(ms / a.n)
                await asyncio.gather(*[ch.stop() for ch in children])
            finally:
                await parent.stop()
            for img in await c.list_images():
                if img.name.startswith(f"snapshot/{parent.id}"):
                    await c.remove_image(img.name)
    rows = [
        summary(f"{a.n} plain creates ({a.image})", plain),
        summary(f"pack_diff of {a.layer_mb} MiB", pack),
        summary("plain creates + pack_diff", [p + q for p, q in zip(plain, pack)]),
        summary(f"fork of {a.n} (snapshot + {a.n} creates)", fork),
        summary("fork, per child", per_child),
    ]
    print_table(rows, ref=rows[2])
    write_results("sandbox_fork", {"n": a.n, "rounds": a.rounds, "layer_mb": a.layer_mb, "rows": rows})


if __name__ == "__main__":
    asyncio.run(main())
