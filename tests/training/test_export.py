"""Export to ONNX and serve from ONNX Runtime: parity with torch, metadata, state slots."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
import torch
from support import sample

from oomcast.model.embedding import EmbeddingState
from oomcast.model.network import NetConfig, OOMForecastNet
from oomcast.model.runtime import ModelLoadError, OnnxForecaster, time_to_oom, times_to_oom
from oomcast.training.export import export
from oomcast.training.train import Rule, save_checkpoint


@pytest.fixture(scope="module")
def model_file(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, OOMForecastNet]:
    torch.manual_seed(0)
    net = OOMForecastNet(NetConfig())
    net.set_normalization(
        torch.full((net.cfg.n_features,), 0.3), torch.full((net.cfg.n_features,), 0.5)
    )
    for p in net.parameters():  # larger weights: risks spread over (0, 1), not all ~0.5
        p.data.mul_(3.0)
    net.eval()
    tmp = tmp_path_factory.mktemp("model")
    save_checkpoint(tmp / "ckpt.pt", net, Rule(60, 0.4, 0.9, 0.95, 0.01), epoch=3)
    path = export(tmp / "ckpt.pt", tmp / "m.onnx", version="test-1")
    return path, net


def ramp(n: int, device: str, slope: float) -> list:  # type: ignore[type-arg]
    return [
        sample(
            1000.0 + 0.7 * t,
            min(0.99, 0.3 + slope * t),
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
    seqs = [ramp(steps, f"gpu{b}", 0.004 + 0.002 * b) for b in range(batch)]
    states = [fc.init_state() for _ in range(batch)]
    streamed = np.zeros((batch, steps, len(fc.horizons_s)))
    for t in range(steps):
        for b, f in enumerate(fc.step(states, [s[t] for s in seqs])):
            streamed[b, t] = [f.risk[h] for h in fc.horizons_s]
    x = np.stack(
        [
            [st.embed(s) for s in seq]
            for seq, st in zip(seqs, [EmbeddingState() for _ in seqs], strict=True)
        ]
    )
    with torch.no_grad():
        full, _ = net(torch.from_numpy(x.astype(np.float32)))
    assert np.abs(streamed - full.numpy()).max() < 1e-4
    assert streamed.std() > 0.01  # the comparison is not between two constants


@pytest.mark.parametrize("batch", [1, 7])
@pytest.mark.parametrize("steps", [5, 300])
def test_onnx_window_matches_torch_and_streaming(
    model_file: tuple[Path, OOMForecastNet], batch: int, steps: int
) -> None:
    path, net = model_file
    fc = OnnxForecaster(path)
    seqs = [ramp(steps, f"gpu{b}", 0.001 + 0.0005 * b) for b in range(batch)]
    x = np.stack([[st.embed(s) for s in seq] for seq, st in ((q, EmbeddingState()) for q in seqs)])
    x = x.astype(np.float32)
    zero = np.zeros((net.cfg.layers, batch, net.cfg.hidden), np.float32)
    onnx_risk, h, c = fc.session.run(None, {"x": x, "h": zero, "c": zero})
    with torch.no_grad():
        torch_risk, (th, tc) = net(torch.from_numpy(x))
    assert np.abs(onnx_risk - torch_risk.numpy()).max() < 1e-4
    assert np.abs(h - th.numpy()).max() < 1e-4
    # c is unbounded (|c| reaches the hundreds with these inflated weights): relative there
    assert np.allclose(c, tc.numpy(), rtol=1e-5, atol=1e-4)
    # the stateless window path of the runtime, one domain at a time, against streaming
    states = [fc.init_state() for _ in range(batch)]
    streamed = [[] for _ in range(batch)]  # type: ignore[var-annotated]
    for t in range(steps):
        for b, f in enumerate(fc.step(states, [s[t] for s in seqs])):
            streamed[b].append([f.risk[hz] for hz in fc.horizons_s])
    for b, seq in enumerate(seqs):
        windowed = [[f.risk[hz] for hz in fc.horizons_s] for f in fc.window(seq)]
        assert np.abs(np.asarray(windowed) - np.asarray(streamed[b])).max() < 1e-4
        assert np.abs(np.asarray(windowed) - onnx_risk[b]).max() < 1e-4
    assert onnx_risk.std() > 0.01


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
    meta = onnx.load(str(path)).metadata_props
    assert {p.key for p in meta} >= {"oomcast.version", "oomcast.rule", "oomcast.features"}


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


def test_time_to_oom_reads_the_median_off_the_risk_curve() -> None:
    h = np.asarray([5, 15, 30, 60, 120, 300], dtype=float)
    assert time_to_oom(np.asarray([0.1, 0.2, 0.3, 0.4, 0.45, 0.49]), h) is None
    assert time_to_oom(np.asarray([0.1, 0.2, 0.4, 0.6, 0.9, 1.0]), h) == pytest.approx(45.0)
    assert time_to_oom(np.asarray([0.8, 0.9, 1, 1, 1, 1]), h) == pytest.approx(5 * 0.5 / 0.8)


@pytest.mark.parametrize("n", [1, 5, 16, 17, 300])
def test_batched_time_to_oom_agrees_with_one_row_at_a_time(n: int) -> None:
    h = np.asarray([5, 15, 30, 60, 120, 300], dtype=float)
    rng = np.random.default_rng(n)
    risk = np.sort(rng.random((n, 6)), axis=1).astype(np.float32)
    risk[0] = [0.1, 0.2, 0.3, 0.4, 0.45, 0.49]  # never reaches one half
    got = times_to_oom(risk, h)
    for row, t in zip(risk, got, strict=True):
        want = time_to_oom(row.astype(np.float64), h)
        assert (t is None) == (want is None)
        if t is not None:
            assert t == pytest.approx(want, rel=1e-5)
    # small batches go row by row in Python, large ones through numpy: padded past the
    # cut-over, the same rows must give the same answers on the numpy path
    padded = np.concatenate([risk, np.zeros((17, 6), np.float32)])
    vectorized = times_to_oom(padded, h)[:n]
    for t, v in zip(got, vectorized, strict=True):
        assert (t is None) == (v is None)
        if t is not None:
            assert t == pytest.approx(v, rel=1e-5)


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
