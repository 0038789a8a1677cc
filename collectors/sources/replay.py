"""Replay a recorded trace with its original spacing, optionally faster, keeping its ``ts``.

The whole file is read and validated before the first record goes out, so a corrupt line
stops the replay with its file name and line number instead of publishing half a trace.
"""

from __future__ import annotations

from pathlib import Path

from oomcast.model.schema import Record
from oomcast.model.trace import load_trace


class ReplaySource:
    def __init__(self, path: Path | str, speed: float = 1.0) -> None:
        if speed <= 0:
            raise ValueError(f"speed={speed} must be positive")
        self.name = f"replay:{Path(path).name}"
        self.speed = speed
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
        return self._records[start : self._next]

    @property
    def exhausted(self) -> bool:
        return self._next >= len(self._records)
