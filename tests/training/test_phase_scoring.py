"""Scoring the sudden OOM causes with phase-aware forecasts (issue 16, part 5): the scenario
generator emits the hook's step, phase and schedule; ``evaluate`` merges the phase
forecaster's forecasts into each detector's, as the service does (docs/phases.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from oomcast.model.events import ArrivalEvent, ScheduleEvent
from oomcast.model.forecast import Detector
from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import load_trace, write_trace
from oomcast.training.evaluate import SUDDEN, evaluate, score_trace
from oomcast.training.scenarios import SCHEDULED, draw_params, simulate_scenario

T0 = 1_700_000_000.0
GIB = 1 << 30
TOTAL = 80 * GIB


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("captures")


@pytest.fixture(scope="module")
def model() -> Detector:
    fc = OnnxForecaster(DEFAULT_MODEL)
    return Detector("model", fc, fc.rule)


def samples_of(records: list[Record]) -> list[Sample]:
    return [r for r in records if isinstance(r, Sample)]


def schedules_in(records: list[Record]) -> list[ScheduleEvent]:
    return [r for r in records if isinstance(r, ScheduleEvent)]


# --- the generator ------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["spikes", "checkpoint_spike"])
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_samples_carry_steps_and_phases_that_match_the_schedule(family: str, cache: Path) -> None:
    phase = "checkpoint"
    for seed in range(10):  # a job that ran the phase twice before it ended (or OOMed)
        params = draw_params(family, seed)
        records, summary = simulate_scenario(params, cache, announce_share=1.0)
        samples = samples_of(records)
        if len({s.step for s in samples if s.phase == phase}) >= 2:
            break
    steps = [s.step for s in samples]
    assert None not in steps and steps == sorted(steps)  # completed steps never go back
    assert samples[0].step == 0 and samples[0].phase == "other"  # the weights load first
    first, *later = schedules_in(records)
    assert first.ts == samples[0].ts and first.job == samples[0].job  # at job start
    assert first.step_s == params.step_s and not first.measured
    every = first.eval_every_steps if phase == "eval" else first.checkpoint_every_steps
    assert every is not None and every >= 1
    assert summary["announced"] and set(first.phase_extra_bytes) == set(SCHEDULED[family])
    tagged = [s for s in samples if s.phase == phase]
    assert tagged, "the phase never ran"
    for s in tagged:  # the phase of a sample is its step's: it runs at the period's multiples
        assert s.step is not None and s.step % every == 0, (s.step, every)
    ran_at = sorted({s.step for s in tagged})
    assert ran_at == [every * k for k in range(1, len(ran_at) + 1)]  # every period, in turn
    # once it has run, the hook publishes the figure it measured on it
    after = [e for e in later if phase in e.measured]
    assert after and after[0].ts == tagged[0].ts
    assert all(e.eval_every_steps == first.eval_every_steps for e in later)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_an_eval_no_grad_job_dies_at_its_first_scheduled_eval(cache: Path) -> None:
    params = draw_params("eval_no_grad", 0)
    records, summary = simulate_scenario(params, cache, announce_share=1.0)
    schedule, *later = schedules_in(records)
    assert all("eval" not in e.measured for e in later)  # no eval ran to its end
    every = schedule.eval_every_steps
    assert every == round(params.extra["eval_every_s"] / params.step_s)
    assert summary["ooms"] and schedule.phase_extra_bytes["eval"] > 0
    last = samples_of(records)[-1]
    # the last sample before the OOM is within its interval of the step the eval comes at
    assert last.step is not None
    assert every - params.interval_s / (0.95 * params.step_s) - 1 <= last.step <= every


def test_announce_share_decides_what_is_known_before_a_phase_runs(cache: Path) -> None:
    params = draw_params("optimizer_state", 1)
    known, s1 = simulate_scenario(params, cache, announce_share=1.0)
    unknown, s0 = simulate_scenario(params, cache, announce_share=0.0)
    assert s1["announced"] and not s0["announced"]
    assert schedules_in(known)[0].phase_extra_bytes["optimizer"] > 0
    assert dict(schedules_in(unknown)[0].phase_extra_bytes) == {}
    # the schedule is all that differs: the samples are the same
    assert samples_of(known) == samples_of(unknown)
    with pytest.raises(ValueError, match="announce_share"):
        simulate_scenario(params, cache, announce_share=1.5)


def test_a_neighbour_is_not_the_jobs_to_announce(cache: Path) -> None:
    records, summary = simulate_scenario(draw_params("neighbour", 0), cache, announce_share=1.0)
    assert not schedules_in(records) and not summary["schedule"]
    assert all(s.step is not None and s.phase is not None for s in samples_of(records))


# --- evaluate with phases ------------------------------------------------------------------------


def eval_trace(
    extra_frac: float, *, oom: bool, step_s: float = 1.0, every: int = 100, measured: bool = False
) -> list[Record]:
    """A flat job at 60% of an 80 GiB GPU, one step per ``step_s``, an eval every ``every``
    steps announced to need ``extra_frac`` of the GPU more; with ``oom`` the first eval
    dies. Nothing in the memory stream shows it coming."""
    records: list[Record] = [
        ScheduleEvent(
            ts=T0,
            node="n",
            device="gpu0",
            event="schedule",
            job="j",
            eval_every_steps=every,
            step_s=step_s,
            phase_extra_bytes={"eval": int(extra_frac * TOTAL)},
            measured=("eval",) if measured else (),
        )
    ]
    steps = every if oom else 3 * every
    for i in range(steps + 1):
        used = int(0.6 * TOTAL) + (i % 3) * (8 << 20)
        records.append(
            Sample(
                ts=T0 + i * step_s,
                node="n",
                device="gpu0",
                kind="gpu",
                total_bytes=TOTAL,
                used_bytes=used,
                allocated_bytes=used - (2 * GIB),
                reserved_bytes=used - GIB,
                peak_bytes=used,
                job="j",
                step=i,
                phase="forward",
            )
        )
    if oom:
        records.append(Event(ts=T0 + steps * step_s + 0.5, node="n", device="gpu0", event="oom"))
    return records


def test_phases_catch_a_first_eval_the_lstm_alone_misses(model: Detector, tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    write_trace(path, eval_trace(0.5, oom=True))  # 40 GiB more than the 30 GiB left
    trace = load_trace(path)
    alone = score_trace(model, trace)
    merged = score_trace(model, trace, phases=True)
    assert alone.lead_s is None or alone.lead_s < 30  # the stream is flat: nothing to see
    # the model's rule fires once the phase is within its horizon (120 s): the whole trace
    assert merged.lead_s is not None and merged.lead_s >= 30
    # its time-to-OOM is the time until the eval
    pred, true = merged.tto_at[30]
    assert pred is not None and abs(pred - true) <= 1.5
    result = evaluate([model], [path], min_lead_s=30)
    assert result["detectors"]["model"]["recall"] == 1.0 and result["phase_traces"] == 1
    off = evaluate([model], [path], min_lead_s=30, phases=False)
    assert off["detectors"]["model"]["recall"] == 0.0 and "phase_traces" not in off
    nvml = evaluate([model], [path], min_lead_s=30, view="nvml")  # no hook: no phases
    assert nvml["detectors"]["model"]["recall"] == 0.0 and "phase_traces" not in nvml


@pytest.mark.parametrize("measured", [False, True])
def test_no_alert_from_phases_when_the_scheduled_phases_fit(
    model: Detector, tmp_path: Path, measured: bool
) -> None:
    path = tmp_path / "fits.jsonl"
    write_trace(path, eval_trace(0.3, oom=False, measured=measured))  # 24 of 30 GiB left
    trace = load_trace(path)
    for phases in (False, True):
        result = score_trace(model, trace, phases=phases)
        assert not result.false_alarm and result.first_alert_ts is None
    # the same schedule with an eval that does not fit does alert, on the safe trace too
    write_trace(path, eval_trace(0.5, oom=False, measured=measured))
    assert score_trace(model, load_trace(path), phases=True).false_alarm


def strip_hook_fields(src: Path, dst: Path) -> None:
    """The trace as the generator wrote it before it knew of steps, phases, schedules and
    announced arrivals."""
    records: list[Record] = []
    for r in load_trace(src).records():
        if isinstance(r, ScheduleEvent | ArrivalEvent):
            continue
        records.append(replace(r, step=None, phase=None) if isinstance(r, Sample) else r)
    write_trace(dst, records)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_no_phases_gives_the_scores_of_traces_without_the_hooks_fields(
    model: Detector, cache: Path, tmp_path: Path
) -> None:
    new, old = tmp_path / "new", tmp_path / "old"
    manifest: dict[str, list[dict[str, str]]] = {"traces": []}
    for i, family in enumerate(("eval_no_grad", "optimizer_state", "spikes", "neighbour")):
        records, _ = simulate_scenario(draw_params(family, i), cache, announce_share=1.0)
        name = f"{i:05d}-{family}.jsonl.gz"
        write_trace(new / name, records)
        strip_hook_fields(new / name, old / name)
        manifest["traces"].append({"file": name, "family": family})
    for folder in (new, old):
        (folder / "manifest.json").write_text(json.dumps(manifest))
    paths = {f: sorted(f.glob("*.jsonl.gz")) for f in (new, old)}
    without = evaluate([model], paths[new], 30, by_cause=True, phases=False)
    before = evaluate([model], paths[old], 30, by_cause=True)
    assert without == before  # same detectors, per cause and sudden figures
    assert set(before[SUDDEN]["model"]) == set(before["detectors"]["model"])
    sudden = before[SUDDEN]["model"]
    # spikes is not a sudden cause, and a neighbour arriving is its own, not the job's step
    assert sudden["oom_traces"] + sudden["ok_traces"] == 2
    assert "neighbour" in before["by_cause"]
    with_phases = evaluate([model], paths[new], 30, by_cause=True)
    # the neighbour's job has no schedule, but its arrival was announced (announce_share 1)
    assert with_phases["phase_traces"] == 4


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_cli_no_phases_and_announce_share_flags(tmp_path: Path) -> None:
    path = tmp_path / "eval.jsonl"
    write_trace(path, eval_trace(0.5, oom=True))
    cmd = [sys.executable, "-m", "oomcast.cli.main", "evaluate", "--traces", str(path)]
    cmd += ["--min-lead", "30", "--json", "--no-progress"]
    on = json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True).stdout)
    off = json.loads(
        subprocess.run([*cmd, "--no-phases"], capture_output=True, text=True, check=True).stdout
    )
    assert on["detectors"]["model"]["recall"] == 1.0 and on["phase_traces"] == 1
    assert off["detectors"]["model"]["recall"] == 0.0
    bad = [sys.executable, "-m", "oomcast.cli.main", "simulate", "--out", str(tmp_path / "s")]
    done = subprocess.run([*bad, "--announce-share", "2"], capture_output=True, text=True)
    assert done.returncode == 2 and "--announce-share 2: must be between 0 and 1" in done.stderr
