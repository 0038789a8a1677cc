"""Refit the alert rule and the per-horizon calibration from the fleet's own outcomes
(``oomcast recalibrate``), and show them beside the model's own before anything changes.

The model is run over every trace as training runs its validation split: each domain is
embedded, its ticks become a sequence (``training/dataset.py``: the same labels and the same
censoring, so a run that ended without an OOM says nothing of the seconds after its end),
and one-step OOMs are left out or censored at their step as training leaves them out
(``train.grouped``). On those sequences:

- the calibration: per horizon, a Platt correction ``sigmoid(a * logit(risk) + b)`` of the
  network's risk (``network.fit_calibration``: the fit training makes, a > 0, the identity
  kept where the fit does not beat it), fitted on the ticks the evidence gate left open (a
  shut gate gives 0, and stays 0) and, for a model with the straight line, where the line
  adds nothing (``line_off``), then made non-decreasing across horizons as the runtime
  applies it (``model/runtime.py``, ``recalibrated``);
- the alert rule: training's own choice (``train.score_rules`` and ``train.best_rule``: the
  horizon and risk that warn the most long OOMs 30 s ahead while at most 2% of the ordinary
  runs of every group of traces, and at most half the near misses, are alerted), on the
  corrected risks. Each ``--traces`` folder is a group, as each source is in training.
  Where a ceiling holds the rule back by 10 points or more of the long OOMs warned 30 s
  ahead, the report says which, and what training would choose without it
  (``binding_ceilings``).

Both models, the one given and the refit, are then scored on the same traces as ``oomcast
evaluate`` scores them (``evaluate.score_trace``, every sample, phases merged in), so
``oomcast evaluate --model NEW.onnx`` gives the refit's figures again.

A refit is refused (``TooLittleEvidence``) below ``MIN_LONG_OOMS`` long OOMs,
``MIN_OOM_FREE_RUNS`` runs that never OOMed or ``MIN_JOB_HOURS`` hours of domains watched:
with fewer, one run moves the recall by more than 10 points or the false-alarm share by more
than 5, and the rule would follow the noise.

Fitting needs torch (it is training's fit and training's rule choice, imported when they
run); reading, checking and formatting do not. ``write_model`` needs the ``onnx`` package.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, date, datetime
from pathlib import Path
from typing import Any

import numpy as np

from oomcast.model.forecast import HORIZONS_S, AlertRule, Detector
from oomcast.model.runtime import RECALIBRATION_KEY, OnnxForecaster, recalibrated
from oomcast.model.trace import load_trace
from oomcast.training.classes import LONG_AFTER_S
from oomcast.training.dataset import Sequence as Seq
from oomcast.training.dataset import sequences_of_trace
from oomcast.training.evaluate import Causes, Score, score_trace
from oomcast.training.progress import bar

# Below these a refit is refused (the module's docstring says why).
MIN_LONG_OOMS = 10
MIN_OOM_FREE_RUNS = 20
MIN_JOB_HOURS = 5.0
MAX_FALSE_ALARMS = 0.02  # training's ceiling on the ordinary runs alerted, per group
ECE_BINS = 10
CEILING_GAIN = 0.10  # say so when a ceiling costs this share of the long OOMs
PROVENANCE_KEY = "oomcast.recalibrated"
FLEET_TAG = "+fleet."
KEPT_LISTING = "outcomes.json"  # what ``oomcast dump --outcomes`` writes beside its traces
# the metadata a refit model differs in; every other entry is the original's
WRITTEN_KEYS = (
    "oomcast.version",
    "oomcast.rule",
    "oomcast.tto_min_risk",
    RECALIBRATION_KEY,
    PROVENANCE_KEY,
)

BIAS_NOTE = (
    "Kept traces (oomcast dump --outcomes) are a biased sample: the service keeps only its"
    " mistakes (missed OOMs, false alarms, near misses), never the runs it got right, and"
    " each starts mid-job, 10 minutes before the outcome. A refit on them alone sees every"
    " false alarm and none of the quiet runs. Add whole streams of ordinary days (oomcast"
    " dump --node NODE --out FILE) before trusting it."
)
IN_SAMPLE_NOTE = (
    "Both columns are measured on the traces the refit was fitted to, which flatters the"
    " refit: judge it on new outcomes, as the service's shadow model."
)


class TooLittleEvidence(ValueError):
    """The traces hold too few OOMs, clean runs or hours for a refit to mean anything."""

    def __init__(self, evidence: Evidence) -> None:
        self.evidence = evidence
        e = evidence
        counts = [
            ("long OOMs", str(e.long_ooms), e.long_ooms >= MIN_LONG_OOMS, f"{MIN_LONG_OOMS}"),
            ("runs that never OOMed", str(e.oom_free), e.oom_free >= MIN_OOM_FREE_RUNS,
             f"{MIN_OOM_FREE_RUNS}"),
            ("job-hours", f"{e.job_hours:.2f}", e.job_hours >= MIN_JOB_HOURS, f"{MIN_JOB_HOURS:g}"),
        ]  # fmt: skip
        short = [f"{name} ({n}; need {need})" for name, n, ok, need in counts if not ok]
        enough = [f"{name} {n}" for name, n, ok, _ in counts if ok]
        super().__init__(
            f"refused: the {e.traces} traces hold too few {' and too few '.join(short)} for a"
            " refit whose figures mean anything"
            + (f" (enough: {', '.join(enough)})" if enough else "")
            + ". Add traces: whole streams (oomcast dump --node NODE --out FILE) as well as"
            " kept outcomes (oomcast dump --outcomes)."
        )


@dataclass
class Evidence:
    """What the traces hold, as the refit counts it."""

    traces: int = 0
    kept_traces: int = 0  # in folders written by ``oomcast dump --outcomes``
    domains: int = 0  # sequences: one per domain of each trace
    ooms: int = 0  # domains that OOMed
    long_ooms: int = 0  # ... 60 s or more after their first sample, growth (the rule's)
    oom_free: int = 0  # domains that never OOMed
    job_hours: float = 0.0  # first sample to the end (OOM, exit, last sample), all domains
    labelled_ticks: int = 0  # ticks with a known label at some horizon
    by_group: dict[str, int] = field(default_factory=dict)  # traces per --traces

    def enough(self) -> bool:
        return (
            self.long_ooms >= MIN_LONG_OOMS
            and self.oom_free >= MIN_OOM_FREE_RUNS
            and self.job_hours >= MIN_JOB_HOURS
        )

    def to_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "job_hours": round(self.job_hours, 3)}


@dataclass
class Result:
    """What ``recalibrate`` found: both columns, the correction and the rule."""

    model: str  # the path given
    version: str  # the model's
    new_version: str
    evidence: Evidence
    table: dict[int, tuple[float, float]]  # the refit's {horizon_s: (a, b)}
    rule: dict[str, Any]  # the refit's, as export stores a rule
    rule_figures: dict[str, Any]  # what chose it, per group (export's rule_validation)
    columns: dict[str, dict[str, Any]]  # "shipped" and "refit": rule, calibration, scores
    notes: list[str]
    written: str | None = None

    def refit_rule(self) -> AlertRule:
        return AlertRule(
            int(self.rule["horizon_s"]), float(self.rule["fire_risk"]), int(self.rule["fire_after"])
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "version": self.version,
            "new_version": self.new_version,
            "evidence": self.evidence.to_dict(),
            "thresholds": {
                "min_long_ooms": MIN_LONG_OOMS,
                "min_oom_free_runs": MIN_OOM_FREE_RUNS,
                "min_job_hours": MIN_JOB_HOURS,
            },
            "recalibration": {str(h): list(ab) for h, ab in self.table.items()},
            "rule": self.rule,
            "rule_figures": self.rule_figures,
            "columns": self.columns,
            "notes": self.notes,
            "written": self.written,
        }


# -- reading --------------------------------------------------------------------------------


def _manifest_runs(label: str) -> dict[str, dict[str, Any]] | None:
    """The runs a folder's manifest.json describes (by file name), as training reads a
    corpus's: a one-step OOM whose step is known is censored there, not dropped."""
    path = Path(label) / "manifest.json"
    try:
        runs = json.loads(path.read_text(encoding="utf-8")).get("runs")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(runs, list):
        return None
    return {Path(r["file"]).name: r for r in runs if isinstance(r, dict) and "file" in r}


