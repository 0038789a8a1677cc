"""Builders of samples and labelled traces shared by the tests (``import support``)."""

from __future__ import annotations

import math
import random
from pathlib import Path

from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import write_trace

GIB = 1 << 30
T0 = 1_750_000_000.0


def sample(
    ts: float = T0,
    used_frac: float = 0.5,
    *,
    total: int = 80 * GIB,
    node: str = "n1",
    device: str = "gpu0",
    **extra: object,
) -> Sample:
    return Sample(
        ts=ts,
        node=node,
        device=device,
        kind="gpu",
        total_bytes=total,
        used_bytes=int(used_frac * total),
        **extra,
    )  # type: ignore[arg-type]


def leak_trace(
    *,
    start_frac: float = 0.5,
    seconds_to_oom: float = 300.0,
    interval_s: float = 1.0,
    node: str = "n1",
    device: str = "gpu0",
    total: int = 80 * GIB,
    seed: int = 0,
) -> list[Record]:
    """Use grows linearly (with a little noise) from start_frac until it reaches capacity,
    then an ``oom`` event."""
    rng = random.Random(seed)
    out: list[Record] = []
    steps = int(seconds_to_oom / interval_s)
    for i in range(steps):
        frac = start_frac + (1.0 - start_frac) * i / steps + rng.gauss(0, 0.002)
        out.append(
            sample(
                T0 + i * interval_s,
                min(frac, 0.995),
                total=total,
                node=node,
                device=device,
                job="leaky",
            )
        )
    out.append(
        Event(ts=T0 + steps * interval_s, node=node, device=device, event="oom", job="leaky")
    )
    return out


def steady_trace(
    *,
    level: float = 0.7,
    amplitude: float = 0.05,
    seconds: float = 300.0,
    interval_s: float = 1.0,
    node: str = "n1",
    device: str = "gpu0",
    total: int = 80 * GIB,
) -> list[Record]:
    """A training job's steady sawtooth: never OOMs."""
    out: list[Record] = []
    for i in range(int(seconds / interval_s)):
        t = i * interval_s
        frac = level + amplitude * math.sin(2 * math.pi * t / 10.0)
        out.append(sample(T0 + t, frac, total=total, node=node, device=device, job="steady"))
    return out


def write(path: Path, records: list[Record]) -> Path:
    write_trace(path, records)
    return path


# --- cgroup fixture trees (files as the kernel writes them) ---------------------------------

MIB = 1 << 20
LIMIT = 512 * MIB


def write_files(path: Path, files: dict[str, str | int]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (path / name).write_text(f"{value}\n")
    return path


def v1_files(
    *,
    usage: int = 300 * MIB,
    limit: int = LIMIT,
    rss: int = 250 * MIB,
    peak: int = 320 * MIB,
    failcnt: int = 0,
    oom_kill: int = 0,
) -> dict[str, str | int]:
    return {
        "memory.limit_in_bytes": limit,
        "memory.usage_in_bytes": usage,
        "memory.max_usage_in_bytes": peak,
        "memory.failcnt": failcnt,
        "memory.stat": f"cache 4096\nrss {rss // 2}\nmapped_file 0\ntotal_cache 4096\n"
        f"total_rss {rss}\nhierarchical_memory_limit {limit}\n",
        "memory.oom_control": f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}",
        "cgroup.procs": "",
    }


def v2_files(
    *,
    current: int = 300 * MIB,
    limit: int | str = LIMIT,
    anon: int = 250 * MIB,
    peak: int = 320 * MIB,
    max_events: int = 0,
    oom_kill: int = 0,
) -> dict[str, str | int]:
    return {
        "memory.max": limit,
        "memory.current": current,
        "memory.peak": peak,
        "memory.stat": f"anon {anon}\nfile 4096\nkernel 8192\nsock 0\n",
        "memory.events": f"low 0\nhigh 0\nmax {max_events}\noom {oom_kill}\n"
        f"oom_kill {oom_kill}\noom_group_kill 0",
        "cgroup.procs": "",
    }
