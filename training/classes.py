"""The scoring classes every forecaster is judged by (``oomcast evaluate``, training's rule
choice, the model card).

A run is scored by what happened to it, and what the detector did:

- ``oom_long``: it OOMed 60 s or more after its first sample. Goal: at least 90% warned 30 s
  ahead and 95% 10 s ahead.
- ``oom_short``: it OOMed sooner (no room for evidence plus 30 s of lead): judged at 10 s,
  reported, not gated.
- ``oom_sudden``: it OOMed from one of its own steps with no growth before it (the first
  evaluation, checkpoint or optimizer step: ``STEP_CAUSES``, as the trace's manifest names
  its cause). The recall goals are for growth OOMs; these are met by phase-aware forecasts
  and ``oomcast preflight``, and are reported apart, at 30 s and 10 s, together.
- ``oom_neighbour``: another process arrived on the device and took the memory
  (``NEIGHBOUR_CAUSES``). Nothing in the job's own stream foretells it; ``POST /v1/admit``
  is the way to see it coming. Reported apart from the job's own steps, at 30 s and 10 s.
- ``censored``: it never OOMed, and the detector's first alert came in its last 60 s (it
  exited normally, or the recording stopped, while the alert stood): its future is unknown,
  so the alert is neither a hit nor a false alarm. When such runs are more than 10% of the
  runs that never OOMed, the set is too short to judge false alarms, and the summary says so.
- ``near_miss``: it never OOMed but came within 10% of its limit. At most half may be warned.
- ``ordinary``: every other run that never OOMed: any alert is a false alarm. Goal: at most
  2% of runs, and false alarms per hour of ordinary run time are reported.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

# a neighbour whose arrival a scheduler announced first (POST /v1/admit, an ``arrival``
# event): the manifest's ``neighbour`` entries with ``announced`` true
ANNOUNCED_NEIGHBOUR = "neighbour_announced"
# causes whose OOM comes from one step: the simulator's families and the corpora's causes
SUDDEN_CAUSES = ("eval_no_grad", "optimizer_state", "checkpoint_spike", "neighbour",
                 ANNOUNCED_NEIGHBOUR, "step_scale", "step_up", "eval_spike",
                 "checkpoint")  # fmt: skip
# of those, another process arriving on the device (announced through POST /v1/admit or
# not); the others are the job's own steps
NEIGHBOUR_CAUSES = ("neighbour", ANNOUNCED_NEIGHBOUR)
STEP_CAUSES = tuple(c for c in SUDDEN_CAUSES if c not in NEIGHBOUR_CAUSES)
OOM_CLASSES = ("oom_long", "oom_short", "oom_sudden", "oom_neighbour")
LONG_AFTER_S = 60.0
CENSOR_S = 60.0
NEAR_LEVEL = 0.9
CLASSES = (*OOM_CLASSES, "near_miss", "ordinary", "censored")
GOALS = {
    "oom_long_recall_30": 0.90,
    "oom_long_recall_10": 0.95,
    "near_miss_warned_max": 0.50,
    "ordinary_false_alarms_max": 0.02,
    "censored_share_max": 0.10,
}


def run_class(
    oom_after_s: float | None,
    max_level: float,
    span_s: float,
    first_alert_s: float | None,
    cause: str | None = None,
) -> str:
    """The class of one run as a detector saw it. Times are seconds after the run's first
    sample: the OOM (None: none), the end of a run that did not OOM (``span_s``), the first
    alert (None: none; on an OOM run, only alerts before the OOM count); ``cause`` as the
    run's manifest names it (None: unknown, scored as growth)."""
    if oom_after_s is not None:
        if cause in NEIGHBOUR_CAUSES:
            return "oom_neighbour"
        if cause in SUDDEN_CAUSES:
            return "oom_sudden"
        return "oom_long" if oom_after_s >= LONG_AFTER_S else "oom_short"
    if first_alert_s is not None and first_alert_s >= span_s - CENSOR_S:
        return "censored"
    return "near_miss" if max_level >= NEAR_LEVEL else "ordinary"