def read_sequences(
    traces: Mapping[str, Sequence[Path]], progress: bool = False
) -> tuple[list[Seq], Evidence]:
    """(the sequences the refit is fitted and its rule chosen on, what every domain of
    the traces holds). ``traces``: per group (a ``--traces`` folder or file), its files."""
    from oomcast.training.train import grouped

    everything: list[Seq] = []
    chosen_on: list[Seq] = []
    ev = Evidence()
    todo = [(label, p) for label, paths in traces.items() for p in paths]
    for label, path in bar(todo, total=len(todo), desc="read", unit="trace", show=progress):
        seqs = sequences_of_trace(load_trace(path), path.name)
        for s in seqs:
            s.group = label
        everything += seqs
        chosen_on += grouped(seqs, label, True, _manifest_runs(label))
        ev.traces += 1
        ev.kept_traces += (path.parent / KEPT_LISTING).is_file()
        ev.by_group[label] = ev.by_group.get(label, 0) + 1
    ev.domains = len(everything)
    ev.ooms = sum(s.ooms for s in everything)
    ev.job_hours = sum(s.span_s for s in everything) / 3600.0
    ev.long_ooms = sum(1 for s in chosen_on if s.ooms and (s.oom_after_s or 0) >= LONG_AFTER_S)
    ev.oom_free = sum(1 for s in chosen_on if not s.ooms)
    ev.labelled_ticks = int(sum((s.m.sum(axis=1) > 0).sum() for s in chosen_on))
    return chosen_on, ev


