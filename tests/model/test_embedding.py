"""model/embedding.py: the per-sample feature vector, its trend fits and the tick cadence."""

from __future__ import annotations

import itertools
import json
import math
import random

import numpy as np
import pytest

from oomcast.model.embedding import (
    CONTEXT_FEATURES,
    EMBEDDING_VERSION,
    FEATURES,
    INSTANT_FEATURES,
    N_FEATURES,
    N_INSTANT,
    TIME_TO_FULL_CAP_S,
    EmbeddingState,
    TrendFit,
    embed,
    seconds_to_full,
    tick_due,
    tick_rows,
    time_to_full,
)
from oomcast.model.growth import GROWTH_FEATURES
from oomcast.model.schema import Sample

T0 = 1_750_000_000.0
GIB = 1 << 30
IDX = {name: i for i, name in enumerate(FEATURES)}


def smp(
    ts: float = T0,
    total: int = 80 * GIB,
    used: float = 0.5,
    *,
    kind: str = "gpu",
    allocated: float | None = None,
    reserved: float | None = None,
    peak: float | None = None,
    retries: int | None = None,
) -> Sample:
    """Fractions of total in, whole bytes out."""

    def b(frac: float | None) -> int | None:
        return None if frac is None else int(frac * total)

    return Sample(
        ts=ts,
        node="n1",
        device="gpu0" if kind == "gpu" else "cgroup:/job",
        kind=kind,
        total_bytes=total,
        used_bytes=int(used * total),
        allocated_bytes=b(allocated),
        reserved_bytes=b(reserved),
        peak_bytes=b(peak),
        alloc_retries=retries,
    )


def feat(vec: list[float], name: str) -> float:
    return vec[IDX[name]]


def squashed(seconds: float) -> float:
    return math.log1p(seconds) / math.log1p(TIME_TO_FULL_CAP_S)


# --- the schema ----------------------------------------------------------------------------


def test_feature_names_are_unique_and_counted() -> None:
    assert len(set(FEATURES)) == len(FEATURES) == N_FEATURES == 48
    assert FEATURES == INSTANT_FEATURES + CONTEXT_FEATURES
    assert FEATURES[:N_INSTANT] == INSTANT_FEATURES and N_INSTANT == 14
    assert EMBEDDING_VERSION == 7
    # v7: the largest fall in 120 s and the pace of the last 10 s, appended (a network
    # trained on v6 reads the first 45: training/graft.py)
    assert FEATURES[-3:] == ("drawdown_120s", "slope_10s_pct_per_s", "slope_se_10s_pct_per_s")
    # v5: growth beyond noise over 15-120 s, the projection to the limit, its age
    assert FEATURES[-len(GROWTH_FEATURES) :] == GROWTH_FEATURES
    # v4: the level and its log headroom replace the per-sample rate and the absolute GiB
    assert {"level_frac", "headroom_log10", "log1p_retries_per_min"} <= set(FEATURES)
    assert {"resid_30s_pct", "resid_300s_pct", "span_30s", "span_300s"} <= set(FEATURES)
    assert not {"used_frac_per_s", "headroom_log2_gib"} & set(FEATURES)


def test_length_equals_n_features() -> None:
    full = smp(allocated=0.4, reserved=0.45, peak=0.55, retries=2)
    assert len(embed(full, None)) == N_INSTANT
    assert len(embed(full, smp(ts=T0 - 1))) == N_INSTANT
    bare = smp(kind="host")
    assert len(embed(bare, None)) == N_INSTANT
    state = EmbeddingState()
    vecs = [state.embed(smp(T0 + t, used=0.4 + 0.01 * t, retries=t)) for t in range(5)]
    assert all(len(v) == N_FEATURES for v in vecs)
    assert all(isinstance(x, float) and math.isfinite(x) for v in vecs for x in v)


# --- instant features ----------------------------------------------------------------------


def test_fractions_are_read_from_the_sample() -> None:
    vec = embed(smp(used=0.5, allocated=0.25, reserved=0.375, peak=0.625, retries=0), None)
    assert feat(vec, "used_frac") == 0.5
    assert feat(vec, "allocated_frac") == 0.25
    assert feat(vec, "reserved_frac") == 0.375
    assert feat(vec, "peak_frac") == 0.625
    assert feat(vec, "slack_frac") == 0.125  # (reserved - allocated) / total
    assert feat(vec, "level_frac") == 0.625  # on a GPU: the peak, when above use
    assert feat(vec, "headroom_log10") == pytest.approx(math.log10(0.375))
    for mask in ("allocated_present", "reserved_present", "peak_present", "retries_present"):
        assert feat(vec, mask) == 1.0, mask
    assert feat(vec, "is_gpu") == 1.0


