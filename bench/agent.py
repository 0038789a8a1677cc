"""``oomcast bench agent``: what the node agent costs a node.

The agent runs its real loop (``NodeAgent.run``) for a while at a given rate over memory
cgroups laid out in a temporary folder exactly as the kernel lays them out (one file per
figure, v2 names, PSI included) and over GPUs answered by the fake NVML module
(``bench/fake_nvml.py``, one compute process each: this process, so the ``/proc``
lookups are real), with usage changing between reads, and publishes to a real Redis.

The figure that matters to an SRE is the CPU it takes: ``cpu_pct`` is the process's CPU
time over wall time, in percent of one core, less what the bench itself spends moving the
workloads between ticks (rewriting ``memory.current``, setting the fake GPUs' use), which
is measured and reported apart (``bench_cpu_pct``). Reading a real cgroupfs costs about the
same as reading these small files on a memory file system (``/dev/shm``, where there is
one); a real NVML call costs more than the fake's (tens of
microseconds per query on a busy driver), which this bench does not try to imitate.
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
from oomcast.collectors.nvml import Nvml
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.base import Source
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.collectors.sources.nvml import NvmlSource
from oomcast.model.wire import Keys

MIB = 1 << 20
GIB = 1 << 30
SHM = Path("/dev/shm")


def _tree_dir() -> str | None:
    """Where to lay the cgroup files out: a memory file system, as cgroupfs is, when there
    is one (a disk file system journals the bench's writes and the peak resets, which a
    cgroupfs never does); else the default temporary folder."""
    if SHM.is_dir() and os.access(SHM, os.W_OK):
        return str(SHM)
    return None


# the keys of a v2 memory.stat on a 6.x kernel, in its order: the agent reads one of them,
# but a real file has all of them to get through
STAT_KEYS = [
    "anon",
    "file",
    "kernel",
    "kernel_stack",
    "pagetables",
    "sec_pagetables",
    "percpu",
    "sock",
    "vmalloc",
    "shmem",
    "zswap",
    "zswapped",
    "file_mapped",
    "file_dirty",
    "file_writeback",
    "swapcached",
    "anon_thp",
    "file_thp",
    "shmem_thp",
    "inactive_anon",
    "active_anon",
    "inactive_file",
    "active_file",
    "unevictable",
    "slab_reclaimable",
    "slab_unreclaimable",
    "slab",
    "workingset_refault_anon",
    "workingset_refault_file",
    "workingset_activate_anon",
    "workingset_activate_file",
    "workingset_restore_anon",
    "workingset_restore_file",
    "workingset_nodereclaim",
    "pgscan",
    "pgsteal",
    "pgscan_kswapd",
    "pgscan_direct",
    "pgscan_khugepaged",
    "pgsteal_kswapd",
    "pgsteal_direct",
    "pgsteal_khugepaged",
    "pgfault",
    "pgmajfault",
    "pgrefill",
    "pgactivate",
    "pgdeactivate",
    "pglazyfree",
    "pglazyfreed",
    "zswpin",
    "zswpout",
    "zswpwb",
    "thp_fault_alloc",
    "thp_collapse_alloc",
    "thp_swpout",
    "thp_swpout_fallback",
]


def _stat_text(used: int) -> str:
    values = {"anon": used * 3 // 4, "file": used // 4, "kernel": 8192}
    return "".join(f"{k} {values.get(k, 4096 * i)}\n" for i, k in enumerate(STAT_KEYS))


def _write_domain(path: Path, used: int, limit: int | None, procs: str = "1\n") -> None:
    path.mkdir(parents=True, exist_ok=True)
    files = {
        "memory.max": "max" if limit is None else str(limit),
        "memory.current": str(used),
        "memory.peak": str(used),
        "memory.stat": _stat_text(used),
        "memory.events": "low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\noom_group_kill 0\n",
        "memory.pressure": "some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n"
        "full avg10=0.00 avg60=0.00 avg300=0.00 total=0\n",
        "cgroup.procs": procs,
    }
    for name, text in files.items():
        (path / name).write_text(text)


def _fake_gpus(n: int) -> Any:
    """A fake NVML module with ``n`` 80 GiB GPUs, each running this process."""
    from oomcast.bench.fake_nvml import FakeGpu, FakeNvml

    pid = os.getpid()
    return FakeNvml([FakeGpu(used=20 * GIB, processes=[(pid, 20 * GIB)]) for _ in range(n)])


def bench_agent(
    redis_url: str,
    *,
    seconds: float = 10.0,
    hz: float = 10.0,
    domains: int = 8,
    gpus: int = 8,
) -> dict[str, Any]:
    """Run the agent for ``seconds`` at ``hz`` over ``domains`` cgroups and ``gpus`` fake
    GPUs; figures in a dict."""
    if domains < 0 or gpus < 0 or domains + gpus == 0:
        raise ValueError(f"domains={domains}, gpus={gpus}: give at least one of either")
    prefix = f"oomcast-bench-{uuid.uuid4().hex[:8]}"
    client = redis.Redis.from_url(redis_url, socket_connect_timeout=1.0)
    client.ping()
    with tempfile.TemporaryDirectory(prefix="oomcast-bench-cg-", dir=_tree_dir()) as tmp:
        root = Path(tmp)
        (root / "cgroup.controllers").write_text("cpu memory pids\n")
        limit = 4096 * MIB
        # the jobs' parent, as on a node: no limit, no processes of its own, and the OOM
        # counter the source reads each tick for kills of jobs removed right after
        _write_domain(root / "kubepods.slice", 8 * 1024 * MIB, None, procs="")
        paths = [root / "kubepods.slice" / f"job-{i}.scope" for i in range(domains)]
        for p in paths:
            _write_domain(p, 1024 * MIB, limit)
        owned: list[CgroupSource | NvmlSource] = []
        if domains:
            owned.append(CgroupSource("bench-node", root, interval_s=1.0 / hz))
        fake = _fake_gpus(gpus)
        if gpus:
            owned.append(NvmlSource("bench-node", Nvml(fake), interval_s=1.0 / hz))
        sources: list[Source] = [*owned]
        agent = NodeAgent(sources, StreamPublisher(client), Keys(prefix), interval_s=1.0 / hz)
        stop = threading.Event()
        ticks: list[float] = []
        bench_cpu = [0.0]  # CPU the bench spends moving the workloads, not the agent's
        real_tick = agent.tick

        def timed_tick() -> None:
            t0 = time.perf_counter()
            real_tick()
            ticks.append(time.perf_counter() - t0)
            c0 = time.process_time()
            # the workloads move: usage changes between reads (not counted as the agent's)
            used = (1024 + 8 * len(ticks)) * MIB
            for p in paths:
                (p / "memory.current").write_text(str(used))
            for gpu in fake.gpus:
                gpu.used = 20 * GIB + used
            bench_cpu[0] += time.process_time() - c0

        agent.tick = timed_tick  # type: ignore[method-assign]
        timer = threading.Timer(seconds, stop.set)
        cpu0, wall0 = time.process_time(), time.perf_counter()
        timer.start()
        try:
            agent.run(stop)
        finally:
            cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
            timer.cancel()
            for source in owned:
                source.close()
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    tick_cpu = sum(ticks)
    agent_pct = 100 * max(0.0, cpu - bench_cpu[0]) / wall
    return {
        "hz": hz,
        "domains": domains,
        "gpus": gpus,
        "seconds": round(wall, 2),
        "ticks": len(ticks),
        "samples_sent": agent.publisher.stats.samples_sent,
        "cpu_pct": round(agent_pct, 2),
        "cpu_percent_of_one_core": round(agent_pct, 2),  # the older name of cpu_pct
        "bench_cpu_pct": round(100 * bench_cpu[0] / wall, 2),
        "tick_wall_percent": round(100 * tick_cpu / wall, 2),
        "us_per_tick_p50": round(statistics.median(ticks) * 1e6, 1) if ticks else None,
        "us_per_tick_p99": round(sorted(ticks)[int(len(ticks) * 0.99)] * 1e6, 1) if ticks else None,
        "us_per_sample": round(tick_cpu / max(1, agent.stats.samples) * 1e6, 1),
        "cpus": os.cpu_count(),
    }
