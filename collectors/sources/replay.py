"""Replay a recorded trace with its original spacing, optionally faster.

By default the records are re-stamped: the first goes out stamped with the wall time the
replay started at, and each later one keeps its distance from the first (trace time, which
is what the forecaster reads). A live service bounds how far a sample's ts may lie from its
arrival (``OOMCAST_MAX_TS_SKEW_S``), so a trace recorded last month must not arrive with
last month's stamps. With ``--speed S`` the stamps run ahead of the clock by
``(1 - 1/S)`` of the time played; ``keep_ts`` (``--keep-ts``) sends the recorded stamps.

The whole file is read and validated before the first record goes out, so a corrupt line
stops the replay with its file name and line number instead of publishing half a trace.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from oomcast.model.schema import Record
from oomcast.model.trace import load_trace


class ReplaySource:
    def __init__(self, path: Path | str, speed: float = 1.0, *, keep_ts: bool = False) -> None:
        if speed <= 0:
            raise ValueError(f"speed={speed} must be positive")
        self.name = f"replay:{Path(path).name}"
        self.speed = speed
        self.keep_ts = keep_ts
        self._records: list[Record] = load_trace(path).records()
        self._next = 0
        self._start_wall: float | None = None

    def __len__(self) -> int:
        return len(self._records)

    def poll(self, now: float) -> list[Record]:
        if not self._records:
            return []
        if self._start_wall is None:
            self._start_wall = now
        t0 = self._records[0].ts
        due_trace_ts = t0 + (now - self._start_wall) * self.speed
        start = self._next
        while self._next < len(self._records) and self._records[self._next].ts <= due_trace_ts:
            self._next += 1
        out = self._records[start : self._next]
        if self.keep_ts:
            return out
        shift = self._start_wall - t0
        return [dataclasses.replace(r, ts=r.ts + shift) for r in out]

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._records)