def network_risks(fc: OnnxForecaster, seqs: Iterable[Seq]) -> list[np.ndarray]:
    """The network's risk (ticks, H) on each sequence, run from a fresh state with every
    row a tick (as ``OnnxForecaster.window_last`` runs committed ticks), before any
    recalibration the model carries."""
    zeros = np.zeros((fc.layers, 1, fc.hidden), np.float32)
    out = []
    for s in seqs:
        x = np.ascontiguousarray(s.x[None, :, : fc.n_features], dtype=np.float32)
        risk = fc.session.run(None, {"x": x, "h": zeros, "c": zeros})[0]
        out.append(np.asarray(risk[0], dtype=np.float32))
    return out


def _corrected(
    risks: list[np.ndarray],
    table: Mapping[int, tuple[float, float]] | None,
    horizons_s: Sequence[int],
) -> list[np.ndarray]:
    if not table:
        return risks
    a = np.asarray([table[h][0] for h in horizons_s])
    b = np.asarray([table[h][1] for h in horizons_s])
    return [recalibrated(r, a, b) for r in risks]


# -- fitting --------------------------------------------------------------------------------


def line_off(seqs: Iterable[Seq], horizons_s: Sequence[int]) -> list[np.ndarray]:
    """Per sequence, (ticks, H): True where the model's straight line adds no risk
    (``network.straight_line`` on the sequence's features), so the risk there is the
    network's alone."""
    import torch

    from oomcast.model.network import straight_line

    out = []
    for s in seqs:
        x = torch.from_numpy(np.ascontiguousarray(s.x, dtype=np.float32))
        with torch.no_grad():
            line, _, _ = straight_line(x, tuple(horizons_s))
        out.append(line.numpy() <= 0.0)
    return out


