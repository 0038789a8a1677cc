"""training/classes.py: the classes runs are scored in, and their goals."""

from __future__ import annotations

import pytest

from oomcast.training.classes import ClassScore, format_classes, run_class


@pytest.mark.parametrize(
    "oom_after, level, span, alert, expected",
    [
        (60.0, 1.0, 60.0, 10.0, "oom_long"),
        (59.9, 1.0, 59.9, None, "oom_short"),
        (None, 0.95, 600.0, None, "near_miss"),
        (None, 0.95, 600.0, 100.0, "near_miss"),  # warned
        (None, 0.5, 600.0, 100.0, "ordinary"),  # a false alarm
        (None, 0.5, 600.0, 540.0, "censored"),  # the last minute: its future is unknown
        (None, 0.95, 600.0, 545.0, "censored"),
        (None, 0.89, 600.0, None, "ordinary"),
    ],
)
def test_run_class(
    oom_after: float | None, level: float, span: float, alert: float | None, expected: str
) -> None:
    assert run_class(oom_after, level, span, alert) == expected


@pytest.mark.parametrize(
    "cause, expected",
    [
        ("neighbour", "oom_neighbour"),  # another process: apart from the job's own steps
        ("eval_no_grad", "oom_sudden"),
        ("optimizer_state", "oom_sudden"),
        ("checkpoint", "oom_sudden"),
        ("leak", "oom_long"),
        (None, "oom_long"),
    ],
)
def test_an_oom_s_cause_sets_its_class_whenever_it_came(cause: str | None, expected: str) -> None:
    assert run_class(300.0, 1.0, 300.0, None, cause) == expected


def test_neighbours_are_counted_apart_from_the_job_s_own_steps() -> None:
    score = ClassScore()
    score.add("oom_sudden", 40.0, True, 300.0)
    score.add("oom_sudden", None, False, 300.0)
    score.add("oom_neighbour", None, False, 300.0)
    s = score.summary()
    assert s["oom_sudden"]["n"] == 2 and s["oom_sudden"]["warned_30s"] == 1
    assert s["oom_neighbour"] == {"n": 1, "warned_30s": 0, "recall_30s": 0.0, "warned_10s": 0,
                                  "recall_10s": 0.0, "median_lead_s": None}  # fmt: skip
    text = "\n".join(format_classes("model", s))
    assert "sudden OOMs (own steps) 1/2 at 30 s; neighbours arriving 0/1 at 30 s" in text


def test_summary_counts_each_class_against_its_goal() -> None:
    score = ClassScore()
    for lead in (45.0, 31.0, 12.0, None):
        score.add("oom_long", lead, lead is not None, 300.0)
    score.add("oom_short", 11.0, True, 40.0)
    score.add("near_miss", None, True, 600.0)
    score.add("near_miss", None, False, 600.0)
    for alerted in (False,) * 49 + (True,):
        score.add("ordinary", None, alerted, 720.0)
    score.add("censored", None, True, 600.0)
    s = score.summary()
    assert s["oom_long"] == {"n": 4, "warned_30s": 2, "recall_30s": 0.5, "warned_10s": 3,
                             "recall_10s": 0.75, "median_lead_s": 31.0}  # fmt: skip
    assert s["oom_short"]["recall_10s"] == 1.0
    assert s["near_miss"] == {"n": 2, "warned": 1, "warned_share": 0.5}
    assert s["ordinary"]["false_alarm_rate"] == 0.02 and s["ordinary"]["hours"] == 10.0
    assert s["ordinary"]["false_alarms_per_hour"] == 0.1
    assert s["censored"]["n"] == 1 and not s["censored"]["too_short_to_judge_false_alarms"]
    assert s["goals"] == {"oom_long_recall_30": False, "oom_long_recall_10": False,
                          "near_miss_warned": True, "ordinary_false_alarms": True}  # fmt: skip
    text = "\n".join(format_classes("model", s))
    assert "long OOMs 2/4 warned 30 s ahead (50%)" in text and "1/50" in text


def test_a_set_of_short_runs_is_flagged_as_too_short_to_judge() -> None:
    score = ClassScore()
    for _ in range(8):
        score.add("ordinary", None, False, 100.0)
    for _ in range(2):
        score.add("censored", None, True, 100.0)
    s = score.summary()
    assert s["censored"]["share_of_no_oom"] == 0.2
    assert s["censored"]["too_short_to_judge_false_alarms"]
    assert "too short to judge false alarms" in "\n".join(format_classes("x", s))
    assert s["goals"]["oom_long_recall_30"] is None  # nothing to judge


def test_merge_pools_two_scores() -> None:
    a, b = ClassScore(), ClassScore()
    a.add("oom_long", 40.0, True, 100.0)
    b.add("oom_long", None, False, 100.0)
    b.add("ordinary", None, True, 3600.0)
    a.merge(b)
    s = a.summary()
    assert s["oom_long"]["n"] == 2 and s["ordinary"]["false_alarms_per_hour"] == 1.0
    with pytest.raises(ValueError, match="unknown class"):
        a.add("meteor", None, False, 1.0)
