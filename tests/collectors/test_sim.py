"""collectors/sources/sim.py: simulated GPUs on virtual time and on a polled clock."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from oomcast.collectors.sources.sim import (
    GIB,
    OOM_PATTERNS,
    PATTERNS,
    SimGPU,
    SimSource,
    default_gpus,
    simulate_trace,
)
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import load_trace, write_trace

T0 = 1_700_000_000.0


def dicts(recs: list[Record]) -> list[dict[str, object]]:
    return [r.to_dict() for r in recs]


def samples_of(recs: list[Record]) -> list[Sample]:
    return [r for r in recs if isinstance(r, Sample)]


@pytest.mark.parametrize("pattern", PATTERNS)
def test_simulate_trace_is_deterministic_for_a_seed(pattern: str) -> None:
    a = simulate_trace(pattern, seed=3, duration_s=120)
    b = simulate_trace(pattern, seed=3, duration_s=120)
    assert len(a) > 50
    assert dicts(a) == dicts(b)


@pytest.mark.parametrize("pattern", PATTERNS)
def test_simulate_trace_differs_across_seeds(pattern: str) -> None:
    a = [s.used_bytes for s in samples_of(simulate_trace(pattern, seed=0, duration_s=60))]
    b = [s.used_bytes for s in samples_of(simulate_trace(pattern, seed=1, duration_s=60))]
    assert a != b


def test_simulate_trace_timing_and_identity() -> None:
    recs = simulate_trace(
        "plateau", seed=0, duration_s=10, interval_s=0.5, node="nx", device="gpu7", start_ts=T0
    )
    ss = samples_of(recs)
    assert [s.ts for s in ss] == [T0 + 0.5 * i for i in range(21)]
    assert {s.domain for s in ss} == {("nx", "gpu7")}
    assert all(s.kind == "gpu" and s.total_bytes == 80 * GIB for s in ss)


@pytest.mark.parametrize("pattern", OOM_PATTERNS)
@pytest.mark.parametrize("seed", range(5))
def test_oom_patterns_end_with_an_oom_event(pattern: str, seed: int) -> None:
    recs = simulate_trace(pattern, seed=seed, duration_s=900, total_bytes=16 * GIB)
    last = recs[-1]
    assert isinstance(last, Event)
    assert last.event == "oom"
    assert last.domain == ("sim-node", "gpu0")
    assert sum(isinstance(r, Event) for r in recs) == 1  # stop_at_oom: the trace ends there
    ss = samples_of(recs)
    assert ss[-1].ts == last.ts
    assert last.ts - T0 < 900
    assert all(s.used_bytes <= s.total_bytes for s in ss)
    assert all(s.peak_bytes is not None and s.peak_bytes <= s.total_bytes for s in ss)
    assert ss[-1].used_frac > 0.99
    assert max(s.used_frac for s in ss[:-1]) < 1.0


@pytest.mark.parametrize("pattern", ["sawtooth", "spiky", "plateau"])
@pytest.mark.parametrize("seed", range(5))
def test_safe_patterns_do_not_oom_within_900s(pattern: str, seed: int) -> None:
    recs = simulate_trace(pattern, seed=seed, duration_s=900)
    assert not any(isinstance(r, Event) for r in recs)
    ss = samples_of(recs)
    assert len(ss) == 901
    assert all(s.used_bytes <= s.total_bytes for s in ss)
    assert max(s.used_frac for s in ss) > 0.5  # busy, not idle


def test_without_stop_at_oom_the_job_restarts() -> None:
    recs = simulate_trace("leak", seed=0, duration_s=900, stop_at_oom=False)
    ooms = [r for r in recs if isinstance(r, Event)]
    assert len(ooms) >= 2
    ss = samples_of(recs)
    # right after an OOM, the domain holds only the driver context while the job restarts
    after = next(s for s in ss if s.ts == ooms[0].ts + 1)
    assert after.used_frac < 0.01
    assert after.job is None
    jobs = {s.job for s in ss if s.job is not None}
    assert len(jobs) >= 2  # the restarted job gets a new name


def test_simulated_trace_is_a_valid_trace(tmp_path: Path) -> None:
    recs = simulate_trace("step_growth", seed=2, duration_s=900)
    path = tmp_path / "sim.jsonl.gz"
    write_trace(path, recs)
    trace = load_trace(path)  # validates every record and the time order
    assert trace.ooms
    assert trace.records() == recs


def test_sim_source_poll_respects_its_interval() -> None:
    gpus = default_gpus("n1", seed=0)
    src = SimSource(gpus, interval_s=2.0)
    assert src.name == "sim"
    first = src.poll(T0)
    assert len(first) == 4
    assert {r.device for r in first} == {"gpu0", "gpu1", "gpu2", "gpu3"}
    assert all(r.ts == T0 for r in first)
    assert src.poll(T0 + 0.5) == []
    assert src.poll(T0 + 1.999) == []
    second = src.poll(T0 + 2.0)
    assert len(second) == 4
    assert all(r.ts == T0 + 2.0 for r in second)
    assert src.poll(T0 + 3.0) == []
    assert len(src.poll(T0 + 10.0)) == 4  # late: emits once, not a backlog
    assert src.poll(T0 + 11.0) == []
    assert not src.exhausted


def test_sim_source_rejects_bad_interval() -> None:
    with pytest.raises(ValueError, match="interval_s"):
        SimSource([], interval_s=0)


def test_time_scale_makes_the_leak_faster() -> None:
    def oom_after(scale: float) -> float:
        gpu = SimGPU("n1", "gpu0", "leak", seed=4, time_scale=scale)
        for i in range(2000):
            recs = gpu.advance(T0 + i * 0.5)
            if any(isinstance(r, Event) for r in recs):
                return i * 0.5
        raise AssertionError("no OOM")

    assert oom_after(4.0) < oom_after(1.0) / 2


def test_default_gpus_patterns() -> None:
    gpus = default_gpus("n1")
    assert [g.pattern for g in gpus] == ["leak", "sawtooth", "step_growth", "spiky"]
    assert [g.device for g in gpus] == ["gpu0", "gpu1", "gpu2", "gpu3"]


def test_bad_pattern_raises_value_error() -> None:
    with pytest.raises(ValueError, match="bogus"):
        SimGPU("n1", "gpu0", "bogus")
    with pytest.raises(ValueError, match="leak"):
        simulate_trace("bogus")


@pytest.mark.parametrize("interval_s", [0.5, 1.0])
def test_fast_leak_ooms_62_to_80s_into_every_job(interval_s: float) -> None:
    for seed in range(30):
        recs = simulate_trace(
            "fast_leak", seed=seed, duration_s=400, interval_s=interval_s, stop_at_oom=False
        )
        ooms = [r.ts - T0 for r in recs if isinstance(r, Event)]
        assert len(ooms) >= 2, seed
        assert 62 <= ooms[0] <= 80, (seed, ooms)
        restarted = ooms[0] + 20.0  # restart_after_s: the next job starts then
        assert 62 <= ooms[1] - restarted <= 80 + interval_s, (seed, ooms)


@pytest.mark.parametrize("seed", range(10))
def test_fast_leak_is_a_steady_climb_from_its_start_up_level(seed: int) -> None:
    recs = simulate_trace("fast_leak", seed=seed, duration_s=120, interval_s=0.5)
    ss = samples_of(recs)[:-1]  # up to the sample before the OOM
    frac = [s.used_frac for s in ss]
    assert 0.3 < frac[10] < 0.7  # 5 s in: weights loaded, far from full
    means = [sum(frac[i : i + 20]) / 20 for i in range(10, len(frac) - 20, 4)]
    assert all(b > a for a, b in itertools.pairwise(means))  # rises every 2 s, never levels off
    assert max(b - a for a, b in itertools.pairwise(frac[10:])) < 0.1  # and never jumps
    assert frac[-60] < 0.9  # 30 s before the OOM there is still room: time to warn


def test_fast_leak_is_a_leak_job_with_one_draw_more() -> None:
    # the same job parameters as a leak of that seed, plus when it must be full; the other
    # patterns draw exactly what they drew before fast_leak existed
    fast = SimGPU("n1", "gpu0", "fast_leak", seed=5)
    leak = SimGPU("n1", "gpu0", "leak", seed=5)
    assert {k: v for k, v in fast._params.items() if k != "oom_by_s"} == leak._params
    assert 72 <= fast._params["oom_by_s"] <= 78
    assert "fast_leak" in OOM_PATTERNS
