"""Benchmark: python `print` calls through the SandboxFusion-compatible /run_code vs dsec's own
function API vs the cold path (a fresh `bwrap` + python per call), side by side in one run;
and the ramp of a 1,000-call burst on a cold pool.

    DSEC_API_URL=http://127.0.0.1:7480 DSEC_API_KEY=dsk_... \
        python3 bench/sandboxfusion.py [--n 2000] [--inflight 8,256] [--burst 1000] [--cold-n 200]

Needs a running dsec with the `debian` image. Both warm cases send the same code over the same
HTTP client (httpx, one connection per call in flight) to the apiserver; each case is warmed
by `inflight` calls first. The cold baseline runs `bwrap --unshare-all` + `python3 -c` on the
debian rootfs locally (no HTTP), with the same numbers in flight (capped at 32 threads: more
only queue on the 2 cores). The ramp: the burst's calls all fired at once at a pool that has
no worker yet (a language pool on the `debian` image that nothing used: `--ramp-language`,
default `perl`), answers counted per second since the first call, with the pool's worker count
sampled each second.
"""

import argparse
import asyncio
import os
import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from common import bwrap_python_once, debian_rootfs, pct

PY = "print(sum(range(100)))"


def stats(name, lat_ms, rate):
    return {"case": name, "calls_per_s": round(rate, 1), "p50_ms": round(pct(lat_ms, 50), 2),
            "p99_ms": round(pct(lat_ms, 99), 2), "n": len(lat_ms)}


async def drive(h, url, body, check, n, inflight):
    todo = n
    lat = []

    async def worker():
        nonlocal todo
        while todo > 0:
            todo -= 1
            t = time.perf_counter()
            r = await h.post(url, json=body)
            lat.append((time.perf_counter() - t) * 1000)
            assert r.status_code == 200, r.text
            assert check(r.json()), r.text
    t0 = time.perf_counter()
    await asyncio.gather(*[worker() for _ in range(inflight)])
    return lat, n / (time.perf_counter() - t0)


def sf_ok(b):
    return b["status"] == "Success" and b["run_result"]["stdout"] == "4950\n"


def native_ok(b):
    return b["status"] == "ok" and b["stdout"] == "4950\n"


def bwrap_cold(n, inflight):
    root = debian_rootfs()
    if shutil.which("bwrap") is None or root is None:
        return None
    t0 = time.perf_counter()
    with ThreadPoolExecutor(min(inflight, 32)) as ex:
        lat = list(ex.map(lambda _: bwrap_python_once(root, PY), range(n)))
    return lat, n / (time.perf_counter() - t0)


async def ramp(h, api, key, burst, language):
    """Answers per second of `burst` calls fired at once on a pool with no worker."""
    code = {"perl": 'print "ok\\n";', "bash": "echo ok", "python": "print('ok')"}[language]
    done = []
    workers = []
    t0 = time.perf_counter()

    async def one():
        r = await h.post(f"{api}/sandboxfusion/{key}/run_code", json={"code": code, "language": language})
        assert r.status_code == 200, r.text
        assert r.json()["run_result"]["stdout"] == "ok\n", r.text
        done.append(time.perf_counter() - t0)

    async def sample():
        while len(done) < burst:
            r = await h.get(f"{api}/v1/functions/pools", headers={"authorization": f"Bearer {key}"})
            pools = [p for p in r.json()["pools"] if p["language"] == language]
            workers.append((round(time.perf_counter() - t0, 1), len(pools[0]["workers"]) if pools else 0))
            await asyncio.sleep(1)
    await asyncio.gather(sample(), *[one() for _ in range(burst)])
    per_s = [0] * (int(max(done)) + 1)
    for d in done:
        per_s[int(d)] += 1
    return per_s, workers, max(done)


async def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--inflight", default="8,256")
    ap.add_argument("--burst", type=int, default=1000)
    ap.add_argument("--cold-n", type=int, default=200)
    ap.add_argument("--ramp-language", default="perl")
    a = ap.parse_args()
    api = os.environ.get("DSEC_API_URL", "http://127.0.0.1:7480").rstrip("/")
    key = os.environ["DSEC_API_KEY"]
    sf_url = f"{api}/sandboxfusion/{key}/run_code"
    nat_url = f"{api}/v1/functions/call"
    rows = []
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=2000),
                                 headers={"authorization": f"Bearer {key}"}) as h:
        if a.burst:
            per_s, workers, total = await ramp(h, api, key, a.burst, a.ramp_language)
            print(f"ramp: {a.burst} calls fired at once on a cold {a.ramp_language} pool, all answered in "
                  f"{total:.2f} s")
            print("  answers per second:", per_s)
            print("  pool workers sampled (s, workers):", workers)
        for inflight in [int(x) for x in a.inflight.split(",")]:
            sf_body = {"code": PY, "language": "python"}
            nat_body = {"code": PY, "language": "python"}
            await drive(h, sf_url, sf_body, sf_ok, inflight, inflight)
            await drive(h, nat_url, nat_body, native_ok, inflight, inflight)
            # interleaved halves, so both see the same load on the machine
            lat_sf, lat_nat, t_sf, t_nat = [], [], 0.0, 0.0
            for _ in range(2):
                t = time.perf_counter()
                lat, _ = await drive(h, sf_url, sf_body, sf_ok, a.n // 2, inflight)
                t_sf += time.perf_counter() - t
                lat_sf += lat
                t = time.perf_counter()
                lat, _ = await drive(h, nat_url, nat_body, native_ok, a.n // 2, inflight)
                t_nat += time.perf_counter() - t
                lat_nat += lat
            r_sf, r_nat = len(lat_sf) / t_sf, len(lat_nat) / t_nat
            rows.append(stats(f"/run_code, {inflight} in flight", lat_sf, r_sf))
            rows.append(stats(f"native /v1/functions/call, {inflight} in flight", lat_nat, r_nat))
            cold = bwrap_cold(a.cold_n, inflight)
            if cold:
                rows.append(stats(f"cold bwrap+python, {inflight} in flight", *cold))
            print(f"ratio /run_code : native at {inflight} in flight = {r_sf / r_nat:.2f}")
    print(f"{'case':48} {'calls/s':>9} {'p50 ms':>9} {'p99 ms':>9} {'n':>6}")
    for r in rows:
        print(f"{r['case']:48} {r['calls_per_s']:>9} {r['p50_ms']:>9} {r['p99_ms']:>9} {r['n']:>6}")


if __name__ == "__main__":
    asyncio.run(main())
