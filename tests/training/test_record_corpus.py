"""training/record_corpus.py: the plan, the limits it sets from a roomy run, one real config
recorded under a real memory cgroup, and the committed corpus itself."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from pathlib import Path

import pytest

from oomcast.model.schema import Sample
from oomcast.model.trace import load_trace
from oomcast.training import record_corpus as rc
from oomcast.training.programs import CAUSES, GROWTH_CAUSES, PROGRAMS

MIB = 1 << 20
CORPUS = Path(rc.__file__).parent / "traces" / "corpus"


def test_the_plan_covers_programs_causes_and_durations_split_by_program() -> None:
    plan = rc.make_plan(0)
    runs = sum(1 + len(c.follow_ups) for c in plan)
    assert runs >= 240
    assert {c.program for c in plan} == set(PROGRAMS) and len(PROGRAMS) >= 10
    causes_with_oom_runs = {c.cause for c in plan if "oom" in c.follow_ups}
    assert len(causes_with_oom_runs) >= 6 and causes_with_oom_runs <= set(CAUSES)
    durations = [c.knobs["duration_s"] for c in plan]
    assert min(durations) >= 19 and 850 <= max(durations) <= 905
    by_split = {s: {c.program for c in plan if c.split == s} for s in rc.SPLITS}
    assert not (by_split["train"] & by_split["val"]) and not (by_split["train"] & by_split["test"])
    assert not (by_split["val"] & by_split["test"])
    assert rc.make_plan(0)[0] == plan[0]  # a pure function of its seed


def _roomy(levels_mib: list[float], dt: float = 1.0) -> list[Sample]:
    return [
        Sample(
            1000.0 + i * dt,
            "n",
            "cgroup:/x",
            "host",
            rc.ROOMY_LIMIT,
            int(v * MIB) + 50 * MIB,
            allocated_bytes=int(v * MIB),
        )
        for i, v in enumerate(levels_mib)
    ]


def test_follow_up_limits_sit_above_the_peak_or_between_floor_and_peak() -> None:
    import random

    [cfg] = [c for c in rc.make_plan(0) if c.cause == "leak"][:1]
    roomy = _roomy([300 + 5 * i for i in range(100)])  # 300 -> 795 MiB over 100 s
    peak = 795 * MIB + 24 * MIB
    for seed in range(20):
        near = rc.follow_up_limit(cfg, roomy, "near", random.Random(seed))
        assert near is not None and peak * 1.03 <= near <= peak * 1.18
        oom = rc.follow_up_limit(cfg, roomy, "oom", random.Random(seed))
        # above the start-up level (first 15% of the run, +15%), below the peak
        assert oom is not None and 375 * 1.15 * MIB < oom < peak


def test_a_sudden_cause_gets_a_limit_between_the_level_before_onset_and_the_spike() -> None:
    import random

    cfg = next(c for c in rc.make_plan(0) if c.cause == "neighbour")
    onset_s = cfg.knobs["onset"] * cfg.knobs["duration_s"] / cfg.knobs["steps"]
    n = int(cfg.knobs["duration_s"])
    roomy = _roomy([400 if i < onset_s else 900 for i in range(n)])
    oom = rc.follow_up_limit(cfg, roomy, "oom", random.Random(0))
    assert oom is not None and 400 * 1.08 * MIB < oom < 924 * MIB
    flat = _roomy([400.0] * n)  # the cause made no difference: no OOM run can be set up
    assert rc.follow_up_limit(cfg, flat, "oom", random.Random(0)) is None


@pytest.mark.slow
def test_one_config_is_recorded_roomy_first_under_a_real_cgroup(
    tmp_path: Path, cgroup_root: Path
) -> None:
    cfg = rc.Config(
        index=0, program="mlp_tabular", cause="leak",
        knobs={"steps": 40, "duration_s": 4.0, "batch": 256, "width": 256, "every": 1,
               "onset": 2, "amount": 1},
        follow_ups=["near"], seed=5,
    )  # fmt: skip
    entries = rc.record_config(cfg, tmp_path, tmp_path)
    assert [e["role"] for e in entries] == ["roomy", "near"]
    assert entries[0]["limit_bytes"] == rc.ROOMY_LIMIT and not entries[0]["oom"]
    roomy = load_trace(tmp_path / entries[0]["file"])
    [(_, samples)] = roomy.samples.items()
    anon_peak = max(s.allocated_bytes or 0 for s in samples)
    assert entries[1]["limit_bytes"] >= anon_peak  # a near miss sits above the peak
    assert len(samples) >= 30  # 10 Hz over a few seconds
    gaps = [b.ts - a.ts for a, b in itertools.pairwise(samples)]
    assert 0.08 <= sorted(gaps)[len(gaps) // 2] <= 0.15


@pytest.mark.skipif(not (CORPUS / rc.MANIFEST).is_file(), reason="no recorded corpus")
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_the_committed_corpus_is_what_the_issue_asked_for() -> None:
    runs = json.loads((CORPUS / rc.MANIFEST).read_text())["runs"]
    assert len(runs) >= 240
    assert len({r["program"] for r in runs}) >= 10
    oom_causes = {r["cause"] for r in runs if r["oom"]}
    assert len(oom_causes) >= 6, oom_causes
    ooms = sum(r["oom"] for r in runs)
    near = sum(1 for r in runs if not r["oom"] and r["anon_peak_frac"] >= 0.7)
    assert 0.25 <= ooms / len(runs) <= 0.6 and near >= 0.3 * len(runs)
    programs_by_split = {s: {r["program"] for r in runs if r["split"] == s} for s in rc.SPLITS}
    assert sum(len(p) for p in programs_by_split.values()) == len({r["program"] for r in runs})
    growth_tests = Counter(
        r["cause"]
        for r in runs
        if r["split"] == "test" and r["oom"] and r["cause"] in GROWTH_CAUSES
    )
    assert sum(growth_tests.values()) >= 10
    assert all((CORPUS / r["file"]).is_file() for r in runs)
    assert rc.check_folder(CORPUS) == []
