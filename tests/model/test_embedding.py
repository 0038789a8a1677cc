"""model/embedding.py: the per-sample feature vector."""

from __future__ import annotations

import itertools
import math

import pytest

from oomcast.model.embedding import (
    EMBEDDING_VERSION,
    FEATURES,
    INSTANT_FEATURES,
    N_FEATURES,
    N_INSTANT,
    TIME_TO_FULL_CAP_S,
    EmbeddingState,
    embed,
    time_to_full,
)
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
        device="gpu0",
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


def test_feature_names_are_unique_and_counted() -> None:
    assert len(set(FEATURES)) == len(FEATURES) == N_FEATURES == 25
    assert FEATURES[:N_INSTANT] == INSTANT_FEATURES
    assert isinstance(EMBEDDING_VERSION, int)


def test_length_equals_n_features() -> None:
    full = smp(allocated=0.4, reserved=0.45, peak=0.55, retries=2)
    assert len(embed(full, None)) == N_INSTANT
    assert len(embed(full, smp(ts=T0 - 1))) == N_INSTANT
    bare = smp(kind="host")
    assert len(embed(bare, None)) == N_INSTANT
    assert len(EmbeddingState().embed(full)) == N_FEATURES
    assert all(isinstance(x, float) and math.isfinite(x) for x in embed(full, smp(T0 - 1)))


def test_fractions_are_read_from_the_sample() -> None:
    vec = embed(smp(used=0.5, allocated=0.25, reserved=0.375, peak=0.625, retries=0), None)
    assert feat(vec, "used_frac") == 0.5
    assert feat(vec, "allocated_frac") == 0.25
    assert feat(vec, "reserved_frac") == 0.375
    assert feat(vec, "peak_frac") == 0.625
    assert feat(vec, "slack_frac") == 0.125  # (reserved - allocated) / total
    for mask in ("allocated_present", "reserved_present", "peak_present", "retries_present"):
        assert feat(vec, mask) == 1.0, mask
    assert feat(vec, "is_gpu") == 1.0


def test_same_fractions_on_different_sizes_give_the_same_dimensionless_features() -> None:
    def pair(ts: float, total: int) -> tuple[Sample, Sample]:
        prev = smp(ts - 2, total, 0.5, allocated=0.25, reserved=0.375, peak=0.5, retries=3)
        cur = smp(ts, total, 0.75, allocated=0.5, reserved=0.625, peak=0.8125, retries=10)
        return prev, cur

    small_prev, small = pair(T0, 16 * GIB)
    big_prev, big = pair(T0, 80 * GIB)
    a = embed(small, small_prev)
    b = embed(big, big_prev)
    head = IDX["headroom_log2_gib"]
    for i, name in enumerate(INSTANT_FEATURES):
        if i != head:
            assert a[i] == pytest.approx(b[i], abs=1e-12), name
    # headroom depends on the absolute free bytes by design: 4 GiB free vs 20 GiB free
    assert a[head] == pytest.approx(math.log2(4 + 1e-3))
    assert b[head] == pytest.approx(math.log2(20 + 1e-3))
    assert b[head] - a[head] == pytest.approx(math.log2(5), abs=1e-3)
    # and the values are not trivially zero
    assert feat(a, "used_frac_per_s") == pytest.approx(0.125)
    assert feat(a, "slack_frac") == pytest.approx(0.125)


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


def test_retries_on_the_first_sample_count_as_present_with_no_delta() -> None:
    vec = embed(smp(retries=100), None)
    assert feat(vec, "log1p_retries_delta") == 0.0
    assert feat(vec, "retries_present") == 1.0


def test_retries_missing_on_either_side_is_masked() -> None:
    assert feat(embed(smp(T0, retries=3), smp(T0 - 1)), "retries_present") == 0.0
    assert feat(embed(smp(T0), smp(T0 - 1, retries=3)), "retries_present") == 0.0


def test_growth_rate_uses_dt() -> None:
    prev = smp(T0, used=0.5)
    fast = embed(smp(T0 + 2, used=0.75), prev)
    slow = embed(smp(T0 + 8, used=0.75), prev)
    assert feat(fast, "used_frac_per_s") == pytest.approx(0.125)
    assert feat(slow, "used_frac_per_s") == pytest.approx(0.03125)
    assert feat(fast, "log1p_dt_s") == pytest.approx(math.log1p(2))
    assert feat(slow, "log1p_dt_s") == pytest.approx(math.log1p(8))
    falling = embed(smp(T0 + 4, used=0.25), prev)
    assert feat(falling, "used_frac_per_s") == pytest.approx(-0.0625)


