"""SandboxFusion-compatible /run_code (issue 20): SandboxFusion's own client package, unmodified
and given only the base URL `http://HOST:PORT/sandboxfusion/<API key>`, and raw HTTP posts the
way RL frameworks send them, against the real apiserver → edge → warm worker path.

Languages whose toolkit layer is absent on this machine (scripts/images/build-function-toolkits.sh
builds them into /var/cache/dsec/function-toolkits) are skipped with the reason."""

from __future__ import annotations

import asyncio
import base64
import socket
import threading

import httpx
import pytest
import requests

sandbox_fusion = pytest.importorskip(
    "sandbox_fusion", reason="the sandbox-fusion client package is not installed (scripts/install-deps.sh pins it)")
from sandbox_fusion import RunCodeRequest, RunStatus, run_code  # noqa: E402
from sandbox_fusion.models import CommandRunStatus  # noqa: E402


@pytest.fixture(scope="module")
def base(node, debian):
    return f"{node.url}/sandboxfusion/{node.key}"


def sf(base, language, code, **kw):
    """One call through the unmodified client (it raises on a non-200 answer)."""
    return run_code(RunCodeRequest(code=code, language=language, **kw), endpoint=base, max_attempts=1,
                    client_timeout=300)


def sf_or_skip(base, language, code, **kw):
    try:
        return sf(base, language, code, **kw)
    except Exception as e:  # the client raises a bare Exception with the answer's text
        if "needs the toolkit" in str(e):
            pytest.skip(f"{language}: toolkit absent on this machine: {e}")
        raise


def test_burst_of_1000_concurrent_calls_on_a_cold_pool(node, base):
    """1,000 python calls fired at once at a pool with no worker: every one answered 200 with
    its own output (none lost, none duplicated), some having queued (`queue_ms`), none refused."""
    def python_pools():
        r = httpx.get(f"{node.url}/v1/functions/pools", headers={"authorization": f"Bearer {node.key}"}, timeout=30)
        return [p for p in r.json()["pools"] if p["language"] == "python"]
    before = {tuple(p["toolkits"]): p for p in python_pools()}

    async def go():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=1100)) as h:
            async def one(i):
                return await h.post(base + "/run_code", json={"code": f"print({i} * 7)", "language": "python"})
            return await asyncio.gather(*[one(i) for i in range(1000)])

    answers = asyncio.run(go())
    assert [a.status_code for a in answers].count(200) == 1000, {a.status_code for a in answers}
    outs = []
    for i, a in enumerate(answers):
        body = a.json()
        assert body["status"] == "Success", body
        assert body["run_result"]["stdout"] == f"{i * 7}\n", (i, body)
        outs.append(body["run_result"]["stdout"])
    assert len(set(outs)) == 1000
    assert max(a.json()["queue_ms"] for a in answers) > 0
    after = [p for p in python_pools() if tuple(p["toolkits"]) not in before or not before[tuple(p["toolkits"])]["workers_created"]]
    if after:  # the pool was cold: it grew past one worker toward the demand
        assert max(p["workers_created"] for p in after) >= min(2, after[0]["max"]), after


def test_python_through_the_client(base):
    r = sf(base, "python", "print('hello')")
    assert r.status == RunStatus.Success and r.run_result.status == CommandRunStatus.Finished
    assert r.run_result.stdout == "hello\n" and r.run_result.return_code == 0
    assert r.compile_result is None and r.run_result.execution_time >= 0
    r = sf(base, "python", "import sys\nprint(sys.stdin.read()[::-1])", stdin="abc")
    assert r.run_result.stdout == "cba\n"
    r = sf(base, "python", "import time\ntime.sleep(30)", run_timeout=1)
    assert r.status == RunStatus.Failed and r.run_result.status == CommandRunStatus.TimeLimitExceeded, r
    r = sf(base, "python", "def f(:\n  pass")
    assert r.status == RunStatus.Failed and r.run_result.return_code != 0
    assert "SyntaxError" in r.run_result.stderr
    data = bytes(range(256))
    code = ("import os\nd = open('data/in.bin', 'rb').read()\nprint(len(d), open('/tmp/t.txt').read())\n"
            "os.makedirs('out', exist_ok=True)\nopen('out/r.bin', 'wb').write(d[::-1])")
    r = sf(base, "python", code,
           files={"data/in.bin": base64.b64encode(data).decode(), "/tmp/t.txt": base64.b64encode(b"abs").decode()},
           fetch_files=["out/r.bin", "missing.txt"])
    assert r.status == RunStatus.Success, r
    assert r.run_result.stdout == "256 abs\n"
    assert base64.b64decode(r.files["out/r.bin"]) == data[::-1]
    assert "missing.txt" not in r.files


