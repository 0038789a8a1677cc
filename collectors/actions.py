"""What the node agent does on a verified command: ask a job to checkpoint, or shed load.

Both act on processes named by pid, and pids are reused, so every signal goes through the
same guard: the process's start time (``/proc/<pid>/stat`` field 22) must still be the one
recorded when the process was chosen. Where the kernel has pidfds (Linux 5.3+) the pidfd
is opened *before* that check and the signal sent through it, so a pid that is recycled
between the check and the signal cannot be hit; elsewhere ``kill(2)`` follows the check.

Signals are sent in the agent's pid namespace and ``/proc`` is read at ``proc_root``: the
two must be the same view of the pids (on Kubernetes, ``hostPID: true`` with the host's
``/proc``), or no process is touched (every start-time check fails).

**Checkpoint** (:class:`CheckpointAction`): first through the job's in-process hook (an
entry on its control stream, :func:`~oomcast.collectors.hook.jobctl_key`), which answers
with a ``checkpoint_requested`` event and, once saved, ``checkpoint_done`` (or
``checkpoint_failed``) carrying the request id. A job whose hook does not answer within
``hook_wait_s`` is sent the checkpoint signal (SIGUSR1) instead, but only to processes
that catch it (``SigCgt`` in ``/proc/<pid>/status``): SIGUSR1's default action terminates
the process, which is the opposite of saving it.

**Shed** (:class:`ShedAction`): frees ``need_bytes`` on a threatened domain by ending
processes of strictly lower priority than the job it protects, largest first. SIGTERM, up
to ``grace_s`` to exit, then SIGKILL for those still there.

Every executor is called as ``executor(command, candidates)`` and returns an
:class:`ActionResult`; ``candidates`` are the domain's processes (:class:`Candidate`, or
anything with the same attributes such as
:class:`~oomcast.collectors.sources.nvml.GpuProcess`, or a plain 5-tuple).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal as signal_mod
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import redis

from oomcast.collectors.hook import encode_jobctl, jobctl_key
from oomcast.collectors.procinfo import ProcResolver
from oomcast.model.control import Command
from oomcast.model.wire import Keys

log = logging.getLogger(__name__)

OUTCOMES = ("done", "failed", "refused", "dry_run")
MAX_LISTED = 50  # processes listed in a result's skipped/not_signalled (results become events)
JOBCTL_MAXLEN = 1000


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


# --- /proc ------------------------------------------------------------------------------------


def _read(proc_root: Path, pid: int, name: str) -> str | None:
    try:
        return (proc_root / str(pid) / name).read_text("utf-8", "replace")
    except OSError:  # gone, or not ours to read
        return None


def proc_state(pid: int, proc_root: Path | str = "/proc") -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of ``pid``, or None if gone."""
    text = _read(Path(proc_root), pid, "stat")
    if text is None:
        return None
    try:
        fields = text[text.rindex(")") + 2 :].split()
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def live_start_time(pid: int, proc_root: Path | str = "/proc") -> int | None:
    """The start time of ``pid`` if it is alive (a zombie has exited: None)."""
    st = proc_state(pid, proc_root)
    if st is None or st[0] in ("Z", "X", "x"):
        return None
    return st[1]


def proc_status(pid: int, proc_root: Path | str = "/proc") -> dict[str, str] | None:
    text = _read(Path(proc_root), pid, "status")
    if text is None:
        return None
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def catches_signal(pid: int, signum: int, proc_root: Path | str = "/proc") -> bool | None:
    """Whether ``pid`` has a handler installed for ``signum`` (``SigCgt``, a hex mask whose
    bit ``signum - 1`` is set when it does); None when its status cannot be read."""
    status = proc_status(pid, proc_root)
    if status is None or "SigCgt" not in status:
        return None
    try:
        mask = int(status["SigCgt"], 16)
    except ValueError:
        return None
    return bool(mask >> (signum - 1) & 1)


