"""Composable layered images: composition, OCI/docker archives with whiteouts, pack_diff,
blob verification, and a blob store on a real network file system (sshfs over loopback)."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import shutil
import signal
import subprocess
import tarfile
import tempfile
import time
from typing import Dict, List, Optional, Tuple

import pytest

import dsec
from helpers import DsecUp, make_sandbox, mounts_under, new_data_dir, remove_data_dir, sh, stop_quietly, wait_until


# ---------------------------------------------------------------------------------------------
# building tars in memory


def _tar(entries: List[Tuple[str, object]], gz: bool = False) -> bytes:
    """entries: (path, bytes) for files, (path, None) for directories, (path, ("link", target))
    for symlinks."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as t:
        for path, data in entries:
            info = tarfile.TarInfo(path)
            info.mtime = 1_700_000_000
            if data is None:
                info.type = tarfile.DIRTYPE
                info.mode = 0o755
                t.addfile(info)
            elif isinstance(data, tuple):
                info.type = tarfile.SYMTYPE
                info.linkname = data[1]
                t.addfile(info)
            else:
                info.size = len(data)
                info.mode = 0o644
                t.addfile(info, io.BytesIO(data))
    raw = buf.getvalue()
    return gzip.compress(raw) if gz else raw


def docker_archive(layers: List[bytes]) -> bytes:
    """A `docker save`-style archive: manifest.json + <n>/layer.tar."""
    files = []
    names = []
    for i, layer in enumerate(layers):
        name = f"{i:02d}/layer.tar"
        names.append(name)
        files.append((name, layer))
    files.append(("config.json", b"{}"))
    files.append(("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["t:1"], "Layers": names}]).encode()))
    return _tar(files)


def oci_archive(layers: List[bytes]) -> bytes:
    """A tar of an OCI image layout with gzip'd layers."""
    blobs: Dict[str, bytes] = {}

    def add(data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        blobs[d] = data
        return d

    config = add(b"{}")
    descs = []
    for layer in layers:
        gz = gzip.compress(layer)
        descs.append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip", "digest": add(gz), "size": len(gz)})
    manifest = json.dumps({
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config, "size": 2},
        "layers": descs,
    }).encode()
    md = add(manifest)
    index = json.dumps({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": md, "size": len(manifest)}]}).encode()
    files = [("oci-layout", b'{"imageLayoutVersion": "1.0.0"}'), ("index.json", index), ("blobs", None), ("blobs/sha256", None)]
    files += [(f"blobs/sha256/{d.split(':')[1]}", data) for d, data in blobs.items()]
    return _tar(files)


# ---------------------------------------------------------------------------------------------
# composition


def test_composition_precedence_and_toolkit_update(client):
    client.import_image("i3-base:v1", _tar([
        ("etc", None), ("etc/which", b"base\n"), ("etc/base_only", b"b\n"),
        ("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\n"), ("etc/group", b"root:x:0:\n"),
        ("x", None), ("x/del_me", b"gone soon\n"), ("x/keep", b"k\n"),
    ]))
    # The workspace deletes /x/del_me (an OCI whiteout, converted on import).
    client.import_image("i3-ws:v1", _tar([
        ("etc", None), ("etc/which", b"workspace\n"), ("etc/ws_only", b"w\n"), ("x", None), ("x/.wh.del_me", b""),
    ]))
    # The top toolkit deletes /x/keep of the toolkit below it.
    client.import_image("i3-tk:v1", _tar([
        ("etc", None), ("etc/which", b"toolkit-1\n"), ("etc/tk_only", b"t\n"), ("x", None), ("x/.wh.keep", b""),
    ]))
    sb = make_sandbox(client, "busybox", workspace="i3-ws:v1", toolkits=["i3-base:v1", "i3-tk:v1"])
    try:
        assert sh(sb, "cat /etc/which") == "toolkit-1\n"
        assert sh(sb, "cat /etc/base_only /etc/ws_only /etc/tk_only") == "b\nw\nt\n"
        # Deletions in an upper layer hide lower ones, never higher ones.
        assert sh(sb, "test -e /x/keep && echo present || echo absent") == "absent\n"
        assert sh(sb, "test -e /x/del_me && echo present || echo absent") == "present\n"
        sb_ws = make_sandbox(client, "busybox", workspace="i3-ws:v1", toolkits=["i3-tk:v1"])
        try:
            assert sh(sb_ws, "cat /etc/which") == "toolkit-1\n"
        finally:
            stop_quietly(sb_ws)
        assert sh(sb, "echo hi | busybox wc -l").strip() == "1"  # base (busybox) still underneath
        layers = {l["digest"]: l for i in client.list_images() for l in i.layers}
        assert any(l.get("users", 0) >= 1 for l in layers.values())
        # Updating the toolkit rebuilds only that layer; the next create picks it up, the
        # running sandbox keeps the old one.
        before = {i.name: [l["digest"] for l in i.layers] for i in client.list_images()}
        client.import_image("i3-tk:v1", _tar([("etc", None), ("etc/which", b"toolkit-2\n")]))
        after = {i.name: [l["digest"] for l in i.layers] for i in client.list_images()}
        assert after["i3-ws:v1"] == before["i3-ws:v1"] and after["i3-base:v1"] == before["i3-base:v1"]
        assert after["i3-tk:v1"] != before["i3-tk:v1"]
        sb2 = make_sandbox(client, "busybox", workspace="i3-ws:v1", toolkits=["i3-tk:v1"])
        try:
            assert sh(sb2, "cat /etc/which") == "toolkit-2\n"
            assert sh(sb2, "test -e /etc/tk_only && echo present || echo absent") == "absent\n"
        finally:
            stop_quietly(sb2)
        assert sh(sb, "cat /etc/which") == "toolkit-1\n"
    finally:
        stop_quietly(sb)
    with pytest.raises(dsec.DSecError) as e:
        make_sandbox(client, "busybox", toolkits=["i3-no-such-toolkit"])
    assert "not found" in str(e.value)


# ---------------------------------------------------------------------------------------------
# OCI / docker archives


LAYER1 = [("d", None), ("d/f1", b"1\n"), ("d/f2", b"2\n"), ("keep", b"k\n"), ("gone", b"g\n")]
LAYER2 = [("d", None), ("d/.wh..wh..opq", b""), ("d/new", b"n\n"), (".wh.gone", b"")]


@pytest.mark.parametrize("fmt", ["docker-archive", "oci"])
def test_archive_import_converts_whiteouts(client, fmt):
    layers = [_tar(LAYER1), _tar(LAYER2)]
    data = docker_archive(layers) if fmt == "docker-archive" else oci_archive(layers)
    info = client.import_image(f"i3-{fmt}:v1", data, format=fmt)
    assert len(info.layers) == 2, info
    assert info.source == fmt
    for l in info.layers:
        assert l["meta_bytes"] > 0
    sb = make_sandbox(client, "busybox", workspace=f"i3-{fmt}:v1")
    try:
        assert sh(sb, "ls /d") == "new\n"  # opaque dir hides f1, f2 of the lower layer
        assert sh(sb, "cat /keep") == "k\n"
        assert sh(sb, "test -e /gone && echo present || echo absent") == "absent\n"
    finally:
        stop_quietly(sb)


def test_bad_archive_is_a_clear_400(client):
    with pytest.raises(dsec.DSecError) as e:
        client.import_image("i3-bad:v1", _tar([("manifest.json", b"[]")]), format="docker-archive")
    assert "manifest.json lists no image" in str(e.value)
    with pytest.raises(dsec.DSecError) as e:
        client.import_image("i3-bad:v1", _tar([("x", b"1")]), format="zip")
    assert "unknown image format" in str(e.value)


# ---------------------------------------------------------------------------------------------
# pack_diff


def test_pack_diff_round_trip_and_chain(client, node):
    client.import_image("i3-pk-base:v1", _tar([
        ("gone", b"base file\n"), ("opq", None), ("opq/a", b"a\n"), ("opq/b", b"b\n"), ("root", None),
    ]))
    src = make_sandbox(client, "busybox", workspace="i3-pk-base:v1")
    try:
        sh(src, "\n".join([
            "set -e",
            "rm /gone",                                   # deletion -> whiteout
            "rm -rf /opq && mkdir /opq && echo c > /opq/c",  # opaque dir
            "mkdir -p /data && echo payload > /data/file",
            "chown 1234:5678 /data/file && chmod 4750 /data/file",
            "ln -s /data/file /data/link",
            "ln /data/file /data/hard",
            "mkfifo /data/fifo",
            "mkdir -p /root/secret && echo answer > /root/secret/key",
            "mkdir -p /scrub && echo x > /scrub/y",
        ]))
        # An xattr on an upper file, set from the host (busybox has no setfattr).
        upper = os.path.join(node.sandbox_dir(src.id), "upper")
        os.setxattr(os.path.join(upper, "data", "file"), "user.note", b"kept")
        info = src.pack_diff("i3-packed:v1", exclude=["/root/secret", "/scrub"])
        assert info.parent == "busybox:latest"
        assert len(info.layers) >= 3, info
        # The source keeps running and was thawed.
        assert sh(src, "echo alive") == "alive\n"
    finally:
        stop_quietly(src)

    new = make_sandbox(client, "i3-packed:v1")
    try:
        assert sh(new, "test -e /gone && echo present || echo absent") == "absent\n"
        assert sh(new, "ls /opq") == "c\n"
        assert sh(new, "stat -c '%a %u %g' /data/file") == "4750 1234 5678\n"
        assert sh(new, "cat /data/file") == "payload\n"
        assert sh(new, "readlink /data/link") == "/data/file\n"
        assert sh(new, "stat -c %i /data/file") == sh(new, "stat -c %i /data/hard")
        assert sh(new, "stat -c %h /data/file") == "2\n"
        assert sh(new, "test -p /data/fifo && echo fifo") == "fifo\n"
        assert sh(new, "test -e /root/secret && echo present || echo absent") == "absent\n"
        assert sh(new, "test -e /scrub && echo present || echo absent") == "absent\n"
        # diff of a diff
        sh(new, "echo second > /data/second && rm /data/hard")
        info2 = new.pack_diff("i3-packed:v2")
        assert info2.parent == "i3-packed:v1"
        assert len(info2.layers) == len(info.layers) + 1
    finally:
        stop_quietly(new)
    third = make_sandbox(client, "i3-packed:v2")
    try:
        assert sh(third, "cat /data/second /data/file") == "second\npayload\n"
        assert sh(third, "test -e /data/hard && echo present || echo absent") == "absent\n"
        assert sh(third, "ls /opq") == "c\n"
    finally:
        stop_quietly(third)
    with pytest.raises(dsec.DSecError) as e:
        s = make_sandbox(client, "busybox")
        try:
            s.pack_diff("i3-x:v1", exclude=["relative/path"])
        finally:
            stop_quietly(s)
    assert "not absolute" in str(e.value)


# ---------------------------------------------------------------------------------------------
# corrupt / truncated blobs


def _blob_path(node: DsecUp, image: str, client) -> str:
    info = next(i for i in client.list_images() if i.name == image)
    digest = info.layers[-1]["digest"]
    assert info.layers[-1]["blob_bytes"] > 0, info
    return os.path.join(node.data_dir, "edge", "images", "blobs", f"{digest}.blob")


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_damaged_blob_fails_create_clearly(client, node, damage):
    name = f"i3-dmg-{damage}:v1"
    client.import_image(name, _tar([("big", os.urandom(300_000))]))
    blob = _blob_path(node, name, client)
    with open(blob, "r+b") as f:
        if damage == "truncate":
            f.truncate(os.path.getsize(blob) - 4096)
        else:
            f.write(b"\xff" * 512)
    t0 = time.monotonic()
    with pytest.raises(dsec.DSecError) as e:
        make_sandbox(client, "busybox", workspace=name)
    assert time.monotonic() - t0 < 30
    msg = str(e.value)
    assert "data blob" in msg and ("truncated" in msg if damage == "truncate" else "corrupt" in msg), msg
    assert all(s.state != "creating" for s in client.list_sandboxes())


# ---------------------------------------------------------------------------------------------
# a posix blob store on a real network file system: sshfs to sshd on loopback


class SshfsStore:
    """sshd on a loopback port (own host key, authorized key, all in a temp dir) and an sshfs
    mount of its export directory. Stopped by PID."""

    def __init__(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="dsec-sshfs-", dir="/var/tmp")
        self.export = os.path.join(self.tmp, "export")
        self.mnt = os.path.join(self.tmp, "mnt")
        os.makedirs(self.export)
        os.makedirs(self.mnt)
        self.sshd: Optional[subprocess.Popen] = None
        self.mounted = False

    def start(self) -> "SshfsStore":
        import socket
        for tool in ("sshfs", "/usr/sbin/sshd", "ssh-keygen"):
            if shutil.which(tool) is None:
                raise RuntimeError(f"{tool} missing (apt-get install sshfs openssh-server)")
        key = os.path.join(self.tmp, "id")
        hostkey = os.path.join(self.tmp, "hostkey")
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", key], check=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", hostkey], check=True)
        shutil.copy(key + ".pub", os.path.join(self.tmp, "authorized_keys"))
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        cfg = os.path.join(self.tmp, "sshd_config")
        with open(cfg, "w") as f:
            f.write("\n".join([
                f"Port {self.port}", "ListenAddress 127.0.0.1", f"HostKey {hostkey}",
                f"AuthorizedKeysFile {self.tmp}/authorized_keys", "PermitRootLogin prohibit-password",
                "PasswordAuthentication no", "UsePAM no", "StrictModes no",
                f"PidFile {self.tmp}/sshd.pid", "Subsystem sftp internal-sftp", "",
            ]))
        os.makedirs("/run/sshd", exist_ok=True)
        self.sshd = subprocess.Popen(["/usr/sbin/sshd", "-D", "-e", "-f", cfg],
                                     stderr=open(os.path.join(self.tmp, "sshd.log"), "wb"))
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.1)
        subprocess.run([
            "sshfs", "-p", str(self.port),
            "-o", f"IdentityFile={key},StrictHostKeyChecking=no,UserKnownHostsFile=/dev/null,allow_other,reconnect",
            f"root@127.0.0.1:{self.export}", self.mnt,
        ], check=True, timeout=30)
        self.mounted = True
        return self

    def stop(self) -> None:
        if self.mounted:
            subprocess.run(["fusermount", "-u", "-z", self.mnt], check=False)
            subprocess.run(["umount", "-l", self.mnt], check=False, stderr=subprocess.DEVNULL)
            self.mounted = False
        if self.sshd is not None and self.sshd.poll() is None:
            self.sshd.send_signal(signal.SIGTERM)
            try:
                self.sshd.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.sshd.kill()
                self.sshd.wait()
        shutil.rmtree(self.tmp, ignore_errors=True)


def dsec_up_with_config(dsec_bin: str, data: str, node_id: str, edge_toml: str) -> DsecUp:
    """A `dsec up` with an `[edge]` config: a wrapper script adds `--config` to `up`."""
    cfg = os.path.join(data + ".toml")
    with open(cfg, "w") as f:
        f.write("[edge]\n" + edge_toml)
    wrapper = data + ".dsec"
    with open(wrapper, "w") as f:
        f.write(f'#!/bin/sh\nif [ "$1" = up ]; then exec {dsec_bin} "$@" --config {cfg}; fi\nexec {dsec_bin} "$@"\n')
    os.chmod(wrapper, 0o755)
    return DsecUp(wrapper, data, node_id)


def test_posix_store_on_sshfs(dsec_bin):
    try:
        store = SshfsStore().start()
    except (RuntimeError, subprocess.CalledProcessError) as e:
        pytest.skip(f"no sshfs/sshd: {e}")
    data = new_data_dir("sshfs")
    up = dsec_up_with_config(dsec_bin, data, "i3fs", f'image_blob_store = "posix:{store.mnt}"\n')
    try:
        up.start()
        c = up.client()
        payload = os.urandom(2_000_000)
        info = c.import_image("i3-remote:v1", _tar([("data", None), ("data/blob.bin", payload), ("data/small", b"s\n")]))
        layer = info.layers[-1]
        assert layer["blob_bytes"] >= len(payload) and layer["meta_bytes"] < 64 * 1024, layer
        # The data blob lives on the server side of the sshfs mount, not on local disk.
        exported = os.path.join(store.export, f"{layer['digest']}.blob")
        assert os.path.getsize(exported) == layer["blob_bytes"]
        assert not os.path.exists(os.path.join(data, "edge", "images", "blobs", f"{layer['digest']}.blob"))
        sb = make_sandbox(c, "busybox", workspace="i3-remote:v1")
        try:
            assert sh(sb, "sha256sum /data/blob.bin").split()[0] == hashlib.sha256(payload).hexdigest()
            assert sh(sb, "cat /data/small") == "s\n"
            # The layer is mounted from the network file system (device=<sshfs path>).
            with open("/proc/self/mountinfo") as f:
                lines = [l for l in f if layer["digest"] in l and " erofs " in l]
            assert lines, "layer not mounted"
            with open("/proc/self/mountinfo") as f:
                assert any(store.mnt in l and "fuse.sshfs" in l for l in f)
        finally:
            stop_quietly(sb)
        c.close()
    finally:
        rc = up.stop()
        store.stop()
        left = mounts_under(data)
        remove_data_dir(data)
        for p in (data + ".toml", data + ".dsec"):
            try:
                os.unlink(p)
            except OSError:
                pass
    assert rc == 0, up.stderr_tail()
    assert not left, left


# ---------------------------------------------------------------------------------------------
# a real OCI registry (Debian's docker-registry) on loopback, with token auth served by a tiny
# token server in this process; images pushed by a small distribution-v2 client below


def _b64url(b: bytes) -> str:
    import base64
    return base64.urlsafe_b64encode(b).rstrip(b"=").decode()


class TokenServer:
    """Issues RS256 JWTs (x5c header, signed with `openssl dgst`) that docker-registry's
    `auth.token` accepts; checks basic credentials; counts the tokens it hands out."""

    def __init__(self, tmp: str, user: str, password: str) -> None:
        import http.server
        import threading
        self.key = os.path.join(tmp, "token.key")
        self.cert = os.path.join(tmp, "token.crt")
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", self.key,
                        "-out", self.cert, "-days", "2", "-subj", "/CN=dsec-test-token"],
                       check=True, capture_output=True)
        der = subprocess.run(["openssl", "x509", "-in", self.cert, "-outform", "DER"], check=True,
                             capture_output=True).stdout
        import base64
        self.x5c = base64.b64encode(der).decode()
        self.user, self.password = user, password
        self.issued = 0
        self.refused = 0
        outer = self

        class H(http.server.BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def do_GET(self):  # noqa: N802
                from urllib.parse import parse_qs, urlparse
                q = parse_qs(urlparse(self.path).query)
                want = "Basic " + base64.b64encode(f"{outer.user}:{outer.password}".encode()).decode()
                if self.headers.get("Authorization") != want:
                    outer.refused += 1
                    self.send_response(401)
                    self.end_headers()
                    return
                access = []
                for scope in q.get("scope", []):
                    kind, name, actions = scope.split(":", 2)
                    access.append({"type": kind, "name": name, "actions": actions.split(",")})
                body = json.dumps({"token": outer.sign(q.get("service", [""])[0], access)}).encode()
                outer.issued += 1
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), H)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def sign(self, service: str, access: list) -> str:
        now = int(time.time())
        header = {"alg": "RS256", "typ": "JWT", "x5c": [self.x5c]}
        claims = {"iss": "dsec-test-issuer", "sub": self.user, "aud": service, "exp": now + 600,
                  "nbf": now - 10, "iat": now, "jti": os.urandom(8).hex(), "access": access}
        signing_input = f"{_b64url(json.dumps(header).encode())}.{_b64url(json.dumps(claims).encode())}"
        sig = subprocess.run(["openssl", "dgst", "-sha256", "-sign", self.key], input=signing_input.encode(),
                             check=True, capture_output=True).stdout
        return f"{signing_input}.{_b64url(sig)}"

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


