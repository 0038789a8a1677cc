"""The forecast object every forecaster returns, and the contract forecasters keep.

A forecaster is stepped one sample at a time per memory domain, in batches across domains:
``step(states, samples)`` advances ``states[i]`` by ``samples[i]``. Baselines loop; the LSTM
runs one batched call. The per-domain state is opaque to callers.

``Forecaster`` is all a forecaster must have. What some have beyond it is declared here, one
protocol per ability (``SnapshotForecaster``, ``SlotForecaster``, ``BatchForecaster``,
``WindowForecaster``, ``EmbeddingForecaster``), and callers use it through the functions
below (``export_state``, ``release_state``, ``step_arrays``, ``forecast_window``,
``embedding_version``), which fall back to what every forecaster can do: nothing outside
this module asks a forecaster what it has.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol, cast, runtime_checkable

import numpy as np
import numpy.typing as npt

from oomcast.model.schema import Sample

# A sample's embedding as a node sent it: a float32 row (``emb_f32``) or a list (``emb``).
Embedding = list[float] | npt.NDArray[np.float32]

# Horizons (seconds) at which every forecaster gives P(OOM within horizon). 45 s sits
# between the 30 s of warning an alert must give and a minute: a straight climb that stops
# a minute short of the limit and a leak that goes on look alike until then, so a rule
# that is to warn the leak and spare the climb that stops decides inside that minute.
HORIZONS_S: tuple[int, ...] = (5, 15, 30, 45, 60, 120, 300)


class RiskRow(Mapping[int, float]):
    """horizon_s -> risk, read from one row of a batch without building a dict per domain
    (the model's hot path forecasts thousands of domains per call)."""

    __slots__ = ("_index", "_values")

    def __init__(self, index: dict[int, int], values: list[float]) -> None:
        self._index = index  # shared: horizon_s -> column
        self._values = values

    def __getitem__(self, horizon_s: int) -> float:
        return self._values[self._index[horizon_s]]

    def __iter__(self) -> Iterator[int]:
        return iter(self._index)

    def __len__(self) -> int:
        return len(self._index)

    def __repr__(self) -> str:
        return repr(dict(self))


class Forecast(NamedTuple):
    """One forecast: immutable, and cheap to make by the thousand."""

    risk: Mapping[int, float]  # horizon_s -> probability of OOM within it; never decreasing
    time_to_oom_s: float | None  # best estimate, None when no OOM is in sight
    observed_at: float  # ts of the sample the forecast was made from
    model_version: str

    def risk_at(self, horizon_s: int) -> float:
        try:
            return self.risk[horizon_s]
        except KeyError:
            raise ValueError(
                f"horizon {horizon_s}s is not one of the forecast horizons {sorted(self.risk)}"
            ) from None

    @property
    def max_risk(self) -> float:
        return max(self.risk.values()) if self.risk else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "risk": {str(h): round(p, 6) for h, p in self.risk.items()},
            "time_to_oom_s": None if self.time_to_oom_s is None else round(self.time_to_oom_s, 3),
            "observed_at": self.observed_at,
            "model_version": self.model_version,
        }


class Forecaster(Protocol):
    version: str  # reported as model_version; baselines start with "baseline/"
    horizons_s: tuple[int, ...]

    def init_state(self) -> Any: ...

    def step(
        self,
        states: list[Any],
        samples: list[Sample],
        embeddings: Sequence[Embedding | None] | None = None,
    ) -> list[Forecast]:
        """Advance ``states[i]`` by ``samples[i]``. ``embeddings[i]``, when given, is the
        sample's embedding as the node computed it (matching ``EMBEDDING_VERSION``)."""
        ...


@runtime_checkable
class SnapshotForecaster(Protocol):
    """A forecaster whose per-domain state can be saved and restored, so a replica that
    takes a domain over continues its forecasts instead of starting them cold."""

    def export_state(self, state: Any) -> dict[str, Any]:
        """``state`` as JSON-able values."""
        ...

    def import_state(self, data: Mapping[str, Any]) -> Any:
        """A fresh state holding what ``export_state`` saved; ValueError when malformed."""
        ...


@runtime_checkable
class SlotForecaster(Protocol):
    """A forecaster that keeps states in reusable slots: a state must be given back."""

    def release(self, state: Any) -> None: ...


@runtime_checkable
class BatchForecaster(Protocol):
    """A forecaster that gives a batch as arrays too: ``(forecasts, risk, ttos)``, ``risk``
    with one row per sample and one column per horizon (``horizons_s`` order)."""

    def step_arrays(
        self,
        states: list[Any],
        samples: list[Sample],
        embeddings: Sequence[Embedding | None] | None = None,
    ) -> tuple[list[Forecast], npt.NDArray[np.float32], list[float | None]]: ...


@runtime_checkable
class WindowForecaster(Protocol):
    """A forecaster that forecasts the last sample of a window faster than stepping it."""

    def window_last(self, samples: list[Sample]) -> Forecast: ...


@runtime_checkable
class EmbeddingForecaster(Protocol):
    """A forecaster that reads the embedding nodes send (``model/embedding.py``'s
    ``EMBEDDING_VERSION``); the service decodes only embeddings of this version."""

    embedding_version: int


