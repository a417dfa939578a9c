"""Per-request client CPU of the SDK against a running ``dsec up`` (``DSEC_API_URL``/``KEY`` or
/var/lib/dsec/env), next to the floor of a hand-written asyncio HTTP/1.1 client and plain httpx.

    python3 sdk/python/tools/bench_overhead.py --n 2000 --modes raw,httpx,sdk [--conc 8]

Each mode runs ``--n`` requests (``--conc`` at once; keep-alive connections): ``shell`` =
POST /v1/sandboxes/{id}/shell ``{"cmd": "true"}`` (server work included in wall time), ``get`` =
GET /v1/sandboxes/{id}. Client CPU is ``time.process_time()`` of this process over the loop (the
server runs in another process, so it is not counted)."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from typing import Any, Dict, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import dsec  # noqa: E402
from dsec.client import _read_env_file, DEFAULT_ENV_FILE  # noqa: E402


def endpoint() -> Tuple[str, str]:
    url = os.environ.get("DSEC_API_URL")
    key = os.environ.get("DSEC_API_KEY")
    if not url or not key:
        env = _read_env_file(DEFAULT_ENV_FILE)
        url, key = url or env["DSEC_API_URL"], key or env["DSEC_API_KEY"]
    return url.rstrip("/"), key


class Raw:
    """The floor: hand-written HTTP/1.1 on one asyncio stream, no header parsing beyond
    Content-Length."""

    def __init__(self, url: str, key: str):
        hostport = url.split("://", 1)[1]
        self.host, _, port = hostport.partition(":")
        self.port = int(port or 80)
        self.key = key

    async def open(self) -> None:
        self.r, self.w = await asyncio.open_connection(self.host, self.port)

    async def req(self, method: str, path: str, body: Any = None) -> Dict[str, Any]:
        data = json.dumps(body).encode() if body is not None else b""
        head = (f"{method} {path} HTTP/1.1\r\nhost: {self.host}\r\nauthorization: Bearer {self.key}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(data)}\r\n\r\n")
        self.w.write(head.encode() + data)
        hdr = await self.r.readuntil(b"\r\n\r\n")
        n = 0
        for line in hdr.split(b"\r\n"):
            if line[:15].lower() == b"content-length:":
                n = int(line[15:])
        return json.loads(await self.r.readexactly(n))

    async def close(self) -> None:
        self.w.close()
        await self.w.wait_closed()


async def bench(mode: str, url: str, key: str, sid: str, n: int, what: str, conc: int = 1) -> Tuple[float, float]:
    path = f"/v1/sandboxes/{sid}" + ("/shell" if what == "shell" else "")
    method = "POST" if what == "shell" else "GET"
    body = {"cmd": "true", "session": "default"} if what == "shell" else None
    if mode == "raw":
        raws = [Raw(url, key) for _ in range(conc)]
        for r in raws:
            await r.open()
        free = list(raws)

        async def call() -> Any:
            r = free.pop()  # one connection per task in flight, like a pool
            try:
                return await r.req(method, path, body)
            finally:
                free.append(r)

        async def done() -> None:
            for r in raws:
                await r.close()
    elif mode == "httpx":
        import httpx

        h = httpx.AsyncClient(base_url=url, headers={"authorization": f"Bearer {key}"}, timeout=60)

        async def call() -> Any:
            if body is None:
                r = await h.get(path)
            else:
                r = await h.post(path, json=body)
            return r.json()

        done = h.aclose
    else:
        client = dsec.DSecClient(url, key)
        await client.open()
        sb = dsec.Sandbox(client, dsec.SandboxInfo(id=sid))
        sb.auto_step = False
        if what == "shell":
            call = lambda: sb.run_shell("true")  # noqa: E731
        else:
            call = lambda: client.get_sandbox(sid)  # noqa: E731
        done = client.close
    async def worker(k: int) -> None:
        for _ in range(k):
            await call()

    await asyncio.gather(*(worker(50 // conc + 1) for _ in range(conc)))
    c0, t0 = time.process_time(), time.perf_counter()
    await asyncio.gather(*(worker(n // conc) for _ in range(conc)))
    n = n // conc * conc
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    await done()
    return cpu / n * 1e3, wall / n * 1e3


async def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=2000)
    ap.add_argument("--modes", default="raw,httpx,sdk")
    ap.add_argument("--what", default="shell,get")
    ap.add_argument("--image", default="debian")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--conc", type=int, default=1, help="requests in flight at once")
    args = ap.parse_args()
    url, key = endpoint()
    async with dsec.DSecClient(url, key) as client:
        sb = await client.run_container(dsec.DSecContainerRunArgs(container_image=args.image))
        try:
            print(f"load average before: {os.getloadavg()}")
            for rnd in range(args.rounds):
                for what in args.what.split(","):
                    for mode in args.modes.split(","):
                        cpu, wall = await bench(mode, url, key, sb.id, args.n, what, args.conc)
                        print(f"round {rnd} {what:5s} {mode:5s} conc {args.conc}: client CPU {cpu:.3f} ms/req, "
                              f"wall {wall:.3f} ms/req")
            print(f"load average after: {os.getloadavg()}")
        finally:
            await sb.stop()


if __name__ == "__main__":
    asyncio.run(main())
