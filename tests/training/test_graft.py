"""training/graft.py: a model exported on an earlier schema, carried to today's schema and
served graph with its network untouched, gives exactly what today's export of the same
network gives, and says where it came from."""

from __future__ import annotations

import hashlib
import json
import math
import warnings
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from torch import nn

from oomcast.model.embedding import EMBEDDING_VERSION, FEATURES, EmbeddingState
from oomcast.model.network import (
    STRAIGHT,
    NetConfig,
    OOMForecastNet,
    SequenceModule,
    evidence_gate,
)
from oomcast.model.runtime import OnnxForecaster
from oomcast.model.schema import Sample
from oomcast.training.graft import graft, main

OLD = len(FEATURES) - 3  # embedding v6: today's schema without its last three features


class _BeforeTheLine(nn.Module):
    """The served graph as exported before the straight line: calibrated risk through the
    gate, the network's own time to OOM."""

    def __init__(self, net: OOMForecastNet) -> None:
        super().__init__()
        self.net = net

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        log_s, log_tto, (h2, c2) = self.net.heads(x, (h, c))
        risk = self.net.calibrated(log_s) * evidence_gate(x, self.net.cfg.horizons_s)
        return risk, torch.exp(log_tto.clamp(-2.0, 9.0)), h2, c2


@pytest.fixture(scope="module")
def old_model(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, OOMForecastNet]:
    torch.manual_seed(4)
    net = OOMForecastNet(NetConfig(n_features=OLD, embedding_version=6))
    net.set_normalization(torch.full((OLD,), 0.3), torch.full((OLD,), 0.5))
    net.eval()
    path = tmp_path_factory.mktemp("old") / "old.onnx"
    x, h = torch.zeros(2, 3, OLD), torch.zeros(2, 2, 64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            _BeforeTheLine(net), (x, h, h.clone()), str(path),
            input_names=["x", "h", "c"], output_names=["risk", "tto_s", "h_out", "c_out"],
            dynamic_axes={"x": {0: "batch", 1: "time"}, "h": {1: "batch"}, "c": {1: "batch"},
                          "risk": {0: "batch", 1: "time"}, "tto_s": {0: "batch", 1: "time"},
                          "h_out": {1: "batch"}, "c_out": {1: "batch"}},
            opset_version=17, dynamo=False,
        )  # fmt: skip
    model = onnx.load(str(path))
    meta = {
        "oomcast.version": "old-1",
        "oomcast.horizons_s": json.dumps(list(net.cfg.horizons_s)),
        "oomcast.embedding_version": "6",
        "oomcast.features": json.dumps(list(FEATURES[:OLD])),
        "oomcast.layers": "2",
        "oomcast.hidden": "64",
        "oomcast.rule": json.dumps({"horizon_s": 45, "threshold": 0.3}),
        "oomcast.tick_s": "1.0",
        "oomcast.tto_min_risk": "0.3",
    }
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(path))
    return path, net


def _sample(t: int, level: float) -> Sample:
    total = 16 << 30
    used = int(level * total)
    return Sample(1_900_000_000.0 + t, "n", "gpu0", "gpu", total, used, peak_bytes=used)


def _embedded(levels: list[float]) -> np.ndarray:
    emb = EmbeddingState()
    return np.asarray([emb.embed(_sample(t, v)) for t, v in enumerate(levels)], np.float32)


