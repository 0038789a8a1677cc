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
from dataclasses import dataclass

from oomcast.model.schema import Sample

EMBEDDING_VERSION = 2

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
# (a job's start-up climbs fast and then levels off; a leak does not).
CONTEXT_FEATURES: tuple[str, ...] = (
    "trend_30s_pct_per_s",
    "trend_300s_pct_per_s",
    "recent_peak_frac",  # highest peak_frac, decaying with a 300 s time constant
    "log1p_age_s",
)
FEATURES = INSTANT_FEATURES + CONTEXT_FEATURES
N_FEATURES = len(FEATURES)
N_INSTANT = len(INSTANT_FEATURES)


@dataclass(slots=True)
class EmbeddingState:
    """What the embedding remembers of a domain: its previous sample and running trends."""

    prev: Sample | None = None
    first_ts: float | None = None
    trend_fast: float = 0.0
    trend_slow: float = 0.0
    recent_peak: float = 0.0

    def embed(self, sample: Sample) -> list[float]:
        vec = embed(sample, self.prev)
        dt = 0.0 if self.prev is None else max(0.0, sample.ts - self.prev.ts)
        rate = vec[FEATURES.index("used_frac_per_s")] * 100.0  # percent of capacity per second
        for name, tau in (("trend_fast", 30.0), ("trend_slow", 300.0)):
            alpha = 1.0 - math.exp(-dt / tau) if dt > 0 else 0.0
            setattr(self, name, getattr(self, name) + alpha * (rate - getattr(self, name)))
        peak = vec[FEATURES.index("peak_frac")]
        self.recent_peak = max(peak, self.recent_peak * math.exp(-dt / 300.0))
        if self.first_ts is None:
            self.first_ts = sample.ts
        self.prev = sample
        vec.extend(
            (
                max(-10.0, min(10.0, self.trend_fast)),
                max(-10.0, min(10.0, self.trend_slow)),
                self.recent_peak,
                math.log1p(sample.ts - self.first_ts),
            )
        )
        return vec


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
