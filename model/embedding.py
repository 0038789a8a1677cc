"""The memory-access embedding: one dimensionless feature vector per sample.

This module is the single definition used by collectors (which attach ``emb``/``emb_v`` to
every sample they publish), training and the service. Bump ``EMBEDDING_VERSION`` whenever a
feature changes meaning, so a service never feeds a model vectors of another schema (it
recomputes them from the raw fields instead).

Three facts of the domain shape the features (``docs/design.md`` gives the reasons at length):

- **Scale is irrelevant, shape is not.** Every feature is a fraction of capacity, a rate of
  one, a duration or a count: the same curve on a 1 GiB cgroup and a 141 GiB GPU gives the
  same vector. The same curve sampled at 1 Hz or 10 Hz gives nearly the same vector too:
  trends are fitted in trace time, not per sample.
- **Evidence accrues with time.** A domain seconds old has shown no growth yet: the age,
  the time span that supports each trend fit and the fit's noise are inputs, so a young or
  noisy history can be told from a steady climb.
- **What counts is what cannot be reclaimed.** A container's usage includes page cache the
  kernel drops before it kills anything; its anonymous memory (``allocated_bytes`` on a
  host domain) is the *level* that is forecast there. On a GPU the level is what the
  device has in use at its peak (``peak_bytes``, else ``used_bytes``); the allocator's
  slack and retries say whether that is cache or trouble.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from oomcast.model.growth import GROWTH_FEATURES, GrowthTracker
from oomcast.model.schema import Sample, parse_sample

EMBEDDING_VERSION = 7
# Earlier schemas whose features are today's first N, unchanged in meaning: a model trained
# on one of them is fed today's vectors cut to its width (v7 appended three features to v6).
PREFIX_SCHEMAS: dict[int, int] = {6: 45}

# Features of one sample and its predecessor (``embed``).
INSTANT_FEATURES: tuple[str, ...] = (
    "used_frac",
    "allocated_frac",
    "allocated_present",
    "reserved_frac",
    "reserved_present",
    "peak_frac",  # highest use since the previous sample; used_frac when not reported
    "peak_present",
    "slack_frac",  # (reserved - allocated) / total: memory the allocator holds but no tensor uses
    "level_frac",  # the level forecast: anon on a host domain, the peak on a GPU
    "headroom_log10",  # log10 of the free fraction above the level, in [-3, 0]
    "log1p_retries_delta",  # allocator retries (or cgroup failcnt) since the previous sample
    "retries_present",
    "log1p_dt_s",  # seconds since the previous sample: intervals vary by source
    "is_gpu",
)
# Features of the domain's history (``EmbeddingState``). A trend is the slope of an
# exponentially weighted least-squares line through the level over the trailing ``tau``
# seconds (weights by age in seconds, so the slope of a straight line is exact from the
# second sample on, at any sampling rate). ``span`` is the weighted spread of the fit's
# sample times divided by tau: 0 for one sample, about 1 after a few tau of history; it is
# how much time the trend stands on. ``resid`` is the fit's residual spread in percent of
# capacity (a sawtooth is noisy, a leak is not). Times to full are what the fitted line
# projects, squashed to [0, 1] (0: full now, 1: an hour or more away, or not growing).
CONTEXT_FEATURES: tuple[str, ...] = (
    "trend_30s_pct_per_s",
    "trend_300s_pct_per_s",
    "resid_30s_pct",
    "resid_300s_pct",
    "span_30s",
    "span_300s",
    "time_to_full_30s",
    "time_to_full_300s",
    "recent_peak_frac",  # highest level, decaying with a 300 s time constant
    "max_peak_frac",  # highest level since the job started
    "max_peak_rise_300s_pct_per_s",  # how fast max_peak_frac rose, averaged over ~300 s
    "time_to_full_max_peak",  # (1 - max peak) / its rise
    "log1p_age_s",
    "allocated_trend_300s_pct_per_s",  # 0 when allocated is not reported (or is the level)
    "time_to_full_allocated_300s",  # 1 when not reported
    "log1p_retries_per_min",  # allocator retries / failcnt, exponentially averaged
    # growth beyond noise, from per-second buckets (``model/growth.py``)
    *GROWTH_FEATURES,
)
TIME_TO_FULL_CAP_S = 3600.0
FEATURES = INSTANT_FEATURES + CONTEXT_FEATURES
N_FEATURES = len(FEATURES)
N_INSTANT = len(INSTANT_FEATURES)
LEVEL = INSTANT_FEATURES.index("level_frac")
PEAK = INSTANT_FEATURES.index("peak_frac")
ALLOCATED = INSTANT_FEATURES.index("allocated_frac")
RETRIES = INSTANT_FEATURES.index("log1p_retries_delta")
FAST_TAU_S = 30.0
SLOW_TAU_S = 300.0


@dataclass(slots=True)
class TrendFit:
    """Exponentially weighted least squares of a level against time, in running sums kept
    relative to the newest sample (t = 0 now, t < 0 before), so they stay well conditioned
    over any run length."""

    tau_s: float
    s0: float = 0.0
    st: float = 0.0
    stt: float = 0.0
    sy: float = 0.0
    sty: float = 0.0
    syy: float = 0.0

    def update(self, y: float, dt: float) -> None:
        if self.s0 > 0.0:
            w = math.exp(-dt / self.tau_s)
            # shift every past time by -dt, then decay
            self.stt = w * (self.stt - 2.0 * dt * self.st + dt * dt * self.s0)
            self.sty = w * (self.sty - dt * self.sy)
            self.st = w * (self.st - dt * self.s0)
            self.s0 *= w
            self.sy *= w
            self.syy *= w
        self.s0 += 1.0
        self.sy += y
        self.syy += y * y

    def fit(self) -> tuple[float, float, float, float]:
        """(level now, slope per s, residual std, span / tau) of the weighted line."""
        if self.s0 <= 0.0:
            return 0.0, 0.0, 0.0, 0.0
        mt, my = self.st / self.s0, self.sy / self.s0
        vtt = max(0.0, self.stt / self.s0 - mt * mt)
        vty = self.sty / self.s0 - mt * my
        vyy = max(0.0, self.syy / self.s0 - my * my)
        span = math.sqrt(vtt)
        if span < 1e-3:  # one instant: no line yet
            return my, 0.0, math.sqrt(vyy), 0.0
        slope = vty / vtt
        resid = math.sqrt(max(0.0, vyy - slope * vty))
        return my - slope * mt, slope, resid, min(2.0, span / self.tau_s)

    def sums(self) -> list[float]:
        return [self.s0, self.st, self.stt, self.sy, self.sty, self.syy]

    @classmethod
    def from_sums(cls, tau_s: float, sums: Any, name: str) -> TrendFit:
        if not isinstance(sums, list) or len(sums) != 6:
            raise ValueError(f"{name}: must be a list of 6 running sums")
        values = [finite_number(v, f"{name}[{i}]") for i, v in enumerate(sums)]
        return cls(tau_s, *values)


@dataclass(slots=True)
class EmbeddingState:
    """What the embedding remembers of a domain: its previous sample and running fits."""

    prev: Sample | None = None
    first_ts: float | None = None
    fast: TrendFit = field(default_factory=lambda: TrendFit(FAST_TAU_S))
    slow: TrendFit = field(default_factory=lambda: TrendFit(SLOW_TAU_S))
    alloc: TrendFit = field(default_factory=lambda: TrendFit(SLOW_TAU_S))
    recent_peak: float = 0.0
    max_peak: float = 0.0
    max_rise: float = 0.0
    retries_rate: float = 0.0  # per minute, exponentially averaged over ~60 s
    growth: GrowthTracker = field(default_factory=GrowthTracker)

    def embed(self, sample: Sample) -> list[float]:
        vec = embed(sample, self.prev)
        first = self.first_ts is None
        dt = 0.0 if self.prev is None else max(0.0, sample.ts - self.prev.ts)
        level = vec[LEVEL]
        self.fast.update(level, dt)
        self.slow.update(level, dt)
        now_fast, trend_fast, resid_fast, span_fast = self.fast.fit()
        now_slow, trend_slow, resid_slow, span_slow = self.slow.fit()
        # allocated gets its own trend on a GPU: a caching allocator can hold the whole
        # device reserved for hours without harm while live tensors creep to the limit
        if sample.allocated_bytes is not None and sample.kind == "gpu":
            self.alloc.update(vec[ALLOCATED], dt)
            alloc_now, alloc_slope, _, _ = self.alloc.fit()
            trend_alloc = _pct(alloc_slope)
            ttf_alloc = time_to_full(1.0 - alloc_now, trend_alloc)
        else:
            trend_alloc, ttf_alloc = 0.0, 1.0
        self.recent_peak = max(level, self.recent_peak * math.exp(-dt / 300.0))
        # the rise of the all-time high as an exponentially weighted rate: each new high adds
        # its step / tau, and the sum decays with tau (the first sample sets the level only)
        if first:
            self.first_ts = sample.ts
            self.max_peak = level
        else:
            rise = max(0.0, level - self.max_peak) * 100.0
            self.max_rise = self.max_rise * math.exp(-dt / 300.0) + rise / 300.0
            self.max_peak = max(self.max_peak, level)
            retries = math.expm1(vec[RETRIES])
            decay = math.exp(-dt / 60.0)
            self.retries_rate = self.retries_rate * decay + retries * (1.0 - decay) * 60.0 / max(
                dt, 1e-3
            )
        self.prev = sample
        max_rise = min(10.0, self.max_rise)
        assert self.first_ts is not None
        t_fast, t_slow = _pct(trend_fast), _pct(trend_slow)
        vec.extend(
            (
                t_fast,
                t_slow,
                min(50.0, resid_fast * 100.0),
                min(50.0, resid_slow * 100.0),
                span_fast,
                span_slow,
                time_to_full(1.0 - max(level, now_fast), t_fast),
                time_to_full(1.0 - max(level, now_slow), t_slow),
                self.recent_peak,
                self.max_peak,
                max_rise,
                time_to_full(1.0 - self.max_peak, max_rise),
                math.log1p(max(0.0, sample.ts - self.first_ts)),
                trend_alloc,
                ttf_alloc,
                math.log1p(min(1e4, self.retries_rate)),
            )
        )
        vec.extend(self.growth.update(sample.ts, level))
        return vec

    def to_dict(self) -> dict[str, Any]:
        """Everything the embedding remembers, as JSON-able values (a replica that takes a
        domain over continues its trends instead of starting them from nothing)."""
        return {
            "prev": None if self.prev is None else sample_dict(self.prev),
            "first_ts": self.first_ts,
            "fast": self.fast.sums(),
            "slow": self.slow.sums(),
            "alloc": self.alloc.sums(),
            "recent_peak": self.recent_peak,
            "max_peak": self.max_peak,
            "max_rise": self.max_rise,
            "retries_rate": self.retries_rate,
            "growth": self.growth.to_dict(),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> EmbeddingState:
        """The inverse of ``to_dict``; ValueError, naming the key, on anything malformed."""
        if not isinstance(data, Mapping):
            raise ValueError("embedding state must be an object")
        prev = data.get("prev")
        if prev is not None and not isinstance(prev, dict):
            raise ValueError("embedding state prev: must be a sample object")
        first_ts = data.get("first_ts")
        return cls(
            prev=None if prev is None else parse_sample(prev),
            first_ts=None if first_ts is None else finite_number(first_ts, "first_ts"),
            fast=TrendFit.from_sums(FAST_TAU_S, data.get("fast"), "fast"),
            slow=TrendFit.from_sums(SLOW_TAU_S, data.get("slow"), "slow"),
            alloc=TrendFit.from_sums(SLOW_TAU_S, data.get("alloc"), "alloc"),
            recent_peak=finite_number(data.get("recent_peak"), "recent_peak"),
            max_peak=finite_number(data.get("max_peak"), "max_peak"),
            max_rise=finite_number(data.get("max_rise"), "max_rise"),
            retries_rate=finite_number(data.get("retries_rate"), "retries_rate"),
            growth=GrowthTracker.from_dict(data.get("growth")),
        )


_SAMPLE_FIELDS = tuple(f.name for f in fields(Sample))


def sample_dict(sample: Sample) -> dict[str, Any]:
    """``sample.to_dict()`` without ``dataclasses.asdict``'s deep copy (a snapshot of every
    domain makes one or two per domain)."""
    return {k: v for k in _SAMPLE_FIELDS if (v := getattr(sample, k)) is not None}


def finite_number(value: Any, name: str) -> float:
    """``value`` as a float, or ValueError naming ``name`` (restoring a saved state)."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{name}: must be a finite number, got {value!r}")
    return float(value)


