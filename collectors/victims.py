"""Which processes a shed may end: victim selection, before anything is signalled.

Victims have a priority strictly below the protected job's, largest ``used_bytes`` first,
until they add up to ``need_bytes``. Never the protected job, PID 1, the agent or its
parent, a process whose uids are not all in ``allowed_uids`` (None: any uid), one whose
memory cgroup is outside ``cgroup_scope`` (None: anywhere), one whose start time is
unknown or has changed (pid reuse), nor one whose memory use is unknown.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from oomcast.collectors.actiontypes import Candidate, as_candidate
from oomcast.collectors.procinfo import PROC, live_start_time, proc_memory_cgroup, proc_uids
from oomcast.collectors.signals import protected_pids
from oomcast.model.control import Command


def in_scope(path: str, scope: str) -> bool:
    """Whether cgroup ``path`` is ``scope`` or below it (whole path components)."""
    scope = "/" + scope.strip("/")
    path = "/" + path.strip("/")
    return scope == "/" or path == scope or path.startswith(scope + "/")


@dataclass(slots=True)
class ShedPlan:
    need_bytes: int
    protected_job: str | None
    protected_priority: int
    victims: list[Candidate]
    skipped: list[dict[str, Any]]

    @property
    def victim_bytes(self) -> int:
        return sum(v.used_bytes or 0 for v in self.victims)

    @property
    def shortfall_bytes(self) -> int:
        return max(0, self.need_bytes - self.victim_bytes)


def victim_dict(v: Candidate, ended: str) -> dict[str, Any]:
    return {
        "pid": v.pid,
        "job": v.job,
        "priority": v.priority,
        "used_bytes": v.used_bytes,
        "ended": ended,
    }


@dataclass(frozen=True, slots=True)
class VictimRules:
    """What this agent allows a shed to end (see the module docstring)."""

    allowed_uids: frozenset[int] | None = None
    cgroup_scope: str | None = None
    proc_root: Path = PROC

    def why_not(self, c: Candidate, protected_job: str | None, priority: int) -> str | None:
        if c.pid <= 1:
            return "pid 1"
        if c.pid in protected_pids():
            return "the agent or its parent"
        if protected_job is not None and c.job == protected_job:
            return "the protected job"
        if c.priority >= priority:
            return f"priority {c.priority} not below {priority}"
        if not c.used_bytes or c.used_bytes <= 0:
            return "memory use unknown"
        if c.start_time is None:
            return "start time unknown"
        start = live_start_time(c.pid, self.proc_root)
        if start is None:
            return "gone"
        if start != c.start_time:
            return "pid reused (start time changed)"
        if self.allowed_uids is not None:
            uids = proc_uids(c.pid, self.proc_root)
            if uids is None:
                return "uid unreadable"
            if not set(uids) <= self.allowed_uids:
                return f"uid {uids[0]} not allowed"
        if self.cgroup_scope is not None:
            path = proc_memory_cgroup(c.pid, self.proc_root)
            if path is None:
                return "cgroup unreadable"
            if not in_scope(path, self.cgroup_scope):
                return "outside the cgroup scope"
        return None

    def plan(
        self,
        candidates: Sequence[Any],
        *,
        need_bytes: int,
        protected_job: str | None,
        protected_priority: int,
    ) -> ShedPlan:
        eligible: list[Candidate] = []
        skipped: list[dict[str, Any]] = []
        seen: set[int] = set()
        for c in map(as_candidate, candidates):
            if c.pid in seen:
                continue
            seen.add(c.pid)
            why = self.why_not(c, protected_job, protected_priority)
            if why is None:
                eligible.append(c)
            else:
                skipped.append({"pid": c.pid, "job": c.job, "why": why})
        eligible.sort(key=lambda c: (-(c.used_bytes or 0), c.priority, -(c.start_time or 0)))
        victims: list[Candidate] = []
        total = 0
        for c in eligible:
            if total >= need_bytes:
                break
            victims.append(c)
            total += c.used_bytes or 0
        return ShedPlan(need_bytes, protected_job, protected_priority, victims, skipped)


def protect_cgroup_top(command: Command, cands: Sequence[Candidate]) -> Command:
    """A container's cgroup is named after the container, its processes after their jobs:
    when the command's job is none of them, protect the most important job in it."""
    if (
        command.device.startswith("cgroup:")
        and cands
        and not any(c.job == command.job for c in cands)
    ):
        top = max(cands, key=lambda c: c.priority)
        return dataclasses.replace(command, job=top.job)
    return command


def protected_priority(command: Command, cands: Sequence[Candidate]) -> int | None:
    """The protected job's priority: the highest among its processes in ``cands``, lowered
    (never raised) by ``params.priority``; ``params.priority`` alone when the job has no
    process here; None when neither is known."""
    own = [c.priority for c in cands if command.job is not None and c.job == command.job]
    asked = command.params.get("priority")
    if isinstance(asked, bool) or not isinstance(asked, int):
        asked = None
    # params.priority may lower the protected job's bar, never raise it above the job's
    # own priority (that would make jobs above it victims)
    if own and asked is not None:
        return min(max(own), asked)
    if own:
        return max(own)
    return asked
