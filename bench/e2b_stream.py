"""Benchmark: a command streaming 100 MB of output through the e2b SDK's `commands.run`
(E2B's envd API on the apiserver: Connect streaming over dsec's process handles) against the
same command through dsec's own `stream_shell`, side by side in one run on one sandbox.

    DSEC_API_URL=http://127.0.0.1:7480 DSEC_API_KEY=dsk_... \
        python3 bench/e2b_stream.py [--mb 100] [--rounds 3] [--image debian]

Each round runs both cases once (alternating which goes first); the output is
`head -c N /dev/zero | tr '\\0' 'a'` (text, so both paths carry it as UTF-8). Reported: MB/s
per run, median and worst, and the ratio of the medians (e2b / native).
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from dsec.sync import DSecClient  # noqa: E402
from dsec.types import DSecContainerRunArgs  # noqa: E402
from e2b import ConnectionConfig, Sandbox  # noqa: E402
from packaging.version import Version  # noqa: E402


def e2b_run(sbx, cmd, n):
    got = 0

    def on_out(s):
        nonlocal got
        got += len(s)
    t = time.perf_counter()
    sbx.commands.run(cmd, on_stdout=on_out, timeout=0)
    dt = time.perf_counter() - t
    assert got == n, (got, n)
    return dt


def native_run(sb, cmd, n):
    got = 0
    t = time.perf_counter()
    for ev in sb.stream_shell(cmd, timeout=600):
        if ev.type == "stdout":
            got += len(ev.data)
        elif ev.type == "exit":
            assert ev.result.exit_code == 0, ev.result
    dt = time.perf_counter() - t
    assert got == n, (got, n)
    return dt


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--image", default="debian")
    a = ap.parse_args()
    url = os.environ.get("DSEC_API_URL", "http://127.0.0.1:7480")
    key = os.environ["DSEC_API_KEY"]
    n = a.mb * 1_000_000
    cmd = f"head -c {n} /dev/zero | tr '\\0' 'a'"
    with DSecClient(url, key) as client:
        sb = client.run_container(DSecContainerRunArgs(container_image=a.image), timeout=120)
        try:
            cfg = ConnectionConfig(api_key=key, sandbox_url=f"{url}/e2b", extra_sandbox_headers={
                "E2b-Sandbox-Id": sb.id, "E2b-Sandbox-Port": "49983", "X-API-Key": key})
            sbx = Sandbox(sandbox_id=sb.id, sandbox_domain=None, envd_version=Version("0.5.7"),
                          envd_access_token=None, connection_config=cfg)
            times = {"e2b commands.run": [], "dsec stream_shell": []}
            for r in range(a.rounds):
                order = [("e2b commands.run", lambda: e2b_run(sbx, cmd, n)),
                         ("dsec stream_shell", lambda: native_run(sb, cmd, n))]
                if r % 2:
                    order.reverse()
                for name, f in order:
                    times[name].append(f())
            print(f"{a.mb} MB of output, {a.rounds} rounds")
            print(f"{'case':22} {'median MB/s':>12} {'worst MB/s':>11} {'runs MB/s':>30}")
            med = {}
            for name, ts in times.items():
                rates = [a.mb / t for t in ts]
                med[name] = statistics.median(rates)
                print(f"{name:22} {med[name]:12.1f} {min(rates):11.1f} {' '.join(f'{x:.1f}' for x in rates):>30}")
            print(f"ratio e2b / native (median throughput): {med['e2b commands.run'] / med['dsec stream_shell']:.2f}")
        finally:
            sb.stop()


if __name__ == "__main__":
    main()
