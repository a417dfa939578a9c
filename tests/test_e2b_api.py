"""E2B-compatible control plane (issue 19, REST part) driven by the REAL e2b Python SDK (pinned in
scripts/install-deps.sh), pointed at the suite's `dsec up` with only environment variables:
E2B_API_URL = E2B_SANDBOX_URL = http://127.0.0.1:PORT/e2b and E2B_API_KEY = a dsec key.

Every sandbox made through E2B must be an ordinary dsec sandbox: in `dsec ps`, in quotas, with
its trajectory. What a call does inside a sandbox (commands, files) is checked here with dsec's
own SDK on the same id; the envd (in-sandbox) API has its own tests.

The `base` template is the image of scripts/images/build-e2b-base.sh, imported once and aliased
`base`; the module skips when that tarball or the e2b package is absent.
"""

from __future__ import annotations

import asyncio
import http.client
import os
import time
import urllib.parse
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from helpers import sh, wait_until

e2b = pytest.importorskip("e2b", reason="the e2b SDK is not installed (scripts/install-deps.sh pins it)")

from e2b import AsyncSandbox, Sandbox, SandboxQuery  # noqa: E402
from e2b.exceptions import (  # noqa: E402
    AuthenticationException,
    NotFoundException,
    RateLimitException,
    SandboxException,
    SandboxNotFoundException,
)

DOMAIN = "sbx.dsec.test"  # MAIN_NODE_CONFIG in conftest.py


def base_tar() -> Path:
    return Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "e2b-base-bookworm.tar"


@pytest.fixture(scope="module")
def e2b_env(node, client):
    """The three variables the SDK needs, and the `base` template on the node."""
    tar = base_tar()
    if not tar.is_file():
        pytest.skip(f"{tar} is absent (build it with scripts/images/build-e2b-base.sh)")
    names = {i.name for i in client.list_images()}
    if "e2b-base:latest" not in names:
        node.cli("image", "import", "e2b-base", "--tar", str(tar), timeout=900)
    out = node.cli("image", "alias", "base", "e2b-base").stdout.decode()
    assert out.strip() == "base:latest", out
    saved = {k: os.environ.get(k) for k in ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY", "E2B_DOMAIN", "E2B_DEBUG")}
    os.environ["E2B_API_URL"] = f"{node.url}/e2b"
    os.environ["E2B_SANDBOX_URL"] = f"{node.url}/e2b"
    os.environ["E2B_API_KEY"] = node.key
    os.environ.pop("E2B_DEBUG", None)
    yield node
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def _kill_quietly(sbx) -> None:
    try:
        sbx.kill()
    except Exception:
        pass


def test_create_info_list_timeout_kill(e2b_env, client):
    tag = _tag()
    sbx = Sandbox.create("base", metadata={"suite": tag, "role": "a"}, timeout=120, allow_internet_access=False)
    other = Sandbox.create("base", metadata={"suite": tag, "role": "b"}, timeout=120, allow_internet_access=False)
    try:
        # An ordinary dsec sandbox: listed by dsec, with the metadata as labels, running the image.
        native = client.get_sandbox(sbx.sandbox_id)
        assert native.state == "running"
        assert native.labels["suite"] == tag and native.labels["dsec.e2b.template"] == "base"
        assert native.ttl_running_stop == 120
        ps = e2b_env.cli("ps").stdout.decode()
        assert sbx.sandbox_id in ps, ps
        # The SDK sends the envd token it was given on every sandbox call.
        assert sbx._envd_access_token and len(sbx._envd_access_token) == 64

        info = sbx.get_info()
        assert info.sandbox_id == sbx.sandbox_id
        assert info.template_id == "base"
        assert info.metadata == {"suite": tag, "role": "a"}
        assert info.state.value == "running"
        assert info.cpu_count >= 1 and info.memory_mb == native.memory_limit_mb

        found = Sandbox.list(query=SandboxQuery(metadata={"suite": tag, "role": "a"})).next_items()
        assert [s.sandbox_id for s in found] == [sbx.sandbox_id]
        both = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert {s.sandbox_id for s in both} == {sbx.sandbox_id, other.sandbox_id}

        # Pagination: one per page, every sandbox exactly once.
        pager = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), limit=1)
        seen = []
        while pager.has_next:
            seen += [s.sandbox_id for s in pager.next_items()]
        assert sorted(seen) == sorted([sbx.sandbox_id, other.sandbox_id])

        # timeout -> the idle TTL, changed in place.
        before = time.time()
        sbx.set_timeout(600)
        assert client.get_sandbox(sbx.sandbox_id).ttl_running_stop == 600
        end = sbx.get_info().end_at.timestamp()
        assert before + 590 <= end <= time.time() + 610, (before, end)

        assert sbx.kill() is True
        with pytest.raises(SandboxNotFoundException):
            Sandbox.get_info(sbx.sandbox_id)
        assert Sandbox.kill(sbx.sandbox_id) is False
        left = Sandbox.list(query=SandboxQuery(metadata={"suite": tag})).next_items()
        assert [s.sandbox_id for s in left] == [other.sandbox_id]
        # The stop went through dsec: its end reason and trajectory are there.
        ended = {s.id: s for s in client.list_sandboxes(ended=True)}
        assert ended[sbx.sandbox_id].end_reason == "stopped_by_user"
    finally:
        _kill_quietly(sbx)
        _kill_quietly(other)