def test_the_grafted_model_is_todays_export_of_the_same_network(
    old_model: tuple[Path, OOMForecastNet], tmp_path: Path
) -> None:
    path, net = old_model
    out = graft(path, tmp_path / "new.onnx", "new-1")
    fc = OnnxForecaster(out)  # loads: today's schema, and the metadata it needs
    assert fc.version == "new-1" and fc.embedding_version == EMBEDDING_VERSION
    # a straight one-minute leak (the line fires from 30 s), a flat line and a climb that
    # slows down, as one batch
    x = np.stack([
        _embedded([t / 60.0 for t in range(50)]),
        _embedded([0.5] * 50),
        _embedded([0.02 + 0.9 * (1 - math.exp(-t / 20.0)) for t in range(50)]),
    ])  # fmt: skip
    h = np.zeros((2, 3, 64), np.float32)
    risk, tto, h2, _ = fc.session.run(None, {"x": x, "h": h, "c": h})
    with torch.no_grad():
        want = SequenceModule(net)(torch.from_numpy(x), torch.from_numpy(h), torch.from_numpy(h))
    assert np.allclose(risk, want[0].numpy(), atol=1e-5)
    assert np.allclose(tto, want[1].numpy(), rtol=1e-4)
    assert np.allclose(h2, want[2].numpy(), atol=1e-5)
    assert risk[0, 35, fc.horizons_s.index(45)] > 0.99  # the leak, 25 s before its OOM
    # the old file, fed the features it knew, gives the network's risk; the line only adds
    import onnxruntime as ort

    before, *_ = ort.InferenceSession(str(path)).run(None, {"x": x[..., :OLD], "h": h, "c": h})
    assert (risk >= before - 1e-6).all() and (risk > before + 1e-3).any()
    meta = fc.metadata
    assert json.loads(meta["oomcast.straight"]) == STRAIGHT
    grafted = json.loads(meta["oomcast.grafted"])
    assert grafted == {
        "from_version": "old-1",
        "from_sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "from_embedding_version": 6,
        "network_features": OLD,
    }
    assert json.loads(meta["oomcast.rule"]) == {"horizon_s": 45, "threshold": 0.3}


def test_todays_export_of_an_earlier_schemas_network_is_the_grafted_file(
    old_model: tuple[Path, OOMForecastNet], tmp_path: Path
) -> None:
    from oomcast.training.export import export
    from oomcast.training.train import ScoredRule, save_checkpoint

    path, net = old_model
    save_checkpoint(tmp_path / "c.pt", net, ScoredRule(45, 0.3, 0.9, 0.95, 0.01), epoch=1)
    exported = OnnxForecaster(export(tmp_path / "c.pt", tmp_path / "e.onnx", version="e-1"))
    grafted = OnnxForecaster(graft(path, tmp_path / "g.onnx", "g-1"))
    assert exported.n_features == grafted.n_features == len(FEATURES)  # x: today's schema
    x = _embedded([t / 60.0 for t in range(45)])[None]
    h = np.zeros((2, 1, 64), np.float32)
    a = exported.session.run(None, {"x": x, "h": h, "c": h})
    b = grafted.session.run(None, {"x": x, "h": h, "c": h})
    assert all(np.allclose(u, v, atol=1e-5) for u, v in zip(a, b, strict=True))
    assert json.loads(exported.metadata["oomcast.straight"]) == STRAIGHT
    # an export of today's schema is refused by the graft: it has the line already
    with pytest.raises(ValueError, match="already has the straight-line tail"):
        graft(tmp_path / "e.onnx", tmp_path / "x.onnx", "x-1")


def test_a_model_grafted_already_recalibrated_or_of_another_schema_is_refused(
    old_model: tuple[Path, OOMForecastNet], tmp_path: Path
) -> None:
    path, _ = old_model
    once = graft(path, tmp_path / "once.onnx", "new-1")
    with pytest.raises(ValueError, match="already has the straight-line tail"):
        graft(once, tmp_path / "twice.onnx", "new-2")
    model = onnx.load(str(path))
    entry = model.metadata_props.add()
    entry.key, entry.value = "oomcast.recalibration", "{}"
    onnx.save(model, str(tmp_path / "recal.onnx"))
    with pytest.raises(ValueError, match="recalibration fitted on the network's risk alone"):
        graft(tmp_path / "recal.onnx", tmp_path / "r.onnx", "new-4")
    model = onnx.load(str(path))
    for p in model.metadata_props:
        if p.key == "oomcast.features":
            p.value = json.dumps(["level_frac", *FEATURES[1:OLD]])
    foreign = tmp_path / "foreign.onnx"
    onnx.save(model, str(foreign))
    with pytest.raises(ValueError, match="not a prefix of today's schema"):
        graft(foreign, tmp_path / "x.onnx", "new-3")
    assert not (tmp_path / "x.onnx").exists() and not (tmp_path / "twice.onnx").exists()


