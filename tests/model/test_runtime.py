"""model/runtime.py on a really trained (tiny) model: the tick cadence of the committed LSTM
state, the stateless window path, the time-to-OOM gate and the metadata export writes.

The model is trained for one short epoch on the plain shapes of ``training/shapes.py`` and
exported, once for the module: what is tested is how the runtime steps it, not how good it
is (tests/training/test_export.py checks parity with torch on a random network)."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

from oomcast.model.embedding import EmbeddingState, tick_rows
from oomcast.model.runtime import OnnxForecaster
from oomcast.model.schema import Sample
from oomcast.training.export import export
from oomcast.training.train import Sources, train

GIB = 1 << 30
T0 = 1_800_000_000.0


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, dict]]:  # type: ignore[type-arg]
    tmp = tmp_path_factory.mktemp("trained")
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # two threads on a busy two-core machine spin for minutes
    try:
        ckpt = train(
            Sources(shapes=60),
            tmp,
            epochs=1,
            draws_per_epoch=32,
            cache=tmp,
            log=lambda *_: None,
            progress=False,
        )
    finally:
        torch.set_num_threads(before)
    path = export(tmp / "checkpoint.pt", tmp / "tiny.onnx", version="tiny-1")
    yield path, ckpt


def level(t: float, phase: float) -> float:
    """A start-up climb, a plateau with a sawtooth, then a leak: the state has things to
    remember, and the outputs change from tick to tick."""
    base = 0.2 + 0.3 * (1 - math.exp(-t / 20))
    saw = 0.05 * (((t + phase) % 7.0) / 7.0)
    leak = 0.004 * max(0.0, t - 60)
    return min(0.995, base + saw + leak)


def stream(
    device: str,
    hz: float,
    seconds: float,
    start: float = 0.0,
    phase: float = 0.0,
    kind: str = "gpu",
) -> list[Sample]:
    total = 24 * GIB if kind == "gpu" else 2 * GIB
    out = []
    for i in range(int(seconds * hz)):
        t = i / hz
        used = int(level(t, phase) * total)
        out.append(
            Sample(
                T0 + start + t,
                "n1",
                device,
                kind,
                total,
                used,
                peak_bytes=used,
                allocated_bytes=int(used * 0.9),
                alloc_retries=i // 50,
            )
        )
    return out


def outputs(fc: OnnxForecaster, forecasts: list) -> tuple[np.ndarray, np.ndarray]:  # type: ignore[type-arg]
    risk = np.asarray([[f.risk[h] for h in fc.horizons_s] for f in forecasts])
    tto = np.asarray([np.nan if f.time_to_oom_s is None else f.time_to_oom_s for f in forecasts])
    return risk, tto


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_export_metadata_carries_the_tick_and_the_tto_floor(trained: tuple[Path, dict]) -> None:  # type: ignore[type-arg]
    path, ckpt = trained
    meta = {p.key: p.value for p in onnx.load(str(path)).metadata_props}
    assert meta["oomcast.tick_s"] == str(float(ckpt["config"]["tick_s"])) == "1.0"
    want = min(0.5, float(ckpt["rule"]["fire_risk"]))
    assert float(meta["oomcast.tto_min_risk"]) == pytest.approx(want)
    assert json.loads(meta["oomcast.rule"]) == ckpt["rule"]
    fc = OnnxForecaster(path)
    assert fc.tick_s == 1.0 and fc.tto_min_risk == pytest.approx(want)
    assert (fc.layers, fc.hidden) == (ckpt["config"]["layers"], ckpt["config"]["hidden"])
    assert [o.name for o in fc.session.get_outputs()] == ["risk", "tto_s", "h_out", "c_out"]


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_streaming_at_10_hz_commits_the_state_only_on_due_ticks(
    trained: tuple[Path, dict],  # type: ignore[type-arg]
) -> None:
    path, _ = trained
    live = OnnxForecaster(path)
    live.tto_min_risk = 0.0  # report every time to OOM, to compare them
    ref = OnnxForecaster(path)
    ref.tto_min_risk = 0.0
    # two 10 Hz domains stepped together, the second starting half a second later, so a
    # call mixes domains whose tick is due with domains whose tick is not
    doms = [stream("gpu0", 10, 150), stream("gpu1", 10, 149.5, start=0.5, phase=3.0)]
    by_ts: dict[float, list[tuple[int, Sample]]] = {}
    for d, samples in enumerate(doms):
        for s in samples:
            by_ts.setdefault(round(s.ts - T0, 3), []).append((d, s))
    slots = [live.init_state() for _ in doms]
    got: list[list] = [[] for _ in doms]  # type: ignore[type-arg]
    mixed = 0
    for t in sorted(by_ts):
        ds, ss = zip(*by_ts[t], strict=True)
        due = [s.ts - slots[d].tick_ts >= 0.9 for d, s in zip(ds, ss, strict=True)]
        mixed += len(set(due)) > 1
        for d, f in zip(ds, live.step([slots[d] for d in ds], list(ss)), strict=True):
            got[d].append(f)
    assert mixed > 100  # the partial commit path was exercised

    for d, samples in enumerate(doms):
        emb_state = EmbeddingState()
        emb = [emb_state.embed(s) for s in samples]  # what the live slot's embedding saw
        rows = tick_rows([s.ts for s in samples], ref.tick_s)
        assert len(samples) / 11 < len(rows) < len(samples) / 9  # about one tick a second
        # the reference sees only the tick samples (with the embeddings of the full stream)
        slot = ref.init_state()
        committed = []  # the reference state after each tick
        ref_out = []
        for i in rows:
            ref_out.append(ref.step([slot], [samples[i]], [emb[i]])[0])
            committed.append((ref._h[:, slot.index].copy(), ref._c[:, slot.index].copy()))
        live_risk, live_tto = outputs(live, got[d])
        ref_risk, ref_tto = outputs(ref, ref_out)
        assert np.abs(live_risk[rows] - ref_risk).max() < 1e-5
        assert np.allclose(live_tto[rows], ref_tto, rtol=1e-5, atol=1e-5)
        # the committed state is the reference's, after the whole stream
        assert np.abs(live._h[:, slots[d].index] - committed[-1][0]).max() < 1e-5
        assert np.abs(live._c[:, slots[d].index] - committed[-1][1]).max() < 1e-5
        # a sample between ticks is forecast from the state committed at the last tick
        for k, (a, b) in enumerate(zip(rows, [*rows[1:], len(samples)], strict=True)):
            for i in range(a + 1, min(b, a + 4)):
                h, c = committed[k]
                x = np.asarray([[emb[i]]], np.float32)
                risk, tto, _, _ = ref.session.run(None, {"x": x, "h": h[:, None], "c": c[:, None]})
                assert np.abs(live_risk[i] - risk[0, 0]).max() < 1e-5
                assert live_tto[i] == pytest.approx(float(tto[0, 0]), rel=1e-5)
        # and that is a real difference: committing every sample would say other things
        zero = np.zeros((ref.layers, 1, ref.hidden), np.float32)
        every_risk, every_tto, _, _ = ref.session.run(
            None, {"x": np.asarray([emb], np.float32), "h": zero, "c": zero}
        )
        differ = max(
            np.abs(every_risk[0][rows] - ref_risk).max(),
            np.abs(np.log(every_tto[0][rows]) - np.log(ref_tto)).max(),
        )
        assert differ > 1e-3


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_window_is_exactly_a_fresh_domain_streamed_sample_by_sample(
    trained: tuple[Path, dict],  # type: ignore[type-arg]
) -> None:
    path, _ = trained
    fc = OnnxForecaster(path)
    fc.tto_min_risk = 0.0
    for samples in (
        stream("gpu0", 10, 40),
        stream("cgroup:/a", 2, 60, kind="host"),
        stream("gpu3", 1, 90, phase=2.0),
    ):
        other = fc.init_state()  # a live domain mid-stream, which a window must not touch
        fc.step([other], [samples[0]])
        h_before = fc._h[:, other.index].copy()
        free = len(fc._free)
        windowed = fc.window(samples)
        slot = fc.init_state()
        streamed = [fc.step([slot], [s])[0] for s in samples]
        fc.release(slot)
        w_risk, w_tto = outputs(fc, windowed)
        s_risk, s_tto = outputs(fc, streamed)
        assert len(windowed) == len(samples)
        assert np.abs(w_risk - s_risk).max() < 1e-6
        assert np.allclose(w_tto, s_tto, rtol=1e-6)
        assert [f.observed_at for f in windowed] == [s.ts for s in samples]
        assert np.array_equal(fc._h[:, other.index], h_before)
        assert len(fc._free) == free
        fc.release(other)
    assert fc.window([]) == []


def test_time_to_oom_is_none_below_the_floor_at_the_longest_horizon(
    trained: tuple[Path, dict],  # type: ignore[type-arg]
) -> None:
    path, _ = trained
    fc = OnnxForecaster(path)
    samples = stream("gpu0", 10, 60)
    longest = fc.horizons_s[-1]

    def run(floor: float | None) -> list:  # type: ignore[type-arg]
        if floor is not None:
            fc.tto_min_risk = floor
        return fc.window(samples)

    shipped = fc.tto_min_risk
    for f in run(None):  # the floor the file carries
        assert (f.time_to_oom_s is None) == (f.risk[longest] < shipped)
    everything = run(0.0)
    assert all(f.time_to_oom_s is not None and f.time_to_oom_s > 0 for f in everything)
    assert all(f.time_to_oom_s is None for f in run(1.01))  # no risk reaches it
    # in between: the gate is the risk at the longest horizon, forecast by forecast, and
    # the value it lets through is the head's own
    risks = np.asarray([f.risk[longest] for f in everything])
    floor = float(np.median(risks))
    gated = run(floor)
    for f, g in zip(everything, gated, strict=True):
        assert g.risk == f.risk
        if f.risk[longest] < floor:
            assert g.time_to_oom_s is None
        else:
            assert g.time_to_oom_s == f.time_to_oom_s
    assert sum(g.time_to_oom_s is not None for g in gated) == int((risks >= floor).sum())


def test_a_stored_rule_is_read_by_its_name_or_by_the_name_older_models_wrote() -> None:
    from oomcast.model.forecast import rule_fire_risk

    assert rule_fire_risk({"horizon_s": 60, "fire_risk": 0.4}) == 0.4
    assert rule_fire_risk({"horizon_s": 60, "threshold": 0.7}) == 0.7  # lstm-2026.12.01
    assert rule_fire_risk({"fire_risk": 0.4, "threshold": 0.7}) == 0.4
    with pytest.raises(KeyError, match="fire_risk"):
        rule_fire_risk({"horizon_s": 60})


def test_an_exported_state_continues_in_another_forecaster_exactly() -> None:
    """The shipped model, three domains at 10 Hz (the network ticks once a second), the
    state exported between two ticks and imported into another forecaster whose slots are
    laid out otherwise: it forecasts what the uninterrupted one does."""
    from oomcast.model.runtime import DEFAULT_MODEL

    domains = [stream(f"gpu{i}", 10.0, 40.0, phase=i) for i in range(3)]
    rows = list(zip(*domains, strict=True))
    cut = 175  # mid-tick: 0.5 s after the last committed step
    ref = OnnxForecaster(DEFAULT_MODEL)
    ref_states = [ref.init_state() for _ in domains]
    expected = [ref.step(ref_states, list(row)) for row in rows]
    old = OnnxForecaster(DEFAULT_MODEL)
    states = [old.init_state() for _ in domains]
    for row in rows[:cut]:
        old.step(states, list(row))
    saved = [json.loads(json.dumps(old.export_state(s))) for s in states]
    new = OnnxForecaster(DEFAULT_MODEL)
    [new.init_state() for _ in range(7)]  # other slots taken: the import must not care
    moved = [new.import_state(d) for d in reversed(saved)][::-1]
    got = [new.step(moved, list(row)) for row in rows[cut:]]
    for g, e in zip(got, expected[cut:], strict=True):
        np.testing.assert_allclose(outputs(new, g)[0], outputs(ref, e)[0], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(outputs(new, g)[1], outputs(ref, e)[1], rtol=1e-5)
    assert [s.tick_ts for s in moved] == [s.tick_ts for s in ref_states]


def test_a_malformed_or_foreign_state_is_refused_without_taking_a_slot() -> None:
    from oomcast.model.runtime import DEFAULT_MODEL

    fc = OnnxForecaster(DEFAULT_MODEL)
    state = fc.init_state()
    fc.step([state], stream("gpu0", 1.0, 1.0))
    good = fc.export_state(state)
    free = len(fc._free)
    for bad, named in [
        ({**good, "hidden": fc.hidden * 2}, "LSTM"),
        ({**good, "h": good["h"][:-8]}, "h"),
        ({**good, "c": "not base64!"}, "c"),
        ({**good, "tick_ts": "soon"}, "tick_ts"),
        ({**good, "emb": {"fast": []}}, "fast"),
    ]:
        with pytest.raises(ValueError, match=named):
            fc.import_state(bad)
        assert len(fc._free) == free


@pytest.mark.parametrize("spacing_s", [0.1, 0.45, 1.0, 2.5])
def test_the_last_forecast_of_a_window_in_two_calls_is_the_stepped_one(spacing_s: float) -> None:
    """POST /v1/predict's path: the committed samples as one sequence, then the last one."""
    fc = OnnxForecaster()
    total = 80 << 30
    for n in (1, 2, 7, 300):
        samples = [
            Sample(
                ts=1.7e9 + i * spacing_s,
                node="n",
                device="g",
                kind="gpu",
                total_bytes=total,
                used_bytes=int(total * min(0.99, 0.5 + 0.45 * i / n)),
            )
            for i in range(n)
        ]
        stepped, fast = fc.window(samples)[-1], fc.window_last(samples)
        assert dict(fast.risk) == pytest.approx(dict(stepped.risk), abs=1e-6)
        assert (fast.time_to_oom_s is None) == (stepped.time_to_oom_s is None)
        if fast.time_to_oom_s is not None:
            assert fast.time_to_oom_s == pytest.approx(stepped.time_to_oom_s, rel=1e-5)
        assert fast.observed_at == stepped.observed_at