class Registry:
    """docker-registry on a free loopback port with a config file in a temp dir (token auth
    when a TokenServer is given; HTTPS when `tls` names a certificate and key file). Stopped
    by PID."""

    def __init__(self, tokens: Optional[TokenServer], tmp: str, tls: Optional[Tuple[str, str]] = None) -> None:
        from helpers import free_port
        self.tmp = tmp
        self.port = free_port()
        self.storage = os.path.join(tmp, "storage")
        cfg = [
            "version: 0.1", "log:", "  level: error", "storage:", "  filesystem:",
            f"    rootdirectory: {self.storage}", "http:", f"  addr: 127.0.0.1:{self.port}",
            "  secret: dsec-test-secret",
        ]
        if tls is not None:
            cfg += ["  tls:", f"    certificate: {tls[0]}", f"    key: {tls[1]}"]
        if tokens is not None:
            cfg += ["auth:", "  token:", f"    realm: http://127.0.0.1:{tokens.port}/token",
                    "    service: dsec-registry", "    issuer: dsec-test-issuer",
                    f"    rootcertbundle: {tokens.cert}"]
        self.config = os.path.join(tmp, "registry.yml")
        with open(self.config, "w") as f:
            f.write("\n".join(cfg) + "\n")
        self.log = open(os.path.join(tmp, "registry.log"), "wb")
        self.proc = subprocess.Popen(["docker-registry", "serve", self.config], stdout=self.log, stderr=self.log)
        import socket
        deadline = time.monotonic() + 15
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                break
            except OSError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("docker-registry did not start: " + open(self.log.name).read()[-2000:])
                time.sleep(0.1)

    @property
    def host(self) -> str:
        return f"127.0.0.1:{self.port}"

    def blob_file(self, digest: str) -> str:
        hexd = digest.split(":", 1)[1]
        return os.path.join(self.storage, "docker", "registry", "v2", "blobs", "sha256", hexd[:2], hexd, "data")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


