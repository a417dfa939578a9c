"""`dsec up --config` refuses a bad `[edge.microvm]` / `[edge.vm]` value instead of falling back
to a default: it exits non-zero with a message naming the key, the value and what is allowed.
The same holds for the environment variables that override those keys.

These runs stop before any sandbox, mount or cgroup exists, so they need neither root nor the
VM artefacts; each uses its own data dir and port.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from helpers import find_dsec_bin, free_port, new_data_dir, remove_data_dir

UP_TIMEOUT = 60.0


@pytest.fixture(scope="module")
def dsec_binary():
    b = find_dsec_bin()
    if b is None:
        pytest.skip("dsec binary not built (cargo build --release -p dsec, or set DSEC_BIN)")
    return b


def run_up(binary: str, config: str | None, env: dict | None = None) -> subprocess.CompletedProcess:
    """Runs `dsec up` with `config` as its file; returns the finished process (a run that is
    still up after the timeout is ended and fails the test)."""
    data_dir = new_data_dir("config")
    try:
        cmd = [binary, "up", "--data-dir", data_dir, "--listen", f"127.0.0.1:{free_port()}",
               "--node-id", "cfg"]
        if config is not None:
            path = os.path.join(data_dir, "dsec.toml")
            with open(path, "w") as f:
                f.write(config)
            cmd += ["--config", path]
        full_env = {k: v for k, v in os.environ.items() if not k.startswith(("DSEC_MICROVM_", "DSEC_VM_"))}
        full_env.update(env or {})
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=full_env)
        try:
            out, err = p.communicate(timeout=UP_TIMEOUT)
        except subprocess.TimeoutExpired:
            p.terminate()
            out, err = p.communicate(timeout=UP_TIMEOUT)
            pytest.fail(f"dsec up kept running with a bad config; stderr:\n{err.decode(errors='replace')[-2000:]}")
        return subprocess.CompletedProcess(cmd, p.returncode, out, err)
    finally:
        remove_data_dir(data_dir)


@pytest.mark.parametrize(
    "config,key,value,allowed",
    [
        ('[edge.microvm]\naccel = "kvmm"\n', "microvm.accel", '"kvmm"', '"kvm" or "tcg"'),
        ('[edge.microvm]\nmachine = "q35"\n', "microvm.machine", '"q35"', '"microvm" or "pc"'),
        ("[edge.microvm]\ndisk_mb = 4\n", "microvm.disk_mb", "4", "at least 16"),
        ('[edge.vm]\nmachine = "i440fx"\n', "vm.machine", '"i440fx"', '"q35" or "pc"'),
    ],
)
def test_bad_vm_config_stops_up(dsec_binary, config, key, value, allowed):
    p = run_up(dsec_binary, config)
    err = p.stderr.decode(errors="replace")
    assert p.returncode != 0, f"dsec up accepted {config!r}"
    assert key in err, f"the error does not name {key}:\n{err[-2000:]}"
    assert value in err and allowed in err, f"the error does not say the value and what is allowed:\n{err[-2000:]}"


@pytest.mark.parametrize(
    "env,key",
    [
        ({"DSEC_MICROVM_ACCEL": "kvmm"}, "microvm.accel"),
        ({"DSEC_MICROVM_DISK_MB": "lots"}, "microvm.disk_mb"),
    ],
)
def test_bad_env_override_stops_up(dsec_binary, env, key):
    p = run_up(dsec_binary, None, env)
    err = p.stderr.decode(errors="replace")
    assert p.returncode != 0, f"dsec up accepted {env}"
    assert key in err, f"the error does not name {key}:\n{err[-2000:]}"
    assert next(iter(env.values())) in err, err[-2000:]


def test_unknown_vm_key_stops_up(dsec_binary):
    p = run_up(dsec_binary, "[edge.microvm]\naccell = \"kvm\"\n")
    assert p.returncode != 0
    assert "accell" in p.stderr.decode(errors="replace")
