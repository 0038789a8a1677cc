"""model/runtime.py with a fleet recalibration (``oomcast.recalibration``, written by
``oomcast recalibrate``): the correction applied after the network's risk is exactly
sigmoid(a * logit(risk) + b), made non-decreasing across horizons, a shut gate kept at 0; a
model without the entry is run as it always was; a malformed entry does not load."""

from __future__ import annotations

import itertools
import json
import math
import random
from pathlib import Path

import numpy as np
import onnx
import pytest

from oomcast.cli.common import SHIPPED_MODEL
from oomcast.model.embedding import EmbeddingState
from oomcast.model.runtime import RECALIBRATION_KEY, ModelLoadError, OnnxForecaster
from oomcast.model.schema import Sample
from oomcast.model.trace import downsample_trace
from oomcast.training.shapes import leak

HORIZONS = (5, 15, 30, 45, 60, 120, 300)
# steep and shifted per horizon, so a wrong column, sign or order shows
TABLE = {5: (1.7, 0.9), 15: (0.6, -0.4), 30: (1.2, 1.5), 45: (0.9, -1.1), 60: (2.0, 0.3),
         120: (0.8, 2.2), 300: (1.1, -2.0)}  # fmt: skip


def with_metadata(src: Path, out: Path, entries: dict[str, str]) -> Path:
    model = onnx.load(str(src))
    for entry in model.metadata_props:
        if entry.key in entries:
            entry.value = entries.pop(entry.key)
    for key, value in entries.items():
        prop = model.metadata_props.add()
        prop.key, prop.value = key, value
    onnx.save(model, str(out))
    return out


def leak_samples() -> list[Sample]:
    """A straight leak to the limit at 1 Hz: the gate opens on its way, so the risks run
    from 0 (gate shut) to near 1."""
    trace = downsample_trace(leak(random.Random(3), 3), 1.0)
    return next(iter(trace.samples.values()))


def expected(risks: list[list[float]], table: dict[int, tuple[float, float]]) -> np.ndarray:
    """The correction written out longhand, one risk at a time."""
    out = []
    for row in risks:
        values = []
        for h, r in zip(HORIZONS, row, strict=True):
            if r <= 0.0:
                values.append(0.0)
                continue
            p = min(max(r, 1e-6), 1.0 - 1e-6)
            a, b = table[h]
            values.append(1.0 / (1.0 + math.exp(-(a * math.log(p / (1.0 - p)) + b))))
        out.append(list(itertools.accumulate(values, max)))
    return np.asarray(out)


def risks_of(fc: OnnxForecaster, samples: list[Sample]) -> list[list[float]]:
    return [[f.risk[h] for h in HORIZONS] for f in fc.window(samples)]


@pytest.fixture(scope="module")
def recalibrated_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    entry = json.dumps({str(h): list(ab) for h, ab in TABLE.items()})
    out = tmp_path_factory.mktemp("recal") / "recal.onnx"
    return with_metadata(SHIPPED_MODEL, out, {RECALIBRATION_KEY: entry})


def test_the_risks_are_the_correction_of_the_networks(recalibrated_model: Path) -> None:
    samples = leak_samples()
    original = risks_of(OnnxForecaster(SHIPPED_MODEL), samples)
    fc = OnnxForecaster(recalibrated_model)
    assert fc.recalibration == TABLE
    got = np.asarray(risks_of(fc, samples))
    want = expected(original, TABLE)
    assert (np.asarray(original) == 0).any() and (np.asarray(original) > 0.5).any()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-7)
    assert not np.allclose(got, np.asarray(original), atol=1e-3)
    assert (np.diff(got, axis=1) >= 0).all()
    # the two-call path of POST /v1/predict corrects the same way
    last = fc.window_last(samples)
    np.testing.assert_allclose([last.risk[h] for h in HORIZONS], got[-1], rtol=1e-6)


def test_step_arrays_carry_the_corrected_risks(recalibrated_model: Path) -> None:
    fc = OnnxForecaster(recalibrated_model)
    samples = leak_samples()[-40:]
    states = [fc.init_state() for _ in samples]  # one domain each: a batch of 40
    forecasts, risk, _ = fc.step_arrays(states, samples)
    assert risk.dtype == np.float32
    assert [[f.risk[h] for h in HORIZONS] for f in forecasts] == risk.tolist()
    bare = OnnxForecaster(SHIPPED_MODEL)
    _, bare_risk, _ = bare.step_arrays([bare.init_state() for _ in samples], samples)
    np.testing.assert_allclose(risk, expected(bare_risk.tolist(), TABLE), rtol=2e-6, atol=1e-7)


def test_a_model_without_the_entry_runs_as_before(recalibrated_model: Path) -> None:
    """The shipped model's forecasts are the graph's own outputs, stepped by hand; taking a
    recalibration off (``set_recalibration(None)``) gives them back exactly."""
    fc = OnnxForecaster(SHIPPED_MODEL)
    assert fc.recalibration is None and RECALIBRATION_KEY not in fc.metadata
    samples = leak_samples()
    emb = EmbeddingState()
    h = np.zeros((fc.layers, 1, fc.hidden), np.float32)
    c = np.zeros_like(h)
    by_hand = []
    for s in samples:  # 1 Hz: every sample is a tick
        x = np.asarray([[emb.embed(s)]], dtype=np.float32)
        risk, _, h, c = fc.session.run(None, {"x": x, "h": h, "c": c})
        by_hand.append(risk[0, 0].tolist())
    assert risks_of(fc, samples) == by_hand
    other = OnnxForecaster(recalibrated_model)
    assert risks_of(other, samples) != by_hand
    other.set_recalibration(None)
    assert other.recalibration is None
    assert risks_of(other, samples) == by_hand


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ("{not json", "not JSON"),
        ("[1, 2]", "must be an object"),
        (json.dumps({str(h): [1.0, 0.0] for h in HORIZONS[:-1]}), "no [a, b] for horizons [300]"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "7": [1, 0]}), "key '7'"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "5": [0.0, 1.0]}), "a > 0"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "5": [-2.0, 1.0]}), "a > 0"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "60": [1.0]}), "not a pair"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "60": ["1", 0]}), "not a pair"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "60": [1.0, True]}), "not a pair"),
        ('{"5": [1.0, NaN]}', "finite"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "x": [1, 0]}), "key 'x'"),
        (json.dumps({**{str(h): [1.0, 0.0] for h in HORIZONS}, "05": [1, 0]}), "5 given twice"),
    ],
)
def test_a_malformed_entry_is_a_load_error_naming_it(entry: str, said: str, tmp_path: Path) -> None:
    path = with_metadata(SHIPPED_MODEL, tmp_path / "bad.onnx", {RECALIBRATION_KEY: entry})
    with pytest.raises(ModelLoadError) as err:
        OnnxForecaster(path)
    assert RECALIBRATION_KEY in str(err.value) and said in str(err.value)


def test_set_recalibration_refuses_a_malformed_table_and_keeps_its_own() -> None:
    fc = OnnxForecaster(SHIPPED_MODEL)
    with pytest.raises(ValueError, match="no \\[a, b\\] for horizons"):
        fc.set_recalibration({5: (1.0, 0.0)})
    with pytest.raises(ValueError, match="a > 0"):
        fc.set_recalibration({h: (0.0 if h == 30 else 1.0, 0.0) for h in HORIZONS})
    assert fc.recalibration is None
