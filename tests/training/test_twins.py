"""Leak twins of near misses (training/twins.py): a near miss that climbs straight until it
stops has a twin that keeps the pace and OOMs; the two share every sample up to the twin's
deadline, so every detector alerts on both or on neither."""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from support import GIB, T0, sample

from oomcast.model.baselines import baseline_detectors
from oomcast.model.embedding import FEATURES, level_frac
from oomcast.model.events import ScheduleEvent
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import Trace, load_trace, write_trace
from oomcast.training.dataset import Sequence
from oomcast.training.evaluate import Causes, evaluate
from oomcast.training.evidence import main as evidence_main
from oomcast.training.twins import (
    LEAD_S,
    NearMiss,
    find_fork,
    main,
    near_misses,
    twin_records,
    write_twins,
)

GROWTH_START_S = 120.0


def climb_then_stop(
    pace_pct_per_s: float,
    stop_level: float,
    *,
    seconds: float = 600.0,
    interval_s: float = 1.0,
    exit_at_end: bool = True,
) -> list[Record]:
    """Steady at 40% for two minutes, a straight climb at ``pace``, flat from
    ``stop_level`` on, and a normal exit at the end."""
    out: list[Record] = []
    for i in range(int(seconds / interval_s)):
        t = i * interval_s
        level = 0.40 + pace_pct_per_s / 100.0 * max(0.0, t - GROWTH_START_S)
        wobble = 0.002 * math.sin(t * 1.7)
        out.append(sample(T0 + t, min(level, stop_level) + wobble, job="nm"))
    if exit_at_end:
        out.append(Event(ts=T0 + seconds, node="n1", device="gpu0", event="exit", job="nm"))
    return out


def slowing(seconds: float = 900.0) -> list[Record]:
    """A start-up that decelerates into 93%: near the limit its pace is far too slow for a
    leak with 30 s to go."""
    out: list[Record] = []
    for i in range(int(seconds)):
        level = 0.40 + 0.53 * (1.0 - math.exp(-max(0.0, i - 60.0) / 90.0))
        out.append(sample(T0 + i, level + 0.002 * math.sin(i * 1.7), job="nm"))
    out.append(Event(ts=T0 + seconds, node="n1", device="gpu0", event="exit", job="nm"))
    return out


def _near_miss(tmp_path: Path, name: str, records: list[Record]) -> tuple[NearMiss, Trace]:
    path = tmp_path / name
    write_trace(path, records)
    found = near_misses([path])
    assert len(found) == 1
    return found[0]


def test_a_straight_climb_that_stops_has_a_twin_that_ooms_on_time(tmp_path: Path) -> None:
    nm, trace = _near_miss(tmp_path, "nm.jsonl", climb_then_stop(0.5, 0.93))
    fork = nm.fork
    assert fork is not None
    assert fork.pace_pct_per_s == pytest.approx(0.5, rel=0.1)
    # the fork is where 30 s of the pace are left: 85% at 0.5 %/s
    assert fork.level == pytest.approx(0.85, abs=0.01)
    assert fork.deadline_s <= fork.fork_s
    assert fork.growth_at_deadline_s >= 30.0
    # the climb began at 120 s; its deadline is where 60 s of the pace are left (70%)
    assert fork.climb_at_deadline_s == pytest.approx(fork.deadline_s - GROWTH_START_S, abs=3.0)
    twin = twin_records(trace, nm.domain, fork)
    ooms = [r for r in twin if isinstance(r, Event) and r.event == "oom"]
    assert len(ooms) == 1 and not any(isinstance(r, Event) and r.event == "exit" for r in twin)
    assert ooms[0].ts - T0 == pytest.approx(fork.oom_after_s, abs=1.0)
    # the past up to the fork is the near miss's, sample for sample
    shared = [r for r in trace.records() if r.ts <= T0 + fork.fork_s]
    assert twin[: len(shared)] == shared
    assert shared[-1].ts == pytest.approx(T0 + fork.fork_s)  # the fork is a sample's time
    after = [r for r in twin if isinstance(r, Sample) and r.ts > T0 + fork.fork_s]
    assert after and all(b.used_frac >= a.used_frac for a, b in itertools.pairwise(after))


