"""Test helpers shared by the two VM substrates' e2e files (`test_microvm.py`, `test_fullvm.py`):
finding QEMU processes by a path on their command line, and skipping (with the reason) when
QEMU or a guest artefact is absent."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Iterable, List, Optional

import pytest


def qemu_pids_for(path_fragment: str) -> List[int]:
    """QEMU processes whose command line mentions `path_fragment`."""
    pids = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            cmd = (p / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if cmd and b"qemu-system" in cmd[0] and any(path_fragment.encode() in a for a in cmd):
            pids.append(int(p.name))
    return pids


def missing(binaries: Iterable[str], files: Iterable[Path], how: str, build: str) -> Optional[str]:
    """Why a VM test cannot run: the first binary not on PATH (`how` installs it) or the first
    file absent (`build` makes it); None when everything is there."""
    for b in binaries:
        if shutil.which(b) is None:
            return f"{b} is not installed ({how})"
    for f in files:
        if not Path(f).is_file():
            return f"{f} is absent: run {build}"
    return None


def skip_if(reason: Optional[str]) -> None:
    """Skips the calling test (fixture) with `reason`, printed so the log says why."""
    if reason:
        print(f"\nSKIP: {reason}")
        pytest.skip(reason)
