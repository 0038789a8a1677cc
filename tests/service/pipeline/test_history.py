"""The per-domain history ring (service/pipeline/history.py): fixed size, oldest first, exact."""

from __future__ import annotations

import pytest

from oomcast.service.pipeline.history import HISTORY_BYTES_PER_POINT, History, HistoryPoint


def test_it_keeps_the_last_maxlen_points_oldest_first() -> None:
    h = History(4)
    for i in range(10):
        h.append(float(i), 100 + i, 1000, i / 10, None if i % 2 else float(i))
    assert len(h) == 4
    assert [p.ts for p in h] == [6.0, 7.0, 8.0, 9.0]
    assert h.points(2) == [
        HistoryPoint(8.0, 108, 1000, pytest.approx(0.8), 8.0),
        HistoryPoint(9.0, 109, 1000, pytest.approx(0.9), None),
    ]
    assert h.points(0) == [] and len(h.points(99)) == 4


def test_its_memory_is_fixed_by_maxlen() -> None:
    h = History(600)
    arrays = [h._ts, h._used, h._total, h._risk, h._tto]
    assert sum(a.nbytes for a in arrays) == h.nbytes == 600 * HISTORY_BYTES_PER_POINT
    for i in range(5000):
        h.append(float(i), i, 10_000, 0.1, None)
    assert [a.nbytes for a in [h._ts, h._used, h._total, h._risk, h._tto]] == [
        a.nbytes for a in arrays
    ]


def test_byte_counts_and_times_are_exact() -> None:
    h = History(3)
    big = 2**62 + 1  # past float64's integers
    h.append(1_733_000_000.123456, big, big, 0.5, None)
    (p,) = h.points()
    assert p.ts == 1_733_000_000.123456 and p.used_bytes == big and p.total_bytes == big


def test_seen_finds_a_redelivered_point_and_stops_at_older_ones() -> None:
    h = History(8)
    for i in range(5):
        h.append(float(i), i * 10, 100, 0.0, None)
    assert h.seen(3.0, 30) and h.seen(0.0, 0)
    assert not h.seen(3.0, 31) and not h.seen(2.5, 25) and not h.seen(9.0, 90)
    h.clear()
    assert len(h) == 0 and not h.seen(3.0, 30) and list(h) == []


def test_an_empty_ring_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        History(0)


def test_a_point_packed_in_place_reads_back_as_the_array_writes_it() -> None:
    """``append`` packs bytes where the record array would write them: what comes back
    through the columns is what a record assignment gives, float32 rounding included, and a
    risk or time to OOM past float32's range reads as infinity instead of failing."""
    import math

    import numpy as np

    from oomcast.service.pipeline.history import POINT

    h = History(4)
    values = [(1.25, 7, 9, 0.1, 33.3), (2.5, 0, 2**63 - 1, 1.0, None), (3.75, 5, 6, 1e40, 1e300)]
    for v in values:
        with np.errstate(over="ignore"):
            h.append(*v)
    expected = np.zeros(3, POINT)
    with np.errstate(over="ignore"):
        for i, (ts, used, total, risk, tto) in enumerate(values):
            expected[i] = (ts, used, total, risk, math.nan if tto is None else tto)
    got = h.columns()
    for name in ("ts", "used", "total"):
        assert got[name].tolist() == expected[name].tolist()
    assert got["risk"].tolist() == expected["risk"].astype(np.float64).tolist()
    assert got["risk"][2] == math.inf and got["tto"][2] == math.inf
    assert math.isnan(got["tto"][1]) and h.points()[1].time_to_oom_s is None