def _features(level: np.ndarray, pace: float, growth_s: float) -> Sequence:
    """Feature rows at one tick a second, as the embedding would give them: the level, the
    10 s and 30 s paces where it climbs, and the growth tracker's age set to ``growth_s``
    there."""
    x = np.zeros((len(level), len(FEATURES)), dtype=np.float32)
    x[:, FEATURES.index("level_frac")] = level
    climbing = np.r_[False, np.diff(level) > 0]
    for name in ("slope_30s_pct_per_s", "slope_10s_pct_per_s"):
        x[climbing, FEATURES.index(name)] = pace
    x[climbing, FEATURES.index("log1p_growth_age_s")] = math.log1p(growth_s)
    n = len(level)
    zeros = np.zeros((n, 1), dtype=np.float32)
    span = float(n - 1)
    return Sequence("hand", x, zeros, zeros, np.full(n, np.inf), False,
                    known=span - np.arange(n, dtype=np.float64),
                    max_level=float(level.max()), span_s=span)  # fmt: skip


@pytest.mark.parametrize(
    ("start_s", "pace", "growth_s", "forks"),
    [
        (100, 0.5, 120.0, True),  # a long climb, and the tracker agrees
        (100, 0.5, 10.0, False),  # a long climb the tracker calls young
        (190, 1.0, 120.0, False),  # a young climb the tracker calls old
    ],
)
def test_the_gate_s_growth_is_asked_of_both_measures(
    start_s: int, pace: float, growth_s: float, forks: bool
) -> None:
    t = np.arange(400.0)
    start_level = 0.4 if start_s == 100 else 0.6
    level = np.minimum(start_level + pace / 100 * np.maximum(t - start_s, 0.0), 0.93)
    fork = find_fork(_features(level, pace, growth_s))
    assert (fork is not None) == forks
    if fork is not None:
        # 30 s of the pace left at 85%: the deadline is the fork, 90 s into the climb
        assert fork.level == pytest.approx(0.85, abs=0.01)
        assert fork.climb_at_deadline_s == pytest.approx(fork.fork_s - start_s, abs=11.0)


def test_a_climb_that_slows_into_its_plateau_has_no_twin(tmp_path: Path) -> None:
    nm, _ = _near_miss(tmp_path, "slow.jsonl", slowing())
    assert nm.peak >= 0.9
    assert nm.fork is None


def test_a_cgroup_twin_ooms_when_its_anonymous_memory_reaches_the_limit(tmp_path: Path) -> None:
    # a container: page cache on top of the anonymous memory, and a peak just above use
    total = 4 * GIB
    records: list[Record] = []
    for i in range(600):
        anon = min(0.40 + 0.005 * max(0.0, i - GROWTH_START_S), 0.93)
        anon += 0.002 * math.sin(i * 1.7)
        used = min(anon + 0.05, 0.99)
        records.append(Sample(
            ts=T0 + i, node="n1", device="cgroup:/job", kind="host", total_bytes=total,
            used_bytes=int(used * total), allocated_bytes=int(anon * total),
            peak_bytes=int(min(used + 0.02, 1.0) * total), job="c",
        ))  # fmt: skip
    records.append(Event(ts=T0 + 600, node="n1", device="cgroup:/job", event="exit", job="c"))
    nm, trace = _near_miss(tmp_path, "cgroup.jsonl", records)
    assert nm.fork is not None
    twin = twin_records(trace, nm.domain, nm.fork)
    oom = next(r for r in twin if isinstance(r, Event) and r.event == "oom")
    # at the line's time, not when use (page cache included) fills the container first
    # on the line: the first sample at or after it (use and peak stop at the capacity,
    # the anonymous memory takes the rest)
    assert 0.0 <= oom.ts - T0 - nm.fork.oom_after_s < 1.0
    samples = [r for r in twin if isinstance(r, Sample)]
    assert level_frac(samples[-1]) >= 1.0
    # every sample of the twin's own comes after its deadline
    own = [r for r in samples if r.ts > T0 + nm.fork.fork_s]
    assert own and own[0].ts > oom.ts - LEAD_S
    assert all(s.used_bytes <= total and (s.peak_bytes or 0) <= total for s in samples)


