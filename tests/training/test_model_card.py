"""training/model_card.py: the card's numbers are counted as evaluate counts them."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from support import leak_trace, steady_trace, write

from oomcast.model.embedding import EmbeddingState
from oomcast.model.forecast import AlertRule, Detector
from oomcast.model.network import NetConfig, OOMForecastNet
from oomcast.model.runtime import OnnxForecaster
from oomcast.model.schema import Sample
from oomcast.training.evaluate import evaluate
from oomcast.training.export import export
from oomcast.training.model_card import (
    alarmed,
    build,
    calibration,
    family_table,
    lead_of,
    trace_risks,
)
from oomcast.training.train import Rule, save_checkpoint

HOST = Path(__file__).resolve().parents[2] / "training" / "traces" / "host"


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    tmp = tmp_path_factory.mktemp("card")
    torch.manual_seed(3)
    net = OOMForecastNet(NetConfig())
    # normalized by the traces' own spread, so the untrained network's risk moves with them
    probe = [leak_trace(seconds_to_oom=200), steady_trace(level=0.7, seconds=400)]
    x = np.asarray(
        [EmbeddingState().embed(r) for recs in probe for r in recs if isinstance(r, Sample)]
    )
    net.set_normalization(torch.from_numpy(x.mean(0)).float(), torch.from_numpy(x.std(0)).float())
    for p in net.parameters():
        p.data.mul_(2.0)
    save_checkpoint(tmp / "c.pt", net, Rule(60, 0.3, 0, 0, 0), epoch=1)
    model = export(tmp / "c.pt", tmp / "m.onnx", version="card-test")
    sim = tmp / "sim"
    entries = []
    for i in range(4):
        name = f"test/{i:05d}-{'leak' if i % 2 == 0 else 'steady'}.jsonl.gz"
        recs = (
            leak_trace(seconds_to_oom=200 + 50 * i, device=f"gpu{i}", seed=i)
            if i % 2 == 0
            else steady_trace(level=0.6 + 0.1 * i, seconds=400, device=f"gpu{i}")
        )
        write(sim / name, recs)
        entries.append({"file": name, "family": "leak" if i % 2 == 0 else "steady"})
    (sim / "manifest.json").write_text(json.dumps({"traces": entries}))
    return model, sim


def test_card_writes_figures_and_covers_every_trace(
    setup: tuple[Path, Path], tmp_path: Path
) -> None:
    model, sim = setup
    result = build(model, sim / "test", HOST, tmp_path / "fig")
    for png in result["figures"]:
        assert Path(png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert result["rule"] == {"horizon_s": 60, "fire_risk": 0.3, "fire_after": 1}
    fams = {row["family"]: row for row in result["sim_families"]}
    assert fams["leak"]["oom"] == 2 and fams["steady"]["ok"] == 2
    host_total = sum(r["oom"] + r["ok"] for r in result["host_families"])
    held = sum(r["oom"] + r["ok"] for r in result["host_held_out"])
    assert host_total == len(json.loads((HOST / "manifest.json").read_text())["runs"])
    assert 0 < held < host_total


def test_card_counts_agree_with_evaluate_streaming(setup: tuple[Path, Path]) -> None:
    model, sim = setup
    fc = OnnxForecaster(model)
    paths = sorted((sim / "test").glob("*.jsonl.gz"))
    fams = {p.name: ("leak" if "leak" in p.name else "steady") for p in paths}
    trs = trace_risks(fc, paths, fams)
    k = list(fc.horizons_s).index(60)
    every = np.concatenate([r[:, k] for t in trs for _, r, _ in t.domains])
    partial = 0
    for q in (0.3, 0.6, 0.8, 0.95):
        thr = float(np.quantile(every, q))
        for after in (1, 2, 3):
            rows = {r["family"]: r for r in family_table(trs, k, thr, after)}
            det = Detector("model", fc, AlertRule(60, thr, after))
            for lead in (10, 30):
                got = evaluate([det], paths, min_lead_s=lead)["detectors"]["model"]
                caught = rows["leak"]["lead10" if lead == 10 else "lead30"]
                assert round(got["recall"] * got["oom_traces"]) == caught, (q, after, lead)
                assert got["false_alarms"] == rows["steady"]["false_alarms"], (q, after)
                partial += 0 < caught < 2 or 0 < rows["steady"]["false_alarms"] < 2
    # the comparison is not all-or-nothing everywhere: some rules split the traces
    assert partial > 0


def test_leads_alarms_and_calibration_by_hand(setup: tuple[Path, Path]) -> None:
    model, sim = setup
    fc = OnnxForecaster(model)
    (tr,) = trace_risks(fc, [sorted((sim / "test").glob("*leak*"))[0]], {})
    ts, risk, oom = tr.domains[0]
    assert oom is not None and ts[-1] < oom
    k = 3
    thr = float(np.quantile(risk[:, k], 0.5))
    first = int(np.flatnonzero(risk[:, k] >= thr)[0])
    assert lead_of(tr, k, thr) == pytest.approx(oom - ts[first])
    assert lead_of(tr, k, 1.01) is None and alarmed(tr, k, thr) and not alarmed(tr, k, 1.01)
    cal = calibration([tr], fc.horizons_s, bins=5)
    for h, rows in cal.items():
        assert sum(n for _, _, n in rows) == len(ts)
        # every sample of this trace comes before its OOM: observed shares are what the
        # horizon says
        expect = float(np.mean(oom - ts <= h))
        got = sum(o * n for _, o, n in rows) / len(ts)
        assert got == pytest.approx(expect)
