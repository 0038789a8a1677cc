"""training/allocator.py: the CUDA caching allocator simulator.

Hand-worked cases first (each comment shows the arithmetic), then hypothesis properties over
random malloc/free/empty_cache/capacity sequences, including a comparison with a deliberately
naive list-based model of the non-expandable allocator.
"""

from __future__ import annotations

import contextlib
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from oomcast.training.allocator import (
    AllocatorStats,
    CachingAllocatorSim,
    SimOutOfMemory,
    allocation_size,
    format_size,
    round_size,
)

KIB = 1 << 10
MIB = 1 << 20
GIB = 1 << 30
BIG = 80 * GIB


def layout(sim: CachingAllocatorSim, pool: str = "large") -> list[list[tuple[int, int]]]:
    """Segments of one pool in address order, each as [(size in bytes, state)], where state is
    0 free, 1 allocated, 2 unmapped (taken from state_key)."""
    key = sim.state_key()
    segs = key[5] if pool == "large" else key[4]
    return [[(size, state) for size, state, _handle in seg] for seg in segs]


def mib_layout(sim: CachingAllocatorSim, pool: str = "large") -> list[list[tuple[float, int]]]:
    return [[(size / MIB, state) for size, state in seg] for seg in layout(sim, pool)]


# ---------------------------------------------------------------------------- helpers


