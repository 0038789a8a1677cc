"""Baseline forecasters: the rules SREs run today, implemented faithfully.

They exist to be beaten, so they are implemented as their users run them, not as straw men:

* ``threshold``: used/total at or above a fraction (a Grafana alert on memory use).
* ``predict_linear``: Prometheus' ``predict_linear(used[window], horizon) >= total``: an
  ordinary least-squares line through the samples of the trailing window, evaluated
  ``horizon`` seconds after the newest sample; optionally gated on current use.
* ``kubelet``: the eviction check, ``available < 100Mi``, evaluated on the kubelet's
  10 s housekeeping period (a decision holds until the next poll).

Each gives risk 0 or 1 per horizon and, where it projects one, a time to OOM.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.embedding import finite_number
from oomcast.model.forecast import (
    HORIZONS_S,
    AlertRule,
    Detector,
    Forecast,
    risk_from_time_to_oom,
)
from oomcast.model.schema import Sample

MIB = 1 << 20
# Below this growth (used fraction per second: 1% a day) a fitted slope is rounding noise of
# the running sums, not a trend; projecting from it would give absurd times to OOM.
MIN_SLOPE_PER_S = 1e-7
REBASE_AFTER_S = 3600.0


class ThresholdBaseline:
    def __init__(self, used_frac: float) -> None:
        if not 0.0 < used_frac <= 1.0:
            raise ValueError(f"used_frac={used_frac} must be in (0, 1]")
        self.used_frac = used_frac
        self.version = f"baseline/threshold_{used_frac:.2f}"
        self.horizons_s = HORIZONS_S

    def init_state(self) -> None:
        return None

    def export_state(self, state: None) -> dict[str, Any]:
        return {}  # stateless

    def import_state(self, data: Mapping[str, Any]) -> None:
        return None

    def step(
        self, states: list[None], samples: list[Sample], embeddings: object = None
    ) -> list[Forecast]:
        out = []
        for sample in samples:
            over = sample.used_frac >= self.used_frac
            out.append(
                Forecast(
                    risk=dict.fromkeys(self.horizons_s, 1.0 if over else 0.0),
                    time_to_oom_s=None,
                    observed_at=sample.ts,
                    model_version=self.version,
                )
            )
        return out


@dataclass
class _LinearState:
    points: deque[tuple[float, float]] = field(default_factory=deque)  # (ts - t0, used_frac)
    t0: float | None = None
    n: int = 0
    sx: float = 0.0
    sy: float = 0.0
    sxx: float = 0.0
    sxy: float = 0.0

    def add(self, x: float, y: float) -> None:
        self.points.append((x, y))
        self.n += 1
        self.sx += x
        self.sy += y
        self.sxx += x * x
        self.sxy += x * y

    def rebase(self) -> None:
        """Move the origin to the oldest point kept, so x and the sums stay small however
        long the domain lives (the degeneracy guard scales with x squared)."""
        assert self.t0 is not None and self.points
        shift = self.points[0][0]
        self.t0 += shift
        points = [(x - shift, y) for x, y in self.points]
        self.points.clear()
        self.n = 0
        self.sx = self.sy = self.sxx = self.sxy = 0.0
        for x, y in points:
            self.add(x, y)

    def drop_before(self, x_min: float) -> None:
        while self.points and self.points[0][0] < x_min:
            x, y = self.points.popleft()
            self.n -= 1
            self.sx -= x
            self.sy -= y
            self.sxx -= x * x
            self.sxy -= x * y


class PredictLinearBaseline:
    """Least-squares projection of the used fraction over a trailing window.

    Running sums keep a step O(1) amortized; x is seconds since the domain's first sample
    and y the used fraction, so the sums stay small enough for float64 to be exact enough.
    """

    def __init__(
        self,
        window_s: float,
        horizon_s: int,
        gate_frac: float | None = None,
        full_window: bool = False,
    ) -> None:
        if not window_s > 0 or window_s == float("inf"):
            raise ValueError(f"window_s={window_s} must be a positive number of seconds")
        if horizon_s not in HORIZONS_S:
            raise ValueError(f"horizon_s={horizon_s} must be one of {HORIZONS_S}")
        if gate_frac is not None and not 0.0 < gate_frac < 1.0:
            raise ValueError(f"gate_frac={gate_frac} must be in (0, 1)")
        self.window_s = window_s
        self.horizon_s = horizon_s
        self.gate_frac = gate_frac
        # Like an alert with `for: <window>`: no projection until the window has filled once,
        # so a job's start-up (weights landing on the GPU) is not read as a leak.
        self.full_window = full_window
        gate = f"_gate{gate_frac:.2f}" if gate_frac is not None else ""
        full = "_full" if full_window else ""
        self.version = f"baseline/predict_linear_w{window_s:g}s_h{horizon_s}s{gate}{full}"
        self.horizons_s = HORIZONS_S

    def init_state(self) -> _LinearState:
        return _LinearState()

    def export_state(self, state: _LinearState) -> dict[str, Any]:
        """The window's points and the running sums, exactly as they stand (recomputing the
        sums from the points would round differently from the ones being carried)."""
        return {
            "points": [[x, y] for x, y in state.points],
            "t0": state.t0,
            "sums": [state.sx, state.sy, state.sxx, state.sxy],
        }

    def import_state(self, data: Mapping[str, Any]) -> _LinearState:
        points, sums, t0 = data.get("points"), data.get("sums"), data.get("t0")
        if not isinstance(points, list) or not all(
            isinstance(p, list) and len(p) == 2 for p in points
        ):
            raise ValueError("predict_linear state points: must be a list of [x, y] pairs")
        if not isinstance(sums, list) or len(sums) != 4:
            raise ValueError("predict_linear state sums: must be a list of 4 numbers")
        if (t0 is None) != (not points):
            raise ValueError("predict_linear state: t0 and points must be set together")
        st = _LinearState(t0=None if t0 is None else finite_number(t0, "t0"))
        st.points.extend(
            (finite_number(x, "points.x"), finite_number(y, "points.y")) for x, y in points
        )
        st.n = len(st.points)
        st.sx, st.sy, st.sxx, st.sxy = (finite_number(v, "sums") for v in sums)
        return st

    def _time_to_oom(self, st: _LinearState, sample: Sample) -> float | None:
        if st.n < 2:
            return None
        if self.full_window and st.points[-1][0] < self.window_s:
            return None
        denom = st.n * st.sxx - st.sx * st.sx
        x_now = st.points[-1][0]
        if denom <= 1e-12 * max(1.0, x_now * x_now) * st.n * st.n:
            return None  # all points at (almost) one instant: no slope to speak of
        slope = (st.n * st.sxy - st.sx * st.sy) / denom  # used fraction per second
        if slope <= MIN_SLOPE_PER_S:
            return None
        intercept = (st.sy - slope * st.sx) / st.n
        fitted_now = intercept + slope * x_now
        return max(0.0, (1.0 - fitted_now) / slope)

    def step(
        self, states: list[_LinearState], samples: list[Sample], embeddings: object = None
    ) -> list[Forecast]:
        out = []
        for st, sample in zip(states, samples, strict=True):
            if st.t0 is None:
                st.t0 = sample.ts
            x = sample.ts - st.t0
            st.add(x, sample.used_frac)
            st.drop_before(x - self.window_s)
            if st.points[0][0] > REBASE_AFTER_S:
                st.rebase()
            tto = self._time_to_oom(st, sample)
            if self.gate_frac is not None and sample.used_frac < self.gate_frac:
                tto = None
            out.append(
                Forecast(
                    risk=risk_from_time_to_oom(tto, self.horizons_s),
                    time_to_oom_s=tto,
                    observed_at=sample.ts,
                    model_version=self.version,
                )
            )
        return out


@dataclass
class _KubeletState:
    next_poll_ts: float | None = None
    under: bool = False


class KubeletBaseline:
    def __init__(self, available_bytes: int = 100 * MIB, poll_s: float = 10.0) -> None:
        if available_bytes <= 0:
            raise ValueError(f"available_bytes={available_bytes} must be positive")
        if not poll_s > 0:
            raise ValueError(f"poll_s={poll_s} must be positive")
        self.available_bytes = available_bytes
        self.poll_s = poll_s
        self.version = f"baseline/kubelet_{available_bytes // MIB}MiB_{poll_s:g}s"
        self.horizons_s = HORIZONS_S

    def init_state(self) -> _KubeletState:
        return _KubeletState()

    def export_state(self, state: _KubeletState) -> dict[str, Any]:
        return {"next_poll_ts": state.next_poll_ts, "under": state.under}

    def import_state(self, data: Mapping[str, Any]) -> _KubeletState:
        nxt, under = data.get("next_poll_ts"), data.get("under")
        if not isinstance(under, bool):
            raise ValueError(f"kubelet state under: must be true or false, got {under!r}")
        return _KubeletState(None if nxt is None else finite_number(nxt, "next_poll_ts"), under)

    def step(
        self, states: list[_KubeletState], samples: list[Sample], embeddings: object = None
    ) -> list[Forecast]:
        out = []
        for st, sample in zip(states, samples, strict=True):
            if st.next_poll_ts is None or sample.ts >= st.next_poll_ts:
                st.under = sample.total_bytes - sample.used_bytes < self.available_bytes
                st.next_poll_ts = sample.ts + self.poll_s
            out.append(
                Forecast(
                    risk=dict.fromkeys(self.horizons_s, 1.0 if st.under else 0.0),
                    time_to_oom_s=None,
                    observed_at=sample.ts,
                    model_version=self.version,
                )
            )
        return out


def baseline_detectors() -> Iterator[Detector]:
    """Every baseline as evaluate scores it, named after its rule."""
    for frac in (0.90, 0.95):
        fc = ThresholdBaseline(frac)
        yield Detector(fc.version.removeprefix("baseline/"), fc, AlertRule(5, 0.5))
    for window_s, horizon_s, gate, full in (
        (60, 60, None, False),
        (120, 120, None, False),
        (300, 300, None, False),
        (120, 120, 0.60, False),
        (60, 60, 0.80, True),
    ):
        fc_lin = PredictLinearBaseline(window_s, horizon_s, gate, full)
        yield Detector(fc_lin.version.removeprefix("baseline/"), fc_lin, AlertRule(horizon_s, 0.5))
    fc_k = KubeletBaseline()
    yield Detector(fc_k.version.removeprefix("baseline/"), fc_k, AlertRule(5, 0.5))


def baseline_by_name(name: str) -> Detector:
    names = []
    for det in baseline_detectors():
        if det.name == name or det.forecaster.version == name:
            return det
        names.append(det.name)
    raise ValueError(f"unknown baseline {name!r}; choose one of: {', '.join(names)}")
