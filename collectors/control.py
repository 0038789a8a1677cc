"""The node agent's side of the control stream: verify signed commands, act, report.

:class:`ControlListener` reads ``{prefix}:control:{<node>}`` (:meth:`Keys.control`) from a
thread, starting after the entries that were there when it started (a restarted agent does
not act on old commands). Each entry is verified with :func:`oomcast.model.control.
verify_command` (signature first, then node, validity window, nonce); a refused entry never
reaches an executor. A valid command runs in a worker thread of its own, so a checkpoint
that waits a minute for its acknowledgement does not hold up reading; only one action per
(device, action) runs at a time (a second is refused as ``busy``), and at most
``max_running`` in all. A live (not dry-run) destructive command (shed) must also be proven
on the node: the agent measures the domain itself and refuses it as ``unconfirmed`` unless
its own reading confirms the memory state the command claims (:mod:`oomcast.collectors.
proof`). A checkpoint loses no work and needs no proof.

Every outcome becomes an event on the events stream, encoded as every event is (field
``event``, a JSON object with the standard keys ``ts``, ``node``, ``device``, ``event``,
``job``) plus keys of its own, which event readers ignore:

* ``action_result``: ``id``, ``action``, ``outcome`` (done, failed, refused, dry_run),
  ``detail``, ``data``, ``dry_run``, ``forecast`` (the command's), ``duration_s``.
* ``command_refused``: ``reason`` (the reason code), ``message``, ``entry`` (the stream
  entry id), ``authenticated`` (whether the signature was valid) and ``id``, the command's
  id where it could be read (for an unauthenticated entry: the id it claims, so that a
  sender with the wrong secret can match the refusal up; nothing else of it is trusted).
  An ``unconfirmed`` refusal adds ``claimed`` and ``measured`` (``used_bytes``,
  ``total_bytes``, ``used_frac``; ``measured`` absent where nothing could be measured) and
  ``tolerance_pp``; a confirmed live action's ``action_result`` carries the same as ``proof``.
  The device and job are the command's when its signature was valid; otherwise the device
  is ``control`` and there is no job. At most ``refusal_events_per_min`` such
  events are written a minute (a flood of junk must not flood the events stream); all are
  logged and counted.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import Any

import redis
from redis.exceptions import RedisClusterException

from oomcast.collectors.actiontypes import OUTCOMES, ActionResult, Executor, as_candidate
from oomcast.collectors.domain import Resolve, make_resolve
from oomcast.collectors.proof import DEFAULT_TOLERANCE, Measure, check_claim
from oomcast.collectors.streams import entries_of, last_id, stream_fields
from oomcast.model.control import (
    DEFAULT_MAX_SKEW_S,
    DESTRUCTIVE_ACTIONS,
    REASONS,
    Command,
    CommandRejected,
    NonceCache,
    unverified_id,
    verify_command,
)
from oomcast.model.events import DetailedEvent
from oomcast.model.wire import Keys, encode_event

log = logging.getLogger(__name__)

ACTION_RESULT = "action_result"
COMMAND_REFUSED = "command_refused"
REFUSED_DEVICE = "control"  # the device of a refusal whose command could not be trusted
LISTENER_REASONS = ("disabled",)  # refusals of the listener itself (besides "busy")

MetricSample = tuple[str, str, str, dict[str, str], float]


def encode_control_event(obj: Mapping[str, Any], key: str | None = None) -> dict[str, str]:
    """Stream fields of an event dict with extra keys: :func:`wire.encode_event` of its
    :class:`~oomcast.model.events.DetailedEvent` (values JSON cannot carry become strings),
    signed with ``key`` (the node's) when given."""
    return encode_event(DetailedEvent.from_dict(obj), key)


class ControlStats:
    def __init__(self) -> None:
        self.received = 0
        self.executed: dict[tuple[str, str], int] = {}  # (action, outcome) -> n
        self.refused: dict[str, int] = {}  # reason -> n
        self.read_errors = 0
        self.event_errors = 0
        self.events_suppressed = 0


class ControlListener:
    """Reads, verifies and executes the commands of one node. See the module docstring.

    executors: action name -> ``executor(command, candidates) -> ActionResult``; an action
        with no executor is refused as ``disabled``.
    resolve: the candidate processes of a command's domain (called in the worker thread).
    publish_event: where events go (a dict each); default XADD to ``keys.events``.
    secret: this node's key (``model.control.node_key``), which the service signs with.
    measure: the agent's own reading of a command's domain (``proof.make_measure``); without
        it no live command is confirmed. ``confirm_tolerance``: how far (a fraction of the
        capacity) the measured use may fall short of the claimed use.
    """

    def __init__(
        self,
        client: redis.Redis,
        keys: Keys,
        node: str,
        secret: str,
        executors: Mapping[str, Executor],
        resolve: Resolve,
        publish_event: Callable[[dict[str, Any]], None] | None = None,
        clock: Callable[[], float] = time.time,
        *,
        block_ms: int = 500,
        max_skew_s: float = DEFAULT_MAX_SKEW_S,
        nonces: NonceCache | None = None,
        max_running: int = 4,
        refusal_events_per_min: int = 60,
        events_maxlen: int = 100_000,
        measure: Measure | None = None,
        confirm_tolerance: float = DEFAULT_TOLERANCE,
    ) -> None:
        if not secret:
            raise ValueError("the control secret must be non-empty")
        if not node:
            raise ValueError("node must be non-empty")
        if max_running < 1:
            raise ValueError(f"max_running={max_running} must be at least 1")
        if not 0 <= confirm_tolerance <= 1:
            raise ValueError(f"confirm_tolerance={confirm_tolerance} must be within [0, 1]")
        self.client = client
        self.keys = keys
        self.node = node
        self._secret = secret
        self.executors = dict(executors)
        self.resolve = resolve
        self.publish_event = publish_event
        self.clock = clock
        self.block_ms = block_ms
        self.max_skew_s = max_skew_s
        self.nonces = nonces if nonces is not None else NonceCache()
        self.max_running = max_running
        self.refusal_events_per_min = refusal_events_per_min
        self.events_maxlen = events_maxlen
        self.measure = measure
        self.confirm_tolerance = confirm_tolerance
        self.stats = ControlStats()
        self.stream = keys.control(node)
        self._cursor: str | None = None
        self._lock = threading.Lock()
        self._running: dict[tuple[str, str], threading.Thread] = {}
        self._refusal_times: deque[float] = deque()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at: float | None = None

    def __repr__(self) -> str:  # never the secret
        return f"ControlListener(node={self.node!r}, stream={self.stream!r})"

    # --- life cycle ---------------------------------------------------------------------------

    def start(self) -> None:
        """Start reading, from the entries added after now."""
        if self._thread is not None:
            raise RuntimeError("the control listener was already started")
        self._started_at = self.clock()
        try:
            self._cursor = self._last_id()
        # RedisClusterException: no node of a cluster answers (it is not a RedisError)
        except (redis.RedisError, RedisClusterException) as exc:  # fetched once Redis answers
            log.warning("control: Redis unreachable at start (%s); will retry", exc)
        self._thread = threading.Thread(target=self._run, name="oomcast-control", daemon=True)
        self._thread.start()
        log.info("control: listening on %s", self.stream)

    def stop(self, timeout_s: float = 5.0) -> bool:
        """Stop reading, cancel waits in progress (executors with a ``cancel()``) and wait up
        to ``timeout_s`` for running actions. True when everything has stopped."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        for executor in self.executors.values():
            cancel = getattr(executor, "cancel", None)
            if callable(cancel):
                cancel()
        with self._lock:
            workers = list(self._running.values())
        for t in workers:
            t.join(max(0.0, deadline - time.monotonic()))
        stopped = not any(t.is_alive() for t in workers)
        return stopped and (self._thread is None or not self._thread.is_alive())

    @property
    def running(self) -> list[tuple[str, str]]:
        """(device, action) of the actions running now."""
        with self._lock:
            return list(self._running)

    def wait_idle(self, timeout_s: float = 10.0) -> bool:
        """Wait until no action runs (for tests and shutdown)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not self.running:
                return True
            time.sleep(0.02)
        return not self.running

    def _last_id(self) -> str:
        return last_id(self.client, self.stream)

    def _run(self) -> None:
        backoff = 0.0
        while not self._stop.is_set():
            try:
                if self._cursor is None:
                    self._cursor = self._last_id()
                resp = self.client.xread({self.stream: self._cursor}, count=16, block=self.block_ms)
                backoff = 0.0
            except (redis.RedisError, RedisClusterException) as exc:
                self.stats.read_errors += 1
                backoff = min(5.0, max(0.2, backoff * 2))
                if self.stats.read_errors in (1, 10, 100) or self.stats.read_errors % 1000 == 0:
                    log.warning("control: reading %s failed (%s)", self.stream, exc)
                self._stop.wait(backoff)
                continue
            for entry_id, fields in entries_of(resp):
                self._cursor = entry_id
                try:
                    self.handle_entry(entry_id, fields)
                except Exception:  # the reader must outlive anything
                    log.exception("control: entry %s could not be handled", entry_id)

    # --- one entry ----------------------------------------------------------------------------

    def handle_entry(self, entry_id: str, fields: Mapping[Any, Any]) -> Command | None:
        """Verify one control entry and start its action; returns the command when an action
        was started, None when it was refused."""
        self.stats.received += 1
        try:
            cmd = verify_command(
                fields,
                self._secret,
                now=self.clock(),
                node=self.node,
                nonces=self.nonces,
                max_skew_s=self.max_skew_s,
            )
        except CommandRejected as exc:
            self._refuse(entry_id, exc, fields)
            return None
        if self._started_at is not None and cmd.issued_at < self._started_at - self.max_skew_s:
            # Nonces live in memory: a restarted agent must not run a command issued before
            # it started (it may have run already); the service sends a fresh one if needed.
            self._refuse(
                entry_id,
                CommandRejected(
                    "replayed",
                    f"issued at {cmd.issued_at}, before this agent started ({self._started_at})",
                    cmd.id,
                    cmd,
                ),
                fields,
            )
            return None
        executor = self.executors.get(cmd.action)
        if executor is None:
            self._refuse(
                entry_id,
                CommandRejected(
                    "disabled", f"action {cmd.action!r} is not enabled on this agent", cmd.id, cmd
                ),
                fields,
            )
            return None
        proof: dict[str, Any] | None = None
        if not cmd.dry_run and cmd.action in DESTRUCTIVE_ACTIONS:
            # the signature proves who sent it, not that the danger is real
            verdict = check_claim(cmd, self.measure, self.confirm_tolerance)
            if not verdict.confirmed:
                refused = CommandRejected("unconfirmed", verdict.message, cmd.id, cmd)
                refused.details = verdict.details
                self._refuse(entry_id, refused, fields)
                return None
            proof = verdict.details
        # a checkpoint reaches every process of the job, on every GPU: one at a time per job
        job_wide = cmd.action == "checkpoint" and cmd.job
        key = (f"job:{cmd.job}", cmd.action) if job_wide else (cmd.device, cmd.action)
        worker: threading.Thread | None = None
        with self._lock:
            busy = None
            if key in self._running:
                busy = f"a {cmd.action} on {key[0]} is already running"
            elif len(self._running) >= self.max_running:
                busy = f"{len(self._running)} actions are running (max_running)"
            if busy is None:
                worker = threading.Thread(
                    target=self._execute,
                    args=(cmd, executor, key, proof),
                    name=f"oomcast-action-{cmd.action}-{cmd.device}",
                    daemon=True,
                )
                self._running[key] = worker
        if worker is None:
            assert busy is not None
            self._refuse(entry_id, CommandRejected("busy", busy, cmd.id, cmd), fields)
            return None
        log.info(
            "control: %s%s on %s (job %s), command %s: %s",
            cmd.action,
            " (dry run)" if cmd.dry_run else "",
            cmd.device,
            cmd.job,
            cmd.id,
            cmd.reason,
        )
        worker.start()
        return cmd

    def _execute(
        self,
        cmd: Command,
        executor: Executor,
        key: tuple[str, str],
        proof: dict[str, Any] | None = None,
    ) -> None:
        started = time.monotonic()
        try:
            candidates = [as_candidate(c) for c in self.resolve(cmd)]
            result = executor(cmd, candidates)
            if not isinstance(result, ActionResult):
                raise TypeError(f"executor returned {type(result).__name__}, not ActionResult")
        except Exception as exc:
            log.exception("control: %s on %s (command %s) failed", cmd.action, cmd.device, cmd.id)
            result = ActionResult("failed", f"executor error: {type(exc).__name__}: {exc}"[:500])
        finally:
            with self._lock:
                self._running.pop(key, None)
        with self._lock:
            k = (cmd.action, result.outcome)
            self.stats.executed[k] = self.stats.executed.get(k, 0) + 1
        log.log(
            logging.WARNING if result.outcome == "failed" else logging.INFO,
            "control: %s on %s (command %s): %s: %s",
            cmd.action,
            cmd.device,
            cmd.id,
            result.outcome,
            result.detail,
        )
        event = self._event(
            ACTION_RESULT,
            cmd.device,
            cmd.job,
            id=cmd.id,
            action=cmd.action,
            outcome=result.outcome,
            detail=result.detail,
            data=result.data,
            dry_run=cmd.dry_run,
            forecast=cmd.forecast,
            duration_s=round(time.monotonic() - started, 3),
        )
        if proof is not None:
            event["proof"] = proof
        self._publish(event)

    def _refuse(self, entry_id: str, exc: CommandRejected, fields: Mapping[Any, Any]) -> None:
        with self._lock:
            self.stats.refused[exc.reason] = self.stats.refused.get(exc.reason, 0) + 1
        log.warning(
            "control: entry %s (command %s) refused: %s: %s",
            entry_id,
            exc.command_id,
            exc.reason,
            exc.message,
        )
        now = time.monotonic()
        window = self._refusal_times
        while window and now - window[0] > 60.0:
            window.popleft()
        if len(window) >= self.refusal_events_per_min:
            self.stats.events_suppressed += 1
            return
        window.append(now)
        cmd = exc.command
        extra: dict[str, Any] = {
            "reason": exc.reason,
            "message": exc.message,
            "entry": entry_id,
            "authenticated": exc.authenticated,
        }
        cid = exc.command_id if exc.authenticated else unverified_id(fields)
        if cid is not None:
            extra["id"] = cid
        if cmd is not None:
            extra["action"] = cmd.action
            extra["dry_run"] = cmd.dry_run
        extra.update(exc.details)
        self._publish(
            self._event(
                COMMAND_REFUSED,
                cmd.device if cmd is not None else REFUSED_DEVICE,
                cmd.job if cmd is not None else None,
                **extra,
            )
        )

    def _event(self, name: str, device: str, job: str | None, **extra: Any) -> dict[str, Any]:
        obj: dict[str, Any] = {"ts": self.clock(), "node": self.node, "device": device}
        obj["event"] = name
        if job is not None:
            obj["job"] = job
        obj.update(extra)
        return obj

    def _publish(self, obj: dict[str, Any]) -> None:
        try:
            if self.publish_event is not None:
                self.publish_event(obj)
            else:
                self.client.xadd(
                    self.keys.events,
                    stream_fields(encode_control_event(obj, self._secret)),
                    maxlen=self.events_maxlen,
                    approximate=True,
                )
        except Exception as exc:
            self.stats.event_errors += 1
            log.warning("control: %s event not published (%s)", obj.get("event"), exc)

    # --- /metrics -----------------------------------------------------------------------------

    def metric_samples(self) -> list[MetricSample]:
        st = self.stats
        with self._lock:
            executed = dict(st.executed)
            refused = dict(st.refused)
            running = len(self._running)
        for action in self.executors:
            for outcome in OUTCOMES:
                executed.setdefault((action, outcome), 0)
        for reason in (*REASONS, *LISTENER_REASONS):
            refused.setdefault(reason, 0)
        plain = [  # (name, type, help, value), unlabelled
            ("commands_total", "counter", "Control-stream entries read.", st.received),
            ("actions_running", "gauge", "Actions running now.", running),
            ("read_errors_total", "counter", "Failed reads of the control stream.", st.read_errors),
            (
                "event_errors_total",
                "counter",
                "Action and refusal events that could not be published.",
                st.event_errors,
            ),
            (
                "events_suppressed_total",
                "counter",
                "Refusal events not written because of the per-minute limit.",
                st.events_suppressed,
            ),
        ]
        out: list[MetricSample] = [
            (f"oomcast_agent_control_{name}", kind, text, {}, value)
            for name, kind, text, value in plain
        ]
        out.extend(
            (
                "oomcast_agent_control_actions_total",
                "counter",
                "Actions run on verified commands, by action and outcome.",
                {"action": action, "outcome": outcome},
                n,
            )
            for (action, outcome), n in sorted(executed.items())
        )
        out.extend(
            (
                "oomcast_agent_control_refused_total",
                "counter",
                "Control commands refused, by reason.",
                {"reason": reason},
                n,
            )
            for reason, n in sorted(refused.items())
        )
        return out


__all__ = [
    "ACTION_RESULT",
    "COMMAND_REFUSED",
    "ControlListener",
    "ControlStats",
    "Resolve",
    "encode_control_event",
    "make_resolve",
]