def test_round_and_allocation_size() -> None:
    assert round_size(1) == 512
    assert round_size(511) == 512
    assert round_size(512) == 512
    assert round_size(513) == 1024
    assert allocation_size(512) == 2 * MIB
    assert allocation_size(MIB) == 2 * MIB  # 1 MiB is still "small"
    assert allocation_size(MIB + 512) == 20 * MIB
    assert allocation_size(10 * MIB - 512) == 20 * MIB
    assert allocation_size(10 * MIB) == 10 * MIB
    assert allocation_size(11 * MIB) == 12 * MIB
    assert format_size(1024) == "1024 bytes"
    assert format_size(1536) == "1.50 KiB"
    assert format_size(60 * MIB) == "60.00 MiB"
    assert format_size(3 * GIB // 2) == "1.50 GiB"


def test_options_are_validated() -> None:
    with pytest.raises(ValueError):
        CachingAllocatorSim(GIB, max_split_size=10 * MIB)  # torch wants >= 20 MiB
    with pytest.raises(ValueError):
        CachingAllocatorSim(GIB, max_split_size=100 * MIB + 1)  # whole MiB only
    with pytest.raises(ValueError):
        CachingAllocatorSim(-1)


# ---------------------------------------------------------------------------- hand-worked


def test_rounding_and_requested_bytes() -> None:
    sim = CachingAllocatorSim(BIG)
    sim.malloc(1)
    sim.malloc(513)
    s = sim.stats()
    assert s.allocated_bytes == 512 + 1024
    assert s.active_bytes == s.allocated_bytes
    assert s.requested_bytes == 1 + 513
    assert s.reserved_bytes == 2 * MIB  # both in one small-pool segment
    assert s.segments == 1
    sim.check_invariants()


def test_small_pool_packs_2mib_segments() -> None:
    sim = CachingAllocatorSim(BIG)
    for _ in range(4096):  # 4096 x 512 B == 2 MiB: exactly one segment
        sim.malloc(100)
    assert sim.stats().segments == 1
    assert sim.stats().reserved_bytes == 2 * MIB
    sim.malloc(100)
    assert sim.stats().segments == 2
    assert sim.stats().reserved_bytes == 4 * MIB
    # 1 MiB is the largest small request: two share a segment, the third needs another
    sim2 = CachingAllocatorSim(BIG)
    for _ in range(3):
        sim2.malloc(MIB)
    assert sim2.stats().reserved_bytes == 4 * MIB
    assert layout(sim2, "small") == [[(MIB, 1), (MIB, 1)], [(MIB, 1), (MIB, 0)]]
    sim2.check_invariants()


def test_small_pool_split_threshold_is_512() -> None:
    sim = CachingAllocatorSim(BIG)
    a = sim.malloc(MIB)  # a 2 MiB segment split into 1 MiB + 1 MiB
    b = sim.malloc(MIB - 512)  # leaves exactly 512 B: still split off
    assert layout(sim, "small") == [[(MIB, 1), (MIB - 512, 1), (512, 0)]]
    sim.malloc(512)  # the 512 B tail serves it
    assert layout(sim, "small") == [[(MIB, 1), (MIB - 512, 1), (512, 1)]]
    sim.free(a)
    sim.free(b)
    # a and b merge into one free block; the segment is still split by the live 512 B block
    assert layout(sim, "small") == [[(2 * MIB - 512, 0), (512, 1)]]
    assert sim.stats().inactive_split_bytes == 2 * MIB - 512
    sim.check_invariants()


def test_large_pool_split_threshold_is_more_than_1mib() -> None:
    sim = CachingAllocatorSim(BIG)
    sim.malloc(19 * MIB)  # 20 MiB segment, 1 MiB rest: not > 1 MiB, so the block stays whole
    assert sim.stats().allocated_bytes == 20 * MIB
    assert sim.stats().requested_bytes == 19 * MIB
    assert sim.stats().inactive_split_bytes == 0
    sim.malloc(19 * MIB - 512)  # rest 1 MiB + 512 B: split
    assert layout(sim) == [[(20 * MIB, 1)], [(19 * MIB - 512, 1), (MIB + 512, 0)]]
    assert sim.stats().allocated_bytes == 39 * MIB - 512
    assert sim.stats().inactive_split_bytes == MIB + 512
    sim.check_invariants()


def test_large_segment_sizes() -> None:
    sim = CachingAllocatorSim(BIG)
    sim.malloc(10 * MIB)  # >= 10 MiB: rounded up to 2 MiB
    sim.malloc(11 * MIB)  # 12 MiB segment; the 1 MiB rest is not split off
    sim.malloc(MIB + 1)  # 1-10 MiB requests get a 20 MiB segment
    sizes = [sum(size for size, _ in seg) for seg in layout(sim)]
    assert sizes == [10 * MIB, 12 * MIB, 20 * MIB]
    assert sim.stats().allocated_bytes == 22 * MIB + MIB + 512
    # the 1 MiB + 512 request left 19 MiB - 512 free in its segment, which serves a 5 MiB one
    sim.malloc(5 * MIB)
    assert sim.stats().reserved_bytes == 42 * MIB


def test_hand_worked_16_then_32() -> None:
    sim = CachingAllocatorSim(BIG)
    hs = [sim.malloc(16 * MIB) for _ in range(8)]  # eight 16 MiB segments
    for h in hs:
        sim.free(h)
    for _ in range(4):  # no free block >= 32 MiB, and segments never merge: four new ones
        sim.malloc(32 * MIB)
    assert sim.stats().reserved_bytes == 256 * MIB
    assert sim.stats().segments == 12
    sim.check_invariants()


def test_hand_worked_32_then_16() -> None:
    sim = CachingAllocatorSim(BIG)
    hs = [sim.malloc(32 * MIB) for _ in range(4)]
    for h in hs:
        sim.free(h)
    for _ in range(8):  # each 32 MiB block is split into 16 + 16
        sim.malloc(16 * MIB)
    assert sim.stats().reserved_bytes == 128 * MIB
    assert sim.stats().segments == 4
    assert sim.stats().inactive_split_bytes == 0
    sim.check_invariants()


def test_no_merging_across_segments() -> None:
    sim = CachingAllocatorSim(BIG)
    a = sim.malloc(16 * MIB)
    b = sim.malloc(16 * MIB)
    sim.free(a)
    sim.free(b)
    assert layout(sim) == [[(16 * MIB, 0)], [(16 * MIB, 0)]]
    sim.malloc(32 * MIB)
    assert sim.stats().reserved_bytes == 64 * MIB
    assert sim.stats().inactive_split_bytes == 0  # whole free segments are not "split"


def test_merge_with_both_neighbours_inside_a_segment() -> None:
    sim = CachingAllocatorSim(BIG)
    hs = [sim.malloc(4 * MIB) for _ in range(5)]  # one 20 MiB segment, five blocks
    assert mib_layout(sim) == [[(4.0, 1)] * 5]
    sim.free(hs[1])
    sim.free(hs[3])
    assert sim.stats().inactive_split_bytes == 8 * MIB
    sim.free(hs[2])  # merges with both neighbours
    assert mib_layout(sim) == [[(4.0, 1), (12.0, 0), (4.0, 1)]]
    assert sim.stats().inactive_split_bytes == 12 * MIB
    sim.free(hs[0])
    sim.free(hs[4])
    assert mib_layout(sim) == [[(20.0, 0)]]
    assert sim.stats().inactive_split_bytes == 0
    sim.check_invariants()


def _free_segments(sim: CachingAllocatorSim, sizes_mib: list[int]) -> None:
    hs = [sim.malloc(s * MIB) for s in sizes_mib]
    for h in hs:
        sim.free(h)


def test_best_fit_picks_the_smallest_block_then_lowest_address() -> None:
    sim = CachingAllocatorSim(BIG)
    _free_segments(sim, [30, 24, 40])
    sim.malloc(22 * MIB)  # 24 is the smallest fit; 2 MiB rest > 1 MiB: split
    assert mib_layout(sim) == [[(30.0, 0)], [(22.0, 1), (2.0, 0)], [(40.0, 0)]]
    sim.malloc(30 * MIB)  # exact fits, no new memory
    sim.malloc(40 * MIB)
    assert sim.stats().reserved_bytes == 94 * MIB
    tie = CachingAllocatorSim(BIG)
    _free_segments(tie, [24, 24])
    tie.malloc(24 * MIB)
    assert mib_layout(tie) == [[(24.0, 1)], [(24.0, 0)]]


def test_max_split_size_oversize_blocks_not_used_for_small_requests() -> None:
    sim = CachingAllocatorSim(BIG, max_split_size=100 * MIB)
    _free_segments(sim, [200])
    sim.malloc(50 * MIB)  # the 200 MiB block is oversize: a new 50 MiB segment
    assert mib_layout(sim) == [[(200.0, 0)], [(50.0, 1)]]
    plain = CachingAllocatorSim(BIG)
    _free_segments(plain, [200])
    plain.malloc(50 * MIB)  # without max_split_size the 200 MiB block is split
    assert mib_layout(plain) == [[(50.0, 1), (150.0, 0)]]


def test_max_split_size_oversize_reuse_within_20mib_and_no_split() -> None:
    sim = CachingAllocatorSim(BIG, max_split_size=100 * MIB)
    _free_segments(sim, [200])
    sim.malloc(190 * MIB)  # 200 < 190 + 20: reused whole, not split
    assert mib_layout(sim) == [[(200.0, 1)]]
    assert sim.stats().allocated_bytes == 200 * MIB

    edge = CachingAllocatorSim(BIG, max_split_size=100 * MIB)
    _free_segments(edge, [200])
    edge.malloc(180 * MIB)  # 200 >= 180 + 20: refused (strict bound), new segment
    assert mib_layout(edge) == [[(200.0, 0)], [(180.0, 1)]]

    nosplit = CachingAllocatorSim(BIG, max_split_size=100 * MIB)
    _free_segments(nosplit, [130])
    nosplit.malloc(120 * MIB)  # request >= max_split_size: never split, 10 MiB rides along
    assert mib_layout(nosplit) == [[(130.0, 1)]]


def test_release_available_cached_blocks_smallest_sufficient_block() -> None:
    sim = CachingAllocatorSim(700 * MIB, max_split_size=64 * MIB)
    _free_segments(sim, [100, 200, 300])
    # 150 MiB: the 200 MiB block is >= 150 + 20 so not reused; 600 + 150 > 700, so
    # release_available_cached_blocks frees the smallest block >= 150 MiB (200) and retries
    sim.malloc(150 * MIB)
    assert mib_layout(sim) == [[(100.0, 0)], [(300.0, 0)], [(150.0, 1)]]
    assert sim.stats().num_alloc_retries == 0  # not the counted, release-everything retry
    assert sim.stats().reserved_bytes == 550 * MIB


def test_release_available_cached_blocks_largest_first_until_enough() -> None:
    sim = CachingAllocatorSim(400 * MIB, max_split_size=64 * MIB)
    _free_segments(sim, [100, 90, 80, 70])
    # 150 MiB: no block >= 150, 340 + 150 > 400; free the largest oversize blocks until
    # 150 MiB are released: 100, then 90 (190 >= 150); 80 and 70 stay cached
    sim.malloc(150 * MIB)
    assert mib_layout(sim) == [[(80.0, 0)], [(70.0, 0)], [(150.0, 1)]]
    assert sim.stats().num_alloc_retries == 0
    sim.check_invariants()


def test_retry_after_releasing_cached_segments() -> None:
    sim = CachingAllocatorSim(100 * MIB)
    _free_segments(sim, [60])
    sim.malloc(80 * MIB)  # 60 + 80 > 100: release the cached 60 MiB, retry, succeed
    s = sim.stats()
    assert s.num_alloc_retries == 1
    assert s.num_ooms == 0
    assert s.reserved_bytes == 80 * MIB
    assert s.peak_reserved_bytes == 80 * MIB
    assert s.segments == 1
    sim.check_invariants()


def test_true_oom() -> None:
    sim = CachingAllocatorSim(100 * MIB)
    sim.malloc(60 * MIB)
    cached = sim.malloc(20 * MIB)
    sim.free(cached)  # a cached 20 MiB segment
    assert sim.stats().reserved_bytes == 80 * MIB
    before = sim.state_key()
    with pytest.raises(SimOutOfMemory) as info:
        sim.malloc(60 * MIB)
    assert isinstance(info.value, MemoryError)
    msg = str(info.value)
    assert "Tried to allocate 60.00 MiB" in msg
    assert "total capacity of 100.00 MiB" in msg
    assert "60.00 MiB is allocated by PyTorch" in msg
    assert info.value.reserved_bytes == 60 * MIB
    s = sim.stats()
    assert s.num_ooms == 1
    assert s.num_alloc_retries == 1  # the retry was attempted before giving up
    assert s.reserved_bytes == 60 * MIB  # the cached segment was released on the way
    assert sim.state_key() != before
    sim.check_invariants()
    with pytest.raises(SimOutOfMemory):
        sim.malloc(60 * MIB)
    assert sim.stats().num_ooms == 2
    assert sim.stats().num_alloc_retries == 2


def test_oom_message_reports_the_segment_size() -> None:
    sim = CachingAllocatorSim(10 * MIB)
    with pytest.raises(SimOutOfMemory, match=r"Tried to allocate 20\.00 MiB"):
        sim.malloc(2 * MIB)  # a 2 MiB request asks cudaMalloc for 20 MiB


def test_capacity_shrinking() -> None:
    sim = CachingAllocatorSim(GIB)
    a = sim.malloc(500 * MIB)
    sim.capacity_bytes = 400 * MIB  # another process took memory
    assert sim.stats().reserved_bytes == 500 * MIB  # stays until freed
    sim.free(a)
    b = sim.malloc(100 * MIB)  # split from the cached 500 MiB block: no new memory needed
    assert mib_layout(sim) == [[(100.0, 1), (400.0, 0)]]
    assert sim.stats().reserved_bytes == 500 * MIB
    with pytest.raises(SimOutOfMemory):
        sim.malloc(450 * MIB)  # 400 MiB free in a split segment: nothing can be released
    sim.free(b)
    sim.malloc(450 * MIB)  # whole again: best fit reuses it, still above the capacity
    assert sim.stats().reserved_bytes == 500 * MIB
    sim.check_invariants()

    other = CachingAllocatorSim(GIB)
    other.free(other.malloc(500 * MIB))
    other.capacity_bytes = 400 * MIB
    with pytest.raises(SimOutOfMemory):
        other.malloc(520 * MIB)  # 500 + 520 > 400; release the cached 500; 520 > 400 still
    s = other.stats()
    assert (s.reserved_bytes, s.num_alloc_retries, s.num_ooms) == (0, 1, 1)
    other.malloc(300 * MIB)
    assert other.stats().reserved_bytes == 300 * MIB
    other.capacity_bytes = 2 * GIB  # and it can grow again
    other.malloc(1000 * MIB)
    assert other.stats().reserved_bytes == 1300 * MIB


def test_peak_stats_and_reset() -> None:
    sim = CachingAllocatorSim(BIG)
    a = sim.malloc(30 * MIB)
    b = sim.malloc(30 * MIB)
    sim.free(a)
    sim.free(b)
    s = sim.stats()
    assert (s.allocated_bytes, s.peak_allocated_bytes) == (0, 60 * MIB)
    assert s.peak_reserved_bytes == 60 * MIB
    sim.empty_cache()
    sim.reset_peak_stats()
    s = sim.stats()
    assert (s.peak_allocated_bytes, s.peak_reserved_bytes) == (0, 0)
    sim.malloc(MIB)
    assert sim.stats().peak_reserved_bytes == 2 * MIB


def test_zero_size_and_bad_frees() -> None:
    sim = CachingAllocatorSim(BIG)
    z = sim.malloc(0)
    assert sim.stats() == AllocatorStats(0, 0, 0, 0, 0, 0, 0, 0, 0, 0)
    h = sim.malloc(10)
    assert z != h
    sim.free(z)
    with pytest.raises(ValueError):
        sim.free(z)
    sim.free(h)
    with pytest.raises(ValueError):
        sim.free(h)
    with pytest.raises(ValueError):
        sim.free(12345)
    with pytest.raises(ValueError):
        sim.malloc(-1)
    with pytest.raises(TypeError):
        sim.malloc(1.5)  # type: ignore[arg-type]
    sim.check_invariants()


def test_numpy_integer_sizes() -> None:
    np = pytest.importorskip("numpy")
    sim = CachingAllocatorSim(np.int64(BIG))
    h = sim.malloc(np.int64(16 * MIB))
    sim.malloc(np.uint32(1000))
    assert sim.stats().allocated_bytes == 16 * MIB + 1024
    assert type(sim.stats().requested_bytes) is int
    sim.free(h)
    sim.check_invariants()


def test_empty_cache_keeps_split_segments() -> None:
    sim = CachingAllocatorSim(BIG)
    a = sim.malloc(4 * MIB)
    b = sim.malloc(4 * MIB)  # same 20 MiB segment
    c = sim.malloc(16 * MIB)  # its own 16 MiB segment
    sim.free(a)
    sim.free(c)
    sim.empty_cache()  # the 16 MiB segment is released, the split 20 MiB one stays
    assert mib_layout(sim) == [[(4.0, 0), (4.0, 1), (12.0, 0)]]
    assert sim.stats().inactive_split_bytes == 16 * MIB
    sim.free(b)
    sim.empty_cache()
    assert sim.stats().reserved_bytes == 0
    assert sim.stats().segments == 0


# ---------------------------------------------------------------------------- expandable


def test_expandable_eight_16mib() -> None:
    sim = CachingAllocatorSim(BIG, expandable_segments=True)
    hs = [sim.malloc(16 * MIB) for _ in range(8)]
    # 128 MiB live in one growing segment; pages of 20 MiB: 7 pages = 140 MiB
    s = sim.stats()
    assert s.reserved_bytes == 140 * MIB
    assert s.segments == 1
    assert s.inactive_split_bytes == 0
    sim.check_invariants()
    for h in hs:
        sim.free(h)
    assert sim.stats().reserved_bytes == 140 * MIB
    sim.empty_cache()
    assert sim.stats().reserved_bytes == 0
    assert sim.stats().segments == 0
    assert sim.state_key()[4:6] == ((), ())  # the segment itself is gone


def test_expandable_small_pool_pages_are_2mib() -> None:
    sim = CachingAllocatorSim(BIG, expandable_segments=True)
    for _ in range(3):
        sim.malloc(MIB)
    assert sim.stats().reserved_bytes == 4 * MIB
    sim.check_invariants()


def test_expandable_splits_large_blocks_down_to_512() -> None:
    sim = CachingAllocatorSim(BIG, expandable_segments=True)
    sim.malloc(20 * MIB - 512)  # one page; the 512 B rest is split off
    assert sim.stats().allocated_bytes == 20 * MIB - 512
    plain = CachingAllocatorSim(BIG)
    plain.malloc(20 * MIB - 512)  # 20 MiB segment; 512 B rest is not > 1 MiB: not split
    assert plain.stats().allocated_bytes == 20 * MIB


def test_expandable_best_fit_counts_unmapped_tail() -> None:
    sim = CachingAllocatorSim(BIG, expandable_segments=True)
    sim.malloc(16 * MIB)  # page 0: [a16][free 4]
    b = sim.malloc(24 * MIB)  # free 4 + page 1: [a16][b24]
    sim.malloc(16 * MIB)  # page 2: [a16][b24][c16][free 4]
    sim.free(b)  # [a16][free 24][c16][free 4][unmapped]
    # a 4 MiB request: the 4 MiB tail block counts as 4 MiB + the unmapped space behind it,
    # so the 24 MiB block is the better fit and is split
    sim.malloc(4 * MIB)
    assert mib_layout(sim)[0][:5] == [(16.0, 1), (4.0, 1), (20.0, 0), (16.0, 1), (4.0, 0)]
    assert layout(sim)[0][5][1] == 2
    sim.check_invariants()


def test_expandable_retry_unmaps_free_pages_between_live_blocks() -> None:
    # a big GPU of which only 100 MiB are available to us
    sim = CachingAllocatorSim(100 * MIB, expandable_segments=True, device_total_bytes=BIG)
    sim.malloc(20 * MIB)  # page 0
    b = sim.malloc(40 * MIB)  # pages 1-2
    sim.malloc(20 * MIB)  # page 3
    sim.free(b)
    assert sim.stats().reserved_bytes == 80 * MIB
    # 60 MiB: the free 40 MiB block is too small and 80 + 60 > 100; the retry unmaps pages
    # 1-2 (between two live blocks), then maps three pages after page 3
    sim.malloc(60 * MIB)
    s = sim.stats()
    assert s.num_alloc_retries == 1
    assert s.reserved_bytes == 100 * MIB
    assert s.segments == 2  # mapped ranges: page 0, pages 3-6
    assert mib_layout(sim)[0][:4] == [(20.0, 1), (40.0, 2), (20.0, 1), (60.0, 1)]
    sim.check_invariants()


def test_expandable_address_range_is_9_8_of_device_memory() -> None:
    # device memory 100 MiB: the segment's range is 112.5 MiB, i.e. 6 pages of 20 MiB
    sim = CachingAllocatorSim(100 * MIB, expandable_segments=True)
    sim.malloc(20 * MIB)
    b = sim.malloc(40 * MIB)
    sim.malloc(20 * MIB)
    sim.free(b)
    # as above, but after pages 1-2 are unmapped only 2 pages of address space are left at
    # the end, so find_expandable_block opens a second segment for the 60 MiB
    sim.malloc(60 * MIB)
    assert mib_layout(sim) == [
        [(20.0, 1), (40.0, 2), (20.0, 1), (40.0, 2)],
        [(60.0, 1), (60.0, 2)],
    ]
    assert sim.stats().segments == 3
    assert sim.stats().reserved_bytes == 100 * MIB
    sim.check_invariants()


def test_expandable_gap_is_refilled_first() -> None:
    sim = CachingAllocatorSim(100 * MIB, expandable_segments=True)
    sim.malloc(20 * MIB)
    b = sim.malloc(40 * MIB)
    sim.malloc(20 * MIB)
    sim.free(b)
    sim.empty_cache()  # unmaps pages 1-2
    assert sim.stats().reserved_bytes == 40 * MIB
    assert sim.stats().segments == 2
    sim.malloc(30 * MIB)  # the lowest address with room is the gap: map pages 1-2 again
    assert mib_layout(sim)[0][:4] == [(20.0, 1), (30.0, 1), (10.0, 0), (20.0, 1)]
    assert sim.stats().reserved_bytes == 80 * MIB
    assert sim.stats().segments == 1
    sim.check_invariants()


def test_expandable_oom() -> None:
    sim = CachingAllocatorSim(50 * MIB, expandable_segments=True)
    sim.malloc(30 * MIB)  # two pages (40 MiB), 10 MiB free at the end
    with pytest.raises(SimOutOfMemory):
        sim.malloc(30 * MIB)  # 10 MiB free + one more page would be 60 MiB > 50
    s = sim.stats()
    assert (s.num_ooms, s.num_alloc_retries, s.reserved_bytes) == (1, 1, 40 * MIB)
    sim.check_invariants()


# ---------------------------------------------------------------------------- state_key


def test_state_key() -> None:
    one = CachingAllocatorSim(BIG)
    two = CachingAllocatorSim(BIG)
    for sim in (one, two):
        sim.malloc(16 * MIB)
    assert one.state_key() == two.state_key()
    assert hash(one.state_key()) == hash(two.state_key())
    one.malloc(MIB)
    assert one.state_key() != two.state_key()
    # same layout reached through different addresses: equal keys
    a = CachingAllocatorSim(BIG)
    a.free(a.malloc(0))
    a.malloc(16 * MIB)
    b = CachingAllocatorSim(BIG)
    b.free(b.malloc(64 * MIB))
    b.empty_cache()
    b.malloc(16 * MIB)
    assert a.state_key() == b.state_key()
    # the configuration is part of the key
    c = CachingAllocatorSim(BIG, max_split_size=100 * MIB)
    c.free(c.malloc(0))
    c.malloc(16 * MIB)
    assert c.state_key() != a.state_key()


# ---------------------------------------------------------------------------- reference model


class RefSim:
    """The non-expandable allocator written naively: lists and linear scans, no bookkeeping
    beyond the layout itself. Segments are kept in address order (new ones at the end)."""

    def __init__(self, capacity: int, max_split_size: int | None) -> None:
        self.capacity = capacity
        self.mss = max_split_size if max_split_size is not None else 1 << 80
        self.mss_set = max_split_size is not None
        self.segs: list[tuple[int, list[list[int]]]] = []  # (pool, [[size, state, handle, req]])
        self.next_handle = 1
        self.zero: set[int] = set()
        self.retries = 0
        self.ooms = 0
        self.peak_alloc = 0
        self.peak_res = 0

    def reserved(self) -> int:
        return sum(b[0] for _, bl in self.segs for b in bl)

    def allocated(self) -> int:
        return sum(b[0] for _, bl in self.segs for b in bl if b[1] == 1)

    def requested(self) -> int:
        return sum(b[3] for _, bl in self.segs for b in bl if b[1] == 1)

    def inactive_split(self) -> int:
        return sum(b[0] for _, bl in self.segs if len(bl) > 1 for b in bl if b[1] == 0)

    def free_blocks(self, pool: int) -> list[tuple[int, int, int]]:
        out = []
        for si, (p, bl) in enumerate(self.segs):
            if p == pool:
                out += [(b[0], si, bi) for bi, b in enumerate(bl) if b[1] == 0]
        return sorted(out)

    def alloc_segment(self, pool: int, alloc_size: int) -> tuple[int, int] | None:
        if self.reserved() + alloc_size > self.capacity:
            return None
        self.segs.append((pool, [[alloc_size, 0, 0, 0]]))
        self.peak_res = max(self.peak_res, self.reserved())
        return len(self.segs) - 1, 0

    def release_whole(self, si: int) -> None:
        assert len(self.segs[si][1]) == 1
        del self.segs[si]

    def release_available(self, pool: int, rsize: int) -> bool:
        target = max(rsize, self.mss)
        fb = self.free_blocks(pool)
        fits = [f for f in fb if f[0] >= target]
        if fits:
            self.release_whole(fits[0][1])
            return True
        released = 0
        victims = []
        for size, si, _ in reversed(fb):
            if released >= target or size < self.mss:
                break
            released += size
            victims.append(si)
        for si in sorted(victims, reverse=True):
            self.release_whole(si)
        return released >= target

    def malloc(self, size: int) -> int:
        if size == 0:
            self.next_handle += 1
            self.zero.add(self.next_handle - 1)
            return self.next_handle - 1
        rsize = max(512, -(-size // 512) * 512)
        pool = 0 if rsize <= MIB else 1
        found = None
        fits = [f for f in self.free_blocks(pool) if f[0] >= rsize]
        if fits:
            bsize, si, bi = fits[0]
            if (rsize < self.mss and bsize < self.mss) or (
                rsize >= self.mss and bsize < rsize + 20 * MIB
            ):
                found = (si, bi)
        if found is None:
            alloc = allocation_size(rsize)
            found = self.alloc_segment(pool, alloc)
            if found is None and self.mss_set and self.release_available(pool, rsize):
                found = self.alloc_segment(pool, alloc)
            if found is None:
                self.segs = [s for s in self.segs if not (len(s[1]) == 1 and s[1][0][1] == 0)]
                self.retries += 1
                found = self.alloc_segment(pool, alloc)
            if found is None:
                self.ooms += 1
                raise SimOutOfMemory(
                    "ref",
                    requested_bytes=size,
                    alloc_size=alloc,
                    capacity_bytes=self.capacity,
                    reserved_bytes=self.reserved(),
                    allocated_bytes=self.allocated(),
                )
        si, bi = found
        blocks = self.segs[si][1]
        rest = blocks[bi][0] - rsize
        split = rest >= 512 if pool == 0 else (rest > MIB and rsize < self.mss)
        handle = self.next_handle
        self.next_handle += 1
        if split:
            blocks[bi][0] = rest
            blocks.insert(bi, [rsize, 1, handle, size])
        else:
            blocks[bi][1:] = [1, handle, size]
        self.peak_alloc = max(self.peak_alloc, self.allocated())
        return handle

    def free(self, handle: int) -> None:
        if handle in self.zero:
            self.zero.remove(handle)
            return
        for _, blocks in self.segs:
            for bi, b in enumerate(blocks):
                if b[1] == 1 and b[2] == handle:
                    b[1:] = [0, 0, 0]
                    if bi + 1 < len(blocks) and blocks[bi + 1][1] == 0:
                        b[0] += blocks.pop(bi + 1)[0]
                    if bi > 0 and blocks[bi - 1][1] == 0:
                        blocks[bi - 1][0] += blocks.pop(bi)[0]
                    return
        raise ValueError(handle)

    def empty_cache(self) -> None:
        self.segs = [s for s in self.segs if not (len(s[1]) == 1 and s[1][0][1] == 0)]

    def pools(self) -> tuple[tuple, tuple]:
        out: tuple[list, list] = ([], [])
        for pool, blocks in self.segs:
            out[pool].append(tuple((b[0], b[1], b[2]) for b in blocks))
        return tuple(out[0]), tuple(out[1])


# ---------------------------------------------------------------------------- properties

SIZES = st.one_of(
    st.integers(0, 4 * KIB),
    st.integers(0, MIB + 4 * KIB),
    st.integers(MIB, 30 * MIB),
    st.integers(30 * MIB, 300 * MIB),
    st.integers(1, 40).map(lambda k: k * 4 * MIB),  # whole pages and oversize blocks
    st.sampled_from([512, MIB, 2 * MIB, 10 * MIB, 16 * MIB, 20 * MIB, 32 * MIB, 100 * MIB]),
)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("malloc"), SIZES),
        st.tuples(st.just("malloc"), SIZES),
        st.tuples(st.just("malloc"), SIZES),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("free"), st.integers(0, 1000)),
        st.tuples(st.just("empty"), st.just(0)),
        st.tuples(st.just("capacity"), st.integers(64, 1024).map(lambda m: m * MIB)),
    ),
    max_size=100,
)
CONFIGS = st.sampled_from(
    [
        {},
        {"max_split_size": 64 * MIB},
        {"max_split_size": 20 * MIB},
        {"expandable_segments": True},
        {"expandable_segments": True, "max_split_size": 64 * MIB},
    ]
)
PROPERTY_SETTINGS = settings(
    max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)


