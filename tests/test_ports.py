"""Exposed ports (issue 18 item 1): servers inside a sandbox WITHOUT egress, reached from the host
through the apiserver, by path (`/v1/sandboxes/{id}/ports/{port}/...`) and by host name
(`{port}-{id}.{sandbox_domain}`, the suite's node has `sandbox_domain = "sbx.dsec.test"`).

One debian sandbox for the module runs `python3 -m http.server` and a small stdlib server
(streamed bodies, a WebSocket echo) written below; every request goes over loopback to the
suite's `dsec up`.
"""

from __future__ import annotations

import base64
import hashlib
import http.client
import json
import os
import socket
import struct
import time
import urllib.error
import urllib.parse
import urllib.request

import pytest

from helpers import make_sandbox, sh, stop_quietly

DOMAIN = "sbx.dsec.test"  # MAIN_NODE_CONFIG in conftest.py

# A small HTTP/1.1 server on the stdlib: /echo answers the sha256 and length of the request body
# (sized or chunked), /stream answers a chunked body in pieces, /headers the request headers,
# /ws is a WebSocket echo (text and binary frames).
SERVER = r'''
import base64, hashlib, http.server, json, socketserver, struct, sys, time

class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def log_message(self, *a):
        pass
    def _send(self, code, body, ctype="application/json"):
        self.send_response(code)
        self.send_header("content-type", ctype)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def _body(self):
        if self.headers.get("transfer-encoding", "").lower() == "chunked":
            out = bytearray()
            while True:
                n = int(self.rfile.readline().split(b";")[0].strip(), 16)
                if n == 0:
                    while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                        pass
                    return bytes(out)
                out += self.rfile.read(n)
                self.rfile.readline()
        return self.rfile.read(int(self.headers.get("content-length") or 0))
    def do_POST(self):
        b = self._body()
        self._send(200, json.dumps({"len": len(b), "sha": hashlib.sha256(b).hexdigest(),
                                    "chunked": "chunked" in self.headers.get("transfer-encoding", "")}).encode())
    def do_GET(self):
        if self.path.startswith("/headers"):
            self._send(200, json.dumps({"path": self.path, "headers": dict(self.headers.items())}).encode())
        elif self.path.startswith("/stream"):
            self.send_response(200)
            self.send_header("content-type", "text/plain")
            self.send_header("transfer-encoding", "chunked")
            self.end_headers()
            for i in range(20):
                piece = (f"piece {i}\n" * 100).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(piece), piece))
                self.wfile.flush()
                time.sleep(0.01)
            self.wfile.write(b"0\r\n\r\n")
        elif self.path.startswith("/ws"):
            key = self.headers["sec-websocket-key"]
            acc = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
            self.send_response(101)
            self.send_header("upgrade", "websocket")
            self.send_header("connection", "Upgrade")
            self.send_header("sec-websocket-accept", acc.decode())
            self.end_headers()
            self.wfile.flush()
            self.close_connection = True
            while True:
                h = self.rfile.read(2)
                if len(h) < 2:
                    return
                op, n = h[0] & 15, h[1] & 127
                if n == 126:
                    n = struct.unpack(">H", self.rfile.read(2))[0]
                elif n == 127:
                    n = struct.unpack(">Q", self.rfile.read(8))[0]
                mask = self.rfile.read(4) if h[1] & 128 else b"\0\0\0\0"
                data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
                if op == 8:
                    self.wfile.write(b"\x88\x00")
                    return
                head = bytes([128 | op]) + (bytes([n]) if n < 126 else b"\x7e" + struct.pack(">H", n))
                self.wfile.write(head + data)
                self.wfile.flush()
        else:
            self._send(404, b"{}")

class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

S(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
'''

PLAIN, APP, PUBLIC, DEAD = 8000, 8001, 8002, 8999