def proc_uids(pid: int, proc_root: Path | str = "/proc") -> tuple[int, ...] | None:
    """(real, effective, saved, filesystem) uids of ``pid``, or None."""
    status = proc_status(pid, proc_root)
    if status is None or "Uid" not in status:
        return None
    try:
        return tuple(int(x) for x in status["Uid"].split())
    except ValueError:
        return None


def proc_memory_cgroup(pid: int, proc_root: Path | str = "/proc") -> str | None:
    """The cgroup path that holds ``pid``'s memory: the v1 memory controller's line where
    there is one (on a hybrid host the v2 line names a hierarchy without that controller),
    else the v2 (``0::``) line."""
    text = _read(Path(proc_root), pid, "cgroup")
    if text is None:
        return None
    v2 = None
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if "memory" in controllers.split(","):
            return path
        if hierarchy == "0" and controllers == "":
            v2 = path
    return v2


def in_scope(path: str, scope: str) -> bool:
    """Whether cgroup ``path`` is ``scope`` or below it (whole path components)."""
    scope = "/" + scope.strip("/")
    path = "/" + path.strip("/")
    return scope == "/" or path == scope or path.startswith(scope + "/")


def processes_in_cgroup(cgroup_dir: Path | str, proc_root: Path | str = "/proc") -> list[int]:
    """The pids in ``cgroup_dir`` and every cgroup below it (``cgroup.procs``), that exist in
    ``proc_root``; pids of another pid namespace read as 0 there and are left out."""
    root = Path(proc_root)
    pids: set[int] = set()
    stack = [Path(cgroup_dir)]
    while stack:
        path = stack.pop()
        try:
            text = (path / "cgroup.procs").read_text()
        except OSError:
            text = ""
        for word in text.split():
            with contextlib.suppress(ValueError):
                pid = int(word)
                if pid > 0:
                    pids.add(pid)
        try:
            with os.scandir(path) as it:
                stack.extend(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return sorted(p for p in pids if (root / str(p)).exists())


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes(pid: int, proc_root: Path | str = "/proc") -> int | None:
    """Resident memory of ``pid`` (``statm`` field 2 × page size), or None if gone."""
    text = _read(Path(proc_root), pid, "statm")
    if text is None:
        return None
    try:
        return int(text.split()[1]) * _PAGE
    except (ValueError, IndexError):
        return None


def cgroup_candidates(
    cgroup_dir: Path | str, resolver: ProcResolver, proc_root: Path | str = "/proc"
) -> list[Candidate]:
    """The processes of a cgroup domain, with their resident memory as ``used_bytes``."""
    out = []
    for pid in processes_in_cgroup(cgroup_dir, proc_root):
        info = resolver.lookup(pid)
        if not info.found:
            continue
        out.append(
            Candidate(pid, rss_bytes(pid, proc_root), info.job, info.priority, info.start_time)
        )
    out.sort(key=lambda c: -(c.used_bytes or 0))
    return out


def send_signal(
    pid: int, start_time: int | None, signum: int, proc_root: Path | str = "/proc"
) -> str:
    """Signal ``pid`` if it is still the process that started at ``start_time`` (None: any
    live process at that pid). Returns "sent", "gone", "reused" or "error: ...".
    Never pid 1 or below, never this process."""
    if pid <= 1 or pid == os.getpid():
        return "error: refusing to signal pid 1 or the agent itself"
    fd: int | None = None
    pidfd_open = getattr(os, "pidfd_open", None)
    pidfd_send = getattr(signal_mod, "pidfd_send_signal", None)
    if pidfd_open is not None and pidfd_send is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:  # ENOSYS on old kernels: fall back to kill(2)
            fd = None
    try:
        current = live_start_time(pid, proc_root)
        if current is None:
            return "gone"
        if start_time is not None and current != start_time:
            return "reused"
        if fd is not None:
            assert pidfd_send is not None
            pidfd_send(fd, signum)
        else:
            os.kill(pid, signum)
        return "sent"
    except ProcessLookupError:
        return "gone"
    except OSError as exc:
        return f"error: {exc.strerror or exc}"
    finally:
        if fd is not None:
            os.close(fd)


def _protected_pids() -> set[int]:
    return {1, os.getpid(), os.getppid()}


def _signal_name(signum: int) -> str:
    try:
        return signal_mod.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# --- checkpoint -------------------------------------------------------------------------------


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def _event_obj(fields: Any) -> dict[str, Any] | None:
    raw = fields.get("event", fields.get(b"event")) if isinstance(fields, dict) else None
    if raw is None:
        return None
    try:
        obj = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return obj if isinstance(obj, dict) else None


def _has_request(obj: dict[str, Any], request_id: str) -> bool:
    if obj.get("request_id") == request_id:
        return True
    ids = obj.get("request_ids")
    return isinstance(ids, list) and request_id in ids


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
        proc_root: Path | str = "/proc",
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
                    why = f"does not catch {_signal_name(self.signal)}"
            if why is None:
                assert start is not None
                catching.append((pid, start))
            else:
                left.append({"pid": pid, "why": why})
        return catching, left[:MAX_LISTED]

    # -- the events stream ------------------------------------------------------------------

    def _last_event_id(self) -> str:
        entries = self.client.xrevrange(self.keys.events, count=1)
        return _text(entries[0][0]) if entries else "0-0"

    def _wait_event(
        self, cursor: str, deadline: float, match: Any
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
            for _stream, entries in resp or []:
                for entry_id, fields in entries:
                    cursor = _text(entry_id)
                    obj = _event_obj(fields)
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
        sig_name = _signal_name(self.signal) if self.signal is not None else None
        data: dict[str, Any] = {"job": job, "jobctl": key, "request_id": command.id}
        if command.dry_run:
            if self.signal is None:
                detail = f"would ask job {job} through {key}; no signal fallback"
            else:
                catching, left = self._inspect(processes)
                data.update(
                    signal=sig_name, catching_pids=[p for p, _ in catching], not_signalled=left
                )
                target = (
                    f"pids {[p for p, _ in catching]}"
                    if catching
                    else "no process (none catches it)"
                )
                detail = (
                    f"would ask job {job} through {key}, then, without an answer within"
                    f" {self.hook_wait_s:g} s, send {sig_name} to {target}"
                )
            return ActionResult("dry_run", detail, data)

        started = time.monotonic()
        try:
            cursor = self._last_event_id()
            reason = command.reason or "oomcast forecast"
            self.client.xadd(
                key,
                encode_jobctl("checkpoint", command.id, reason),
                maxlen=JOBCTL_MAXLEN,
                approximate=True,
            )
        except redis.RedisError as exc:
            return ActionResult("failed", f"could not send the request to {key}: {exc}", data)

        # 1. the hook: it acknowledges with checkpoint_requested, then reports the save.
        def answers(obj: dict[str, Any]) -> bool:
            return obj.get("event") in (
                "checkpoint_requested",
                "checkpoint_done",
                "checkpoint_failed",
            ) and _has_request(obj, command.id)

        obj, cursor = self._wait_event(cursor, started + self.hook_wait_s, answers)
        if obj is not None:
            data["via"] = "hook"
            if obj.get("event") == "checkpoint_requested":

                def saved(o: dict[str, Any]) -> bool:
                    return o.get("event") in (
                        "checkpoint_done",
                        "checkpoint_failed",
                    ) and _has_request(o, command.id)

                obj, cursor = self._wait_event(cursor, time.monotonic() + self.ack_timeout_s, saved)
            return self._finish(obj, data, started, "the hook took the request but")

        if self._cancel.is_set():
            return ActionResult("failed", "cancelled: the agent is stopping", data)
        # 2. the signal, to the processes that catch it
        if self.signal is None:
            return ActionResult(
                "failed",
                f"job {job}'s hook did not answer within {self.hook_wait_s:g} s and the signal"
                " fallback is off",
                data,
            )
        data["via"] = "signal"
        catching, left = self._inspect(processes)
        data.update(signal=sig_name, not_signalled=left)
        if not processes:
            return ActionResult(
                "refused",
                f"job {job}'s hook did not answer within {self.hook_wait_s:g} s, and no process"
                " of it is known here: nothing signalled",
                data,
            )
        if not catching:
            return ActionResult(
                "refused",
                f"job {job}'s hook did not answer within {self.hook_wait_s:g} s, and none of"
                f" its {len(left)} process(es) here catches {sig_name} (its default action"
                " would kill them): nothing signalled",
                data,
            )
        # the wait goes on from where the hook's ended: a late answer from the hook counts
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

        def done_by_job(o: dict[str, Any]) -> bool:
            return (
                o.get("event") in ("checkpoint_done", "checkpoint_failed") and o.get("job") == job
            )

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
        if obj.get("event") == "checkpoint_failed":
            return ActionResult("failed", f"job {data['job']} reported the checkpoint failed", data)
        where = f" to {obj['path']}" if obj.get("path") else ""
        return ActionResult("done", f"job {data['job']} saved a checkpoint{where}", data)


# --- shed -------------------------------------------------------------------------------------


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


def _victim_dict(v: Candidate, ended: str) -> dict[str, Any]:
    return {
        "pid": v.pid,
        "job": v.job,
        "priority": v.priority,
        "used_bytes": v.used_bytes,
        "ended": ended,
    }


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
        proc_root: Path | str = "/proc",
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

    def _why_not(self, c: Candidate, protected_job: str | None, priority: int) -> str | None:
        if c.pid <= 1:
            return "pid 1"
        if c.pid in _protected_pids():
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
            why = self._why_not(c, protected_job, protected_priority)
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
        if (
            command.device.startswith("cgroup:")
            and cands
            and not any(c.job == command.job for c in cands)
        ):
            # A container's cgroup is named after the container, its processes after their
            # jobs: protect the most important job in it, shed only what ranks below it.
            top = max(cands, key=lambda c: c.priority)
            command = dataclasses.replace(command, job=top.job)
        own = [c.priority for c in cands if command.job is not None and c.job == command.job]
        asked = params.get("priority")
        if isinstance(asked, bool) or not isinstance(asked, int):
            asked = None
        # params.priority may lower the protected job's bar, never raise it above the job's
        # own priority (that would make jobs above it victims)
        if own and asked is not None:
            priority: int | None = min(max(own), asked)
        elif own:
            priority = max(own)
        else:
            priority = asked
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
            data["victims"] = [_victim_dict(v, "not signalled") for v in plan.victims]
            return ActionResult(
                "refused",
                f"the processes that may be shed hold {plan.victim_bytes} bytes, "
                f"{plan.shortfall_bytes} short of the {need} needed (params.allow_partial"
                " is not set)",
                data,
            )
        if command.dry_run:
            data["victims"] = [_victim_dict(v, "dry_run") for v in plan.victims]
            pids = [v.pid for v in plan.victims]
            return ActionResult(
                "dry_run",
                f"would send SIGTERM to pids {pids} ({plan.victim_bytes} bytes), SIGKILL"
                f" after {self.grace_s:g} s",
                data,
            )
        ended = self._shed(plan.victims)
        data["victims"] = [_victim_dict(v, ended[v.pid]) for v in plan.victims]
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


_FREED = frozenset({"TERM", "KILL", "gone"})

__all__ = [
    "OUTCOMES",
    "ActionResult",
    "Candidate",
    "CheckpointAction",
    "Executor",
    "ShedAction",
    "ShedPlan",
    "as_candidate",
    "catches_signal",
    "cgroup_candidates",
    "in_scope",
    "live_start_time",
    "proc_memory_cgroup",
    "proc_uids",
    "processes_in_cgroup",
    "rss_bytes",
    "send_signal",
]