@PROPERTY_SETTINGS
@given(config=CONFIGS, capacity=st.integers(64, 1024), ops=OPS)
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_random_sequences_keep_the_books(config: dict, capacity: int, ops: list) -> None:
    sim = CachingAllocatorSim(capacity * MIB, **config)
    live: list[tuple[int, int]] = []  # (handle, requested size)
    for op, arg in ops:
        before = sim.stats().reserved_bytes
        if op == "malloc":
            with contextlib.suppress(SimOutOfMemory):
                live.append((sim.malloc(arg), arg))
            after = sim.stats().reserved_bytes
            # memory is only ever added while it fits under the capacity
            assert after <= max(sim.capacity_bytes, before)
        elif op == "free" and live:
            handle, _ = live.pop(arg % len(live))
            sim.free(handle)
            assert sim.stats().reserved_bytes == before
        elif op == "empty":
            sim.empty_cache()
            assert sim.stats().reserved_bytes <= before
        elif op == "capacity":
            sim.capacity_bytes = arg
        sim.check_invariants()
        s = sim.stats()
        assert s.reserved_bytes >= s.allocated_bytes >= 0
        assert s.allocated_bytes == s.active_bytes
        # allocated counts whole blocks: at least the rounded requests, plus a rest too small
        # to split off (< 20 MiB each); check_invariants compares it with the block sizes
        rounded = [round_size(n) for _, n in live if n]
        assert sum(rounded) <= s.allocated_bytes < sum(rounded) + 20 * MIB * len(rounded) + 1
        assert s.requested_bytes == sum(n for _, n in live)
        assert s.peak_allocated_bytes >= s.allocated_bytes
        assert s.peak_reserved_bytes >= s.reserved_bytes
        if config.get("expandable_segments"):
            assert s.inactive_split_bytes == 0
    for handle, _ in live:
        sim.free(handle)
    sim.check_invariants()
    s = sim.stats()
    assert (s.allocated_bytes, s.requested_bytes, s.inactive_split_bytes) == (0, 0, 0)
    for pool in sim.state_key()[4:6]:
        for seg in pool:
            # only whole free segments (or free runs between unmapped pages) are left
            assert all(state != 1 for _, state, _ in seg)
            if not config.get("expandable_segments"):
                assert len(seg) == 1
    sim.empty_cache()
    sim.check_invariants()
    s = sim.stats()
    assert s.reserved_bytes == 0
    assert s.segments == 0
    for pool in sim.state_key()[4:6]:
        for seg in pool:  # at most a never-mapped expandable segment left by a failed map
            assert [state for _, state, _ in seg] == [2]