def test_growth_rate_is_clipped() -> None:
    prev = smp(T0, used=0.1)
    assert feat(embed(smp(T0 + 0.1, used=0.9), prev), "used_frac_per_s") == 1.0
    assert feat(embed(smp(T0 + 1, used=0.9), prev), "used_frac_per_s") == pytest.approx(0.8)
    back = embed(prev, smp(T0 - 0.1, used=0.9))
    assert feat(back, "used_frac_per_s") == -1.0


def test_growth_rate_uses_fractions_when_capacity_changes() -> None:
    # a cgroup whose limit was raised: 0.5 of 8 GiB, then 0.5 of 16 GiB: no growth
    vec = embed(smp(T0 + 1, total=16 * GIB, used=0.5), smp(T0, total=8 * GIB, used=0.5))
    assert feat(vec, "used_frac_per_s") == 0.0


def test_first_sample_has_no_rate_and_no_dt() -> None:
    vec = embed(smp(used=0.9), None)
    assert feat(vec, "used_frac_per_s") == 0.0
    assert feat(vec, "log1p_dt_s") == 0.0


def test_zero_or_negative_dt_gives_no_rate() -> None:
    prev = smp(T0, used=0.5)
    assert feat(embed(smp(T0, used=0.9), prev), "used_frac_per_s") == 0.0
    vec = embed(smp(T0 - 5, used=0.9), prev)
    assert feat(vec, "used_frac_per_s") == 0.0
    assert feat(vec, "log1p_dt_s") == 0.0


def test_headroom_is_log2_free_gib_and_clipped() -> None:
    assert feat(embed(smp(total=80 * GIB, used=0.75), None), "headroom_log2_gib") == (
        pytest.approx(math.log2(20 + 1e-3))
    )
    full = Sample(
        ts=T0, node="n", device="d", kind="gpu", total_bytes=GIB, used_bytes=GIB + 1
    )  # over capacity: no free bytes, the floor of log2(0 + 1e-3)
    assert feat(embed(full, None), "headroom_log2_gib") == pytest.approx(math.log2(1e-3))
    huge = Sample(ts=T0, node="n", device="d", kind="host", total_bytes=4096 * GIB, used_bytes=0)
    assert feat(embed(huge, None), "headroom_log2_gib") == 8.0


def test_is_gpu_flag() -> None:
    assert feat(embed(smp(kind="gpu"), None), "is_gpu") == 1.0
    assert feat(embed(smp(kind="host"), None), "is_gpu") == 0.0


def test_embedding_state_remembers_the_previous_sample() -> None:
    state = EmbeddingState()
    first = state.embed(smp(T0, used=0.5, retries=1))
    second = state.embed(smp(T0 + 4, used=0.75, retries=4))
    assert feat(first, "used_frac_per_s") == 0.0
    assert feat(second, "used_frac_per_s") == pytest.approx(0.0625)
    assert feat(second, "log1p_retries_delta") == pytest.approx(math.log1p(3))
    assert state.prev is not None
    assert state.prev.ts == T0 + 4
    instant = embed(smp(T0 + 4, used=0.75, retries=4), smp(T0, used=0.5, retries=1))
    assert second[:N_INSTANT] == instant


def test_context_features_follow_the_history() -> None:
    state = EmbeddingState()
    vecs = [
        state.embed(smp(T0 + t, used=0.5 + 0.001 * t, peak=0.6 + 0.001 * t))
        for t in range(0, 600, 2)
    ]
    last = vecs[-1]
    # a steady 0.1%/s climb: both trends converge on it, the fast one sooner (after 600 s
    # the slow one has 1 - (360 e^(-600/360) - 60 e^(-10)) / 300 of it)
    assert feat(last, "trend_30s_pct_per_s") == pytest.approx(0.1, rel=1e-3)
    slow_share = 1 - (360 * math.exp(-598 / 360) - 60 * math.exp(-598 / 60)) / 300
    assert feat(last, "trend_300s_pct_per_s") == pytest.approx(0.1 * slow_share, rel=0.02)
    assert feat(vecs[10], "trend_30s_pct_per_s") > feat(vecs[10], "trend_300s_pct_per_s")
    assert feat(last, "recent_peak_frac") == pytest.approx(0.6 + 0.598)
    assert feat(last, "log1p_age_s") == pytest.approx(math.log1p(598))
    # a drop: the recent peak decays with a 300 s time constant instead of vanishing
    after = state.embed(smp(T0 + 900, used=0.2, peak=0.2))
    assert feat(after, "recent_peak_frac") == pytest.approx(1.198 * math.exp(-302 / 300))


