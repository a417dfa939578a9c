# dsec function worker: a fork-server started once per warm worker container.
#
# It imports common modules once, then serves ONE connection (the edge's) on a unix socket
# whose path is argv[1]; the socket file is removed and the listener closed as soon as the edge
# is connected, so nothing inside the sandbox can talk to the server afterwards.
#
# Frames both ways: 4-byte big-endian length + JSON. Per request the server forks one child per
# run. The child: new session, uid/gid 65534 (so it cannot touch the server, the image or files
# of root), the call's scratch dir (emptied and reset between calls) as cwd and HOME, the
# call's environment (set in the server when the call begins, so the child inherits it),
# rlimits (CPU, file size = output limit, core 0), oom_score_adj 1000, stdout/stderr into
# memfds. After every run everything except this server and PID 1 is SIGKILLed (kill(-1) with
# CAP_KILL) and reaped (the server is a child subreaper); after every call the scratch dir and
# the world-writable dirs are wiped. With `early` (on an `end` request) the answer goes out
# right after the last run, before that run's kill-and-reap and the wipe; a second frame then
# confirms the cleanup, and the edge lends the worker to no other call before it has read it.
#
# CPU per call matters more than anything else here (2 cores serve every call): every fork
# write-protects the server's whole heap, so the child does as little Python as possible
# before the program (each page it writes is a copy-on-write fault), and no child is kept
# alive while the server does its bookkeeping (the server's own writes would then copy too).
import base64, ctypes, gc, json, os, select, signal, socket, struct, sys, time, traceback, resource
import collections, itertools, functools, heapq, bisect, math, random, re, string, fractions
import decimal, statistics, typing, dataclasses, operator, copy, io, array, enum, datetime
# Imported only to be warm in every call's address space (named here so the linter knows).
WARM = (collections, itertools, functools, heapq, bisect, math, random, re, string, fractions,
        decimal, statistics, typing, dataclasses, operator, copy, array, enum, datetime)
try:
    import numpy  # warm if the image has it

    WARM += (numpy,)
except Exception:
    pass

NOBODY = 65534
# On the container's own root (its writable overlay layer): /dev/shm is noexec and small.
SCRATCH_ROOT = "/var/lib/dsec-fn"
SCRATCH = SCRATCH_ROOT + "/call"
_libc = ctypes.CDLL(None, use_errno=True)
PR_SET_CHILD_SUBREAPER = 36


def writable_dirs():
    out = []
    for d in ("/tmp", "/var/tmp", "/dev/shm", "/run/lock", "/dev/mqueue"):
        if os.path.isdir(d) and not os.path.islink(d):
            out.append(d)
    return out


WIPE = writable_dirs()


def recv_exact(conn, n):
    buf = bytearray()
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            raise EOFError
        buf += chunk
    return bytes(buf)


def recv_msg(conn):
    (n,) = struct.unpack(">I", recv_exact(conn, 4))
    return json.loads(recv_exact(conn, n))


def send_msg(conn, obj):
    data = json.dumps(obj).encode()
    conn.sendall(struct.pack(">I", len(data)) + data)


def survivors():
    me = os.getpid()
    out = []
    for p in os.listdir("/proc"):
        if p.isdigit() and int(p) not in (1, me):
            try:
                with open("/proc/%s/stat" % p) as f:
                    out.append(f.read()[:120])
            except OSError:
                pass
    return out


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid <= 0:
            return


def kill_everything():
    """SIGKILLs every process of the container but PID 1 and this one, reaps, until none."""
    me = os.getpid()
    for i in range(2000):
        reap()
        # Looked at first: with nothing left (the usual case) no kill(-1), which walks every
        # task on the host. A process that could fork would itself be listed.
        if not [p for p in os.listdir("/proc") if p.isdigit() and int(p) not in (1, me)]:
            return True
        try:
            os.kill(-1, signal.SIGKILL)
        except ProcessLookupError:
            pass
        reap()
        if i:
            time.sleep(0.0005)
    return False