@PROPERTY_SETTINGS
@given(
    mss=st.sampled_from([None, 20 * MIB, 64 * MIB, 256 * MIB]),
    capacity=st.integers(64, 1024),
    ops=OPS,
)
def test_matches_naive_reference_model(mss: int | None, capacity: int, ops: list) -> None:
    sim = CachingAllocatorSim(capacity * MIB, max_split_size=mss)
    ref = RefSim(capacity * MIB, mss)
    live: list[int] = []
    for op, arg in ops:
        if op == "malloc":
            outcome = []
            for model in (sim, ref):
                try:
                    outcome.append(model.malloc(arg))
                except SimOutOfMemory:
                    outcome.append(None)
            assert outcome[0] == outcome[1]
            if outcome[0] is not None:
                live.append(outcome[0])
        elif op == "free" and live:
            handle = live.pop(arg % len(live))
            sim.free(handle)
            ref.free(handle)
        elif op == "empty":
            sim.empty_cache()
            ref.empty_cache()
        elif op == "capacity":
            sim.capacity_bytes = ref.capacity = arg
        assert sim.state_key()[4:6] == ref.pools()
        s = sim.stats()
        assert s.allocated_bytes == ref.allocated()
        assert s.reserved_bytes == ref.reserved()
        assert s.requested_bytes == ref.requested()
        assert s.inactive_split_bytes == ref.inactive_split()
        assert s.segments == len(ref.segs)
        assert (s.num_alloc_retries, s.num_ooms) == (ref.retries, ref.ooms)
        assert (s.peak_allocated_bytes, s.peak_reserved_bytes) == (ref.peak_alloc, ref.peak_res)


