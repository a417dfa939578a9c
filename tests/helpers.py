"""Helpers shared by the end-to-end tests: a `dsec up` process and host-side observation."""

from __future__ import annotations

import glob
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import urllib.error
import urllib.request
import time
from pathlib import Path
from typing import Dict, List, Optional, Set, Tuple

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "sdk" / "python") not in sys.path:
    sys.path.insert(0, str(REPO / "sdk" / "python"))

import dsec  # noqa: E402
import dsec.sync  # noqa: E402
from dsec import DSecContainerRunArgs  # noqa: E402

START_TIMEOUT = 60.0
STOP_TIMEOUT = 60.0
CGROUP_ROOT = "/sys/fs/cgroup"


# ---------------------------------------------------------------------------------------------
# host-side observation helpers


def _unescape_mountinfo(field: str) -> str:
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) and field[i + 1 : i + 4].isdigit():
            out.append(chr(int(field[i + 1 : i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mounts_under(path: os.PathLike, mountinfo: str = "/proc/self/mountinfo") -> List[str]:
    """Mount points at or below ``path`` in the given mount table."""
    root = os.path.realpath(os.fspath(path)).rstrip("/")
    found = []
    try:
        with open(mountinfo, encoding="utf-8", errors="replace") as f:
            for line in f:
                parts = line.split()
                if len(parts) < 5:
                    continue
                mp = _unescape_mountinfo(parts[4])
                if mp == root or mp.startswith(root + "/"):
                    found.append(mp)
    except OSError:
        pass
    return found


def dsec_cgroups(substr: str = "") -> Set[str]:
    """Every cgroup directory under ``/sys/fs/cgroup/<controller>/dsec/`` (v1) and
    ``/sys/fs/cgroup/unified/dsec`` or ``/sys/fs/cgroup/dsec`` (v2) whose path contains
    ``substr``."""
    roots = glob.glob(f"{CGROUP_ROOT}/*/dsec") + glob.glob(f"{CGROUP_ROOT}/dsec")
    found = set()
    for root in roots:
        if not os.path.isdir(root):
            continue
        for dirpath, _dirnames, _files in os.walk(root):
            if substr in dirpath:
                found.add(dirpath)
    return found


def proc_cgroup_paths(pid: int) -> List[str]:
    try:
        with open(f"/proc/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            return [line.rstrip("\n").split(":", 2)[2] for line in f if line.count(":") >= 2]
    except OSError:
        return []


def dsec_processes(substr: str = "") -> Dict[int, Tuple[str, str]]:
    """Processes whose cgroup (any hierarchy) is under ``/dsec`` and contains ``substr``:
    pid -> (comm, cgroup path)."""
    found: Dict[int, Tuple[str, str]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        for cg in proc_cgroup_paths(pid):
            if (cg.startswith("/dsec/") or "/dsec/" in cg) and substr in cg:
                try:
                    comm = Path(f"/proc/{pid}/comm").read_text().strip()
                except OSError:
                    comm = "?"
                found[pid] = (comm, cg)
                break
    return found


def vm_rss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def find_dsec_bin() -> Optional[str]:
    env = os.environ.get("DSEC_BIN")
    if env:
        return env if os.access(env, os.X_OK) else None
    for rel in ("target/release/dsec", "target/debug/dsec"):
        p = REPO / rel
        if p.is_file() and os.access(p, os.X_OK):
            return str(p)
    return None


def find_aether() -> Optional[str]:
    """The static aether the suite should use: ``DSEC_AETHER``, else the static release build in
    the tree (which a stale ``target/debug/dsec-aether`` next to the binary would otherwise
    shadow in the edge's lookup order)."""
    env = os.environ.get("DSEC_AETHER")
    if env:
        return env
    p = REPO / "target" / "x86_64-unknown-linux-gnu" / "release" / "dsec-aether"
    return str(p) if p.is_file() else None


def debian_tar() -> Path:
    return Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "debian-bookworm.tar"


# ---------------------------------------------------------------------------------------------
# a running `dsec up`


class DsecUp:
    """One `dsec up` process on its own data dir and port."""

    def __init__(self, binary: str, data_dir: str, node_id: str, port: Optional[int] = None,
                 config: Optional[str] = None, env: Optional[Dict[str, str]] = None):
        self.binary = binary
        self.config = config
        # Extra environment for this `dsec up` only (e.g. DSEC_MICROVM_MACHINE=pc).
        self.extra_env = dict(env or {})
        self.data_dir = data_dir
        self.node_id = node_id
        self.port = port or free_port()
        self.proc: Optional[subprocess.Popen] = None
        self.url = ""
        self.key = ""
        self.stderr_path = os.path.join(os.path.dirname(data_dir.rstrip("/")) or "/tmp", f"{os.path.basename(data_dir)}.stderr.log")
        self._stdout_lines: "queue.Queue[Optional[str]]" = queue.Queue()

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def stderr_tail(self, n: int = 60) -> str:
        try:
            lines = Path(self.stderr_path).read_text(errors="replace").splitlines()
        except OSError:
            return "(no stderr log)"
        return "\n".join(lines[-n:])

    def remove_log(self) -> None:
        try:
            os.unlink(self.stderr_path)
        except OSError:
            pass

    @staticmethod
    def _pump_stdout(stream, lines: "queue.Queue[Optional[str]]") -> None:
        # Each process's pump feeds its own queue: after a crash-and-restart, the old process's
        # end of stdout (seen late by a lagging pump) must not reach the new process's queue.
        for raw in stream:
            lines.put(raw.decode("utf-8", "replace").rstrip("\n"))
        lines.put(None)

    def start(self) -> "DsecUp":
        os.makedirs(self.data_dir, exist_ok=True)
        env = {**os.environ, **self.extra_env}
        env.setdefault("RUST_LOG", "info")
        aether = find_aether()
        if aether:
            env["DSEC_AETHER"] = aether
        env.pop("DSEC_API_URL", None)
        env.pop("DSEC_API_KEY", None)
        cmd = [
            self.binary, "up",
            "--data-dir", self.data_dir,
            "--listen", f"127.0.0.1:{self.port}",
            "--node-id", self.node_id,
        ]
        if self.config is not None:
            path = os.path.join(self.data_dir, "dsec.toml")
            with open(path, "w") as f:
                f.write(self.config)
            cmd += ["--config", path]
        stderr = open(self.stderr_path, "ab")
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=env, start_new_session=True)
        stderr.close()
        self._stdout_lines = queue.Queue()
        threading.Thread(target=self._pump_stdout, args=(self.proc.stdout, self._stdout_lines), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT
        seen: List[str] = []
        while not (self.url and self.key):
            left = deadline - time.monotonic()
            if left <= 0:
                self.kill()
                raise RuntimeError(
                    f"`{' '.join(cmd)}` printed no DSEC_API_URL/DSEC_API_KEY within {START_TIMEOUT:.0f} s; "
                    f"stdout: {seen!r}\nstderr:\n{self.stderr_tail()}"
                )
            try:
                line = self._stdout_lines.get(timeout=min(left, 1.0))
            except queue.Empty:
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"`{' '.join(cmd)}` exited with {self.proc.returncode} before printing its URL; "
                        f"stdout: {seen!r}\nstderr:\n{self.stderr_tail()}"
                    )
                continue
            if line is None:
                self.proc.wait(timeout=10)
                raise RuntimeError(
                    f"`{' '.join(cmd)}` closed stdout (exit {self.proc.returncode}) before printing its URL; "
                    f"stdout: {seen!r}\nstderr:\n{self.stderr_tail()}"
                )
            seen.append(line)
            if line.startswith("DSEC_API_URL="):
                self.url = line.split("=", 1)[1].strip()
            elif line.startswith("DSEC_API_KEY="):
                self.key = line.split("=", 1)[1].strip()
        return self

    def env(self) -> Dict[str, str]:
        env = dict(os.environ)
        env["DSEC_API_URL"] = self.url
        env["DSEC_API_KEY"] = self.key
        return env

    def cli(self, *args: str, timeout: float = 120.0, check: bool = True, input: Optional[bytes] = None) -> subprocess.CompletedProcess:
        """Runs `dsec ARGS...` against this instance; returns the completed process (text)."""
        proc = subprocess.run(
            [self.binary, *args], env=self.env(), capture_output=True, timeout=timeout, input=input
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"`dsec {' '.join(args)}` exited {proc.returncode}\nstdout: {proc.stdout.decode(errors='replace')}\n"
                f"stderr: {proc.stderr.decode(errors='replace')}"
            )
        return proc

    def client(self) -> dsec.sync.DSecClient:
        return dsec.sync.DSecClient(api_url=self.url, api_key=self.key, timeout=120)

    def aclient(self) -> dsec.DSecClient:
        return dsec.DSecClient(api_url=self.url, api_key=self.key, timeout=120)

    def stop(self, timeout: float = STOP_TIMEOUT) -> int:
        """SIGTERM and wait; returns the exit status (SIGKILLs and raises after ``timeout``)."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
                raise AssertionError(
                    f"dsec up (pid {self.proc.pid}) did not exit within {timeout:.0f} s of SIGTERM; killed it.\n"
                    f"stderr:\n{self.stderr_tail()}"
                )
        return self.proc.returncode

    def kill(self) -> None:
        """SIGKILL (simulated crash)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def layer_files(self) -> List[str]:
        return sorted(glob.glob(os.path.join(self.data_dir, "edge", "images", "layers", "*.erofs")))

    def sandbox_dir(self, sandbox_id: str) -> str:
        return os.path.join(self.data_dir, "edge", "sandboxes", sandbox_id)


def force_cleanup(data_dir: str, cgroup_substr: str) -> List[str]:
    """Cleans what a dsec instance left behind after it exited (so a failing run does not litter
    the machine): kills processes in its sandbox cgroups, removes those cgroups, lazily unmounts
    mounts under its data dir. Returns what it had to do."""
    done = []
    for pid, (comm, cg) in dsec_processes(cgroup_substr).items():
        try:
            os.kill(pid, signal.SIGKILL)
            done.append(f"killed {pid} {comm} ({cg})")
        except ProcessLookupError:
            pass
    time.sleep(0.2) if done else None
    for cg in sorted(dsec_cgroups(cgroup_substr), key=lambda c: -c.count("/")):
        if "/sb-" not in cg:
            continue
        try:
            os.rmdir(cg)
            done.append(f"rmdir {cg}")
        except OSError as e:
            done.append(f"rmdir {cg} failed: {e}")
    for mp in sorted(mounts_under(data_dir), key=lambda m: -m.count("/")):
        r = subprocess.run(["umount", "-l", mp], capture_output=True)
        done.append(f"umount -l {mp}: rc {r.returncode}")
    return done


def remove_data_dir(path: str) -> None:
    """Removes a test data dir, but never through a mount (would delete mounted content)."""
    left = mounts_under(path)
    if left:
        print(f"\nNOT removing {path}: still mounted: {left}", file=sys.stderr)
        return
    shutil.rmtree(path, ignore_errors=True)


def new_data_dir(tag: str) -> str:
    return tempfile.mkdtemp(prefix=f"dsec-e2e-{tag}-", dir="/var/tmp")


def make_sandbox(client, image: str = "busybox", **kw):
    return client.run_container(DSecContainerRunArgs(container_image=image, **kw), timeout=120)


def stop_quietly(sb) -> None:
    try:
        sb.stop()
    except dsec.SandboxNotFound:
        pass


def sh(sb, cmd: str, **kw) -> str:
    """Runs ``cmd`` and asserts it succeeded; returns stdout."""
    r = sb.run_shell(cmd, **kw)
    assert r.exit_code == 0 and not r.timed_out, (
        f"{cmd!r} failed: exit {r.exit_code} signal {r.signal} timed_out {r.timed_out}\n"
        f"stdout: {r.stdout[-2000:]}\nstderr: {r.stderr[-2000:]}"
    )
    return r.stdout


def gxx_toolkit_tree(root: str) -> Optional[str]:
    """Copies the host's g++ (Debian packages g++-12, g++, libstdc++-12-dev) into `root`, a
    toolkit layer tree for C++ function calls (the cached debian image has only gcc). Returns
    why it cannot, or None."""
    if shutil.which("dpkg") is None:
        return "dpkg absent: cannot build the g++ toolkit layer"
    files = []
    for pkg in ("g++-12", "g++", "libstdc++-12-dev"):
        p = subprocess.run(["dpkg", "-L", pkg], capture_output=True, text=True)
        if p.returncode != 0:
            return f"host package {pkg} is not installed: cannot build the g++ toolkit layer"
        files += [line for line in p.stdout.splitlines() if line.startswith("/")]
    for f in files:
        if os.path.isdir(f) and not os.path.islink(f):
            os.makedirs(root + f, exist_ok=True)
        elif os.path.lexists(f):
            os.makedirs(os.path.dirname(root + f), exist_ok=True)
            if os.path.islink(f):
                os.symlink(os.readlink(f), root + f)
            else:
                shutil.copy2(f, root + f)
    return None


def wait_until(pred, timeout: float = 10.0, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(interval)
    return pred()


# ---------------------------------------------------------------------------------------------
# substrates: the same tests against a container and a microVM


SUBSTRATES = ("container", "microvm")


def microvm_guest_dir() -> Path:
    return Path(os.environ.get("DSEC_GUEST_DIR") or Path(os.environ.get("DSEC_CACHE", "/var/cache/dsec")) / "guest")


def microvm_skip_reason() -> Optional[str]:
    """Why the microVM substrate cannot run here (None when it can): the same checks as
    `tests/test_microvm.py`'s `vm_ok`."""
    if shutil.which(os.environ.get("DSEC_QEMU", "qemu-system-x86_64")) is None:
        return "qemu-system-x86_64 is not installed (scripts/install-deps.sh installs qemu-system-x86)"
    guest = microvm_guest_dir()
    for f in ("vmlinuz", "initrd.img"):
        if not (guest / f).is_file():
            return f"{guest / f} is absent: run scripts/vm/build-guest.sh"
    return None


def make_microvm(client, image: str, memory_limit_mb: int = 512, **kw):
    from dsec import DSecMicroVMRunArgs

    return client.run_microvm(DSecMicroVMRunArgs(container_image=image, memory_limit_mb=memory_limit_mb, **kw), timeout=300)


def proc_cmdlines(sb) -> List[str]:
    """Command lines of every process in the sandbox, from /proc (no `ps`: the debian image has
    none, and busybox's `ps` formats differently)."""
    r = sb.run_shell("for p in /proc/[0-9]*; do tr '\\000' ' ' < $p/cmdline 2>/dev/null; echo; done")
    assert r.exit_code == 0, r
    return [line.strip() for line in r.stdout.splitlines() if line.strip()]


def http(method: str, url: str, key: str, body=None, timeout: float = 120):
    """One JSON request with the API key; answers (status, raw body), also for 4xx/5xx."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method)
    req.add_header("Authorization", f"Bearer {key}")
    if data is not None:
        req.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
