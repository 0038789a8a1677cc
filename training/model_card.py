"""The model's card (``oomcast card``): the model and every baseline measured on held-out data.

Four sets, each scored by :func:`oomcast.training.evaluate.evaluate` exactly as ``oomcast
evaluate`` scores them (the model and the baselines ``oomcast evaluate`` runs, one pass per
set with the per-trace lines kept, so each detector steps each trace once):

* ``corpus_test_10hz``: the test programs of the corpus of real jobs (never trained on, nor
  used to choose the rule, in any form) at their native 10 Hz;
* ``corpus_test_1hz``: the same traces downsampled to 1 Hz (a slower collector);
* ``sim_test_full``: the simulated test split as the in-process hook sees it;
* ``sim_test_nvml``: the same as NVML alone sees it (no allocator figures).

Each set reports, per detector, the evaluate summary at 30 s and at 10 s of lead, the scoring
classes of ``training/classes.py`` (long and short OOMs, near misses, ordinary runs with
their false alarms per hour, censored alerts), recall on the OOMs with a signal in the
stream (``growth``: the corpus's growth causes, the simulated leak, seq_growth and
fragmentation families) apart from the rest (``sudden``), a per-cause table and, for the
corpus, a per-program table of false alarms. ``data`` says what the model was trained and
judged on, by source. ``quietest_baseline_at_model_fa``
says, per set, which baselines alert on no more OOM-free runs than the model, and how many
growth OOMs they warn 30 s ahead: whether the model beats every baseline at its own
false-alarm count.

Three figures (PNG, dpi 100) come from one more pass of the model alone over the corpus test
(10 Hz) and the simulated test (full view): the network is stepped through ``step`` over
batches of domains at its ticks (about 1 Hz; what lies between two ticks leaves the LSTM
state as it was), with the embeddings and labels of :func:`training.dataset.sequences_of_trace`,
the rule the model was trained by: OOM within ``h`` for a domain that OOMs; 0 for one that
does not, known only where the trace runs ``h`` seconds on or ends with an ``exit`` event.

    oomcast card --model M --sim-test data/sim2k/test --corpus training/traces/corpus \\
        --figures docs/figures --out runs/card.json
"""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oomcast.model.baselines import baseline_detectors
from oomcast.model.embedding import level_frac
from oomcast.model.forecast import HORIZONS_S, Detector, release_state
from oomcast.model.runtime import OnnxForecaster
from oomcast.model.schema import Sample
from oomcast.model.trace import Trace, find_traces, load_trace
from oomcast.training.corpus.plan import GROWTH as JOB_GROWTH
from oomcast.training.evaluate import TTO_AT_S, UNKNOWN_CAUSE, Causes, evaluate

# the corpus's causes whose OOM grows in the stream first (start-up fills included)
GROWTH_CAUSES = (*JOB_GROWTH, "plateau", "warmup")

MODEL = "model"
MIN_LEADS_S = (30, 10)
# simulated families whose OOM shows in the stream before it happens
SIM_GROWTH_FAMILIES = ("leak", "seq_growth", "fragmentation")
# name -> (source, view, resample_s)
SETS: dict[str, tuple[str, str, float | None]] = {
    "corpus_test_10hz": ("corpus", "full", None),
    "corpus_test_1hz": ("corpus", "full", 1.0),
    "sim_test_full": ("sim", "full", None),
    "sim_test_nvml": ("sim", "nvml", None),
}
FIGURE_SETS = ("corpus_test_10hz", "sim_test_full")  # the sets the figures show
RELIABILITY_BINS = 10
DPI = 100
BATCH_DOMAINS = 256  # domains stepped together in the figures' pass
FIGURES = {
    "reliability": "model-reliability.png",
    "tto_error": "model-tto-error.png",
    "risk_examples": "model-risk-examples.png",
}


# --- scoring ------------------------------------------------------------------------------
def lead_of(row: dict[str, Any]) -> float | None:
    """A per-trace line's lead, from its unrounded timestamps (None: no alert before the OOM)."""
    if row["oom_ts"] is None or row["first_alert_ts"] is None:
        return None
    return float(row["oom_ts"] - row["first_alert_ts"])


def warned(row: dict[str, Any], min_lead_s: float) -> bool:
    lead = lead_of(row)
    return bool(row["oom"]) and lead is not None and lead >= min_lead_s


