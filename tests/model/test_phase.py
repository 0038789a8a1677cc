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


# --- allocation terms: the caching allocator's cached blocks are room --------------------------

OUTSIDE = GIB  # the CUDA context and libraries: used - reserved
USABLE = TOTAL - int(MARGIN_FRAC * TOTAL)


def gpu(step: int, allocated: int, reserved: int, **over: Any) -> Sample:
    """A CUDA hook's sample: the device's use is what is outside the allocator plus its
    reservation."""
    fields = {"allocated_bytes": allocated, "reserved_bytes": reserved}
    fields |= {"used_bytes": OUTSIDE + reserved} | over
    return sample(step, **fields)


def checkpoint_run(state: PhaseState) -> None:
    """A checkpoint every 100 steps, announced at 10 GiB (allocated bytes). Before it the
    allocator holds 60 GiB of 61 reserved; the checkpoint reserves 9 GiB more, and when it
    ends its blocks stay cached: 60 GiB allocated of 70 reserved."""
    state.on_schedule(schedule({"checkpoint": 10 * GIB}, checkpoint_every_steps=100))
    for i in range(101):
        state.observe(gpu(i, 60 * GIB, 61 * GIB))
    ended = gpu(100, 60 * GIB, 70 * GIB, phase="checkpoint", peak_bytes=OUTSIDE + 70 * GIB)
    state.observe(ended)


def test_a_checkpoint_served_from_cached_blocks_is_not_forecast() -> None:
    """After a checkpoint its blocks stay reserved: the device has only 78.4 - 71 GiB free,
    but the next checkpoint is served from the 10 GiB of cached blocks (17.4 GiB of room in
    all). In used terms it did not fit and was forecast at every sample: a false alarm."""
    state = PhaseState()
    checkpoint_run(state)
    # the hook measured it from the allocator's peak: 10 GiB above the allocated level
    state.on_schedule(
        schedule({"checkpoint": 10 * GIB}, checkpoint_every_steps=100, measured=("checkpoint",))
    )
    for i in range(101, 200):
        s = gpu(i, 60 * GIB, 70 * GIB)
        state.observe(s)
        assert USABLE - s.used_bytes < 10 * GIB  # no room in used terms
        assert state.forecast(s) is None, i


def test_a_checkpoint_whose_cached_blocks_a_creep_refilled_is_forecast() -> None:
    """A slow creep fills the cached blocks the first checkpoint left, then takes fresh
    memory: the next checkpoint no longer fits and is forecast before it comes. The
    service does not measure it from the tagged sample (its peak is the reservation's,
    which did not rise after the first: it read 0 and replaced the announced 10 GiB, so
    nothing was forecast); the figure stays the announced one until the hook sends its own."""
    state = PhaseState()
    checkpoint_run(state)
    assert state.extra_bytes["checkpoint"] == 10 * GIB and "checkpoint" not in state.measured
    half = gpu(140, 65 * GIB, 70 * GIB)  # the creep is in the cached blocks: room for 10 GiB
    state.observe(half)
    assert state.forecast(half) is None
    full = gpu(150, 72 * GIB, 72 * GIB)  # they are full, and 2 GiB more were reserved
    state.observe(full)
    pf = state.forecast(full)
    assert pf is not None and pf.phase == "checkpoint" and pf.steps_away == 50
    assert pf.time_to_oom_s == pytest.approx(50.0)
    assert pf.extra_bytes == 10 * GIB and pf.headroom_bytes == USABLE - OUTSIDE - 72 * GIB
    # the hook's figure, measured on the allocator's peak, is taken as it comes
    state.on_schedule(
        schedule({"checkpoint": 11 * GIB}, checkpoint_every_steps=100, measured=("checkpoint",))
    )
    pf = state.forecast(full)
    assert pf is not None and pf.extra_bytes == 11 * GIB and pf.measured


def test_in_allocation_terms_a_phase_is_judged_from_the_level_between_steps() -> None:
    """Mid-forward, the allocator holds the step's activations, freed before the checkpoint
    runs: the checkpoint is judged from the step's first sample (its reservation is the
    same either way, so in used terms nothing changes)."""
    state = PhaseState()
    state.on_schedule(schedule({"checkpoint": 10 * GIB}, checkpoint_every_steps=100, step_s=1.0))
    state.observe(gpu(40, 60 * GIB, 72 * GIB))  # the step ended: activations freed
    mid = gpu(40, 70 * GIB, 72 * GIB, ts=T0 + 40.5)  # the next one's forward
    state.observe(mid)
    assert state.forecast(mid) is None
    # a level that does not leave room between steps either is forecast
    state.observe(gpu(41, 69 * GIB, 72 * GIB))
    pf = state.forecast(gpu(41, 70 * GIB, 72 * GIB, ts=T0 + 41.5))
    assert pf is not None and pf.headroom_bytes == USABLE - OUTSIDE - 69 * GIB


