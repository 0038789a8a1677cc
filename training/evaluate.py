"""Score detectors on a folder of labelled traces (``oomcast evaluate``).

Per DESIGN.md: a trace with an ``oom`` event is an OOM trace. A detector alerts on the first
sample at which its rule fires. For an OOM trace, only alerts on the domain that OOMed and
before its OOM count; the lead is the OOM's ts minus the alert's ts, in trace time. Recall
is the share of OOM traces alerted at least ``min_lead_s`` ahead. ``median_lead_s`` is the
median lead over OOM traces that were alerted before the OOM at all (null if none were). A
false alarm is an OOM-free trace with any alert, on any domain.

Every trace is also given a class (``training/classes.py``): a long or short OOM (60 s or
more after its first sample, or less), a near miss (never OOMed, came within 10% of its
limit), an ordinary run, or a censored one (never OOMed, and the detector's first alert
came in its last 60 s: its future is unknown). ``classes`` in each detector's summary
scores them as the product's goals are set; ``--per-trace`` lines carry the ``class``.

Beside those, each detector's time-to-OOM forecast is checked on the OOM domain at the last
sample at or before 60, 30 and 10 s ahead of the OOM (``tto_rel_err_<N>s``: the relative
error ``|predicted - true| / true`` over OOM traces where a forecast was made that early and
was not null; ``missing`` counts those where it was null). The same single pass over a
domain's samples gives both the first alert and these forecasts.

In the hook's view (``view="full"``) a domain whose job announced a schedule (``schedule``
events, docs/phases.md) has each detector's forecasts merged with the phase forecaster's
(``model/phase.py``: the same :class:`~oomcast.model.phase.PhaseState` and
:func:`~oomcast.model.phase.merge` the service applies before its rules), so the scores are
those of what the service would alert on; ``phases=False`` scores the detectors alone. The
NVML view has no hook, hence no step, phase or schedule: phases are off there.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TextIO

from oomcast.model.embedding import level_frac
from oomcast.model.events import ArrivalEvent, ScheduleEvent
from oomcast.model.forecast import Detector, Forecast, release_state
from oomcast.model.phase import PhaseState, merge
from oomcast.model.schema import Domain, Sample
from oomcast.model.trace import (
    Trace,
    as_nvml_sees_it,
    downsample_trace,
    find_traces,
    load_trace,
)
from oomcast.training.classes import (
    ANNOUNCED_NEIGHBOUR,
    STEP_CAUSES,
    ClassScore,
    format_classes,
    run_class,
)
from oomcast.training.progress import bar

# Seconds before the OOM at which the time-to-OOM forecast is checked, latest last.
TTO_AT_S: tuple[int, ...] = (60, 30, 10)
UNKNOWN_CAUSE = "unknown"
MANIFEST = "manifest.json"
# manifest keys that name what drove a trace: recorded runs (cause), simulated traces
# (family), the first host corpus (scenario)
CAUSE_KEYS = ("cause", "family", "scenario")
MANIFEST_LEVELS = 3  # look for a manifest in the trace's folder and the two above it
# The causes whose OOM the memory stream does not announce (docs/phases.md); scored together
# as ``sudden`` beside the per-cause scores.
SUDDEN = "sudden"


def quantile(values: Sequence[float], q: float) -> float:
    """Linear interpolation between the order statistics (numpy's default)."""
    xs = sorted(values)
    pos = q * (len(xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


@dataclass
class TraceResult:
    """What one detector did on one trace: a line of ``--per-trace``."""

    trace: str  # file name
    detector: str
    oom: bool
    oom_ts: float | None  # the scored OOM domain's OOM
    first_alert_ts: float | None  # OOM trace: on that domain before its OOM; else any domain
    false_alarm: bool
    # seconds ahead -> (predicted time to OOM or None, true time to OOM), on the OOM domain
    tto_at: dict[int, tuple[float | None, float]] = field(default_factory=dict)
    cause: str | None = None
    first_ts: float = 0.0  # the run's first sample (on an OOM run: the OOM domain's)
    end_ts: float = 0.0  # the OOM, the exit, or the last sample
    max_level: float = 0.0  # the highest level of any domain, as a fraction of capacity
    # an announced arrival on the OOM domain (an ``arrival`` event): when it was to land
    lands_at: float | None = None

    @property
    def run_class(self) -> str:
        first = None if self.first_alert_ts is None else self.first_alert_ts - self.first_ts
        oom_after = None if self.oom_ts is None else self.oom_ts - self.first_ts
        return run_class(oom_after, self.max_level, self.end_ts - self.first_ts, first, self.cause)

    @property
    def lead_s(self) -> float | None:
        if self.oom_ts is None or self.first_alert_ts is None:
            return None
        return self.oom_ts - self.first_alert_ts

    def to_dict(self) -> dict[str, Any]:
        lead = self.lead_s
        return {
            "trace": self.trace,
            "detector": self.detector,
            "oom": self.oom,
            "oom_ts": self.oom_ts,
            "first_alert_ts": self.first_alert_ts,
            "lead_s": None if lead is None else round(lead, 3),
            "false_alarm": self.false_alarm,
            "tto_at": {
                str(h): {
                    "predicted": None if pred is None else round(pred, 3),
                    "true": round(true, 3),
                }
                for h, (pred, true) in self.tto_at.items()
            },
            "cause": self.cause,
            "class": self.run_class,
            "span_s": round(self.end_ts - self.first_ts, 3),
            "max_level": round(self.max_level, 4),
            **({} if self.lands_at is None else self._arrival()),
        }

    def _arrival(self) -> dict[str, Any]:
        """Where an arrival was announced: when it was to land, whether the OOM came after
        it landed (the arrival's doing), and how long before it landed the first alert came
        (negative: after)."""
        assert self.lands_at is not None
        alert = self.first_alert_ts
        return {
            "lands_at": self.lands_at,
            "oom_after_landing": self.oom_ts is not None and self.oom_ts >= self.lands_at,
            "alert_before_landing_s": None if alert is None else round(self.lands_at - alert, 3),
        }


@dataclass
class Score:
    leads_s: list[float] = field(default_factory=list)  # per alerted OOM trace
    missed: int = 0  # OOM traces never alerted before the OOM
    false_alarms: int = 0
    oom_traces: int = 0
    ok_traces: int = 0
    # seconds ahead -> relative errors of the non-null forecasts / count of null ones
    tto_rel_err: dict[int, list[float]] = field(default_factory=dict)
    tto_missing: dict[int, int] = field(default_factory=dict)
    classes: ClassScore = field(default_factory=ClassScore)

    def add(self, result: TraceResult) -> None:
        self.classes.add(result.run_class, result.lead_s, result.first_alert_ts is not None,
                         result.end_ts - result.first_ts)  # fmt: skip
        if not result.oom:
            self.ok_traces += 1
            self.false_alarms += result.false_alarm
            return
        self.oom_traces += 1
        lead = result.lead_s
        if lead is None:
            self.missed += 1
        else:
            self.leads_s.append(lead)
        for h, (pred, true) in result.tto_at.items():
            if pred is None:
                self.tto_missing[h] = self.tto_missing.get(h, 0) + 1
            else:
                self.tto_rel_err.setdefault(h, []).append(abs(pred - true) / true)

    def tto_summary(self, ahead_s: int) -> dict[str, Any]:
        errs = self.tto_rel_err.get(ahead_s, [])
        return {
            "median": round(statistics.median(errs), 4) if errs else None,
            "p90": round(quantile(errs, 0.9), 4) if errs else None,
            "n": len(errs),
            "missing": self.tto_missing.get(ahead_s, 0),
        }

    def summary(self, min_lead_s: float) -> dict[str, Any]:
        caught = sum(1 for lead in self.leads_s if lead >= min_lead_s)
        out: dict[str, Any] = {
            "recall": round(caught / self.oom_traces, 4) if self.oom_traces else None,
            "median_lead_s": round(statistics.median(self.leads_s), 2) if self.leads_s else None,
            "false_alarms": self.false_alarms,
            "oom_traces": self.oom_traces,
            "ok_traces": self.ok_traces,
        }
        for h in TTO_AT_S:
            out[f"tto_rel_err_{h}s"] = self.tto_summary(h)
        out["classes"] = self.classes.summary()
        return out


class PhaseTrack:
    """The service's phase side of one domain (service/pipeline/phases.py), replayed over a trace:
    the domain's ``schedule`` and ``arrival`` events are taken in as the samples' time
    reaches them (a schedule of another job replaces the state; a sample of another job
    drops it; announced arrivals, the GPU's, stay), and each forecast is merged with
    :meth:`PhaseState.forecast`'s as the live state merges it."""

    def __init__(self, events: Sequence[ScheduleEvent | ArrivalEvent]) -> None:
        self.pending = sorted(events, key=lambda e: e.ts)
        self.state: PhaseState | None = None
        self.job: str | None = None

    def step(self, sample: Sample, fc: Forecast) -> Forecast:
        while self.pending and self.pending[0].ts <= sample.ts:
            event = self.pending.pop(0)
            st = self.state
            if isinstance(event, ArrivalEvent):
                if st is None:
                    st = self.state = PhaseState()
                st.on_arrival(event)
                continue
            if st is None or (st.schedule is not None and st.schedule.job != event.job):
                st = self.state = (st.carried() if st is not None else None) or PhaseState()
            st.on_schedule(event)
        if sample.job is not None and self.job is not None and sample.job != self.job:
            st = self.state  # another job: the schedule goes, unless it is the new job's
            if st is not None and (st.schedule is None or st.schedule.job != sample.job):
                self.state = st.carried()
        if sample.job is not None:
            self.job = sample.job
        if self.state is None:
            return fc
        self.state.observe(sample)
        merged, _cause = merge(fc, self.state.forecast(sample))
        return merged


def schedules_of(trace: Trace, domain: Domain) -> list[ScheduleEvent | ArrivalEvent]:
    """The domain's ``schedule`` and ``arrival`` events, in time order."""
    out = [
        e
        for e in trace.events
        if isinstance(e, ScheduleEvent | ArrivalEvent) and e.domain == domain
    ]
    return sorted(out, key=lambda e: e.ts)


def scan_domain(
    detector: Detector,
    samples: list[Sample],
    until_ts: float | None,
    tto_at_s: Sequence[int] = (),
    schedules: Sequence[ScheduleEvent | ArrivalEvent] = (),
) -> tuple[float | None, dict[int, tuple[float, float | None]]]:
    """One pass of the detector over a domain's samples (those before ``until_ts``, when
    given). Returns the ts of the first sample at which it fires, and, for each ``h`` of
    ``tto_at_s`` (needs ``until_ts``), the ts of the last sample at or before
    ``until_ts - h`` with the time to OOM forecast there. Stops stepping as soon as both are
    known. With ``schedules`` (the domain's ``schedule`` events) each forecast is first
    merged with the phase forecast (:class:`PhaseTrack`)."""
    fc = detector.forecaster
    rule = detector.rule
    cuts = [(h, until_ts - h) for h in tto_at_s] if until_ts is not None else []
    last_cut = max((c for _, c in cuts), default=None)
    at: dict[int, tuple[float, float | None]] = {}
    alert: float | None = None
    state = fc.init_state()
    run = 0  # consecutive samples at or above the rule's risk
    track = PhaseTrack(schedules) if schedules else None
    try:
        for sample in samples:
            ts = sample.ts
            if until_ts is not None and ts >= until_ts:
                break
            if alert is not None and (last_cut is None or ts > last_cut):
                break
            forecast = fc.step([state], [sample])[0]
            if track is not None:
                forecast = track.step(sample, forecast)
            if alert is None:
                run = run + 1 if rule.fires(forecast) else 0
                if run >= rule.fire_after:
                    alert = ts
            for h, cut in cuts:
                if ts <= cut:
                    at[h] = (ts, forecast.time_to_oom_s)
        return alert, at
    finally:
        release_state(fc, state)


def first_alert_ts(
    detector: Detector,
    samples: list[Sample],
    until_ts: float | None,
    schedules: Sequence[ScheduleEvent | ArrivalEvent] = (),
) -> float | None:
    """ts of the first sample (before ``until_ts``, when given) at which the detector fires."""
    return scan_domain(detector, samples, until_ts, schedules=schedules)[0]


def score_trace(
    detector: Detector, trace: Trace, cause: str | None = None, *, phases: bool = False
) -> TraceResult:
    """Run the detector over the trace once and say what it did; ``phases``: with its
    forecasts merged with the phase forecaster's where the trace has schedules."""
    name = Path(trace.path).name

    def scheds(domain: Domain) -> list[ScheduleEvent | ArrivalEvent]:
        return schedules_of(trace, domain) if phases else []

    starts = [ss[0].ts for ss in trace.samples.values() if ss]
    top = max((level_frac(s) for ss in trace.samples.values() for s in ss), default=0.0)
    if not trace.ooms:
        alerts = [first_alert_ts(detector, ss, None, scheds(d)) for d, ss in trace.samples.items()]
        first = min((a for a in alerts if a is not None), default=None)
        exits = [e.ts for e in trace.events if e.event == "exit"]
        last = max((ss[-1].ts for ss in trace.samples.values() if ss), default=0.0)
        return TraceResult(name, detector.name, False, None, first, first is not None, {}, cause,
                           first_ts=min(starts, default=0.0), end_ts=max([last, *exits]),
                           max_level=top)  # fmt: skip
    # Several domains may OOM: score the one alerted with the longest lead (the trace counts
    # as caught if any was), or, when none was, the one that OOMed first.
    chosen: TraceResult | None = None
    for domain, samples in trace.samples.items():
        oom_ts = trace.oom_ts(domain)
        if oom_ts is None:
            continue
        alert, at = scan_domain(detector, samples, oom_ts, TTO_AT_S, scheds(domain))
        tto = {h: (at[h][1], oom_ts - at[h][0]) for h in TTO_AT_S if h in at}
        first_ts = samples[0].ts if samples else oom_ts
        lands = [e.lands_at for e in trace.events
                 if isinstance(e, ArrivalEvent) and e.domain == domain]  # fmt: skip
        result = TraceResult(name, detector.name, True, oom_ts, alert, False, tto, cause,
                             first_ts=first_ts, end_ts=oom_ts, max_level=top,
                             lands_at=min(lands, default=None))  # fmt: skip
        if chosen is None or _scores_better(result, chosen):
            chosen = result
    if chosen is not None:
        return chosen
    # an OOM event on a domain with no samples: nothing to alert on
    oom_ts = min(e.ts for e in trace.events if e.event == "oom")
    return TraceResult(
        name,
        detector.name,
        True,
        oom_ts,
        None,
        False,
        {},
        cause,
        first_ts=min(starts, default=oom_ts),
        end_ts=oom_ts,
        max_level=top,
    )


def _scores_better(a: TraceResult, b: TraceResult) -> bool:
    lead_a, lead_b = a.lead_s, b.lead_s
    if lead_a is not None or lead_b is not None:
        return lead_a is not None and (lead_b is None or lead_a > lead_b)
    return a.oom_ts is not None and b.oom_ts is not None and a.oom_ts < b.oom_ts


class Causes:
    """What drove each trace, read from the ``manifest.json`` of its folder or a folder above
    it (entries under ``runs`` or ``traces`` with a ``file`` relative to the manifest and a
    ``cause``, ``family`` or ``scenario``). None for a trace no manifest names."""

    def __init__(self) -> None:
        self._manifests: dict[Path, dict[Path, str]] = {}

    def _read(self, folder: Path) -> dict[Path, str]:
        if folder not in self._manifests:
            causes: dict[Path, str] = {}
            try:
                manifest = json.loads((folder / MANIFEST).read_text(encoding="utf-8"))
            except (OSError, ValueError):
                manifest = None
            if isinstance(manifest, dict):
                for key in ("runs", "traces"):
                    entries = manifest.get(key)
                    for entry in entries if isinstance(entries, list) else []:
                        if not isinstance(entry, dict) or not isinstance(entry.get("file"), str):
                            continue
                        cause = next(
                            (entry[k] for k in CAUSE_KEYS if isinstance(entry.get(k), str)), None
                        )
                        if cause == "neighbour" and entry.get("announced") is True:
                            cause = ANNOUNCED_NEIGHBOUR  # its arrival went through admit
                        if cause:
                            causes[(folder / entry["file"]).resolve()] = cause
            self._manifests[folder] = causes
        return self._manifests[folder]

    def of(self, path: Path | str) -> str | None:
        path = Path(path).resolve()
        for folder in [path.parent, *path.parent.parents][:MANIFEST_LEVELS]:
            cause = self._read(folder).get(path)
            if cause is not None:
                return cause
        return None


def evaluate(
    detectors: Iterable[Detector],
    traces: Iterable[Path],
    min_lead_s: float = 10.0,
    view: str = "full",
    *,
    resample_s: float | None = None,
    per_trace: Path | str | TextIO | None = None,
    by_cause: bool = False,
    progress: bool = False,
    phases: bool = True,
) -> dict[str, Any]:
    """Score every detector on every trace (``progress``: a bar on stderr). ``view="nvml"``
    first reduces GPU samples to what NVML alone reports (no allocator figures): a node
    running the agent without the hook.
    ``resample_s`` first downsamples every trace to one sample per that many seconds.
    ``per_trace`` (a file name or an open text file) gets one JSON line per trace and
    detector; ``by_cause`` adds ``by_cause: {cause: {detector: summary}}`` and, over the
    causes of :data:`STEP_CAUSES` there are (a neighbour arriving is left to its own cause),
    ``sudden: {detector: summary}``.
    ``phases`` (the hook's view only): merge the phase forecasts in, as the service does;
    ``phase_traces`` in the result counts the traces they were merged into (absent: none)."""
    if view not in ("full", "nvml"):
        raise ValueError(f"view={view!r}: choose full or nvml")
    if resample_s is not None and (not resample_s > 0 or resample_s == float("inf")):
        raise ValueError(f"resample_s={resample_s} must be a positive number of seconds")
    dets = list(detectors)
    with_phases = phases and view == "full"
    phase_traces = 0  # traces scored with phase forecasts merged in (they have a schedule)
    scores = {d.name: Score() for d in dets}
    cause_scores: dict[str, dict[str, Score]] = {}
    causes = Causes() if per_trace is not None or by_cause else None
    with ExitStack() as stack:
        lines: TextIO | None
        if isinstance(per_trace, str | Path):
            Path(per_trace).parent.mkdir(parents=True, exist_ok=True)
            lines = stack.enter_context(open(per_trace, "w", encoding="utf-8"))
        else:
            lines = per_trace
        paths = list(traces)
        for path in bar(paths, total=len(paths), desc="evaluate", unit="trace", show=progress):
            trace = _prepared(path, view, resample_s)
            cause = causes.of(path) if causes is not None else None
            phased = (ScheduleEvent, ArrivalEvent)
            if with_phases and any(isinstance(e, phased) for e in trace.events):
                phase_traces += 1
            for det in dets:
                result = score_trace(det, trace, cause, phases=with_phases)
                scores[det.name].add(result)
                if by_cause:
                    group = cause_scores.setdefault(cause or UNKNOWN_CAUSE, {})
                    group.setdefault(det.name, Score()).add(result)
                if lines is not None:
                    lines.write(json.dumps(result.to_dict(), separators=(",", ":")) + "\n")
    out: dict[str, Any] = {
        "detectors": {name: s.summary(min_lead_s) for name, s in scores.items()},
        "min_lead_s": min_lead_s,
    }
    if phase_traces:
        out["phase_traces"] = phase_traces
    if view != "full":
        out["view"] = view
    if resample_s is not None:
        out["resample_s"] = resample_s
    if by_cause:
        out["by_cause"] = {
            c: {name: s.summary(min_lead_s) for name, s in cause_scores[c].items()}
            for c in sorted(cause_scores)
        }
        sudden = _sudden(cause_scores, [d.name for d in dets])
        if sudden is not None:
            out[SUDDEN] = {name: s.summary(min_lead_s) for name, s in sudden.items()}
    return out


def _prepared(path: Path, view: str, resample_s: float | None) -> Trace:
    """The trace as scored: resampled, then reduced to the view."""
    trace = load_trace(path)  # a corrupt line raises TraceError naming file and line
    if resample_s is not None:
        trace = downsample_trace(trace, resample_s)
    if view == "nvml":
        trace = as_nvml_sees_it(trace)
    return trace


def _sudden(cause_scores: dict[str, dict[str, Score]], names: list[str]) -> dict[str, Score] | None:
    """The sudden causes' scores pooled, per detector; None when no trace had one."""
    groups = [cause_scores[c] for c in STEP_CAUSES if c in cause_scores]
    if not groups:
        return None
    pooled = {name: Score() for name in names}
    for group in groups:
        for name, score in group.items():
            p = pooled[name]
            p.leads_s += score.leads_s
            p.missed += score.missed
            p.false_alarms += score.false_alarms
            p.oom_traces += score.oom_traces
            p.ok_traces += score.ok_traces
            for h, errs in score.tto_rel_err.items():
                p.tto_rel_err.setdefault(h, []).extend(errs)
            for h, n in score.tto_missing.items():
                p.tto_missing[h] = p.tto_missing.get(h, 0) + n
            p.classes.merge(score.classes)
    return pooled


def evaluate_folder(
    folder: Path | str, detectors: Iterable[Detector], min_lead_s: float = 10.0, **options: Any
) -> dict[str, Any]:
    traces = find_traces(folder)
    if not traces:
        raise FileNotFoundError(f"no traces (*.jsonl, *.jsonl.gz) in {folder}")
    return evaluate(detectors, traces, min_lead_s, **options)


def _table(detectors: dict[str, Any]) -> list[str]:
    rows = [
        ("detector", "recall", "median lead s", "false alarms", "OOM traces", "ok traces"),
    ]
    for name, s in detectors.items():
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
    return lines


def format_table(result: dict[str, Any]) -> str:
    lines = _table(result["detectors"])
    lines.append("")
    for name, s in result["detectors"].items():
        lines += format_classes(name, s["classes"])
    for cause, dets in result.get("by_cause", {}).items():
        lines += ["", f"cause: {cause}", *_table(dets)]
    if SUDDEN in result:
        lines += [
            "",
            f"sudden: {', '.join(STEP_CAUSES)} together (a neighbour arriving is its own"
            " cause above)",
            *_table(result[SUDDEN]),
        ]
    if result.get("phase_traces"):
        lines.append(
            f"phase forecasts merged in on the {result['phase_traces']} traces with a schedule"
        )
    lines.append(f"recall = share of OOM traces alerted at least {result['min_lead_s']:g}s ahead")
    return "\n".join(lines)
