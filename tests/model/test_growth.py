"""model/growth.py: slopes beyond noise over 15-120 s, projections and the age of growth."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from oomcast.model.growth import (
    GROWTH_FEATURES,
    N_GROWTH,
    GrowthTracker,
    fit_windows,
    idle_features,
    squash_s,
)

IDX = {name: i for i, name in enumerate(GROWTH_FEATURES)}


def seconds(squashed: float) -> float:
    return math.expm1(squashed * math.log1p(3600.0))


def run(level: Callable[[float], float], duration_s: float, hz: float) -> dict[int, list[float]]:
    """Features at each whole second of a level sampled at ``hz``."""
    tracker = GrowthTracker()
    out: dict[int, list[float]] = {}
    for k in range(int(duration_s * hz)):
        t = k / hz
        feats = tracker.update(1_900_000_000.0 + t, level(t))
        if abs(t - round(t)) < 1e-9:
            out[round(t)] = feats
    return out


def age(feats: list[float]) -> float:
    return math.expm1(feats[IDX["log1p_growth_age_s"]])


def test_fits_recover_a_line_and_a_window_needs_its_span() -> None:
    t = [float(s) for s in range(0, 31)]
    y = [0.2 + 0.001 * s for s in t]
    fits = fit_windows(t, y, 30.0)
    assert fits[0].valid and fits[0].slope == pytest.approx(0.001)
    assert fits[1].valid and fits[1].slope == pytest.approx(0.001) and fits[1].growing
    assert not fits[2].valid and not fits[3].valid  # 30 s of data: no 60 s or 120 s fit
    noisy = [v + (0.004 if s % 2 else -0.004) for s, v in zip(t, y, strict=True)]
    fit = fit_windows(t, noisy, 30.0)[1]
    assert fit.se > 5e-5 and fit.slope == pytest.approx(0.001, rel=0.3)


@pytest.mark.parametrize("hz", [1.0, 10.0])
def test_a_straight_leak_has_30_s_of_growth_30_s_in_and_projects_its_oom(hz: float) -> None:
    feats = run(lambda t: t / 60.0, 60.0, hz)
    at30 = feats[30]
    assert age(at30) == pytest.approx(30.0, abs=0.5)
    assert at30[IDX["slope_30s_pct_per_s"]] == pytest.approx(100 / 60, rel=1e-3)
    assert seconds(at30[IDX["time_to_limit"]]) == pytest.approx(30.0, rel=0.05)
    assert seconds(at30[IDX["time_to_limit_lo"]]) <= seconds(at30[IDX["time_to_limit"]])
    assert age(feats[20]) < 30.0


def test_the_same_curve_at_1_and_10_hz_gives_the_same_features() -> None:
    def level(t: float) -> float:
        return 0.3 + 0.002 * max(0.0, t - 100) + 0.01 * math.sin(t / 7)

    slow, fast = run(level, 400, 1.0), run(level, 400, 10.0)
    for sec in range(130, 400, 10):
        for name in ("slope_30s_pct_per_s", "slope_120s_pct_per_s", "time_to_limit"):
            a, b = slow[sec][IDX[name]], fast[sec][IDX[name]]
            assert abs(a - b) <= 0.05 * (abs(a) + abs(b)) + 0.01, (sec, name, a, b)


def test_a_noisy_flat_line_and_passing_spikes_are_not_growth() -> None:
    rng = random.Random(3)

    def level(t: float) -> float:  # flat at 60%, a 3 s evaluation spike every 40 s
        return 0.6 + rng.gauss(0, 0.004) + (0.2 if t % 40 < 3 else 0.0)

    feats = run(level, 600, 10.0)
    # four windows tested every second: noise passes for growth now and then, rarely...
    grown = [s for s, f in feats.items() if age(f) > 0]
    assert len(grown) <= 0.05 * len(feats), grown
    # ... and never 30 s of it with a limit it could reach within five minutes (the gate)
    gate = [s for s, f in feats.items()
            if age(f) >= 30 and f[IDX["time_to_limit_lo"]] <= squash_s(300)]  # fmt: skip
    assert not gate, gate
    # the spikes themselves (t % 40 < 3) are never growth
    assert not [s for s in grown if s % 40 < 6], grown


@pytest.mark.parametrize("top", [0.5, 0.85])
def test_a_start_up_jump_then_a_level_is_never_growth_as_windows_come_of_age(top: float) -> None:
    # weights land in 5 s, then the job steps in a 12 s sawtooth of 10% around ``top``: every
    # window that comes of age (15 s, 30 s, 60 s, 120 s) first holds the jump in its first
    # third, and the line fitted through it is steep; it is still not growth (the demo's
    # sawtooth job was alerted on 30 s in when it was)
    def level(t: float) -> float:
        return (top - 0.05) * min(1.0, t / 5.0) + 0.10 * ((t % 12.0) / 12.0)

    feats = run(level, 300, 1.0)
    grown = [s for s, f in feats.items() if age(f) > 0]
    assert not grown, grown
    # and the same jump followed by a real leak is growth once the leak has lasted
    leak = run(lambda t: level(t) + (0.002 * (t - 60.0) if t > 60 else 0.0), 200, 1.0)
    assert age(leak[130]) >= 30.0, age(leak[130])


def test_a_climb_that_levels_off_decelerates_and_stops_growing() -> None:
    rng = random.Random(5)

    def level(t: float) -> float:
        return 0.1 + 0.7 * (1 - math.exp(-t / 40)) + rng.gauss(0, 0.002)

    feats = run(level, 600, 1.0)
    assert feats[150][IDX["deceleration"]] > 0.3
    assert age(feats[30]) >= 25.0  # the climb itself is growth
    assert age(feats[599]) == 0.0  # long levelled off: no more
    leak = run(lambda t: 0.1 + 0.002 * t, 300, 1.0)
    assert abs(leak[250][IDX["deceleration"]]) < 0.05


@pytest.mark.parametrize("hz", [1.0, 10.0, 0.5])
def test_the_running_sums_fit_exactly_what_the_plain_fits_do(hz: float) -> None:
    rng = random.Random(7)
    tracker = GrowthTracker()
    for k in range(int(4000 * hz)):  # past a rebase of the running sums
        t = k / hz
        tracker.update(1_900_000_000.0 + t, 0.3 + 0.0004 * t % 0.5 + rng.gauss(0, 0.003))
        if k % int(97 * hz) == 0 and tracker.t:
            now = float(tracker.sec or 0)
            plain = fit_windows([*tracker.t, now], [*tracker.lo, tracker.lo_now], now)
            fast = [tracker._fit(now, w) for w in (15, 30, 60, 120)]
            for a, b in zip(plain, fast, strict=True):
                assert a.valid == b.valid and a.steady == b.steady and a.span_s == b.span_s
                if a.valid:
                    assert b.slope == pytest.approx(a.slope, rel=1e-6, abs=1e-9)
                    assert b.se == pytest.approx(a.se, rel=1e-5, abs=1e-9)


def test_state_round_trips_and_malformed_state_names_the_key() -> None:
    tracker = GrowthTracker()
    for k in range(50):
        tracker.update(1_900_000_000.0 + k * 0.5, 0.2 + 0.001 * k)
    copy = GrowthTracker.from_dict(tracker.to_dict())
    assert copy.update(1_900_000_030.0, 0.3) == pytest.approx(tracker.update(1_900_000_030.0, 0.3))
    assert GrowthTracker.from_dict(None).features == idle_features()
    bad = tracker.to_dict() | {"lo": [0.1]}
    with pytest.raises(ValueError, match="as long as"):
        GrowthTracker.from_dict(bad)
    with pytest.raises(ValueError, match=r"growth\.features"):
        GrowthTracker.from_dict(tracker.to_dict() | {"features": [0.0]})
    assert len(idle_features()) == N_GROWTH
    assert squash_s(3600.0) == 1.0 and squash_s(0.0) == 0.0


def test_a_climb_that_slows_says_where_it_will_level_off_and_a_leak_never_does() -> None:
    def approach(t: float) -> float:  # levels off at 89%, time constant 50 s
        return 0.3 + 0.59 * (1 - math.exp(-t / 50))

    feats = run(approach, 200, 1.0)
    for t in (40, 60, 120):
        assert feats[t][IDX["plateau_headroom"]] == pytest.approx(0.11, abs=0.05), t
        assert feats[t][IDX["slowing_per_min"]] == pytest.approx(60 / 50, rel=0.1), t
    leak = run(lambda t: 0.3 + 0.004 * t, 150, 10.0)
    assert all(f[IDX["plateau_headroom"]] == -1.0 for f in leak.values())
    assert all(f[IDX["slowing_per_min"]] == 0.0 for f in leak.values())


def test_drawdown_is_the_largest_fall_of_the_floor_in_the_last_two_minutes() -> None:
    # a leak never falls
    leak = run(lambda t: 0.2 + 0.004 * t, 150, 10.0)
    assert leak[140][IDX["drawdown_120s"]] == 0.0
    # a 45 s sawtooth from 60% to 95%: its next tooth climbs as straight as a leak, and the
    # drop before it (about 35% of capacity) is what tells them apart, for two minutes
    saw = run(lambda t: 0.6 + 0.35 * ((t % 45.0) / 45.0), 300, 1.0)
    assert saw[30][IDX["drawdown_120s"]] == 0.0  # the first tooth: nothing fell yet
    assert saw[80][IDX["drawdown_120s"]] == pytest.approx(0.35 * 44 / 45, abs=1e-6)
    # activations freed within every second (10 Hz, a 0.5 s step) are not a fall: the floor
    # of each second holds while the level swings 10% within it
    swing = run(lambda t: 0.3 + 0.002 * t + (0.1 if (t % 0.5) < 0.25 else 0.0), 150, 10.0)
    assert swing[140][IDX["drawdown_120s"]] < 0.005
    # a drop older than the window is forgotten
    once = run(lambda t: 0.8 if t < 10 else 0.4, 200, 1.0)
    assert once[100][IDX["drawdown_120s"]] == pytest.approx(0.4)
    assert once[140][IDX["drawdown_120s"]] == 0.0


def test_the_10_s_pace_sees_a_climb_that_stopped_while_longer_fits_still_climb() -> None:
    leak = run(lambda t: 0.2 + 0.004 * t, 60, 10.0)
    assert leak[50][IDX["slope_10s_pct_per_s"]] == pytest.approx(0.4, rel=1e-3)
    jump = run(lambda t: 0.05 + 0.65 * min(1.0, max(0.0, t - 17.0) / 5.0), 40, 1.0)
    assert jump[33][IDX["slope_15s_pct_per_s"]] > 2.0  # the jump is still in the window
    assert jump[33][IDX["slope_10s_pct_per_s"]] == 0.0
    assert jump[33][IDX["slope_se_10s_pct_per_s"]] < 0.01
    young = run(lambda t: 0.2 + 0.004 * t, 8, 1.0)  # less than 10 s of history: no fit
    assert young[7][IDX["slope_10s_pct_per_s"]] == 0.0
    assert young[7][IDX["slope_se_10s_pct_per_s"]] == 10.0
