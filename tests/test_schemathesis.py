"""API fuzzing (issue 22): schemathesis (pinned, from the package index; scripts/install-deps.sh)
against the served `/openapi.json` of a private `dsec up`.

- With a valid admin key, seed 1, 25 examples per operation (the `examples` and `fuzzing`
  phases): no 5xx (but 501 `unsupported` for a capability this build lacks: memory
  snapshots), the server does not crash, every 4xx carries the JSON error body
  (`{"error": {"code", "message"}}`).
- With a wrong key, seed 1, 5 examples per operation: 401 everywhere except the
  unauthenticated service routes (`/healthz`, `/openapi.json`, `/metrics`).

Every exchange is read back from schemathesis' HAR report, so the checks see every response,
not only the ones schemathesis' own checks flag.

Excluded operations and why:
- the terminal, file-watch and process-output streams (`/tty`, `/watch`, `.../output`): a
  WebSocket / long-lived stream that a plain request holds open until its timeout (slow, not
  a wrong answer);
- `PUT /v1/images/{name}` (import from an uploaded archive) and `POST /v1/images/{name}`
  (build/pull): each can spend minutes unpacking or fetching what the fuzzer names;
- the exposed-port proxy (`/v1/sandboxes/{id}/ports/...`): it relays whatever the sandbox's
  own server answers, 5xx included (502 `port_unreachable` is documented);
- `POST /v1/functions/call|batch`: they run the fuzzed code on the worker pool (bounded by
  their own time limits, but tens of seconds each); and `/sandboxfusion/...` likewise.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from typing import List
from urllib.parse import urlparse

import pytest

from helpers import DsecUp, new_data_dir, remove_data_dir

SCHEMATHESIS_VERSION = "4.32.5"

EXCLUDE_PATH_REGEX = (
    r"(/tty$|/watch$|/processes/\{pid\}/output$|/ports/|^/v1/functions/(call|batch)$|^/sandboxfusion/)"
)
EXCLUDE_OPS = [
    ("PUT", "/v1/images/{name}"),
    ("POST", "/v1/images/{name}"),
]
PUBLIC = {"/healthz", "/openapi.json", "/metrics"}


def schemathesis_bin() -> str:
    exe = shutil.which("schemathesis") or shutil.which("st")
    if exe is None:
        pytest.skip("schemathesis is not installed (scripts/install-deps.sh installs it)")
    r = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    if SCHEMATHESIS_VERSION not in r.stdout:
        pytest.skip(f"schemathesis {SCHEMATHESIS_VERSION} wanted, found {r.stdout.strip()!r}")
    return exe


@pytest.fixture(scope="module")
def up(dsec_bin):
    data = new_data_dir("fuzz")
    u = DsecUp(dsec_bin, data, f"fz{os.getpid() % 100000}")
    try:
        u.start()
    except RuntimeError as e:
        remove_data_dir(data)
        pytest.fail(str(e), pytrace=False)
    yield u
    rc = u.stop()
    remove_data_dir(data)
    assert rc == 0, f"dsec up exited {rc} after SIGTERM\n{u.stderr_tail()}"


def run(exe: str, up: DsecUp, key: str, examples: int) -> List[dict]:
    """Runs schemathesis; returns the HAR entries (every request and its response)."""
    out = tempfile.mkdtemp(prefix="dsec-fuzz-")
    har = os.path.join(out, "run.har")
    argv = [exe, "run", f"{up.url}/openapi.json", "--url", up.url,
            "-H", f"Authorization: Bearer {key}",
            "--seed", "1", "--max-examples", str(examples), "--phases", "examples,fuzzing",
            "--checks", "not_a_server_error", "--request-timeout", "30", "--workers", "2",
            "--no-shrink", "--continue-on-failure", "--suppress-health-check", "all",
            "--report", "har", "--report-har-path", har,
            "--exclude-path-regex", EXCLUDE_PATH_REGEX]
    for method, path in EXCLUDE_OPS:
        argv += ["--exclude-operation-id", op_id(up, method, path)]
    # In the temp dir: schemathesis keeps a cache in its working directory.
    r = subprocess.run(argv, capture_output=True, text=True, timeout=600, cwd=out,
                       env=dict(os.environ, NO_COLOR="1"))
    try:
        with open(har) as f:
            entries = json.load(f)["log"]["entries"]
    except (OSError, ValueError, KeyError) as e:
        raise AssertionError(f"schemathesis wrote no HAR report ({e}); exit {r.returncode}\n"
                             f"{r.stdout[-4000:]}\n{r.stderr[-4000:]}")
    finally:
        shutil.rmtree(out, ignore_errors=True)
    print(f"schemathesis: {len(entries)} requests; exit {r.returncode}\n{r.stdout[-1500:]}")
    assert entries, "schemathesis sent no request"
    return entries


_DOC: dict = {}


def op_id(up: DsecUp, method: str, path: str) -> str:
    if not _DOC:
        import urllib.request
        with urllib.request.urlopen(f"{up.url}/openapi.json", timeout=30) as r:
            _DOC.update(json.load(r))
    return _DOC["paths"][path][method.lower()]["operationId"]


def describe(e: dict) -> str:
    req, resp = e["request"], e["response"]
    body = (req.get("postData") or {}).get("text", "")
    return (f"{req['method']} {req['url']} {body[:300]!r} -> {resp['status']} "
            f"{(resp.get('content') or {}).get('text', '')[:300]!r}")


def unsupported(e: dict) -> bool:
    """501 `unsupported`: a capability this build does not have (today only memory snapshots,
    `POST .../snapshot {"memory": true}`, which tests/test_fork.py expects as such); the only
    5xx let through, listed in the run's output."""
    if e["response"]["status"] != 501:
        return False
    try:
        return json.loads(e["response"]["content"]["text"])["error"]["code"] == "unsupported"
    except (ValueError, KeyError, TypeError):
        return False


