"""What every node action shares: the processes it may act on and the result it reports.

An executor is called as ``executor(command, candidates)`` and returns an
:class:`ActionResult`; ``candidates`` are the domain's processes (:class:`Candidate`, or
anything with the same attributes such as
:class:`~oomcast.collectors.sources.nvml.GpuProcess`, or a plain 5-tuple).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

from oomcast.model.control import Command

OUTCOMES = ("done", "failed", "refused", "dry_run")
MAX_LISTED = 50  # processes listed in a result's skipped/not_signalled (results become events)


class Candidate(NamedTuple):
    """One process of a memory domain, as the agent saw it when it chose it."""

    pid: int
    used_bytes: int | None
    job: str | None
    priority: int
    start_time: int | None


def as_candidate(obj: Any) -> Candidate:
    """A Candidate from a Candidate, a GpuProcess-like object or a 5-tuple."""
    if isinstance(obj, Candidate):
        return obj
    if isinstance(obj, tuple):
        return Candidate(*obj)
    return Candidate(obj.pid, obj.used_bytes, obj.job, obj.priority, obj.start_time)


@dataclass(slots=True)
class ActionResult:
    outcome: str  # one of OUTCOMES
    detail: str
    data: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.outcome not in OUTCOMES:
            raise ValueError(f"outcome={self.outcome!r} must be one of {', '.join(OUTCOMES)}")

    def to_dict(self) -> dict[str, Any]:
        return {"outcome": self.outcome, "detail": self.detail, "data": self.data}


class Executor(Protocol):
    def __call__(self, command: Command, candidates: Sequence[Any]) -> ActionResult: ...