class Pusher:
    """Just enough of the distribution v2 API to push blobs and manifests, with the same
    bearer-token dance a client does."""

    def __init__(self, host: str, user: str = "", password: str = "", scheme: str = "http",
                 verify: object = True) -> None:
        import httpx
        self.base = f"{scheme}://{host}"
        self.http = httpx.Client(timeout=60, verify=verify)
        self.user, self.password = user, password
        self.auth: Optional[str] = None

    def _req(self, method: str, url: str, **kw):
        for _ in range(2):
            headers = dict(kw.pop("headers", {}) or {})
            if self.auth:
                headers["Authorization"] = self.auth
            r = self.http.request(method, url, headers=headers, **kw)
            kw["headers"] = {k: v for k, v in headers.items() if k != "Authorization"}
            if r.status_code != 401:
                return r
            ch = r.headers.get("www-authenticate", "")
            params = dict(p.split("=", 1) for p in ch.split(" ", 1)[1].replace('"', "").split(",") if "=" in p) \
                if ch.lower().startswith("bearer") else {}
            # A scope value may itself contain a comma (pull,push): rebuild it.
            import re
            m = re.search(r'scope="([^"]*)"', ch)
            if m:
                params["scope"] = m.group(1)
            t = self.http.get(params["realm"], params={"service": params.get("service", ""), "scope": params["scope"]},
                              auth=(self.user, self.password))
            t.raise_for_status()
            self.auth = "Bearer " + t.json()["token"]
        return r

    def blob(self, repo: str, data: bytes) -> str:
        d = "sha256:" + hashlib.sha256(data).hexdigest()
        r = self._req("POST", f"{self.base}/v2/{repo}/blobs/uploads/")
        assert r.status_code == 202, (r.status_code, r.text)
        loc = r.headers["location"]
        if loc.startswith("/"):
            loc = self.base + loc
        sep = "&" if "?" in loc else "?"
        r = self._req("PUT", f"{loc}{sep}digest={d}", content=data,
                      headers={"content-type": "application/octet-stream"})
        assert r.status_code == 201, (r.status_code, r.text)
        return d

    def manifest(self, repo: str, tag: str, doc: dict, media_type: str) -> str:
        body = json.dumps(doc).encode()
        r = self._req("PUT", f"{self.base}/v2/{repo}/manifests/{tag}", content=body,
                      headers={"content-type": media_type})
        assert r.status_code == 201, (r.status_code, r.text)
        return "sha256:" + hashlib.sha256(body).hexdigest()

    def image(self, repo: str, tag: str, layers: List[bytes], docker: bool = False) -> Tuple[str, int]:
        """Pushes gzip'd layers + a config + a manifest; returns (manifest digest, size)."""
        descs = []
        ltype = ("application/vnd.docker.image.rootfs.diff.tar.gzip" if docker
                 else "application/vnd.oci.image.layer.v1.tar+gzip")
        diff_ids = []
        for layer in layers:
            gz = gzip.compress(layer)
            diff_ids.append("sha256:" + hashlib.sha256(layer).hexdigest())
            descs.append({"mediaType": ltype, "digest": self.blob(repo, gz), "size": len(gz)})
        config = json.dumps({"architecture": "amd64", "os": "linux",
                             "rootfs": {"type": "layers", "diff_ids": diff_ids}, "config": {}}).encode()
        cd = self.blob(repo, config)
        mtype = ("application/vnd.docker.distribution.manifest.v2+json" if docker
                 else "application/vnd.oci.image.manifest.v1+json")
        ctype = ("application/vnd.docker.container.image.v1+json" if docker
                 else "application/vnd.oci.image.config.v1+json")
        doc = {"schemaVersion": 2, "mediaType": mtype,
               "config": {"mediaType": ctype, "digest": cd, "size": len(config)}, "layers": descs}
        size = len(json.dumps(doc).encode())
        return self.manifest(repo, tag, doc, mtype), size


