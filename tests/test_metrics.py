"""Per-sandbox metrics (issue 18, item 5): sampled by the edge over time, from the SDK and on
the edge's Prometheus `/metrics` with the sandbox id."""

from __future__ import annotations

import time
import urllib.request

from helpers import make_sandbox, stop_quietly


def wait_for(sb, pred, timeout=30.0):
    deadline = time.monotonic() + timeout
    samples = []
    while time.monotonic() < deadline:
        samples = sb.metrics()
        if samples and pred(samples):
            return samples
        time.sleep(0.5)
    return samples


def test_metrics_show_a_cpu_hog_and_a_memory_allocation(client, node, debian):
    sb = make_sandbox(client, debian, memory_limit_mb=512, cpu_cores_limit=1)
    try:
        first = wait_for(sb, lambda s: len(s) >= 1)
        assert first, "no metrics sample within 30 s"
        base = first[-1]
        assert base.memory_limit_bytes == 512 * 1024 * 1024 and base.cpu_limit_cores == 1
        assert base.disk_limit_bytes > 0 and base.pids >= 1
        # A CPU hog: its CPU time shows up and a sample shows the core in use (a share of it
        # only, on a loaded host: the threshold is low, an idle sandbox is at ~0).
        hog = sb.start("while :; do :; done")
        busy = wait_for(sb, lambda s: s[-1].cpu_percent > 5 and s[-1].cpu_time_s > base.cpu_time_s + 0.3,
                        timeout=60)
        assert busy[-1].cpu_percent > 5, [round(s.cpu_percent) for s in busy]
        hog.kill()
        # ~100 MB written (so resident) and held by a process.
        mem = sb.start("python3 -c \"import time; b = b'a' * 100_000_000; time.sleep(1000)\"")
        grown = wait_for(sb, lambda s: s[-1].memory_bytes > base.memory_bytes + 80_000_000, timeout=60)
        assert grown[-1].memory_bytes > base.memory_bytes + 80_000_000, grown[-1]
        mem.kill()
        samples = sb.metrics()
        assert len(samples) >= 3 and all(a.time_ms < b.time_ms for a, b in zip(samples, samples[1:]))
        # The edge's Prometheus endpoint carries the sandbox's gauges.
        edge_url = client.list_nodes()[0]["url"]
        with urllib.request.urlopen(f"{edge_url}/metrics", timeout=10) as r:
            text = r.read().decode()
        for name in ("dsec_edge_sandbox_cpu_seconds", "dsec_edge_sandbox_memory_limit_bytes"):
            lines = [l for l in text.splitlines() if l.startswith(name + "{") and f'sandbox="{sb.id}"' in l]
            assert lines, f"{name} of {sb.id} is not on the edge's /metrics"
    finally:
        stop_quietly(sb)