def test_async_create_info_kill(e2b_env):
    async def run():
        sbx = await AsyncSandbox.create("base", metadata={"suite": _tag()}, allow_internet_access=False)
        try:
            info = await sbx.get_info()
            assert info.sandbox_id == sbx.sandbox_id and info.state.value == "running"
            assert info.template_id == "base"
        finally:
            assert await sbx.kill() is True
        with pytest.raises(SandboxNotFoundException):
            await AsyncSandbox.get_info(sbx.sandbox_id)

    asyncio.run(run())


def test_pause_then_connect_keeps_files_and_processes(e2b_env, client):
    sbx = Sandbox.create("base", timeout=300, allow_internet_access=False)
    try:
        native = client.attach(sbx.sandbox_id)
        sh(native, "echo kept > /tmp/state.txt && (nohup sleep 1000 >/dev/null 2>&1 &) && sleep 0.2")
        pid = sh(native, "pgrep -x sleep | head -1").strip()
        assert pid

        assert sbx.pause() is True
        assert sbx.get_info().state.value == "paused"
        assert client.get_sandbox(sbx.sandbox_id).state == "paused"
        assert sbx.pause() is False  # already paused: the SDK's 409

        again = Sandbox.connect(sbx.sandbox_id, timeout=200)
        assert again.sandbox_id == sbx.sandbox_id
        assert client.get_sandbox(sbx.sandbox_id).state == "running"
        assert again.get_info().state.value == "running"
        assert client.get_sandbox(sbx.sandbox_id).ttl_running_stop == 200
        assert sh(native, "cat /tmp/state.txt") == "kept\n"
        assert sh(native, f"kill -0 {pid} && echo alive") == "alive\n"
        # Connecting to a running sandbox is fine too.
        assert Sandbox.connect(sbx.sandbox_id).sandbox_id == sbx.sandbox_id
    finally:
        _kill_quietly(sbx)


def test_metrics(e2b_env):
    sbx = Sandbox.create("base", allow_internet_access=False)
    try:
        got = []
        assert wait_until(lambda: bool(got.extend(sbx.get_metrics()) or got), timeout=30, interval=1), "no metrics"
        m = got[-1]
        assert m.cpu_count >= 1 and m.mem_total > 0 and m.mem_used > 0
        assert abs(m.timestamp.timestamp() - time.time()) < 120
    finally:
        _kill_quietly(sbx)