# --- the first optimizer step's absolute peak, known before the job starts ------------------


def loading(state: PhaseState, peak: int, extra: int) -> list[Sample]:
    """A job that announces its first step's absolute peak and what it needs above the
    weights (30 GiB: peak - extra), then loads them at 1 GiB/s; 2 GiB outside the
    allocator. Its samples, one every 5 s, observed."""
    state.on_schedule(
        schedule({"optimizer": extra}, step_s=2.0, phase_peak_bytes={"optimizer": peak})
    )
    out = []
    for k, loaded in enumerate((1, 6, 11, 16, 21, 26, 30, 30)):
        s = gpu(0, loaded * GIB, loaded * GIB, ts=T0 + 5 * k, used_bytes=(2 + loaded) * GIB)
        state.observe(s)
        out.append(s)
    return out


def test_an_announced_first_step_peak_above_the_device_is_forecast_from_the_first_sample() -> None:
    state = PhaseState()
    samples = loading(state, peak=77 * GIB, extra=47 * GIB)  # 77 + 2 outside > 78.4
    first = state.forecast(samples[0])
    assert first is not None and first.phase == "optimizer" and first.cause == "phase:optimizer"
    assert first.time_to_oom_s == pytest.approx(2.0)  # no load rate yet: one step
    assert not first.measured and first.extra_bytes > first.headroom_bytes
    # once the rate shows (1 GiB/s), the rest of the load (19 GiB at 11 loaded), then a step
    third = state.forecast(samples[2])
    assert third is not None and third.time_to_oom_s == pytest.approx(19.0 + 2.0)
    for s in samples:  # at every sample of the load: 30 s ahead of a step that is 45 s away
        pf = state.forecast(s)
        assert pf is not None and pf.phase == "optimizer", s
    merged, cause = merge(calm(), state.forecast(samples[0]))
    assert cause == "phase:optimizer" and merged.risk[30] == PHASE_RISK
    # the step ran (it did fit after all): the announced peak is spent
    ran = gpu(1, 60 * GIB, 70 * GIB, ts=T0 + 45, phase="optimizer")
    state.observe(ran)
    assert state.peak_bytes == {} and state.forecast(ran) is None
    # the snapshot keeps the peak and where the load began
    again = PhaseState()
    loading(again, peak=77 * GIB, extra=47 * GIB)
    back = PhaseState.from_dict(again.to_dict())
    assert back.peak_bytes == {"optimizer": 77 * GIB} and back.load_start == (T0, GIB)
    assert back.forecast(samples[2]) == again.forecast(samples[2])


def test_an_announced_first_step_peak_that_fits_the_device_is_never_forecast() -> None:
    state = PhaseState()
    samples = loading(state, peak=75 * GIB, extra=45 * GIB)  # 75 + 2 outside < 78.4
    for s in samples:
        assert state.forecast(s) is None, s
    step = gpu(0, 74 * GIB, 76 * GIB, ts=T0 + 41, used_bytes=78 * GIB)  # in the step
    state.observe(step)
    assert state.forecast(step) is None


def test_an_announced_peak_is_dropped_once_its_phase_has_run_or_been_measured() -> None:
    state = PhaseState()
    state.on_schedule(schedule({}, step_s=2.0, phase_peak_bytes={"optimizer": TOTAL}))
    state.on_schedule(
        schedule({"optimizer": GIB}, measured=("optimizer",), phase_peak_bytes={"optimizer": TOTAL})
    )
    assert state.peak_bytes == {}
    first = sample(0)
    state.observe(first)
    assert state.forecast(first) is None