@pytest.fixture
def registry_with_tokens():
    for tool in ("docker-registry", "openssl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} missing (apt-get install docker-registry openssl)")
    tmp = tempfile.mkdtemp(prefix="dsec-registry-", dir="/var/tmp")
    tokens = TokenServer(tmp, "alice", "s3cret")
    try:
        reg = Registry(tokens, tmp)
    except RuntimeError as e:
        tokens.stop()
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(str(e))
    try:
        yield reg, tokens
    finally:
        reg.stop()
        tokens.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_registry_pull_with_token_auth(client, node, registry_with_tokens):
    reg, tokens = registry_with_tokens
    p = Pusher(reg.host, "alice", "s3cret")
    # A two-layer image (whiteouts in the second), as a Docker schema-2 manifest.
    md, _ = p.image("team/app", "v1", [_tar(LAYER1), _tar(LAYER2)], docker=True)
    # A multi-platform index: the amd64 manifest must be picked.
    amd, amd_size = p.image("team/app", "amd64-only", [_tar([("arch", b"amd64\n")])])
    arm, arm_size = p.image("team/app", "arm64-only", [_tar([("arch", b"arm64\n")])])
    index = {"schemaVersion": 2, "mediaType": "application/vnd.oci.image.index.v1+json", "manifests": [
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": arm, "size": arm_size,
         "platform": {"architecture": "arm64", "os": "linux"}},
        {"mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": amd, "size": amd_size,
         "platform": {"architecture": "amd64", "os": "linux"}},
    ]}
    p.manifest("team/app", "multi", index, "application/vnd.oci.image.index.v1+json")
    issued_before = tokens.issued

    # SDK pull: 401 -> token server (basic credentials) -> retried with the bearer token.
    info = client.pull_image("i3-pulled:v1", f"{reg.host}/team/app:v1", username="alice", password="s3cret")
    assert tokens.issued > issued_before, "the pull did not go through the token server"
    assert len(info.layers) == 2, info
    assert info.source == f"registry {reg.host}/team/app@{md}", info.source
    sb = make_sandbox(client, "busybox", workspace="i3-pulled:v1")
    try:
        assert sh(sb, "ls /d") == "new\n"
        assert sh(sb, "cat /keep") == "k\n"
        assert sh(sb, "test -e /gone && echo present || echo absent") == "absent\n"
    finally:
        stop_quietly(sb)

    # CLI pull of the index by tag, with progress; then the same manifest pinned by digest.
    os.environ["DSEC_REGISTRY_PASSWORD"] = "s3cret"
    try:
        proc = node.cli("image", "pull", f"{reg.host}/team/app:multi", "--name", "i3-multi:v1",
                        "--username", "alice", timeout=300)
    finally:
        del os.environ["DSEC_REGISTRY_PASSWORD"]
    err = proc.stderr.decode()
    assert f"manifest {amd}: 1 layer(s)" in err, err
    assert "layer 1/1:" in err and "building layer 1/1" in err and "pulled i3-multi:v1" in err, err
    assert proc.stdout.decode().strip() == "i3-multi:v1"
    pinned = client.pull_image("i3-pinned:v1", f"{reg.host}/team/app@{amd}", username="alice", password="s3cret")
    sb = make_sandbox(client, "busybox", workspace="i3-multi:v1")
    try:
        assert sh(sb, "cat /arch") == "amd64\n"
    finally:
        stop_quietly(sb)
    multi = next(i for i in client.list_images() if i.name == "i3-multi:v1")
    # The index resolved to the same amd64 manifest the digest pin names.
    assert multi.source == pinned.source == f"registry {reg.host}/team/app@{amd}", (multi.source, pinned.source)

    # Wrong credentials: a clear error, nothing registered.
    with pytest.raises(dsec.DSecError) as e:
        client.pull_image("i3-denied:v1", f"{reg.host}/team/app:v1", username="alice", password="wrong")
    assert "check the credentials" in str(e.value), e.value
    assert tokens.refused >= 1
    with pytest.raises(dsec.DSecError) as e:
        client.pull_image("i3-missing:v1", f"{reg.host}/team/app:nope", username="alice", password="s3cret")
    assert "404" in str(e.value) or "MANIFEST_UNKNOWN" in str(e.value), e.value
    assert not any(i.name in ("i3-denied:v1", "i3-missing:v1") for i in client.list_images())

    # A blob damaged in the registry's storage (same size) fails digest verification.
    bad_manifest, _ = p.image("team/bad", "v1", [_tar([("f", os.urandom(50_000))])])
    r = p._req("GET", f"{p.base}/v2/team/bad/manifests/v1",
               headers={"accept": "application/vnd.oci.image.manifest.v1+json"})
    layer_digest = r.json()["layers"][0]["digest"]
    path = reg.blob_file(layer_digest)
    size = os.path.getsize(path)
    with open(path, "r+b") as f:
        f.write(os.urandom(size))
    with pytest.raises(dsec.DSecError) as e:
        client.pull_image("i3-badblob:v1", f"{reg.host}/team/bad:v1", username="alice", password="s3cret")
    assert "failed verification" in str(e.value), e.value
    tmp = os.path.join(node.data_dir, "edge", "images", "tmp")
    assert wait_until(lambda: not os.listdir(tmp), timeout=10), os.listdir(tmp)


