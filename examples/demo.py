"""dsec demo: a few sandboxes from the `debian` image doing real work, side by side.

Run after `dsec up` (scripts/setup.sh does both); reads DSEC_API_URL / DSEC_API_KEY.
"""

import asyncio
import time

from dsec import DSecClient, DSecContainerRunArgs

TASKS = [
    ("python", "python3 -c 'import sys, platform; print(platform.python_version(), sys.platform)'"),
    ("git", "cd /tmp && git init -q repo && cd repo && echo hi > a && git add a "
            "&& git -c user.name=demo -c user.email=demo@example.test commit -qm init && git log --oneline"),
    ("gcc", "printf '#include <stdio.h>\\nint main(){printf(\"%%d\\\\n\", 6*7);}\\n' > /tmp/m.c "
            "&& gcc -O2 -o /tmp/m /tmp/m.c && /tmp/m"),
    ("state", "cd /tmp && export GREETING=hello"),
]


async def one(client: DSecClient, name: str, cmd: str) -> None:
    t0 = time.perf_counter()
    args = DSecContainerRunArgs(container_image="debian", memory_limit_mb=512, cpu_cores_limit=1,
                                ttl_running_stop=300, network_rules={"npm": False, "pypi": True},
                                init_user="root")
    sandbox = await client.run_container(args, timeout=120)
    ready = time.perf_counter()
    try:
        result = await sandbox.run_shell(cmd)
        if name == "state":  # the shell keeps cwd and exported variables between calls
            result = await sandbox.run_shell('echo "$GREETING from $(pwd) on $(hostname)"')
        whoami = await sandbox.run_shell(
            "for p in /proc/[0-9]*; do printf '%s=%s ' ${p#/proc/} $(cat $p/comm); done")
        print(f"[{sandbox.id}] {name:6} create {1000 * (ready - t0):6.1f} ms  exit {result.exit_code}  "
              f"{result.stdout.strip()!r}")
        print(f"[{sandbox.id}]        processes visible inside (aether, PID 1, is hidden): {whoami.stdout.strip()}")
    finally:
        await sandbox.stop()


async def main() -> None:
    client = DSecClient()
    await client.open()
    try:
        await asyncio.gather(*(one(client, n, c) for n, c in TASKS))
        sandbox = await client.run_container(DSecContainerRunArgs(container_image="debian"))
        r = await sandbox.run_shell("sleep 5", timeout=1)
        print(f"[{sandbox.id}] a command past its timeout: timed_out={r.timed_out}, "
              f"session still usable: {(await sandbox.run_shell('echo yes')).stdout.strip()}")
        await sandbox.write_file("/tmp/hello.bin", bytes(range(256)), mode=0o640)
        st = await sandbox.stat("/tmp/hello.bin")
        print(f"[{sandbox.id}] wrote a binary file: {st.size} bytes, mode {oct(st.mode)}")
        await sandbox.stop()
    finally:
        await client.close()


if __name__ == "__main__":
    asyncio.run(main())
