"""Apiserver create path on SQLite vs PostgreSQL (issue 5 storage backends).

160 simulated edges (test/benchmark mode) and one apiserver whose IAM/quota store is a SQLite
file, then a fresh database on a private PostgreSQL server (started here like the tests do:
initdb + pg_ctl as `postgres` on a free loopback port, removed afterwards). For each backend,
`dsec bench create-load --delete` at increasing rates; prints achieved creates/s, p50, p99.

    DSEC_BIN=target/release/dsec python3 crates/apiserver/bench/backends.py --rates 1000,2500,5000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "tests"))

from test_cluster import PgCluster, apiserver, pg_bindir, sim_edges, specs  # noqa: E402

DSEC = os.environ.get("DSEC_BIN", str(REPO / "target/release/dsec"))


def load(url: str, key: str, *args: str) -> dict:
    import subprocess

    out = subprocess.run([DSEC, "bench", "create-load", *args],
                         env=dict(os.environ, DSEC_API_URL=url, DSEC_API_KEY=key),
                         capture_output=True, text=True, check=True)
    s = json.loads(out.stdout)
    s.pop("per_node", None)
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rates", default="1000,2500,5000")
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    tmp = tempfile.mkdtemp(prefix="dsec-bench-backends-")
    bindir = pg_bindir()
    pg = PgCluster(bindir).start() if bindir else None
    res: dict = {}
    edges = sim_edges(DSEC, 160, 2500)
    try:
        dbs = [("sqlite", os.path.join(tmp, "iam.db"))]
        if pg:
            dbs.append(("postgres", pg.create_db("bench")))
        else:
            print("postgres: server binaries absent, skipped", file=sys.stderr)
        for name, db in dbs:
            api = apiserver(DSEC, db, os.path.join(tmp, f"env-{name}"), specs(edges), "--log-level", "warn")
            try:
                u, k = api.first("DSEC_API_URL"), api.first("DSEC_API_KEY")
                res[name] = []
                for r in [float(x) for x in a.rates.split(",") if x]:
                    s = load(u, k, "--rate", str(r), "--total", str(int(r * a.seconds)),
                             "--concurrency", "1024", "--delete")
                    res[name].append(s)
                    print(f"{name:8} rate {r:.0f}/s: achieved {s['achieved_creates_per_s']:.0f}/s "
                          f"p50 {s['create_p50_ms']:.1f} ms p99 {s['create_p99_ms']:.1f} ms refused {s['refused']}",
                          file=sys.stderr)
            finally:
                api.kill(signal.SIGTERM)
    finally:
        edges.kill(signal.SIGTERM)
        if pg:
            pg.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