@settings(max_examples=60, deadline=None)
@given(config=CONFIGS, ops=OPS, tail=OPS)
def test_equal_state_keys_mean_equal_futures(config: dict, ops: list, tail: list) -> None:
    """Two allocators driven identically agree on keys; replaying the same future on both
    gives the same outcomes, and the key never depends on the stats or the address base."""
    one = CachingAllocatorSim(GIB, **config)
    two = CachingAllocatorSim(GIB, **config)
    two.free(two.malloc(300 * MIB))
    two.empty_cache()  # shifts every future address of `two`
    two.free(two.malloc(0))
    one.free(one.malloc(0))
    one.free(one.malloc(0))
    assert one.state_key() == two.state_key()
    lives: list[list[int]] = [[], []]
    for op, arg in ops + tail:
        results = []
        for sim, live in zip((one, two), lives, strict=True):
            if op == "malloc":
                try:
                    live.append(sim.malloc(arg))
                    results.append("ok")
                except SimOutOfMemory:
                    results.append("oom")
            elif op == "free" and live:
                sim.free(live.pop(arg % len(live)))
            elif op == "empty":
                sim.empty_cache()
            elif op == "capacity":
                sim.capacity_bytes = arg
        assert len(set(results)) <= 1
        assert one.state_key() == two.state_key()
        assert one.stats().reserved_bytes == two.stats().reserved_bytes


