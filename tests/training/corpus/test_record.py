"""training/corpus/record.py under a real memory cgroup: a run is recorded with its limit,
pinned to its core, checked for drift, written to the manifest; a recording resumes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from oomcast.collectors.cgroupfs import CgroupUnavailable, default_root
from oomcast.model.trace import load_trace
from oomcast.training.corpus import record as rec
from oomcast.training.corpus.driver import Phase
from oomcast.training.corpus.plan import MIB, Calibration, RunPlan, sized

pytestmark = pytest.mark.slow


def _cgroups() -> bool:
    try:
        root = default_root()
    except CgroupUnavailable:
        return False
    return os.access(root, os.W_OK)


needs_cgroup = pytest.mark.skipif(not _cgroups(), reason="no writable memory cgroup here")
CAL = Calibration(compute_s=0.02, compute_x2_s=0.04, level_bytes=270 * MIB,
                  peak_bytes=290 * MIB, per_scale_bytes=14 * MIB)  # fmt: skip


def _plan(name: str, *, limit: int, duration_s: float, period_s: float = 0.2,
          phases: list[Phase] | None = None, expect_oom: bool = False) -> RunPlan:  # fmt: skip
    script = sized("mlp_tabular", duration_s=duration_s, period_s=period_s, seed=1,
                   eval_every_s=3.0, ckpt_every_s=4.0, phases=phases or [])  # fmt: skip
    script.batch = 32
    onset = phases[0].start_s if phases else None
    return RunPlan(name, "mlp_tabular", "oom" if expect_oom else "ordinary", "leak", "train",
                   limit, script, expect_oom, onset)  # fmt: skip


@needs_cgroup
def test_a_run_is_recorded_under_its_limit_and_killed_by_the_kernel(tmp_path: Path) -> None:
    recorder = rec.Recorder(tmp_path, workers=1, log=lambda m: None)
    recorder.calibrations["mlp_tabular"] = CAL
    plan = _plan("mlp_tabular-oom-leak", limit=600 * MIB, duration_s=60.0, expect_oom=True,
                 phases=[Phase("leak", 6.0, rate_bps=40 * MIB)])  # fmt: skip
    entry = recorder.record_run(plan, core=0)
    assert entry["oom"] and entry["accepted"] and entry["attempts"] == 1
    assert abs(entry["period_drift"]) <= rec.MAX_DRIFT
    trace = load_trace(tmp_path / entry["file"])
    assert trace.ooms and len(trace.samples) == 1
    (samples,) = trace.samples.values()
    assert samples[0].total_bytes == 600 * MIB
    assert all(s.job == plan.name for s in samples)
    span = samples[-1].ts - samples[0].ts
    assert span > 6.0 and 8 <= len(samples) / span <= 11  # sampled at 10 Hz
    assert entry["level_peak_frac"] > 0.9


@needs_cgroup
def test_a_recording_resumes_without_recording_a_run_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plans = [_plan(f"mlp_tabular-ordinary-{k}", limit=1024 * MIB, duration_s=6.0) for k in (1, 2)]
    monkeypatch.setattr(rec.Recorder, "plan", lambda self, progs: plans)
    cals = {"mlp_tabular": CAL.to_dict()}
    (tmp_path / rec.CALIBRATION).write_text(json.dumps(cals))
    said: list[str] = []
    recorder = rec.Recorder(tmp_path, workers=2, log=said.append)
    recorder.run(["mlp_tabular"])
    manifest = json.loads((tmp_path / rec.MANIFEST).read_text())
    assert [r["name"] for r in manifest["runs"]] == [p.name for p in plans]
    assert {r["core"] for r in manifest["runs"]} <= {0, 1}
    assert all(not r["oom"] and r["exit_code"] == 0 for r in manifest["runs"])
    # an exit event: the run ended normally (censored, for training)
    assert all(load_trace(tmp_path / r["file"]).exit_ts(next(iter(
        load_trace(tmp_path / r["file"]).samples))) for r in manifest["runs"])  # fmt: skip
    again: list[str] = []
    rec.Recorder(tmp_path, workers=2, log=again.append).run(["mlp_tabular"])
    assert any("0 runs to record (2 done)" in line for line in again), again
    assert rec.summarize(tmp_path).startswith("2 runs")
    assert rec.check_folder(tmp_path) == []


@needs_cgroup
def test_a_run_whose_steps_cannot_keep_their_period_is_recorded_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(rec, "ATTEMPTS", 2)
    recorder = rec.Recorder(tmp_path, workers=1, log=lambda m: None)
    recorder.calibrations["mlp_tabular"] = CAL
    # mlp_tabular at batch 256 needs ~70 ms a step: a 10 ms period cannot hold
    plan = _plan("mlp_tabular-ordinary", limit=1024 * MIB, duration_s=14.0, period_s=0.01)
    plan.script.batch = 256
    entry = recorder.record_run(plan, core=0)
    assert entry["attempts"] == 2 and not entry["accepted"]
    assert entry["period_drift"] > rec.MAX_DRIFT
    assert (tmp_path / entry["file"]).exists()  # kept, and marked


@needs_cgroup
def test_a_start_up_climb_is_judged_by_the_pace_of_its_first_minute(tmp_path: Path) -> None:
    """A warmup's growth starts a few seconds in: its period is still measured (it once came
    out unknown, and every such run was rejected three times)."""
    recorder = rec.Recorder(tmp_path, workers=1, log=lambda m: None)
    recorder.calibrations["mlp_tabular"] = CAL
    plan = _plan("mlp_tabular-warmup", limit=1024 * MIB, duration_s=18.0,
                 phases=[Phase("warmup", 3.0, level_bytes=60 * MIB, tau_s=5.0)])  # fmt: skip
    entry = recorder.record_run(plan, core=0)
    assert entry["period_drift"] is not None and abs(entry["period_drift"]) <= rec.MAX_DRIFT
    assert entry["accepted"] and entry["attempts"] == 1 and not entry["oom"]


@needs_cgroup
def test_a_program_that_fails_by_itself_is_not_recorded_and_repeated_failures_stop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = [_plan(f"mlp_tabular-ordinary-{k}", limit=512 * MIB, duration_s=5.0) for k in range(6)]
    for p in bad:  # a script the program refuses: it exits 2 before its first step
        p.script.phases = [Phase("leak", 0.0, rate_bps=-1.0)]
        p.script.period_s = -1.0
    monkeypatch.setattr(rec.Recorder, "plan", lambda self, progs: bad)
    (tmp_path / rec.CALIBRATION).write_text(json.dumps({"mlp_tabular": CAL.to_dict()}))
    said: list[str] = []
    recorder = rec.Recorder(tmp_path, workers=1, log=said.append)
    recorder.run(["mlp_tabular"])
    assert not (tmp_path / rec.MANIFEST).exists()  # nothing recorded
    assert not list(tmp_path.glob("*.jsonl.gz"))
    assert sum("failed, not recorded" in line for line in said) == rec.MAX_FAILURES
    assert any("in a row failed: stopping" in line for line in said)


def _entry(
    name: str, split: str, kind: str, limit: int, peak: float, oom: bool
) -> dict[str, object]:
    return {"name": name, "program": name.split("-")[0], "kind": kind, "split": split,
            "file": f"{name}.jsonl.gz", "limit_bytes": limit, "level_peak_frac": peak,
            "oom": oom, "duration_s": 400.0}  # fmt: skip


@pytest.mark.parametrize("first_peak", [0.73, 0.89])
def test_a_near_miss_that_fell_short_gets_a_limit_from_its_own_peak_until_it_lands(
    tmp_path: Path, first_peak: float
) -> None:
    """Near misses planned at 85-95% of their limit stopped at 73-89% (ordinary runs by the
    scoring). ``relimit_near`` gives exactly those (not killed, not other kinds) a limit that
    puts their measured peak at 91-95%, keeps the first figures, and tries again if the run
    recorded under it still falls short."""
    runs = [
        _entry("gan-near", "val", "near", 600 * MIB, first_peak, False),
        _entry("gan-near-2", "val", "near", 600 * MIB, 0.93, False),
        _entry("lstm_lm-near", "test", "near", 600 * MIB, 0.997, True),
        _entry("gan-ordinary", "val", "ordinary", 600 * MIB, 0.5, False),
        _entry("mlp_tabular-near", "train", "near", 800 * MIB, 0.80, False),
    ]
    for r in runs:
        (tmp_path / str(r["file"])).write_bytes(b"")
    (tmp_path / rec.MANIFEST).write_text(json.dumps({"runs": runs}))
    recorder = rec.Recorder(tmp_path, log=lambda m: None)
    assert len(recorder.done()) == 5
    assert recorder.relimit_near() == ["gan-near", "mlp_tabular-near"]  # validation first
    new = recorder.relimits["gan-near"]
    peak = first_peak * 600 * MIB
    assert peak / 0.95 <= new["limit_bytes"] <= peak / 0.91
    assert new["first"] == {"limit_bytes": 600 * MIB, "level_peak_frac": first_peak,
                            "duration_s": 400.0}  # fmt: skip
    assert json.loads((tmp_path / rec.RELIMITS).read_text()) == recorder.relimits
    assert recorder.done() == {"gan-near-2", "lstm_lm-near", "gan-ordinary"}
    # recorded under the new limit and short again: another limit, the first figures kept
    runs[0].update(limit_bytes=new["limit_bytes"], level_peak_frac=0.89)
    runs[4].update(limit_bytes=recorder.relimits["mlp_tabular-near"]["limit_bytes"],
                   level_peak_frac=0.93)  # fmt: skip
    (tmp_path / rec.MANIFEST).write_text(json.dumps({"runs": runs}))
    again = rec.Recorder(tmp_path, log=lambda m: None)
    assert again.relimit_near() == ["gan-near"]
    second = again.relimits["gan-near"]
    assert second["tries"] == 2 and second["first"] == new["first"]
    assert (
        0.89 * new["limit_bytes"] / 0.95
        <= second["limit_bytes"]
        <= 0.89 * new["limit_bytes"] / 0.91
    )
    assert "mlp_tabular-near" in again.done() and "gan-near" not in again.done()
