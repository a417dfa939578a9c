"""Trajectory log (issue 7): durable ordered history, client fast-forward, provenance, replay.

Must show:
- ``test_agent_killed_mid_run_replays_to_identical_state``: a 50-step scripted agent with
  non-idempotent steps (append, counter increment, git commit) is SIGKILLed at a random step,
  restarted, replays its script: final state identical to an uninterrupted run, every
  non-idempotent command ran exactly once.
- ``test_edge_kill9_during_heavy_writes_log_reopens``: `kill -9` of `dsec up` during heavy
  writes; the log reopens cleanly (torn tail cut, contiguous seqs).
- ``test_replay_deterministic_and_date``: replay reports no difference for a deterministic
  trajectory and exactly the `date` steps otherwise.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

from helpers import REPO, DsecUp, debian_tar, force_cleanup, make_sandbox, new_data_dir, remove_data_dir, stop_quietly

import dsec

# ---------------------------------------------------------------------------------------------
# this module's own node: sandboxes of a node id shared with concurrent runs could be reaped by
# another `dsec up` starting with that id


@pytest.fixture(scope="module")
def node(dsec_bin):
    data = new_data_dir("traj")
    up = DsecUp(dsec_bin, data, "traj")
    try:
        up.start()
    except RuntimeError as e:
        remove_data_dir(data)
        pytest.fail(str(e), pytrace=False)
    yield up
    rc = up.stop()
    force_cleanup(data, "/traj/")
    remove_data_dir(data)
    assert rc == 0, up.stderr_tail()
    up.remove_log()


@pytest.fixture(scope="module")
def client(node):
    c = node.client()
    yield c
    c.close()


@pytest.fixture(scope="module")
def debian(node):
    tar = debian_tar()
    if not tar.is_file():
        pytest.skip(f"{tar} is absent (build it with scripts/images/build-debian.sh)")
    node.cli("image", "import", "debian", "--tar", str(tar), timeout=900)
    return "debian"


# ---------------------------------------------------------------------------------------------
# the scripted agent (runs as its own process so that it can be SIGKILLed)

AGENT = r'''
import sys, json
sys.path.insert(0, sys.argv[4])
from dsec.sync import DSecClient
url, key, sid, _, out = sys.argv[1:6]
c = DSecClient(api_url=url, api_key=key, timeout=120)
sb = c.attach(sid)
print(json.dumps({"attached": True, "last_completed_step": sb.last_completed_step}), flush=True)
outputs = []
def rec(i, r):
    outputs.append([i, r.exit_code, r.stdout, r.replayed])
    print(json.dumps({"step": i, "replayed": r.replayed}), flush=True)
i = 0
for n in range(1, 51):
    k = n % 5
    if k == 1:
        r = sb.run_shell(f"echo line-{n} >> /work/log.txt && echo {n} >> /work/ran && sleep 0.05")
    elif k == 2:
        r = sb.run_shell("n=$(cat /work/counter); echo $((n+1)) > /work/counter; echo c%d >> /work/ran; cat /work/counter" % n)
    elif k == 3:
        r = sb.run_shell(f"cd /work/repo && echo {n} > f{n}.txt && git add f{n}.txt && git commit -q -m step-{n} && echo g{n} >> /work/ran && git rev-list --count HEAD")
    elif k == 4:
        sb.write_file(f"/work/notes/{n}.txt", f"note {n}\n")
        r = sb.exec(["cat", f"/work/notes/{n}.txt"])
    else:
        r = sb.run_shell("wc -l < /work/log.txt; cat /work/counter")
    rec(n, r)
json.dump(outputs, open(out, "w"))
print(json.dumps({"done": True}), flush=True)
'''

SETUP = (
    "mkdir -p /work/repo /work/notes && echo 0 > /work/counter && : > /work/log.txt && : > /work/ran && "
    "cd /work/repo && git init -q && git config user.email a@b.test && git config user.name agent && "
    "git config commit.gpgsign false && echo init > README && git add README && git commit -q -m init"
)

STATE = "cat /work/log.txt; echo ---; cat /work/counter; echo ---; sort /work/ran; echo ---; " \
        "cd /work/repo && git log --format=%s && git ls-files | sort; echo ---; ls /work/notes | sort"


def _agent(node, sid: str, out: str, tmp: Path) -> subprocess.Popen:
    script = tmp / "agent.py"
    script.write_text(AGENT)
    return subprocess.Popen(
        [sys.executable, str(script), node.url, node.key, sid, str(REPO / "sdk" / "python"), out],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )


def _prepared(client, image):
    sb = make_sandbox(client, image)
    sb.auto_step = False  # the test's own calls carry no step ids
    r = sb.run_shell(SETUP, timeout=60)
    assert r.exit_code == 0, r
    return sb


def test_agent_killed_mid_run_replays_to_identical_state(node, client, debian, tmp_path):
    ref = _prepared(client, debian)
    victim = _prepared(client, debian)
    try:
        # Uninterrupted reference run.
        t0 = time.monotonic()
        p = _agent(node, ref.id, str(tmp_path / "ref.json"), tmp_path)
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        ref_secs = time.monotonic() - t0

        # The victim: SIGKILL at a random point in the middle of the run (after a random step
        # between 10 and 40 was answered, plus a random fraction of a step's time, so the kill
        # can also land while a call is in flight), then restart it.
        p = _agent(node, victim.id, str(tmp_path / "v1.json"), tmp_path)
        assert json.loads(p.stdout.readline())["attached"]
        kill_after = random.randint(10, 40)
        while json.loads(p.stdout.readline()).get("step", 0) < kill_after:
            pass
        time.sleep(random.uniform(0, ref_secs / 50))
        p.send_signal(signal.SIGKILL)
        p.wait(timeout=30)
        before = victim.last_step()
        print(f"killed the agent after step {kill_after} of 50 (~{ref_secs:.2f}s per run); edge: {before}")
        assert before["last_completed_step"] is not None and before["last_completed_step"] < 50, before

        p = _agent(node, victim.id, str(tmp_path / "v2.json"), tmp_path)
        out, err = p.communicate(timeout=600)
        assert p.returncode == 0, err
        lines = [json.loads(l) for l in out.splitlines() if l.strip()]
        attached = lines[0]
        replayed = [l["step"] for l in lines if l.get("replayed")]
        assert attached["last_completed_step"] is not None
        # The calls already done were answered from the log (a prefix of the script), the rest ran.
        assert replayed and replayed == list(range(1, len(replayed) + 1)), replayed
        assert len(replayed) < 50

        s_ref = ref.run_shell(STATE).stdout
        s_vic = victim.run_shell(STATE).stdout
        assert s_vic == s_ref, f"final states differ:\n--- reference\n{s_ref}\n--- killed+restarted\n{s_vic}"
        ran = victim.run_shell("sort /work/ran | uniq -d").stdout
        assert ran == "", f"non-idempotent commands ran more than once: {ran!r}"
        n_ran = int(victim.run_shell("wc -l < /work/ran").stdout.strip())
        assert n_ran == 30, n_ran  # 10 appends + 10 increments + 10 commits, each exactly once
        assert victim.run_shell("cat /work/counter").stdout.strip() == "10"
        # The agent's observations are identical too (replayed results are the recorded ones).
        ref_out = json.load(open(tmp_path / "ref.json"))
        vic_out = json.load(open(tmp_path / "v2.json"))
        assert [o[:3] for o in vic_out] == [o[:3] for o in ref_out]
    finally:
        stop_quietly(ref)
        stop_quietly(victim)


# ---------------------------------------------------------------------------------------------
# step semantics


def test_steps_completed_running_conflict(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        sb.auto_step = False
        r1 = sb.run_shell("echo x >> /tmp/n; wc -l < /tmp/n", step=1)
        assert not r1.replayed and r1.stdout.strip() == "1"
        r2 = sb.run_shell("echo x >> /tmp/n; wc -l < /tmp/n", step=1)
        assert r2.replayed and r2.stdout == r1.stdout
        assert sb.run_shell("wc -l < /tmp/n").stdout.strip() == "1", "a completed step must not run again"
        # A different call under a used step id is refused with a clear message.
        with pytest.raises(dsec.DSecError) as ei:
            sb.run_shell("rm -rf /tmp", step=1)
        assert ei.value.code == "conflict" and "step 1" in str(ei.value), ei.value
        with pytest.raises(dsec.DSecError) as ei:
            sb.exec(["echo", "x"], step=1)
        assert ei.value.code == "conflict"

        # A running step: a second caller attaches to it and gets its result.
        got = {}

        def first():
            got["a"] = sb.run_shell("sleep 1; echo y >> /tmp/m; wc -l < /tmp/m", step=2)

        t = threading.Thread(target=first)
        t.start()
        time.sleep(0.3)
        assert 2 in sb.last_step()["running_steps"]
        b = sb.run_shell("sleep 1; echo y >> /tmp/m; wc -l < /tmp/m", step=2)
        t.join()
        assert b.replayed and b.stdout == got["a"].stdout == "1\n"
        assert sb.run_shell("wc -l < /tmp/m").stdout.strip() == "1"

        # File operations carry steps too.
        sb.write_file("/tmp/f", "one", step=3)
        sb.write_file("/tmp/f", "one", step=3)
        assert sb.read_file("/tmp/f", step=4) == b"one"
        sb.write_file("/tmp/f", "two")
        assert sb.read_file("/tmp/f", step=4) == b"one", "a replayed read answers the recorded content"
        with pytest.raises(dsec.DSecError) as ei:
            sb.write_file("/tmp/f", "three", step=3)
        assert ei.value.code == "conflict"
        info = sb.last_step()
        assert info["last_completed_step"] == 4 and info["enabled"]

        # attach: numbering restarts at 1; completed steps fast-forward locally.
        h = client.attach(sb.id)
        assert h.last_completed_step == 4
        r = h.run_shell("echo x >> /tmp/n; wc -l < /tmp/n")  # auto step 1
        assert r.replayed and r.stdout.strip() == "1"
        recs = sb.trajectory(kind="shell", from_step=1, to_step=2)
        assert [x["step"] for x in recs] == [1, 2]
        assert all(x["kind"] == "shell" for x in recs)
        seqs = [x["seq"] for x in sb.trajectory()]
        assert seqs == list(range(1, len(seqs) + 1))
    finally:
        stop_quietly(sb)


def test_trajectory_off_and_log_survives_stop(node, client):
    off = make_sandbox(client, "busybox", trajectory=False)
    try:
        assert off.last_step()["enabled"] is False
        off.auto_step = False
        off.run_shell("echo x >> /tmp/n", step=1)
        r = off.run_shell("echo x >> /tmp/n; wc -l < /tmp/n", step=1)
        assert not r.replayed and r.stdout.strip() == "2"
    finally:
        stop_quietly(off)
    sb = make_sandbox(client, "busybox")
    sb.run_shell("echo kept")
    sb.stop()
    kinds = [r["kind"] for r in sb.trajectory()]
    assert kinds[0] == "create" and kinds[-1] == "stop" and "shell" in kinds, kinds


# ---------------------------------------------------------------------------------------------
# provenance and isolation


def test_which_step_last_wrote_a_file(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        sb.write_file("/tmp/a.txt", "a")                      # step 1
        sb.run_shell("sleep 0.05; echo b > /tmp/b.txt")        # step 2
        sb.run_shell("sleep 0.05; echo unrelated")             # step 3
        sb.run_shell("sleep 0.05; echo more >> /tmp/a.txt")   # step 4
        sb.mkdir("/tmp/d")                                     # step 5
        found = lambda p: [r["step"] for r in sb.trajectory(path=p)]
        assert found("/tmp/b.txt") == [2]
        assert found("/tmp/a.txt") == [4]
        assert found("/tmp/d") == [5]
        assert found("/bin/sh") == []
        out = node.cli("trajectory", sb.id, "--path", "/tmp/b.txt").stdout.decode()
        assert "echo b > /tmp/b.txt" in out, out
        # written through the file API: the record names the digest of what was written
        rec = sb.trajectory(kind="write_file")[0]
        assert rec["files_written"][0]["path"] == "/tmp/a.txt" and len(rec["files_written"][0]["sha256"]) == 64
    finally:
        stop_quietly(sb)


def test_log_is_unreachable_from_inside(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        sb.auto_step = False
        # The marker only ever exists joined in the command's OUTPUT, which the log records.
        sb.run_shell("printf 'zq%sqz' 7f3a91")
        logs = Path(node.data_dir, "edge", "trajectories", f"{sb.id}.log")
        assert b"zq7f3a91qz" in logs.read_bytes(), "the host-side log must hold the marker"
        r = sb.run_shell(
            "M=zq$(echo 7f3a91)qz; grep -rl -D skip --exclude-dir=proc --exclude-dir=sys \"$M\" / 2>/dev/null; "
            "echo grep-done; cat /proc/self/mountinfo | grep -i traject; "
            "ls -l /proc/*/fd 2>/dev/null | grep -i traject; ls -l /proc/*/root/ 2>/dev/null | grep -i traject; "
            "find / -xdev -name '*.log' -path '*traject*' 2>/dev/null; echo end",
            timeout=120,
        )
        assert r.stdout.strip().splitlines() == ["grep-done", "end"], r.stdout
        # Writes from inside cannot reach it either: the record count is unchanged by anything
        # the sandbox does to its own filesystem.
        before = logs.stat().st_size
        sb.run_shell("for f in $(find / -xdev -name '*.log' 2>/dev/null); do echo junk >> $f; done; true")
        recs = sb.trajectory()
        assert [r["seq"] for r in recs] == list(range(1, len(recs) + 1))
        assert logs.stat().st_size > before  # only our own append of the last call
    finally:
        stop_quietly(sb)


# ---------------------------------------------------------------------------------------------
# replay


def _replay(node, sb_id: str, tmp_path: Path):
    t = tmp_path / f"{sb_id}.jsonl"
    t.write_bytes(node.cli("trajectory", sb_id, "--json").stdout)
    p = node.cli("replay", str(t), "--json", check=False, timeout=300)
    assert p.returncode in (0, 3), p.stderr.decode()
    return p.returncode, json.loads(p.stdout)


def test_replay_deterministic_and_date(node, client, tmp_path):
    det = make_sandbox(client, "busybox")
    dated = make_sandbox(client, "busybox")
    try:
        for sb, with_date in ((det, False), (dated, True)):
            sb.write_file("/tmp/in.txt", "hello\n")                    # 1
            sb.run_shell("cat /tmp/in.txt | tr a-z A-Z > /tmp/out")    # 2
            sb.run_shell("date" if with_date else "echo 42")            # 3
            sb.exec(["cat", "/tmp/out"])                                # 4
            sb.mkdir("/tmp/d/e")                                        # 5
            sb.run_shell("ls /tmp/d; hostname; echo $((6*7))")         # 6
            sb.run_shell("date +%s" if with_date else "true")          # 7
            sb.read_file("/tmp/out")                                    # 8
            sb.list_files("/tmp/d")                                     # 9
            sb.run_shell("exit 3")                                      # 10
        time.sleep(1.1)  # `date` has second resolution: the replay runs in later seconds
        rc, rep = _replay(node, det.id, tmp_path)
        assert rc == 0 and rep["differing"] == [] and rep["replayed"] == 10, rep
        rc, rep = _replay(node, dated.id, tmp_path)
        assert rc == 3, rep
        assert [d["step"] for d in rep["differing"]] == [3, 7], rep
    finally:
        stop_quietly(det)
        stop_quietly(dated)


# ---------------------------------------------------------------------------------------------
# crash of the edge during heavy writes


def test_edge_kill9_during_heavy_writes_log_reopens(dsec_bin, tmp_path):
    data = new_data_dir("traj-crash")
    up = DsecUp(dsec_bin, data, "tc")
    up2 = None
    try:
        up.start()
        c = up.client()
        sb = make_sandbox(c, "busybox")
        sb.auto_step = False
        stop = threading.Event()
        errors = []

        def writer(w):
            i = 0
            while not stop.is_set():
                i += 1
                try:
                    sb.run_shell(f"head -c 6000 /dev/zero | tr '\\0' {w}", step=w * 1_000_000 + i if i % 2 else None)
                except Exception as e:  # the edge dies under us
                    errors.append(e)
                    return

        threads = [threading.Thread(target=writer, args=(w,)) for w in range(1, 5)]
        for t in threads:
            t.start()
        time.sleep(2.0)
        up.kill()  # SIGKILL mid-write
        stop.set()
        for t in threads:
            t.join(timeout=30)
        c.close()
        log = Path(data, "edge", "trajectories", f"{sb.id}.log")
        size = log.stat().st_size
        assert size > 0
        # Make the torn tail certain: half a frame as a crash mid-write leaves it.
        frame_payload = b'{"seq": 999999, "kind": "shell", "start_ms": 1'
        with open(log, "ab") as f:
            f.write(b"DSTR" + struct.pack("<II", 4096, 0) + frame_payload)

        up2 = DsecUp(dsec_bin, data, "tc")
        up2.start()
        c2 = up2.client()
        # Reading through the API reopens the log (also after a re-adoption of the sandbox).
        try:
            h = c2.attach(sb.id)  # re-adopted by the restarted edge
        except dsec.DSecError:
            # reaped: its log stays readable for the retention period
            from dsec.types import SandboxInfo
            h = dsec.sync.Sandbox(c2, dsec.client.Sandbox(c2._aclient, SandboxInfo(id=sb.id)))
        recs = h.trajectory()
        seqs = [r["seq"] for r in recs]
        assert len(seqs) > 10 and seqs == list(range(1, len(seqs) + 1)), seqs[:20]
        assert all(r["kind"] in ("create", "shell", "stop", "died") for r in recs)
        valid = log.stat().st_size
        assert valid <= size, "the torn frame was cut"
        ls = h.last_step()
        assert ls["records"] >= len(seqs)
        c2.close()
    finally:
        for u in (up2, up):
            if u is not None:
                u.stop()
        force_cleanup(data, "/tc/")
        remove_data_dir(data)



def test_state_changes_are_logged_with_their_origin(client):
    """Pause, resume (explicit and transparent) and network-rule changes are trajectory entries,
    in order, between the calls around them."""
    sb = make_sandbox(client)
    try:
        sb.run_shell("echo before")
        sb.pause()
        sb.run_shell("echo after")  # resumes the sandbox transparently first
        sb.pause()
        sb.resume()
        kinds = [r["kind"] for r in sb.trajectory()]
        assert kinds[0] == "create", kinds
        tail = [k for k in kinds if k in ("shell", "pause", "resume")]
        assert tail == ["shell", "pause", "resume", "shell", "pause", "resume"], kinds
        seqs = [r["seq"] for r in sb.trajectory()]
        assert seqs == sorted(seqs) and len(set(seqs)) == len(seqs), seqs
        pause = [r for r in sb.trajectory(kind="pause")][0]
        assert pause["ok"] is True and "memory_before_bytes" in json.dumps(pause["result"]), pause
    finally:
        stop_quietly(sb)
    kinds = [r["kind"] for r in sb.trajectory()]
    assert kinds[-1] == "stop", kinds