def wipe(path, keep_self=False):
    try:
        entries = list(os.scandir(path))
    except OSError:
        return
    for e in entries:
        p = e.path
        if p == SCRATCH_ROOT and keep_self:
            wipe(p)
            continue
        try:
            if e.is_dir(follow_symlinks=False):
                wipe(p)
                os.rmdir(p)
            else:
                os.unlink(p)
        except OSError:
            pass


def child(run, stdin_fd, out_fd, err_fd, scratch, cpu_ms, fsize):
    try:
        os.setsid()
        for fd, target in ((stdin_fd, 0), (out_fd, 1), (err_fd, 2)):
            os.dup2(fd, target)
        os.closerange(3, 65536)
        try:
            fd = os.open("/proc/self/oom_score_adj", os.O_WRONLY)
            os.write(fd, b"1000")
            os.close(fd)
        except OSError:
            pass
        os.setgroups([])
        os.setgid(NOBODY)
        os.setuid(NOBODY)
        secs = max(1, (cpu_ms + 999) // 1000)
        resource.setrlimit(resource.RLIMIT_CPU, (secs, secs + 1))
        resource.setrlimit(resource.RLIMIT_FSIZE, (fsize + 1, fsize + 1))
        if run["kind"] == "python":
            path = run["code_path"]
            fd = os.open(path, os.O_RDONLY)
            chunks = []
            while True:
                b = os.read(fd, 1 << 20)
                if not b:
                    break
                chunks.append(b)
            os.close(fd)
            src = b"".join(chunks)
            sys.argv = [path] + list(run.get("args", []))
            sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)))
            sys.stdout = io.TextIOWrapper(io.BufferedWriter(io.FileIO(1, "w", closefd=False)), write_through=False)
            sys.stderr = io.TextIOWrapper(io.BufferedWriter(io.FileIO(2, "w", closefd=False)), write_through=True)
            sys.path[0] = scratch
            code = 0
            try:
                g = {"__name__": "__main__", "__file__": path, "__builtins__": __builtins__}
                exec(compile(src, path, "exec"), g)
            except SystemExit as e:
                c = e.code
                if c is None:
                    code = 0
                elif isinstance(c, int):
                    code = c & 0xFF
                else:
                    sys.stderr.write(str(c) + "\n")
                    code = 1
            except BaseException as e:
                # The traceback starts at the program, as with a plain interpreter.
                tb = e.__traceback__.tb_next if e.__traceback__ is not None else None
                traceback.print_exception(type(e), e, tb)
                code = 1
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            except BaseException:
                code = code or 1
            os._exit(code)
        else:
            os.execvp(run["argv"][0], run["argv"])
    except BaseException as e:
        try:
            os.write(2, ("dsec worker: cannot start the program: %s\n" % e).encode())
        except OSError:
            pass
    os._exit(127)


def read_fd(fd, limit):
    size = os.fstat(fd).st_size
    data = os.pread(fd, min(size, limit), 0)
    return data, size


def run_once(step, scratch, kill=True):
    timeout_ms, cpu_ms, fsize, keep = step["timeout_ms"], step["cpu_ms"], step["fsize"], step["keep"]
    stdin_fd = os.memfd_create("stdin")
    os.write(stdin_fd, base64.b64decode(step["stdin"]))
    os.lseek(stdin_fd, 0, 0)
    out_fd = os.memfd_create("stdout")
    err_fd = os.memfd_create("stderr")
    started = time.monotonic()
    pid = os.fork()
    if pid == 0:
        child(step["run"], stdin_fd, out_fd, err_fd, scratch, cpu_ms, fsize)
    os.close(stdin_fd)
    timed_out = False
    pfd = os.pidfd_open(pid)
    try:
        r, _, _ = select.select([pfd], [], [], timeout_ms / 1000.0)
        if not r:
            timed_out = True
            os.kill(pid, signal.SIGKILL)
    finally:
        os.close(pfd)
    _, status, ru = os.wait4(pid, 0)
    wall_ms = (time.monotonic() - started) * 1000.0
    cpu = (ru.ru_utime + ru.ru_stime) * 1000.0
    clean = kill_everything() if kill else True
    out, out_size = read_fd(out_fd, keep)
    err, err_size = read_fd(err_fd, keep)
    os.close(out_fd)
    os.close(err_fd)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else 128 + (sig or 0)
    return {
        "exit": code,
        "signal": sig,
        "stdout": base64.b64encode(out).decode(),
        "stderr": base64.b64encode(err).decode(),
        "stdout_size": out_size,
        "stderr_size": err_size,
        "wall_ms": wall_ms,
        "cpu_ms": cpu,
        "timed_out": timed_out,
        "cpu_exceeded": sig == signal.SIGXCPU or (sig == signal.SIGKILL and cpu >= cpu_ms),
        "output_exceeded": sig == signal.SIGXFSZ or out_size > fsize or err_size > fsize,
    }, clean


