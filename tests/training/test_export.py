"""Export to ONNX and serve from ONNX Runtime: parity with torch (risk, time to OOM and
state), metadata, state slots, the time-to-OOM gate. A random network with inflated weights
stands in for a trained one, so its outputs spread over their range; tests/model/
test_runtime.py runs a really trained one through the tick cadence."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from support import sample

from oomcast.model.embedding import EmbeddingState
from oomcast.model.network import NetConfig, OOMForecastNet
from oomcast.model.runtime import ModelLoadError, OnnxForecaster
from oomcast.training.export import export
from oomcast.training.train import ScoredRule, save_checkpoint


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, OOMForecastNet]:
    torch.manual_seed(0)
    net = OOMForecastNet(NetConfig())
    net.set_normalization(
        torch.full((net.cfg.n_features,), 0.3), torch.full((net.cfg.n_features,), 0.5)
    )
    for name, p in net.named_parameters():  # larger weights: risks spread over (0, 1)
        if not name.startswith(("by_projection", "trust")):  # (those would saturate them)
            p.data.mul_(3.0)
    net.eval()
    tmp = tmp_path_factory.mktemp("model")
    save_checkpoint(tmp / "ckpt.pt", net, ScoredRule(60, 0.4, 0.9, 0.95, 0.01), epoch=3)
    path = export(tmp / "ckpt.pt", tmp / "m.onnx", version="test-1")
    return path, net


def ramp(n: int, device: str, slope: float, dt: float = 0.7) -> list:  # type: ignore[type-arg]
    return [
        sample(
            1000.0 + dt * t,
            min(0.995, 0.979 + slope * t),  # at the brink soon: the gate opens
            device=device,
            allocated_bytes=int((0.2 + slope * t / 2) * (80 << 30)),
            alloc_retries=t // 9,
        )
        for t in range(n)
    ]


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("steps", [5, 40])
def test_streaming_onnx_matches_torch_on_the_whole_window(
    model_file: tuple[Path, OOMForecastNet], batch: int, steps: int
) -> None:
    path, net = model_file
    fc = OnnxForecaster(path)
    fc.tto_min_risk = 0.0  # report every time to OOM, to compare them all
    # one sample a second: every sample is a tick, so streaming is the whole window
    seqs = [ramp(steps, f"gpu{b}", 0.004 + 0.002 * b, dt=1.0) for b in range(batch)]
    states = [fc.init_state() for _ in range(batch)]
    streamed = np.zeros((batch, steps, len(fc.horizons_s)))
    ttos = np.zeros((batch, steps))
    for t in range(steps):
        for b, f in enumerate(fc.step(states, [s[t] for s in seqs])):
            streamed[b, t] = [f.risk[h] for h in fc.horizons_s]
            ttos[b, t] = f.time_to_oom_s
    x = np.stack(
        [
            [st.embed(s) for s in seq]
            for seq, st in zip(seqs, [EmbeddingState() for _ in seqs], strict=True)
        ]
    )
    with torch.no_grad():
        full, _ = net(torch.from_numpy(x.astype(np.float32)))
        _, log_tto, _ = net.heads(torch.from_numpy(x.astype(np.float32)))
    assert np.abs(streamed - full.numpy()).max() < 1e-4
    assert np.allclose(ttos, torch.exp(log_tto.clamp(-2.0, 9.0)).numpy(), rtol=1e-4)
    assert streamed.std() > 0.01  # the comparison is not between two constants
    assert all(st.tick_ts == seq[-1].ts for st, seq in zip(states, seqs, strict=True))


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("steps", [5, pytest.param(300, marks=pytest.mark.slow)])
def test_onnx_graph_matches_torch_risk_tto_and_state(
    model_file: tuple[Path, OOMForecastNet], batch: int, steps: int
) -> None:
    path, net = model_file
    fc = OnnxForecaster(path)
    seqs = [ramp(steps, f"gpu{b}", 0.001 + 0.0005 * b) for b in range(batch)]
    x = np.stack([[st.embed(s) for s in seq] for seq, st in ((q, EmbeddingState()) for q in seqs)])
    x = x.astype(np.float32)
    zero = np.zeros((net.cfg.layers, batch, net.cfg.hidden), np.float32)
    onnx_risk, onnx_tto, h, c = fc.session.run(None, {"x": x, "h": zero, "c": zero})
    assert [o.name for o in fc.session.get_outputs()] == ["risk", "tto_s", "h_out", "c_out"]
    with torch.no_grad():
        torch_risk, (th, tc) = net(torch.from_numpy(x))
        _, log_tto, _ = net.heads(torch.from_numpy(x))
    assert onnx_tto.shape == (batch, steps)
    assert np.abs(onnx_risk - torch_risk.numpy()).max() < 1e-4
    assert np.allclose(onnx_tto, torch.exp(log_tto.clamp(-2.0, 9.0)).numpy(), rtol=1e-4)
    assert np.abs(h - th.numpy()).max() < 1e-4
    # c is unbounded (|c| reaches the hundreds with these inflated weights): relative there
    assert np.allclose(c, tc.numpy(), rtol=1e-5, atol=1e-4)
    assert onnx_risk.std() > 0.01


@pytest.mark.parametrize("batch", [1, 7])
def test_window_equals_streaming_when_samples_come_faster_than_ticks(
    model_file: tuple[Path, OOMForecastNet], batch: int
) -> None:
    path, _ = model_file
    fc = OnnxForecaster(path)
    # 0.7 s apart: some samples are ticks, the ones in between are not
    seqs = [ramp(120, f"gpu{b}", 0.001 + 0.0005 * b) for b in range(batch)]
    states = [fc.init_state() for _ in range(batch)]
    streamed = [[] for _ in range(batch)]  # type: ignore[var-annotated]
    for t in range(120):
        for b, f in enumerate(fc.step(states, [s[t] for s in seqs])):
            streamed[b].append([f.risk[hz] for hz in fc.horizons_s])
    live = fc._h[:, states[0].index].copy()
    free = len(fc._free)
    for b, seq in enumerate(seqs):
        windowed = [[f.risk[hz] for hz in fc.horizons_s] for f in fc.window(seq)]
        assert np.abs(np.asarray(windowed) - np.asarray(streamed[b])).max() < 1e-5
    # the window ran on a slot of its own and gave it back; live state is untouched
    assert np.array_equal(fc._h[:, states[0].index], live) and len(fc._free) == free
    # and it is not the same as ticking on every sample
    x = np.stack([[st.embed(s) for s in q] for q, st in ((q, EmbeddingState()) for q in seqs)])
    zero = np.zeros((fc.layers, batch, fc.hidden), np.float32)
    every, _, _, _ = fc.session.run(None, {"x": x.astype(np.float32), "h": zero, "c": zero})
    assert np.abs(every - np.asarray(streamed)).max() > 1e-3


def test_node_embeddings_are_used_when_given(model_file: tuple[Path, OOMForecastNet]) -> None:
    path, _ = model_file
    fc = OnnxForecaster(path)
    seq = ramp(6, "gpu0", 0.01)
    a, b, c = fc.init_state(), fc.init_state(), fc.init_state()
    emb = EmbeddingState()
    for s in seq:
        local = fc.step([a], [s])[0]
        vec = emb.embed(s)
        given = fc.step([b], [s], [vec])[0]
        assert local.risk == pytest.approx(given.risk, abs=1e-6)
        # a different vector changes the forecast: the node's embedding is really read
        other = fc.step([c], [s], [[v + 1.0 for v in vec]])[0]
        assert other.risk != pytest.approx(given.risk, abs=1e-3)


def test_metadata_rule_and_slots(model_file: tuple[Path, OOMForecastNet]) -> None:
    path, _ = model_file
    fc = OnnxForecaster(path)
    assert fc.version == "test-1"
    assert fc.rule.horizon_s == 60 and fc.rule.fire_risk == 0.4
    assert fc.provider == "CPUExecutionProvider"
    slots = [fc.init_state() for _ in range(150)]  # grows past the first 64
    assert len({s.index for s in slots}) == 150
    fc.release(slots[3])
    assert fc.init_state().index == slots[3].index
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert set(meta) >= {"oomcast.version", "oomcast.rule", "oomcast.features"}
    # the tick the network was trained at, and where a time to OOM starts being reported:
    # the rule's threshold, at most one half
    assert meta["oomcast.tick_s"] == "1.0" and fc.tick_s == 1.0
    assert float(meta["oomcast.tto_min_risk"]) == pytest.approx(0.4) and fc.tto_min_risk == 0.4


def test_an_older_file_without_tick_or_tto_floor_gets_the_defaults(
    model_file: tuple[Path, OOMForecastNet], tmp_path: Path
) -> None:
    model = onnx.load(str(model_file[0]))
    keep = [
        p for p in model.metadata_props if p.key not in ("oomcast.tick_s", "oomcast.tto_min_risk")
    ]
    del model.metadata_props[:]
    model.metadata_props.extend(keep)
    onnx.save(model, str(tmp_path / "older.onnx"))
    fc = OnnxForecaster(tmp_path / "older.onnx")
    assert fc.tick_s == 1.0 and fc.tto_min_risk == fc.rule.fire_risk == 0.4


def test_a_high_threshold_caps_the_tto_floor_at_one_half(tmp_path: Path) -> None:
    net = OOMForecastNet(NetConfig(embed_dim=8, hidden=16, layers=1, tick_s=2.0))
    save_checkpoint(tmp_path / "ckpt.pt", net, ScoredRule(30, 0.9, 0.5, 0.5, 0.0))
    meta = {
        p.key: p.value
        for p in onnx.load(
            str(export(tmp_path / "ckpt.pt", tmp_path / "m.onnx", version="v"))
        ).metadata_props
    }
    assert float(meta["oomcast.tto_min_risk"]) == 0.5 and meta["oomcast.tick_s"] == "2.0"
    fc = OnnxForecaster(tmp_path / "m.onnx")
    assert fc.tick_s == 2.0 and fc.hidden == 16 and fc.layers == 1


def test_time_to_oom_is_reported_only_when_the_longest_horizon_risk_reaches_the_floor(
    model_file: tuple[Path, OOMForecastNet],
) -> None:
    path, _ = model_file
    fc = OnnxForecaster(path)
    seqs = [ramp(60, f"gpu{b}", 0.002 + 0.003 * b, dt=1.0) for b in range(6)]
    x = np.stack([[st.embed(s) for s in q] for q, st in ((q, EmbeddingState()) for q in seqs)])
    zero = np.zeros((fc.layers, 6, fc.hidden), np.float32)
    risk, tto, _, _ = fc.session.run(None, {"x": x.astype(np.float32), "h": zero, "c": zero})
    last = risk[..., -1]
    fc.tto_min_risk = float(np.median(last))  # half the forecasts below, half above
    states = [fc.init_state() for _ in range(6)]
    got = [fc.step(states, [q[t] for q in seqs]) for t in range(60)]
    reported = 0
    for t, forecasts in enumerate(got):
        for b, f in enumerate(forecasts):
            if f.risk[fc.horizons_s[-1]] < fc.tto_min_risk:
                assert f.time_to_oom_s is None
            else:
                assert f.time_to_oom_s == pytest.approx(float(tto[b, t]), rel=1e-4)
                reported += 1
    assert 0 < reported < 6 * 60
    assert np.unique(np.round(tto, 3)).size > 10  # the head says different things


def test_bad_model_files_are_refused_with_a_reason(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="no model file"):
        OnnxForecaster(tmp_path / "missing.onnx")
    junk = tmp_path / "junk.onnx"
    junk.write_bytes(b"not a model")
    with pytest.raises(ModelLoadError, match="cannot load"):
        OnnxForecaster(junk)


def test_wrong_embedding_version_is_refused(
    model_file: tuple[Path, OOMForecastNet], tmp_path: Path
) -> None:
    model = onnx.load(str(model_file[0]))
    for p in model.metadata_props:
        if p.key == "oomcast.embedding_version":
            p.value = "1"
    onnx.save(model, str(tmp_path / "old.onnx"))
    with pytest.raises(ModelLoadError, match="embedding v1"):
        OnnxForecaster(tmp_path / "old.onnx")


def test_cuda_is_asked_for_first_and_the_provider_reported_is_the_one_running(
    model_file: tuple[Path, OOMForecastNet], monkeypatch: pytest.MonkeyPatch
) -> None:
    import onnxruntime as ort

    asked: list[list[str]] = []
    real_session = ort.InferenceSession

    def session(path: str, options: object, providers: list[str]) -> object:
        asked.append(list(providers))
        # the CPU build cannot run CUDA: it runs on what it has, as a GPU-less node would
        return real_session(path, options, providers=["CPUExecutionProvider"])

    monkeypatch.setattr(
        ort, "get_available_providers", lambda: ["CUDAExecutionProvider", "CPUExecutionProvider"]
    )
    monkeypatch.setattr(ort, "InferenceSession", session)
    fc = OnnxForecaster(model_file[0])
    assert asked == [["CUDAExecutionProvider", "CPUExecutionProvider"]]
    assert fc.provider == "CPUExecutionProvider"
