"""Isolation as seen from inside a sandbox (and checked against the host where that is the truth)."""

from __future__ import annotations

import hashlib
import os
import shutil
import socket
import subprocess
import uuid

import pytest

from helpers import dsec_processes, make_sandbox, sh, stop_quietly

# capability bits (linux/capability.h)
CAP_SYS_MODULE = 16
CAP_SYS_RAWIO = 17
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_MKNOD = 27


def status_fields(sb) -> dict:
    out = sh(sb, "cat /proc/self/status")
    fields = {}
    for line in out.splitlines():
        k, _, v = line.partition(":")
        fields[k.strip()] = v.strip()
    return fields


def test_pid1_is_aether_and_only_sandbox_processes_visible(bb):
    # The session shell's parent is PID 1 ...
    ppid = sh(bb, "awk '/^PPid/{print $2}' /proc/$$/status").strip()
    assert ppid == "1", f"the session shell's parent is pid {ppid!r}, not 1"
    # ... which is hidden from the sandbox's /proc (aether is non-dumpable; hidepid=invisible) ...
    assert sh(bb, "test -e /proc/1 && echo visible || echo hidden").strip() == "hidden"
    # ... and is aether: seen from the host, the sandbox process whose innermost pid is 1.
    inits = []
    for pid in dsec_processes(bb.id):
        try:
            st = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        nspid = [l for l in st.splitlines() if l.startswith("NSpid:")][0].split()
        if nspid[-1] == "1":
            inits.append([l for l in st.splitlines() if l.startswith("Name:")][0].split()[1])
    assert inits == ["dsec-aether"], f"PID 1 of the sandbox is {inits}"
    listing = sh(bb, "for p in /proc/[0-9]*; do echo \"${p#/proc/} $(cat $p/comm 2>/dev/null)\"; done")
    procs = [line.split(None, 1) for line in listing.splitlines() if line.strip()]
    comms = {p[1] if len(p) > 1 else "" for p in procs}
    # the host runs pytest (python3) and `dsec up` (dsec); neither may be visible
    for host_comm in ("dsec", "python3", "pytest", "systemd", "init", "sshd"):
        assert host_comm not in comms, f"host process {host_comm!r} visible inside: {procs}"
    assert len(procs) < 12, f"too many processes visible inside a fresh sandbox: {procs}"
    # the pids are those of a new pid namespace (small numbers; PID 1 itself is hidden)
    assert max(int(p[0]) for p in procs) < 100, procs


def test_own_hostname(client):
    sb = make_sandbox(client, "busybox", hostname="box-e2e")
    try:
        assert sh(sb, "hostname").strip() == "box-e2e"
        assert sh(sb, "cat /proc/sys/kernel/hostname").strip() == "box-e2e"
        # changing it (if allowed at all) must not touch the host
        sb.run_shell("hostname changed-inside 2>/dev/null")
        assert socket.gethostname() != "changed-inside"
    finally:
        stop_quietly(sb)
    sb2 = make_sandbox(client, "busybox")
    try:
        assert sh(sb2, "hostname").strip() != socket.gethostname(), "default hostname is the host's"
    finally:
        stop_quietly(sb2)


def test_own_root_and_host_files_absent(bb):
    marker = f"/tmp/dsec-e2e-marker-{uuid.uuid4().hex}"
    with open(marker, "w") as f:
        f.write("host secret\n")
    try:
        for path in (marker, f"/proc/1/root{marker}", f"/proc/self/root{marker}", f"/proc/1/cwd{marker}"):
            r = bb.run_shell(f"cat {path}")
            assert r.exit_code != 0 and "host secret" not in r.stdout, f"host file readable inside via {path}"
        r = bb.run_shell(f"ls /proc/*/root{marker} 2>/dev/null")
        assert "host secret" not in r.stdout and marker not in r.stdout
        # chroot-escape attempt via .. from /proc/1/root stays inside
        r = bb.run_shell(f"cd /proc/1/root/../../../../ 2>/dev/null && cat .{marker}")
        assert "host secret" not in r.stdout
    finally:
        os.unlink(marker)


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def test_writes_land_in_upper_dir_and_layers_unchanged(node, client):
    sb = make_sandbox(client, "busybox")
    try:
        layers = node.layer_files()
        assert layers, f"no layer files under {node.data_dir}/edge/images/layers"
        before = {p: sha256_file(p) for p in layers}
        sh(sb, "echo written-inside > /etc/e2e-new-file && echo appended >> /etc/passwd && rm /bin/arch && mkdir -p /root/d && echo x > /root/d/f")
        upper = os.path.join(node.sandbox_dir(sb.id), "upper")
        assert os.path.isdir(upper), f"no upper dir at {upper}"
        with open(os.path.join(upper, "etc", "e2e-new-file")) as f:
            assert f.read() == "written-inside\n"
        with open(os.path.join(upper, "etc", "passwd")) as f:
            assert f.read().endswith("appended\n")
        assert os.path.exists(os.path.join(upper, "root", "d", "f"))
        vi = os.path.join(upper, "bin", "arch")
        assert os.path.lexists(vi), "deleting an image file left no whiteout in the upper dir"
        st = os.lstat(vi)
        assert (st.st_mode & 0o170000) == 0o020000 and st.st_rdev == 0, "whiteout is not a 0/0 char device"
        # the sandbox sees its own changes
        assert "appended" in sh(sb, "cat /etc/passwd")
        assert sb.run_shell("test -e /bin/arch").exit_code != 0
        after = {p: sha256_file(p) for p in node.layer_files() if p in before}
        assert after == before, "an image layer file changed after writes inside a sandbox"
    finally:
        stop_quietly(sb)


