"""Pulling from an OCI registry served over HTTPS (Debian's docker-registry behind TLS on
loopback) with a certificate authority the test generates: trusted through `--ca-file` (CLI)
or the edge's `registry_ca_file` the pull works and the image runs; without the CA the pull is
refused with a message saying the certificate is not trusted and how to pass a CA."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import pytest

import dsec
from helpers import DsecUp, make_sandbox, new_data_dir, remove_data_dir, sh, stop_quietly
from test_images import LAYER1, LAYER2, Pusher, Registry, _tar


def _openssl(*args: str, cwd: str) -> None:
    p = subprocess.run(["openssl", *args], cwd=cwd, capture_output=True, timeout=60)
    assert p.returncode == 0, f"openssl {' '.join(args)}: {p.stderr.decode(errors='replace')}"


def make_ca_and_server_cert(d: str) -> tuple[str, str, str]:
    """A test CA and a server certificate it signed for 127.0.0.1 and registry.dsec.test.
    Returns (ca.pem, server.pem, server.key)."""
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", "/CN=dsec test CA",
             "-keyout", "ca.key", "-out", "ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
             cwd=d)
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=registry.dsec.test",
             "-keyout", "server.key", "-out", "server.csr", cwd=d)
    with open(os.path.join(d, "server.ext"), "w") as f:
        f.write("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                "extendedKeyUsage=serverAuth\nsubjectAltName=IP:127.0.0.1,DNS:registry.dsec.test\n")
    _openssl("x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
             "-days", "2", "-extfile", "server.ext", "-out", "server.pem", cwd=d)
    return tuple(os.path.join(d, n) for n in ("ca.pem", "server.pem", "server.key"))  # type: ignore[return-value]


@pytest.fixture(scope="module")
def tls_registry():
    for tool in ("docker-registry", "openssl"):
        if shutil.which(tool) is None:
            pytest.skip(f"{tool} missing (apt-get install docker-registry openssl)")
    tmp = tempfile.mkdtemp(prefix="dsec-registry-tls-", dir="/var/tmp")
    ca, cert, key = make_ca_and_server_cert(tmp)
    try:
        reg = Registry(None, tmp, tls=(cert, key))
    except RuntimeError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        pytest.skip(str(e))
    try:
        # The test pushes over TLS too, trusting only the test CA.
        import ssl
        p = Pusher(reg.host, scheme="https", verify=ssl.create_default_context(cafile=ca))
        digest, _ = p.image("team/tls", "v1", [_tar(LAYER1), _tar(LAYER2)])
        yield reg, ca, digest
    finally:
        reg.stop()
        shutil.rmtree(tmp, ignore_errors=True)


def test_pull_over_https_with_the_ca_file_runs(node, client, tls_registry):
    reg, ca, digest = tls_registry
    ref = f"https://{reg.host}/team/tls:v1"
    p = node.cli("image", "pull", ref, "--ca-file", ca, "--name", "tls-pulled:v1", timeout=300)
    assert b"pulled tls-pulled:v1: 2 layer(s)" in p.stderr, p.stderr
    info = next(i for i in client.list_images() if i.name == "tls-pulled:v1")
    assert info.source == f"registry {reg.host}/team/tls@{digest}", info.source
    sb = make_sandbox(client, "busybox", workspace="tls-pulled:v1")
    try:
        assert sh(sb, "ls /d") == "new\n"
        assert sh(sb, "cat /keep") == "k\n"
    finally:
        stop_quietly(sb)
        client.remove_image("tls-pulled:v1")


def test_pull_over_https_without_the_ca_is_refused_clearly(node, client, tls_registry):
    reg, _, _ = tls_registry
    ref = f"https://{reg.host}/team/tls:v1"
    p = node.cli("image", "pull", ref, "--name", "tls-untrusted:v1", check=False, timeout=120)
    err = p.stderr.decode(errors="replace")
    assert p.returncode != 0, err
    assert "not trusted" in err and "--ca-file" in err, err
    # Through the API the same refusal is a client error (4xx), not a server fault.
    with pytest.raises(dsec.DSecError) as e:
        client.pull_image("tls-untrusted:v1", ref)
    assert 400 <= e.value.status < 500, e.value
    assert "not trusted" in str(e.value), e.value
    assert "tls-untrusted:v1" not in [i.name for i in client.list_images()]


def test_ca_file_that_is_not_a_certificate_is_a_usage_error(node, tls_registry, tmp_path):
    reg, _, _ = tls_registry
    bad = tmp_path / "not-a-ca.pem"
    bad.write_text("hello\n")
    p = node.cli("image", "pull", f"https://{reg.host}/team/tls:v1", "--ca-file", str(bad), check=False)
    assert p.returncode == 2, p
    assert b"--ca-file" in p.stderr and b"BEGIN CERTIFICATE" in p.stderr, p.stderr


def test_edge_registry_ca_file_trusts_the_registry(dsec_bin, tls_registry):
    """`registry_ca_file` in the [edge] config: every pull of that node trusts the CA."""
    reg, ca, digest = tls_registry
    data = new_data_dir("tlsca")
    up = DsecUp(dsec_bin, data, f"tls{os.getpid() % 100000}", config=f'[edge]\nregistry_ca_file = "{ca}"\n')
    try:
        up.start()
        c = up.client()
        try:
            info = c.pull_image("tls-edge-ca:v1", f"https://{reg.host}/team/tls:v1")
            assert len(info.layers) == 2, info
            assert info.source == f"registry {reg.host}/team/tls@{digest}", info.source
        finally:
            c.close()
    finally:
        rc = up.stop()
        remove_data_dir(data)
    assert rc == 0, up.stderr_tail()


def test_edge_registry_ca_file_that_is_not_a_certificate_stops_up(dsec_bin, tmp_path):
    bad = tmp_path / "bad-ca.pem"
    bad.write_text("hello\n")
    cfg = tmp_path / "dsec.toml"
    cfg.write_text(f'[edge]\nregistry_ca_file = "{bad}"\n')
    data = new_data_dir("tlsbad")
    try:
        p = subprocess.run([dsec_bin, "up", "--data-dir", data, "--listen", "127.0.0.1:0",
                            "--node-id", "tlsbad", "--config", str(cfg)], capture_output=True, timeout=60)
    finally:
        remove_data_dir(data)
    assert p.returncode != 0
    assert b"registry_ca_file" in p.stderr, p.stderr
