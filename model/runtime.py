"""The ONNX Runtime forecaster: stateful, batched streaming inference.

Each memory domain owns a slot in two preallocated arrays holding the LSTM's ``h`` and
``c``; a step gathers the slots of the domains in the batch, runs one ONNX call, and
scatters the new state back for the domains whose tick is due (the network advances once
per ``tick_s`` of trace time; a sample in between is forecast from the committed state,
which it leaves as it was). A domain's embedding comes from the node when its schema
version matches the model's, else it is computed here from the raw sample. Only this
module of ``model/`` imports onnxruntime.

A model may carry a fleet recalibration (``oomcast.recalibration``, written by ``oomcast
recalibrate``): per horizon, a Platt correction ``(a, b)`` applied to the network's risk,
``sigmoid(a * logit(risk) + b)``, then made non-decreasing across horizons. A risk the
evidence gate shut (exactly 0) stays 0. A model without the entry is run as it always was.
"""

from __future__ import annotations

import base64
import binascii
import json
import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oomcast.model.embedding import (
    EMBEDDING_VERSION,
    FEATURES,
    N_FEATURES,
    PREFIX_SCHEMAS,
    TICK_TOLERANCE,
    EmbeddingState,
    finite_number,
)
from oomcast.model.forecast import AlertRule, Embedding, Forecast, RiskRow, rule_fire_risk
from oomcast.model.schema import Sample

log = logging.getLogger(__name__)
DEFAULT_MODEL = Path(__file__).with_name("oomcast-lstm.onnx")
# metadata: {"<horizon_s>": [a, b], ...}, one pair per horizon of the model
RECALIBRATION_KEY = "oomcast.recalibration"
_RISK_CLAMP = 1e-6  # as the network clamps a risk before its own calibration's logit


class ModelLoadError(RuntimeError):
    pass


def parse_recalibration(value: Any, horizons_s: Sequence[int]) -> dict[int, tuple[float, float]]:
    """A recalibration table (``RECALIBRATION_KEY``'s JSON text, or the object it holds)
    checked against the model's horizons: ``{horizon_s: (a, b)}`` with a pair of finite
    numbers, ``a > 0``, for every horizon and no other key. ValueError naming what is wrong."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as exc:
            raise ValueError(f"not JSON ({exc})") from None
    if not isinstance(value, Mapping):
        raise ValueError("must be an object of horizon_s: [a, b]")
    table: dict[int, tuple[float, float]] = {}
    for key, pair in value.items():
        try:
            h = int(key)
        except (TypeError, ValueError):
            raise ValueError(f"key {key!r} is not a horizon in seconds") from None
        if h not in horizons_s:
            raise ValueError(f"key {key!r}: the model's horizons are {list(horizons_s)}")
        if h in table:
            raise ValueError(f"horizon {h} given twice")
        if (
            not isinstance(pair, Sequence)
            or isinstance(pair, str)
            or len(pair) != 2
            or not all(isinstance(v, int | float) and not isinstance(v, bool) for v in pair)
        ):
            raise ValueError(f"{h}: {pair!r} is not a pair [a, b] of numbers")
        a, b = float(pair[0]), float(pair[1])
        if not (math.isfinite(a) and math.isfinite(b) and a > 0):
            raise ValueError(f"{h}: [a, b] = {[a, b]} must be finite with a > 0")
        table[h] = (a, b)
    missing = [h for h in horizons_s if h not in table]
    if missing:
        raise ValueError(f"no [a, b] for horizons {missing}")
    return table


def recalibrated(risk: np.ndarray, a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """``risk`` (..., H) through the per-horizon correction: sigmoid(a * logit(risk) + b),
    the risk clamped first as the network clamps it, a gated risk (0) kept at 0, and the
    result made non-decreasing across horizons. float32, as the network's."""
    p = np.clip(risk.astype(np.float64), _RISK_CLAMP, 1.0 - _RISK_CLAMP)
    z = a * (np.log(p) - np.log1p(-p)) + b
    out = np.where(risk > 0.0, 1.0 / (1.0 + np.exp(-z)), 0.0)
    return np.maximum.accumulate(out, axis=-1).astype(np.float32)


@dataclass
class Slot:
    index: int
    emb: EmbeddingState = field(default_factory=EmbeddingState)
    tick_ts: float = -math.inf  # ts of the sample the committed LSTM state ends with