# ---------------------------------------------------------------------------------------------
# fold through the API


def test_fold_via_api_keeps_the_tree(client):
    layers = [_tar([("d", None), ("d/a", b"1\n"), ("d/b", b"2\n"), ("top", b"0\n")]),
              _tar([("d", None), ("d/.wh.a", b""), ("d/c", b"3\n")]),
              _tar([(".wh.top", b""), ("n", b"4\n")])]
    client.import_image("i3-fold:v1", docker_archive(layers), format="docker-archive")
    folded = client.fold_image("i3-fold:v1", max_layer_bytes=10 << 20, into="i3-fold:folded")
    assert len(folded.layers) == 1, folded
    assert folded.parent == "i3-fold:v1"
    script = "ls /d; cat /d/b /d/c /n; test -e /top && echo top || echo no-top"
    outs = []
    for name in ("i3-fold:v1", "i3-fold:folded"):
        sb = make_sandbox(client, "busybox", workspace=name)
        try:
            outs.append(sh(sb, script))
        finally:
            stop_quietly(sb)
    assert outs[0] == outs[1] == "b\nc\n2\n3\n4\nno-top\n", outs


# ---------------------------------------------------------------------------------------------
# a workspace whiteout hides a base file; pack_diff keeps xattrs (read through the sandbox root)