def test_snapshot_and_fork(e2b_env, client):
    sbx = Sandbox.create("base", allow_internet_access=False)
    kids = []
    try:
        native = client.attach(sbx.sandbox_id)
        sh(native, "echo from-parent > /root/marker")
        snap = sbx.create_snapshot()
        assert snap.snapshot_id.startswith("snapshot/")
        listed = [s.snapshot_id for s in Sandbox.list_snapshots(sandbox_id=sbx.sandbox_id).next_items()]
        assert snap.snapshot_id in listed
        from_snap = Sandbox.create(snap.snapshot_id, allow_internet_access=False)
        kids.append(from_snap)
        assert sh(client.attach(from_snap.sandbox_id), "cat /root/marker") == "from-parent\n"

        forks = sbx.fork(count=2, timeout=90)
        assert len(forks) == 2 and all(isinstance(f, Sandbox) for f in forks), forks
        kids += forks
        for f in forks:
            assert f.sandbox_id != sbx.sandbox_id
            assert sh(client.attach(f.sandbox_id), "cat /root/marker") == "from-parent\n"
            assert client.get_sandbox(f.sandbox_id).labels["dsec.fork_of"] == sbx.sandbox_id
            assert client.get_sandbox(f.sandbox_id).ttl_running_stop == 90
    finally:
        for k in kids:
            _kill_quietly(k)
        _kill_quietly(sbx)


