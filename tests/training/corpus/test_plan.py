"""training/corpus/plan.py: every program gets the runs the corpus needs, and each run a
script and limit that put it where its kind says it goes."""

from __future__ import annotations

import json

import pytest

from oomcast.training.corpus.driver import Script
from oomcast.training.corpus.plan import (
    FILL_OVERSHOOT,
    KERNEL_BYTES,
    MAX_LIMIT_BYTES,
    MIB,
    SPLITS,
    Calibration,
    calibration_script,
    plan_program,
    programs,
    scale_viable,
)
from oomcast.training.corpus.run import FRAMEWORK, PROGRAMS

CAL = Calibration(compute_s=0.05, compute_x2_s=0.09, level_bytes=300 * MIB,
                  peak_bytes=320 * MIB, per_scale_bytes=80 * MIB)  # fmt: skip
FLAT = Calibration(compute_s=0.05, compute_x2_s=0.06, level_bytes=300 * MIB,
                   peak_bytes=320 * MIB, per_scale_bytes=5 * MIB)  # fmt: skip


def test_splits_are_by_program_with_frameworks_on_every_side() -> None:
    progs = programs()
    assert sorted(progs) == sorted(PROGRAMS) and len(progs) >= 12
    assert len(set(progs)) == len(progs)
    assert len(FRAMEWORK) >= 5
    for split in ("val", "test"):
        assert set(SPLITS[split]) & set(FRAMEWORK), split
    assert not set(SPLITS["train"]) & (set(SPLITS["val"]) | set(SPLITS["test"]))


def test_every_program_gets_every_kind_of_run() -> None:
    for program in programs():
        plans = plan_program(program, CAL, {})
        kinds = [p.kind for p in plans]
        assert len(plans) >= 10
        for kind in ("ordinary", "warmup", "near", "oom", "startup_oom", "censored", "sudden"):
            assert kind in kinds, (program, kind)
        assert kinds.count("oom") >= 3
        names = [p.name for p in plans]
        assert len(set(names)) == len(names)
        test = program in SPLITS["test"]
        assert (kinds.count("oom") == 5) == test  # held-out programs: every growth cause


def test_scripts_put_each_kind_where_it_must_go() -> None:
    peak = CAL.peak_bytes
    for program in programs():
        for p in plan_program(program, CAL, {"mlp_tabular": CAL}):
            assert 0 < p.limit_bytes <= MAX_LIMIT_BYTES
            script = Script.from_json(p.script.to_json())  # it survives the command line
            assert script == p.script
            if p.kind == "ordinary":
                assert 300 <= script.duration_s <= 480 and not script.phases
                assert 0.4 <= peak / p.limit_bytes <= 0.75
            elif p.kind == "oom":
                (phase,) = script.phases
                assert 120 <= phase.start_s <= 300  # 2-5 minutes of steady running first
                assert p.expect_oom and peak < p.limit_bytes
            elif p.kind == "near":
                (phase,) = script.phases
                fill = phase.level_bytes * FILL_OVERSHOOT + KERNEL_BYTES
                assert 0.85 <= (peak + fill) / p.limit_bytes <= 0.95 + 1e-9
                hold = (
                    script.duration_s
                    - phase.start_s
                    - (phase.tau_s if phase.kind == "plateau" else 3 * phase.tau_s)
                )
                assert hold >= 179.9  # it holds near the limit for three minutes (to 0.1 s)
            elif p.kind == "censored":
                (phase,) = script.phases
                # it ends before its growth reaches the limit
                assert not p.expect_oom and script.duration_s < phase.start_s + 240
            elif p.kind == "startup_oom":
                assert (
                    script.phases[0].start_s <= 5
                    and p.limit_bytes < peak + script.phases[0].level_bytes
                )
            elif p.kind == "sudden":
                assert peak < p.limit_bytes and 120 <= script.phases[0].start_s <= 240


def test_plans_are_the_same_every_time_and_swap_causes_a_program_cannot_run() -> None:
    a = [p.manifest() for p in plan_program("gan", CAL, {})]
    b = [p.manifest() for p in plan_program("gan", CAL, {})]
    assert json.dumps(a) == json.dumps(b)
    assert scale_viable(CAL) and not scale_viable(FLAT)
    for program in programs():
        causes = {p.cause for p in plan_program(program, FLAT, {})}
        assert "scale" not in causes and "step_scale" not in causes, program


@pytest.mark.parametrize("program", ["mlp_tabular", "hf_bert_trainer"])
def test_the_calibration_doubles_the_batch_partway(program: str) -> None:
    script = calibration_script(program)
    (probe,) = script.phases
    assert probe.kind == "step_scale" and probe.factor == 2.0
    assert 0 < probe.start_s < script.duration_s
