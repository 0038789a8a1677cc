"""The ONNX Runtime forecaster: stateful, batched streaming inference.

Each memory domain owns a slot in two preallocated arrays holding the LSTM's ``h`` and
``c``; a step gathers the slots of the domains in the batch, runs one ONNX call, and
scatters the new state back. A domain's embedding comes from the node when its schema
version matches the model's, else it is computed here from the raw sample. Only this
module of ``model/`` imports onnxruntime.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState
from oomcast.model.forecast import AlertRule, Forecast, RiskRow
from oomcast.model.schema import Sample

log = logging.getLogger(__name__)
DEFAULT_MODEL = Path(__file__).with_name("oomcast-lstm.onnx")


class ModelLoadError(RuntimeError):
    pass


@dataclass
class Slot:
    index: int
    emb: EmbeddingState = field(default_factory=EmbeddingState)


def times_to_oom(risk: np.ndarray, horizons: np.ndarray) -> list[float | None]:
    """``time_to_oom`` for a batch (batch, H) at once."""
    n = risk.shape[0]
    if n <= 16:
        hs = horizons.tolist()
        return [time_to_oom(row, hs) for row in risk.tolist()]
    ys = np.concatenate([np.zeros((n, 1), risk.dtype), risk], axis=1)
    xs = np.concatenate([[0.0], horizons])
    crossed = ys >= 0.5
    k = np.argmax(crossed, axis=1)
    rows = np.arange(n)
    found = crossed[rows, k] & (k > 0)
    k = np.maximum(k, 1)
    y0, y1 = ys[rows, k - 1], ys[rows, k]
    t = xs[k - 1] + (0.5 - y0) * (xs[k] - xs[k - 1]) / np.maximum(y1 - y0, 1e-9)
    return [float(v) if ok else None for v, ok in zip(t.tolist(), found.tolist(), strict=True)]


def time_to_oom(risk: Sequence[float], horizons: Sequence[float]) -> float | None:
    """Median time to OOM read off one risk curve (linear between horizons), or None when
    the risk within the longest horizon stays under one half. Plain Python: for a few rows
    numpy's per-call overhead costs more than the arithmetic."""
    if risk[-1] < 0.5:
        return None
    x0, y0 = 0.0, 0.0
    for x1, y1 in zip(horizons, risk, strict=True):
        if y1 >= 0.5:
            return float(x0 + (0.5 - y0) * (x1 - x0) / max(y1 - y0, 1e-9))
        x0, y0 = x1, y1
    return None  # unreachable: the last risk is >= 0.5


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
            self.embedding_version = int(meta["oomcast.embedding_version"])
            self.layers = int(meta["oomcast.layers"])
            self.hidden = int(meta["oomcast.hidden"])
            rule = json.loads(meta["oomcast.rule"])
        except (KeyError, ValueError) as exc:
            raise ModelLoadError(f"{path} lacks oomcast metadata ({exc})") from exc
        if self.embedding_version != EMBEDDING_VERSION:
            raise ModelLoadError(
                f"{path} was trained on embedding v{self.embedding_version}; this oomcast"
                f" computes v{EMBEDDING_VERSION}"
            )
        self.rule = AlertRule(
            int(rule["horizon_s"]), float(rule["threshold"]), int(rule.get("fire_after", 1))
        )
        self.metadata: dict[str, Any] = {k: v for k, v in meta.items()}
        self.provider = self.session.get_providers()[0]
        self.path = path
        self._h = np.zeros((self.layers, 64, self.hidden), np.float32)
        self._c = np.zeros_like(self._h)
        self._free: list[int] = list(range(63, -1, -1))
        self._horizons = np.asarray(self.horizons_s, dtype=np.float64)
        self._index = {h: i for i, h in enumerate(self.horizons_s)}
        self._n_features = len(json.loads(meta["oomcast.features"]))

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

    # -- inference ------------------------------------------------------------------------
    def step(
        self,
        states: list[Slot],
        samples: list[Sample],
        embeddings: list[list[float] | None] | None = None,
    ) -> list[Forecast]:
        n = len(states)
        if n == 0:
            return []
        width = self._n_features
        if embeddings is not None and all(e is not None and len(e) == width for e in embeddings):
            x = np.asarray(embeddings, dtype=np.float32)  # the node's: the hot path
        else:
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
        else:
            idx = np.fromiter((st.index for st in states), dtype=np.intp, count=n)
        risk, h, c = self.session.run(
            None, {"x": x[:, None, :], "h": self._h[:, idx], "c": self._c[:, idx]}
        )
        risk = risk[:, 0, :]
        self._h[:, idx] = h
        self._c[:, idx] = c
        return self._forecasts(risk, samples)

    def window(self, samples: list[Sample]) -> list[Forecast]:
        """Forecasts for every sample of one domain's window, in one call from a zero state
        (the stateless path of ``POST /v1/predict``; live state is not touched)."""
        if not samples:
            return []
        emb = EmbeddingState()
        x = np.asarray([[emb.embed(s) for s in samples]], dtype=np.float32)
        zero = np.zeros((self.layers, 1, self.hidden), np.float32)
        risk = self.session.run(None, {"x": x, "h": zero, "c": zero})[0][0]
        return self._forecasts(risk, samples)

    def _forecasts(self, risk: np.ndarray, samples: list[Sample]) -> list[Forecast]:
        """One Forecast per row of ``risk`` (rows, H), made from ``samples[i]``."""
        ttos = times_to_oom(risk, self._horizons)
        index = self._index
        version = self.version
        new, cls = tuple.__new__, Forecast  # Forecast(...) without its Python-level __new__
        return [
            new(cls, (RiskRow(index, row), tto, sample.ts, version))
            for row, tto, sample in zip(risk.tolist(), ttos, samples, strict=True)
        ]

    @property
    def metadata_features(self) -> list[str]:
        return json.loads(self.metadata["oomcast.features"])