def test_the_command_writes_the_file_and_says_so(
    old_model: tuple[Path, OOMForecastNet], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path, _ = old_model
    assert main([str(path), "--version", "cli-1", "--out", str(tmp_path / "m.onnx")]) == 0
    assert f"cli-1, embedding v{EMBEDDING_VERSION}" in capsys.readouterr().out
    assert OnnxForecaster(tmp_path / "m.onnx").version == "cli-1"


def test_a_model_of_the_earlier_schema_still_loads_and_reads_its_own_features(
    old_model: tuple[Path, OOMForecastNet], tmp_path: Path
) -> None:
    """A service upgraded to today's schema keeps serving a v6 file it was given (a shadow,
    a fleet recalibration): fed today's vectors cut to the 45 it knows, as it was exported;
    a schema that is not a known prefix of today's is refused by name."""
    import onnxruntime as ort

    from oomcast.model.runtime import ModelLoadError

    path, _ = old_model
    fc = OnnxForecaster(path)
    assert fc.trained_embedding_version == 6 and fc.embedding_version == EMBEDDING_VERSION
    levels = [t / 60.0 for t in range(50)]
    state = fc.init_state()
    got = [fc.step([state], [_sample(t, v)])[0] for t, v in enumerate(levels)]
    x = _embedded(levels)[None, :, :OLD]
    h = np.zeros((2, 1, 64), np.float32)
    want, *_ = ort.InferenceSession(str(path)).run(None, {"x": x, "h": h, "c": h})
    assert np.allclose([f.risk_at(45) for f in got], want[0, :, 3], atol=1e-5)
    model = onnx.load(str(path))
    for p in model.metadata_props:
        if p.key == "oomcast.embedding_version":
            p.value = "5"
    older = tmp_path / "v5.onnx"
    onnx.save(model, str(older))
    with pytest.raises(ModelLoadError, match="trained on embedding v5; this oomcast computes v7"):
        OnnxForecaster(older)


def test_an_earlier_schemas_model_takes_the_nodes_vectors_for_many_domains_at_once(
    old_model: tuple[Path, OOMForecastNet],
) -> None:
    """The service hands a batch of domains with the embeddings their nodes sent (today's
    schema, which ``embedding_version`` says the model reads): the same forecasts as when the
    forecaster computes them itself, each row cut to the network's 45."""
    from oomcast.model.forecast import embedding_version

    path, _ = old_model
    fc = OnnxForecaster(path)
    assert embedding_version(fc) == EMBEDDING_VERSION  # so decode keeps the nodes' vectors
    curves = [[t / 60.0 for t in range(40)], [0.5] * 40, [0.2 + t / 200.0 for t in range(40)]]
    nodes = [EmbeddingState() for _ in curves]
    sent, local = [fc.init_state() for _ in curves], [fc.init_state() for _ in curves]
    for t in range(40):
        batch = [_sample(t, c[t]) for c in curves]
        rows = [e.embed(s) for e, s in zip(nodes, batch, strict=True)]
        _, with_rows, _ = fc.step_arrays(sent, batch, rows)
        _, computed, _ = fc.step_arrays(local, batch)
        assert np.allclose(with_rows, computed, atol=1e-6), t


def test_an_earlier_schemas_model_serves_a_window_and_a_recalibration_run(
    old_model: tuple[Path, OOMForecastNet],
) -> None:
    """``POST /v1/predict``'s stateless path and ``oomcast recalibrate``'s pass over whole
    sequences feed today's vectors too: both cut them to the network's width."""
    from types import SimpleNamespace

    from oomcast.training.recalibrate import network_risks

    path, _ = old_model
    fc = OnnxForecaster(path)
    samples = [_sample(t, t / 60.0) for t in range(40)]
    stepped = fc.window(samples)[-1]
    assert fc.window_last(samples).risk == pytest.approx(stepped.risk, abs=1e-5)
    seq = SimpleNamespace(x=_embedded([t / 60.0 for t in range(40)]))  # 48 wide
    (risk,) = network_risks(fc, [seq])  # type: ignore[list-item]
    assert risk.shape == (40, len(fc.horizons_s))