def _share(k: int, n: int) -> float | None:
    return round(k / n, 4) if n else None


def group_recall(rows: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """OOM traces among ``rows`` and the share warned 30 s and 10 s ahead."""
    ooms = [r for r in rows if r["oom"]]
    out: dict[str, Any] = {"oom_traces": len(ooms)}
    for s in MIN_LEADS_S:
        out[f"warned_{s}s"] = sum(warned(r, s) for r in ooms)
    for s in MIN_LEADS_S:
        out[f"recall_{s}s"] = _share(out[f"warned_{s}s"], len(ooms))
    return out


def cause_table(rows: Iterable[dict[str, Any]]) -> dict[str, dict[str, int]]:
    table: dict[str, dict[str, int]] = {}
    for r in rows:
        cause = r["cause"] or UNKNOWN_CAUSE
        t = table.setdefault(
            cause,
            {
                "oom_traces": 0,
                **{f"warned_{s}s": 0 for s in MIN_LEADS_S},
                "ok_traces": 0,
                "false_alarms": 0,
            },
        )
        if r["oom"]:
            t["oom_traces"] += 1
            for s in MIN_LEADS_S:
                t[f"warned_{s}s"] += warned(r, s)
        else:
            t["ok_traces"] += 1
            t["false_alarms"] += bool(r["false_alarm"])
    return {c: table[c] for c in sorted(table)}


def program_table(rows: Iterable[dict[str, Any]], programs: dict[str, str]) -> dict[str, Any]:
    """Per program: its runs that never OOMed, and how many of them the detector alerted on."""
    table: dict[str, dict[str, int]] = {}
    for r in rows:
        t = table.setdefault(
            programs.get(r["trace"], UNKNOWN_CAUSE), {"ok_traces": 0, "false_alarms": 0}
        )
        if not r["oom"]:
            t["ok_traces"] += 1
            t["false_alarms"] += bool(r["false_alarm"])
    return {p: table[p] for p in sorted(table)}


def score_set(
    detectors: Sequence[Detector],
    paths: list[Path],
    growth: Sequence[str],
    *,
    view: str = "full",
    resample_s: float | None = None,
    programs: dict[str, str] | None = None,
) -> tuple[dict[str, Any], dict[str, list[dict[str, Any]]]]:
    """One evaluate pass over ``paths`` (at 30 s; the 10 s figures come from its per-trace
    lines): the set's section of the card, and the per-trace lines by detector."""
    with tempfile.TemporaryDirectory(prefix="oomcast-card-") as tmp:
        per_trace = Path(tmp) / "per-trace.jsonl"
        summary = evaluate(
            detectors, paths, MIN_LEADS_S[0], view, resample_s=resample_s, per_trace=per_trace
        )
        with open(per_trace, encoding="utf-8") as lines:
            rows = [json.loads(line) for line in lines if line.strip()]
    by_det: dict[str, list[dict[str, Any]]] = {d.name: [] for d in detectors}
    for row in rows:
        by_det[row["detector"]].append(row)
    out: dict[str, Any] = {
        "traces": len(paths),
        "view": view,
        "resample_s": resample_s,
        "growth_causes": list(growth),
        "detectors": {},
    }
    for det in detectors:
        det_rows = by_det[det.name]
        at: dict[str, Any] = {}
        for s in MIN_LEADS_S:
            part = dict(summary["detectors"][det.name])
            ooms = [r for r in det_rows if r["oom"]]
            part["recall"] = _share(sum(warned(r, s) for r in ooms), len(ooms))
            at[f"at_{s}s"] = part
        entry: dict[str, Any] = {
            **at,
            "classes": summary["detectors"][det.name]["classes"],
            "growth": group_recall(r for r in det_rows if r["cause"] in growth),
            "sudden": group_recall(r for r in det_rows if r["cause"] not in growth),
            "by_cause": cause_table(det_rows),
        }
        if programs is not None:
            entry["by_program"] = program_table(det_rows, programs)
        out["detectors"][det.name] = entry
    first = next(iter(summary["detectors"].values()), {"oom_traces": 0, "ok_traces": 0})
    out["oom_traces"] = first["oom_traces"]
    out["ok_traces"] = first["ok_traces"]
    return out, by_det


def compare_at_model_fa(section: dict[str, Any]) -> dict[str, Any]:
    """The baselines that alert on no more OOM-free traces than the model, and their growth
    recall 30 s ahead; ``model_beats_all``: the model's is higher than each of theirs (None
    when the set has no growth OOMs)."""
    dets = section["detectors"]
    model = dets[MODEL]
    fa = model["at_30s"]["false_alarms"]
    ours = model["growth"]["recall_30s"]
    quiet = {
        name: {
            "false_alarms": d["at_30s"]["false_alarms"],
            "growth_recall_30s": d["growth"]["recall_30s"],
        }
        for name, d in dets.items()
        if name != MODEL and d["at_30s"]["false_alarms"] <= fa
    }
    best = max(quiet, key=lambda n: quiet[n]["growth_recall_30s"] or 0.0, default=None)
    others = [n for n in dets if n != MODEL]
    quietest = min(
        others,
        key=lambda n: (
            dets[n]["at_30s"]["false_alarms"],
            -(dets[n]["growth"]["recall_30s"] or 0.0),
        ),
        default=None,
    )
    return {
        "model": {"false_alarms": fa, "growth_recall_30s": ours},
        "baselines": quiet,
        "best_baseline": best,
        # None when there is nothing to compare: no growth OOMs, or no baseline that quiet
        "model_beats_all": None
        if ours is None or not quiet
        else all(ours > (q["growth_recall_30s"] or 0.0) for q in quiet.values()),
        "quietest_baseline": None
        if quietest is None
        else {
            "name": quietest,
            "false_alarms": dets[quietest]["at_30s"]["false_alarms"],
            "growth_recall_30s": dets[quietest]["growth"]["recall_30s"],
        },
    }


# --- the model's risks at its ticks, for the figures ---------------------------------------
@dataclass
class DomainRisk:
    """One domain of one trace at the network's ticks."""

    trace: str
    cause: str | None
    oom_ts: float | None
    ts: np.ndarray  # (ticks,)
    used: np.ndarray  # (ticks,) the level the model forecasts, as a fraction of capacity
    y: np.ndarray  # (ticks, H) OOM within the horizon
    m: np.ndarray  # (ticks, H) 1 where that is known
    x: np.ndarray | None  # (ticks, features) the embedding at the ticks; dropped once stepped
    samples: list[Sample] | None  # the tick samples; dropped once stepped
    risk: np.ndarray | None = None  # (ticks, horizons of the model)


def trace_domains(trace: Trace, name: str, cause: str | None) -> list[DomainRisk]:
    """The trace's domains at their ticks, labelled by ``sequences_of_trace``."""
    from oomcast.model.embedding import tick_rows
    from oomcast.training.dataset import TICK_S, sequences_of_trace

    seqs = iter(sequences_of_trace(trace, name))
    out = []
    for domain, all_samples in trace.samples.items():
        # the samples sequences_of_trace keeps: up to the OOM, or the job's normal end
        oom_ts = trace.oom_ts(domain)
        end = oom_ts if oom_ts is not None else trace.exit_ts(domain)
        samples = [s for s in all_samples if end is None or s.ts <= end]
        if not samples:
            continue
        seq = next(seqs)
        ticks = [samples[i] for i in tick_rows([s.ts for s in samples], TICK_S)]
        if len(ticks) != len(seq.x):
            raise AssertionError(f"{name}: {len(ticks)} ticks, {len(seq.x)} sequence rows")
        out.append(
            DomainRisk(
                name,
                cause,
                oom_ts,
                np.asarray([s.ts for s in ticks], dtype=np.float64),
                np.asarray([level_frac(s) for s in ticks], dtype=np.float64),
                seq.y,
                seq.m,
                seq.x,
                ticks,
            )
        )
    return out


def step_domains(fc: OnnxForecaster, doms: list[DomainRisk]) -> None:
    """Risks at every tick of every domain: all of them stepped together, one ONNX call per
    tick index, each from its own state (as the service steps a node's domains)."""
    order = sorted(range(len(doms)), key=lambda i: -len(doms[i].ts))
    states = [fc.init_state() for _ in order]
    horizons = fc.horizons_s
    risks = [np.zeros((len(doms[i].ts), len(horizons)), dtype=np.float32) for i in order]
    try:
        n = len(order)
        for k in range(len(doms[order[0]].ts) if order else 0):
            while n and len(doms[order[n - 1]].ts) <= k:
                n -= 1
            active = [doms[order[j]] for j in range(n)]
            forecasts = fc.step(
                states[:n],
                [d.samples[k] for d in active],  # type: ignore[index]
                [d.x[k] for d in active],  # type: ignore[index]
            )
            for j, f in enumerate(forecasts):
                risks[j][k] = [f.risk[h] for h in horizons]
    finally:
        for st in states:
            release_state(fc, st)
    for j, i in enumerate(order):
        doms[i].risk = risks[j]
        doms[i].x = None
        doms[i].samples = None


def model_risks(
    fc: OnnxForecaster, paths: list[Path], causes: Causes
) -> dict[str, list[DomainRisk]]:
    """trace name -> its domains with the model's risks, in batches of domains."""
    out: dict[str, list[DomainRisk]] = {}
    batch: list[DomainRisk] = []
    for path in paths:
        doms = trace_domains(load_trace(path), path.name, causes.of(path))
        out[path.name] = doms
        batch += doms
        if len(batch) >= BATCH_DOMAINS:
            step_domains(fc, batch)
            batch = []
    if batch:
        step_domains(fc, batch)
    return out


def reliability(
    doms: Iterable[DomainRisk], horizons: Sequence[int], bins: int = RELIABILITY_BINS
) -> dict[str, list[dict[str, Any]]]:
    """Per horizon, per risk bin: mean predicted risk, observed share with an OOM within the
    horizon, and how many ticks with a known label fell in it."""
    doms = list(doms)
    edges = np.linspace(0.0, 1.0, bins + 1)
    out = {}
    for k, h in enumerate(horizons):
        col = HORIZONS_S.index(h)  # the labels' column
        known = [d.m[:, col] > 0 for d in doms]
        p = np.concatenate([d.risk[w, k] for d, w in zip(doms, known, strict=True)] or [[]])  # type: ignore[index]
        o = np.concatenate([d.y[w, col] for d, w in zip(doms, known, strict=True)] or [[]])
        which = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
        rows = []
        for b in range(bins):
            sel = which == b
            count = int(sel.sum())
            rows.append(
                {
                    "lo": round(float(edges[b]), 2),
                    "hi": round(float(edges[b + 1]), 2),
                    "mean_predicted": round(float(p[sel].mean()), 4) if count else None,
                    "observed": round(float(o[sel].mean()), 4) if count else None,
                    "count": count,
                }
            )
        out[str(h)] = rows
    return out


# --- figures -------------------------------------------------------------------------------
def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


TITLES = {"corpus_test_10hz": "corpus test programs, 10 Hz", "sim_test_full": "simulated test"}


def plot_reliability(rel: dict[str, dict[str, list[dict[str, Any]]]], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(
        2,
        len(rel),
        figsize=(4.6 * len(rel), 6.4),
        squeeze=False,
        gridspec_kw={"height_ratios": [3, 1.3]},
    )
    for j, (name, per_h) in enumerate(rel.items()):
        top, bottom = axes[0][j], axes[1][j]
        top.plot([0, 1], [0, 1], color="grey", ls=":", lw=1)
        width = 0.1 / (len(per_h) + 1)
        for i, (h, rows) in enumerate(per_h.items()):
            full = [r for r in rows if r["count"]]
            (line,) = top.plot(
                [r["mean_predicted"] for r in full],
                [r["observed"] for r in full],
                marker="o",
                ms=3,
                lw=1,
                label=f"within {h}s",
            )
            bottom.bar(
                [r["lo"] + width * (i + 0.5) for r in full],
                [r["count"] for r in full],
                width=width,
                color=line.get_color(),
                align="edge",
            )
        n = sum(r["count"] for r in next(iter(per_h.values()), []))
        top.set_title(f"{TITLES.get(name, name)} ({n} ticks)", fontsize=9)
        top.set_xlim(0, 1)
        top.set_ylim(-0.02, 1.02)
        top.set_ylabel("observed share with an OOM within h")
        top.legend(fontsize=7, loc="upper left")
        bottom.set_yscale("log")
        bottom.set_xlim(0, 1)
        bottom.set_xlabel("predicted risk (10 bins)")
        bottom.set_ylabel("ticks per bin")
        for ax in (top, bottom):
            ax.tick_params(labelsize=7)
    fig.suptitle("Reliability of the model's risk, by horizon", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


def plot_tto(rows_by_set: dict[str, list[dict[str, Any]]], path: Path) -> None:
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(rows_by_set), figsize=(4.6 * len(rows_by_set), 4.4), squeeze=False
    )
    for ax, (name, rows) in zip(axes[0], rows_by_set.items(), strict=True):
        lo, hi = 1.0, 100.0
        for h in TTO_AT_S:
            pts = [r["tto_at"][str(h)] for r in rows if r["oom"] and str(h) in r["tto_at"]]
            made = [(p["true"], p["predicted"]) for p in pts if p["predicted"] is not None]
            if made:
                true, pred = (np.asarray(v, dtype=np.float64) for v in zip(*made, strict=True))
                pred = np.maximum(pred, 0.5)  # a forecast of 0 s, drawn on the log axis
                errs = np.abs(pred - true) / true
                ax.scatter(
                    true,
                    pred,
                    s=10,
                    alpha=0.6,
                    label=f"{h}s ahead: n={len(made)}, median err {np.median(errs):.0%},"
                    f" null {len(pts) - len(made)}",
                )
                lo = min(lo, float(true.min()), float(pred.min()))
                hi = max(hi, float(true.max()), float(pred.max()))
            else:
                ax.scatter([], [], s=10, label=f"{h}s ahead: no forecast ({len(pts)} null)")
        grid = np.geomspace(lo / 1.5, hi * 1.5, 50)
        ax.plot(grid, grid, color="k", lw=1)
        ax.fill_between(
            grid, 0.75 * grid, 1.25 * grid, color="grey", alpha=0.25, label="within 25%"
        )
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(grid[0], grid[-1])
        ax.set_ylim(grid[0], grid[-1])
        ax.set_xlabel("true time to OOM (s)")
        ax.set_ylabel("predicted time to OOM (s)")
        ax.set_title(TITLES.get(name, name), fontsize=9)
        ax.legend(fontsize=7, loc="upper left")
        ax.tick_params(labelsize=7)
    fig.suptitle("Time to OOM: the model's forecast 60, 30 and 10 s before the OOM", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


@dataclass
class Example:
    label: str
    trace: str
    dom: DomainRisk
    alert_ts: float | None


def _main_domain(doms: list[DomainRisk]) -> DomainRisk | None:
    """The domain that OOMed first, or the one that came closest to its limit."""
    if not doms:
        return None
    ooms = [d for d in doms if d.oom_ts is not None]
    if ooms:
        return min(ooms, key=lambda d: d.oom_ts or 0.0)
    return max(doms, key=lambda d: float(d.used.max()) if len(d.used) else 0.0)


def pick_examples(
    corpus: dict[str, list[DomainRisk]],
    sim: dict[str, list[DomainRisk]],
    runs: dict[str, dict[str, Any]],
    sim_growth: Sequence[str],
    alerts: dict[tuple[str, str], float | None],
) -> list[Example]:
    """Single traces of the held-out programs, one of each shape worth seeing: a leak (any
    growth OOM) after a steady phase, a start-up climb that levels off, a near miss that
    plateaus, a run that exits mid-climb (censored), a sudden OOM; and a simulated growth
    OOM with the simulated OOM-free trace that came closest to its limit."""
    picked: list[tuple[str, str, str]] = []  # (label, set, trace)

    def oom(doms: list[DomainRisk]) -> bool:
        return any(d.oom_ts is not None for d in doms)

    def peak(doms: list[DomainRisk]) -> float:
        return max((float(d.used.max()) for d in doms if len(d.used)), default=0.0)

    def first(kind: str, *, ooms: bool | None = None, cause: str | None = None) -> str | None:
        names = [n for n in sorted(corpus) if corpus[n] and runs.get(n, {}).get("kind") == kind
                 and (ooms is None or oom(corpus[n]) == ooms)
                 and (cause is None or runs[n].get("cause") == cause)]  # fmt: skip
        return names[0] if names else None

    leak = first("oom", ooms=True, cause="leak") or first("oom", ooms=True)
    for label, name in (
        ("leak after a steady phase", leak),
        ("start-up climb that levels off", first("warmup", ooms=False)),
        ("near miss that plateaus", first("near", ooms=False)),
        ("exits mid-climb (censored)", first("censored", ooms=False)),
        ("sudden OOM", first("sudden", ooms=True)),
    ):
        if name is not None:
            cause = runs[name].get("cause", UNKNOWN_CAUSE)
            picked.append((f"{label}, {runs[name]['program']}, {cause}", "corpus_test_10hz", name))
    sim_ooms = [n for n in sorted(sim) if oom(sim[n])]
    sim_growth_ooms = [n for n in sim_ooms if _cause(sim[n]) in sim_growth]
    if sim_growth_ooms:
        n = sim_growth_ooms[0]
        picked.append((f"simulated OOM, {_cause(sim[n])}", "sim_test_full", n))
    sim_ok = [n for n in sorted(sim) if not oom(sim[n]) and sim[n]]
    if sim_ok:
        n = max(sim_ok, key=lambda n: peak(sim[n]))
        picked.append((f"simulated, no OOM, {_cause(sim[n])}", "sim_test_full", n))
    out = []
    for label, where, n in picked:
        dom = _main_domain(corpus[n] if where == "corpus_test_10hz" else sim[n])
        if dom is not None:
            out.append(Example(label, n, dom, alerts.get((where, n))))
    return out


def _cause(doms: list[DomainRisk]) -> str:
    return next((d.cause for d in doms if d.cause), UNKNOWN_CAUSE)


def plot_examples(examples: list[Example], fc: OnnxForecaster, path: Path) -> None:
    plt = _pyplot()
    rule = fc.rule
    k = list(fc.horizons_s).index(rule.horizon_s)
    rows = max(1, len(examples))
    fig, axes = plt.subplots(rows, 1, figsize=(8, 1.75 * rows), squeeze=False)
    for ax, ex in zip(axes[:, 0], examples, strict=False):
        d = ex.dom
        t0 = d.ts[0] if len(d.ts) else 0.0
        ax.plot(d.ts - t0, d.used, color="tab:blue", lw=1, label="level (share of the limit)")
        assert d.risk is not None
        ax.plot(
            d.ts - t0,
            d.risk[:, k],
            color="tab:orange",
            lw=1.3,
            label=f"risk within {rule.horizon_s}s",
        )
        ax.axhline(
            rule.fire_risk, color="grey", ls="--", lw=0.8, label=f"threshold {rule.fire_risk:g}"
        )
        if d.oom_ts is not None:
            ax.axvline(d.oom_ts - t0, color="red", lw=1.5, label="OOM")
        if ex.alert_ts is not None:
            ax.axvline(ex.alert_ts - t0, color="tab:orange", ls=":", lw=1.2, label="model alert")
        ax.set_ylim(-0.02, 1.05)
        ax.set_title(f"{ex.label}: {ex.trace}", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.legend(fontsize=6, loc="lower right", ncol=5)
    axes[-1][0].set_xlabel("seconds since the trace began (model ticks, about 1 Hz)")
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)


# --- the card ------------------------------------------------------------------------------
def _corpus_runs(corpus: Path) -> dict[str, dict[str, Any]]:
    manifest = json.loads((corpus / "manifest.json").read_text(encoding="utf-8"))
    return {Path(r["file"]).name: r for r in manifest.get("runs", [])}


def data_by_source(fc: OnnxForecaster, corpus: Path, sim_test: Path) -> dict[str, Any]:
    """What the model was trained on (its metadata) and what this card judges it on."""
    trained = json.loads(fc.metadata.get("oomcast.trained", "{}"))
    runs = json.loads((corpus / "manifest.json").read_text(encoding="utf-8")).get("runs", [])
    by_split: dict[str, dict[str, Any]] = {}
    for r in runs:
        entry = by_split.setdefault(r["split"], {"runs": 0, "hours": 0.0, "ooms": 0,
                                                 "programs": set(), "kinds": {}})  # fmt: skip
        entry["runs"] += 1
        entry["hours"] += r.get("duration_s", 0.0) / 3600.0
        entry["ooms"] += bool(r.get("oom"))
        entry["programs"].add(r["program"])
        entry["kinds"][r.get("kind", "?")] = entry["kinds"].get(r.get("kind", "?"), 0) + 1
    corpus_out = {
        split: {**e, "hours": round(e["hours"], 2), "programs": sorted(e["programs"])}
        for split, e in sorted(by_split.items())
    }
    return {
        "trained_on": trained.get("data", {}),
        "corpus": {"path": str(corpus), "by_split": corpus_out},
        "sim_test": {"path": str(sim_test), "traces": len(find_traces(sim_test))},
    }


def build(
    model_path: Path | str,
    *,
    sim_test: Path | str,
    corpus: Path | str,
    figures_dir: Path | str,
    out_json: Path | str | None = None,
) -> dict[str, Any]:
    """Measure the model and every baseline on the four sets, draw the three figures under
    ``figures_dir``, and write the numbers to ``out_json`` (when given); returns them."""
    from oomcast.training.dataset import TICK_S
    from oomcast.training.record_corpus import corpus_paths

    started = last = time.monotonic()
    seconds: dict[str, float] = {}

    def lap(what: str) -> None:
        nonlocal last
        now = time.monotonic()
        seconds[what] = round(now - last, 1)
        last = now

    fc = OnnxForecaster(model_path)
    if fc.tick_s != TICK_S:
        raise ValueError(f"{model_path}: ticks every {fc.tick_s}s; the labels assume {TICK_S}s")
    missing = [h for h in fc.horizons_s if h not in HORIZONS_S]
    if missing:
        raise ValueError(f"{model_path}: horizons {missing} have no labels")
    detectors = [Detector(MODEL, fc, fc.rule), *baseline_detectors()]
    corpus, sim_test = Path(corpus), Path(sim_test)
    runs = _corpus_runs(corpus)
    programs = {name: r.get("program", UNKNOWN_CAUSE) for name, r in runs.items()}
    paths = {"corpus": corpus_paths(corpus, "test"), "sim": find_traces(sim_test)}
    growth = {"corpus": tuple(GROWTH_CAUSES), "sim": SIM_GROWTH_FAMILIES}
    sets: dict[str, Any] = {}
    model_rows: dict[str, list[dict[str, Any]]] = {}
    for name, (source, view, resample_s) in SETS.items():
        section, by_det = score_set(
            detectors,
            paths[source],
            growth[source],
            view=view,
            resample_s=resample_s,
            programs=programs if source == "corpus" else None,
        )
        section["source"] = str(corpus if source == "corpus" else sim_test)
        sets[name] = section
        model_rows[name] = by_det[MODEL]
        lap(name)

    causes = Causes()
    risks = {
        "corpus_test_10hz": model_risks(fc, paths["corpus"], causes),
        "sim_test_full": model_risks(fc, paths["sim"], causes),
    }
    lap("model_risks")
    rel = {
        name: reliability((d for doms in risks[name].values() for d in doms), fc.horizons_s)
        for name in FIGURE_SETS
    }
    alerts = {
        (name, r["trace"]): r["first_alert_ts"] for name in FIGURE_SETS for r in model_rows[name]
    }
    examples = pick_examples(
        risks["corpus_test_10hz"], risks["sim_test_full"], runs, SIM_GROWTH_FAMILIES, alerts
    )
    figures_dir = Path(figures_dir)
    figures_dir.mkdir(parents=True, exist_ok=True)
    figures = {key: figures_dir / file for key, file in FIGURES.items()}
    plot_reliability(rel, figures["reliability"])
    plot_tto({name: model_rows[name] for name in FIGURE_SETS}, figures["tto_error"])
    plot_examples(examples, fc, figures["risk_examples"])
    lap("figures")
    seconds["total"] = round(time.monotonic() - started, 1)

    result: dict[str, Any] = {
        "data": data_by_source(fc, corpus, sim_test),
        "model": {
            "path": str(model_path),
            "version": fc.version,
            "rule": {
                "horizon_s": fc.rule.horizon_s,
                "fire_risk": fc.rule.fire_risk,
                "fire_after": fc.rule.fire_after,
            },
            "horizons_s": list(fc.horizons_s),
            "tick_s": fc.tick_s,
        },
        "sets": sets,
        "quietest_baseline_at_model_fa": {name: compare_at_model_fa(s) for name, s in sets.items()},
        "reliability": rel,
        "risk_examples": [
            {"label": e.label, "trace": e.trace, "oom_ts": e.dom.oom_ts, "alert_ts": e.alert_ts}
            for e in examples
        ],
        "figures": {key: str(p) for key, p in figures.items()},
        "seconds": seconds,
    }
    if out_json is not None:
        Path(out_json).parent.mkdir(parents=True, exist_ok=True)
        Path(out_json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result