def _pct(slope_frac_per_s: float) -> float:
    return max(-10.0, min(10.0, slope_frac_per_s * 100.0))


def time_to_full(headroom_frac: float, rate_pct_per_s: float) -> float:
    """Seconds until ``headroom_frac`` of capacity is used up at ``rate_pct_per_s``, on a log
    scale in [0, 1]: 0 is now (or already over), 1 is ``TIME_TO_FULL_CAP_S`` or never."""
    if headroom_frac <= 0.0:
        return 0.0
    if rate_pct_per_s <= 1e-6:
        return 1.0
    seconds = min(TIME_TO_FULL_CAP_S, headroom_frac * 100.0 / rate_pct_per_s)
    return math.log1p(seconds) / math.log1p(TIME_TO_FULL_CAP_S)


def seconds_to_full(squashed: float) -> float:
    """The inverse of ``time_to_full``'s squashing: seconds from a value in [0, 1]."""
    return math.expm1(squashed * math.log1p(TIME_TO_FULL_CAP_S))


def _frac(value: int | None, total: int) -> tuple[float, float]:
    return (0.0, 0.0) if value is None else (value / total, 1.0)


def level_frac(sample: Sample) -> float:
    """The level the embedding forecasts, as a fraction of capacity: on a host domain its
    anonymous memory plus whatever the peak saw above usage; on a GPU its peak (or use)."""
    total = sample.total_bytes
    used = sample.used_bytes / total
    peak = used if sample.peak_bytes is None else sample.peak_bytes / total
    if sample.kind == "host" and sample.allocated_bytes is not None:
        return sample.allocated_bytes / total + max(0.0, peak - used)
    return max(peak, used)