def fit_table(
    risks: list[np.ndarray],
    seqs: list[Seq],
    horizons_s: Sequence[int],
    fit_on: list[np.ndarray] | None = None,
) -> dict[int, tuple[float, float]]:
    """Per horizon, training's Platt fit (``network.fit_calibration``) of the risks the
    gate left open (> 0) against the known labels; with ``fit_on`` (per sequence, ticks x
    horizons), only where it is True. A model with the straight line is fitted where the
    line adds nothing (``line_off``): the correction is the network's. The line's risk is
    a projection with its own spread, near 0 or 1 on a clean climb; fitted with the rest,
    the confident line on a straight climb that stopped short (a near miss) drags the
    slope towards 0 and the refit's risk towards a constant (a = 0.02 to 0.2 on the
    repository's test jobs, where the network's ticks alone give 0.4 to 3)."""
    import torch

    from oomcast.model.network import NetConfig, OOMForecastNet, fit_calibration

    r = np.concatenate(risks).astype(np.float64)
    y = np.concatenate([s.y for s in seqs]).astype(np.float64)
    m = np.concatenate([s.m for s in seqs]).astype(np.float64) * (r > 0)
    if fit_on is not None:
        m = m * np.concatenate(fit_on).astype(np.float64)
    log_s = np.log1p(-np.clip(r, 1e-6, 1.0 - 1e-6))  # what fit_calibration takes
    holder = OOMForecastNet(NetConfig(horizons_s=tuple(horizons_s)))  # its cal_a, cal_b
    with torch.no_grad():
        holder.cal_a.fill_(1.0)
        holder.cal_b.fill_(0.0)
    fit_calibration(holder, torch.from_numpy(log_s), torch.from_numpy(y), torch.from_numpy(m))
    return {
        int(h): (round(float(holder.cal_a[k]), 6), round(float(holder.cal_b[k]), 6))
        for k, h in enumerate(horizons_s)
    }