def _wait_listening(sb, port: int) -> None:
    # Read from the sandbox's /proc/net/tcp{,6} (a sandbox without network has its loopback down
    # until the first proxied connection brings it up, so no probe connection from inside).
    probe = (
        "python3 -c 'import sys,time\n"
        "for _ in range(100):\n"
        "    rows = [l.split() for f in (\"/proc/net/tcp\", \"/proc/net/tcp6\") for l in open(f).readlines()[1:]]\n"
        "    if any(r[1].endswith(\":%04X\") and r[3] == \"0A\" for r in rows): sys.exit(0)\n"
        "    time.sleep(0.1)\n"
        "sys.exit(1)'" % port
    )
    sh(sb, probe, timeout=30)


@pytest.fixture(scope="module")
def psb(client, debian):
    sb = make_sandbox(client, debian, public_ports=[PUBLIC])
    try:
        sh(sb, "mkdir -p /srv && cd /srv && echo hello-from-inside > index.txt && head -c 300000 /dev/urandom > big.bin")
        sb.write_file("/srv/app.py", SERVER.encode())
        sh(sb, f"cd /srv && (nohup python3 -m http.server {PLAIN} >/tmp/plain.log 2>&1 &)")
        sh(sb, f"(nohup python3 /srv/app.py {APP} >/tmp/app.log 2>&1 &)")
        sh(sb, f"(nohup python3 /srv/app.py {PUBLIC} >/tmp/pub.log 2>&1 &)")
        for p in (PLAIN, APP, PUBLIC):
            _wait_listening(sb, p)
        yield sb
    finally:
        stop_quietly(sb)


def _api(node):
    u = urllib.parse.urlsplit(node.url)
    return u.hostname, u.port


def _conn(node) -> http.client.HTTPConnection:
    host, port = _api(node)
    return http.client.HTTPConnection(host, port, timeout=30)


def _auth(node):
    return {"authorization": f"Bearer {node.key}"}