@pytest.mark.parametrize(
    "damage", [{"peak_bytes": {"forward": 1}}, {"load_start": [1.0]}, {"load_start": [1.0, -2]}]
)
def test_a_damaged_peak_or_load_in_a_snapshot_is_refused(damage: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PhaseState.from_dict(PhaseState().to_dict() | damage)


def arrival(need: int, lands_at: float, peak: int | None = None, job: str = "b") -> Any:
    from oomcast.model.events import ArrivalEvent

    return ArrivalEvent(T0, "n1", "cuda0", "arrival", job, need_bytes=need, lands_at=lands_at,
                        resident_peak_bytes=peak)  # fmt: skip


def test_an_announced_arrival_that_will_not_fit_is_forecast_until_just_after_it_lands() -> None:
    st = PhaseState()  # no schedule: an arrival is the GPU's, not the job's
    st.on_arrival(arrival(HEADROOM + GIB, T0 + 60))
    pf = st.forecast(sample(None, ts=T0 + 10))
    assert pf is not None and pf.phase == "arrival" and pf.cause == "phase:arrival"
    assert pf.time_to_oom_s == pytest.approx(50.0) and pf.headroom_bytes == HEADROOM
    merged, cause = merge(calm(), pf)
    assert cause == "phase:arrival" and merged.risk_at(60) == PHASE_RISK
    assert merged.risk_at(45) < 0.5  # it lands in 50 s: not within 45
    assert st.forecast(sample(None, ts=T0 + 80)) is not None  # landed, ramping up
    assert st.forecast(sample(None, ts=T0 + 91)) is None and not st.arrivals  # 30 s after
    # one that fits warns nobody; a peak the residents reached before counts against it
    st.on_arrival(arrival(HEADROOM - GIB, T0 + 60))
    assert st.forecast(sample(None, ts=T0 + 10)) is None
    st.on_arrival(arrival(HEADROOM - GIB, T0 + 60, peak=USED + 2 * GIB))
    assert st.forecast(sample(None, ts=T0 + 10)) is not None


def test_the_earliest_of_an_arrival_and_a_phase_is_forecast_and_arrivals_outlive_the_job() -> None:
    st = PhaseState()
    st.on_schedule(schedule({"eval": HEADROOM + GIB}, eval_every_steps=100))
    run(st, range(0, 10))  # step 9 at T0 + 9: the eval comes in 91 s
    st.on_arrival(arrival(HEADROOM + GIB, T0 + 30))
    pf = st.forecast(sample(9))
    assert pf is not None and pf.phase == "arrival" and pf.time_to_oom_s == pytest.approx(21.0)
    st.on_arrival(arrival(HEADROOM + GIB, T0 + 200))  # the same job, announced again: later
    pf = st.forecast(sample(9))
    assert pf is not None and pf.phase == "eval" and len(st.arrivals) == 1
    kept = st.carried()
    assert kept is not None and kept.schedule is None and kept.arrivals == st.arrivals
    assert PhaseState().carried() is None
    # and the announcement travels with the domain's snapshot; a damaged one is refused
    back = PhaseState.from_dict(st.to_dict())
    assert back.arrivals == st.arrivals
    bad = st.to_dict()
    bad["arrivals"] = [{"job": "b", "lands_at": "soon", "need_bytes": 1}]
    with pytest.raises(ValueError, match="lands_at"):
        PhaseState.from_dict(bad)


def test_after_it_lands_an_arrival_is_not_judged_again_on_top_of_its_own_memory() -> None:
    st = PhaseState()
    st.on_arrival(arrival(HEADROOM - GIB, T0 + 60))  # fits beside 60 GiB
    assert st.forecast(sample(None, ts=T0 + 59)) is None
    # it landed and ramps up: the level has its memory now, which must not count twice
    assert st.forecast(sample(None, ts=T0 + 65, used_bytes=USED + 6 * GIB)) is None
    assert not st.arrivals
    # one that did not fit when it landed stays forecast while its memory ramps up
    st.on_arrival(arrival(HEADROOM + GIB, T0 + 60, job="c"))
    assert st.forecast(sample(None, ts=T0 + 59)) is not None
    ramp = st.forecast(sample(None, ts=T0 + 70, used_bytes=USED + 6 * GIB))
    assert ramp is not None and ramp.time_to_oom_s == 0.0
    back = PhaseState.from_dict(st.to_dict())  # the verdict travels with the snapshot
    assert back.unfit == {"c"} and back.forecast(sample(None, ts=T0 + 75)) is not None


# --- a phase that grows, a level that creeps -------------------------------------------------


def evals_measured(state: PhaseState, figures: list[int]) -> None:
    """Evals every 100 steps whose figures the hook measured, one after each (as the hook
    does: the sample that ends the eval, then the schedule event with its figure)."""
    for n, extra in enumerate(figures, 1):
        run(state, range((n - 1) * 100, n * 100))
        state.observe(sample(n * 100, phase="eval", allocated_bytes=0, reserved_bytes=0))
        state.on_schedule(schedule({"eval": extra}, eval_every_steps=100, measured=("eval",)))


def test_figures_measured_again_within_one_eval_are_one_occurrence() -> None:
    # a hook that publishes the figure as the eval goes (the simulator's does, after each
    # sample of it): 2, then 3 and 4 GiB during the one eval at step 100; then 5 at step 200.
    # Two occurrences are no trend: nothing is projected
    state = PhaseState()
    state.on_schedule(schedule({}, eval_every_steps=100))
    run(state, range(100))
    for extra in (2 * GIB, 3 * GIB, 4 * GIB):
        state.observe(sample(100, phase="eval", allocated_bytes=0, reserved_bytes=0))
        state.on_schedule(schedule({"eval": extra}, eval_every_steps=100, measured=("eval",)))
    run(state, range(101, 200))
    state.observe(sample(200, phase="eval", allocated_bytes=0, reserved_bytes=0))
    state.on_schedule(schedule({"eval": 5 * GIB}, eval_every_steps=100, measured=("eval",)))
    assert state.history["eval"] == [[100, 4 * GIB], [200, 5 * GIB]]
    assert state.next_figure("eval") == 5 * GIB


def test_an_eval_that_needed_more_each_time_is_forecast_to_need_more_again() -> None:
    # 2, 3 and 4.5 GiB: the next one is taken at 4.5 + 1.5 = 6 GiB, above the 5 GiB of
    # room, while the largest seen so far (4.5 GiB) would fit
    state = PhaseState()
    state.on_schedule(schedule({}, eval_every_steps=100))
    evals_measured(state, [2 * GIB, 3 * GIB, GIB * 9 // 2])
    assert state.next_figure("eval") == 6 * GIB
    now = sample(350, used_bytes=TOTAL - int(MARGIN_FRAC * TOTAL) - 5 * GIB)
    state.observe(now)
    pf = state.forecast(now)
    assert pf is not None and pf.phase == "eval" and pf.extra_bytes == 6 * GIB
    assert pf.time_to_oom_s == pytest.approx(50.0) and pf.measured


@pytest.mark.parametrize(
    "figures",
    [
        [2 * GIB, 3 * GIB],  # two occurrences are no trend yet
        [2 * GIB, 3 * GIB, 3 * GIB + GIB // 100],  # the last grew by 0.3%: noise
        [3 * GIB, 2 * GIB, GIB * 9 // 2],  # not growing each time
    ],
)
def test_an_eval_that_did_not_grow_steadily_keeps_its_figure(figures: list[int]) -> None:
    state = PhaseState()
    state.on_schedule(schedule({}, eval_every_steps=100))
    evals_measured(state, figures)
    assert state.next_figure("eval") == figures[-1]


def test_a_checkpoint_that_a_creep_will_crowd_out_is_forecast_before_it_does() -> None:
    # the checkpoint needs 10 GiB; there are 14 GiB of room now, and the level between steps
    # rises 0.1 GiB/s: 50 s from now, when the checkpoint comes, 9 GiB are left
    state = PhaseState()
    state.on_schedule(
        schedule({"checkpoint": 10 * GIB}, checkpoint_every_steps=100, measured=("checkpoint",))
    )
    flat = PhaseState.from_dict(state.to_dict())
    start = USABLE - 14 * GIB - 5 * GIB
    for i in range(51):
        used = start + int(i * GIB / 10)
        state.observe(sample(i, used_bytes=used))
        flat.observe(sample(i, used_bytes=start + 5 * GIB))  # the same room, no creep
    now = sample(50, used_bytes=start + 5 * GIB)
    assert state.creep_bytes_per_s() == pytest.approx(GIB / 10, rel=0.01)
    pf = state.forecast(now)
    assert pf is not None and pf.phase == "checkpoint" and pf.time_to_oom_s == pytest.approx(50)
    assert pf.headroom_bytes < pf.extra_bytes == 10 * GIB
    assert flat.creep_bytes_per_s() == 0.0 and flat.forecast(now) is None


def test_a_level_that_only_wanders_projects_no_creep() -> None:
    state = PhaseState()
    for i in range(120):
        state.observe(sample(i, used_bytes=USED + (GIB if i % 2 else -GIB)))
    assert state.creep_bytes_per_s() == 0.0
    short = PhaseState()
    for i in range(20):  # a clear rise, but over 20 s only
        short.observe(sample(i, used_bytes=USED + i * GIB))
    assert short.creep_bytes_per_s() == 0.0


def test_the_figures_and_levels_survive_a_round_trip_and_damage_is_refused() -> None:
    state = PhaseState()
    state.on_schedule(schedule({}, eval_every_steps=100))
    evals_measured(state, [2 * GIB, 3 * GIB, GIB * 9 // 2])
    back = PhaseState.from_dict(state.to_dict())
    assert back.history == {"eval": [[100, 2 * GIB], [200, 3 * GIB], [300, GIB * 9 // 2]]}
    assert list(back.levels) == list(state.levels) and back.next_figure("eval") == 6 * GIB
    for damage in (
        {"history": {"forward": [1]}},
        {"history": {"eval": [[1, -2]]}},
        {"history": {"eval": [[1, 2], [2, 3], [3, 4], [4, 5]]}},
        {"history": {"eval": [7]}},
        {"levels": [[1.0, "x"]]},
        {"levels": "no"},
    ):
        with pytest.raises(ValueError):
            PhaseState.from_dict(state.to_dict() | damage)


def test_a_level_that_jumped_once_projects_no_creep() -> None:
    # the first steps' allocations (optimizer state, a cache) lift the level once, then it
    # holds: the least-squares slope over the window is clearly positive, but it is no creep
    state = PhaseState()
    for i in range(60):
        state.observe(sample(i, used_bytes=USED + (4 * GIB if i >= 20 else 0)))
    assert state.creep_bytes_per_s() == 0.0


def test_a_level_that_rose_in_two_steps_projects_no_creep() -> None:
    # a cache that grew twice in two minutes is a staircase, not a creep
    state = PhaseState()
    for i in range(120):
        state.observe(sample(i, used_bytes=USED + 2 * GIB * ((i >= 30) + (i >= 90))))
    assert state.creep_bytes_per_s() == 0.0


def test_a_creep_that_alone_fills_the_room_is_left_to_the_stream() -> None:
    # 0.1 GiB/s with 5 GiB of room: the creep reaches the limit by itself in 50 s, before
    # the checkpoint 100 s away; the phase forecast does not claim that OOM as the checkpoint's
    state = PhaseState()
    state.on_schedule(
        schedule({"checkpoint": GIB // 2}, checkpoint_every_steps=200, measured=("checkpoint",))
    )
    start = USABLE - 5 * GIB - 10 * GIB
    for i in range(101):
        state.observe(sample(i, used_bytes=start + int(i * GIB / 10)))
    assert state.creep_bytes_per_s() > 0
    assert state.forecast(sample(100, used_bytes=start + 10 * GIB)) is None


def test_new_highs_that_are_not_consecutive_occurrences_are_no_growth() -> None:
    # a hook sends a figure only when an eval needs more than any before: the highs of the
    # 1st, 3rd and 6th evals of a job whose evals vary are no trend
    state = PhaseState()
    state.on_schedule(schedule({}, eval_every_steps=100))
    run(state, range(600))
    for at, extra in ((100, 2 * GIB), (300, 3 * GIB), (600, GIB * 9 // 2)):
        state.observe(sample(at, phase="eval", allocated_bytes=0, reserved_bytes=0))
        state.on_schedule(schedule({"eval": extra}, eval_every_steps=100, measured=("eval",)))
    assert [s for s, _ in state.history["eval"]] == [100, 300, 600]
    assert state.next_figure("eval") == GIB * 9 // 2


def test_an_extreme_step_time_does_not_break_the_forecast() -> None:
    # a schedule may say anything positive: 1e308 s a step puts the checkpoint, 5 steps
    # away, at an infinite time (0 x inf was NaN, and int(NaN) raised in every batch)
    state = PhaseState()
    state.on_schedule(
        schedule({"checkpoint": HEADROOM + GIB}, checkpoint_every_steps=5, step_s=1e308)
    )
    first = sample(0)
    state.observe(first)
    pf = state.forecast(first)
    assert pf is not None and pf.phase == "checkpoint" and pf.time_to_oom_s == float("inf")


@pytest.mark.parametrize(
    "damage",
    [
        {"levels": [[float("nan"), 1]]},
        {"levels": [[1.0, 2**70]]},
        {"levels": [[10.0, 1], [5.0, 1]]},  # out of order
        {"levels": [[True, 1]]},
        {"steps": [[float("inf"), 1]]},
        {"history": {"eval": [[1, 2**70]]}},
        {"history": {"eval": [[True, 1]]}},
    ],
)
def test_a_snapshot_s_levels_steps_and_figures_are_checked(damage: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        PhaseState.from_dict(PhaseState().to_dict() | damage)