@functools.cache
def _class_has(cls: type, ability: type) -> bool:
    """Whether instances of ``cls`` have ``ability`` (a protocol of methods), decided once
    per class: a protocol ``isinstance`` costs microseconds, and snapshots ask it for every
    domain. Abilities are declared by the class, not added to one instance."""
    return issubclass(cls, ability)


def _has(forecaster: Forecaster, ability: type) -> bool:
    return _class_has(type(forecaster), ability)


def export_state(forecaster: Forecaster, state: Any) -> dict[str, Any] | None:
    """The domain's state as JSON-able values; None when the forecaster cannot save it."""
    if not _has(forecaster, SnapshotForecaster):
        return None
    return cast(SnapshotForecaster, forecaster).export_state(state)


def import_state(forecaster: Forecaster, data: Mapping[str, Any] | None) -> Any:
    """A state restored from ``export_state``'s values, or a fresh one where there are none
    or the forecaster cannot restore them. ValueError when ``data`` is malformed."""
    if data is None or not _has(forecaster, SnapshotForecaster):
        return forecaster.init_state()
    return cast(SnapshotForecaster, forecaster).import_state(data)


def release_state(forecaster: Forecaster, state: Any) -> None:
    """Give a domain's state back (the ONNX forecaster keeps states in reusable slots)."""
    if _has(forecaster, SlotForecaster):
        cast(SlotForecaster, forecaster).release(state)


def step_arrays(
    forecaster: Forecaster,
    states: list[Any],
    samples: list[Sample],
    embeddings: Sequence[Embedding | None] | None = None,
) -> tuple[list[Forecast], npt.NDArray[np.float32], list[float | None]]:
    """``step``, and the batch as arrays (see ``BatchForecaster``): the forecaster's own
    where it has them, else built from its forecasts."""
    if _has(forecaster, BatchForecaster):
        return cast(BatchForecaster, forecaster).step_arrays(states, samples, embeddings)
    forecasts = forecaster.step(states, samples, embeddings)
    risk = np.asarray(
        [[fc.risk_at(h) for h in forecaster.horizons_s] for fc in forecasts], np.float32
    ).reshape(len(forecasts), len(forecaster.horizons_s))
    return forecasts, risk, [fc.time_to_oom_s for fc in forecasts]


def forecast_window(forecaster: Forecaster, samples: list[Sample]) -> Forecast:
    """The forecast of a window's last sample, from a fresh state stepped through the window
    as a live domain is (live state is not touched). ValueError for an empty window."""
    if not samples:
        raise ValueError("a window needs at least one sample")
    if _has(forecaster, WindowForecaster):
        return cast(WindowForecaster, forecaster).window_last(samples)
    state = forecaster.init_state()
    try:
        forecast = None
        for sample in samples:
            forecast = forecaster.step([state], [sample])[0]
    finally:
        release_state(forecaster, state)
    assert forecast is not None
    return forecast


def embedding_version(forecaster: Forecaster) -> int | None:
    """The embedding version the forecaster reads from nodes; None when it reads none."""
    return forecaster.embedding_version if isinstance(forecaster, EmbeddingForecaster) else None


def risk_from_time_to_oom(
    time_to_oom_s: float | None, horizons_s: tuple[int, ...] = HORIZONS_S
) -> dict[int, float]:
    """A deterministic forecaster's risk: 1 at every horizon the projected OOM falls within."""
    if time_to_oom_s is None:
        return dict.fromkeys(horizons_s, 0.0)
    return {h: 1.0 if time_to_oom_s <= h else 0.0 for h in horizons_s}


@dataclass(frozen=True)
class AlertRule:
    """When a forecast counts as an alert: risk at ``horizon_s`` at least ``fire_risk``, on
    ``fire_after`` consecutive samples of the domain."""

    horizon_s: int = 60
    fire_risk: float = 0.5
    fire_after: int = 1

    def __post_init__(self) -> None:
        if self.horizon_s not in HORIZONS_S:
            raise ValueError(f"horizon_s={self.horizon_s} is not one of {HORIZONS_S}")
        if not 0.0 < self.fire_risk <= 1.0:
            raise ValueError(f"fire_risk={self.fire_risk} must be in (0, 1]")
        if self.fire_after < 1:
            raise ValueError(f"fire_after={self.fire_after} must be at least 1")

    def fires(self, forecast: Forecast) -> bool:
        return forecast.risk_at(self.horizon_s) >= self.fire_risk


@dataclass(frozen=True)
class Detector:
    """A forecaster plus the rule that turns its forecasts into alerts; what evaluate scores."""

    name: str
    forecaster: Forecaster
    rule: AlertRule


def rule_fire_risk(rule: dict[str, Any]) -> float:
    """The firing risk of a rule stored with a model or checkpoint: ``fire_risk``, or
    ``threshold`` in files written before the name was settled (lstm-2026.12.01 and older)."""
    value = rule.get("fire_risk", rule.get("threshold"))
    if value is None:
        raise KeyError("the stored rule has no fire_risk")
    return float(value)
