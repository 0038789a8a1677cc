"""The contract every source keeps: hand the node agent what is due at each tick."""

from __future__ import annotations

from typing import Protocol

from oomcast.model.schema import Record


class Source(Protocol):
    name: str

    def poll(self, now: float) -> list[Record]:
        """Records ready at wall-clock time ``now`` (samples and events), oldest first."""
        ...

    @property
    def exhausted(self) -> bool:
        """True once the source will never produce another record (end of a replay)."""
        ...