SOAK_CONFIGS: list[dict] = [
    {},
    {"max_split_size": 64 * MIB},
    {"max_split_size": 20 * MIB},
    {"expandable_segments": True},
    {"expandable_segments": True, "max_split_size": 64 * MIB},
    {"expandable_segments": True, "device_total_bytes": 8 * GIB},
]


def _soak_size(rng: random.Random) -> int:
    kind = rng.random()
    if kind < 0.3:
        return rng.randrange(0, MIB + 4096)
    if kind < 0.6:
        return rng.randrange(MIB, 40 * MIB)
    if kind < 0.8:
        return rng.randrange(1, 40) * 4 * MIB - rng.choice([0, 0, 512, MIB])
    return rng.randrange(40 * MIB, 250 * MIB)


@pytest.mark.parametrize("config", SOAK_CONFIGS, ids=lambda c: "-".join(map(str, c)) or "plain")
def test_long_random_runs(config: dict) -> None:
    """Long seeded runs under memory pressure reach states short examples do not (gaps in
    expandable segments, oversize releases); the non-expandable ones are compared op by op with
    the reference model."""
    rng = random.Random(1234)
    for _ in range(6):
        capacity = rng.randrange(200, 700) * MIB
        sim = CachingAllocatorSim(capacity, **config)
        ref = None if config.get("expandable_segments") else RefSim(capacity, sim.max_split_size)
        live: list[int] = []
        for _ in range(400):
            r = rng.random()
            if r < 0.5:
                size = _soak_size(rng)
                try:
                    handle: int | None = sim.malloc(size)
                except SimOutOfMemory:
                    handle = None
                if ref is not None:
                    try:
                        assert ref.malloc(size) == handle
                    except SimOutOfMemory:
                        assert handle is None
                if handle is not None:
                    live.append(handle)
            elif r < 0.94 and live:
                handle = live.pop(rng.randrange(len(live)))
                sim.free(handle)
                if ref is not None:
                    ref.free(handle)
            elif r < 0.97:
                sim.empty_cache()
                if ref is not None:
                    ref.empty_cache()
            else:
                sim.capacity_bytes = rng.randrange(150, 800) * MIB
                if ref is not None:
                    ref.capacity = sim.capacity_bytes
            sim.check_invariants()
            if ref is not None:
                assert sim.state_key()[4:6] == ref.pools()
                s = sim.stats()
                assert (s.num_alloc_retries, s.num_ooms) == (ref.retries, ref.ooms)
                assert s.inactive_split_bytes == ref.inactive_split()
        for handle in live:
            sim.free(handle)
        sim.empty_cache()
        sim.check_invariants()
        assert sim.stats().reserved_bytes == 0