def test_the_domain_keeps_its_other_events_and_the_trace_its_other_domains(
    tmp_path: Path,
) -> None:
    records = climb_then_stop(0.5, 0.93)
    schedule = ScheduleEvent(T0 + 5, "n1", "gpu0", "schedule", "nm", eval_every_steps=100,
                             phase_extra_bytes={"eval": GIB})  # fmt: skip
    other = [sample(T0 + i, 0.3, device="gpu1", job="other") for i in range(600)]
    later = ScheduleEvent(T0 + 500, "n1", "gpu0", "schedule", "nm", eval_every_steps=50,
                          phase_extra_bytes={"eval": GIB})  # fmt: skip
    nm, trace = _near_miss(tmp_path, "two.jsonl", [*records, schedule, later, *other])
    assert nm.fork is not None and nm.domain == ("n1", "gpu0")
    twin = twin_records(trace, nm.domain, nm.fork)
    assert schedule in twin and later not in twin  # what came after the fork is the near miss's
    assert [r for r in twin if isinstance(r, Sample) and r.device == "gpu1"] == other


def test_a_trace_with_an_oom_on_another_domain_has_no_near_miss(tmp_path: Path) -> None:
    oom = Event(T0 + 300, "n1", "gpu1", "oom", "other")
    other = [sample(T0 + i, 0.3, device="gpu1", job="other") for i in range(300)]
    path = tmp_path / "mixed.jsonl"
    write_trace(path, [*climb_then_stop(0.5, 0.93), *other, oom])
    assert near_misses([path]) == []


def test_no_twin_where_the_gate_would_not_let_any_forecaster_warn(tmp_path: Path) -> None:
    # a jump from 40% to 91% in 17 s: fast enough, but the gate's 30 s of growth come
    # after the twin's deadline
    nm, _ = _near_miss(tmp_path, "jump.jsonl", climb_then_stop(3.0, 0.91))
    assert nm.fork is None


def test_no_twin_where_the_tracker_runs_ahead_of_a_young_climb(tmp_path: Path) -> None:
    # 1.5 %/s from 40%: the line reaches the limit 40 s into the climb, so its deadline
    # comes 10 s in; the tracker's widest growing window already spans 30 s or more there
    nm, _ = _near_miss(tmp_path, "young.jsonl", climb_then_stop(1.5, 0.93))
    assert nm.fork is None


def test_a_run_that_exits_mid_climb_has_no_twin(tmp_path: Path) -> None:
    # it exits at 94%, still climbing: any alert that would warn its twin 30 s ahead comes
    # in its last 60 s, where the scoring counts it as censored, not as a warned near miss
    records = climb_then_stop(0.5, 0.999, seconds=120 + 108)
    exit_ev = records.pop()
    # the job's teardown, recorded with its exit: memory freed, the peak kept
    teardown = sample(exit_ev.ts, 0.31, job="nm", peak_bytes=int(0.948 * 80 * GIB))
    nm, _ = _near_miss(tmp_path, "cut.jsonl", [*records, teardown, exit_ev])
    assert nm.fork is None
    # the same climb, recorded two minutes longer before it stopped at 94%: a twin
    nm, _ = _near_miss(tmp_path, "long.jsonl", climb_then_stop(0.5, 0.94, seconds=400))
    assert nm.fork is not None


