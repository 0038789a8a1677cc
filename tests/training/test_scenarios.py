from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, cast

import pytest

from oomcast.model.events import ScheduleEvent
from oomcast.model.phase import PhaseState
from oomcast.model.schema import Event, Sample
from oomcast.model.trace import load_trace, write_trace
from oomcast.training.scenarios import (
    FAMILIES,
    OOM_FAMILIES,
    SAFE_FAMILIES,
    _Point,
    _sample_points,
    _with_schedule,
    draw_params,
    simulate_scenario,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("captures")


def test_parameters_are_deterministic_and_plausible() -> None:
    for family in FAMILIES:
        a, b = draw_params(family, 3), draw_params(family, 3)
        assert a == b
        assert a != draw_params(family, 4)
        assert 16 <= a.gpu_gib <= 141
        assert 0.1 <= a.interval_s <= 2.0
        assert 300 <= a.context_mib <= 500
        assert a.nccl_mib == 0 or 512 <= a.nccl_mib <= 1640
    with pytest.raises(ValueError, match="unknown scenario family"):
        draw_params("meteor", 0)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_traces_are_valid_and_physically_consistent(
    family: str, cache: Path, tmp_path: Path
) -> None:
    params = draw_params(family, 1)
    records, summary = simulate_scenario(params, cache)
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, records)
    trace = load_trace(path)  # schema and time order hold
    (domain,) = trace.samples
    samples = trace.samples[domain]
    assert len(samples) == summary["samples"] > 0
    context = params.context_mib << 20
    for s in samples:
        assert s.allocated_bytes is not None and s.reserved_bytes is not None
        assert s.reserved_bytes >= s.allocated_bytes
        assert s.used_bytes <= s.total_bytes == params.gpu_gib << 30
        # NVML sees the context and libraries on top of the allocator (a little noise aside)
        assert s.used_bytes >= s.reserved_bytes + context - (16 << 20)
        assert s.peak_bytes is not None and s.peak_bytes >= s.used_bytes - (16 << 20)
    retries = [s.alloc_retries or 0 for s in samples]
    assert retries == sorted(retries)  # cumulative
    ooms = [e for e in trace.events if e.event == "oom"]
    assert bool(ooms) == summary["ooms"]
    if ooms:
        assert ooms[0].ts >= samples[-1].ts


def test_same_parameters_same_trace(cache: Path) -> None:
    params = draw_params("leak", 2)
    a, _ = simulate_scenario(params, cache)
    b, _ = simulate_scenario(params, cache)
    assert a == b


@pytest.mark.slow
def test_oom_families_oom_and_safe_families_do_not(cache: Path) -> None:
    for family in OOM_FAMILIES:
        outcomes = [simulate_scenario(draw_params(family, s), cache)[1]["ooms"] for s in range(4)]
        assert any(outcomes), family
    for family in SAFE_FAMILIES:
        for seed in range(4):
            _, summary = simulate_scenario(draw_params(family, seed), cache)
            assert not summary["ooms"], (family, seed)


def test_nccl_buffers_and_a_neighbour_show_in_nvml_but_not_in_the_allocator(
    cache: Path,
) -> None:
    for seed in range(40):
        params = draw_params("neighbour", seed)
        if params.nccl_mib:
            break
    records, _ = simulate_scenario(params, cache)
    samples = [r for r in records if isinstance(r, Sample)]
    outside = [s.used_bytes - (s.reserved_bytes or 0) for s in samples]
    base = (params.context_mib + params.workspace_mib) << 20
    assert abs(outside[0] - base) < 16 << 20
    assert max(outside) >= base + (params.nccl_mib << 20) + (1 << 30)  # the neighbour arrived
    assert any(isinstance(r, Event) for r in records) or max(outside) < samples[0].total_bytes


GIB = 1 << 30


class _FakeRun:
    """What the sampler and the hook view read of a run: its points and its device."""

    total = 80 * GIB
    node, device, job, start_ts = "sim-node", "gpu0", "j", 1_700_000_000.0

    def __init__(self, points: list[_Point]) -> None:
        self.points = points

    def outside_at(self, t: float) -> int:
        return GIB