def test_same_fractions_on_different_sizes_give_the_same_instant_features() -> None:
    def pair(total: int) -> tuple[Sample, Sample]:
        prev = smp(T0 - 2, total, 0.5, allocated=0.25, reserved=0.375, peak=0.5, retries=3)
        cur = smp(T0, total, 0.75, allocated=0.5, reserved=0.625, peak=0.8125, retries=10)
        return prev, cur

    for small, big in ((16 * GIB, 80 * GIB), (GIB, 141 * GIB)):
        a = embed(*reversed(pair(small)))
        b = embed(*reversed(pair(big)))
        # every instant feature is dimensionless now, headroom included
        assert a == b
    # and the values are not trivially zero
    assert feat(a, "slack_frac") == pytest.approx(0.125)
    assert feat(a, "headroom_log10") == pytest.approx(math.log10(1 - 0.8125))
    assert feat(a, "log1p_retries_delta") == pytest.approx(math.log1p(7))


@pytest.mark.parametrize("kind", ["host", "gpu"])
def test_same_fractions_on_a_1_gib_and_a_141_gib_domain_give_identical_features(
    kind: str,
) -> None:
    """Every feature, history included, for a whole run: dyadic fractions are exact in bytes
    on both capacities, so the vectors must be equal, not merely close."""
    rng = random.Random(7)

    def run(total: int) -> list[list[float]]:
        state = EmbeddingState()
        out = []
        retries = 0
        t = 0.0
        for i in range(400):
            t += rng_steps[i]
            used = (300 + i) / 1024
            alloc = (200 + i // 2) / 1024
            retries += i % 7 == 0
            out.append(
                state.embed(
                    smp(
                        T0 + t,
                        total,
                        used,
                        kind=kind,
                        allocated=alloc,
                        reserved=used - 1 / 1024,
                        peak=used + (i % 5) / 1024,
                        retries=retries,
                    )
                )
            )
        return out

    rng_steps = [rng.choice((0.1, 0.5, 1.0, 2.0)) for _ in range(400)]
    small, big = run(GIB), run(141 * GIB)
    assert small == big
    last = small[-1]
    assert feat(last, "trend_300s_pct_per_s") > 0 and feat(last, "log1p_retries_per_min") > 0


def test_headroom_log10_is_the_free_fraction_above_the_level_clipped_to_minus_3() -> None:
    assert feat(embed(smp(used=0.75), None), "headroom_log10") == pytest.approx(math.log10(0.25))
    assert feat(embed(smp(used=0.0), None), "headroom_log10") == 0.0
    assert feat(embed(smp(used=0.999), None), "headroom_log10") == pytest.approx(-3.0, abs=1e-3)
    # closer to full than 0.1% free, full, or over capacity: the floor
    for used_bytes in (GIB - 1000, GIB, GIB + 1):
        over = Sample(
            ts=T0, node="n", device="d", kind="gpu", total_bytes=GIB, used_bytes=used_bytes
        )
        assert feat(embed(over, None), "headroom_log10") == -3.0
    # the peak counts: a spike since the last sample eats headroom
    spiky = embed(smp(used=0.5, peak=0.9), None)
    assert feat(spiky, "headroom_log10") == pytest.approx(-1.0)
    # and it is the same on any capacity (100 MiB free is not 10% free on every size,
    # but 10% free is 10% free)
    small = embed(smp(total=GIB, used=0.75), None)
    assert feat(small, "headroom_log10") == pytest.approx(math.log10(0.25))


def test_host_level_is_anonymous_memory_not_usage_with_page_cache() -> None:
    # a container whose usage is 95% (mostly page cache the kernel can drop), anon 40%
    host = embed(smp(used=0.95, allocated=0.4, kind="host"), None)
    assert feat(host, "used_frac") == pytest.approx(0.95)
    assert feat(host, "level_frac") == pytest.approx(0.4)
    assert feat(host, "headroom_log10") == pytest.approx(math.log10(0.6))
    assert feat(host, "is_gpu") == 0.0
    # the same numbers on a GPU: there the level is what the device has in use
    gpu = embed(smp(used=0.95, allocated=0.4, kind="gpu"), None)
    assert feat(gpu, "level_frac") == pytest.approx(0.95)
    # a spike between samples (peak above usage) adds to the anon level on a host
    spike = embed(smp(used=0.6, allocated=0.4, peak=0.7, kind="host"), None)
    assert feat(spike, "level_frac") == pytest.approx(0.5)
    # without anon figures a host falls back to usage (and its peak)
    bare = embed(smp(used=0.6, peak=0.65, kind="host"), None)
    assert feat(bare, "level_frac") == pytest.approx(0.65)


def test_page_cache_filling_a_container_is_no_trend_but_anon_growth_is() -> None:
    cache, anon = EmbeddingState(), EmbeddingState()
    for t in range(0, 300):
        a = cache.embed(smp(T0 + t, used=0.5 + 0.0015 * t, allocated=0.3, kind="host"))
        b = anon.embed(smp(T0 + t, used=0.5 + 0.0015 * t, allocated=0.3 + 0.0015 * t, kind="host"))
    assert feat(a, "used_frac") > 0.94
    for name in ("trend_30s_pct_per_s", "trend_300s_pct_per_s"):
        assert feat(a, name) == pytest.approx(0.0, abs=1e-9), name
        assert feat(b, name) == pytest.approx(0.15, rel=1e-6), name
    assert feat(a, "time_to_full_30s") == 1.0 and feat(a, "max_peak_frac") == pytest.approx(0.3)
    assert feat(b, "time_to_full_30s") < 0.8
    # on a host the allocated figure is the level: it has no trend of its own
    assert feat(b, "allocated_trend_300s_pct_per_s") == 0.0
    assert feat(b, "time_to_full_allocated_300s") == 1.0


def test_missing_optional_fields_give_mask_zero_and_value_zero() -> None:
    prev = smp(T0 - 1, used=0.4)
    vec = embed(smp(T0, used=0.5), prev)
    for value, mask in (
        ("allocated_frac", "allocated_present"),
        ("reserved_frac", "reserved_present"),
        ("log1p_retries_delta", "retries_present"),
    ):
        assert feat(vec, value) == 0.0, value
        assert feat(vec, mask) == 0.0, mask
    assert feat(vec, "peak_present") == 0.0
    assert feat(vec, "peak_frac") == 0.5  # falls back to used_frac, as documented
    assert feat(vec, "level_frac") == 0.5
    assert feat(vec, "slack_frac") == 0.0


def test_missing_optional_fields_on_the_first_sample() -> None:
    vec = embed(smp(used=0.5), None)
    assert feat(vec, "allocated_present") == feat(vec, "allocated_frac") == 0.0
    assert feat(vec, "reserved_present") == feat(vec, "reserved_frac") == 0.0
    assert feat(vec, "retries_present") == feat(vec, "log1p_retries_delta") == 0.0


def test_slack_needs_both_allocated_and_reserved() -> None:
    assert feat(embed(smp(reserved=0.5), None), "slack_frac") == 0.0
    assert feat(embed(smp(allocated=0.5), None), "slack_frac") == 0.0
    assert feat(embed(smp(allocated=0.25, reserved=0.5), None), "slack_frac") == 0.25


def test_retries_delta_uses_the_previous_sample() -> None:
    prev = smp(T0 - 1, retries=5)
    vec = embed(smp(T0, retries=12), prev)
    assert feat(vec, "log1p_retries_delta") == pytest.approx(math.log1p(7))
    assert feat(vec, "retries_present") == 1.0
    # unchanged counter: present, no retries
    vec = embed(smp(T0, retries=5), prev)
    assert feat(vec, "log1p_retries_delta") == 0.0
    assert feat(vec, "retries_present") == 1.0


def test_retries_counter_reset_is_not_negative() -> None:
    vec = embed(smp(T0, retries=1), smp(T0 - 1, retries=40))  # job restarted
    assert feat(vec, "log1p_retries_delta") == 0.0
    state = EmbeddingState()
    state.embed(smp(T0, retries=40))
    after = state.embed(smp(T0 + 1, retries=1))
    assert feat(after, "log1p_retries_per_min") == 0.0


def test_retries_on_the_first_sample_count_as_present_with_no_delta() -> None:
    vec = embed(smp(retries=100), None)
    assert feat(vec, "log1p_retries_delta") == 0.0
    assert feat(vec, "retries_present") == 1.0
    # a counter that was already high when we started watching is no rate either
    assert feat(EmbeddingState().embed(smp(retries=100)), "log1p_retries_per_min") == 0.0


def test_retries_missing_on_either_side_is_masked() -> None:
    assert feat(embed(smp(T0, retries=3), smp(T0 - 1)), "retries_present") == 0.0
    assert feat(embed(smp(T0), smp(T0 - 1, retries=3)), "retries_present") == 0.0


@pytest.mark.parametrize("hz", [1, 10])
def test_retries_rate_is_per_minute_of_trace_time_at_any_sampling_rate(hz: int) -> None:
    state = EmbeddingState()
    vec: list[float] = []
    for i in range(600 * hz):  # one retry a second for ten minutes
        vec = state.embed(smp(T0 + i / hz, retries=i // hz))
    assert math.expm1(feat(vec, "log1p_retries_per_min")) == pytest.approx(60.0, rel=0.05)
    quiet = EmbeddingState()
    for i in range(60 * hz):
        vec = quiet.embed(smp(T0 + i / hz, retries=3))
    assert feat(vec, "log1p_retries_per_min") == 0.0


def test_dt_is_the_time_since_the_previous_sample() -> None:
    prev = smp(T0, used=0.5)
    assert feat(embed(smp(T0 + 2, used=0.75), prev), "log1p_dt_s") == pytest.approx(math.log1p(2))
    assert feat(embed(smp(T0 + 8, used=0.75), prev), "log1p_dt_s") == pytest.approx(math.log1p(8))
    assert feat(embed(smp(T0, used=0.9), None), "log1p_dt_s") == 0.0
    # a sample out of order (or at the same instant) gives zero, never a negative dt
    assert feat(embed(smp(T0 - 5, used=0.9), prev), "log1p_dt_s") == 0.0
    assert feat(embed(smp(T0, used=0.9), prev), "log1p_dt_s") == 0.0


def test_is_gpu_flag() -> None:
    assert feat(embed(smp(kind="gpu"), None), "is_gpu") == 1.0
    assert feat(embed(smp(kind="host"), None), "is_gpu") == 0.0


# --- the trend fit -------------------------------------------------------------------------


@pytest.mark.parametrize("hz", [1, 10])
def test_trend_fit_slope_is_exact_on_a_straight_line_from_the_second_sample(hz: int) -> None:
    for tau in (30.0, 300.0):
        fit = TrendFit(tau)
        for i in range(600 * hz):
            t = i / hz
            fit.update(0.2 + 0.0013 * t, 0.0 if i == 0 else 1.0 / hz)
            now, slope, resid, span = fit.fit()
            if i == 0:  # one sample: a level, no line
                assert (now, slope, resid, span) == pytest.approx((0.2, 0.0, 0.0, 0.0))
                continue
            assert slope == pytest.approx(0.0013, rel=1e-6), (tau, i)
            assert now == pytest.approx(0.2 + 0.0013 * t, abs=1e-9)  # the line, now
            assert resid == pytest.approx(0.0, abs=1e-5)
            assert 0.0 < span <= 2.0


def test_trend_fit_is_exponentially_weighted_least_squares_in_trace_time() -> None:
    """Against a direct weighted fit (numpy) on irregular timestamps and a noisy level."""
    rng = np.random.default_rng(3)
    gaps = rng.choice([0.1, 0.3, 1.0, 2.5], size=400)
    ts = np.concatenate([[0.0], np.cumsum(gaps)])
    ys = 0.4 + 0.0007 * ts + 0.02 * np.sin(ts / 7.0) + rng.normal(0, 0.005, len(ts))
    for tau in (30.0, 300.0):
        fit = TrendFit(tau)
        for i, (t, y) in enumerate(zip(ts, ys, strict=True)):
            fit.update(float(y), 0.0 if i == 0 else float(t - ts[i - 1]))
        now, slope, resid, span = fit.fit()
        rel = ts - ts[-1]  # t = 0 now
        w = np.exp(rel / tau)
        b, a = np.polyfit(rel, ys, 1, w=np.sqrt(w))  # polyfit weighs residuals by w
        r = ys - (a + b * rel)
        mt = np.average(rel, weights=w)
        assert slope == pytest.approx(b, rel=1e-6)
        assert now == pytest.approx(a, abs=1e-9)
        assert resid == pytest.approx(math.sqrt(np.average(r * r, weights=w)), rel=1e-5)
        spread = math.sqrt(np.average((rel - mt) ** 2, weights=w))
        assert span == pytest.approx(min(2.0, spread / tau), rel=1e-6)


def test_a_young_history_has_little_span_and_a_sawtooth_has_residuals() -> None:
    state = EmbeddingState()
    vecs = [state.embed(smp(T0 + t, used=0.5)) for t in range(0, 1200)]
    first, young, old = vecs[0], vecs[5], vecs[-1]
    assert feat(first, "span_30s") == feat(first, "span_300s") == 0.0
    assert feat(young, "span_300s") < 0.02 < feat(young, "span_30s") < 0.2
    # after many tau, the spread of exponentially weighted ages is tau itself
    assert feat(old, "span_30s") == pytest.approx(1.0, rel=0.01)
    # four tau of history: the spread of a truncated exponential, less than tau
    ages = np.arange(1200.0)
    w = np.exp(-ages / 300.0)
    spread = math.sqrt(np.average((ages - np.average(ages, weights=w)) ** 2, weights=w))
    assert feat(old, "span_300s") == pytest.approx(spread / 300.0, rel=1e-6)
    assert 0.8 < feat(old, "span_300s") < 0.9
    assert feat(old, "resid_30s_pct") == pytest.approx(0.0, abs=1e-6)
    saw = EmbeddingState()
    for t in range(0, 600):
        vec = saw.embed(smp(T0 + t, used=0.5 + 0.1 * ((t % 10) / 10)))
    # a 10-point sawtooth: residual spread about 10 / sqrt(12) = 2.9 % of capacity
    assert feat(vec, "resid_30s_pct") == pytest.approx(2.9, rel=0.1)
    assert feat(vec, "trend_300s_pct_per_s") == pytest.approx(0.0, abs=0.005)


def test_embedding_state_remembers_the_previous_sample() -> None:
    state = EmbeddingState()
    first = state.embed(smp(T0, used=0.5, retries=1))
    second = state.embed(smp(T0 + 4, used=0.75, retries=4))
    assert feat(first, "trend_30s_pct_per_s") == 0.0 and feat(first, "log1p_age_s") == 0.0
    # two samples make a line: 0.25 in 4 s
    assert feat(second, "trend_30s_pct_per_s") == pytest.approx(6.25)
    assert feat(second, "trend_300s_pct_per_s") == pytest.approx(6.25)
    assert feat(second, "log1p_retries_delta") == pytest.approx(math.log1p(3))
    assert feat(second, "log1p_dt_s") == pytest.approx(math.log1p(4))
    assert feat(second, "log1p_age_s") == pytest.approx(math.log1p(4))
    assert state.prev is not None
    assert state.prev.ts == T0 + 4
    instant = embed(smp(T0 + 4, used=0.75, retries=4), smp(T0, used=0.5, retries=1))
    assert second[:N_INSTANT] == instant


def test_first_sample_and_samples_at_one_instant_show_no_trend() -> None:
    state = EmbeddingState()
    vec = state.embed(smp(T0, used=0.9, peak=0.95))
    for name in (
        "trend_30s_pct_per_s",
        "trend_300s_pct_per_s",
        "span_30s",
        "span_300s",
        "max_peak_rise_300s_pct_per_s",
        "log1p_age_s",
        "resid_30s_pct",
    ):
        assert feat(vec, name) == 0.0, name
    assert feat(vec, "time_to_full_30s") == 1.0  # not growing: never
    # a second sample at the same instant is no line either
    again = state.embed(smp(T0, used=0.5))
    assert feat(again, "trend_30s_pct_per_s") == 0.0
    assert feat(again, "span_30s") == 0.0
    assert feat(again, "resid_30s_pct") == pytest.approx(22.5, rel=1e-6)  # levels 0.95, 0.5


def test_a_sample_slightly_out_of_order_is_no_time_backwards() -> None:
    state = EmbeddingState()
    state.embed(smp(T0, used=0.5))
    state.embed(smp(T0 + 1, used=0.6))
    late = state.embed(smp(T0 + 0.5, used=0.55))  # overtaken in transit
    assert feat(late, "log1p_dt_s") == 0.0
    assert feat(late, "log1p_age_s") == pytest.approx(math.log1p(0.5))
    assert all(math.isfinite(v) for v in late)


def test_a_sample_older_than_the_domains_first_does_not_crash_the_embedding() -> None:
    state = EmbeddingState()
    state.embed(smp(T0, used=0.5))
    vec = state.embed(smp(T0 - 5, used=0.5))  # a node clock stepped back, a replayed batch
    assert feat(vec, "log1p_age_s") == 0.0 and feat(vec, "log1p_dt_s") == 0.0


def test_a_jump_within_a_fraction_of_a_second_clips_the_trend() -> None:
    state = EmbeddingState()
    state.embed(smp(T0, used=0.1))
    vec = state.embed(smp(T0 + 0.1, used=0.9))  # 800 %/s
    assert feat(vec, "trend_30s_pct_per_s") == 10.0
    assert feat(vec, "trend_300s_pct_per_s") == 10.0
    falling = EmbeddingState()
    falling.embed(smp(T0, used=0.9))
    vec = falling.embed(smp(T0 + 0.1, used=0.1))
    assert feat(vec, "trend_30s_pct_per_s") == -10.0


def test_a_raised_limit_at_the_same_fraction_is_no_growth() -> None:
    # a cgroup whose limit was raised: 0.5 of 8 GiB, then 0.5 of 16 GiB
    state = EmbeddingState()
    state.embed(smp(T0, total=8 * GIB, used=0.5, kind="host"))
    vec = state.embed(smp(T0 + 1, total=16 * GIB, used=0.5, kind="host"))
    assert feat(vec, "level_frac") == 0.5
    assert feat(vec, "trend_30s_pct_per_s") == 0.0


def test_context_features_follow_the_history() -> None:
    state = EmbeddingState()
    vecs = [
        state.embed(smp(T0 + t, used=0.5 + 0.001 * t, peak=0.6 + 0.001 * t))
        for t in range(0, 600, 2)
    ]
    last = vecs[-1]
    # a steady 0.1 %/s climb of the level (the peak, on a GPU): both fits are exact on it
    assert feat(last, "trend_30s_pct_per_s") == pytest.approx(0.1, rel=1e-6)
    assert feat(last, "trend_300s_pct_per_s") == pytest.approx(0.1, rel=1e-6)
    assert feat(vecs[10], "trend_300s_pct_per_s") == pytest.approx(0.1, rel=1e-6)
    assert feat(last, "recent_peak_frac") == pytest.approx(0.6 + 0.598)
    assert feat(last, "max_peak_frac") == pytest.approx(0.6 + 0.598)
    assert feat(last, "log1p_age_s") == pytest.approx(math.log1p(598))
    # a drop: the recent peak decays with a 300 s time constant instead of vanishing
    after = state.embed(smp(T0 + 900, used=0.2, peak=0.2))
    assert feat(after, "recent_peak_frac") == pytest.approx(1.198 * math.exp(-302 / 300))
    assert feat(after, "max_peak_frac") == pytest.approx(1.198)


def test_the_same_curve_at_1_hz_and_10_hz_gives_nearly_the_same_context() -> None:
    """A start-up climb that levels off, then a leak with a small sawtooth on top; peaks,
    allocated and retries reported. Compared at every whole second after the first minute."""

    def level(t: float) -> float:
        return 0.2 + 0.3 * (1 - math.exp(-t / 60)) + 0.0004 * max(0.0, t - 300)

    def run(hz: int) -> dict[int, list[float]]:
        state = EmbeddingState()
        out = {}
        for i in range(900 * hz):
            t = i / hz
            y = level(t)
            vec = state.embed(
                smp(
                    T0 + t,
                    used=y,
                    peak=y + 0.005,
                    allocated=0.8 * y,
                    reserved=y,
                    retries=int(t // 20),
                )
            )
            if i % hz == 0:
                out[i // hz] = vec
        return out

    slow, fast = run(1), run(10)
    worst = {}
    for sec in range(60, 900):
        for k, name in enumerate(CONTEXT_FEATURES):
            a, b = slow[sec][N_INSTANT + k], fast[sec][N_INSTANT + k]
            worst[name] = max(worst.get(name, 0.0), abs(a - b) / (abs(a) + abs(b) + 1e-2))
    assert max(worst.values()) < 0.03, worst
    # the comparison is between features that move: a real trend, then a real leak
    assert feat(slow[100], "trend_30s_pct_per_s") > 0.05
    assert feat(slow[890], "trend_30s_pct_per_s") == pytest.approx(0.04, rel=0.05)


def test_time_to_full_is_what_a_linear_forecast_would_say_on_a_log_scale() -> None:
    assert time_to_full(0.3, 1.0) == pytest.approx(squashed(30.0))
    assert time_to_full(0.0, 1.0) == 0.0
    assert time_to_full(-0.1, 0.0) == 0.0  # over capacity already
    assert time_to_full(0.5, 0.0) == 1.0  # not growing: never
    assert time_to_full(0.5, -2.0) == 1.0
    assert time_to_full(0.9, 1e-4) == 1.0  # capped at an hour
    assert time_to_full(0.2, 2.0) < time_to_full(0.2, 1.0) < time_to_full(0.4, 1.0)


def test_seconds_to_full_inverts_the_squashing() -> None:
    for seconds in (0.0, 1.0, 30.0, 299.5, TIME_TO_FULL_CAP_S):
        assert seconds_to_full(squashed(seconds)) == pytest.approx(seconds, abs=1e-9)
    assert seconds_to_full(time_to_full(0.3, 1.0)) == pytest.approx(30.0)


def test_a_steady_climb_gives_a_shrinking_time_to_full() -> None:
    state = EmbeddingState()
    vecs = [state.embed(smp(T0 + t, used=0.3 + 0.001 * t)) for t in range(0, 600, 2)]
    # 0.1 %/s with 1 - 0.898 left at the end: 102 s to full
    for name in ("time_to_full_30s", "time_to_full_300s"):
        assert feat(vecs[-1], name) == pytest.approx(squashed(102.0), rel=1e-4), name
    ttf = [feat(v, "time_to_full_30s") for v in vecs[1:]]
    assert all(b <= a + 1e-9 for a, b in itertools.pairwise(ttf))


def test_growing_spikes_raise_the_high_water_mark_and_flat_ones_do_not() -> None:
    def run(growth: float) -> list[float]:
        state = EmbeddingState()
        vec: list[float] = []
        for t in range(0, 1200):
            spike = t % 100 == 50
            peak = 0.6 + (0.1 + growth * (t // 100) if spike else 0.0)
            vec = state.embed(smp(T0 + t, used=0.6, peak=peak))
        return vec

    flat, growing = run(0.0), run(0.02)
    assert feat(flat, "max_peak_frac") == pytest.approx(0.7)
    assert feat(growing, "max_peak_frac") == pytest.approx(0.7 + 0.02 * 11)
    # flat spikes set their high once, 1150 s ago: the rise has decayed to almost nothing
    assert feat(flat, "max_peak_rise_300s_pct_per_s") < 0.001
    assert feat(growing, "max_peak_rise_300s_pct_per_s") > 0.002
    assert feat(flat, "time_to_full_max_peak") == 1.0
    assert feat(growing, "time_to_full_max_peak") < 1.0
    # the average is the same in both: only the peaks tell them apart
    assert feat(flat, "used_frac") == feat(growing, "used_frac")


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_trends_do_not_depend_on_the_sampling_interval_or_a_sawtooth() -> None:
    def climb(interval: float, saw: float) -> list[float]:
        state = EmbeddingState()
        vec: list[float] = []
        n = int(2400 / interval)
        for i in range(n):
            t = i * interval
            wobble = saw if i % 2 else -saw  # a step's forward/backward swing
            vec = state.embed(smp(T0 + t, used=0.3 + 0.0005 * t + wobble))
        return vec

    ref = feat(climb(1.0, 0.0), "trend_300s_pct_per_s")
    assert ref == pytest.approx(0.05, rel=1e-6)
    for interval, saw in ((0.1, 0.05), (2.0, 0.0), (0.25, 0.1)):
        got = climb(interval, saw)
        assert feat(got, "trend_300s_pct_per_s") == pytest.approx(ref, rel=0.05)
        assert feat(got, "trend_30s_pct_per_s") == pytest.approx(0.05, abs=0.02)


def test_allocated_has_its_own_trend_and_time_to_full_on_a_gpu() -> None:
    state = EmbeddingState()
    # the allocator keeps 95% reserved (and used) while tensors creep up 0.02%/s
    vecs = [
        state.embed(smp(T0 + t, used=0.95, reserved=0.94, allocated=0.5 + 0.0002 * t))
        for t in range(0, 1800, 2)
    ]
    last = vecs[-1]
    assert feat(last, "trend_300s_pct_per_s") == pytest.approx(0.0, abs=1e-6)
    assert feat(last, "allocated_trend_300s_pct_per_s") == pytest.approx(0.02, rel=1e-6)
    left_s = (1 - (0.5 + 0.0002 * 1798)) * 100 / 0.02
    assert feat(last, "time_to_full_allocated_300s") == pytest.approx(squashed(left_s), rel=1e-4)
    # without allocated: no trend, never full, and the mask says why
    bare = EmbeddingState()
    v = [bare.embed(smp(T0 + t, used=0.5 + 0.001 * t)) for t in range(0, 100, 2)][-1]
    assert feat(v, "allocated_trend_300s_pct_per_s") == 0.0
    assert feat(v, "time_to_full_allocated_300s") == 1.0
    assert feat(v, "allocated_present") == 0.0


# --- the tick cadence ----------------------------------------------------------------------


def test_tick_due_after_93_percent_of_a_tick() -> None:
    assert tick_due(None, T0, 1.0)  # a domain's first sample always ticks
    assert tick_due(T0, T0 + 1.0, 1.0) and tick_due(T0, T0 + 0.95, 1.0)
    assert not tick_due(T0, T0 + 0.85, 1.0) and not tick_due(T0, T0, 1.0)
    assert not tick_due(T0, T0 - 3.0, 1.0)  # out of order: not a tick
    assert tick_due(T0, T0 + 1.87, 2.0) and not tick_due(T0, T0 + 1.8, 2.0)
    assert not tick_due(T0, T0 + 0.9, 1.0)  # the ninth sample at 10 Hz: not yet


def test_tick_rows_at_10_hz_tick_about_once_a_second() -> None:
    ts = [T0 + i * 0.1 for i in range(6000)]  # ten minutes
    rows = tick_rows(ts, 1.0)
    assert rows[0] == 0
    gaps = np.diff(rows)
    tick_gaps = np.diff([ts[i] for i in rows])
    assert set(gaps.tolist()) <= {9, 10}  # never fewer than 0.9 s apart, never more than 1 s
    assert (tick_gaps >= 0.9 - 1e-6).all() and (tick_gaps <= 1.0 + 1e-6).all()
    assert 600 <= len(rows) <= 612  # about one tick a second of trace time


def test_tick_rows_at_2_hz_take_every_other_sample() -> None:
    ts = [T0 + i * 0.5 for i in range(200)]
    assert tick_rows(ts, 1.0) == list(range(0, 200, 2))


def test_tick_rows_at_1_hz_with_jitter_take_every_sample() -> None:
    rng = random.Random(5)
    ts = [T0 + i + rng.uniform(-0.03, 0.03) for i in range(600)]
    assert tick_rows(ts, 1.0) == list(range(600))
    # but a sample that came early (half a second after the last) waits for the next one
    early = [T0, T0 + 1.0, T0 + 1.5, T0 + 2.0, T0 + 3.0]
    assert tick_rows(early, 1.0) == [0, 1, 3, 4]


def test_tick_rows_at_half_a_hz_take_every_sample() -> None:
    ts = [T0 + 2.0 * i for i in range(100)]
    assert tick_rows(ts, 1.0) == list(range(100))
    assert tick_rows([], 1.0) == []


def test_a_saved_embedding_state_continues_exactly_where_it_stopped() -> None:
    samples = [
        smp(
            T0 + i * 0.7,
            used=0.3 + 0.002 * i,
            allocated=0.2 + 0.001 * i,
            reserved=0.5,
            retries=i // 10,
        )
        for i in range(120)
    ]
    ref = EmbeddingState()
    ref_vecs = [ref.embed(s) for s in samples]
    st = EmbeddingState()
    for s in samples[:70]:
        st.embed(s)
    restored = EmbeddingState.from_dict(json.loads(json.dumps(st.to_dict())))
    assert restored == st
    # the growth fits' running sums are rebuilt on restore: the same to the last bits
    for got, want in zip([restored.embed(s) for s in samples[70:]], ref_vecs[70:], strict=True):
        assert got == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert EmbeddingState.from_dict(EmbeddingState().to_dict()) == EmbeddingState()


@pytest.mark.parametrize(
    ("change", "named"),
    [
        ({"fast": [1.0, 2.0]}, "fast"),
        ({"max_peak": "high"}, "max_peak"),
        ({"first_ts": float("nan")}, "first_ts"),
        ({"prev": {"ts": 1.0}}, "node"),
    ],
)
def test_a_malformed_embedding_state_is_refused_naming_the_key(
    change: dict[str, object], named: str
) -> None:
    st = EmbeddingState()
    st.embed(smp(T0))
    with pytest.raises(ValueError, match=named):
        EmbeddingState.from_dict({**st.to_dict(), **change})
