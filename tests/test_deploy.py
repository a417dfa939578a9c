"""Deployment files (deploy/): the Kubernetes manifests pass yamllint and kubernetes-validate
(strict, against a pinned Kubernetes version), the systemd units pass `systemd-analyze verify`,
and the example config files parse. The tools come from scripts/install-deps.sh; a test whose
tool is absent skips with the reason."""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

import pytest

from helpers import find_dsec_bin, free_port

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
KUBERNETES_VERSION = "1.37.0"
MANIFESTS = sorted(str(p) for p in (DEPLOY / "kubernetes").glob("*.yaml") if p.name != "kustomization.yaml")
UNITS = sorted((DEPLOY / "systemd").glob("*.service"))


def tool(name: str) -> str:
    path = shutil.which(name) or shutil.which(name, path=os.path.dirname(sys.executable))
    if path is None:
        pytest.skip(f"{name} is not installed (scripts/install-deps.sh installs it)")
    return path


def run(argv, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, **kw)


def test_manifests_pass_yamllint():
    assert MANIFESTS, "no manifests in deploy/kubernetes"
    files = MANIFESTS + [str(DEPLOY / "kubernetes" / "kustomization.yaml"), str(DEPLOY / ".yamllint.yaml")]
    r = run([tool("yamllint"), "-s", "-c", str(DEPLOY / ".yamllint.yaml"), *files])
    assert r.returncode == 0, r.stdout + r.stderr


def test_manifests_are_valid_kubernetes_objects():
    kv = tool("kubernetes-validate")
    r = run([kv, "--strict", "-k", KUBERNETES_VERSION, *MANIFESTS])
    assert r.returncode == 0, r.stdout + r.stderr
    out = r.stdout + r.stderr
    for kind in ("deployment/dsec-apiserver", "service/dsec-apiserver", "daemonset/dsec-edge",
                 "statefulset/dsec-postgres", "configmap/dsec-apiserver-config", "configmap/dsec-edge-config"):
        assert f"{kind} against version" in out, f"{kind} not validated:\n{out}"
    # the check can fail: a misspelt field is refused
    with tempfile.NamedTemporaryFile("w", suffix=".yaml") as f:
        f.write(open(DEPLOY / "kubernetes" / "namespace.yaml").read().replace("labels:", "lables:", 1))
        f.flush()
        assert run([kv, "--strict", "-k", KUBERNETES_VERSION, f.name]).returncode != 0


def test_edge_daemonset_keeps_sandboxes_across_pod_restarts():
    """What re-adoption needs: host PID namespace, the host's cgroups and data dir, SIGKILL as
    the stop signal (a replaced pod acts like a crashed edge)."""
    yaml = pytest.importorskip("yaml")
    docs = list(yaml.safe_load_all(open(DEPLOY / "kubernetes" / "edge.yaml")))
    ds = next(d for d in docs if d and d["kind"] == "DaemonSet")
    spec = ds["spec"]["template"]["spec"]
    assert spec["hostPID"] and spec["hostNetwork"]
    edge = next(c for c in spec["containers"] if c["name"] == "edge")
    assert edge["securityContext"]["privileged"]
    assert edge["lifecycle"]["stopSignal"] == "SIGKILL"
    mounts = {m["mountPath"]: m for m in edge["volumeMounts"]}
    assert mounts["/var/lib/dsec"]["mountPropagation"] == "Bidirectional"
    assert "/sys/fs/cgroup" in mounts and "/dev" in mounts


def test_systemd_units_verify():
    analyze = tool("systemd-analyze")
    dsec = find_dsec_bin()
    if dsec is None:
        pytest.skip("no dsec binary to point the units at (cargo build --release -p dsec)")
    with tempfile.TemporaryDirectory() as d:
        for u in UNITS:
            Path(d, u.name).write_text(u.read_text().replace("/usr/local/bin/dsec", dsec))
        units = sorted(glob.glob(os.path.join(d, "*.service")))
        r = run([analyze, "verify", *units])
        # verify warns about unknown keys without failing: any message is a defect
        assert r.returncode == 0 and not (r.stdout + r.stderr).strip(), r.stdout + r.stderr
        bad = Path(d, "dsec-edge.service")
        bad.write_text(bad.read_text().replace("KillMode=process", "KillMode=process\nKilMode=x"))
        r = run([analyze, "verify", str(bad)])
        assert "KilMode" in r.stdout + r.stderr, "systemd-analyze did not notice a bad key"
    edge = (DEPLOY / "systemd" / "dsec-edge.service").read_text()
    # sandboxes' agents must outlive the edge's process (re-adoption after a restart)
    assert "\nKillMode=process\n" in edge and "\nRestart=always\n" in edge


def test_example_configs_parse():
    for p in (DEPLOY / "systemd").glob("*.toml"):
        tomllib.loads(p.read_text())


def test_example_apiserver_config_is_accepted(tmp_path):
    """`dsec apiserver --config deploy/systemd/apiserver.toml` starts (database and listen
    address overridden: the example names a PostgreSQL host and edges that do not exist here)."""
    dsec = find_dsec_bin()
    if dsec is None:
        pytest.skip("no dsec binary (cargo build --release -p dsec)")
    argv = [dsec, "apiserver", "--config", str(DEPLOY / "systemd" / "apiserver.toml"),
            "--db", f"sqlite://{tmp_path}/iam.db", "--listen", f"127.0.0.1:{free_port()}"]
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = ""
        for _ in range(20):
            line = p.stdout.readline()
            if line.startswith("DSEC_API_URL=") or not line:
                break
        assert line.startswith("DSEC_API_URL="), f"did not start: {line!r} {p.stderr.read() if p.poll() is not None else ''}"
        assert (tmp_path / "env").is_file()
    finally:
        p.terminate()
        p.wait(timeout=30)
