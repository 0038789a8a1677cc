"""The memory-access embedding: one dimensionless feature vector per sample.

This module is the single definition used by collectors (which attach ``emb``/``emb_v`` to
every sample they publish), training and the service. Features are fractions of capacity or
rates of them, so a 16 GB GPU and a 2 GB container look alike; an optional field that is
missing is flagged by a mask feature rather than silently read as zero. Bump
``EMBEDDING_VERSION`` whenever a feature changes meaning, so a service never feeds a model
vectors of another schema (it recomputes them from the raw fields instead).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from oomcast.model.schema import Sample

EMBEDDING_VERSION = 3

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
    "used_frac_per_s",  # growth rate since the previous sample, clipped to +-1/s
    "log1p_retries_delta",  # allocator retries (or cgroup failcnt) since the previous sample
    "retries_present",
    "log1p_dt_s",  # seconds since the previous sample: intervals vary by source
    "headroom_log2_gib",  # log2 of free GiB, clipped: 100 MiB free is not 10% free on every size
    "is_gpu",
)
# Features that summarize the domain's history (``EmbeddingState``): trends over two time
# scales in percent of capacity per second, the recent high-water mark, and the domain's age
# (a job's start-up climbs fast and then levels off; a leak does not). The high-water mark
# since the job started and how fast it keeps rising catch jobs whose spikes grow (an eval
# that keeps more each time, a checkpoint on top of a creep) while the average stays flat.
# Allocated memory gets its own trend: a caching allocator can hold the whole GPU reserved
# for hours without harm, while what tensors really hold creeps towards the limit.
# The time-to-full features are what predict_linear would compute, squashed to [0, 1]
# (0: full now, 1: an hour or more away, or not growing), so the network need not divide.
CONTEXT_FEATURES: tuple[str, ...] = (
    "trend_30s_pct_per_s",
    "trend_300s_pct_per_s",
    "recent_peak_frac",  # highest peak_frac, decaying with a 300 s time constant
    "log1p_age_s",
    "max_peak_frac",  # highest peak_frac since the job started
    "max_peak_rise_300s_pct_per_s",  # how fast max_peak_frac rose, averaged over ~300 s
    "time_to_full_30s",  # (1 - recent peak) / 30 s trend
    "time_to_full_300s",  # (1 - recent peak) / 300 s trend
    "time_to_full_max_peak",  # (1 - max peak) / its rise
    "allocated_trend_300s_pct_per_s",  # 0 when allocated is not reported
    "time_to_full_allocated_300s",  # (1 - allocated) / its trend; 1 when not reported
)
TIME_TO_FULL_CAP_S = 3600.0
FEATURES = INSTANT_FEATURES + CONTEXT_FEATURES
N_FEATURES = len(FEATURES)
N_INSTANT = len(INSTANT_FEATURES)
# A trend over time scale T is read off two exponential moving averages of the level, with
# time constants a and b (b - a = T): on a steady climb of s per second the slower one lags
# the faster by s * T. Unlike an average of sample-to-sample rates, this does not depend on
# how often samples come, and a step's sawtooth averages out instead of being clipped.
FAST_TAUS_S = (10.0, 40.0)
SLOW_TAUS_S = (60.0, 360.0)


@dataclass(slots=True)
class _Trend:
    a: float = 0.0
    b: float = 0.0

    def update(self, level: float, dt: float, taus: tuple[float, float], first: bool) -> float:
        """Advance by a sample at ``level`` ``dt`` seconds on; the trend in percent per s."""
        if first:
            self.a = self.b = level
        else:
            self.a += (1.0 - math.exp(-dt / taus[0])) * (level - self.a)
            self.b += (1.0 - math.exp(-dt / taus[1])) * (level - self.b)
        return max(-10.0, min(10.0, (self.a - self.b) * 100.0 / (taus[1] - taus[0])))


@dataclass(slots=True)
class EmbeddingState:
    """What the embedding remembers of a domain: its previous sample and running trends."""

    prev: Sample | None = None
    first_ts: float | None = None
    fast: _Trend = field(default_factory=_Trend)
    slow: _Trend = field(default_factory=_Trend)
    alloc: _Trend = field(default_factory=_Trend)
    alloc_seen: bool = False
    recent_peak: float = 0.0
    max_peak: float = 0.0
    max_rise: float = 0.0

    def embed(self, sample: Sample) -> list[float]:
        vec = embed(sample, self.prev)
        first = self.first_ts is None
        dt = 0.0 if self.prev is None else max(0.0, sample.ts - self.prev.ts)
        used = vec[0]
        trend_fast = self.fast.update(used, dt, FAST_TAUS_S, first)
        trend_slow = self.slow.update(used, dt, SLOW_TAUS_S, first)
        if sample.allocated_bytes is not None:
            allocated = vec[1]
            trend_alloc = self.alloc.update(allocated, dt, SLOW_TAUS_S, not self.alloc_seen)
            self.alloc_seen = True
            ttf_alloc = time_to_full(1.0 - allocated, trend_alloc)
        else:
            trend_alloc, ttf_alloc = 0.0, 1.0
        peak = vec[5]  # peak_frac
        self.recent_peak = max(peak, self.recent_peak * math.exp(-dt / 300.0))
        # the rise of the all-time high as an exponentially weighted rate: each new high adds
        # its step / tau, and the sum decays with tau (the first sample sets the level only)
        if first:
            self.first_ts = sample.ts
            self.max_peak = peak
        else:
            rise = max(0.0, peak - self.max_peak) * 100.0
            self.max_rise = self.max_rise * math.exp(-dt / 300.0) + rise / 300.0
            self.max_peak = max(self.max_peak, peak)
        self.prev = sample
        max_rise = min(10.0, self.max_rise)
        assert self.first_ts is not None
        vec.extend(
            (
                trend_fast,
                trend_slow,
                self.recent_peak,
                math.log1p(sample.ts - self.first_ts),
                self.max_peak,
                max_rise,
                time_to_full(1.0 - self.recent_peak, trend_fast),
                time_to_full(1.0 - self.recent_peak, trend_slow),
                time_to_full(1.0 - self.max_peak, max_rise),
                trend_alloc,
                ttf_alloc,
            )
        )
        return vec


def time_to_full(headroom_frac: float, rate_pct_per_s: float) -> float:
    """Seconds until ``headroom_frac`` of capacity is used up at ``rate_pct_per_s``, on a log
    scale in [0, 1]: 0 is now (or already over), 1 is ``TIME_TO_FULL_CAP_S`` or never."""
    if headroom_frac <= 0.0:
        return 0.0
    if rate_pct_per_s <= 1e-6:
        return 1.0
    seconds = min(TIME_TO_FULL_CAP_S, headroom_frac * 100.0 / rate_pct_per_s)
    return math.log1p(seconds) / math.log1p(TIME_TO_FULL_CAP_S)


def _frac(value: int | None, total: int) -> tuple[float, float]:
    return (0.0, 0.0) if value is None else (value / total, 1.0)


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
    if prev is None:
        dt = 0.0
        rate = 0.0
        retries_delta, retries_m = 0.0, float(sample.alloc_retries is not None)
    else:
        dt = max(0.0, sample.ts - prev.ts)
        prev_used = prev.used_bytes / prev.total_bytes
        rate = (used - prev_used) / dt if dt > 0 else 0.0
        rate = max(-1.0, min(1.0, rate))
        if sample.alloc_retries is not None and prev.alloc_retries is not None:
            retries_delta = math.log1p(max(0, sample.alloc_retries - prev.alloc_retries))
            retries_m = 1.0
        else:
            retries_delta, retries_m = 0.0, 0.0
    free_gib = max(total - sample.used_bytes, 0) / (1 << 30)
    headroom = max(-10.0, min(8.0, math.log2(free_gib + 1e-3)))
    return [
        used,
        alloc,
        alloc_m,
        resv,
        resv_m,
        peak,
        peak_m,
        slack,
        rate,
        retries_delta,
        retries_m,
        math.log1p(dt),
        headroom,
        1.0 if sample.kind == "gpu" else 0.0,
    ]
