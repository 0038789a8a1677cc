"""Asking a job to save a checkpoint before it runs out of memory.

:class:`CheckpointAction` asks first through the job's in-process hook: an entry on its
control stream (:func:`~oomcast.model.jobcontrol.jobctl_key`; the protocol is
:mod:`oomcast.model.jobcontrol`), which the hook answers with a ``checkpoint_requested``
event and, once saved, ``checkpoint_done`` (or ``checkpoint_failed``) carrying the request
id. A job whose hook does not answer within ``hook_wait_s`` is sent the checkpoint signal
(SIGUSR1) instead, but only to processes that catch it (``SigCgt`` in
``/proc/<pid>/status``): SIGUSR1's default action terminates the process, which is the
opposite of saving it. Signals go through :func:`~oomcast.collectors.signals.send_signal`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal as signal_mod
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import redis

from oomcast.collectors.actiontypes import MAX_LISTED, ActionResult, Candidate, as_candidate
from oomcast.collectors.procinfo import PROC, catches_signal, live_start_time
from oomcast.collectors.signals import send_signal, signal_name
from oomcast.collectors.streams import entries_of, last_id, stream_fields
from oomcast.model.control import Command
from oomcast.model.jobcontrol import (
    ANSWER_EVENTS,
    CHECKPOINT,
    CHECKPOINT_FAILED,
    CHECKPOINT_REQUESTED,
    FINAL_EVENTS,
    answers_request,
    encode_jobctl,
    event_object,
    jobctl_key,
)
from oomcast.model.wire import Keys

log = logging.getLogger(__name__)

JOBCTL_MAXLEN = 1000


def _answers(obj: dict[str, Any], request_id: str, events: Sequence[str]) -> bool:
    return obj.get("event") in events and answers_request(obj, request_id)


class CheckpointAction:
    """Ask a job to save a checkpoint: through its hook, else by signal to the processes that
    catch it. See the module docstring.

    client: a Redis client (its socket timeout must exceed ``block_ms``).
    keys: the Keys (or key prefix) of the deployment, for the events and job streams.
    signal: the fallback signal, or None for no fallback.
    ack_timeout_s: how long the job has to report the checkpoint saved.
    hook_wait_s: how long the hook has to acknowledge the request before the signal is used.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys | str,
        *,
        signal: int | None = signal_mod.SIGUSR1,
        ack_timeout_s: float = 60.0,
        hook_wait_s: float = 3.0,
        proc_root: Path | str = PROC,
        block_ms: int = 250,
    ) -> None:
        if ack_timeout_s <= 0 or hook_wait_s < 0:
            raise ValueError("ack_timeout_s must be positive and hook_wait_s not negative")
        self.client = client
        self.keys = keys if isinstance(keys, Keys) else Keys(keys)
        self.signal = signal
        self.ack_timeout_s = ack_timeout_s
        self.hook_wait_s = hook_wait_s
        self.proc_root = Path(proc_root)
        self.block_ms = block_ms
        self._cancel = threading.Event()

    def cancel(self) -> None:
        """Make waits in progress (and any later) end at once: the agent is stopping."""
        self._cancel.set()

    def __call__(self, command: Command, candidates: Sequence[Any]) -> ActionResult:
        cands = [as_candidate(c) for c in candidates]
        if command.device.startswith("cgroup:"):
            # Every process of a container's cgroup is the job's. The service names the job
            # after the cgroup; the processes may name it themselves (OOMCAST_JOB, the name
            # the hook listens under): when they agree on one name, ask under that name.
            jobs = {c.job for c in cands}
            if len(jobs) == 1 and command.job not in jobs:
                command = dataclasses.replace(command, job=jobs.pop())
            return self.checkpoint(command, cands)
        own = [c for c in cands if c.job == command.job]
        return self.checkpoint(command, own)

    # -- which processes would get the signal --------------------------------------------------

    def _inspect(
        self, processes: Sequence[int | Candidate]
    ) -> tuple[list[tuple[int, int]], list[dict[str, Any]]]:
        """(pid, start time) of the processes that catch the signal, and why the others
        are left alone."""
        assert self.signal is not None
        catching: list[tuple[int, int]] = []
        left: list[dict[str, Any]] = []
        seen: set[int] = set()
        protected = {1, os.getpid()}
        for item in processes:
            pid, expected = (item, None) if isinstance(item, int) else (item.pid, item.start_time)
            if pid in seen:
                continue
            seen.add(pid)
            why = None
            start = live_start_time(pid, self.proc_root)
            if pid <= 1 or pid in protected:
                why = "pid 1 or the agent itself"
            elif start is None:
                why = "gone"
            elif expected is not None and start != expected:
                why = "pid reused (start time changed)"
            else:
                caught = catches_signal(pid, self.signal, self.proc_root)
                if caught is None:
                    why = "status unreadable"
                elif not caught:
                    why = f"does not catch {signal_name(self.signal)}"
            if why is None:
                assert start is not None
                catching.append((pid, start))
            else:
                left.append({"pid": pid, "why": why})
        return catching, left[:MAX_LISTED]

    # -- the events stream ------------------------------------------------------------------

    def _wait_event(
        self, cursor: str, deadline: float, match: Callable[[dict[str, Any]], bool]
    ) -> tuple[dict[str, Any] | None, str]:
        """The first event after ``cursor`` for which ``match(obj)`` holds, before the
        (monotonic) deadline; and the cursor to go on from."""
        while not self._cancel.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            block = max(1, min(self.block_ms, int(remaining * 1000)))
            try:
                resp = self.client.xread({self.keys.events: cursor}, count=200, block=block)
            except redis.RedisError as exc:
                log.warning("checkpoint: reading events failed (%s); retrying", exc)
                self._cancel.wait(min(0.5, max(0.0, remaining)))
                continue
            for cursor, fields in entries_of(resp):
                obj = event_object(fields)
                if obj is not None and match(obj):
                    return obj, cursor
        return None, cursor

    # -- the action -------------------------------------------------------------------------

    def checkpoint(self, command: Command, processes: Sequence[int | Candidate]) -> ActionResult:
        """Checkpoint ``command.job``; ``processes`` are its pids (or Candidates) on this node."""
        job = command.job
        if not job:
            return ActionResult("refused", "the command names no job to checkpoint")
        key = jobctl_key(self.keys.prefix, job)
        data: dict[str, Any] = {"job": job, "jobctl": key, "request_id": command.id}
        if command.dry_run:
            return self._dry_run(job, key, processes, data)
        started = time.monotonic()
        try:
            cursor = last_id(self.client, self.keys.events)
            reason = command.reason or "oomcast forecast"
            self.client.xadd(
                key,
                stream_fields(encode_jobctl(CHECKPOINT, command.id, reason)),
                maxlen=JOBCTL_MAXLEN,
                approximate=True,
            )
        except redis.RedisError as exc:
            return ActionResult("failed", f"could not send the request to {key}: {exc}", data)
        # 1. the hook: it acknowledges with checkpoint_requested, then reports the save.
        obj, cursor = self._wait_event(
            cursor, started + self.hook_wait_s, lambda o: _answers(o, command.id, ANSWER_EVENTS)
        )
        if obj is not None:
            data["via"] = "hook"
            if obj.get("event") == CHECKPOINT_REQUESTED:
                obj, cursor = self._wait_event(
                    cursor,
                    time.monotonic() + self.ack_timeout_s,
                    lambda o: _answers(o, command.id, FINAL_EVENTS),
                )
            return self._finish(obj, data, started, "the hook took the request but")
        if self._cancel.is_set():
            return ActionResult("failed", "cancelled: the agent is stopping", data)
        # 2. the signal, to the processes that catch it
        return self._by_signal(job, processes, data, cursor, started)

    def _dry_run(
        self, job: str, key: str, processes: Sequence[int | Candidate], data: dict[str, Any]
    ) -> ActionResult:
        if self.signal is None:
            return ActionResult(
                "dry_run", f"would ask job {job} through {key}; no signal fallback", data
            )
        sig_name = signal_name(self.signal)
        catching, left = self._inspect(processes)
        data.update(signal=sig_name, catching_pids=[p for p, _ in catching], not_signalled=left)
        target = f"pids {[p for p, _ in catching]}" if catching else "no process (none catches it)"
        detail = (
            f"would ask job {job} through {key}, then, without an answer within"
            f" {self.hook_wait_s:g} s, send {sig_name} to {target}"
        )
        return ActionResult("dry_run", detail, data)

    def _by_signal(
        self,
        job: str,
        processes: Sequence[int | Candidate],
        data: dict[str, Any],
        cursor: str,
        started: float,
    ) -> ActionResult:
        """The hook did not answer: the signal, to the job's processes that catch it."""
        no_answer = f"job {job}'s hook did not answer within {self.hook_wait_s:g} s"
        if self.signal is None:
            return ActionResult("failed", f"{no_answer} and the signal fallback is off", data)
        sig_name = signal_name(self.signal)
        data["via"] = "signal"
        catching, left = self._inspect(processes)
        data.update(signal=sig_name, not_signalled=left)
        if not processes:
            return ActionResult(
                "refused",
                f"{no_answer}, and no process of it is known here: nothing signalled",
                data,
            )
        if not catching:
            return ActionResult(
                "refused",
                f"{no_answer}, and none of its {len(left)} process(es) here catches {sig_name}"
                " (its default action would kill them): nothing signalled",
                data,
            )
        signalled = []
        for pid, start in catching:
            status = send_signal(pid, start, self.signal, self.proc_root)
            if status == "sent":
                signalled.append(pid)
            else:
                left.append({"pid": pid, "why": status})
        data["signalled_pids"] = signalled
        if not signalled:
            return ActionResult("failed", f"no process of job {job} could be signalled", data)
        log.warning("checkpoint: sent %s to job %s, pids %s", sig_name, job, signalled)

        # the wait goes on from where the hook's ended: a late answer from the hook counts
        def done_by_job(o: dict[str, Any]) -> bool:
            return o.get("event") in FINAL_EVENTS and o.get("job") == job

        obj, cursor = self._wait_event(cursor, time.monotonic() + self.ack_timeout_s, done_by_job)
        if obj is None and not self._cancel.is_set():
            return ActionResult(
                "failed",
                f"signalled {sig_name} to pids {signalled}, no acknowledgement within"
                f" {self.ack_timeout_s:g} s",
                data,
            )
        return self._finish(obj, data, started, f"signalled {sig_name} to pids {signalled}, but")

    def _finish(
        self, obj: dict[str, Any] | None, data: dict[str, Any], started: float, waiting: str
    ) -> ActionResult:
        data["waited_s"] = round(time.monotonic() - started, 3)
        if obj is None:
            if self._cancel.is_set():
                return ActionResult("failed", "cancelled: the agent is stopping", data)
            return ActionResult(
                "failed",
                f"{waiting} reported no checkpoint within {self.ack_timeout_s:g} s",
                data,
            )
        data["path"] = obj.get("path")
        if obj.get("event") == CHECKPOINT_FAILED:
            return ActionResult("failed", f"job {data['job']} reported the checkpoint failed", data)
        where = f" to {obj['path']}" if obj.get("path") else ""
        return ActionResult("done", f"job {data['job']} saved a checkpoint{where}", data)
