"""A domain's recent history as a fixed ring of numpy columns, not a deque of objects.

Each point is a sample's time, used and total bytes, and the forecast made from it (risk at
the ranking horizon and time to OOM): 8 + 8 + 8 + 4 + 4 = 32 bytes. At the default 600
points (a minute at 10 Hz) that is 19.2 KB per domain, allocated once when the domain first
reports and never grown; a deque of 600 small objects took about 110 KB and kept the garbage
collector busy walking them. ``HISTORY_BYTES_PER_POINT`` is the figure docs/scaling.md uses.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

HISTORY_BYTES_PER_POINT = 32
POINT = np.dtype(  # little-endian, as _PACK writes it, on any machine
    [
        ("ts", "<f8"),
        ("used", "<i8"),
        ("total", "<i8"),
        ("risk", "<f4"),
        ("tto", "<f4"),
    ]
)
assert POINT.itemsize == HISTORY_BYTES_PER_POINT
# One point as bytes, laid out as POINT is: an append packs them in place (0.10 us) where
# assigning a tuple to a record of the array costs 0.30 us, once per sample ingested.
_PACK = struct.Struct("<dqqff")
assert _PACK.size == HISTORY_BYTES_PER_POINT


class HistoryPoint(NamedTuple):
    ts: float
    used_bytes: int
    total_bytes: int
    risk: float  # at the alert rule's horizon
    time_to_oom_s: float | None


class History:
    """The last ``maxlen`` points, oldest first when iterated."""

    __slots__ = (
        "_buf",
        "_next",
        "_points",
        "_risk",
        "_size",
        "_total",
        "_ts",
        "_tto",
        "_used",
        "maxlen",
    )

    def __init__(self, maxlen: int) -> None:
        if maxlen < 1:
            raise ValueError(f"a history holds at least 1 point, not {maxlen}")
        self.maxlen = maxlen
        # one record per point, so that an append is one write of 32 bytes (five column
        # writes cost 0.48 us a point); the columns are views of it
        self._buf = bytearray(maxlen * HISTORY_BYTES_PER_POINT)  # zeros
        self._points = np.frombuffer(self._buf, POINT)  # the same bytes, writable
        self._ts = self._points["ts"]
        self._used = self._points["used"]
        self._total = self._points["total"]
        self._risk = self._points["risk"]
        self._tto = self._points["tto"]  # NaN: no OOM in sight
        self._next = 0  # where the next point goes
        self._size = 0

    @property
    def nbytes(self) -> int:
        return self.maxlen * HISTORY_BYTES_PER_POINT

    def __len__(self) -> int:
        return self._size

    def append(
        self, ts: float, used: int, total: int, risk: float, time_to_oom_s: float | None
    ) -> None:
        i = self._next
        tto = math.nan if time_to_oom_s is None else time_to_oom_s
        try:
            _PACK.pack_into(self._buf, i * HISTORY_BYTES_PER_POINT, ts, used, total, risk, tto)
        except (OverflowError, struct.error):  # a float past float32's range: numpy rounds
            self._points[i] = (ts, used, total, risk, tto)  # it to inf, as it always did
        self._next = (i + 1) % self.maxlen
        if self._size < self.maxlen:
            self._size += 1

    def clear(self) -> None:
        self._next = self._size = 0

    def _order(self, last: int | None = None) -> np.ndarray:
        """Ring positions of the last ``last`` points (all by default), oldest first."""
        n = self._size if last is None else max(0, min(last, self._size))
        start = (self._next - n) % self.maxlen
        return (start + np.arange(n)) % self.maxlen

    def columns(self, last: int | None = None) -> dict[str, np.ndarray]:
        """The last ``last`` points as columns (copies), oldest first: ``ts``, ``used``,
        ``total``, ``risk`` (float64) and ``tto`` (float64, NaN for none)."""
        idx = self._order(last)
        return {
            "ts": self._ts[idx],
            "used": self._used[idx],
            "total": self._total[idx],
            "risk": self._risk[idx].astype(np.float64),
            "tto": self._tto[idx].astype(np.float64),
        }

    def points(self, last: int | None = None) -> list[HistoryPoint]:
        """The last ``last`` points, oldest first, as tuples (for the API and snapshots)."""
        c = self.columns(last)
        return [
            HistoryPoint(ts, used, total, risk, None if math.isnan(tto) else tto)
            for ts, used, total, risk, tto in zip(
                c["ts"].tolist(),
                c["used"].tolist(),
                c["total"].tolist(),
                c["risk"].tolist(),
                c["tto"].tolist(),
                strict=True,
            )
        ]

    def __iter__(self) -> Iterator[HistoryPoint]:
        return iter(self.points())

    def seen(self, ts: float, used: int) -> bool:
        """Whether a point of time ``ts`` and use ``used`` is held (a redelivered sample),
        looking back from the newest only as far as points at or after ``ts``."""
        n, i = self._size, self._next
        for _ in range(n):
            i = (i - 1) % self.maxlen
            t = self._ts[i]
            if t < ts:
                return False
            if t == ts and self._used[i] == used:
                return True
        return False

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, History):
            return NotImplemented
        return self.points() == other.points()

    __hash__ = None  # type: ignore[assignment]  # mutable
