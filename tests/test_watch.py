"""File watch (issue 18, item 4): inotify inside the sandbox, streamed to the client.

A shell command inside the sandbox changes files; the watcher must see every change in order;
once the watcher is closed its inotify instance is gone from the sandbox's agent (checked from
the host in /proc) and no more events are delivered.
"""

from __future__ import annotations

import os
import time

import pytest

import dsec
from helpers import dsec_processes, make_sandbox, sh, stop_quietly


@pytest.fixture(scope="module")
def box(client):
    sb = make_sandbox(client, "busybox")
    yield sb
    stop_quietly(sb)


def inotify_fds(sandbox_id: str) -> int:
    """inotify instances held by the sandbox's agent (seen from the host)."""
    n = 0
    for pid, (comm, _cg) in dsec_processes(sandbox_id).items():
        if not comm.startswith("dsec-aether"):
            continue
        try:
            for fd in os.listdir(f"/proc/{pid}/fd"):
                try:
                    if os.readlink(f"/proc/{pid}/fd/{fd}") == "anon_inode:inotify":
                        n += 1
                except OSError:
                    pass
        except OSError:
            pass
    return n


def collect(w, until, timeout=20.0):
    """Events from `w` until `until(events)` holds (or the timeout)."""
    events = []
    deadline = time.monotonic() + timeout
    while not until(events) and time.monotonic() < deadline:
        ev = w.next(timeout=max(0.1, deadline - time.monotonic()))
        if ev is not None:
            events.append(ev)
    return events


def test_watch_sees_a_shell_commands_changes_in_order(box):
    sh(box, "rm -rf /tmp/w && mkdir -p /tmp/w")
    w = box.watch("/tmp/w")
    try:
        assert inotify_fds(box.id) == 1
        sh(box, "cd /tmp/w && echo one > a && mkdir d")
        # A new dir's own watch is in place when its create event is delivered: what happens
        # inside it from then on is seen too.
        events = collect(w, lambda evs: any(e.kind == "create" and e.path == "/tmp/w/d" for e in evs))
        sh(box, "cd /tmp/w && echo two > d/b && mv a c && chmod 600 c && rm c && rm d/b && rmdir d")
        events += collect(w, lambda evs: any(e.kind == "remove" and e.path == "/tmp/w/d" for e in evs))
    finally:
        w.close()
    seen = []
    for e in events:
        # A file made in a new dir just as its watch is added is seen by the watch and by the
        # scan of the new dir: once is enough.
        if not seen or seen[-1] != (e.kind, e.path, e.to):
            seen.append((e.kind, e.path, e.to))
    want = [
        ("create", "/tmp/w/a", None),
        ("write", "/tmp/w/a", None),
        ("create", "/tmp/w/d", None),
        ("create", "/tmp/w/d/b", None),
        ("write", "/tmp/w/d/b", None),
        ("rename", "/tmp/w/a", "/tmp/w/c"),
        ("chmod", "/tmp/w/c", None),
        ("remove", "/tmp/w/c", None),
        ("remove", "/tmp/w/d/b", None),
        ("remove", "/tmp/w/d", None),
    ]
    assert seen == want, seen
    assert [e.is_dir for e in events if e.path == "/tmp/w/d"] == [True, True]


def test_events_stop_when_the_watcher_closes(box):
    sh(box, "rm -rf /tmp/w2 && mkdir -p /tmp/w2")
    before = inotify_fds(box.id)
    w = box.watch("/tmp/w2", recursive=False)
    sh(box, "touch /tmp/w2/x")
    assert [e.kind for e in collect(w, lambda evs: len(evs) >= 1)][:1] == ["create"]
    w.close()
    assert w.closed
    deadline = time.monotonic() + 10
    while inotify_fds(box.id) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert inotify_fds(box.id) == before, "the agent kept the inotify instance of a closed watcher"
    sh(box, "touch /tmp/w2/y")
    assert w.next(timeout=0.5) is None


def test_watch_errors_say_what_is_wrong(box):
    with pytest.raises(dsec.FileNotFound):
        box.watch("/no/such/dir")
    sh(box, "echo x > /tmp/plainfile")
    with pytest.raises(dsec.BadRequest, match="not a directory"):
        box.watch("/tmp/plainfile")
    with pytest.raises(dsec.BadRequest, match="absolute"):
        box.watch("relative/dir")
    assert inotify_fds(box.id) == 0