def test_pytest_style_code(base):
    r = sf_or_skip(base, "pytest", "def test_ok():\n    assert 1 + 1 == 2\n")
    assert r.status == RunStatus.Success, r
    assert "1 passed" in r.run_result.stdout
    r = sf(base, "pytest", "def test_bad():\n    assert 1 == 2\n")
    assert r.status == RunStatus.Failed and "1 failed" in r.run_result.stdout, r


CPP_OK = "#include <iostream>\nint main(){int a,b;std::cin>>a>>b;std::cout<<a+b<<std::endl;}"


@pytest.mark.parametrize("language,code,stdin,out", [
    ("cpp", CPP_OK, "2 3", "5\n"),
    ("java", "public class Main { public static void main(String[] a) {"
             " java.util.Scanner s = new java.util.Scanner(System.in); System.out.println(s.nextInt() * 2); } }",
     "21", "42\n"),
    ("go", "package main\nimport \"fmt\"\nfunc main() { var a int; fmt.Scan(&a); fmt.Println(a + 1) }", "41", "42\n"),
    ("nodejs", "const l = require('fs').readFileSync(0, 'utf8'); console.log(Number(l) * 3)", "14", "42\n"),
    ("rust", "use std::io::Read;\nfn main() { let mut s = String::new(); std::io::stdin().read_to_string(&mut s).unwrap();"
             " let n: i32 = s.trim().parse().unwrap(); println!(\"{}\", n * 6); }", "7", "42\n"),
    ("bash", "read x; echo $((x * 2))", "21", "42\n"),
])
def test_languages_through_the_client(base, language, code, stdin, out):
    r = sf_or_skip(base, language, code, stdin=stdin, compile_timeout=60, run_timeout=20)
    assert r.status == RunStatus.Success, r
    assert r.run_result.stdout == out, r


def test_cpp_compile_error(base):
    r = sf_or_skip(base, "cpp", "int main() { undefined_thing(); }")
    assert r.status == RunStatus.Failed and r.run_result is None, r
    assert r.compile_result.status == CommandRunStatus.Finished and r.compile_result.return_code != 0
    assert "undefined_thing" in r.compile_result.stderr


def test_raw_http_like_rl_frameworks(base):
    r = requests.post(base + "/run_code", json={"code": "print(6 * 7)", "language": "python", "run_timeout": 5},
                      timeout=60)
    assert r.status_code == 200
    body = r.json()
    assert body["status"] == "Success" and body["message"] == ""
    assert body["run_result"]["status"] == "Finished" and body["run_result"]["stdout"] == "42\n"
    assert body["run_result"]["return_code"] == 0 and body["compile_result"] is None


def test_wrong_key_malformed_body_and_unknown_language(node, base):
    def unauthorized_count():
        text = httpx.get(f"{node.url}/metrics", timeout=10).text
        line = [x for x in text.splitlines() if x.startswith("dsec_api_sandboxfusion_unauthorized_total")]
        return float(line[0].split()[-1]) if line else 0.0
    before = unauthorized_count()
    for key in ("dsk_" + "0" * 32, "nonsense"):
        r = requests.post(f"{node.url}/sandboxfusion/{key}/run_code", json={"code": "print(1)", "language": "python"},
                          timeout=30)
        assert r.status_code == 401, r.text
    assert unauthorized_count() >= before + 2
    with pytest.raises(Exception, match="401"):
        run_code(RunCodeRequest(code="print(1)", language="python"), endpoint=f"{node.url}/sandboxfusion/dsk_x",
                 max_attempts=1)
    r = requests.post(base + "/run_code", json={"language": "python"}, timeout=30)
    assert r.status_code == 400 and "`code`" in r.json()["error"]["message"]
    r = requests.post(base + "/run_code", json={"code": "x", "language": "python", "run_timeout": "soon"}, timeout=30)
    assert r.status_code == 400 and "`run_timeout`" in r.json()["error"]["message"]
    r = requests.post(base + "/run_code", data=b"{not json", timeout=30)
    assert r.status_code == 400
    r = requests.post(base + "/run_code", json={"code": "x", "language": "cobol"}, timeout=30)
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert "cobol" in msg and "python" in msg and "bash" in msg, msg
    r = requests.post(base + "/run_jupyter", json={"cells": ["1"]}, timeout=30)
    assert r.status_code == 501 and "kernel" in r.json()["error"]["message"]