@pytest.mark.parametrize("expandable", [False, True])
def test_memory_snapshot_matches_the_stats(expandable: bool) -> None:
    """``memory_snapshot`` (torch's snapshot format) adds up to the allocator's own stats
    after a random mix of requests and frees, with each live block's stack."""
    rng = random.Random(7)
    sim = CachingAllocatorSim(512 * MIB, expandable_segments=expandable)
    live: list[int] = []
    for _ in range(400):
        if live and rng.random() < 0.45:
            sim.free(live.pop(rng.randrange(len(live))))
        else:
            try:
                live.append(sim.malloc(rng.choice([300, 64 * 1024, 900 * 1024, 3 * MIB, 12 * MIB])))
            except SimOutOfMemory:
                sim.empty_cache()
    snap = sim.memory_snapshot(lambda h: [{"filename": "t.py", "line": h, "name": "f"}])
    blocks = [b for seg in snap["segments"] for b in seg["blocks"]]
    stats = sim.stats()
    assert sum(seg["total_size"] for seg in snap["segments"]) == stats.reserved_bytes
    active = [b for b in blocks if b["state"] == "active_allocated"]
    assert sum(b["size"] for b in active) == stats.allocated_bytes
    assert len(active) == len(live)
    assert {b["frames"][0]["line"] for b in active} == set(live)
    assert len(snap["segments"]) == stats.segments
