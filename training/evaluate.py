"""Score detectors on a folder of labelled traces (``oomcast evaluate``).

Per DESIGN.md: a trace with an ``oom`` event is an OOM trace. A detector alerts on the first
sample at which its rule fires. For an OOM trace, only alerts on the domain that OOMed and
before its OOM count; the lead is the OOM's ts minus the alert's ts, in trace time. Recall
is the share of OOM traces alerted at least ``min_lead_s`` ahead. ``median_lead_s`` is the
median lead over OOM traces that were alerted before the OOM at all (null if none were). A
false alarm is an OOM-free trace with any alert, on any domain.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomcast.model.forecast import Detector, release_state
from oomcast.model.schema import Sample
from oomcast.model.trace import Trace, as_nvml_sees_it, find_traces, load_trace


@dataclass
class Score:
    leads_s: list[float] = field(default_factory=list)  # per alerted OOM trace
    missed: int = 0  # OOM traces never alerted before the OOM
    false_alarms: int = 0
    oom_traces: int = 0
    ok_traces: int = 0

    def summary(self, min_lead_s: float) -> dict[str, Any]:
        caught = sum(1 for lead in self.leads_s if lead >= min_lead_s)
        return {
            "recall": round(caught / self.oom_traces, 4) if self.oom_traces else None,
            "median_lead_s": round(statistics.median(self.leads_s), 2) if self.leads_s else None,
            "false_alarms": self.false_alarms,
            "oom_traces": self.oom_traces,
            "ok_traces": self.ok_traces,
        }


def first_alert_ts(
    detector: Detector, samples: list[Sample], until_ts: float | None
) -> float | None:
    """ts of the first sample (before ``until_ts``, when given) at which the detector fires."""
    fc = detector.forecaster
    state = fc.init_state()
    run = 0  # consecutive samples at or above the rule's risk
    try:
        for sample in samples:
            if until_ts is not None and sample.ts >= until_ts:
                return None
            run = run + 1 if detector.rule.fires(fc.step([state], [sample])[0]) else 0
            if run >= detector.rule.fire_after:
                return sample.ts
        return None
    finally:
        release_state(fc, state)


def score_trace(detector: Detector, trace: Trace, score: Score) -> None:
    oom_domains = [(d, ts) for d in trace.samples if (ts := trace.oom_ts(d)) is not None]
    if trace.ooms:
        score.oom_traces += 1
        best: float | None = None
        for domain, oom_ts in oom_domains:
            alert = first_alert_ts(detector, trace.samples[domain], oom_ts)
            if alert is not None:
                lead = oom_ts - alert
                best = lead if best is None else max(best, lead)
        if best is None:
            score.missed += 1
        else:
            score.leads_s.append(best)
        return
    score.ok_traces += 1
    if any(first_alert_ts(detector, ss, None) is not None for ss in trace.samples.values()):
        score.false_alarms += 1


def evaluate(
    detectors: Iterable[Detector],
    traces: Iterable[Path],
    min_lead_s: float = 10.0,
    view: str = "full",
) -> dict[str, Any]:
    """Score every detector on every trace. ``view="nvml"`` first reduces GPU samples to what
    NVML alone reports (no allocator figures): a node running the agent without the hook."""
    if view not in ("full", "nvml"):
        raise ValueError(f"view={view!r}: choose full or nvml")
    dets = list(detectors)
    scores = {d.name: Score() for d in dets}
    for path in traces:
        trace = load_trace(path)  # a corrupt line raises TraceError naming file and line
        if view == "nvml":
            trace = as_nvml_sees_it(trace)
        for det in dets:
            score_trace(det, trace, scores[det.name])
    out: dict[str, Any] = {
        "detectors": {name: s.summary(min_lead_s) for name, s in scores.items()},
        "min_lead_s": min_lead_s,
    }
    if view != "full":
        out["view"] = view
    return out


def evaluate_folder(
    folder: Path | str, detectors: Iterable[Detector], min_lead_s: float = 10.0
) -> dict[str, Any]:
    traces = find_traces(folder)
    if not traces:
        raise FileNotFoundError(f"no traces (*.jsonl, *.jsonl.gz) in {folder}")
    return evaluate(detectors, traces, min_lead_s)


def format_table(result: dict[str, Any]) -> str:
    rows = [("detector", "recall", "median lead s", "false alarms", "OOM traces", "ok traces")]
    for name, s in result["detectors"].items():
        rows.append(
            (
                name,
                "-" if s["recall"] is None else f"{s['recall']:.1%}",
                "-" if s["median_lead_s"] is None else f"{s['median_lead_s']:.1f}",
                f"{s['false_alarms']}/{s['ok_traces']}",
                str(s["oom_traces"]),
                str(s["ok_traces"]),
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append(f"recall = share of OOM traces alerted at least {result['min_lead_s']:g}s ahead")
    return "\n".join(lines)