class OnnxForecaster:
    def __init__(
        self, path: Path | str = DEFAULT_MODEL, providers: list[str] | None = None, threads: int = 1
    ) -> None:
        try:
            import onnxruntime as ort
        except ImportError as exc:
            raise ModelLoadError(
                "onnxruntime is not installed (pip install oomcast[onnx])"
            ) from exc
        path = Path(path)
        if not path.is_file():
            raise ModelLoadError(f"no model file at {path}")
        options = ort.SessionOptions()
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
        available = ort.get_available_providers()
        wanted = providers or [
            p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in available
        ]
        try:
            self.session = ort.InferenceSession(str(path), options, providers=wanted)
        except Exception as exc:  # a corrupt or foreign file
            raise ModelLoadError(f"cannot load {path}: {exc}") from exc
        meta = self.session.get_modelmeta().custom_metadata_map
        try:
            self.version = meta["oomcast.version"]
            self.horizons_s = tuple(json.loads(meta["oomcast.horizons_s"]))
            # the schema its network was trained on; ``embedding_version`` is the one it reads
            self.trained_embedding_version = int(meta["oomcast.embedding_version"])
            self.layers = int(meta["oomcast.layers"])
            self.hidden = int(meta["oomcast.hidden"])
            rule = json.loads(meta["oomcast.rule"])
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{path} lacks oomcast metadata ({exc})") from exc
        try:
            model_features = json.loads(meta["oomcast.features"])
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{path} lacks oomcast metadata ({exc})") from exc
        trained = self.trained_embedding_version
        prefix = PREFIX_SCHEMAS.get(trained)
        same = trained == EMBEDDING_VERSION and model_features == list(FEATURES)
        earlier = prefix == len(model_features) and model_features == list(FEATURES[:prefix])
        if not (same or earlier):
            raise ModelLoadError(
                f"{path} was trained on embedding v{trained}; this oomcast"
                f" computes v{EMBEDDING_VERSION}"
            )
        self.rule = AlertRule(
            int(rule["horizon_s"]), rule_fire_risk(rule), int(rule.get("fire_after", 1))
        )
        self.tick_s = float(meta.get("oomcast.tick_s", "1.0"))
        # a time to OOM is reported once the risk within the longest horizon reaches this
        self.tto_min_risk = float(meta.get("oomcast.tto_min_risk", str(self.rule.fire_risk)))
        self._tick_min_s = TICK_TOLERANCE * self.tick_s
        self.metadata: dict[str, Any] = {k: v for k, v in meta.items()}
        self.provider = self.session.get_providers()[0]
        self.path = path
        self._h = np.zeros((self.layers, 64, self.hidden), np.float32)
        self._c = np.zeros_like(self._h)
        self._free: list[int] = list(range(63, -1, -1))
        self._horizons = np.asarray(self.horizons_s, dtype=np.float64)
        self._index = {h: i for i, h in enumerate(self.horizons_s)}
        # the graph's input width: today's, or an earlier schema's that is its prefix; either
        # way the forecaster reads today's vectors (from nodes, or computed here) and cuts them
        self._n_features = len(model_features)
        self.embedding_version = EMBEDDING_VERSION
        self.recalibration: dict[int, tuple[float, float]] | None = None
        self._recal: tuple[np.ndarray, np.ndarray] | None = None
        if RECALIBRATION_KEY in meta:
            try:
                table = parse_recalibration(meta[RECALIBRATION_KEY], self.horizons_s)
            except ValueError as exc:
                raise ModelLoadError(f"{path}: malformed {RECALIBRATION_KEY} ({exc})") from None
            self.set_recalibration(table)

    def set_recalibration(self, table: Mapping[int, Sequence[float]] | None) -> None:
        """Apply ``table`` (``{horizon_s: (a, b)}``, every horizon) after the network's
        risk from now on, in place of any the file carried; None: the network's risk as it
        is. ValueError on a malformed table (``oomcast recalibrate`` scores a refit with it
        before it writes one)."""
        if table is None:
            self.recalibration, self._recal = None, None
            return
        checked = parse_recalibration({str(h): list(v) for h, v in table.items()}, self.horizons_s)
        self.recalibration = checked
        pairs = np.asarray([checked[h] for h in self.horizons_s], dtype=np.float64)
        self._recal = (pairs[:, 0], pairs[:, 1])

    # -- state slots ----------------------------------------------------------------------
    def init_state(self) -> Slot:
        if not self._free:
            n = self._h.shape[1]
            self._h = np.concatenate([self._h, np.zeros_like(self._h)], axis=1)
            self._c = np.concatenate([self._c, np.zeros_like(self._c)], axis=1)
            self._free = list(range(2 * n - 1, n - 1, -1))
        index = self._free.pop()
        self._h[:, index] = 0.0
        self._c[:, index] = 0.0
        return Slot(index)

    def release(self, state: Slot) -> None:
        if state.index in self._free:  # a second release would give one slot to two domains
            raise ValueError(f"state slot {state.index} released twice")
        self._free.append(state.index)

    # -- snapshots (a domain handed to another replica) -----------------------------------
    def export_state(self, state: Slot) -> dict[str, Any]:
        """A domain's whole state as JSON-able values: the LSTM's ``h`` and ``c`` (float32,
        base64, exact), the tick the committed state ends with, and the embedding's memory."""
        i = state.index
        return {
            "layers": self.layers,
            "hidden": self.hidden,
            "h": _encode_array(self._h[:, i]),
            "c": _encode_array(self._c[:, i]),
            "tick_ts": None if state.tick_ts == -math.inf else state.tick_ts,
            "emb": state.emb.to_dict(),
        }

    def import_state(self, data: Mapping[str, Any]) -> Slot:
        """A slot holding what ``export_state`` saved; ValueError, before any slot is taken,
        when ``data`` is malformed or was saved by a network of another shape."""
        if not isinstance(data, Mapping):
            raise ValueError("forecaster state must be an object")
        if data.get("layers") != self.layers or data.get("hidden") != self.hidden:
            raise ValueError(
                f"forecaster state of a {data.get('layers')}x{data.get('hidden')} LSTM; this"
                f" model is {self.layers}x{self.hidden}"
            )
        shape = (self.layers, self.hidden)
        h = _decode_array(data.get("h"), shape, "h")
        c = _decode_array(data.get("c"), shape, "c")
        tick = data.get("tick_ts")
        tick_ts = -math.inf if tick is None else finite_number(tick, "tick_ts")
        emb = EmbeddingState.from_dict(data.get("emb", {}))
        slot = self.init_state()
        self._h[:, slot.index] = h
        self._c[:, slot.index] = c
        slot.emb, slot.tick_ts = emb, tick_ts
        return slot

    # -- inference ------------------------------------------------------------------------
    def step(
        self,
        states: list[Slot],
        samples: list[Sample],
        embeddings: Sequence[Embedding | None] | None = None,
    ) -> list[Forecast]:
        return self.step_arrays(states, samples, embeddings)[0]

    def step_arrays(
        self,
        states: list[Slot],
        samples: list[Sample],
        embeddings: Sequence[Embedding | None] | None = None,
    ) -> tuple[list[Forecast], np.ndarray, list[float | None]]:
        """``step``, and the batch as arrays beside the forecasts: the risks (rows,
        horizons; columns in ``horizons_s`` order) and each row's time to OOM, for a caller
        that judges thousands of forecasts at once (``service/pipeline/state.py``)."""
        n = len(states)
        if n == 0:
            return [], np.zeros((0, len(self.horizons_s)), np.float32), []
        width = N_FEATURES  # what nodes send and the embedding computes
        x: np.ndarray | None = None
        if embeddings is not None:  # the node's: the hot path, one conversion for them all
            try:
                x = np.asarray(embeddings, dtype=np.float32)
            except (TypeError, ValueError):  # a missing (None) or ragged one among them
                x = None
            if x is not None and x.shape != (n, width):
                x = None
        if x is None:
            # Computed here for the samples that came without a usable embedding. A domain
            # whose node stops sending one starts its local history afresh at that sample.
            rows = []
            for i, (st, sample) in enumerate(zip(states, samples, strict=True)):
                given = embeddings[i] if embeddings is not None else None
                rows.append(
                    given if given is not None and len(given) == width else st.emb.embed(sample)
                )
            x = np.asarray(rows, dtype=np.float32)
        if n == 1:  # one domain (POST /v1/samples, a quiet node): a view, no gather
            i = states[0].index
            idx: slice | np.ndarray = slice(i, i + 1)
            h0, c0 = self._h[:, idx], self._c[:, idx]
        else:  # np.take gathers a quarter faster than fancy indexing
            slot_rows = np.fromiter((st.index for st in states), dtype=np.intp, count=n)
            idx = slot_rows
            h0, c0 = np.take(self._h, slot_rows, axis=1), np.take(self._c, slot_rows, axis=1)
        risk, tto, h, c = self.session.run(
            None, {"x": x[:, None, : self._n_features], "h": h0, "c": c0}
        )
        risk, tto = risk[:, 0, :], tto[:, 0]
        if self._recal is not None:
            risk = recalibrated(risk, *self._recal)
        ts = np.fromiter((s.ts for s in samples), np.float64, n)
        ticks = np.fromiter((st.tick_ts for st in states), np.float64, n)
        due = ts - ticks >= self._tick_min_s
        if due.all():
            self._h[:, idx] = h
            self._c[:, idx] = c
            for st, s in zip(states, samples, strict=True):
                st.tick_ts = s.ts
        elif due.any():
            due_rows = np.flatnonzero(due)
            sel = np.asarray(idx)[due_rows] if n > 1 else np.asarray([states[0].index])
            self._h[:, sel] = h[:, due_rows]
            self._c[:, sel] = c[:, due_rows]
            for k in due_rows.tolist():
                states[k].tick_ts = samples[k].ts
        ttos = self._ttos(risk, tto)
        return self._forecasts(risk, ttos, samples), risk, ttos

    def window(self, samples: list[Sample]) -> list[Forecast]:
        """Forecasts for every sample of one domain's window, from a fresh state, stepped
        exactly as a live domain is (the stateless path of ``POST /v1/predict``; live
        state is not touched)."""
        if not samples:
            return []
        state = self.init_state()
        try:
            return [self.step([state], [s])[0] for s in samples]
        finally:
            self.release(state)

    def window_last(self, samples: list[Sample]) -> Forecast:
        """``window(samples)[-1]`` in two ONNX calls instead of one per sample (``POST
        /v1/predict`` wants only the last): the state a live domain would hold before the
        last sample is what the samples that fell on a tick commit, so those run as one
        sequence from a zero state, and the last sample runs from where they end."""
        if not samples:
            raise ValueError("window_last needs at least one sample")
        emb = EmbeddingState()
        x = np.asarray([emb.embed(s) for s in samples], dtype=np.float32)[:, : self._n_features]
        tick, committed = -math.inf, []
        for i, s in enumerate(samples[:-1]):  # as step() commits: once per tick
            if s.ts - tick >= self._tick_min_s:
                committed.append(i)
                tick = s.ts
        h = np.zeros((self.layers, 1, self.hidden), np.float32)
        c = np.zeros_like(h)
        if committed:
            _, _, h, c = self.session.run(None, {"x": x[committed][None], "h": h, "c": c})
        risk, tto, _, _ = self.session.run(None, {"x": x[-1:][None], "h": h, "c": c})
        risk = risk[:, -1, :]
        if self._recal is not None:
            risk = recalibrated(risk, *self._recal)
        return self._forecasts(risk, self._ttos(risk, tto[:, -1]), samples[-1:])[0]

    def _ttos(self, risk: np.ndarray, tto: np.ndarray) -> list[float | None]:
        """The graph's time to OOM (the straight line's where it holds, else the survival
        curve's median), where the risk within the longest horizon says an OOM is in sight
        (else None), per row."""
        floor = self.tto_min_risk
        return [
            float(t) if r >= floor else None
            for t, r in zip(tto.tolist(), risk[:, -1].tolist(), strict=True)
        ]

    def _forecasts(
        self, risk: np.ndarray, ttos: list[float | None], samples: list[Sample]
    ) -> list[Forecast]:
        """One Forecast per row of ``risk`` (rows, H), made from ``samples[i]``."""
        index = self._index
        version = self.version
        new, cls = tuple.__new__, Forecast  # Forecast(...) without its Python-level __new__
        return [
            new(cls, (RiskRow(index, row), tto, sample.ts, version))
            for row, tto, sample in zip(risk.tolist(), ttos, samples, strict=True)
        ]

    @property
    def n_features(self) -> int:
        """The width of the graph's input: today's schema's, or an earlier schema's that is
        its prefix (feed it ``x[..., :n_features]``)."""
        return self._n_features

    @property
    def metadata_features(self) -> list[str]:
        features: list[str] = json.loads(self.metadata["oomcast.features"])
        return features


def _encode_array(arr: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(arr, dtype="<f4").tobytes()).decode("ascii")


def _decode_array(text: Any, shape: tuple[int, int], name: str) -> np.ndarray:
    if not isinstance(text, str):
        raise ValueError(f"forecaster state {name}: must be a base64 string")
    try:
        raw = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ValueError(f"forecaster state {name}: not base64 ({exc})") from None
    if len(raw) != 4 * shape[0] * shape[1]:
        raise ValueError(f"forecaster state {name}: {len(raw)} bytes, not {shape} float32")
    arr = np.frombuffer(raw, dtype="<f4").reshape(shape)
    if not np.isfinite(arr).all():
        raise ValueError(f"forecaster state {name}: not finite")
    return arr