def test_two_sandboxes_of_one_image_do_not_share_writes(client):
    a = make_sandbox(client, "busybox")
    b = make_sandbox(client, "busybox")
    try:
        sh(a, "echo from-a > /tmp/shared-test && echo from-a > /etc/shared-test && rm -f /bin/arch")
        r = b.run_shell("cat /tmp/shared-test /etc/shared-test")
        assert r.exit_code != 0 and "from-a" not in r.stdout
        assert b.run_shell("test -e /bin/arch").exit_code == 0, "a deletion in one sandbox is visible in another"
        # and their processes are separate too
        sh(a, "sleep 1000 >/dev/null 2>&1 &")
        assert "sleep" not in sh(b, "cat /proc/[0-9]*/comm 2>/dev/null")
    finally:
        stop_quietly(a)
        stop_quietly(b)


MASKED_READ = [
    "/proc/kcore",
    "/proc/kpagecgroup",
    "/proc/kpageflags",
    "/proc/kpagecount",
    "/proc/timer_list",
    "/proc/keys",
]


@pytest.mark.parametrize("path", MASKED_READ)
def test_masked_proc_entries_unreadable(bb, path):
    r = bb.run_shell(f"head -c 4096 {path} | wc -c")
    n = int(r.stdout.strip() or "0")
    assert n == 0, f"{path} returned {n} bytes inside the sandbox"


def test_sys_firmware_masked(bb):
    r = bb.run_shell("ls -A /sys/firmware 2>/dev/null | wc -l")
    assert r.stdout.strip() == "0", f"/sys/firmware not masked: {bb.run_shell('ls -A /sys/firmware').stdout!r}"


def test_sysrq_trigger_write_has_no_effect(bb):
    def help_lines() -> int:
        if shutil.which("dmesg") is None:
            pytest.skip("dmesg not available on the host to observe sysrq")
        out = subprocess.run(["dmesg"], capture_output=True, text=True).stdout
        return out.count("sysrq: HELP")

    before = help_lines()
    r = bb.run_shell("echo h > /proc/sysrq-trigger")
    after = help_lines()
    assert after == before, f"writing /proc/sysrq-trigger inside reached the host kernel (exit {r.exit_code})"


def test_root_inside_cannot_mount_umount_unshare_mknod(client):
    sb = make_sandbox(client, "busybox", init_user="root")
    try:
        assert sh(sb, "id -u").strip() == "0"
        checks = {
            "mount tmpfs": "mkdir -p /mnt/t && mount -t tmpfs none /mnt/t",
            "mount proc": "mkdir -p /mnt/p && mount -t proc proc /mnt/p",
            "bind mount": "mkdir -p /mnt/b && mount --bind / /mnt/b",
            "umount /proc": "umount /proc",
            "umount -l /": "umount -l /",
            "unshare mount ns": "unshare -m true",
            "unshare net ns": "unshare -n true",
            "mknod block device": "mknod /tmp/blk b 8 0",
            "pivot_root": "mkdir -p /tmp/pr && pivot_root /tmp /tmp/pr",
        }
        failures = []
        for what, cmd in checks.items():
            r = sb.run_shell(cmd)
            if r.exit_code == 0:
                failures.append(what)
        assert not failures, f"privileged operations succeeded inside the sandbox: {failures}"
        assert sb.run_shell("test -b /tmp/blk").exit_code != 0
    finally:
        stop_quietly(sb)