def test_valid_key_no_5xx_and_json_errors(up):
    exe = schemathesis_bin()
    entries = run(exe, up, up.key, 25)
    server_errors = [describe(e) for e in entries if e["response"]["status"] >= 500 and not unsupported(e)]
    assert not server_errors, f"{len(server_errors)} 5xx answers:\n" + "\n".join(server_errors[:40])
    for e in entries:
        if unsupported(e):
            print("allowed 501 unsupported:", describe(e))
    bad_bodies = []
    for e in entries:
        st = e["response"]["status"]
        if 400 <= st < 500:
            text = (e["response"].get("content") or {}).get("text", "")
            try:
                body = json.loads(text)
                if "/e2b/" in e["request"]["url"]:
                    # The E2B-compatible API answers E2B's error shape, which its SDK maps.
                    ok = isinstance(body.get("code"), int) and isinstance(body.get("message"), str) and body["message"]
                else:
                    err = body["error"]
                    ok = isinstance(err.get("code"), str) and isinstance(err.get("message"), str) and err["message"]
            except (ValueError, KeyError, TypeError, AttributeError):
                ok = False
            if not ok:
                bad_bodies.append(describe(e))
    assert not bad_bodies, f"{len(bad_bodies)} 4xx answers without the JSON error body:\n" + "\n".join(bad_bodies[:40])
    assert up.proc is not None and up.proc.poll() is None, "dsec up died under the fuzzer"
    up.cli("ps")  # still answers


def test_wrong_key_is_401_everywhere_but_the_service_routes(up):
    exe = schemathesis_bin()
    entries = run(exe, up, "dsk_" + "0" * 32, 5)
    wrong = []
    for e in entries:
        path = urlparse(e["request"]["url"]).path
        if path in PUBLIC:
            continue
        if e["response"]["status"] != 401:
            wrong.append(describe(e))
    assert not wrong, f"{len(wrong)} answers other than 401 with a wrong key:\n" + "\n".join(wrong[:40])