def test_the_simulated_hook_measures_a_phase_from_the_allocators_allocated_peak() -> None:
    """A checkpoint served from cached blocks leaves the reservation where it was: in used
    terms it measured 0, and a creep that then filled the cached blocks made the next
    checkpoint an OOM no figure announced. The hook's measure in allocation terms is the
    copy's 10 GiB, and with it the phase forecaster sees the next checkpoint not fitting
    once the creep has filled the cache, before it comes."""
    pts = [_Point(0.0, 60 * GIB, 72 * GIB, 0, 0, "other")]
    for step in range(1, 9):
        creep = max(0, step - 2) * 3 * GIB  # fills the 12 GiB cached from step 3 on
        allocated = 60 * GIB + creep
        reserved = max(72 * GIB, allocated)
        pts.append(_Point(step - 0.5, allocated + GIB, reserved, 0, step - 1, "forward"))
        pts.append(_Point(float(step), allocated, reserved, 0, step, "optimizer"))
        if step == 2:  # the checkpoint: a 10 GiB copy, from the cached blocks
            pts.append(_Point(2.4, allocated, reserved, 0, 2, "checkpoint", allocated + 10 * GIB))
    params = replace(draw_params("spikes", 0), interval_s=0.25, step_s=1.0)
    run = _FakeRun(pts)
    records, view = _sample_points(cast(Any, run), params, None)
    out = _with_schedule(records, view, cast(Any, run), params, (None, 6), {}, {})
    events = [r for r in out if isinstance(r, ScheduleEvent)]
    measured = [e for e in events if "checkpoint" in e.measured]
    assert measured and measured[0].phase_extra_bytes["checkpoint"] == 10 * GIB
    state = PhaseState()
    forecasts = []
    for r in out:
        if isinstance(r, ScheduleEvent):
            state.on_schedule(r)
        elif isinstance(r, Sample):
            state.observe(r)
            pf = state.forecast(r)
            forecasts.append((r.step, None if pf is None else pf.phase))
    # served from cache at steps 2 to 4; no room once the creep has filled it (step 5 on)
    assert all(phase is None for step, phase in forecasts if step is not None and step < 5)
    assert "checkpoint" in {phase for step, phase in forecasts if step == 5}, forecasts


def test_an_announced_job_announces_its_first_steps_absolute_peak(cache: Path) -> None:
    params = draw_params("optimizer_state", 1)
    records, summary = simulate_scenario(params, cache, announce_share=1.0)
    first = next(r for r in records if isinstance(r, ScheduleEvent))
    assert summary["announced"]
    peak, extra = first.phase_peak_bytes["optimizer"], first.phase_extra_bytes["optimizer"]
    # absolute: the loaded weights and the first steps' extra, less what those steps free
    # of the loaded storages before their peak
    samples = [r for r in records if isinstance(r, Sample)]
    loaded = max(s.allocated_bytes or 0 for s in samples if s.step == 0 and s.phase == "other")
    assert loaded < peak <= loaded + extra + (64 << 20)
    assert peak - extra > loaded // 2
    bare, _ = simulate_scenario(params, cache, announce_share=0.0)
    assert all(r.phase_peak_bytes == {} for r in bare if isinstance(r, ScheduleEvent))


def test_an_announced_neighbour_is_the_same_run_with_an_arrival_before_it_lands(
    cache: Path, tmp_path: Path
) -> None:
    from oomcast.model.events import ArrivalEvent
    from oomcast.model.forecast import Detector
    from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster
    from oomcast.training.evaluate import score_trace

    params = draw_params("neighbour", 1)
    records, summary = simulate_scenario(params, cache, announce_share=1.0)
    bare, bare_summary = simulate_scenario(params, cache, announce_share=0.0)
    arrivals = [r for r in records if isinstance(r, ArrivalEvent)]
    assert len(arrivals) == 1 and not any(isinstance(r, ArrivalEvent) for r in bare)
    assert [r for r in records if not isinstance(r, ArrivalEvent)] == bare  # the same run
    arrival = arrivals[0]
    start = next(r.ts for r in records if isinstance(r, Sample))
    assert arrival.lands_at == pytest.approx(start + params.extra["arrive_s"], abs=1e-3)
    assert 10.0 - 1e-3 <= arrival.lands_at - arrival.ts <= 120.0 + 1e-3 or arrival.ts == start
    assert summary["announced"] and not bare_summary["announced"]
    assert summary["arrival_announced_s_before"] == round(arrival.lands_at - arrival.ts, 3)
    # the trace keeps it, and the shipped model with the phase forecasts merged in warns the
    # running job before the neighbour lands; without the announcement, not before its OOM
    write_trace(tmp_path / "a.jsonl", records)
    write_trace(tmp_path / "b.jsonl", bare)
    trace, plain = load_trace(tmp_path / "a.jsonl"), load_trace(tmp_path / "b.jsonl")
    assert [e for e in trace.events if isinstance(e, ArrivalEvent)] == arrivals
    fc = OnnxForecaster(DEFAULT_MODEL)
    det = Detector("model", fc, fc.rule)
    warned = score_trace(det, trace, "neighbour", phases=True)
    assert warned.first_alert_ts is not None and warned.first_alert_ts < arrival.lands_at
    line = warned.to_dict()  # what --per-trace writes
    assert line["lands_at"] == arrival.lands_at and line["oom_after_landing"] is True
    assert line["alert_before_landing_s"] == round(arrival.lands_at - warned.first_alert_ts, 3)
    assert "lands_at" not in score_trace(det, plain, "neighbour", phases=True).to_dict()
    unwarned = score_trace(det, plain, "neighbour", phases=True)
    assert unwarned.first_alert_ts is None or unwarned.first_alert_ts > arrival.lands_at
