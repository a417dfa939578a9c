#!/usr/bin/env python3
"""Exposed ports (issue 18): requests/s and p50/p99 of a small HTTP answer through the
apiserver's port proxy against straight to the sandbox's server, side by side in one run.

    DSEC_BIN=target/release/dsec python3 bench/ports.py [--n 2000] [--rounds 3]

Runs its own `dsec up` (debian imported from the cached tarball), one sandbox without egress
running a stdlib HTTP/1.1 server (keep-alive, a 13-byte answer). Both paths use the same
bounded Python load loop (one keep-alive `http.client` connection, `--n` GETs per round,
rounds interleaved):
- direct: the loop runs in the sandbox's network namespace (`nsenter --net`, host mount
  namespace) and connects to the server on the sandbox's loopback: what a host process with a
  route to the sandbox would see, without the proxy;
- proxy: the loop runs on the host and GETs `/v1/sandboxes/{id}/ports/{port}/` from the
  apiserver with the API key (apiserver → edge tunnel → the sandbox's loopback).
Target: proxy ≥ 0.5× direct throughput, proxy p99 ≤ 2× direct p99 + 1 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "sdk", "python"))

from helpers import DsecUp, debian_tar, dsec_processes, find_dsec_bin, make_sandbox, new_data_dir, remove_data_dir  # noqa: E402

PORT = 8080

SERVER = r'''
import http.server, socketserver, sys
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def do_GET(self):
        # Head and body in one write: no Nagle/delayed-ACK stall between two small segments.
        self.wfile.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\ncontent-length: 13\r\n\r\nhello, world\n")
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True
S(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
'''

# The load loop (run as a child so the direct case can run it inside the sandbox's namespace).
LOOP = r'''
import http.client, json, sys, time
host, port, path, key, n = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
h = {"authorization": "Bearer " + key} if key else {}
c = http.client.HTTPConnection(host, port, timeout=30)
for _ in range(50):
    c.request("GET", path, headers=h); r = c.getresponse(); r.read(); assert r.status == 200, r.status
lat = []
t0 = time.perf_counter()
for _ in range(n):
    s = time.perf_counter()
    c.request("GET", path, headers=h)
    r = c.getresponse()
    body = r.read()
    lat.append((time.perf_counter() - s) * 1000)
    assert r.status == 200 and body == b"hello, world\n", (r.status, body)
wall = time.perf_counter() - t0
print(json.dumps({"rps": n / wall, "lat": lat}))
'''


def pct(v, p):
    v = sorted(v)
    return v[max(0, min(len(v) - 1, int(round(p / 100.0 * len(v) + 0.5)) - 1))]


def run_loop(argv):
    out = subprocess.run(argv, capture_output=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"{argv[:3]}... exited {out.returncode}: {out.stderr.decode()[-2000:]}")
    return json.loads(out.stdout)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    binary = find_dsec_bin()
    if not binary:
        raise SystemExit("no dsec binary: set DSEC_BIN")
    if not debian_tar().is_file():
        raise SystemExit(f"{debian_tar()} missing: run scripts/images/build-debian.sh")
    data = new_data_dir("bench-ports")
    up = DsecUp(binary, data, "bp")
    up.start()
    try:
        up.cli("image", "import", "debian", "--tar", str(debian_tar()), timeout=900)
        c = up.client()
        sb = make_sandbox(c, "debian")
        sb.write_file("/srv/s.py", SERVER.encode())
        sb.run_shell(f"(nohup python3 /srv/s.py {PORT} >/dev/null 2>&1 &)")
        time.sleep(1.0)
        pids = [p for p, (comm, _) in dsec_processes(sb.id).items() if comm == "python3"]
        if not pids:
            raise SystemExit("the server in the sandbox did not start")
        loop_file = os.path.join(data, "loop.py")
        with open(loop_file, "w") as f:
            f.write(LOOP)
        u = up.url.split("//", 1)[1]
        api_host, api_port = u.split(":")[0], u.split(":")[1].rstrip("/")
        direct = ["nsenter", f"--net=/proc/{pids[0]}/ns/net", sys.executable, loop_file,
                  "127.0.0.1", str(PORT), "/", "", str(a.n)]
        proxy = [sys.executable, loop_file, api_host, api_port,
                 f"/v1/sandboxes/{sb.id}/ports/{PORT}/", up.key, str(a.n)]
        # The sandbox has no network: its loopback comes up with the first proxied connection.
        run_loop(proxy[:-1] + ["1"])
        res = {"direct": [], "proxy": []}
        for i in range(a.rounds):
            order = (("direct", direct), ("proxy", proxy)) if i % 2 == 0 else (("proxy", proxy), ("direct", direct))
            for name, argv in order:
                res[name].append(run_loop(argv))
        rows = {}
        for name, runs in res.items():
            lat = [x for r in runs for x in r["lat"]]
            rps = sorted(r["rps"] for r in runs)[len(runs) // 2]
            rows[name] = {"rps": rps, "p50": pct(lat, 50), "p99": pct(lat, 99), "n": len(lat)}
        d, p = rows["direct"], rows["proxy"]
        print(f"load average {os.getloadavg()[0]:.2f}; {a.rounds} rounds of {a.n} GETs each, interleaved")
        print(f"{'path':28} {'n':>6} {'req/s (median round)':>22} {'p50 ms':>8} {'p99 ms':>8}")
        for name, r in (("direct (sandbox loopback)", d), ("apiserver port proxy", p)):
            print(f"{name:28} {r['n']:>6} {r['rps']:>22.0f} {r['p50']:>8.3f} {r['p99']:>8.3f}")
        ratio = p["rps"] / d["rps"]
        bound = 2 * d["p99"] + 1.0
        print(f"throughput ratio proxy/direct = {ratio:.2f}x (target >= 0.5x: {'met' if ratio >= 0.5 else 'missed'})")
        print(f"proxy p99 {p['p99']:.3f} ms vs 2 x direct p99 + 1 ms = {bound:.3f} ms "
              f"({'met' if p['p99'] <= bound else 'missed'})")
        sb.stop()
    finally:
        up.stop()
        remove_data_dir(data)


if __name__ == "__main__":
    main()