ENV = None  # the environment last set in os.environ (None: the one the server started with)


def fresh_scratch():
    """The call's scratch dir, emptied by the previous call's cleanup (`Call.finish` fails the
    cleanup if anything is left in it) and reset here: owner, mode, extended attributes (ACLs
    included) and times. One dir reused on the overlay's ext4 upper layer instead of a mkdir and
    rmdir per call (inode and block allocation, and a discard per freed dir block)."""
    if not os.path.isdir(SCRATCH):
        os.mkdir(SCRATCH, 0o700)
    os.chown(SCRATCH, NOBODY, NOBODY, follow_symlinks=False)
    os.chmod(SCRATCH, 0o700)
    for name in os.listxattr(SCRATCH):
        os.removexattr(SCRATCH, name)
    os.utime(SCRATCH)
    return SCRATCH


class Call:
    def __init__(self, begin):
        self.scratch = fresh_scratch()
        os.chdir(self.scratch)  # the server's cwd: inherited by the runs
        self.env = {
            "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
            "HOME": self.scratch,
            "TMPDIR": self.scratch,
            "LANG": "C.UTF-8",
            "PWD": self.scratch,
        }
        self.env.update(begin.get("env", {}))
        # The server's own environment becomes the call's: a forked run inherits it (both
        # os.environ and the C environ), with no per-run work in the child. Only a child can
        # change its copy, so the server's stays as set here until the next call that differs.
        global ENV
        if self.env != ENV:
            ENV = None  # until set in full (an update that fails leaves a mix)
            os.environ.clear()
            os.environ.update(self.env)
            ENV = dict(self.env)
        for name, b64 in begin.get("files", {}).items():
            placed = call_path(name, self.scratch)
            if placed is None:
                continue
            base, parts = placed
            for i in range(1, len(parts)):
                d = os.path.join(base, *parts[:i])
                if not os.path.isdir(d):
                    os.mkdir(d, 0o755)
                    os.chown(d, NOBODY, NOBODY)
            p = os.path.join(base, *parts)
            with open(p, "wb") as f:
                f.write(base64.b64decode(b64))
            os.chown(p, NOBODY, NOBODY)
            os.chmod(p, 0o755)

    def finish(self):
        wipe(self.scratch)
        for d in WIPE:
            wipe(d, keep_self=True)
        try:
            return not os.listdir(self.scratch)
        except OSError:
            return False


def call_path(name, scratch):
    """(base dir, components) of a call's file: relative to the scratch dir, or absolute under
    one of the wiped dirs; None for anything else."""
    base = scratch
    if name.startswith("/"):
        base = next((d for d in WIPE if name.startswith(d + "/")), None)
        if base is None:
            return None
        name = name[len(base) + 1:]
    parts = [x for x in name.split("/") if x not in ("", ".")]
    if not parts or ".." in parts:
        return None
    return base, parts


FETCH_LIMIT = 64 << 20  # bytes fetched back per call, in total