def embed(sample: Sample, prev: Sample | None) -> list[float]:
    """The instant features (``INSTANT_FEATURES``) of one sample; ``EmbeddingState`` adds the
    context features that complete the vector."""
    total = sample.total_bytes
    used = sample.used_bytes / total
    alloc, alloc_m = _frac(sample.allocated_bytes, total)
    resv, resv_m = _frac(sample.reserved_bytes, total)
    peak, peak_m = _frac(sample.peak_bytes, total)
    if not peak_m:
        peak = used
    slack = resv - alloc if alloc_m and resv_m else 0.0
    # host: anon memory, plus whatever the peak saw above usage (a spike between samples)
    level = alloc + max(0.0, peak - used) if sample.kind == "host" and alloc_m else max(peak, used)
    if prev is None:
        dt = 0.0
        retries_delta, retries_m = 0.0, float(sample.alloc_retries is not None)
    else:
        dt = max(0.0, sample.ts - prev.ts)
        if sample.alloc_retries is not None and prev.alloc_retries is not None:
            retries_delta = math.log1p(max(0, sample.alloc_retries - prev.alloc_retries))
            retries_m = 1.0
        else:
            retries_delta, retries_m = 0.0, 0.0
    return [
        used,
        alloc,
        alloc_m,
        resv,
        resv_m,
        peak,
        peak_m,
        slack,
        level,
        math.log10(max(1e-3, min(1.0, 1.0 - level))),
        retries_delta,
        retries_m,
        math.log1p(dt),
        1.0 if sample.kind == "gpu" else 0.0,
    ]


# The cadence of the network (``docs/design.md``): the LSTM commits a step once per tick of
# trace time; samples in between are forecast from the last committed state without moving
# it. A sample counts as the next tick once 93% of a tick has passed, so a 1 Hz source with
# jitter still ticks on every sample (and a 10 Hz one ticks on every tenth, not on the float
# rounding of the ninth).
TICK_TOLERANCE = 0.93


def tick_due(last_tick_ts: float | None, ts: float, tick_s: float) -> bool:
    return last_tick_ts is None or ts - last_tick_ts >= TICK_TOLERANCE * tick_s


def tick_rows(ts: list[float], tick_s: float) -> list[int]:
    """Indices of the samples (timestamps ``ts``, in order) at which the network ticks."""
    rows: list[int] = []
    last: float | None = None
    for i, t in enumerate(ts):
        if tick_due(last, t, tick_s):
            rows.append(i)
            last = t
    return rows
