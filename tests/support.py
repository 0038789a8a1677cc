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
