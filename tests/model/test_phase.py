"""model/phase.py: phase-aware forecasts, on plain shapes."""

from __future__ import annotations

from typing import Any

import pytest

from oomcast.model.events import ScheduleEvent
from oomcast.model.forecast import HORIZONS_S, Forecast
from oomcast.model.phase import MARGIN_FRAC, PHASE_RISK, PhaseState, merge
from oomcast.model.schema import Sample

T0 = 1_750_000_000.0
GIB = 1 << 30
TOTAL = 80 * GIB
USED = 60 * GIB
HEADROOM = TOTAL - int(MARGIN_FRAC * TOTAL) - USED  # what a phase may add and still fit


def sample(step: int | None, ts: float | None = None, **over: Any) -> Sample:
    fields: dict[str, Any] = {"total_bytes": TOTAL, "used_bytes": USED, "job": "j"}
    fields |= over
    when = T0 + (step or 0) if ts is None else ts
    return Sample(when, "n1", "cuda0", "gpu", step=step, **fields)


def schedule(extra: dict[str, int], **over: Any) -> ScheduleEvent:
    return ScheduleEvent(T0, "n1", "cuda0", "schedule", "j", phase_extra_bytes=extra, **over)


def run(state: PhaseState, steps: range, **over: Any) -> Sample:
    """Samples at 1 step/s, one per step; the last one."""
    last = None
    for i in steps:
        last = sample(i, **over)
        state.observe(last)
    assert last is not None
    return last


def calm() -> Forecast:
    return Forecast(dict.fromkeys(HORIZONS_S, 0.01), None, T0, "lstm-test")


def test_no_schedule_gives_nothing() -> None:
    state = PhaseState()
    last = run(state, range(41))
    assert state.forecast(last) is None
    fc = calm()
    assert merge(fc, None) == (fc, None)


def test_an_eval_that_does_not_fit_is_forecast_at_the_time_it_comes() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    last = run(state, range(41))  # at step 40, 1 step/s: the eval at step 100 is 60 s away
    pf = state.forecast(last)
    assert pf is not None and pf.phase == "eval" and pf.cause == "phase:eval"
    assert pf.time_to_oom_s == pytest.approx(60.0)
    assert pf.steps_away == 60 and pf.extra_bytes == HEADROOM + GIB and not pf.measured
    merged, cause = merge(calm(), pf)
    assert cause == "phase:eval" and merged.time_to_oom_s == pytest.approx(60.0)
    assert {h: merged.risk[h] for h in HORIZONS_S} == {
        h: PHASE_RISK if h >= 60 else 0.01 for h in HORIZONS_S
    }
    # half a second after the step-40 sample, the eval is half a second nearer
    later = sample(40, ts=last.ts + 0.5)
    state.observe(later)
    pf = state.forecast(later)
    assert pf is not None and pf.time_to_oom_s == pytest.approx(59.5)


def test_an_eval_that_fits_gives_nothing() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM - GIB}, eval_every_steps=100))
    assert state.forecast(run(state, range(41))) is None


def test_the_margin_counts_against_the_phase() -> None:
    """An eval that would fill the device to within the last 2% does not fit."""
    state = PhaseState()
    state.on_schedule(schedule({"eval": TOTAL - USED - GIB}, eval_every_steps=100))
    assert state.forecast(run(state, range(41))) is not None


def test_after_the_eval_ran_the_measured_extra_replaces_the_announced_one() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    run(state, range(100))
    at_100 = sample(100)
    state.observe(at_100)
    pf = state.forecast(at_100)  # step 100 done, its eval not yet run: now
    assert pf is not None and pf.time_to_oom_s == 0.0 and pf.steps_away == 0
    # the eval ran, peaking 2 GiB above the level before it, and the job went on
    state.observe(sample(100, ts=at_100.ts + 5, phase="eval", peak_bytes=USED + 2 * GIB))
    assert state.extra_bytes["eval"] == 2 * GIB and "eval" in state.measured
    assert state.forecast(run(state, range(101, 141))) is None
    # a repeated announcement does not undo the measurement
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    assert state.extra_bytes["eval"] == 2 * GIB
    # a later, bigger eval is kept: evals vary with their data
    state.observe(sample(200, phase="eval", peak_bytes=USED + 3 * GIB))
    assert state.extra_bytes["eval"] == 3 * GIB


def test_a_measured_figure_in_a_schedule_replaces_the_announced_one() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    state.on_schedule(schedule({"eval": GIB}, eval_every_steps=100, measured=("eval",)))
    assert state.forecast(run(state, range(41))) is None


def test_the_earliest_phase_that_does_not_fit_is_the_one_forecast() -> None:
    state = PhaseState()
    big = HEADROOM + GIB
    state.on_schedule(
        schedule({"eval": big, "checkpoint": big}, eval_every_steps=100, checkpoint_every_steps=50)
    )
    pf = state.forecast(run(state, range(41)))
    assert pf is not None and pf.phase == "checkpoint" and pf.time_to_oom_s == pytest.approx(10)