def fetch(names, scratch):
    """The files named, read after the runs: name -> base64. A file is read only if no
    component of its path is a symbolic link (the program could point one anywhere) and it
    is a regular file; missing ones are left out."""
    out, total = {}, 0
    for name in names:
        placed = call_path(name, scratch)
        if placed is None:
            continue
        base, parts = placed
        p, ok = base, True
        for c in parts:
            p = os.path.join(p, c)
            try:
                st = os.lstat(p)
            except OSError:
                ok = False
                break
            if stat_is_link(st.st_mode):
                ok = False
                break
        if not ok or not stat_is_reg(st.st_mode) or total + st.st_size > FETCH_LIMIT:
            continue
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            data = os.read(fd, st.st_size + 1)[: st.st_size] if st.st_size else b""
        finally:
            os.close(fd)
        total += len(data)
        out[name] = base64.b64encode(data).decode()
    return out


def stat_is_link(mode):
    return (mode & 0o170000) == 0o120000


def stat_is_reg(mode):
    return (mode & 0o170000) == 0o100000


def serve(req, state, conn):
    clean = True
    results = []
    if req.get("reap"):
        # The edge swept leftovers from outside: reap them, re-check, re-wipe.
        if state.get("call") is not None:
            state["call"].finish()
            state["call"] = None
        clean = kill_everything()
        wipe(SCRATCH_ROOT)
        for d in WIPE:
            wipe(d, keep_self=True)
        clean = clean and not os.listdir(SCRATCH_ROOT)
        return {"results": [], "clean": clean, "survivors": [] if clean else survivors()}
    if req.get("begin") is not None:
        if state.get("call") is not None:
            state["call"].finish()
        state["call"] = Call(req["begin"])
    call = state.get("call")
    if call is None:
        return {"error": "no call begun", "clean": False}
    steps = req.get("steps", [])
    early = bool(req.get("early")) and bool(req.get("end"))
    for i, step in enumerate(steps):
        # With `early`, the last run's leftovers are killed after the answer has gone out.
        res, ok = run_once(step, call.scratch, kill=not (early and i == len(steps) - 1))
        clean = clean and ok
        results.append(res)
        failed = res["exit"] != 0 or res["signal"] is not None or res["timed_out"]
        if failed and req.get("stop_on_fail"):
            break
    files = {}
    if req.get("fetch"):
        # Nothing of the call may still run while its files are read back (it could swap a
        # directory for a symbolic link between the checks and the read).
        if early:
            clean = kill_everything() and clean
        files = fetch(req["fetch"], call.scratch)
    if early:
        # The answer now; the cleanup's outcome in a second frame.
        send_msg(conn, {"results": results, "clean": clean, "pending": True, "files": files})
        clean = kill_everything() and clean
    if req.get("end"):
        clean = call.finish() and clean
        state["call"] = None
    if early:
        return {"results": [], "clean": clean, "survivors": [] if clean else survivors()}
    return {"results": results, "clean": clean, "survivors": [] if clean else survivors(),
            "files": files}


def main():
    sock_path = sys.argv[1]
    _libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    # Inherited by every run, so set once here: no core dumps; SIGPIPE and SIGXFSZ (the output
    # limit) kill, as in a plain process (Python ignores both); SIGINT not Python's handler.
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT):
        signal.signal(sig, signal.SIG_DFL)
    os.makedirs(SCRATCH_ROOT, 0o711, exist_ok=True)
    os.chmod(SCRATCH_ROOT, 0o711)
    os.makedirs(os.path.dirname(sock_path), 0o700, exist_ok=True)
    lst = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    lst.bind(sock_path)
    lst.listen(1)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    lst.settimeout(30)
    conn, _ = lst.accept()
    lst.close()
    os.unlink(sock_path)
    conn.settimeout(None)
    # Everything imported so far goes to the GC's permanent generation: a forked call's
    # collections then never touch (and copy-on-write) the warm runtime's pages.
    gc.collect()
    gc.freeze()
    state = {}
    while True:
        try:
            req = recv_msg(conn)
        except EOFError:
            return
        try:
            answer = serve(req, state, conn)
        except Exception:
            answer = {"error": traceback.format_exc(), "clean": False}
        send_msg(conn, answer)


if __name__ == "__main__":
    main()
