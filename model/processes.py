"""Per-process GPU memory in a sample (the ``processes`` field of the trace format): who
else is on the GPU, and how much each holds. The node agent fills it from NVML
(``nvmlDeviceGetComputeRunningProcesses``), with each pid's job from ``/proc``. The service
reads it as evidence: a process that arrived on the GPU, or one of another job that grew, is
a neighbour (model/causes.py)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

MAX_PROCESSES = 256  # more compute processes than any GPU runs: a bigger list is an error
_MAX_PID = 1 << 31


@dataclass(frozen=True, slots=True)
class ProcessUse:
    pid: int
    used_bytes: int | None  # None where NVML gives no per-process figure (some vGPU / MIG)
    job: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"pid": self.pid, "used_bytes": self.used_bytes}
        if self.job is not None:
            out["job"] = self.job
        return out


def parse_processes(
    value: Any, bound: float, good_name: Any
) -> tuple[tuple[ProcessUse, ...] | None, str | None]:
    """The processes of a sample, or the problem with them (a sentence). ``bound``: the
    largest byte count a process may hold (the sample's sanity bound); ``good_name``: the
    schema's check of a name."""
    if value is None:
        return None, None
    if not isinstance(value, list) or len(value) > MAX_PROCESSES:
        return None, f"must be a list of at most {MAX_PROCESSES} processes"
    out = []
    for i, p in enumerate(value):
        if not isinstance(p, dict) or "pid" not in p or "used_bytes" not in p:
            return None, f"[{i}] must be an object with pid and used_bytes (null: unknown)"
        pid, used, job = _whole(p.get("pid")), _whole(p.get("used_bytes")), p.get("job")
        if type(pid) is not int or not 0 < pid < _MAX_PID:
            return None, f"[{i}].pid must be a positive integer, got {str(pid)[:40]!r}"
        if used is not None and (type(used) is not int or not 0 <= used <= bound):
            return None, f"[{i}].used_bytes must be a byte count up to the sanity bound"
        if job is not None and not good_name(job, blank_ok=True):
            return None, f"[{i}].job must be a name of plain text"
        out.append(ProcessUse(pid, used, job))
    return tuple(out), None


def _whole(v: Any) -> Any:
    """JSON writers in other languages send 1.6e10 for an integer: whole floats count."""
    return int(v) if type(v) is float and v.is_integer() else v


def neighbour_growth(
    first: Sequence[ProcessUse] | None, last: Sequence[ProcessUse] | None, job: str | None
) -> int | None:
    """How much the GPU's other processes grew between two samples: every process not of
    ``job`` counts its growth, a process new since ``first`` all it holds. None when either
    sample has no process list."""
    if first is None or last is None:
        return None
    before = {p.pid: p.used_bytes or 0 for p in first}
    grew = 0
    for p in last:
        if job is not None and p.job == job:
            continue
        grew += max(0, (p.used_bytes or 0) - before.get(p.pid, 0))
    return grew
