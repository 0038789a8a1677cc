"""Shedding load: end lower-priority processes on a threatened domain to free memory.

:class:`ShedAction` frees ``params.need_bytes`` by ending the processes
:mod:`oomcast.collectors.victims` chooses: SIGTERM, up to ``grace_s`` to exit, then SIGKILL
for those still there, every signal through the start-time guard of
:func:`~oomcast.collectors.signals.send_signal`.
"""

from __future__ import annotations

import logging
import signal as signal_mod
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomcast.collectors.actiontypes import MAX_LISTED, ActionResult, Candidate, as_candidate
from oomcast.collectors.procinfo import PROC, live_start_time
from oomcast.collectors.signals import send_signal
from oomcast.collectors.victims import (
    ShedPlan,
    VictimRules,
    protect_cgroup_top,
    protected_priority,
    victim_dict,
)
from oomcast.model.control import Command

log = logging.getLogger(__name__)

_FREED = frozenset({"TERM", "KILL", "gone"})


class ShedAction:
    """End lower-priority processes on a domain to free ``params.need_bytes``.

    Victims: priority strictly below the protected job's (the command's job; its priority is
    ``params.priority`` or, failing that, the highest among its processes in the
    candidates), largest ``used_bytes`` first, until they add up to ``need_bytes``. Never the
    protected job, PID 1, the agent or its parent, a process whose uids are not all in
    ``allowed_uids`` (None: any uid), one whose memory cgroup is outside ``cgroup_scope``
    (None: anywhere), one whose start time is unknown or has changed (pid reuse), nor one
    whose memory use is unknown. If the allowed victims cannot free ``need_bytes`` the
    command is refused unless ``params.allow_partial`` is true.
    """

    def __init__(
        self,
        *,
        grace_s: float = 10.0,
        allowed_uids: set[int] | None = None,
        cgroup_scope: str | None = None,
        proc_root: Path | str = PROC,
        kill_wait_s: float = 2.0,
        require_scope: bool = True,
        poll_s: float = 0.05,
    ) -> None:
        if grace_s < 0 or kill_wait_s < 0 or poll_s <= 0:
            raise ValueError("grace_s and kill_wait_s must not be negative, poll_s positive")
        self.grace_s = grace_s
        self.allowed_uids = None if allowed_uids is None else frozenset(allowed_uids)
        self.cgroup_scope = cgroup_scope
        self.proc_root = Path(proc_root)
        self.kill_wait_s = kill_wait_s
        self.require_scope = require_scope
        self.poll_s = poll_s
        self.rules = VictimRules(self.allowed_uids, cgroup_scope, self.proc_root)

    def plan(
        self,
        candidates: Sequence[Any],
        *,
        need_bytes: int,
        protected_job: str | None,
        protected_priority: int,
    ) -> ShedPlan:
        return self.rules.plan(
            candidates,
            need_bytes=need_bytes,
            protected_job=protected_job,
            protected_priority=protected_priority,
        )

    def __call__(self, command: Command, candidates: Sequence[Any]) -> ActionResult:
        params = command.params
        need = params.get("need_bytes")
        if isinstance(need, float) and need.is_integer():
            need = int(need)
        if isinstance(need, bool) or not isinstance(need, int) or need <= 0:
            return ActionResult(
                "refused", f"params.need_bytes must be a positive integer: {need!r}"
            )
        cands = [as_candidate(c) for c in candidates]
        if (
            not command.dry_run
            and self.require_scope
            and self.allowed_uids is None
            and self.cgroup_scope is None
        ):
            return ActionResult(
                "refused",
                "live shedding needs a scope on this agent (--shed-uids or --shed-cgroup-scope):"
                " without one any process on the domain could be stopped",
            )
        command = protect_cgroup_top(command, cands)
        priority = protected_priority(command, cands)
        if priority is None:
            return ActionResult(
                "refused",
                f"the protected job {command.job!r}'s priority is unknown (not among the"
                " domain's processes, no params.priority): nothing is lower",
            )
        allow_partial = params.get("allow_partial") is True
        plan = self.plan(
            cands, need_bytes=need, protected_job=command.job, protected_priority=priority
        )
        data: dict[str, Any] = {
            "need_bytes": need,
            "protected_job": command.job,
            "protected_priority": priority,
            "victim_bytes": plan.victim_bytes,
            "shortfall_bytes": plan.shortfall_bytes,
            "skipped": plan.skipped[:MAX_LISTED],
        }
        if not plan.victims:
            data["victims"] = []
            return ActionResult(
                "refused", f"no process below priority {priority} may be shed here", data
            )
        if plan.shortfall_bytes and not allow_partial:
            data["victims"] = [victim_dict(v, "not signalled") for v in plan.victims]
            return ActionResult(
                "refused",
                f"the processes that may be shed hold {plan.victim_bytes} bytes, "
                f"{plan.shortfall_bytes} short of the {need} needed (params.allow_partial"
                " is not set)",
                data,
            )
        if command.dry_run:
            data["victims"] = [victim_dict(v, "dry_run") for v in plan.victims]
            pids = [v.pid for v in plan.victims]
            return ActionResult(
                "dry_run",
                f"would send SIGTERM to pids {pids} ({plan.victim_bytes} bytes), SIGKILL"
                f" after {self.grace_s:g} s",
                data,
            )
        ended = self._shed(plan.victims)
        data["victims"] = [victim_dict(v, ended[v.pid]) for v in plan.victims]
        freed = sum(v.used_bytes or 0 for v in plan.victims if ended[v.pid] in _FREED)
        data["freed_bytes"] = freed
        bad = {pid: how for pid, how in ended.items() if how not in _FREED}
        if bad:
            return ActionResult("failed", f"freed about {freed} bytes; not ended: {bad}", data)
        return ActionResult(
            "done",
            f"ended {len(plan.victims)} process(es) of priority below {priority}, about"
            f" {freed} bytes",
            data,
        )

    def _wait_gone(self, targets: dict[int, int], timeout_s: float) -> set[int]:
        """The pids of ``targets`` (pid -> start time) still alive after up to timeout_s."""
        deadline = time.monotonic() + timeout_s
        while True:
            alive = {
                pid
                for pid, start in targets.items()
                if live_start_time(pid, self.proc_root) == start
            }
            if not alive or time.monotonic() >= deadline:
                return alive
            time.sleep(self.poll_s)

    def _shed(self, victims: list[Candidate]) -> dict[int, str]:
        ended: dict[int, str] = {}
        termed: dict[int, int] = {}
        for v in victims:
            assert v.start_time is not None
            status = send_signal(v.pid, v.start_time, signal_mod.SIGTERM, self.proc_root)
            log.warning(
                "shed: SIGTERM to pid %d (job %s, priority %d, %s bytes): %s",
                v.pid,
                v.job,
                v.priority,
                v.used_bytes,
                status,
            )
            if status == "sent":
                termed[v.pid] = v.start_time
            else:  # "reused": the victim exited and its pid went to another process
                ended[v.pid] = "gone" if status == "reused" else status
        alive = self._wait_gone(termed, self.grace_s)
        for pid in termed:
            if pid not in alive:
                ended[pid] = "TERM"
        killed: dict[int, int] = {}
        for pid in alive:
            status = send_signal(pid, termed[pid], signal_mod.SIGKILL, self.proc_root)
            log.warning(
                "shed: pid %d still there after %g s: SIGKILL: %s", pid, self.grace_s, status
            )
            if status == "sent":
                killed[pid] = termed[pid]
            else:
                ended[pid] = "TERM" if status in ("gone", "reused") else status
        still = self._wait_gone(killed, self.kill_wait_s)
        for pid in killed:
            ended[pid] = "unconfirmed (SIGKILL sent, still present)" if pid in still else "KILL"
        return ended
