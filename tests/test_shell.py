"""Shell sessions: state that persists, sessions, stdin/env/cwd, exit codes, timeouts, streaming.

Every test runs on both substrates (`sb`/`substrate` in conftest.py): a busybox container and a
microVM booted from the `debian` layers (issue 9), asserting the same behaviour.
"""

from __future__ import annotations

import asyncio
import time

import pytest

import dsec

from helpers import make_microvm, make_sandbox, proc_cmdlines, sh, stop_quietly, wait_until


def test_cwd_env_functions_persist(sb):
    sh(sb, "cd /tmp && mkdir -p work && cd work")
    assert sh(sb, "pwd") == "/tmp/work\n"
    sh(sb, "export FOO='bar baz'; LOCALVAR=1")
    assert sh(sb, 'echo "$FOO|$LOCALVAR"') == "bar baz|1\n"
    sh(sb, "greet() { echo \"hello-$1\"; }")
    assert sh(sb, "greet e2e") == "hello-e2e\n"
    sh(sb, "alias ll='echo aliased'")
    assert sh(sb, "ll") == "aliased\n"


def test_background_job_survives_between_calls(sb):
    sh(sb, "sleep 1000 >/dev/null 2>&1 & echo $! > /tmp/bg.pid")
    pid = sh(sb, "cat /tmp/bg.pid").strip()
    assert sb.run_shell(f"kill -0 {pid}").exit_code == 0, "background job died when its command returned"
    assert pid in sh(sb, "jobs -p; echo")
    time.sleep(1)
    assert sb.run_shell(f"kill -0 {pid}").exit_code == 0, "background job died later"
    sh(sb, f"kill {pid}")


def test_background_job_without_redirect_does_not_hang(sb):
    t0 = time.monotonic()
    r = sb.run_shell("sleep 1000 & echo started", timeout=20)
    elapsed = time.monotonic() - t0
    assert not r.timed_out and r.exit_code == 0, f"a backgrounded job held the command open: {r}"
    assert r.stdout == "started\n"
    assert elapsed < 10, f"command with a background job took {elapsed:.1f} s"
    assert "sleep" in sh(sb, "cat /proc/[0-9]*/comm 2>/dev/null")


def test_named_sessions_are_independent(sb):
    sh(sb, "cd /tmp && export WHO=a", session="a")
    sh(sb, "cd /etc && export WHO=b", session="b")
    assert sh(sb, 'pwd; echo "$WHO"', session="a") == "/tmp\na\n"
    assert sh(sb, 'pwd; echo "$WHO"', session="b") == "/etc\nb\n"
    assert sh(sb, 'echo "[$WHO]"') == "[]\n"
    # a session that is closed starts fresh
    sb.close_session("a")
    assert sh(sb, 'echo "[$WHO]"', session="a") == "[]\n"


def test_sessions_run_concurrently(node, sb):
    async def main():
        async with node.aclient() as client:
            # The sandbox under test through the async client: a second handle, whose calls
            # carry no step ids (the sync handle numbers its own).
            asb = await client.attach(sb.id)
            asb.auto_step = False
            t0 = time.monotonic()
            results = await asyncio.gather(*(asb.run_shell("sleep 2; echo done", session=f"s{i}") for i in range(3)))
            elapsed = time.monotonic() - t0
        return results, elapsed

    results, elapsed = asyncio.run(main())
    assert all(r.stdout == "done\n" for r in results)
    assert elapsed < 5.5, f"3 sessions sleeping 2 s took {elapsed:.1f} s: sessions do not run in parallel"


def test_stdin(sb):
    assert sb.run_shell("cat", stdin="line one\nline two\n").stdout == "line one\nline two\n"
    assert sb.run_shell("read x; echo got:$x", stdin="value\n").stdout == "got:value\n"
    # default stdin is empty, not the session's terminal: cat must not hang
    r = sb.run_shell("cat; echo end", timeout=10)
    assert not r.timed_out and r.stdout == "end\n"


def test_env_and_cwd_per_call(sb):
    assert sh(sb, 'echo "$ONLY_HERE"; pwd', env={"ONLY_HERE": "x y"}, cwd="/etc") == "x y\n/etc\n"
    out = sh(sb, 'echo "[$ONLY_HERE]"; pwd')
    assert out.splitlines()[0] == "[]", "per-call env leaked into the session"
    assert out.splitlines()[1] != "/etc", "per-call cwd changed the session's cwd"


def test_exit_codes(sb):
    assert sb.run_shell("true").exit_code == 0
    assert sb.run_shell("false").exit_code == 1
    assert sb.run_shell("(exit 7)").exit_code == 7
    assert sb.run_shell("sh -c 'exit 42'").exit_code == 42
    assert sb.run_shell("no-such-command-e2e").exit_code == 127
    r = sb.run_shell("sh -c 'kill -TERM $$'")
    assert r.exit_code == 143 or r.signal == 15, r
    # `exit` in the session's shell: the status is reported and the session keeps working
    r = sb.run_shell("exit 5")
    assert r.exit_code == 5
    assert sh(sb, "echo still-here") == "still-here\n"