def _edge_tunnels(client) -> float:
    url = client.list_nodes()[0]["url"]
    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("dsec_edge_port_tunnels_open"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no dsec_edge_port_tunnels_open metric on the edge")


def _wait_no_tunnels(client, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while (n := _edge_tunnels(client)) != 0:
        assert time.monotonic() < deadline, f"{n} port tunnels still open on the edge"
        time.sleep(0.2)


def test_sandbox_has_no_egress(psb):
    # Checked from inside: no interface but loopback, no route; nothing is opened for the proxy.
    assert psb.network()["mode"] == "none"
    devs = [l.split(":")[0].strip() for l in sh(psb, "cat /proc/net/dev").splitlines()[2:]]
    assert devs == ["lo"], devs
    routes = sh(psb, "cat /proc/net/route").splitlines()[1:]
    assert routes == [], routes


def test_http_server_by_path_with_keep_alive(node, psb):
    c = _conn(node)
    try:
        base = f"/v1/sandboxes/{psb.id}/ports/{PLAIN}"
        socks = set()
        for _ in range(3):
            c.request("GET", f"{base}/index.txt", headers=_auth(node))
            r = c.getresponse()
            body = r.read()
            assert r.status == 200, body
            assert body == b"hello-from-inside\n"
            assert not r.will_close, r.getheaders()
            socks.add(id(c.sock))
        assert len(socks) == 1, "the client connection was not kept alive"
        # A bigger file, checked against the sandbox's own hash of it.
        c.request("GET", f"{base}/big.bin", headers=_auth(node))
        r = c.getresponse()
        data = r.read()
        inside = sh(psb, "sha256sum /srv/big.bin").split()[0]
        assert hashlib.sha256(data).hexdigest() == inside
        # The directory listing: the bare port path reaches `/`.
        c.request("GET", base, headers=_auth(node))
        r = c.getresponse()
        assert r.status == 200 and b"index.txt" in r.read()
    finally:
        c.close()


def test_api_key_stays_out_of_the_sandbox_and_query_is_kept(node, psb):
    c = _conn(node)
    try:
        c.request("GET", f"/v1/sandboxes/{psb.id}/ports/{APP}/headers?a=1&b=two", headers=_auth(node))
        r = c.getresponse()
        doc = json.loads(r.read())
        assert r.status == 200, doc
        assert doc["path"] == "/headers?a=1&b=two"
        seen = {k.lower(): v for k, v in doc["headers"].items()}
        assert "authorization" not in seen, seen
        assert node.key not in json.dumps(doc)
    finally:
        c.close()


def test_streamed_bodies_both_ways(node, psb):
    c = _conn(node)
    try:
        payload = os.urandom(4 << 20)

        def chunks():
            for i in range(0, len(payload), 256 << 10):
                yield payload[i:i + (256 << 10)]

        c.request("POST", f"/v1/sandboxes/{psb.id}/ports/{APP}/echo", body=chunks(),
                  headers={**_auth(node), "transfer-encoding": "chunked"}, encode_chunked=True)
        r = c.getresponse()
        doc = json.loads(r.read())
        assert r.status == 200, doc
        assert doc == {"len": len(payload), "sha": hashlib.sha256(payload).hexdigest(), "chunked": True}
        # A chunked answer arrives in pieces, on the same kept-alive connection.
        c.request("GET", f"/v1/sandboxes/{psb.id}/ports/{APP}/stream", headers=_auth(node))
        r = c.getresponse()
        assert r.status == 200
        text = r.read().decode()
        assert text.count("piece 19\n") == 100 and text.startswith("piece 0\n")
        assert not r.will_close
    finally:
        c.close()


def test_signed_url_works_without_the_key_and_bad_tokens_are_refused(node, psb):
    url = psb.get_url(PLAIN)
    assert "dsec_token=" in url
    with urllib.request.urlopen(url.replace("/?", "/index.txt?"), timeout=30) as r:
        assert r.read() == b"hello-from-inside\n"

    def status(u, headers=None):
        try:
            with urllib.request.urlopen(urllib.request.Request(u, headers=headers or {}), timeout=30) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as e:
            return e.code, e.read()

    # No credentials: the port is not public.
    code, body = status(psb.get_url(PLAIN, public=True))
    assert code == 401, body
    assert b"not public" in body
    # A tampered token, and a token of another port.
    tok = url.split("dsec_token=", 1)[1]
    exp, mac = tok.split(".")
    bad = f"{exp}.{('0' if mac[0] != '0' else '1') + mac[1:]}"
    code, body = status(url.replace(tok, bad))
    assert code == 401, body
    code, body = status(f"{node.url}/v1/sandboxes/{psb.id}/ports/{APP}/headers?dsec_token={tok}")
    assert code == 401, body
    # A later expiry with the old signature.
    code, body = status(url.replace(tok, f"{int(exp) + 1000}.{mac}"))
    assert code == 401, body
    # The token in a header works as well, and an expired token is refused with the reason.
    code, body = status(psb.get_url(PLAIN, public=True) + "index.txt", {"x-dsec-port-token": tok})
    assert code == 200 and body == b"hello-from-inside\n"
    short = psb.get_url(PLAIN, expires_in=1)
    time.sleep(2.1)
    code, body = status(short)
    assert code == 401, body
    assert b"expired" in body
    # Signing needs the API key and refuses bad values.
    import dsec
    with pytest.raises(dsec.DSecError) as e:
        psb.port_url(0)
    assert e.value.status == 400
    with pytest.raises(dsec.DSecError) as e:
        psb.port_url(PLAIN, expires_in=10**9)
    assert e.value.status == 400


def test_public_port_needs_no_credentials(node, psb):
    assert PUBLIC in psb.refresh().public_ports
    with urllib.request.urlopen(psb.get_url(PUBLIC, public=True) + "headers", timeout=30) as r:
        assert json.loads(r.read())["path"] == "/headers"


def test_host_based_form(node, psb):
    host, port = _api(node)
    c = _conn(node)
    try:
        name = f"{PLAIN}-{psb.id}.{DOMAIN}:{port}"
        c.request("GET", "/index.txt", headers={**_auth(node), "host": name})
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"hello-from-inside\n"
        info = psb.port_url(APP)
        assert info["host"] == f"{APP}-{psb.id}.{DOMAIN}"
        c.request("GET", f"/headers?dsec_token={info['token']}", headers={"host": f"{info['host']}:{port}"})
        r = c.getresponse()
        doc = json.loads(r.read())
        assert r.status == 200, doc
        assert doc["path"] == "/headers"
        # Without credentials on a private port: refused; the API itself still answers on the
        # same listener for other host names.
        c.request("GET", "/index.txt", headers={"host": name})
        r = c.getresponse()
        body = r.read()
        assert r.status == 401, body
        c.request("GET", "/healthz", headers={"host": f"127.0.0.1:{port}"})
        r = c.getresponse()
        assert r.status == 200 and r.read() == b"ok\n"
    finally:
        c.close()


def _ws_connect(node, path: str, headers=None) -> socket.socket:
    host, port = _api(node)
    s = socket.create_connection((host, port), timeout=30)
    key = base64.b64encode(os.urandom(16)).decode()
    extra = "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
    s.sendall((f"GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
               f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = s.recv(4096)
        assert chunk, f"connection closed during the handshake: {head!r}"
        head += chunk
    status = head.split(b"\r\n", 1)[0]
    assert b" 101 " in status, head
    want = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
    assert want in head, head
    return s


def _ws_send(s: socket.socket, data: bytes, op: int = 1) -> None:
    mask = os.urandom(4)
    n = len(data)
    head = bytes([128 | op]) + (bytes([128 | n]) if n < 126 else bytes([128 | 126]) + struct.pack(">H", n))
    s.sendall(head + mask + bytes(b ^ mask[i % 4] for i, b in enumerate(data)))


def _recv_exact(s: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = s.recv(n - len(out))
        if not chunk:
            raise EOFError(f"closed after {len(out)} of {n} bytes")
        out += chunk
    return out


def _ws_recv(s: socket.socket):
    h = _recv_exact(s, 2)
    n = h[1] & 127
    if n == 126:
        n = struct.unpack(">H", _recv_exact(s, 2))[0]
    return h[0] & 15, _recv_exact(s, n)


def test_websocket_echo(node, psb, client):
    tok = psb.port_url(APP)["token"]
    s = _ws_connect(node, f"/v1/sandboxes/{psb.id}/ports/{APP}/ws?dsec_token={tok}")
    try:
        for msg in (b"hello", b"x" * 5000, "żółw".encode()):
            _ws_send(s, msg)
            assert _ws_recv(s) == (1, msg)
        _ws_send(s, b"\x00\x01\x02", op=2)
        assert _ws_recv(s) == (2, b"\x00\x01\x02")
        assert _edge_tunnels(client) >= 1
        _ws_send(s, b"", op=8)
        assert _ws_recv(s)[0] == 8
    finally:
        s.close()
    _wait_no_tunnels(client)


def test_dead_port_is_a_clear_502(node, psb):
    c = _conn(node)
    try:
        c.request("GET", f"/v1/sandboxes/{psb.id}/ports/{DEAD}/", headers=_auth(node))
        r = c.getresponse()
        doc = json.loads(r.read())
        assert r.status == 502, doc
        assert doc["error"]["code"] == "port_unreachable"
        assert str(DEAD) in doc["error"]["message"]
        for bad in ("0", "99999"):
            c.request("GET", f"/v1/sandboxes/{psb.id}/ports/{bad}/", headers=_auth(node))
            r = c.getresponse()
            body = r.read()
            assert r.status == 400, body
    finally:
        c.close()


def test_connections_end_with_the_sandbox(node, client, debian):
    """An open WebSocket to a sandbox ends when the sandbox is stopped; no tunnel stays."""
    sb = make_sandbox(client, debian)
    try:
        sb.write_file("/srv/app.py", SERVER.encode())
        sh(sb, f"(nohup python3 /srv/app.py {APP} >/tmp/app.log 2>&1 &)")
        _wait_listening(sb, APP)
        s = _ws_connect(node, f"/v1/sandboxes/{sb.id}/ports/{APP}/ws", _auth(node))
        _ws_send(s, b"ping")
        assert _ws_recv(s) == (1, b"ping")
        sb.stop()
        s.settimeout(10)
        with pytest.raises((EOFError, ConnectionError)):
            while True:
                _ws_recv(s)
        s.close()
        _wait_no_tunnels(client)
        c = _conn(node)
        c.request("GET", f"/v1/sandboxes/{sb.id}/ports/{APP}/", headers=_auth(node))
        r = c.getresponse()
        assert r.status in (404, 410), r.read()
        c.close()
    finally:
        stop_quietly(sb)
