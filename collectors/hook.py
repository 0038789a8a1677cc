"""The in-process hook: memory samples, OOMs and checkpoint requests from inside a training loop.

A few lines in the loop::

    from oomcast.collectors.hook import MemoryHook

    hook = MemoryHook(job="bert-ft-42")  # OOMCAST_REDIS_URL, OOMCAST_NODE (or the hostname)
    with hook.guard():  # an OOM that kills the loop still becomes an `oom` event
        for batch in loader:
            ...
            optimizer.step()
            hook.step()
            if hook.checkpoint_requested:
                save(...)
                hook.checkpoint_done(path)
    hook.close()

**Modes** (``hook.mode``, logged once at start; what each reads:
:mod:`~oomcast.collectors.hook_memory`):

* ``cuda``: the caching allocator's figures for one GPU and the device's total and free
  memory; the step's peak is the allocator's peak reserved since the previous sample.
* ``host`` (no CUDA): this process's resident memory (``proc:{pid}``) against its memory
  cgroup's limit; the peak is the kernel's VmHWM, reset at most once per ``peak_reset_s``.
* ``off``: ``enabled=False`` or ``OOMCAST_HOOK=off``; every call is a no-op.

Resetting peaks is a side effect on the rest of the process: ``torch.cuda.max_memory_*``
(cuda) and ``getrusage().ru_maxrss`` (host) then cover one step, not the run. Pass
``track_peak=False`` to keep them (samples then carry no peak).

**Never in the way.** ``step()`` reads the figures and puts the sample on a bounded queue
(when full, the oldest is dropped and counted); a daemon thread embeds the samples and
publishes them, in batches, exactly as the node agent does (one entry holds many samples),
riding out Redis outages with :class:`~oomcast.collectors.publisher.StreamPublisher`'s
bounded buffer. ``close()`` (also run at exit) flushes with a timeout.

**OOMs** become ``oom`` events (the ground truth for retraining): from torch's OOM
observer where it exists, from ``num_ooms`` rising between steps, and from ``guard()``,
which publishes synchronously (the process is probably about to die) and re-raises. One
OOM seen several ways is one event: after an ``oom`` event, the next is only sent once a
step has completed.

**Checkpoint requests** arrive by signal (SIGUSR1 unless ``checkpoint_signal`` says
otherwise), by the job's control stream ``{prefix}:jobctl:{<job>}`` (the protocol:
:mod:`oomcast.model.jobcontrol`),
or from :meth:`MemoryHook.request_checkpoint`. Each is published as a
``checkpoint_requested`` event; :meth:`MemoryHook.checkpoint_done` answers it with
``checkpoint_done`` (or ``checkpoint_failed``) carrying the request id. Requests that arrive
while one is pending are answered by the same checkpoint.

In multi-process training every rank has a hook of its own (one GPU each). A signal or
command reaches the ranks at different steps, so a checkpoint that needs every rank at the
same step (a sharded save) must agree on the step itself before saving; the Lightning and
Hugging Face callbacks (:mod:`oomcast.collectors.integrations`) do.

**Where things are**: settings and their ``OOMCAST_*`` variables in ``hook_settings``,
reading the figures in ``hook_memory``, the queues and the publishing thread in
``hook_outbox``, checkpoint requests in ``hook_jobctl``, the training step, phases and the
job's schedule (``set_schedule``, ``phase()``) in ``hook_phases``; the benchmark is
``bench/hook.py``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import signal
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import redis

from oomcast.collectors.hook_bundle import BundleHook
from oomcast.collectors.hook_jobctl import (
    CheckpointRequest,
    CheckpointRequests,
    JobControlReader,
    SignalRelay,
)
from oomcast.collectors.hook_memory import (
    CudaReader,
    HostReader,
    cuda_device_name,
    cuda_torch,
    format_gpu_uuid,
    is_oom_error,
    memory_limit_bytes,
)
from oomcast.collectors.hook_outbox import HookOutbox, HookStats, OutEvent
from oomcast.collectors.hook_settings import MODES, OFF_VALUES, HookSettings, redact_url
from oomcast.collectors.publisher import StreamPublisher
from oomcast.model.events import DetailedEvent
from oomcast.model.jobcontrol import (
    CHECKPOINT_DONE,
    CHECKPOINT_FAILED,
    CHECKPOINT_REQUESTED,
    JobCommand,
    ack_extra,
    encode_jobctl,
    jobctl_key,
    new_request_id,
    parse_jobctl,
)
from oomcast.model.schema import Sample

log = logging.getLogger(__name__)

_LIVE: weakref.WeakSet[MemoryHook] = weakref.WeakSet()


def live_hooks() -> list[MemoryHook]:
    """The hooks of this process that are running (not closed, not a fork's copy)."""
    return [h for h in list(_LIVE) if not h._off]


def _after_fork_in_child() -> None:
    # The thread did not survive the fork and the domain is the parent's: go quiet.
    for hook in list(_LIVE):
        hook._forked = True
        hook._off = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MemoryHook(BundleHook):
    """Samples memory at each ``step()`` and publishes it from a background thread; turns
    OOMs into events and relays checkpoint requests. See the module docstring."""

    def __init__(
        self,
        job: str | None = None,
        *,
        redis_url: str | None = None,
        node: str | None = None,
        key_prefix: str | None = None,
        partitions: int | None = None,
        device: int | str | Any | None = None,
        enabled: bool = True,
        mode: str = "auto",
        min_interval_s: float = 0.0,
        queue_size: int = 1024,
        checkpoint_signal: int | None = signal.SIGUSR1,
        publish: bool = True,
        control: bool = True,
        track_peak: bool = True,
        peak_reset_s: float = 1.0,
        publish_interval_s: float = 0.2,
        control_poll_s: float = 0.5,
        buffer_samples: int = 10_000,
        stream_maxlen: int = 100_000,
        redis_timeout_s: float = 2.0,
        close_timeout_s: float = 5.0,
        oom_timeout_s: float = 2.0,
        bundle_dir: str | None = None,
    ) -> None:
        """Every argument but ``device`` is a setting: :class:`HookSettings` documents each
        and the ``OOMCAST_*`` variable that an argument left unset falls back to.
        device: the CUDA device to watch (index, ``"cuda:1"``, torch.device); default current.
        """
        args = {k: v for k, v in locals().items() if k not in ("self", "device")}
        self.settings = st = HookSettings.from_env(**args)
        self.job, self.node, self.keys, self.redis_url = st.job, st.node, st.keys, st.redis_url
        self.stats = HookStats()
        self.device = ""
        self.mode = "off"
        self._off = True
        self._closed = False
        self._forked = False
        self._delivered_at_close = True
        self._next_sample_at = 0.0
        self._created = time.time()
        self._last_ts = 0.0
        self._oom_lock = threading.Lock()
        self._oom_open = False
        self._oom_event: OutEvent | None = None
        self._num_ooms: int | None = None
        self._read_error_logged = False
        self._reader: CudaReader | HostReader | None = None
        self._requests = CheckpointRequests()
        self._signal = SignalRelay(self._on_signal)
        self._client: redis.Redis | None = None
        self._jobctl: JobControlReader | None = None
        self._next_control = 0.0
        self._init_mixins()  # phases and bundles (hook_phases.py, hook_bundle.py)
        self._outbox = HookOutbox(
            self.node,
            self.keys,
            None,
            self.stats,
            queue_size=st.queue_size,
            publish_interval_s=st.publish_interval_s,
            chores=self._chores,
        )
        if not st.enabled:
            log.info("oomcast hook: mode=off (%s)", st.off_by)
            return
        self._start(device)

    def _start(self, device: Any) -> None:
        st = self.settings
        torch = cuda_torch(st.mode == "cuda") if st.mode in ("auto", "cuda") else None
        if torch is not None:
            cuda = CudaReader(torch, device, st.track_peak)
            ref = weakref.ref(self)

            def on_oom() -> None:  # in the allocating thread: it only appends to a deque
                hook = ref()
                if hook is not None and not hook._off:
                    hook._note_oom("observer")

            cuda.attach_oom_observer(on_oom)
        reader = cuda if torch is not None else HostReader(st.track_peak, st.peak_reset_s)
        self._reader, self.device, self.mode = reader, reader.device, reader.mode
        if st.publish:
            self._client = redis.Redis.from_url(
                self.redis_url,
                socket_timeout=st.redis_timeout_s,
                socket_connect_timeout=st.redis_timeout_s,
            )
            self._outbox.publisher = StreamPublisher(
                self._client, maxlen=st.stream_maxlen, buffer_samples=st.buffer_samples
            )
            if st.control and self.job:
                key = jobctl_key(self.keys.prefix, self.job)
                self._jobctl = JobControlReader(self._client, key, self._created)
        self._off = False
        self._outbox.start()
        if st.checkpoint_signal is not None:
            self._signal.install(st.checkpoint_signal)
        atexit.register(self.close)
        _LIVE.add(self)
        log.info(
            "oomcast hook: mode=%s device=%s node=%s job=%s publish=%s",
            self.mode,
            self.device,
            self.node,
            self.job,
            "off" if self._outbox.publisher is None else redact_url(self.redis_url),
        )

    # --- the training loop's side -------------------------------------------------------------

    def step(self, step: int | None = None) -> None:
        """Take a sample and queue it (never blocks; never raises for a failed read);
        ``step``: the job's count of completed steps (default: one more than before)."""
        if self._off:
            return
        self.stats.steps += 1
        self._advance(step)
        if self.settings.min_interval_s:
            now = time.monotonic()
            if now < self._next_sample_at:
                return
            self._next_sample_at = now + self.settings.min_interval_s
        self._sample()
        # A completed step after an OOM: the next OOM is a new one.
        self._oom_open = False

    def _sample(self) -> Sample | None:
        try:
            sample, ooms = self._read()
        except Exception as exc:
            self.stats.read_errors += 1
            if not self._read_error_logged:
                self._read_error_logged = True
                log.warning("oomcast hook: reading memory failed (%r); step goes on", exc)
            return None
        if ooms is not None:
            if self._num_ooms is not None and ooms > self._num_ooms:
                # it happened during the step, before this sample: the sample is the first of
                # the history after it, not the last one before. The event is queued first,
                # so that the thread cannot publish (and embed) the sample before it.
                self._note_oom("num_ooms", ts=sample.ts - 1e-6)
            self._num_ooms = ooms
        self.stats.samples += 1
        self._outbox.put_sample(sample)
        self._noted(sample)
        return sample

    def _read(self) -> tuple[Sample, int | None]:
        ts = time.time()
        if ts <= self._last_ts:  # samples of a domain must be strictly in time order
            ts = self._last_ts + 1e-6
        self._last_ts = ts
        assert self._reader is not None
        return self._reader.read(ts, self.node, self.job, self.step_number, self.current_phase)

    # --- OOMs ------------------------------------------------------------------------------------

    def _event(self, name: str, ts: float | None = None, **extra: Any) -> DetailedEvent:
        return DetailedEvent(
            ts=time.time() if ts is None else ts,
            node=self.node,
            device=self.device,
            event=name,
            job=self.job,
            extra={k: v for k, v in extra.items() if v is not None},
        )

    def _note_oom(
        self, source: str, detail: str | None = None, ts: float | None = None
    ) -> OutEvent:
        """Queue an ``oom`` event unless this OOM was already reported; returns its event."""
        with self._oom_lock:
            if self._oom_open and self._oom_event is not None:
                return self._oom_event
            self.stats.ooms += 1
            ev = self._outbox.put_event(self._event("oom", ts=ts, source=source, detail=detail))
            self._oom_open = True
            self._oom_event = ev
        return ev

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is an out-of-memory error of this hook's domain."""
        return not self._off and is_oom_error(exc, self.mode)

    def report_oom(self, exc: BaseException | None = None, timeout_s: float | None = None) -> bool:
        """Publish an ``oom`` event now, with what is queued before it, waiting at most
        ``timeout_s`` (default ``oom_timeout_s``). True once it is in Redis."""
        if self._off:
            return False
        timeout = self.settings.oom_timeout_s if timeout_s is None else timeout_s
        ev = self._note_oom("exception", type(exc).__name__ if exc is not None else None)
        # the error's own first line says what was asked ("Tried to allocate 2.00 GiB"):
        # `oomcast explain` reads the failing request from it when no memory history has it
        try:  # an exception's own __str__ may fail: the OOM is still reported
            first = (str(exc).strip().splitlines() or [""])[0][:300] if exc is not None else ""
        except Exception:
            first = ""
        said = type(exc).__name__ if exc is not None else "reported"
        said += f": {first}" if first else ""
        self.bundle_soon(f"out of memory: {said}")
        if self.flush(timeout):
            return True
        return self._outbox.send_directly(
            ev, self.redis_url, timeout, maxlen=self.settings.stream_maxlen
        )

    @contextlib.contextmanager
    def guard(self) -> Iterator[MemoryHook]:
        """Around the training loop: an out-of-memory error (``torch.OutOfMemoryError``; in
        host mode ``MemoryError`` too) is published as an ``oom`` event before it goes on."""
        try:
            yield self
        except Exception as exc:
            if self.is_oom(exc):
                try:
                    self.report_oom(exc)
                except Exception:  # the OOM itself must surface, not a failure to report it
                    log.exception("oomcast hook: reporting the OOM failed")
            raise

    # --- checkpoint requests ----------------------------------------------------------------

    @property
    def checkpoint_requested(self) -> bool:
        return bool(self._requests.pending)

    @property
    def checkpoint_request(self) -> CheckpointRequest | None:
        """The oldest pending request, or None."""
        return self._requests.oldest()

    def on_checkpoint_request(
        self, callback: Callable[[CheckpointRequest], None]
    ) -> Callable[[CheckpointRequest], None]:
        """Call ``callback(request)`` when a request is taken. It runs in the thread that
        received the request: the main thread, inside the signal handler, for a signal (so it
        interrupts whatever the loop was doing: keep it short, set a flag); the hook's
        background thread for a control-stream command; the caller's for
        :meth:`request_checkpoint`. Usable as a decorator."""
        self._requests.callbacks.append(callback)
        return callback

    def request_checkpoint(self, reason: str | None = None) -> CheckpointRequest | None:
        """Ask for a checkpoint from code (as a signal or a control command would)."""
        return None if self._off else self._take_request("api", reason)

    def _take_request(
        self, source: str, reason: str | None, cid: str | None = None
    ) -> CheckpointRequest:
        # No lock anywhere on this path: it runs inside signal handlers.
        req = CheckpointRequest(cid or new_request_id(), reason, source, time.time())
        self._requests.pending.append(req)
        self.stats.checkpoint_requests += 1
        extra: dict[str, Any] = {"request_id": req.id, "reason": reason, "source": source}
        self._outbox.put_event(self._event(CHECKPOINT_REQUESTED, **extra))
        self._requests.notify(req)
        return req

    def checkpoint_done(self, path: str | None = None, ok: bool = True) -> None:
        """Report the checkpoint taken for the pending request(s) (``ok=False``: it failed);
        clears ``checkpoint_requested``."""
        if self._off:
            return
        taken = [r.id for r in self._requests.drain()]
        name = CHECKPOINT_DONE if ok else CHECKPOINT_FAILED
        self._outbox.put_event(self._event(name, **ack_extra(taken, path)))
        self._outbox.wake.set()

    def _on_signal(self, signum: int) -> None:
        if not self._off:
            self._take_request("signal", f"signal {signal.Signals(signum).name}")

    def _take_command(self, cid: str, reason: str | None) -> None:
        self._take_request("jobctl", reason, cid)

    def _chores(self) -> None:
        """The thread's work besides publishing: the control stream, the host's limit."""
        if self._jobctl is not None and time.monotonic() >= self._next_control:
            self._next_control = time.monotonic() + self.settings.control_poll_s
            self.stats.control_ignored += self._jobctl.poll(self._take_command)
        if self._reader is not None:
            self._reader.refresh()

    # --- flushing and closing ---------------------------------------------------------------

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (at most ``timeout_s``) until everything queued so far is in Redis."""
        if self._forked:
            return self._outbox.publisher is None or self._outbox.pending() == 0
        return self._outbox.flush(timeout_s)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self, timeout_s: float | None = None) -> bool:
        """Flush (at most ``timeout_s``, default ``close_timeout_s``), stop the thread and
        restore the signal handler. True when everything was delivered. Idempotent."""
        if self._closed:
            return self._delivered_at_close
        self._closed = True
        self._off = True  # no new samples while the last ones go out
        outbox = self._outbox
        if self._forked or outbox.thread is None:
            return True
        timeout = self.settings.close_timeout_s if timeout_s is None else timeout_s
        if threading.current_thread() is outbox.thread:  # from a control-request callback
            delivered = False
            outbox.stop_event.set()
        else:
            delivered = self.flush(timeout)
            outbox.stop(min(1.0, max(0.1, timeout)))
        self._signal.restore()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._reader is not None:
            self._reader.close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        if not delivered:
            log.warning(
                "oomcast hook: closing with %d samples/events not delivered", outbox.pending()
            )
        self._delivered_at_close = delivered
        return delivered

    def __enter__(self) -> MemoryHook:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"MemoryHook(mode={self.mode!r}, node={self.node!r}, device={self.device!r},"
            f" job={self.job!r})"
        )


_installed: MemoryHook | None = None


def install(job: str | None = None, **kwargs: Any) -> MemoryHook:
    """The process's hook, created on the first call (later calls return the same one until
    it is closed). Takes :class:`MemoryHook`'s arguments. In a forked child the parent's
    hook has gone quiet (its thread did not survive the fork, its domain is the parent's),
    so the child's first call makes one of its own (host mode: ``proc:{child's pid}``)."""
    global _installed
    current = _installed
    if current is None or current.closed or current._forked:
        _installed = current = MemoryHook(job, **kwargs)
    return current


__all__ = [  # what this module offered before it was split (README, integrations, service)
    "MODES",
    "OFF_VALUES",
    "CheckpointRequest",
    "HookSettings",
    "HookStats",
    "JobCommand",
    "MemoryHook",
    "cuda_device_name",
    "encode_jobctl",
    "format_gpu_uuid",
    "install",
    "jobctl_key",
    "memory_limit_bytes",
    "parse_jobctl",
    "redact_url",
]