def test_the_step_rate_is_measured_and_step_s_is_the_fallback() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100, step_s=3.0))
    state.observe(sample(40))  # one step seen: no rate yet, the announced one
    pf = state.forecast(sample(40))
    assert pf is not None and pf.time_to_oom_s == pytest.approx(180.0)
    for i in range(41, 46):  # then 2 s per step, one step stretched by a pause
        state.observe(sample(i, ts=T0 + 40 + 2 * (i - 40) + (30 if i == 43 else 0)))
    assert state.step_s() == pytest.approx(2.0)
    # without step_s and with one step seen, nothing can be timed
    bare = PhaseState()
    bare.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    bare.observe(sample(40))
    assert bare.forecast(sample(40)) is None


def test_the_first_optimizer_step_is_forecast_until_it_has_run() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"optimizer": HEADROOM + GIB}, step_s=20.0))
    first = sample(0)
    state.observe(first)
    pf = state.forecast(first)
    assert pf is not None and pf.cause == "phase:optimizer"
    assert pf.time_to_oom_s == pytest.approx(20.0)
    state.observe(sample(1, ts=T0 + 20, used_bytes=USED + GIB))  # it ran; its state stays
    assert state.forecast(sample(1, ts=T0 + 20)) is None


def test_the_first_optimizer_step_is_judged_from_the_start_of_its_step() -> None:
    """Mid-forward, the use holds the step's activations, which are gone by the time the
    optimizer's state appears: counting both was 15 false alarms in 160 safe simulated
    runs (docs/phases.md). The step began at USED - 8 GiB; 6 GiB more fit from there."""
    state = PhaseState()
    state.on_schedule(schedule({"optimizer": HEADROOM + 6 * GIB}, step_s=20.0))
    state.observe(sample(0, used_bytes=USED - 8 * GIB))  # the weights, at the step's start
    mid_forward = sample(0, ts=T0 + 5)  # activations on top: USED
    state.observe(mid_forward)
    assert state.forecast(mid_forward) is None
    # a first step that does not fit even from its start is still forecast
    tight = PhaseState()
    tight.on_schedule(schedule({"optimizer": HEADROOM + 9 * GIB}, step_s=20.0))
    tight.observe(sample(0, used_bytes=USED - 8 * GIB))
    tight.observe(mid_forward)
    pf = tight.forecast(mid_forward)
    assert pf is not None and pf.phase == "optimizer" and pf.headroom_bytes == HEADROOM + 8 * GIB
    # and the snapshot keeps where the step began
    assert PhaseState.from_dict(tight.to_dict()).step_start_bytes == USED - 8 * GIB


def test_a_step_count_that_starts_over_is_a_new_run() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    run(state, range(90))
    state.observe(sample(90, phase="eval", peak_bytes=USED))
    run(state, range(1000, 1002))  # ts moves on
    state.observe(sample(5, ts=T0 + 2000))
    assert list(state.steps) == [(T0 + 2000, 5)] and state.last_ran == {}


def test_merge_keeps_the_lstms_forecast_when_it_is_the_earlier_and_riskier() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    pf = state.forecast(run(state, range(41)))
    assert pf is not None
    alarmed = Forecast(dict.fromkeys(HORIZONS_S, 0.99), 10.0, T0, "lstm-test")
    assert merge(alarmed, pf) == (alarmed, None)
    mid = Forecast({h: 0.5 for h in HORIZONS_S}, 20.0, T0, "lstm-test")
    merged, cause = merge(mid, pf)
    assert cause == "phase:eval" and merged.time_to_oom_s == 20.0
    assert merged.risk[120] == PHASE_RISK and merged.risk[30] == 0.5
    assert list(merged.risk.values()) == sorted(merged.risk.values())  # never decreasing


def test_the_state_survives_a_round_trip_and_refuses_a_damaged_one() -> None:
    state = PhaseState()
    state.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100, step_s=2.0))
    run(state, range(100))
    state.observe(sample(100, phase="eval", peak_bytes=USED + GIB))
    run(state, range(101, 110))
    back = PhaseState.from_dict(state.to_dict())
    assert back.to_dict() == state.to_dict()
    assert back.forecast(sample(110)) == state.forecast(sample(110))
    assert PhaseState.from_dict(PhaseState().to_dict()).to_dict() == PhaseState().to_dict()
    for damage in (
        {"extra_bytes": {"forward": 1}},
        {"measured": ["eval", 3]},
        {"last_ran": {"eval": -1}},
        {"steps": [[1.0]]},
        {"level_bytes": "big"},
        {"schedule": {"event": "schedule"}},
    ):
        with pytest.raises(ValueError):
            PhaseState.from_dict(state.to_dict() | damage)