def test_get_host_reaches_a_server_inside(e2b_env, client):
    sbx = Sandbox.create("base", allow_internet_access=False)
    try:
        native = client.attach(sbx.sandbox_id)
        sh(native, "mkdir -p /srv && echo hello-e2b > /srv/index.txt && "
                   "cd /srv && (nohup python -m http.server 8000 >/tmp/http.log 2>&1 &)")
        host = sbx.get_host(8000)
        assert host == f"8000-{sbx.sandbox_id}.{DOMAIN}"
        u = urllib.parse.urlsplit(e2b_env.url)

        def fetch():
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            try:
                c.request("GET", "/index.txt", headers={"Host": host})
                r = c.getresponse()
                return r.status, r.read()
            finally:
                c.close()

        assert wait_until(lambda: fetch()[0] == 200, timeout=20, interval=0.3), fetch()
        # No dsec key on the request: E2B sandboxes' ports are public by default ...
        assert fetch() == (200, b"hello-e2b\n")
        # ... and the same through the E2b-Sandbox-Port header on the API URL.
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
        c.request("GET", "/e2b/index.txt", headers={"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "8000"})
        r = c.getresponse()
        assert (r.status, r.read()) == (200, b"hello-e2b\n")
        c.close()
    finally:
        _kill_quietly(sbx)


def test_private_traffic_needs_the_token(e2b_env, client):
    sbx = Sandbox.create("base", allow_internet_access=False, network={"allow_public_traffic": False})
    try:
        native = client.attach(sbx.sandbox_id)
        sh(native, "cd /tmp && echo private > p.txt && (nohup python -m http.server 8001 >/dev/null 2>&1 &)")
        u = urllib.parse.urlsplit(e2b_env.url)
        host = sbx.get_host(8001)

        def fetch(headers):
            c = http.client.HTTPConnection(u.hostname, u.port, timeout=10)
            try:
                c.request("GET", "/p.txt", headers={"Host": host, **headers})
                r = c.getresponse()
                return r.status, r.read()
            finally:
                c.close()

        token = sbx.traffic_access_token
        assert token
        assert wait_until(lambda: fetch({"e2b-traffic-access-token": token})[0] == 200, timeout=20, interval=0.3)
        assert fetch({"e2b-traffic-access-token": token}) == (200, b"private\n")
        assert fetch({})[0] in (401, 403, 404), fetch({})
        assert fetch({"e2b-traffic-access-token": "0" * 64})[0] in (401, 403, 404)
    finally:
        _kill_quietly(sbx)


def test_errors_are_the_sdks_exceptions_with_dsecs_message(e2b_env, node):
    with pytest.raises(AuthenticationException) as ei:
        Sandbox.create("base", api_key="dsk_" + "0" * 32)
    assert "E2B_API_KEY" in str(ei.value) and "dsec API key" in str(ei.value)

    unknown = f"sb-{node.node_id}-0000000000000000"
    with pytest.raises(SandboxNotFoundException):
        Sandbox.get_info(unknown)
    with pytest.raises(NotFoundException):
        Sandbox.connect(unknown)
    assert Sandbox.kill(unknown) is False

    with pytest.raises(SandboxException) as ei:
        Sandbox.create("no-such-template-" + _tag())
    assert "404" in str(ei.value) and "not found" in str(ei.value).lower()

    with pytest.raises(SandboxException) as ei:
        Sandbox.create("base", mcp={"x": {}})
    assert "mcp is not supported" in str(ei.value)

    # A call dsec does not implement answers a clear error, not a hang or a 404 page.
    st, raw = _raw(node, "POST", "/e2b/volumes", {"name": "v"})
    assert st == 501 and b"volumes" in raw and b"not supported" in raw, raw
    st, raw = _raw(node, "GET", "/e2b/secrets", None)
    assert st == 501 and b"not supported" in raw, raw
    st, raw = _raw(node, "GET", "/e2b/no/such/thing", None)
    assert st == 404 and b'"code":404' in raw, raw


def _raw(node, method, path, body):
    import json

    u = urllib.parse.urlsplit(node.url)
    c = http.client.HTTPConnection(u.hostname, u.port, timeout=30)
    try:
        data = None if body is None else json.dumps(body).encode()
        c.request(method, path, body=data, headers={"X-API-Key": node.key, "Content-Type": "application/json"})
        r = c.getresponse()
        return r.status, r.read()
    finally:
        c.close()


def test_templates_are_dsec_images(e2b_env):
    st, raw = _raw(e2b_env, "GET", "/e2b/templates", None)
    assert st == 200, raw
    import json

    templates = {t["templateID"]: t for t in json.loads(raw)}
    assert "e2b-base:latest" in templates and "base:latest" in templates["e2b-base:latest"]["aliases"]
    st, raw = _raw(e2b_env, "GET", "/e2b/templates/aliases/base", None)
    assert st == 200 and json.loads(raw)["templateID"] == "e2b-base:latest", raw


def test_64_parallel_creates_none_lost_and_quota_counted(e2b_env, node, client):
    tag = _tag()
    project = f"e2b{tag[:6]}"
    node.cli("project", "create", project, "--max-sandboxes", "64")
    key = node.cli("key", "create", f"e2b-{tag}", "--project", project, "--quiet").stdout.decode().strip()

    def make(i):
        return Sandbox.create("base", api_key=key, metadata={"suite": tag, "i": str(i)},
                              allow_internet_access=False, timeout=300)

    made = []
    try:
        with ThreadPoolExecutor(16) as pool:
            made = list(pool.map(make, range(64)))
        ids = {s.sandbox_id for s in made}
        assert len(ids) == 64
        listed = Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), api_key=key, limit=100).next_items()
        assert {s.sandbox_id for s in listed} == ids
        native = {s.id for s in client.list_sandboxes() if s.labels.get("suite") == tag}
        assert native == ids
        assert all(client.get_sandbox(i).labels["dsec.project"] == project for i in list(ids)[:4])
        # The project's quota counts them: the 65th is refused with dsec's message.
        with pytest.raises(RateLimitException) as ei:
            make(64)
        assert "quota" in str(ei.value).lower(), str(ei.value)

        with ThreadPoolExecutor(16) as pool:
            killed = list(pool.map(lambda s: s.kill(), made))
        assert all(killed)
        assert not Sandbox.list(query=SandboxQuery(metadata={"suite": tag}), api_key=key).next_items()
        assert not [s for s in client.list_sandboxes() if s.labels.get("suite") == tag]
    finally:
        for s in made:
            _kill_quietly(s)


def test_javascript_sdk_control_plane(e2b_env, client):
    import json
    import shutil
    import subprocess

    js = Path(__file__).parent / "e2b_js"
    node_bin = shutil.which("node")
    if node_bin is None or not (js / "node_modules" / "e2b").is_dir():
        pytest.skip("node or tests/e2b_js/node_modules is absent (scripts/install-deps.sh runs npm ci there)")
    tag = _tag()
    p = subprocess.run([node_bin, "control_plane.mjs", tag], cwd=js, capture_output=True, timeout=120, env=dict(os.environ))
    assert p.returncode == 0, p.stderr.decode()[-3000:]
    out = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert out["state"] == "running" and out["templateId"] == "base", out
    assert out["metadata"] == {"suite": tag} and out["listed"] == [out["id"]], out
    assert out["killed"] is True and "NotFound" in out["afterKill"], out
    assert not [s for s in client.list_sandboxes() if s.labels.get("suite") == tag]