@dataclass
class ClassScore:
    """One detector's runs, by class."""

    leads: dict[str, list[float | None]] = field(
        default_factory=lambda: {c: [] for c in OOM_CLASSES}
    )  # lead per OOM run; None: not warned before the OOM
    near: list[bool] = field(default_factory=list)  # warned, per near miss
    ordinary: list[bool] = field(default_factory=list)  # false alarm, per ordinary run
    ordinary_s: float = 0.0
    censored: int = 0

    def add(self, cls: str, lead_s: float | None, alerted: bool, span_s: float) -> None:
        if cls in self.leads:
            self.leads[cls].append(lead_s)
        elif cls == "near_miss":
            self.near.append(alerted)
        elif cls == "ordinary":
            self.ordinary.append(alerted)
            self.ordinary_s += span_s
        elif cls == "censored":
            self.censored += 1
        else:
            raise ValueError(f"unknown class {cls!r}")

    def merge(self, other: ClassScore) -> None:
        for k in self.leads:
            self.leads[k] += other.leads[k]
        self.near += other.near
        self.ordinary += other.ordinary
        self.ordinary_s += other.ordinary_s
        self.censored += other.censored

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        judged_at = {"oom_long": (30, 10), "oom_short": (10,), "oom_sudden": (30, 10),
                     "oom_neighbour": (30, 10)}  # fmt: skip
        for cls, at in judged_at.items():
            leads = self.leads[cls]
            known = [x for x in leads if x is not None]
            entry: dict[str, Any] = {"n": len(leads)}
            for s in at:
                hit = sum(1 for x in known if x >= s)
                entry[f"warned_{s}s"] = hit
                entry[f"recall_{s}s"] = round(hit / len(leads), 4) if leads else None
            entry["median_lead_s"] = round(statistics.median(known), 1) if known else None
            out[cls] = entry
        n_near = len(self.near)
        out["near_miss"] = {
            "n": n_near,
            "warned": sum(self.near),
            "warned_share": round(sum(self.near) / n_near, 4) if n_near else None,
        }
        n_ord = len(self.ordinary)
        hours = self.ordinary_s / 3600.0
        out["ordinary"] = {
            "n": n_ord,
            "false_alarms": sum(self.ordinary),
            "false_alarm_rate": round(sum(self.ordinary) / n_ord, 4) if n_ord else None,
            "hours": round(hours, 2),
            "false_alarms_per_hour": round(sum(self.ordinary) / hours, 3) if hours else None,
        }
        no_oom = n_near + n_ord + self.censored
        share = self.censored / no_oom if no_oom else 0.0
        out["censored"] = {
            "n": self.censored,
            "share_of_no_oom": round(share, 4),
            "too_short_to_judge_false_alarms": share > GOALS["censored_share_max"],
        }
        out["goals"] = self.goals(out)
        return out

    @staticmethod
    def goals(s: dict[str, Any]) -> dict[str, bool | None]:
        """Which goals the summary meets (None: no run of that class to judge)."""

        def at_least(v: float | None, goal: float) -> bool | None:
            return None if v is None else v >= goal

        def at_most(v: float | None, goal: float) -> bool | None:
            return None if v is None else v <= goal

        long, near, ordinary = s["oom_long"], s["near_miss"], s["ordinary"]
        return {
            "oom_long_recall_30": at_least(long["recall_30s"], GOALS["oom_long_recall_30"]),
            "oom_long_recall_10": at_least(long["recall_10s"], GOALS["oom_long_recall_10"]),
            "near_miss_warned": at_most(near["warned_share"], GOALS["near_miss_warned_max"]),
            "ordinary_false_alarms": at_most(ordinary["false_alarm_rate"],
                                             GOALS["ordinary_false_alarms_max"]),
        }  # fmt: skip


def format_classes(name: str, s: dict[str, Any]) -> list[str]:
    """Lines of a human-readable per-class summary of one detector."""
    lo, sh, nm, od, ce = (s[k] for k in ("oom_long", "oom_short", "near_miss", "ordinary",
                                           "censored"))  # fmt: skip

    def pct(v: float | None) -> str:
        return "-" if v is None else f"{v:.0%}"

    lines = [
        f"{name}: long OOMs {lo['warned_30s']}/{lo['n']} warned 30 s ahead"
        f" ({pct(lo['recall_30s'])}),"
        f" {lo['warned_10s']}/{lo['n']} 10 s ({pct(lo['recall_10s'])}), median lead"
        f" {lo['median_lead_s'] if lo['median_lead_s'] is not None else '-'} s;"
        f" short OOMs {sh['warned_10s']}/{sh['n']} at 10 s; sudden OOMs (own steps)"
        f" {s['oom_sudden']['warned_30s']}/{s['oom_sudden']['n']} at 30 s; neighbours arriving"
        f" {s['oom_neighbour']['warned_30s']}/{s['oom_neighbour']['n']} at 30 s",
        f"  near misses warned {nm['warned']}/{nm['n']} ({pct(nm['warned_share'])});"
        f" ordinary runs with a false alarm {od['false_alarms']}/{od['n']}"
        f" ({pct(od['false_alarm_rate'])}), {od['false_alarms_per_hour'] or 0:g} per hour over"
        f" {od['hours']:g} h; censored alerts {ce['n']}",
    ]
    if ce["too_short_to_judge_false_alarms"]:
        lines.append(
            f"  censored alerts are {ce['share_of_no_oom']:.0%} of the runs that never OOMed:"
            " the set is too short to judge false alarms"
        )
    return lines
