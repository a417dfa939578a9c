#!/usr/bin/env python3
"""Benchmark (issue 19): one sandbox cycle through the e2b SDK against the same cycle through
dsec's own SDK, side by side in one run, alternating so both see the same machine load.

    cycle = create("base") + run "echo hi" + kill

- e2b:  `Sandbox.create("base")`, `sbx.commands.run("echo hi")` (the envd API), `sbx.kill()`,
        with E2B_API_URL = E2B_SANDBOX_URL = $DSEC_API_URL/e2b and E2B_API_KEY = $DSEC_API_KEY;
- dsec: `client.run_container(image="base")`, `sb.run_shell("echo hi")`, `sb.stop()`.

With `--no-commands` the cycle is create + get_info + kill (the control plane alone: use it
while the envd API is not in the build).

    DSEC_API_URL=http://127.0.0.1:7480 DSEC_API_KEY=dsk_... \\
        python3 bench/e2b_cycle.py [--n 30] [--warmup 3] [--no-commands]

Needs a running dsec with the `base` template (scripts/images/build-e2b-base.sh, then
`dsec image import e2b-base --tar ...` and `dsec image alias base e2b-base`). Prints p50/p99
per case and the ratio e2b/dsec (target <= 1.3x); writes bench/results/e2b_cycle.json.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from common import summary, print_table, write_results  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--no-commands", action="store_true")
    args = ap.parse_args()

    url = os.environ.get("DSEC_API_URL", "http://127.0.0.1:7480")
    key = os.environ["DSEC_API_KEY"]
    os.environ["E2B_API_URL"] = f"{url}/e2b"
    os.environ["E2B_SANDBOX_URL"] = f"{url}/e2b"
    os.environ["E2B_API_KEY"] = key

    import dsec.sync as ds
    from dsec import DSecContainerRunArgs
    from e2b import Sandbox

    client = ds.DSecClient(url, api_key=key)

    def e2b_cycle():
        sbx = Sandbox.create("base", allow_internet_access=False)
        try:
            if args.no_commands:
                sbx.get_info()
            else:
                r = sbx.commands.run("echo hi")
                assert r.stdout == "hi\n", r
        finally:
            sbx.kill()

    def dsec_cycle():
        sb = client.run_container(DSecContainerRunArgs(container_image="base"))
        try:
            if args.no_commands:
                client.get_sandbox(sb.id)
            else:
                r = sb.run_shell("echo hi")
                assert r.stdout == "hi\n", r
        finally:
            sb.stop()

    cases = {"dsec SDK": dsec_cycle, "e2b SDK": e2b_cycle}
    for f in cases.values():
        for _ in range(args.warmup):
            f()
    lat = {k: [] for k in cases}
    for _ in range(args.n):
        for name, f in cases.items():
            t = time.perf_counter()
            f()
            lat[name].append((time.perf_counter() - t) * 1000)
    rows = [summary(f"{name}: create+{'info' if args.no_commands else 'echo'}+kill", v) for name, v in lat.items()]
    print_table(rows, ref=rows[0])
    ratio = rows[1]["p50_ms"] / rows[0]["p50_ms"]
    print(f"ratio e2b/dsec p50: {ratio:.2f}x, p99: {rows[1]['p99_ms'] / rows[0]['p99_ms']:.2f}x")
    write_results("e2b_cycle", {"rows": rows, "ratio_p50": ratio, "commands": not args.no_commands})
    client.close()


if __name__ == "__main__":
    main()
