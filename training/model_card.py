"""The shipped model's card (``oomcast card``): figures and tables measured on held-out traces.

Everything here is computed from the ONNX file itself (served exactly as the service serves
it) on traces the model never trained on: the simulated test split, and the recorded host
traces, all of them and the held-out half (odd seeds) apart. Risks come from the stateless
window path, which the parity tests hold equal to streaming within 1e-4.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from oomcast.model.runtime import OnnxForecaster
from oomcast.model.trace import find_traces, load_trace
from oomcast.training.train import first_run


@dataclass
class TraceRisk:
    name: str
    family: str
    ooms: bool
    # per domain: sample ts, risk (time, H), OOM ts or None
    domains: list[tuple[np.ndarray, np.ndarray, float | None]]


def trace_risks(fc: OnnxForecaster, paths: list[Path], families: dict[str, str]) -> list[TraceRisk]:
    out = []
    for path in paths:
        trace = load_trace(path)
        domains = []
        for domain, samples in trace.samples.items():
            oom = trace.oom_ts(domain)
            kept = [s for s in samples if oom is None or s.ts < oom]
            if not kept:
                continue
            risk = np.asarray(
                [[f.risk[h] for h in fc.horizons_s] for f in fc.window(kept)], dtype=np.float64
            )
            domains.append((np.asarray([s.ts for s in kept]), risk, oom))
        out.append(TraceRisk(path.name, families.get(path.name, "-"), trace.ooms, domains))
    return out


def lead_of(tr: TraceRisk, k: int, threshold: float, fire_after: int = 1) -> float | None:
    """The model's lead on an OOM trace (None: no alert before the OOM), as evaluate counts it:
    the alert is the sample completing ``fire_after`` consecutive samples at the threshold."""
    best = None
    for ts, risk, oom in tr.domains:
        if oom is None:
            continue
        at = first_run(risk[:, k] >= threshold, fire_after)
        if at is not None:
            lead = oom - ts[at]
            best = lead if best is None else max(best, lead)
    return best


def alarmed(tr: TraceRisk, k: int, threshold: float, fire_after: int = 1) -> bool:
    return any(
        first_run(risk[:, k] >= threshold, fire_after) is not None for _, risk, _ in tr.domains
    )


def family_table(
    trs: list[TraceRisk], k: int, threshold: float, fire_after: int = 1
) -> list[dict[str, Any]]:
    rows: dict[str, dict[str, Any]] = defaultdict(
        lambda: {"oom": 0, "lead10": 0, "lead30": 0, "ok": 0, "false_alarms": 0}
    )
    for tr in trs:
        row = rows[tr.family]
        if tr.ooms:
            lead = lead_of(tr, k, threshold, fire_after)
            row["oom"] += 1
            row["lead10"] += int(lead is not None and lead >= 10)
            row["lead30"] += int(lead is not None and lead >= 30)
        else:
            row["ok"] += 1
            row["false_alarms"] += int(alarmed(tr, k, threshold, fire_after))
    return [{"family": f, **rows[f]} for f in sorted(rows)]


def calibration(
    trs: list[TraceRisk], horizons: tuple[int, ...], bins: int = 10
) -> dict[int, list[tuple[float, float, int]]]:
    """Per horizon: (mean predicted risk, observed share with an OOM within it, count) per
    risk bin, over every sample whose outcome is known."""
    out = {}
    for k, h in enumerate(horizons):
        pred, obs = [], []
        for tr in trs:
            for ts, risk, oom in tr.domains:
                if oom is None:
                    known = ts <= ts[-1] - h  # the trace ran at least h on, OOM-free
                    pred.append(risk[known, k])
                    obs.append(np.zeros(int(known.sum())))
                else:
                    pred.append(risk[:, k])
                    obs.append((oom - ts <= h).astype(np.float64))
        p, o = np.concatenate(pred), np.concatenate(obs)
        edges = np.linspace(0, 1, bins + 1)
        which = np.clip(np.digitize(p, edges) - 1, 0, bins - 1)
        out[h] = [
            (float(p[which == b].mean()), float(o[which == b].mean()), int((which == b).sum()))
            for b in range(bins)
            if (which == b).any()
        ]
    return out


def plot(
    fc: OnnxForecaster,
    sim: list[TraceRisk],
    host: list[TraceRisk],
    k: int,
    threshold: float,
    out_dir: Path,
    fire_after: int = 1,
) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    horizon = fc.horizons_s[k]

    # 1. lead-time distribution on OOM traces
    fig, ax = plt.subplots(figsize=(7, 3.5))
    for label, trs in (("simulated test split", sim), ("recorded host traces", host)):
        leads = [lead_of(t, k, threshold, fire_after) for t in trs if t.ooms]
        caught = [v for v in leads if v is not None]
        ax.hist(
            np.clip(caught, 0, 600),
            bins=np.arange(0, 620, 20),
            alpha=0.6,
            label=f"{label}: {len(caught)}/{len(leads)} alerted before the OOM",
        )
    for x in (10, 30):
        ax.axvline(x, color="k", ls=":", lw=1)
    ax.set_xlabel("lead: seconds from the first alert to the OOM (clipped at 600)")
    ax.set_ylabel("OOM traces")
    ax.set_title(f"Lead time (alert: risk within {horizon}s >= {threshold:g})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "model-lead-times.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 2. risk over time on example traces, the OOM marked
    examples = _examples(sim, host)
    fig, axes = plt.subplots(len(examples), 1, figsize=(8, 1.9 * len(examples)), sharex=False)
    for ax, tr in zip(np.atleast_1d(axes), examples, strict=True):
        ts, risk, oom = max(tr.domains, key=lambda d: d[2] is not None)
        t = ts - ts[0]
        for j, h in enumerate(fc.horizons_s):
            if h in (15, 60, 300) or j == k:
                ax.plot(t, risk[:, j], lw=1.4 if j == k else 0.8, label=f"risk within {h}s")
        ax.axhline(threshold, color="grey", ls="--", lw=0.8)
        if oom is not None:
            ax.axvline(oom - ts[0], color="red", lw=1.5, label="OOM")
        ax.set_ylim(-0.02, 1.02)
        ax.set_title(f"{tr.name} ({tr.family}{', OOM' if tr.ooms else ', no OOM'})", fontsize=9)
        ax.tick_params(labelsize=7)
    np.atleast_1d(axes)[0].legend(fontsize=7, ncol=5, loc="upper left")
    np.atleast_1d(axes)[-1].set_xlabel("seconds since the trace began")
    fig.tight_layout()
    written.append(out_dir / "model-risk-examples.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)

    # 3. calibration
    fig, ax = plt.subplots(figsize=(4.5, 4.5))
    ax.plot([0, 1], [0, 1], color="grey", ls=":", lw=1)
    for h, rows in calibration(sim, fc.horizons_s).items():
        if h in (15, 60, 300) or h == horizon:
            ax.plot([r[0] for r in rows], [r[1] for r in rows], marker="o", ms=3, label=f"{h}s")
    ax.set_xlabel("predicted risk")
    ax.set_ylabel("observed share with an OOM within the horizon")
    ax.set_title("Calibration, simulated test split", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(out_dir / "model-calibration.png")
    fig.savefig(written[-1], dpi=110)
    plt.close(fig)
    return written


def _examples(sim: list[TraceRisk], host: list[TraceRisk]) -> list[TraceRisk]:
    picked = []
    for fam in ("leak", "eval_no_grad", "neighbour", "plateau", "spikes"):
        cands = [t for t in sim if t.family == fam]
        if cands:
            picked.append(cands[0])
    host_oom = [t for t in host if t.ooms]
    if host_oom:
        picked.append(host_oom[0])
    return picked


def build(
    model: Path | str,
    sim_test: Path | str,
    host_dir: Path | str,
    out_dir: Path | str,
) -> dict[str, Any]:
    """Figures under ``out_dir`` and the figures' numbers, for the card."""
    from oomcast.training.dataset import host_split

    fc = OnnxForecaster(model)
    k = list(fc.horizons_s).index(fc.rule.horizon_s)
    thr = fc.rule.fire_risk
    after = fc.rule.fire_after
    manifest = json.loads((Path(sim_test).parent / "manifest.json").read_text())
    fams = {Path(r["file"]).name: r["family"] for r in manifest["traces"]}
    runs = json.loads((Path(host_dir) / "manifest.json").read_text())["runs"]
    fams.update({r["file"]: r["scenario"] for r in runs})
    sim = trace_risks(fc, find_traces(sim_test), fams)
    _, held_out = host_split(host_dir)
    host = trace_risks(fc, find_traces(host_dir), fams)
    held = {p.name for p in held_out}
    figures = plot(fc, sim, host, k, thr, Path(out_dir), after)
    leads = [v for t in sim if t.ooms and (v := lead_of(t, k, thr, after)) is not None]
    return {
        "rule": {"horizon_s": fc.rule.horizon_s, "fire_risk": thr, "fire_after": after},
        "sim_families": family_table(sim, k, thr, after),
        "host_families": family_table(host, k, thr, after),
        "host_held_out": family_table([t for t in host if t.name in held], k, thr, after),
        "sim_median_lead_s": statistics.median(leads) if leads else None,
        "calibration": {str(h): v for h, v in calibration(sim, fc.horizons_s).items()},
        "figures": [str(p) for p in figures],
        "metadata": fc.metadata,
    }
