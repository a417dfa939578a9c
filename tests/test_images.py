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
from helpers import DsecUp, make_sandbox, mounts_under, new_data_dir, remove_data_dir, sh, stop_quietly


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