def test_window_last_refuses_an_empty_window() -> None:
    with pytest.raises(ValueError, match="at least one"):
        OnnxForecaster().window_last([])


def test_step_arrays_are_the_forecasts_and_any_unusable_embedding_is_computed_here() -> None:
    """``step_arrays`` (the live state's batch judgement reads it) gives, beside the
    forecasts, their risks in ``horizons_s`` order and their times to OOM; and a batch whose
    node embeddings include a missing or a short one forecasts exactly as the same batch
    with those rows computed here (the rest taken as sent)."""
    from oomcast.model.runtime import DEFAULT_MODEL

    domains = [stream(f"gpu{i}", 2.0, 30.0, phase=i) for i in range(4)]
    rows = list(zip(*domains, strict=True))
    ref, got = OnnxForecaster(DEFAULT_MODEL), OnnxForecaster(DEFAULT_MODEL)
    ref_states = [ref.init_state() for _ in domains]
    states = [got.init_state() for _ in domains]
    node_side = [EmbeddingState() for _ in domains]
    for k, row in enumerate(rows):
        # the slots' own embedding state, as the node's was before this sample
        for st, e in zip(states, node_side, strict=True):
            st.emb = EmbeddingState.from_dict(e.to_dict())
        embs: list[list[float] | None] = [e.embed(s) for e, s in zip(node_side, row, strict=True)]
        expected = ref.step(ref_states, list(row), embs)
        if k % 3 == 1:  # the node sent none for gpu1 and a short one for gpu2
            embs[1] = None
            embs[2] = embs[2][:-1]  # type: ignore[index]
        forecasts, risk, ttos = got.step_arrays(states, list(row), embs)
        assert outputs(got, forecasts)[0] == pytest.approx(outputs(ref, expected)[0], abs=1e-6)
        np.testing.assert_array_equal(risk, outputs(got, forecasts)[0].astype(np.float32))
        assert ttos == [f.time_to_oom_s for f in forecasts]