def test_10mb_of_output_is_truncated_and_flagged(base):
    r = sf(base, "python", "import sys\nsys.stdout.write('x' * (10 * 1024 * 1024))")
    assert r.status == RunStatus.Failed and "truncated" in r.message, r.message
    body = requests.post(base + "/run_code", json={"code": "print('y' * 10_000_000)", "language": "python"},
                         timeout=60).json()
    assert body["run_result"]["truncated"] is True
    assert 0 < len(body["run_result"]["stdout"]) < 10_000_000


def test_fork_bomb_and_memory_hog_get_a_verdict_and_the_next_call_is_fine(base):
    r = sf(base, "bash", ":(){ :|:& };: ; sleep 2; echo done", run_timeout=4)
    assert r.status in (RunStatus.Failed, RunStatus.Success), r
    assert sf(base, "python", "print('after bomb')").run_result.stdout == "after bomb\n"
    r = sf(base, "python", "x = bytearray(2 << 30)\nprint('no')")
    assert r.status == RunStatus.Failed and r.run_result.return_code != 0, r
    assert "no" not in r.run_result.stdout
    assert sf(base, "python", "print('after hog')").run_result.stdout == "after hog\n"


def test_isolation_between_calls(base):
    # a server left listening by one call (in the background), its files: gone for the next call
    # (the worker's network namespace has no usable interface, so the listener is looked up in
    # the socket table, and connecting to it must fail either way)
    listening = ("def listening():\n    rows = []\n    for f in ('/proc/net/tcp', '/proc/net/tcp6'):\n"
                 "        try:\n            rows += open(f).read().splitlines()[1:]\n"
                 "        except OSError:\n            pass\n"
                 "    return any(r.split()[1].endswith(':494D') and r.split()[3] == '0A' for r in rows)\n")
    leave = (listening + "import os, socket, time\nopen('mine.txt', 'w').write('x')\n"
             "open('/tmp/left.txt', 'w').write('x')\n"
             "if os.fork() == 0:\n    os.setsid()\n    s = socket.socket()\n"
             "    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\n"
             "    s.bind(('0.0.0.0', 18765)); s.listen(); time.sleep(60)\n"
             "for _ in range(50):\n    if listening(): break\n    time.sleep(0.1)\nprint(listening())")
    r = sf(base, "python", leave, run_timeout=10)
    assert r.run_result.stdout == "True\n", r
    probe = (listening + "import os, socket\n"
             "print(os.path.exists('mine.txt'), os.path.exists('/tmp/left.txt'), listening())\n"
             "try:\n    socket.create_connection(('127.0.0.1', 18765), timeout=2); print('reached')\n"
             "except OSError:\n    print('refused')")
    for _ in range(3):  # whichever worker serves it
        r = sf(base, "python", probe)
        assert r.run_result.stdout == "False False False\nrefused\n", r
    # no network: a listener on the host's loopback is not reachable from a call
    lst = socket.socket()
    lst.bind(("127.0.0.1", 0))
    lst.listen(8)
    port = lst.getsockname()[1]
    hits = []
    stop = threading.Event()

    def accept():
        lst.settimeout(0.2)
        while not stop.is_set():
            try:
                c, _ = lst.accept()
                hits.append(1)
                c.close()
            except OSError:
                pass
    t = threading.Thread(target=accept, daemon=True)
    t.start()
    try:
        code = (f"import socket\nfor h in ('127.0.0.1', '10.0.2.2'):\n    try:\n"
                f"        socket.create_connection((h, {port}), timeout=2); print('reached')\n"
                f"    except OSError:\n        print('no')")
        r = sf(base, "python", code)
        assert r.run_result.stdout == "no\nno\n", r
        assert not hits
    finally:
        stop.set()
        t.join(5)
        lst.close()