def test_every_detector_alerts_on_a_twin_before_its_deadline_as_on_its_near_miss(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    src = tmp_path / "src"
    src.mkdir()
    write_trace(src / "a.jsonl", climb_then_stop(0.5, 0.93))
    write_trace(src / "b.jsonl", climb_then_stop(0.35, 0.95, seconds=700))
    write_trace(src / "c.jsonl", slowing())
    out = tmp_path / "twins"
    assert main([str(src), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "without an OOM 3: 2 share their past with a warnable leak" in printed
    manifest = json.loads((out / "manifest.json").read_text())
    assert [e["source"] for e in manifest["runs"]] == ["a.jsonl", "b.jsonl"]
    twins = sorted(out.glob("*.jsonl.gz"))
    assert all(Causes().of(p) == "leak_twin" for p in twins)
    assert all(load_trace(p).ooms for p in twins)

    dets = list(baseline_detectors())
    rows: dict[tuple[str, str], dict[str, Any]] = {}
    for folder, suffix in ((src, ".jsonl"), (out, "-twin.jsonl.gz")):
        lines = tmp_path / f"{folder.name}.jsonl"
        evaluate(dets, sorted(folder.glob("*.jsonl*")), per_trace=lines)
        for line in lines.read_text().splitlines():
            r = json.loads(line)
            rows[(str(r["trace"]).removesuffix(suffix), str(r["detector"]) + suffix)] = r
    forks = {e["source"].removesuffix(".jsonl"): e for e in manifest["runs"]}
    compared = 0
    for name, entry in forks.items():
        deadline = T0 + float(entry["oom_after_s"]) - LEAD_S
        for det in dets:
            near = rows[(name, det.name + ".jsonl")]["first_alert_ts"]
            twin = rows[(name, det.name + "-twin.jsonl.gz")]["first_alert_ts"]
            # an alert by the deadline is the same alert on both; after it they may part
            if twin is not None and twin <= deadline:
                assert near == twin, (name, det.name)
                compared += 1
            if near is not None and near <= deadline:
                assert twin == near, (name, det.name)
    # the rules that read the trend warn the twins in time, so the identity was exercised
    assert compared >= 2

    # a second run over sources that fork less leaves no twin of the first behind
    (src / "a.jsonl").unlink()
    assert main([str(src), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.glob("*.jsonl.gz")) == ["b-twin.jsonl.gz"]


@pytest.mark.parametrize("tool", [main, evidence_main])
def test_bad_input_is_one_line_that_names_it(
    tool: Callable[[list[str]], int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "bad").mkdir()
    write_trace(tmp_path / "bad" / "nm.jsonl", climb_then_stop(0.5, 0.93))
    with (tmp_path / "bad" / "nm.jsonl").open("a") as fh:
        fh.write('{"ts": 1750000700.0, "node":\n')
    cases = {
        (str(tmp_path / "nope"),): "nope: not a folder of traces",
        (str(tmp_path / "empty"),): "empty: no traces in it",
        (str(tmp_path / "bad"), "--split", "test"): "has no manifest.json naming splits",
        (str(tmp_path / "bad"),): "nm.jsonl:602: not valid JSON",
    }
    for argv, said in cases.items():
        assert tool(list(argv)) == 2, argv
        err = capsys.readouterr().err
        assert said in err and err.count("\n") == 1, err


def test_two_near_misses_of_one_trace_get_a_twin_each(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    gpu1 = [
        replace(r, device="gpu1") if isinstance(r, Sample | Event) else r
        for r in climb_then_stop(0.4, 0.92)
    ]
    write_trace(src / "node.jsonl", [*climb_then_stop(0.5, 0.93), *gpu1])
    entries = write_twins(near_misses([src / "node.jsonl"]), tmp_path / "out")
    files = [str(e["file"]) for e in entries]
    assert sorted(files) == ["node-gpu0-twin.jsonl.gz", "node-gpu1-twin.jsonl.gz"]
    assert all((tmp_path / "out" / f).is_file() for f in files)
