"""The SDK example of DESIGN.md §2, verbatim apart from the image, plus the sync client."""

from __future__ import annotations

import asyncio

import pytest

from dsec import DSecClient, DSecContainerRunArgs
import dsec.sync


@pytest.fixture
def api_env(node, monkeypatch):
    monkeypatch.setenv("DSEC_API_URL", node.url)
    monkeypatch.setenv("DSEC_API_KEY", node.key)


def test_design_example(api_env, debian):
    async def main():
        client = DSecClient()
        await client.open()
        args = DSecContainerRunArgs(container_image="debian",
            memory_limit_mb=4096, cpu_cores_limit=4, ttl_running_stop=300,
            network_rules={"npm": False, "pypi": True}, init_user="root")
        sandbox = await client.run_container(args, timeout=120)
        result = await sandbox.run_shell("echo hello world")
        await sandbox.stop()
        await client.close()
        return sandbox, result

    sandbox, result = asyncio.run(main())
    assert result.stdout == "hello world\n"
    assert result.exit_code == 0
    assert sandbox.info.state == "stopped"


def test_design_example_stored_settings(api_env, debian):
    async def main():
        async with DSecClient() as client:
            args = DSecContainerRunArgs(container_image="debian", memory_limit_mb=512, ttl_running_stop=300,
                                        network_rules={"npm": False, "pypi": True}, labels={"job": "e2e"})
            async with await client.run_container(args, timeout=120) as sandbox:
                info = await client.get_sandbox(sandbox.id)
                listed = [s.id for s in await client.list_sandboxes()]
                attached = await client.attach(sandbox.id)
                r = await attached.run_shell("cat /etc/debian_version")
            return sandbox, info, listed, r

    sandbox, info, listed, r = asyncio.run(main())
    assert info.image.startswith("debian")
    assert info.memory_limit_mb == 512
    assert info.ttl_running_stop == 300
    assert info.network_rules == {"npm": False, "pypi": True}
    # `dsec.`-prefixed labels are the platform's own (project, quota reservation), shown but
    # reserved; the caller's labels come back exactly.
    user_labels = {k: v for k, v in info.labels.items() if not k.startswith("dsec.")}
    assert user_labels == {"job": "e2e"}, info.labels
    assert sandbox.id in listed
    assert r.exit_code == 0 and r.stdout.strip().startswith("12")
    assert sandbox.info.state == "stopped"


def test_sync_client(api_env):
    with dsec.sync.DSecClient() as client:
        with client.run_container(DSecContainerRunArgs(container_image="busybox"), timeout=120) as sandbox:
            result = sandbox.run_shell("echo hello world")
            assert result.stdout == "hello world\n"
            sandbox.write_file("/tmp/x", b"\x00sync")
            assert sandbox.read_file("/tmp/x") == b"\x00sync"
            assert [e.type for e in sandbox.stream_shell("echo a")][-1] == "exit"
            assert "busybox" in " ".join(i.name for i in client.list_images())
        assert sandbox.info.state == "stopped"


def test_reserved_label_prefix_cannot_be_forged(client):
    sb = client.run_container(DSecContainerRunArgs(
        container_image="busybox", labels={"dsec.project": "someone-else", "job": "x"}))
    try:
        labels = sb.info.labels
        assert labels["job"] == "x"
        assert labels["dsec.project"] != "someone-else", labels
    finally:
        sb.stop()
