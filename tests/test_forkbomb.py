"""A sandbox survives its own fork bomb: after an OOM kill, a shell fork bomb that holds every
pid slot and large outputs that squeeze memory, the agent (PID 1) still answers and
`kill -9 -1` from the shell ends the bomb."""

from __future__ import annotations

import time

from helpers import dsec_processes, make_sandbox, stop_quietly, wait_until

BIG_OUTPUT = "head -c 300000000 /dev/zero | tr '\\0' x"


def answers(sb) -> bool:
    try:
        return sb.run_shell("echo ok", timeout=10).stdout == "ok\n"
    except Exception:  # noqa: BLE001 - any failure means "does not answer"
        return False


def process_count(sb) -> int:
    """Live (not zombie) processes the sandbox's user sees."""
    r = sb.run_shell("grep -L '^State:.Z' /proc/[0-9]*/status 2>/dev/null | wc -l", timeout=30)
    return int(r.stdout.strip())


def test_the_oom_killer_picks_commands_before_the_agent(client):
    """aether gets oom_score_adj -1000 where the host allows it; where it does not (no
    CAP_SYS_RESOURCE) it stays at the edge's score and every command runs at 1000. Either way a
    command scores above the agent and is never unkillable."""
    sb = make_sandbox(client, "busybox")
    try:
        agents = [pid for pid, (comm, _) in dsec_processes(sb.id).items() if comm == "dsec-aether"]
        assert len(agents) == 1, dsec_processes(sb.id)
        with open(f"/proc/{agents[0]}/oom_score_adj") as f:
            agent = int(f.read())
        cmd = int(sb.run_shell("cat /proc/self/oom_score_adj").stdout)
        assert cmd > agent, f"a command's oom_score_adj {cmd} is not above the agent's {agent}"
        assert cmd in (0, 1000), cmd
        assert int(sb.exec(["cat", "/proc/self/oom_score_adj"]).stdout) == cmd
    finally:
        stop_quietly(sb)


def test_sandbox_survives_its_own_fork_bomb_ten_times(client, debian):
    for round_no in range(10):
        sb = make_sandbox(client, debian, memory_limit_mb=256)
        try:
            hog = sb.run_shell("python3 -c 'bytearray(900*2**20)'", timeout=60)
            assert hog.exit_code != 0, f"round {round_no}: 900 MiB under a 256 MiB limit succeeded"
            bomb = sb.run_shell("bomb(){ bomb | bomb & }; bomb", timeout=30)
            assert bomb is not None
            alive = sb.run_shell("echo alive", timeout=30)
            assert alive.stdout == "alive\n", f"round {round_no}: {alive}"
            for attempt in range(2):
                t0 = time.monotonic()
                r = sb.run_shell(BIG_OUTPUT, timeout=120)
                took = time.monotonic() - t0
                # the output may be cut at the sandbox's output limit or the shell may be
                # killed by the OOM killer; what matters is that the agent answered
                assert r is not None, f"round {round_no} output {attempt}: no result after {took:.1f}s"
            assert answers(sb), f"round {round_no}: the sandbox stopped answering after the bomb"
            killed = sb.run_shell("kill -9 -1; true", timeout=60)
            assert killed is not None
            assert wait_until(lambda: answers(sb), timeout=30), f"round {round_no}: no answer after kill -9 -1"
            # the shell, grep and wc are left (the bomb's zombies are reaped by the agent)
            assert wait_until(lambda: process_count(sb) <= 5, timeout=30, interval=1), (
                f"round {round_no}: the bomb survived kill -9 -1: {process_count(sb)} processes"
            )
        finally:
            stop_quietly(sb)