def binding_ceilings(
    seqs: list[Seq], risks: list[np.ndarray], rule: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """What each of training's two ceilings (at most ``MAX_FALSE_ALARMS`` of every group's
    ordinary runs alerted; at most half of the near misses) costs ``rule``: per ceiling that
    holds it back by ``CEILING_GAIN`` or more of the long OOMs warned 30 s ahead, the rule
    training would choose without it and what that rule buys and costs."""
    from oomcast.training.train import best_rule, score_rules

    out: dict[str, dict[str, Any]] = {}
    for name, fa, near in (("false_alarms", 1.0, 0.5), ("near_misses", MAX_FALSE_ALARMS, 1.0)):
        free = best_rule(score_rules(seqs, risks, fa, near), fa, near)
        if free.recall_30 >= float(rule["recall_30"]) + CEILING_GAIN - 1e-9:
            out[name] = {
                "horizon_s": free.horizon_s,
                "fire_risk": float(free.fire_risk),
                "recall_30": float(free.recall_30),
                "recall_10": float(free.recall_10),
                "false_alarm_rate": float(free.false_alarm_rate),
                "near_miss_warned": float(free.near_miss_warned),
            }
    return out


def _ceiling_note(rule: Mapping[str, Any], name: str, free: Mapping[str, Any]) -> str:
    what = {
        "false_alarms": f"at most {MAX_FALSE_ALARMS:.0%} of every group's ordinary runs alerted",
        "near_misses": "at most half of the near misses alerted",
    }[name]
    return (
        f"The ceiling of {what} sets the refit's rule: it warns {float(rule['recall_30']):.0%}"
        " of the long OOMs 30 s ahead. Without that ceiling training's choice would be"
        f" risk@{free['horizon_s']}s >= {free['fire_risk']:.4g}: {free['recall_30']:.0%} of them,"
        f" with {free['false_alarm_rate']:.0%} of the ordinary runs of the worst group and"
        f" {free['near_miss_warned']:.0%} of the near misses alerted (ticks, as training counts"
        " them). Weigh the two before running this refit."
    )


def choose_rule(seqs: list[Seq], risks: list[np.ndarray]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Training's rule choice on ``risks``: (the rule as export stores it, its figures)."""
    from oomcast.training.train import best_rule, score_rules

    rule = best_rule(score_rules(seqs, risks, MAX_FALSE_ALARMS), MAX_FALSE_ALARMS)
    stored = {
        k: float(v) if isinstance(v, np.floating) else v
        for k, v in rule.__dict__.items()
        if k != "figures"
    }
    return stored, rule.figures


# -- measuring ------------------------------------------------------------------------------


def calibration(
    risks: list[np.ndarray], seqs: list[Seq], horizons_s: Sequence[int]
) -> dict[str, dict[str, Any]]:
    """Per horizon, over the ticks whose label is known: the Brier score, the expected
    calibration error (``ECE_BINS`` equal bins of risk: the tick-weighted gap between the
    mean risk and the share that OOMed), the mean risk and the share that OOMed."""
    r = np.concatenate(risks).astype(np.float64)
    y = np.concatenate([s.y for s in seqs]).astype(np.float64)
    m = np.concatenate([s.m for s in seqs]) > 0
    out: dict[str, dict[str, Any]] = {}
    for k, h in enumerate(horizons_s):
        p, t = r[m[:, k], k], y[m[:, k], k]
        if not len(p):
            out[str(h)] = {
                "n": 0,
                "ooms": 0,
                "brier": None,
                "ece": None,
                "mean_risk": None,
                "observed": None,
            }
            continue
        bins = np.minimum((p * ECE_BINS).astype(int), ECE_BINS - 1)
        n = np.bincount(bins, minlength=ECE_BINS)
        gap = np.abs(np.bincount(bins, p, ECE_BINS) - np.bincount(bins, t, ECE_BINS))
        out[str(h)] = {
            "n": len(p),
            "ooms": int(t.sum()),
            "brier": round(float(np.mean((p - t) ** 2)), 6),
            "ece": round(float(gap[n > 0].sum() / len(p)), 6),
            "mean_risk": round(float(p.mean()), 6),
            "observed": round(float(t.mean()), 6),
        }
    return out


def score(
    detectors: Sequence[Detector],
    paths: Sequence[Path],
    job_hours: float,
    progress: bool = False,
) -> dict[str, dict[str, Any]]:
    """Each detector on every trace as ``oomcast evaluate`` scores it (every sample, phase
    forecasts merged in, classes by the traces' manifests), summed up as the scorecard
    states it; by detector name."""
    causes = Causes()
    totals = {d.name: Score() for d in detectors}
    for path in bar(paths, total=len(paths), desc="score", unit="trace", show=progress):
        trace = load_trace(path)
        for d in detectors:
            totals[d.name].add(score_trace(d, trace, causes.of(path), phases=True))
    return {name: _figures(total, job_hours) for name, total in totals.items()}


def _figures(total: Score, job_hours: float) -> dict[str, Any]:
    c = total.classes.summary()
    long, short, sudden = c["oom_long"], c["oom_short"], c["oom_sudden"]
    false_alarms = c["ordinary"]["false_alarms"]
    leads = [x for x in total.leads_s if x is not None]
    return {
        "long_ooms": long["n"],
        "long_warned_30s": long["warned_30s"],
        "long_warned_10s": long["warned_10s"],
        "recall_30s": long["recall_30s"],
        "recall_10s": long["recall_10s"],
        "median_lead_s": long["median_lead_s"],
        "short_ooms": short["n"],
        "short_warned_10s": short["warned_10s"],
        "sudden_ooms": sudden["n"],
        "sudden_warned_30s": sudden["warned_30s"],
        "neighbour_ooms": c["oom_neighbour"]["n"],
        "neighbour_warned_30s": c["oom_neighbour"]["warned_30s"],
        "oom_runs": total.oom_traces,
        "oom_warned_30s": sum(1 for x in leads if x >= 30.0),
        "median_lead_all_s": round(statistics.median(leads), 1) if leads else None,
        "near_misses": c["near_miss"]["n"],
        "near_misses_alerted": c["near_miss"]["warned"],
        "ordinary_runs": c["ordinary"]["n"],
        "false_alarms": false_alarms,
        "false_alarms_per_1000_job_hours": (
            round(1000.0 * false_alarms / job_hours, 1) if job_hours > 0 else None
        ),
        "censored": c["censored"]["n"],
        "job_hours": round(job_hours, 3),
    }


# -- the whole --------------------------------------------------------------------------------


def fleet_version(version: str, today: date | None = None) -> str:
    """``<version>+fleet.<YYYYMMDD>``; a model refit before is named from its base."""
    day = today or datetime.now(UTC).date()
    return f"{version.split(FLEET_TAG, 1)[0]}{FLEET_TAG}{day:%Y%m%d}"


def recalibrate(
    model: Path | str,
    traces: Mapping[str, Sequence[Path]],
    *,
    today: date | None = None,
    progress: bool = False,
) -> Result:
    """Refit the model at ``model`` on ``traces`` (per group, its trace files) and score it
    beside the model as it is. Raises ``TooLittleEvidence`` when the traces hold too little
    (before anything is fitted), ``ModelLoadError`` for a model that will not load."""
    fc = OnnxForecaster(model)
    if tuple(fc.horizons_s) != HORIZONS_S:
        raise ValueError(
            f"{model}: horizons {list(fc.horizons_s)}; this oomcast's rules are"
            f" chosen at {list(HORIZONS_S)}"
        )
    chosen_on, ev = read_sequences(traces, progress)
    if not ev.enough():
        raise TooLittleEvidence(ev)
    net = network_risks(fc, chosen_on)
    has_line = "oomcast.straight" in fc.metadata
    fit_on = line_off(chosen_on, fc.horizons_s) if has_line else None
    table = fit_table(net, chosen_on, fc.horizons_s, fit_on)
    refit_risks = _corrected(net, table, fc.horizons_s)
    rule, figures = choose_rule(chosen_on, refit_risks)
    binding = binding_ceilings(chosen_on, refit_risks, rule)
    if binding:
        figures = {**figures, "without_ceiling": binding}
    shipped_risks = _corrected(net, fc.recalibration, fc.horizons_s)

    refit = OnnxForecaster(model)
    refit.set_recalibration(table)
    refit.tto_min_risk = min(0.5, float(rule["fire_risk"]))  # as export sets it
    new_version = fleet_version(fc.version, today)
    refit.version = new_version
    paths = [p for ps in traces.values() for p in ps]
    refit_rule = AlertRule(
        int(rule["horizon_s"]), float(rule["fire_risk"]), int(rule["fire_after"])
    )
    detectors = [Detector("shipped", fc, fc.rule), Detector("refit", refit, refit_rule)]
    scores = score(detectors, paths, ev.job_hours, progress)
    columns: dict[str, dict[str, Any]] = {}
    for det, version, risks, tab in (
        (detectors[0], fc.version, shipped_risks, fc.recalibration),
        (detectors[1], new_version, refit_risks, table),
    ):
        columns[det.name] = {
            "version": version,
            "rule": {
                "horizon_s": det.rule.horizon_s,
                "fire_risk": det.rule.fire_risk,
                "fire_after": det.rule.fire_after,
            },
            "recalibration": None if tab is None else {str(h): list(v) for h, v in tab.items()},
            "calibration": calibration(risks, chosen_on, fc.horizons_s),
            "scores": scores[det.name],
        }
    notes = [IN_SAMPLE_NOTE, BIAS_NOTE]
    notes[:0] = [_ceiling_note(rule, name, free) for name, free in binding.items()]
    if ev.kept_traces and ev.kept_traces == ev.traces:
        notes.insert(
            0,
            "Every trace here is a kept outcome: this refit has seen no run the service got right.",
        )
    return Result(str(model), fc.version, new_version, ev, table, rule, figures, columns, notes)


# -- writing --------------------------------------------------------------------------------


class ModelWriteError(RuntimeError):
    pass


def onnx_available() -> bool:
    try:
        import onnx  # noqa: F401
    except ImportError:
        return False
    return True


def write_model(source: Path | str, out: Path | str, result: Result) -> Path:
    """A copy of the model at ``source`` whose metadata carries the refit: the rule, the
    version, the time-to-OOM floor, ``oomcast.recalibration`` and where it came from
    (``oomcast.recalibrated``). Never replaces a file; the copy is loaded back and checked
    before this returns."""
    try:
        import onnx
    except ImportError:
        raise ModelWriteError(
            "writing a model needs the onnx package: pip install 'oomcast[train]'"
        ) from None
    out = Path(out)
    if out.exists():
        raise FileExistsError(f"{out} exists: give a new file name")
    model = onnx.load(str(source))
    meta = {p.key: p.value for p in model.metadata_props}
    meta.update(
        {
            "oomcast.version": result.new_version,
            "oomcast.rule": json.dumps(result.rule),
            "oomcast.tto_min_risk": str(min(0.5, float(result.rule["fire_risk"]))),
            RECALIBRATION_KEY: json.dumps({str(h): list(ab) for h, ab in result.table.items()}),
            PROVENANCE_KEY: json.dumps(
                {
                    "from_version": result.version,
                    "at": datetime.now(UTC).isoformat(timespec="seconds"),
                    "evidence": result.evidence.to_dict(),
                    "rule_figures": result.rule_figures,
                }
            ),
        }
    )
    del model.metadata_props[:]
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    data = model.SerializeToString()
    with open(out, "xb") as fh:  # exclusive: a file that appeared meanwhile is not replaced
        try:
            fh.write(data)
        except BaseException:
            fh.close()
            out.unlink()
            raise
    try:
        check = OnnxForecaster(out)
        ok = (
            check.version == result.new_version
            and check.recalibration == result.table
            and check.rule == result.refit_rule()
        )
    except Exception:
        out.unlink()
        raise
    if not ok:
        out.unlink()
        raise ModelWriteError(f"{out}: the written model did not read back as written")
    return out


# -- printing -------------------------------------------------------------------------------


def _pct(n: int, d: int) -> str:
    return f"{n}/{d} ({n / d:.0%})" if d else "0/0"


def _num(v: Any, fmt: str = "{:.4f}") -> str:
    return "-" if v is None else fmt.format(v)


def _rule_text(column: dict[str, Any]) -> str:
    rule = column["rule"]
    return f"risk@{rule['horizon_s']}s >= {rule['fire_risk']:.4g}, {rule['fire_after']} sample"


def _rows(result: Result) -> list[tuple[str, str, str]]:
    s, r = result.columns["shipped"], result.columns["refit"]
    rows = [("version", s["version"], r["version"]), ("rule", _rule_text(s), _rule_text(r))]
    a, b = s["scores"], r["scores"]

    def both(label: str, f: Any) -> None:
        rows.append((label, f(a), f(b)))

    both("long OOMs warned >= 30 s", lambda x: _pct(x["long_warned_30s"], x["long_ooms"]))
    both("long OOMs warned >= 10 s", lambda x: _pct(x["long_warned_10s"], x["long_ooms"]))
    both("median lead, long OOMs", lambda x: _num(x["median_lead_s"], "{:.1f} s"))
    both("short OOMs warned >= 10 s", lambda x: _pct(x["short_warned_10s"], x["short_ooms"]))
    both("sudden OOMs warned >= 30 s", lambda x: _pct(x["sudden_warned_30s"], x["sudden_ooms"]))
    both(
        "neighbours arriving warned >= 30 s",
        lambda x: _pct(x["neighbour_warned_30s"], x["neighbour_ooms"]),
    )
    both("all OOMs warned >= 30 s", lambda x: _pct(x["oom_warned_30s"], x["oom_runs"]))
    both("false alarms (ordinary runs)", lambda x: _pct(x["false_alarms"], x["ordinary_runs"]))
    both(
        "false alarms / 1000 job-hours",
        lambda x: _num(x["false_alarms_per_1000_job_hours"], "{:.1f}"),
    )
    both("near misses alerted", lambda x: _pct(x["near_misses_alerted"], x["near_misses"]))
    both("censored alerts", lambda x: str(x["censored"]))
    return rows


def _calibration_lines(result: Result) -> list[str]:
    s, r = result.columns["shipped"]["calibration"], result.columns["refit"]["calibration"]
    head = (
        "horizon",
        "ticks",
        "OOM share",
        "Brier shipped",
        "refit",
        "ECE shipped",
        "refit",
        "mean risk shipped",
        "refit",
        "a",
        "b",
    )
    rows = [head]
    for h, cs in s.items():
        cr = r[h]
        a, b = result.table[int(h)]
        rows.append(
            (
                f"{h} s",
                str(cs["n"]),
                _num(cs["observed"]),
                _num(cs["brier"]),
                _num(cr["brier"]),
                _num(cs["ece"]),
                _num(cr["ece"]),
                _num(cs["mean_risk"]),
                _num(cr["mean_risk"]),
                f"{a:.3f}",
                f"{b:+.3f}",
            )
        )
    return _align(rows)


def _align(rows: Sequence[Sequence[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return [
        "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip() for row in rows
    ]


def format_report(result: Result) -> str:
    ev = result.evidence
    lines = [
        f"model {result.version} ({result.model}) on {ev.traces} traces"
        f" ({', '.join(f'{g}: {n}' for g, n in ev.by_group.items())}), {ev.kept_traces} of"
        f" them kept outcomes",
        f"{ev.domains} domains, {ev.job_hours:.2f} job-hours; {ev.ooms} OOMed. The refit is"
        f" fitted on {ev.labelled_ticks} labelled ticks and its rule chosen on {ev.long_ooms}"
        f" long OOMs and {ev.oom_free} runs that never OOMed (one-step OOMs left out, as in"
        " training)",
        "",
        *_align([("", "shipped", "refit"), *_rows(result)]),
        "",
        "calibration per horizon, on ticks whose future is known (a run that ended without an"
        " OOM is unlabelled in its last h seconds); refit risk = sigmoid(a * logit(risk) + b):",
        *_calibration_lines(result),
        "",
    ]
    hours = ev.job_hours
    if hours > 0:
        lines.append(
            f"One false alarm is {1000.0 / hours:.1f} per 1000 job-hours on these"
            f" {hours:.2f} hours."
        )
    lines += result.notes
    if result.written:
        lines.append(
            f"Wrote {result.written} ({result.new_version}). Nothing in service has changed:"
            f" run it as the shadow model (OOMCAST_SHADOW_MODEL_PATH={result.written}),"
            " compare both on /v1/scorecard (oomcast report --since 7d), then promote it."
        )
    else:
        lines.append(
            "Nothing was written or changed: give --out NEW.onnx to write the refit"
            " model, to run as the service's shadow (OOMCAST_SHADOW_MODEL_PATH)."
        )
    return "\n".join(lines)


__all__ = [
    "MIN_JOB_HOURS",
    "MIN_LONG_OOMS",
    "MIN_OOM_FREE_RUNS",
    "Evidence",
    "ModelWriteError",
    "Result",
    "TooLittleEvidence",
    "fleet_version",
    "format_report",
    "recalibrate",
    "write_model",
]