def test_unshare_user_namespace_denied(bb):
    # a new user namespace would hand root inside CAP_SYS_ADMIN over new mount namespaces
    r = bb.run_shell("unshare -U -r -m true")
    assert r.exit_code != 0, "unshare of a user namespace (+mount ns) succeeded inside the sandbox"


def test_pid1_private_files_unreadable(bb):
    for cmd in ("cat /proc/1/environ", "ls /proc/1/fd", "head -c 1 /proc/1/mem", "ls /proc/1/task/1/fd",
                "readlink /proc/1/fd/3", "ls /proc/2/fd", "cat /proc/2/environ"):
        r = bb.run_shell(cmd)
        assert r.exit_code != 0, f"`{cmd}` succeeded inside the sandbox: {r.stdout[:200]!r}"


def test_capabilities_no_new_privs_seccomp(bb):
    fields = status_fields(bb)
    cap_eff = int(fields["CapEff"], 16)
    cap_bnd = int(fields["CapBnd"], 16)
    for name, bit in (("SYS_ADMIN", CAP_SYS_ADMIN), ("SYS_PTRACE", CAP_SYS_PTRACE), ("SYS_MODULE", CAP_SYS_MODULE),
                      ("SYS_RAWIO", CAP_SYS_RAWIO), ("MKNOD", CAP_MKNOD)):
        assert not cap_eff & (1 << bit), f"CAP_{name} is effective inside (CapEff={fields['CapEff']})"
        assert not cap_bnd & (1 << bit), f"CAP_{name} is in the bounding set (CapBnd={fields['CapBnd']})"
    assert fields.get("NoNewPrivs") == "1", f"NoNewPrivs={fields.get('NoNewPrivs')}"
    assert fields.get("Seccomp") == "2", f"Seccomp={fields.get('Seccomp')} (2 = filter)"


PY_SYSCALLS = r"""
import ctypes, ctypes.util, errno, os, sys
libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
libc.syscall.restype = ctypes.c_long
PTRACE_ATTACH = 16
def check(name, rc):
    e = ctypes.get_errno()
    print(f"{name} rc={rc} errno={errno.errorcode.get(e, e)}")
libc.ptrace.restype = ctypes.c_long
check("ptrace_attach_1", libc.ptrace(PTRACE_ATTACH, 1, None, None))
# init_module(image, len, params) = 175, finit_module(fd, params, flags) = 313 on x86_64
img = ctypes.create_string_buffer(b"\x7fELF" + b"\0" * 60)
check("init_module", libc.syscall(175, img, ctypes.c_ulong(64), ctypes.c_char_p(b"")))
fd = os.open("/bin/true", os.O_RDONLY)
check("finit_module", libc.syscall(313, fd, ctypes.c_char_p(b""), 0))
"""


def test_ptrace_and_module_loading_denied(deb):
    deb.write_file("/tmp/sys.py", PY_SYSCALLS)
    out = sh(deb, "python3 /tmp/sys.py")
    lines = dict(line.split(" ", 1) for line in out.strip().splitlines())
    assert lines["ptrace_attach_1"].startswith("rc=-1"), f"ptrace(ATTACH, 1) succeeded: {out}"
    assert lines["ptrace_attach_1"].split("errno=")[1] in ("EPERM", "EACCES"), out
    for name in ("init_module", "finit_module"):
        assert lines[name] == "rc=-1 errno=EPERM", f"{name}: {lines[name]} (want EPERM)"


def test_ptrace_pid1_compiled(deb):
    src = r"""
#include <errno.h>
#include <stdio.h>
#include <string.h>
#include <sys/ptrace.h>
int main(void) {
    long rc = ptrace(PTRACE_SEIZE, 1, 0, 0);
    printf("%ld %s\n", rc, rc < 0 ? strerror(errno) : "ok");
    return rc < 0 ? 0 : 1;
}
"""
    deb.write_file("/tmp/pt.c", src)
    r = deb.run_shell("command -v gcc >/dev/null || exit 77; gcc -o /tmp/pt /tmp/pt.c && /tmp/pt", timeout=120)
    if r.exit_code == 77:
        pytest.skip("gcc is not in the debian image")
    assert r.exit_code == 0, f"PTRACE_SEIZE of PID 1 succeeded or build failed: {r.stdout} {r.stderr}"
