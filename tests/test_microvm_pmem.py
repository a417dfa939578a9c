"""Garbage collection of the microVMs' virtio-pmem layer copies (issue 9): a layer attached as
virtio-pmem is a 2 MiB-padded copy of its file in `<cache>/pmem-layers` (shared by the edges of
a host). When the image is removed and nothing uses the copy, the edge removes it
(`crates/runtime/src/microvm/pmem.rs`) and logs the copies' total size.

One microVM boot (TCG: seconds of a core). Skips with the reason when QEMU or the guest
artefacts are absent, or when virtio-pmem is off (`DSEC_MICROVM_PMEM=0`).
"""

from __future__ import annotations

import io
import os
import tarfile
import time
import uuid
from pathlib import Path

import pytest

from helpers import DsecUp, find_dsec_bin, make_microvm, new_data_dir, remove_data_dir, stop_quietly
from vmfixture import qemu_pids_for


@pytest.fixture(scope="module")
def node(microvm_ok):
    """A node of its own on the `pc` machine: QEMU 7.2's `microvm` (the default) gives
    virtio-pmem regions no address, so only `pc` attaches layers as pmem copies."""
    binary = os.environ.get("DSEC_BIN") or find_dsec_bin()
    if not binary:
        pytest.skip("no dsec binary")
    data = new_data_dir("vmpmem")
    up = DsecUp(binary, data, f"pmem{os.getpid() % 100000}",
                env={"DSEC_MICROVM_MACHINE": "pc", "DSEC_MICROVM_TEMPLATES": "0"}).start()
    yield up
    up.stop()
    remove_data_dir(data)
    up.remove_log()


@pytest.fixture(scope="module")
def client(node):
    c = node.client()
    yield c
    c.close()


def _unique_busybox_tar(path: Path, mark: str) -> None:
    """A root with a static busybox and a file no other image has (so its layer is its own)."""
    bb = Path("/bin/busybox")
    if not bb.is_file():
        pytest.skip("/bin/busybox (busybox-static) is not installed")
    with tarfile.open(path, "w") as t:
        for d in ("bin", "etc", "tmp", "root", "proc", "sys", "dev"):
            ti = tarfile.TarInfo(d)
            ti.type, ti.mode = tarfile.DIRTYPE, 0o755
            t.addfile(ti)
        t.add(str(bb), "bin/busybox")
        ti = tarfile.TarInfo("bin/sh")
        ti.type, ti.linkname = tarfile.SYMTYPE, "busybox"
        t.addfile(ti)
        data = f"{mark}\n".encode()
        ti = tarfile.TarInfo("etc/pmem-gc-mark")
        ti.size = len(data)
        t.addfile(ti, io.BytesIO(data))


def test_pmem_copies_of_a_removed_image_are_removed(microvm_ok, client, node, tmp_path):
    if os.environ.get("DSEC_MICROVM_PMEM") == "0":
        pytest.skip("virtio-pmem is off (DSEC_MICROVM_PMEM=0)")
    name = f"pmemgc-{uuid.uuid4().hex[:8]}"
    tar = tmp_path / "root.tar"
    _unique_busybox_tar(tar, name)
    node.cli("image", "import", name, "--tar", str(tar), timeout=300)
    removed = False
    try:
        sb = make_microvm(client, name, memory_limit_mb=256)
        vm_dir = Path(node.sandbox_dir(sb.id)) / "vm"
        try:
            assert sb.run_shell("cat /etc/pmem-gc-mark").stdout == f"{name}\n"
            pids = qemu_pids_for(str(vm_dir))
            assert len(pids) == 1, pids
            args = Path(f"/proc/{pids[0]}/cmdline").read_bytes().split(b"\0")
            copies = sorted({Path(x.decode()[len("mem-path="):]) for a in args for x in a.split(b",")
                             if x.startswith(b"mem-path=") and x.endswith(b".pmem")})
            assert copies, f"no virtio-pmem copy on QEMU's command line: {args}"
            for c in copies:
                assert c.is_file(), c
                src = Path(f"{c}.src").read_text()
                assert any(Path(l).is_file() for l in src.splitlines() if not l.startswith("#")), src
        finally:
            stop_quietly(sb)
        # Still registered: the copies stay (a later create reuses them).
        assert all(c.is_file() for c in copies)
        node.cli("image", "rm", name)
        removed = True
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(c.exists() for c in copies):
            time.sleep(0.1)
        left = [str(c) for c in copies if c.exists() or Path(f"{c}.src").exists()]
        assert not left, f"virtio-pmem copies of a removed image left: {left}"
        # The sweep logged what the copies take.
        assert "virtio-pmem layer copies" in node.stderr_tail(400)
    finally:
        if not removed:
            node.cli("image", "rm", name, check=False)
