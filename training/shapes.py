"""Plain memory shapes whose answer is obvious, as labelled traces.

Flat lines at any level, start-up climbs that level off, sawtooths that always fit, an
allocator cache held near the limit while live tensors sit far below it: none of these
OOMs. A straight leak to the limit always does, at the moment it gets there. Every real
corpus is thin on some of them (a flat line at 97% of a 141 GiB GPU, a 1 GiB container
sampled at 10 Hz), so training sees them too, drawn at random capacities, rates, levels and
durations. The property tests (``tests/model/test_properties.py``) draw their own, with
their own generator, and hold the shipped model to the same answers.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable

from oomcast.model.schema import Event, Sample
from oomcast.model.trace import Trace

GIB = 1 << 30
T0 = 1_800_000_000.0


def _capacity(r: random.Random) -> int:
    return int(math.exp(r.uniform(math.log(1.0), math.log(141.0))) * GIB)


def _emit(
    r: random.Random,
    name: str,
    levels: Callable[[float], float],
    duration_s: float,
    oom_at_s: float | None,
    cache: tuple[float, float] | None = None,
) -> Trace:
    """Samples of ``levels(t)`` (fraction of capacity) from t = 0 to ``duration_s``, at a
    random rate; an ``oom`` event at ``oom_at_s`` (the samples stop there) or an ``exit``."""
    kind = r.choice(("gpu", "host"))
    total = _capacity(r)
    interval = r.choice((0.1, 0.5, 1.0, 1.0, 1.0, 2.0)) if duration_s <= 600 else 1.0
    noise = r.choice((0.0, 0.001, 0.003, 0.01))
    hook = kind == "gpu" and r.random() < 0.5
    records: list[Sample] = []
    t = 0.0
    end = duration_s if oom_at_s is None else oom_at_s
    device = "gpu0" if kind == "gpu" else "cgroup:/shape"
    while t < end:
        level = min(0.999, max(0.0, levels(t) + r.gauss(0.0, noise)))
        used = int(level * total)
        extra: dict[str, int] = {}
        if cache is not None and kind == "gpu":  # reserved near the limit, tensors far below
            used = int(cache[0] * total)
            extra = {"allocated_bytes": int(level * total), "reserved_bytes": used - (300 << 20)}
        elif hook:
            extra = {"allocated_bytes": int(used * 0.9), "reserved_bytes": int(used * 0.97)}
        elif kind == "host":
            extra = {"allocated_bytes": int(used * 0.98)}
        if cache is not None and kind == "host":
            # page cache fills the container; anon memory is the level
            used = int(cache[0] * total)
            extra = {"allocated_bytes": int(level * total)}
        records.append(
            Sample(
                T0 + t,
                "shapes",
                device,
                kind,
                total,
                used,
                allocated_bytes=extra.get("allocated_bytes"),
                reserved_bytes=extra.get("reserved_bytes"),
                peak_bytes=used,
            )
        )
        t += interval
    ev = "oom" if oom_at_s is not None else "exit"
    event = Event(ts=T0 + end + 1e-3, node="shapes", device=device, event=ev)
    return Trace(path=name, samples={("shapes", device): records}, events=[event])


def flat(r: random.Random, i: int) -> Trace:
    level = r.uniform(0.0, 0.97)
    return _emit(r, f"flat-{i}", lambda t: level, r.uniform(30, 1800), None)


def startup_plateau(r: random.Random, i: int) -> Trace:
    """A start-up climb that levels off: slowing as it nears its top (as filling caches and
    loading weights do); a straight one only far below the limit, since a straight climb
    that stops dead cannot be told from a leak until it stops."""
    top, rise = r.uniform(0.1, 0.9), r.uniform(3, 180)
    start = r.uniform(0.0, 0.05)
    linear = top < 0.6 and r.random() < 0.5

    def level(t: float) -> float:
        if linear:
            return start + (top - start) * min(1.0, t / rise)
        return start + (top - start) * (1 - math.exp(-3 * t / rise))

    return _emit(r, f"plateau-{i}", level, r.uniform(60, 1200), None)


def sawtooth(r: random.Random, i: int) -> Trace:
    """A sawtooth that always fits. It starts at a random point of a tooth's second half:
    a whole first tooth of 30 s or more, climbing from the job's first sample, is a straight
    climb no forecaster can tell from a leak until it drops (the property tests exempt it
    too), and training should not be told it is safe."""
    top = r.uniform(0.6, 0.95)
    base = r.uniform(0.3, top - 0.05)
    period = r.uniform(1.0, 60.0)
    phase = r.uniform(0.5, 1.0) * period
    return _emit(
        r, f"sawtooth-{i}", lambda t: base + (top - base) * (((t + phase) % period) / period),
        r.uniform(60, 1200), None,
    )  # fmt: skip


def allocator_cache(r: random.Random, i: int) -> Trace:
    live = r.uniform(0.3, 0.7)
    return _emit(r, f"cache-{i}", lambda t: live, r.uniform(60, 1200), None, (0.97, live))


def leak(r: random.Random, i: int) -> Trace:
    """A flat start, then a straight climb to the limit over 1 to 10 minutes."""
    start = r.uniform(0.0, 0.9)
    climb = r.uniform(60, 600)
    calm = r.choice((0.0, r.uniform(5, 120), r.uniform(120, 900)))
    rate = (1.0 - start) / climb

    def level(t: float) -> float:
        return start + rate * max(0.0, t - calm)

    return _emit(r, f"leak-{i}", level, calm + climb, calm + climb)


def leak_that_stops(r: random.Random, i: int) -> Trace:
    """A climb that slows as it nears its top, below the limit, and stays there (a cache
    filling, a warm-up): a near miss. It decelerates, as such climbs do; a straight line
    that stops dead a few percent short of the limit cannot be told from a leak in time."""
    start, stop = r.uniform(0.0, 0.5), r.uniform(0.6, 0.9)
    climb = r.uniform(30, 300)

    def level(t: float) -> float:
        return start + (stop - start) * (1.0 - math.exp(-3.0 * t / climb))

    return _emit(r, f"stops-{i}", level, climb + r.uniform(120, 900), None)


SHAPES: dict[str, Callable[[random.Random, int], Trace]] = {
    "flat": flat,
    "startup_plateau": startup_plateau,
    "sawtooth": sawtooth,
    "allocator_cache": allocator_cache,
    "leak": leak,
    "leak_that_stops": leak_that_stops,
}


def shape_traces(n: int, seed: int = 0) -> list[Trace]:
    """``n`` traces, the shapes in turn, each drawn from its own seeded generator."""
    names = list(SHAPES)
    out = []
    for i in range(n):
        r = random.Random(seed * 1_000_003 + i)
        out.append(SHAPES[names[i % len(names)]](r, i))
    return out
