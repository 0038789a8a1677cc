"""What users rely on, pinned on the shipped model: plain memory shapes whose answer is
obvious, stepped through the path the service uses (``OnnxForecaster.step`` per sample,
many domains per call) and judged by the shipped alert rule (``fc.rule``).

- flat use at any level from 0% to 97%, any capacity from 1 GiB to 141 GiB, for up to
  30 minutes, at 1 Hz and at 10 Hz: never alerts;
- a start-up climb that levels off at up to 90%, an allocator cache at 97% with live tensors
  at 60%: never alert; a sawtooth that always fits (60-95%): never, once its first tooth
  has dropped (a first tooth of 45 s is a straight climb from the job's start, as steep as
  the 1-minute leak below: the drop is what tells them apart);
- a straight leak to 100% over 1 to 10 minutes from any starting level alerts at least 30 s
  before the OOM, and its time to OOM 60 s and 30 s before the OOM is within 25% of the
  truth (wherever at least 30 s of the leak were seen by then);
- the same fractions at another capacity, or the same curve at 1, 2 or 10 Hz: the same
  verdict.

The shapes are drawn here, with their own generator (``hypothesis`` and explicit grids);
``training/shapes.py`` draws the ones training sees, independently.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster
from oomcast.model.schema import Sample

GIB = 1 << 30
T0 = 1_900_000_000.0
Level = Callable[[float], float]  # seconds since start -> fraction of capacity

pytestmark = pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="no shipped model")


@pytest.fixture(scope="module")
def fc() -> OnnxForecaster:
    return OnnxForecaster(DEFAULT_MODEL)


def _sample(
    t: float, level: float, total: int, kind: str, cache: tuple[float, float] | None, dev: str
) -> Sample:
    used = int(min(level, 1.0) * total)
    if cache is not None:  # reserved held by the allocator, live tensors far below it
        held, live = cache
        return Sample(T0 + t, "props", dev, "gpu", total, int(held * total),
                      allocated_bytes=int(live * total), reserved_bytes=int((held - 0.01) * total),
                      peak_bytes=int(held * total), alloc_retries=0)  # fmt: skip
    return Sample(T0 + t, "props", dev, kind, total, used, peak_bytes=used)


def run_domains(
    fc: OnnxForecaster,
    shapes: list[tuple[Level, float, int, str, float]],
    cache: tuple[float, float] | None = None,
    count_from_s: list[float] | None = None,
) -> list[tuple[float | None, dict[float, float | None]]]:
    """Step every (level, duration_s, total_bytes, kind, hz) domain, all in one batch per
    instant. Returns per domain: the time of the first alert by the shipped rule (None: it
    never alerted; with ``count_from_s``, the first at or after that domain's time), and
    the forecast time to OOM at each second of the run."""
    count_from = count_from_s or [0.0] * len(shapes)
    states = [fc.init_state() for _ in shapes]
    runs = [0] * len(shapes)
    first: list[float | None] = [None] * len(shapes)
    ttos: list[dict[float, float | None]] = [{} for _ in shapes]
    ticks = sorted({round(k / hz, 4) for _, dur, _, _, hz in shapes for k in range(int(dur * hz))})
    try:
        for t in ticks:
            idx = [
                i for i, (_, dur, _, _, hz) in enumerate(shapes)
                if t < dur and abs(t * hz - round(t * hz)) < 1e-6
            ]  # fmt: skip
            if not idx:
                continue
            samples = [
                _sample(t, shapes[i][0](t), shapes[i][2], shapes[i][3], cache, f"d{i}") for i in idx
            ]
            for i, f in zip(idx, fc.step([states[i] for i in idx], samples), strict=True):
                runs[i] = runs[i] + 1 if fc.rule.fires(f) else 0
                if runs[i] >= fc.rule.fire_after and first[i] is None and t >= count_from[i]:
                    first[i] = t
                if abs(t - round(t)) < 1e-6:
                    ttos[i][round(t)] = f.time_to_oom_s
    finally:
        for s in states:
            fc.release(s)
    return list(zip(first, ttos, strict=True))


def _flat(level: float) -> Level:
    return lambda t: level


CAPACITIES = (1 * GIB, 16 * GIB, 80 * GIB, 141 * GIB)
LEVELS = (0.0, 0.002, 0.01, 0.2, 0.5, 0.7, 0.85, 0.9, 0.95, 0.97)


@pytest.mark.slow
@pytest.mark.parametrize("hz, minutes", [(1.0, 30), (10.0, 10)])
def test_flat_lines_never_alert_at_any_level_capacity_or_rate(
    fc: OnnxForecaster, hz: float, minutes: int
) -> None:
    shapes = [
        (_flat(level), minutes * 60.0, total, kind, hz)
        for level in LEVELS
        for total in CAPACITIES
        for kind in ("gpu", "host")
    ]
    results = run_domains(fc, shapes)
    alerted = [
        (LEVELS[i // 8], CAPACITIES[(i // 2) % 4] // GIB, ("gpu", "host")[i % 2], first)
        for i, (first, _) in enumerate(results)
        if first is not None
    ]
    assert not alerted, f"flat lines alerted (level, GiB, kind, at s): {alerted}"


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    level=st.floats(0.0, 0.97),
    gib=st.floats(1.0, 141.0),
    minutes=st.floats(0.05, 30.0),
    hz=st.sampled_from([1.0, 2.0, 10.0]),
    kind=st.sampled_from(["gpu", "host"]),
)
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_flat_line_drawn_at_random_never_alerts(
    fc: OnnxForecaster, level: float, gib: float, minutes: float, hz: float, kind: str
) -> None:
    if hz == 10.0:
        minutes = min(minutes, 5.0)
    ((first, _),) = run_domains(fc, [(_flat(level), minutes * 60, int(gib * GIB), kind, hz)])
    assert first is None, f"alerted at {first}s on a flat line at {level:.1%}"


def _climb(top: float, rise_s: float) -> Level:
    return lambda t: 0.02 + (top - 0.02) * (1.0 - math.exp(-3.0 * t / rise_s))


def _sawtooth(base: float, top: float, period_s: float) -> Level:
    return lambda t: base + (top - base) * ((t % period_s) / period_s)


@pytest.mark.slow
def test_start_up_climbs_that_level_off_never_alert(fc: OnnxForecaster) -> None:
    shapes = [
        (_climb(top, rise), 900.0, 40 * GIB, kind, 1.0)
        for top in (0.3, 0.6, 0.8, 0.9)
        for rise in (5.0, 30.0, 120.0)
        for kind in ("gpu", "host")
    ]
    results = run_domains(fc, shapes)
    alerted = [(i, first) for i, (first, _) in enumerate(results) if first is not None]
    assert not alerted, f"{len(alerted)} of {len(shapes)} climbs alerted: {alerted}"


@pytest.mark.slow
def test_sawtooths_that_fit_never_alert_once_their_first_tooth_has_dropped(
    fc: OnnxForecaster,
) -> None:
    shapes: list[tuple[Level, float, int, str, float]] = []
    first_tooth_s: list[float] = []  # how long a shape's first straight climb lasts
    for base, top in ((0.6, 0.7), (0.6, 0.95), (0.8, 0.95), (0.4, 0.9)):
        for period in (2.0, 10.0, 45.0):
            shapes.append((_sawtooth(base, top, period), 900.0, 80 * GIB, "gpu", 1.0))
            first_tooth_s.append(period if period >= 30.0 else 0.0)
    # A sawtooth's first tooth is a straight climb from the job's first sample: 45 s from
    # 60% to 95% is the 1-minute leak from 60% of the test below (which must alert 30 s in),
    # only steeper and higher, so no forecaster can both warn that leak and stay quiet on
    # this tooth. What tells them apart is the drop: from the second tooth on, the history
    # shows it, and from there on it must be quiet.
    results = run_domains(fc, shapes, count_from_s=first_tooth_s)
    alerted = [(i, first) for i, (first, _) in enumerate(results) if first is not None]
    assert not alerted, f"{len(alerted)} of {len(shapes)} sawtooths alerted: {alerted}"


def test_an_allocator_cache_at_97_percent_with_tensors_at_60_never_alerts(
    fc: OnnxForecaster,
) -> None:
    shapes = [(_flat(0.6), 1200.0, total, "gpu", 1.0) for total in CAPACITIES]
    results = run_domains(fc, shapes, cache=(0.97, 0.6))
    assert all(first is None for first, _ in results), results


def _leak(start: float, climb_s: float) -> Level:
    return lambda t: start + (1.0 - start) * t / climb_s


LEAKS = [(start, minutes) for start in (0.0, 0.3, 0.6, 0.85) for minutes in (1, 2, 5, 10)]


@pytest.mark.slow
def test_a_straight_leak_alerts_30s_ahead_with_a_time_to_oom_within_25_percent(
    fc: OnnxForecaster,
) -> None:
    shapes = [
        (_leak(start, minutes * 60.0), minutes * 60.0, total, "gpu", 1.0)
        for start, minutes in LEAKS
        for total in (16 * GIB, 80 * GIB)
    ]
    results = run_domains(fc, shapes)
    late, off = [], []
    for (first, ttos), (start, minutes) in zip(results, [lk for lk in LEAKS for _ in (0, 1)],
                                               strict=True):  # fmt: skip
        oom_s = minutes * 60.0
        if first is None or oom_s - first < 30.0:
            late.append((start, minutes, first))
        for before in (60, 30):
            at = oom_s - before
            if at < 30:  # less than 30 s of the leak seen: no trend to judge yet
                continue
            pred = ttos.get(round(at))
            if pred is None or abs(pred - before) > 0.25 * before:
                off.append((start, minutes, before, pred))
    assert not late, f"leaks not warned 30 s ahead (start, minutes, first alert s): {late}"
    assert not off, f"time to OOM off by > 25% (start, minutes, s before, predicted): {off}"


def _verdict(result: tuple[float | None, dict[float, float | None]], oom_s: float | None) -> str:
    first, _ = result
    if first is None:
        return "quiet"
    return "early" if oom_s is not None and oom_s - first >= 30 else "alert"


@pytest.mark.slow
def test_the_same_fractions_at_another_capacity_or_rate_give_the_same_verdict(
    fc: OnnxForecaster,
) -> None:
    curves: list[tuple[Level, float, float | None]] = [
        (_leak(0.4, 240.0), 240.0, 240.0),
        (_leak(0.1, 420.0), 420.0, 420.0),
        (_flat(0.9), 600.0, None),
        (_climb(0.85, 40.0), 600.0, None),
        (_sawtooth(0.6, 0.92, 12.0), 600.0, None),
    ]
    for level, dur, oom_s in curves:
        variants = [(level, dur, total, "gpu", 1.0) for total in CAPACITIES]
        variants += [(level, dur, 80 * GIB, "gpu", hz) for hz in (2.0, 10.0)]
        verdicts = [_verdict(r, oom_s) for r in run_domains(fc, variants)]
        assert len(set(verdicts)) == 1, f"verdicts differ across capacity/rate: {verdicts}"
        assert verdicts[0] == ("early" if oom_s is not None else "quiet"), verdicts
