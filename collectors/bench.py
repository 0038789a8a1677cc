"""``oomcast bench agent``: what the node agent costs a node.

The agent runs its real loop (``NodeAgent.run``) for a while at a given rate over memory
cgroups laid out in a temporary folder exactly as the kernel lays them out (one file per
figure, v2 names, PSI included), with their usage changing between reads, and publishes to
a real Redis. The figure that matters to an SRE is the CPU it takes: process CPU time over
wall time, in percent of one core, plus the cost of one tick (read every domain, embed,
publish). Reading a real cgroupfs costs about the same as reading these small files.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis

from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.model.wire import Keys

MIB = 1 << 20


def _write_domain(path: Path, used: int, limit: int) -> None:
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "memory.max": str(limit),
        "memory.current": str(used),
        "memory.peak": str(used),
        "memory.stat": f"anon {used * 3 // 4}\nfile {used // 4}\nkernel 8192\n",
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "cgroup.procs": "1\n",
    }
    for name, text in files.items():
        (path / name).write_text(text)


def bench_agent(
    redis_url: str, *, seconds: float = 10.0, hz: float = 10.0, domains: int = 8
) -> dict[str, Any]:
    """Run the agent for ``seconds`` at ``hz`` over ``domains`` cgroups; figures in a dict."""
    prefix = f"oomcast-bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1.0)
    client.ping()
    with tempfile.TemporaryDirectory(prefix="oomcast-bench-cg-") as tmp:
        root = Path(tmp)
        (root / "cgroup.controllers").write_text("cpu memory pids\n")
        limit = 4096 * MIB
        paths = [root / "kubepods.slice" / f"job-{i}.scope" for i in range(domains)]
        for p in paths:
            _write_domain(p, 1024 * MIB, limit)
        source = CgroupSource("bench-node", root, interval_s=1.0 / hz)
        agent = NodeAgent([source], StreamPublisher(client), Keys(prefix), interval_s=1.0 / hz)
        stop = threading.Event()
        ticks: list[float] = []
        real_tick = agent.tick

        def timed_tick() -> None:
            t0 = time.perf_counter()
            real_tick()
            ticks.append(time.perf_counter() - t0)
            # the workloads move: usage changes between reads (not counted in the tick)
            used = str((1024 + 8 * len(ticks)) * MIB)
            for p in paths:
                (p / "memory.current").write_text(used)

        agent.tick = timed_tick  # type: ignore[method-assign]
        timer = threading.Timer(seconds, stop.set)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        timer.start()
        agent.run(stop)
        cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
        timer.cancel()
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    # the bench's own file writes between ticks are in the process CPU time too: take them
    # out by the measured tick time share, and report both
    tick_cpu = sum(ticks)
    return {
        "hz": hz,
        "domains": domains,
        "seconds": round(wall, 2),
        "ticks": len(ticks),
        "samples_sent": agent.publisher.stats.samples_sent,
        "cpu_percent_of_one_core": round(100 * cpu / wall, 2),
        "tick_wall_percent": round(100 * tick_cpu / wall, 2),
        "us_per_tick_p50": round(statistics.median(ticks) * 1e6, 1) if ticks else None,
        "us_per_tick_p99": round(sorted(ticks)[int(len(ticks) * 0.99)] * 1e6, 1) if ticks else None,
        "us_per_sample": round(tick_cpu / max(1, agent.stats.samples) * 1e6, 1),
        "cpus": os.cpu_count(),
    }