def test_workspace_whiteout_hides_base_file(client):
    client.import_image("i3-ws-del:v1", _tar([("etc", None), ("etc/.wh.hostname", b""), ("etc/ws", b"w\n")]))
    sb = make_sandbox(client, "busybox", workspace="i3-ws-del:v1")
    try:
        assert sh(sb, "test -e /etc/hostname && echo present || echo absent") == "absent\n"
        assert sh(sb, "cat /etc/ws; test -e /etc/hosts && echo hosts") == "w\nhosts\n"
    finally:
        stop_quietly(sb)
    plain = make_sandbox(client, "busybox")
    try:
        assert sh(plain, "test -e /etc/hostname && echo present") == "present\n"
    finally:
        stop_quietly(plain)


def _sandbox_pid(sb_id: str) -> int:
    from helpers import dsec_processes
    procs = dsec_processes(sb_id)
    assert procs, f"no process of sandbox {sb_id}"
    return min(procs)


def test_pack_diff_keeps_xattrs(client, node):
    src = make_sandbox(client, "busybox")
    try:
        sh(src, "mkdir -p /data && echo payload > /data/file && mkdir /data/dir")
        upper = os.path.join(node.sandbox_dir(src.id), "upper")
        os.setxattr(os.path.join(upper, "data", "file"), "user.note", b"kept")
        os.setxattr(os.path.join(upper, "data", "dir"), "user.dirnote", b"d")
        src.pack_diff("i3-xattr:v1")
    finally:
        stop_quietly(src)
    info = next(i for i in client.list_images() if i.name == "i3-xattr:v1")
    diff_mnt = os.path.join(node.data_dir, "edge", "images", "mnt", info.layers[-1]["digest"])
    new = make_sandbox(client, "i3-xattr:v1")
    try:
        # In the diff layer itself...
        assert os.getxattr(os.path.join(diff_mnt, "data", "file"), "user.note") == b"kept"
        # ...and in the new sandbox's root, as its processes see it.
        root = f"/proc/{_sandbox_pid(new.id)}/root"
        assert os.getxattr(f"{root}/data/file", "user.note") == b"kept"
        assert os.getxattr(f"{root}/data/dir", "user.dirnote") == b"d"
        assert sh(new, "cat /data/file") == "payload\n"
    finally:
        stop_quietly(new)


