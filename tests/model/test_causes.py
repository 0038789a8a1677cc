"""Plain shapes whose cause is obvious, and the remedies that go with each."""

from __future__ import annotations

import numpy as np

from oomcast.model.causes import EXPANDABLE, diagnose
from oomcast.model.schema import Sample

GIB = 1 << 30


def last(used: float, kind: str = "gpu", **extra: int) -> Sample:
    device = "gpu0" if kind == "gpu" else "cgroup:/job"
    return Sample(100.0, "n", device, kind, 80 * GIB, int(used), **extra)  # type: ignore[arg-type]


def history(values: list[float]) -> tuple[np.ndarray, np.ndarray]:
    return np.arange(len(values), dtype=np.float64), np.asarray(values, dtype=np.int64)


def test_a_straight_leak_is_a_leak_and_says_what_is_missing() -> None:
    ts, used = history([(40 + 0.5 * i) * GIB for i in range(60)])
    d = diagnose(last(used[-1]), ts, used)
    assert d.cause == "leak" and "steadily" in d.evidence
    assert any("no allocator figures" in t for t in d.thin)
    assert any(".detach()" in r for r in d.remedies)


def test_use_rising_in_a_few_jumps_is_batch_growth() -> None:
    values = [40 * GIB] * 20 + [50 * GIB] * 20 + [62 * GIB] * 20
    ts, used = history(values)
    d = diagnose(last(used[-1]), ts, used)
    assert d.cause == "batch_growth"
    assert any("sequence length" in r for r in d.remedies)


def test_a_reserved_but_unused_cache_near_the_limit_is_fragmentation() -> None:
    ts, used = history([(60 + 0.2 * i) * GIB for i in range(60)])
    d = diagnose(last(used[-1], reserved_bytes=76 * GIB, allocated_bytes=55 * GIB), ts, used)
    assert d.cause == "fragmentation" and "cached but not in use" in d.evidence
    assert EXPANDABLE in d.remedies[0]
    # the same share far from the limit is not what will kill the job
    far = diagnose(last(30 * GIB, reserved_bytes=30 * GIB, allocated_bytes=20 * GIB), ts, used)
    assert far.cause != "fragmentation"


def test_climbing_allocator_retries_are_fragmentation() -> None:
    ts, used = history([(60 + 0.2 * i) * GIB for i in range(60)])
    d = diagnose(
        last(used[-1], reserved_bytes=72 * GIB, allocated_bytes=70 * GIB, alloc_retries=5),
        ts,
        used,
        retries_before=2,
    )
    assert d.cause == "fragmentation" and "retried 3 times" in d.evidence


def test_a_containers_page_cache_is_a_growing_cache_not_a_leak() -> None:
    ts, used = history([(10 + 0.1 * i) * GIB for i in range(60)])
    d = diagnose(
        last(used[-1], kind="host", allocated_bytes=4 * GIB), ts, used, anon_before=4 * GIB
    )
    assert d.cause == "growing_cache" and "page cache" in d.evidence
    assert not any("memory.max" in r for r in d.remedies)


def test_a_container_leak_gets_the_limit_that_fits_its_peak() -> None:
    values = [(10 + 0.1 * i) * GIB for i in range(60)]
    ts, used = history(values)
    near = Sample(100.0, "n", "cgroup:/job", "host", int(16.5 * GIB), int(used[-1]),
                  allocated_bytes=int(used[-1]) - GIB)  # fmt: skip
    d = diagnose(near, ts, used, anon_before=9 * GIB)
    assert d.cause == "leak"
    limit = next(r for r in d.remedies if "memory.max" in r)
    assert f"{values[-1] * 1.2 / GIB:.1f} GiB" in limit  # the peak plus 20%


def test_a_limit_with_room_is_not_told_to_grow_and_no_hook_means_no_bundle() -> None:
    """A CPU job at 16 GiB of an 80 GiB limit was told to raise its limit "to at least 19
    GiB; it is 80 GiB now"; and without the in-job hook, to read the bundle the hook saved."""
    ts, used = history([(10 + 0.1 * i) * GIB for i in range(60)])
    roomy = last(used[-1], kind="host", allocated_bytes=int(used[-1]) - GIB)
    d = diagnose(roomy, ts, used, anon_before=9 * GIB)
    assert d.cause == "leak" and not any("memory.max" in r for r in d.remedies)
    assert not any("the hook saved" in r for r in d.remedies)
    assert any("add oomcast's in-job hook" in r for r in d.remedies)
    hooked = Sample(**{**roomy.to_dict(), "step": 1200})
    assert any(
        "the hook saved" in r for r in diagnose(hooked, ts, used, anon_before=9 * GIB).remedies
    )
    # a cgroup without an anonymous-memory figure says what that hides, not "no hook"
    bare = diagnose(last(used[-1], kind="host"), ts, used)
    assert any("no anonymous-memory figure" in t for t in bare.thin)
    assert not any("no in-job hook" in t for t in bare.thin)


def test_a_phase_forecast_keeps_its_cause() -> None:
    ts, used = history([40 * GIB] * 60)
    d = diagnose(last(40 * GIB), ts, used, phase_cause="phase:eval")
    assert d.cause == "phase:eval" and any("no_grad" in r for r in d.remedies)


def test_thin_or_flat_history_is_unknown() -> None:
    ts, used = history([40 * GIB] * 3)
    d = diagnose(last(40 * GIB), ts, used)
    assert d.cause == "unknown" and any("only 3 samples" in t for t in d.thin)
    ts, used = history([40 * GIB] * 60)
    assert diagnose(last(40 * GIB), ts, used).cause == "unknown"


def test_a_growing_neighbour_is_named() -> None:
    ts, used = history([(40 + 0.3 * i) * GIB for i in range(60)])
    d = diagnose(last(used[-1]), ts, used, neighbour_bytes=15 * GIB)
    assert d.cause == "neighbour"


def test_a_containers_phase_alert_sizes_the_limit_for_the_phase() -> None:
    """A cgroup at 0.33 GiB of 0.63 whose eval needs 0.39 GiB more: the limit that fits is
    the use plus the phase's extra, with 20% on top, not the past peak."""
    ts, used = history([0.33 * GIB] * 60)
    limit_now = Sample(100.0, "n", "cgroup:/job", "host", int(0.63 * GIB), int(0.33 * GIB))
    d = diagnose(limit_now, ts, used, phase_cause="phase:eval", phase_extra_bytes=int(0.39 * GIB))
    limit = next(r for r in d.remedies if "memory.max" in r)
    assert f"{(0.33 + 0.39) * 1.2:.1f} GiB" in limit and "no_grad" in d.remedies[0]
