"""How checkpoint requests reach the in-process hook: a signal, the job's control stream, or
a call; and where they wait until the training loop has saved.

The protocol (key names, the ``cmd`` entry, the answers) is :mod:`oomcast.model.jobcontrol`;
this module is the job's side of it. Everything on the request path takes no lock (deques
only), since a signal handler may run it in the middle of anything.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from oomcast.collectors.streams import entries_of
from oomcast.model.jobcontrol import CHECKPOINT, parse_jobctl
from oomcast.model.schema import SchemaError

log = logging.getLogger(__name__)

# Commands older than the hook (by their stream id) are for an earlier run of the job; a
# little slack covers a Redis clock a bit behind ours.
CONTROL_LOOKBACK_S = 2.0


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    id: str
    reason: str | None
    source: str  # "signal", "jobctl" or "api"
    ts: float


class CheckpointRequests:
    """The requests not answered yet, oldest first, and who to tell of a new one."""

    def __init__(self) -> None:
        self.pending: deque[CheckpointRequest] = deque()
        self.callbacks: list[Callable[[CheckpointRequest], None]] = []

    def notify(self, req: CheckpointRequest) -> None:
        for callback in list(self.callbacks):
            try:
                callback(req)
            except Exception:
                log.exception("oomcast hook: checkpoint request callback failed")

    def oldest(self) -> CheckpointRequest | None:
        try:
            return self.pending[0]
        except IndexError:
            return None

    def drain(self) -> list[CheckpointRequest]:
        """Every pending request, oldest first; none is left pending."""
        taken: list[CheckpointRequest] = []
        while True:
            try:
                taken.append(self.pending.popleft())
            except IndexError:
                return taken


class JobControlReader:
    """Reads the job's control stream from the hook's thread (no blocking read: the thread
    also publishes), starting at commands issued shortly before ``created`` (unix s)."""

    def __init__(self, client: redis.Redis, key: str, created: float) -> None:
        self.client = client
        self.key = key
        self.cursor = f"{max(0, int((created - CONTROL_LOOKBACK_S) * 1000))}-0"

    def poll(self, take: Callable[[str, str | None], None]) -> int:
        """Call ``take(id, reason)`` for each new checkpoint command; returns how many
        entries were ignored (malformed, or of an unknown action)."""
        try:
            resp = self.client.xread({self.key: self.cursor}, count=32)
        except redis.RedisError as exc:
            log.debug("oomcast hook: control stream not read (%s)", exc)
            return 0
        ignored = 0
        for entry_id, fields in entries_of(resp):
            self.cursor = entry_id
            try:
                cmd = parse_jobctl(fields)
            except SchemaError as exc:
                ignored += 1
                log.warning("oomcast hook: control entry %s ignored: %s", entry_id, exc)
                continue
            if cmd.action != CHECKPOINT:
                ignored += 1
                log.warning(
                    "oomcast hook: control entry %s ignored: unknown action %r",
                    entry_id,
                    cmd.action,
                )
                continue
            take(cmd.id, cmd.reason)
        return ignored


class SignalRelay:
    """A signal handler that calls ``on_signal(signum)`` and then the handler it replaced.
    Installed only from the main thread (Python's rule); restored the same way."""

    def __init__(self, on_signal: Callable[[int], None]) -> None:
        self.on_signal = on_signal
        self.signum: int | None = None
        self.prev: Any = None

    def install(self, signum: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("oomcast hook: created outside the main thread; no signal handler")
            return
        self.prev = signal.getsignal(signum)
        signal.signal(signum, self.handle)
        self.signum = signum

    def handle(self, signum: int, frame: Any) -> None:
        self.on_signal(signum)
        prev = self.prev
        if callable(prev):
            prev(signum, frame)

    def restore(self) -> None:
        if self.signum is None:
            return
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(self.signum) == self.handle:
                    prev = self.prev
                    signal.signal(self.signum, prev if prev is not None else signal.SIG_DFL)
        self.signum = None