def test_time_to_full_is_what_a_linear_forecast_would_say_on_a_log_scale() -> None:
    cap = math.log1p(TIME_TO_FULL_CAP_S)
    assert time_to_full(0.3, 1.0) == pytest.approx(math.log1p(30.0) / cap)
    assert time_to_full(0.0, 1.0) == 0.0
    assert time_to_full(-0.1, 0.0) == 0.0  # over capacity already
    assert time_to_full(0.5, 0.0) == 1.0  # not growing: never
    assert time_to_full(0.5, -2.0) == 1.0
    assert time_to_full(0.9, 1e-4) == 1.0  # capped at an hour
    assert time_to_full(0.2, 2.0) < time_to_full(0.2, 1.0) < time_to_full(0.4, 1.0)


def test_a_steady_climb_gives_a_shrinking_time_to_full() -> None:
    state = EmbeddingState()
    vecs = [state.embed(smp(T0 + t, used=0.3 + 0.001 * t)) for t in range(0, 600, 2)]
    # 0.1 %/s with 1 - 0.898 left at the end: about 102 s to full
    assert feat(vecs[-1], "time_to_full_30s") == pytest.approx(
        math.log1p(102.0) / math.log1p(TIME_TO_FULL_CAP_S), rel=0.02
    )
    ttf = [feat(v, "time_to_full_30s") for v in vecs[50:]]
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


def test_trends_do_not_depend_on_the_sampling_interval_or_a_sawtooth() -> None:
    def climb(interval: float, saw: float) -> list[float]:
        state = EmbeddingState()
        vec: list[float] = []
        n = int(2400 / interval)  # long enough for the start's offset to wear off
        for i in range(n):
            t = i * interval
            wobble = saw if i % 2 else -saw  # a step's forward/backward swing
            vec = state.embed(smp(T0 + t, used=0.3 + 0.0005 * t + wobble))
        return vec

    ref = feat(climb(1.0, 0.0), "trend_300s_pct_per_s")
    assert ref == pytest.approx(0.05, rel=0.01)
    for interval, saw in ((0.1, 0.05), (2.0, 0.0), (0.25, 0.1)):
        got = climb(interval, saw)
        assert feat(got, "trend_300s_pct_per_s") == pytest.approx(ref, rel=0.05)
        assert feat(got, "trend_30s_pct_per_s") == pytest.approx(0.05, abs=0.02)


def test_allocated_has_its_own_trend_and_time_to_full() -> None:
    state = EmbeddingState()
    # the allocator keeps 95% reserved (and used) while tensors creep up 0.02%/s
    vecs = [
        state.embed(smp(T0 + t, used=0.95, reserved=0.94, allocated=0.5 + 0.0002 * t))
        for t in range(0, 1800, 2)
    ]
    last = vecs[-1]
    assert feat(last, "trend_300s_pct_per_s") == pytest.approx(0.0, abs=1e-6)
    assert feat(last, "allocated_trend_300s_pct_per_s") == pytest.approx(0.02, rel=0.05)
    left_s = (1 - (0.5 + 0.0002 * 1798)) * 100 / 0.02
    assert feat(last, "time_to_full_allocated_300s") == pytest.approx(
        math.log1p(left_s) / math.log1p(TIME_TO_FULL_CAP_S), rel=0.03
    )
    # without allocated: no trend, never full, and the mask says why
    bare = EmbeddingState()
    v = [bare.embed(smp(T0 + t, used=0.5 + 0.001 * t)) for t in range(0, 100, 2)][-1]
    assert feat(v, "allocated_trend_300s_pct_per_s") == 0.0
    assert feat(v, "time_to_full_allocated_300s") == 1.0
    assert feat(v, "allocated_present") == 0.0