def test_timeout_kills_command_and_children_session_survives(sb):
    sh(sb, "cd /tmp && export KEEP=1")
    t0 = time.monotonic()
    r = sb.run_shell("sh -c 'sleep 1001 & sleep 1002 & wait' & sleep 1003; echo never", timeout=2)
    elapsed = time.monotonic() - t0
    assert r.timed_out, f"command was not reported as timed out: {r}"
    assert "never" not in r.stdout
    assert elapsed < 15, f"timeout of 2 s took {elapsed:.1f} s"

    def survivors():
        return [c for c in proc_cmdlines(sb) if any(s in c for s in ("sleep 1001", "sleep 1002", "sleep 1003"))]

    # the listing works: it sees the session's shell
    assert any(c.split()[0].rsplit("/", 1)[-1] in ("sh", "bash") for c in proc_cmdlines(sb)), proc_cmdlines(sb)
    assert wait_until(lambda: not survivors(), 5), f"processes of the timed-out command survived: {survivors()}"
    assert sh(sb, "echo alive") == "alive\n"
    if not r.session_restarted:
        assert sh(sb, 'pwd; echo "$KEEP"') == "/tmp\n1\n", "session state lost without session_restarted"


def test_builtin_loop_timeout(sb):
    r = sb.run_shell("while :; do :; done", timeout=2)
    assert r.timed_out
    assert sh(sb, "echo ok") == "ok\n"


def test_non_utf8_output_exact(sb):
    r = sb.run_shell("printf '\\377\\376abc\\200\\000z'; printf '\\351t\\351' >&2")
    assert r.stdout_bytes == b"\xff\xfeabc\x80\x00z"
    assert r.stderr_bytes == b"\xe9t\xe9"
    assert "abc" in r.stdout and "\ufffd" in r.stdout


def test_stderr_separate(sb):
    r = sb.run_shell("echo out; echo err >&2; echo out2")
    assert r.stdout == "out\nout2\n"
    assert r.stderr == "err\n"


def test_streaming_yields_before_end(node, sb):
    async def main():
        async with node.aclient() as client:
            # The sandbox under test through the async client: a second handle, whose calls
            # carry no step ids (the sync handle numbers its own).
            asb = await client.attach(sb.id)
            asb.auto_step = False
            t0 = time.monotonic()
            events = []
            async for ev in asb.stream_shell("echo first; sleep 1.5; echo second >&2; sleep 0.5; echo third"):
                events.append((time.monotonic() - t0, ev))
        return events

    events = asyncio.run(main())
    kinds = [e.type for _, e in events]
    assert kinds[-1] == "exit" and events[-1][1].result.exit_code == 0
    stdout = b"".join(e.data for _, e in events if e.type == "stdout")
    stderr = b"".join(e.data for _, e in events if e.type == "stderr")
    assert stdout == b"first\nthird\n" and stderr == b"second\n"
    first_at = next(t for t, e in events if e.type == "stdout" and b"first" in e.data)
    exit_at = events[-1][0]
    assert exit_at - first_at > 1.0, f"first chunk arrived at {first_at:.2f} s, exit at {exit_at:.2f} s: not streamed"


def test_stream_exec_and_sync_streaming(sb):
    events = list(sb.stream_exec(["sh", "-c", "echo a; echo b >&2; exit 3"]))
    assert events[-1].type == "exit" and events[-1].result.exit_code == 3
    assert b"".join(e.data for e in events if e.type == "stdout") == b"a\n"
    assert b"".join(e.data for e in events if e.type == "stderr") == b"b\n"


def test_exec_argv(sb):
    r = sb.exec(["sh", "-c", 'printf "%s|" "$@"', "argv0", "a b", "", "c'd\"e", "$HOME"])
    assert r.exit_code == 0
    assert r.stdout == "a b||c'd\"e|$HOME|"
    r = sb.exec(["cat"], stdin=b"\x00\x01\xffbinary")
    assert r.stdout_bytes == b"\x00\x01\xffbinary"
    assert sb.exec(["sh", "-c", "exit 9"]).exit_code == 9
    r = sb.exec(["pwd"], cwd="/etc", env={"E2E": "v"})
    assert r.stdout == "/etc\n"
    assert sb.exec(["sh", "-c", 'echo "$E2E"'], env={"E2E": "v"}).stdout == "v\n"


def test_init_user(client, substrate, request):
    """A fresh sandbox whose commands run as the image's `user` (uid 1000 in both images)."""
    if substrate == "container":
        sb = make_sandbox(client, "busybox", init_user="user")
    else:
        try:
            sb = make_microvm(client, request.getfixturevalue("debian"), init_user="user")
        except dsec.BadRequest as e:
            # aether takes --user in a VM guest; the microVM runtime and the guest's /init do not
            # pass it yet and refuse init_user (a clear 400). Runs as soon as they do.
            if "init_user" not in str(e):
                raise
            reason = f"microVMs refuse init_user for now: {e}"
            print(f"\nSKIP: {reason}")
            pytest.skip(reason)
    try:
        assert sh(sb, "id -u").strip() == "1000"
        assert bb_exec_uid(sb) == "1000"
        r = sb.run_shell("touch /root/x")
        assert r.exit_code != 0, "uid 1000 could write /root"
    finally:
        stop_quietly(sb)


def bb_exec_uid(sb) -> str:
    return sb.exec(["id", "-u"]).stdout.strip()