# ---------------------------------------------------------------------------------------------
# node-level sharing: concurrent creates needing the same cold layer -> one fetch, one mount


def _edge_metrics(client) -> Dict[str, float]:
    import httpx
    url = client.list_nodes()[0]["url"]
    text = httpx.get(f"{url}/metrics", timeout=10).text
    out = {}
    for line in text.splitlines():
        if line.startswith("dsec_edge_image_"):
            k, v = line.rsplit(" ", 1)
            out[k] = float(v)
    return out


def test_concurrent_creates_fetch_and_mount_a_cold_layer_once(client, node):
    import concurrent.futures
    info = client.import_image("i3-cold:v1", _tar([("cold", None), ("cold/data", os.urandom(400_000))]))
    digest = info.layers[-1]["digest"]
    # As on a node that never used this layer: the metadata image is only in the blob store.
    os.unlink(os.path.join(node.data_dir, "edge", "images", "layers", f"{digest}.erofs"))
    # Keep the busybox base mounted, so the only cold layer is the workspace's.
    warm = make_sandbox(client, "busybox")
    before = _edge_metrics(client)
    n = 8
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        sbs = list(pool.map(lambda _: make_sandbox(client, "busybox", workspace="i3-cold:v1"), range(n)))
    try:
        after = _edge_metrics(client)
        with open("/proc/self/mountinfo") as f:
            mounts = [l for l in f if f"/mnt/{digest} " in l and " erofs " in l]
        assert len(mounts) == 1, mounts
        assert after["dsec_edge_image_meta_fetches_total"] - before["dsec_edge_image_meta_fetches_total"] == 1
        assert after["dsec_edge_image_layer_mounts_total"] - before["dsec_edge_image_layer_mounts_total"] == 1
        users = next(i for i in client.list_images() if i.name == "i3-cold:v1").layers[-1]["users"]
        assert users == n
        for sb in sbs[:2]:
            assert sh(sb, "busybox wc -c < /cold/data").strip() == "400000"
        # GC: a layer in use cannot be removed.
        with pytest.raises(dsec.DSecError) as e:
            client.remove_image("i3-cold:v1")
        assert "stop them first" in str(e.value), e.value
    finally:
        for sb in sbs + [warm]:
            stop_quietly(sb)
    # Unreferenced: removed, with its layer files and blobs.
    client.remove_image("i3-cold:v1")
    assert not any(i.name == "i3-cold:v1" for i in client.list_images())
    blobs = os.path.join(node.data_dir, "edge", "images", "blobs")
    assert not any(f.startswith(digest) for f in os.listdir(blobs))
