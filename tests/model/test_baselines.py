"""model/baselines.py: threshold, predict_linear and kubelet rules, and the detector list."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest

from oomcast.model.baselines import (
    MIB,
    KubeletBaseline,
    PredictLinearBaseline,
    ThresholdBaseline,
    baseline_by_name,
    baseline_detectors,
)
from oomcast.model.forecast import HORIZONS_S, Forecast
from oomcast.model.schema import Sample

T0 = 1_750_000_000.0
TOTAL = 10**9  # a decimal capacity, so fractions of it are exact byte counts


def smp(t: float, used: int, total: int = TOTAL) -> Sample:
    return Sample(
        ts=T0 + t, node="n1", device="gpu0", kind="gpu", total_bytes=total, used_bytes=used
    )


def run(fc: Any, samples: list[Sample]) -> list[Forecast]:
    state = fc.init_state()
    return [fc.step([state], [s])[0] for s in samples]


def ramp(seconds: int, start: float = 0.5, per_s: float = 0.001) -> list[Sample]:
    """used_frac = start + per_s * t, one sample a second, t = 0..seconds-1."""
    return [smp(t, round((start + per_s * t) * TOTAL)) for t in range(seconds)]


# --- threshold -------------------------------------------------------------------------------


def test_threshold_fires_at_and_above_the_fraction_only() -> None:
    fc = ThresholdBaseline(0.9)
    used = [899_999_999, 900_000_000, 950_000_000, 1_000_000_000, 100]
    out = run(fc, [smp(t, u) for t, u in enumerate(used)])
    assert [f.max_risk for f in out] == [0.0, 1.0, 1.0, 1.0, 0.0]
    for f in out:
        assert set(f.risk) == set(HORIZONS_S)
        assert len(set(f.risk.values())) == 1  # same at every horizon
        assert f.time_to_oom_s is None
    assert [f.observed_at for f in out] == [T0 + t for t in range(5)]
    assert out[0].model_version == "baseline/threshold_0.90"


def test_threshold_steps_a_batch_of_domains() -> None:
    fc = ThresholdBaseline(0.5)
    out = fc.step([fc.init_state(), fc.init_state()], [smp(0, 400), smp(0, 600, total=1000)])
    assert [f.max_risk for f in out] == [0.0, 1.0]


@pytest.mark.parametrize("frac", [0.0, -0.1, 1.01, 2.0, float("nan")])
def test_threshold_rejects_bad_fraction(frac: float) -> None:
    with pytest.raises(ValueError, match="used_frac"):
        ThresholdBaseline(frac)


def test_threshold_accepts_one() -> None:
    assert ThresholdBaseline(1.0).version == "baseline/threshold_1.00"


# --- predict_linear --------------------------------------------------------------------------


def test_predict_linear_on_an_exact_ramp_gives_the_time_to_oom() -> None:
    # used_frac = 0.5 + 0.001 t reaches 1.0 at t = 500 s; at sample t the answer is 500 - t
    fc = PredictLinearBaseline(window_s=60, horizon_s=60)
    out = run(fc, ramp(450))
    assert out[0].time_to_oom_s is None  # one point: no line yet
    for t in (1, 10, 59, 60, 61, 200, 449):
        assert out[t].time_to_oom_s == pytest.approx(500 - t, abs=1e-6), t
    assert out[449].observed_at == T0 + 449


def test_predict_linear_risk_follows_the_projection() -> None:
    fc = PredictLinearBaseline(window_s=60, horizon_s=60)
    out = run(fc, ramp(450))
    f = out[441]  # OOM projected 59 s ahead
    assert f.time_to_oom_s == pytest.approx(59, abs=1e-6)
    assert f.risk == {5: 0.0, 15: 0.0, 30: 0.0, 45: 0.0, 60: 1.0, 120: 1.0, 300: 1.0}
    f = out[100]  # 400 s ahead: beyond every horizon
    assert f.max_risk == 0.0


def test_predict_linear_past_capacity_projects_zero() -> None:
    # a ramp whose fitted value is already over 1.0
    samples = [smp(t, round((1.0 + 0.01 * t) * TOTAL)) for t in range(5)]
    out = run(PredictLinearBaseline(60, 60), samples)
    assert out[-1].time_to_oom_s == 0.0
    assert out[-1].risk == dict.fromkeys(HORIZONS_S, 1.0)


def test_predict_linear_uses_least_squares_through_noisy_points() -> None:
    # alternating +-0.01 around 0.5 + 0.002 t: the OLS line is fit by hand below
    ys = [0.5 + 0.002 * t + (0.01 if t % 2 else -0.01) for t in range(4)]
    samples = [smp(t, round(y * TOTAL)) for t, y in enumerate(ys)]
    xs = [0.0, 1.0, 2.0, 3.0]
    n = 4
    mx = sum(xs) / n
    my = sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    fitted_now = my + slope * (3 - mx)
    # ys = .490 .512 .494 .516: slope = 0.03 / 5 = 0.006/s, fitted_now = 0.503 + 0.006 * 1.5
    expected = (1.0 - fitted_now) / slope
    assert slope == pytest.approx(0.006)
    assert expected == pytest.approx(0.488 / 0.006)
    out = run(PredictLinearBaseline(60, 60), samples)
    assert out[-1].time_to_oom_s == pytest.approx(expected, rel=1e-9)


def test_predict_linear_no_projection_on_a_falling_series() -> None:
    out = run(PredictLinearBaseline(60, 60), ramp(200, start=0.9, per_s=-0.002))
    assert all(f.time_to_oom_s is None for f in out)
    assert all(f.max_risk == 0.0 for f in out)


def test_predict_linear_no_risk_on_a_flat_series() -> None:
    out = run(PredictLinearBaseline(60, 60), [smp(t, 700_000_000) for t in range(200)])
    assert all(f.max_risk == 0.0 for f in out)


def test_predict_linear_no_projection_on_a_flat_series() -> None:
    out = run(PredictLinearBaseline(60, 60), [smp(t, 700_000_000) for t in range(200)])
    assert [t for t, f in enumerate(out) if f.time_to_oom_s is not None] == []


def test_predict_linear_no_projection_when_all_points_share_one_instant() -> None:
    fc = PredictLinearBaseline(60, 60)
    state = fc.init_state()
    # two domains' worth of samples with the same ts can't define a slope
    f1 = fc.step([state], [smp(0, 500_000_000)])[0]
    f2 = fc.step([state], [smp(0, 900_000_000)])[0]
    assert f1.time_to_oom_s is None
    assert f2.time_to_oom_s is None


def test_predict_linear_window_drops_old_points() -> None:
    # a steep 60 s ramp from 0.3 to ~0.9, then a fall at 0.0005/s: with a 60 s window the ramp
    # has left the window by t = 121 (points with x < t - 60 are dropped), so nothing projects
    ramp_part = [smp(t, round((0.3 + 0.01 * t) * TOTAL)) for t in range(60)]
    fall = [smp(t, round((0.89 - 0.0005 * (t - 60)) * TOTAL)) for t in range(60, 400)]
    fc = PredictLinearBaseline(window_s=60, horizon_s=60)
    out = run(fc, ramp_part + fall)
    assert out[59].time_to_oom_s is not None  # mid-ramp: projects
    assert out[59].time_to_oom_s == pytest.approx((1.0 - 0.89) / 0.01, abs=1e-6)
    late = out[121:]
    assert all(f.time_to_oom_s is None for f in late)
    # without a window short enough, the old ramp would still drag the fit upward
    long_window = run(PredictLinearBaseline(window_s=10_000, horizon_s=60), ramp_part + fall)
    assert long_window[121].time_to_oom_s is not None


def test_predict_linear_window_keeps_points_exactly_window_s_old() -> None:
    # points at x = 0 and x = 10 only; window 10: the point at x = 0 is exactly 10 s old
    fc = PredictLinearBaseline(window_s=10, horizon_s=60)
    out = run(fc, [smp(0, 500_000_000), smp(10, 600_000_000)])
    assert out[1].time_to_oom_s == pytest.approx(40.0)
    # at x = 10.5 the first point is dropped, leaving (10, .6), (10.5, .65): slope 0.1/s
    out = run(fc, [smp(0, 500_000_000), smp(10, 600_000_000), smp(10.5, 650_000_000)])
    assert out[2].time_to_oom_s == pytest.approx(3.5)


def test_predict_linear_gate_suppresses_projection_below_the_gate() -> None:
    # ramp 0.5 + 0.001 t: under the 0.6 gate until t = 100
    gated = run(PredictLinearBaseline(60, 60, gate_frac=0.6), ramp(200))
    ungated = run(PredictLinearBaseline(60, 60), ramp(200))
    assert ungated[50].time_to_oom_s == pytest.approx(450, abs=1e-6)
    assert all(f.time_to_oom_s is None and f.max_risk == 0.0 for f in gated[:100])
    assert gated[100].time_to_oom_s == pytest.approx(400, abs=1e-6)
    assert gated[150].time_to_oom_s == pytest.approx(ungated[150].time_to_oom_s)


def test_predict_linear_full_window_waits_for_window_s_of_history() -> None:
    out = run(PredictLinearBaseline(60, 60, full_window=True), ramp(100))
    assert all(f.time_to_oom_s is None for f in out[:60])
    assert out[60].time_to_oom_s == pytest.approx(440, abs=1e-6)
    assert out[99].time_to_oom_s == pytest.approx(401, abs=1e-6)


def test_predict_linear_full_window_counts_from_the_domains_first_sample() -> None:
    fc = PredictLinearBaseline(30, 60, full_window=True)
    state = fc.init_state()
    later = [smp(1000 + t, round((0.5 + 0.001 * t) * TOTAL)) for t in range(40)]
    out = [fc.step([state], [s])[0] for s in later]
    assert out[29].time_to_oom_s is None
    assert out[30].time_to_oom_s == pytest.approx(470, abs=1e-6)


def test_predict_linear_version_names_its_settings() -> None:
    assert PredictLinearBaseline(60, 60).version == "baseline/predict_linear_w60s_h60s"
    assert (
        PredictLinearBaseline(120, 120, gate_frac=0.6, full_window=True).version
        == "baseline/predict_linear_w120s_h120s_gate0.60_full"
    )


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window_s": 0, "horizon_s": 60},
        {"window_s": -5, "horizon_s": 60},
        {"window_s": 60, "horizon_s": 60, "gate_frac": 0.0},
        {"window_s": 60, "horizon_s": 60, "gate_frac": 1.0},
        {"window_s": 60, "horizon_s": 60, "gate_frac": -0.5},
    ],
)
def test_predict_linear_rejects_bad_args(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PredictLinearBaseline(**kwargs)


# --- kubelet ---------------------------------------------------------------------------------


def test_kubelet_decides_only_on_its_10s_polls() -> None:
    total = 1000 * MIB
    fc = KubeletBaseline()
    # available drops under 100 MiB at t = 3, and recovers at t = 23
    used = [total - (50 * MIB if 3 <= t < 23 else 500 * MIB) for t in range(40)]
    out = run(fc, [smp(t, u, total=total) for t, u in enumerate(used)])
    fired = [t for t, f in enumerate(out) if f.max_risk == 1.0]
    # polls at t = 0, 10, 20, 30: under at the 10 and 20 polls, over again at 30
    assert fired == list(range(10, 30))
    assert out[10].risk == dict.fromkeys(HORIZONS_S, 1.0)
    assert all(f.time_to_oom_s is None for f in out)


def test_kubelet_threshold_is_strictly_under_available_bytes() -> None:
    total = 1000 * MIB
    fc = KubeletBaseline()
    assert run(fc, [smp(0, total - 100 * MIB, total=total)])[0].max_risk == 0.0
    assert run(fc, [smp(0, total - 100 * MIB + 1, total=total)])[0].max_risk == 1.0


def test_kubelet_custom_poll_and_available() -> None:
    fc = KubeletBaseline(available_bytes=10, poll_s=2.0)
    assert fc.version == "baseline/kubelet_0MiB_2s"
    out = run(fc, [smp(t, 995 if t >= 1 else 0, total=1000) for t in range(5)])
    assert [f.max_risk for f in out] == [0.0, 0.0, 1.0, 1.0, 1.0]


# --- all baselines ---------------------------------------------------------------------------


def wiggly_leak() -> list[Sample]:
    # rises with a sawtooth on top, goes past capacity, then falls back
    out = []
    for t in range(400):
        frac = 0.4 + 0.0016 * t + 0.04 * ((t % 7) / 7)
        if t > 350:
            frac = 0.3
        out.append(smp(t, round(min(frac, 1.2) * TOTAL)))
    return out


FORECASTERS: list[Callable[[], Any]] = [
    lambda: ThresholdBaseline(0.9),
    lambda: PredictLinearBaseline(60, 60),
    lambda: PredictLinearBaseline(300, 300, gate_frac=0.6),
    lambda: PredictLinearBaseline(30, 30, full_window=True),
    lambda: KubeletBaseline(available_bytes=80 * 10**6, poll_s=3),
]


@pytest.mark.parametrize("make", FORECASTERS)
def test_risk_never_decreases_with_horizon(make: Callable[[], Any]) -> None:
    fc = make()
    out = run(fc, wiggly_leak())
    assert any(f.max_risk == 1.0 for f in out)  # the check below is not vacuous
    for f in out:
        assert list(f.risk) == sorted(f.risk) == list(HORIZONS_S)
        values = [f.risk[h] for h in HORIZONS_S]
        assert values == sorted(values), f
        assert set(values) <= {0.0, 1.0}


def test_every_detector_keeps_risk_monotonic() -> None:
    for det in baseline_detectors():
        for f in run(det.forecaster, wiggly_leak()):
            values = [f.risk[h] for h in HORIZONS_S]
            assert values == sorted(values), det.name


def test_baseline_detectors_are_named_after_their_rules() -> None:
    dets = list(baseline_detectors())
    names = [d.name for d in dets]
    assert len(names) == len(set(names))
    assert "threshold_0.90" in names
    assert "threshold_0.95" in names
    assert "predict_linear_w120s_h120s_gate0.60" in names
    assert "predict_linear_w60s_h60s_gate0.80_full" in names
    assert "kubelet_100MiB_10s" in names
    for det in dets:
        assert det.forecaster.version == f"baseline/{det.name}"
    lin = next(d for d in dets if d.name == "predict_linear_w300s_h300s")
    assert lin.rule.horizon_s == 300


def test_baseline_by_name_finds_by_name_or_version() -> None:
    det = baseline_by_name("threshold_0.95")
    assert isinstance(det.forecaster, ThresholdBaseline)
    assert det.forecaster.used_frac == 0.95
    again = baseline_by_name("baseline/predict_linear_w60s_h60s")
    assert isinstance(again.forecaster, PredictLinearBaseline)
    assert again.forecaster.window_s == 60


def test_baseline_by_name_unknown_lists_the_names() -> None:
    with pytest.raises(ValueError) as info:
        baseline_by_name("threshold_0.99")
    msg = str(info.value)
    assert "threshold_0.99" in msg
    for det in baseline_detectors():
        assert det.name in msg


def test_predict_linear_still_projects_on_a_domain_alive_for_a_year() -> None:
    fc = PredictLinearBaseline(60, 60)
    state = fc.init_state()
    year = 365 * 86400
    for t in range(0, year, 600):  # a year of flat use, then a leak
        fc.step([state], [smp(t, int(0.3 * TOTAL))])
    leak = [smp(year + i, int((0.5 + 0.005 * i) * TOTAL)) for i in range(60)]
    last = [fc.step([state], [s])[0] for s in leak][-1]
    # Use is 0.795 and rising 0.005/s: capacity in 41 s.
    assert last.time_to_oom_s == pytest.approx(41.0, abs=0.1)


@pytest.mark.parametrize(
    "make",
    [
        lambda: ThresholdBaseline(0.9),
        lambda: PredictLinearBaseline(60, 60),
        lambda: PredictLinearBaseline(60, 60, gate_frac=0.6, full_window=True),
        lambda: KubeletBaseline(100 * MIB, poll_s=10.0),
    ],
)
def test_an_exported_state_continues_exactly(make: Callable[[], Any]) -> None:
    """Exported mid-run (JSON and back), imported into another instance: the same forecasts
    as the run that was never interrupted, across a rebase of the linear fit too."""
    leak = [smp(t * 7.0, int((0.3 + 0.0001 * t) * TOTAL)) for t in range(700)]
    ref, old, new = make(), make(), make()
    ref_state, state = ref.init_state(), old.init_state()
    expected = [ref.step([ref_state], [s])[0] for s in leak]
    for s in leak[:400]:
        old.step([state], [s])
    moved = new.import_state(json.loads(json.dumps(old.export_state(state))))
    got = [new.step([moved], [s])[0] for s in leak[400:]]
    assert got == expected[400:]


def test_a_malformed_linear_state_is_refused_naming_the_key() -> None:
    fc = PredictLinearBaseline(60, 60)
    st = fc.init_state()
    fc.step([st], [smp(0, TOTAL // 2)])
    good = fc.export_state(st)
    with pytest.raises(ValueError, match="points"):
        fc.import_state({**good, "points": [[1.0]]})
    with pytest.raises(ValueError, match="sums"):
        fc.import_state({**good, "sums": [0.0, 1.0]})
    with pytest.raises(ValueError, match="under"):
        KubeletBaseline().import_state({"next_poll_ts": None, "under": "no"})
