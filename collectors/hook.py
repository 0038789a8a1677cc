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

**Modes** (``hook.mode``, logged once at start):

* ``cuda``: the caching allocator's figures for one GPU (``torch.cuda.memory_stats``:
  allocated, reserved, ``num_alloc_retries``, ``num_ooms``), the device's total and free memory
  (``torch.cuda.mem_get_info``; used = total - free, so other processes count), and the
  step's peak: the allocator's peak reserved since the previous sample (the figure
  ``torch.cuda.max_memory_reserved`` returns, then ``reset_peak_memory_stats``), added on top
  of the current use, so it is on the same scale as ``used_bytes``. The device is named by
  its UUID as NVML writes it (``GPU-xxxxxxxx-...``), else ``cuda{i}``; never ``gpu{i}``,
  which is the node agent's NVML name for the whole GPU.
* ``host`` (no CUDA): this process's resident memory (``proc:{pid}``) against its memory
  cgroup's limit, or MemTotal when it has none. The peak is the kernel's VmHWM (at least the
  current RSS), reset through ``/proc/self/clear_refs`` at most once per ``peak_reset_s``
  (default 1 s), right after a sample has read it: the reset takes the process's mmap lock,
  so doing it at every step would make ``step()`` wait behind other threads' page faults
  (DataLoader workers' threads, pinned memory) and stall them. A sample's peak therefore
  covers at least the time since the previous sample, and at most the time since the last
  reset (up to ``peak_reset_s`` before it); no peak between resets is lost, since the sample
  that triggers a reset has read VmHWM first. Where the kernel refuses the reset the peak
  is left out.
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
otherwise), by the job's control stream ``{prefix}:jobctl:{{job}}`` (:func:`jobctl_key`),
or from :meth:`MemoryHook.request_checkpoint`. Each is published as a
``checkpoint_requested`` event; :meth:`MemoryHook.checkpoint_done` answers it with
``checkpoint_done`` (or ``checkpoint_failed``) carrying the request id. Requests that arrive
while one is pending are answered by the same checkpoint.

In multi-process training every rank has a hook of its own (one GPU each). A signal or
command reaches the ranks at different steps, so a checkpoint that needs every rank at the
same step (a sharded save) must agree on the step itself before saving; the Lightning and
Hugging Face callbacks (:mod:`oomcast.collectors.integrations`) do.
"""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import logging
import os
import queue
import resource
import signal
import statistics
import sys
import threading
import time
import uuid
import weakref
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import redis

from oomcast.collectors.publisher import Entry, StreamPublisher
from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState
from oomcast.model.schema import Event, Sample, SchemaError, decode_json
from oomcast.model.wire import ENTRY_VERSION, Keys, encode_samples, sample_payload

log = logging.getLogger(__name__)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
MODES = ("cuda", "host", "off")
OFF_VALUES = ("off", "0", "false", "no", "disabled")
SAMPLES_PER_ENTRY = 500  # a long backlog goes out as several entries, not one huge one
EVENTS_BACKLOG = 10_000  # events waiting for the thread (they are rare; this is a safety cap)
# Commands older than the hook (by their stream id) are for an earlier run of the job; a
# little slack covers a Redis clock a bit behind ours.
CONTROL_LOOKBACK_S = 2.0
V1_UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as ~9.2e18 bytes
HOST_TOTAL_REFRESH_S = 60.0
YIELD_EVERY = 8  # samples the thread embeds before it offers the GIL to the training loop


# --- the job control stream ------------------------------------------------------------------


def jobctl_key(prefix: str, job: str) -> str:
    """The stream of commands for one job; the hash tag keeps it in one Redis Cluster slot."""
    return f"{prefix}:jobctl:{{{job}}}"


@dataclass(frozen=True, slots=True)
class JobCommand:
    action: str
    id: str
    reason: str | None = None


def parse_jobctl(fields: Mapping[Any, Any]) -> JobCommand:
    """Decode one entry of a job control stream: field ``cmd``, a JSON object
    ``{"action": "checkpoint", "id": "...", "reason": "..."}``. Every command goes through
    here, so this is where a signature check belongs. Raises SchemaError."""
    raw = fields.get("cmd", fields.get(b"cmd"))
    if raw is None:
        raise SchemaError("cmd", "entry has no 'cmd' field")
    if isinstance(raw, bytes):
        try:
            raw = raw.decode()
        except UnicodeDecodeError:
            raise SchemaError("cmd", "is not UTF-8") from None
    obj = decode_json(raw, "cmd")
    if not isinstance(obj, dict):
        raise SchemaError("cmd", f"must be a JSON object, got {type(obj).__name__}")
    action = obj.get("action")
    if not isinstance(action, str) or not action:
        raise SchemaError("cmd.action", f"must be a non-empty string, got {action!r}")
    cid = obj.get("id")
    if cid is None:
        cid = _new_id()
    elif isinstance(cid, int) and not isinstance(cid, bool):
        cid = str(cid)
    elif not isinstance(cid, str) or not cid:
        raise SchemaError("cmd.id", f"must be a non-empty string, got {cid!r}")
    reason = obj.get("reason")
    if reason is not None and not isinstance(reason, str):
        raise SchemaError("cmd.reason", f"must be a string, got {reason!r}")
    return JobCommand(action=action, id=cid, reason=reason)


def encode_jobctl(
    action: str = "checkpoint", id: str | None = None, reason: str | None = None
) -> dict[str, str]:
    """The fields of a job control entry, for XADD (what :func:`parse_jobctl` reads)."""
    cmd: dict[str, str] = {"action": action, "id": id or _new_id()}
    if reason is not None:
        cmd["reason"] = reason
    return {"cmd": json.dumps(cmd, separators=(",", ":"))}


def redact_url(url: str) -> str:
    """``url`` without its password, for logs."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.netloc.rsplit("@", 1)[-1]
    user = f"{parts.username}:***@" if parts.username else ":***@"
    return urlunsplit(parts._replace(netloc=user + host))


def _new_id() -> str:
    return uuid.uuid4().hex[:16]


# --- reading memory ---------------------------------------------------------------------------


def format_gpu_uuid(raw: Any) -> str | None:
    """torch's device UUID (``_CUuuid``, its string, or 16 raw bytes) as NVML writes it,
    ``GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx``; None when it is not a usable UUID."""
    if isinstance(raw, bytes | bytearray):
        digits = bytes(raw).hex() if len(raw) == 16 else ""
    else:
        text = str(raw).strip()
        if text.startswith(("GPU-", "MIG-")) and len(text) > 4:
            return text
        digits = text.replace("-", "").lower()
    if len(digits) != 32 or any(c not in "0123456789abcdef" for c in digits):
        return None
    if set(digits) == {"0"}:  # what a driver that does not know reports
        return None
    d = digits
    return f"GPU-{d[:8]}-{d[8:12]}-{d[12:16]}-{d[16:20]}-{d[20:]}"


def cuda_device_name(index: int, props: Any) -> str:
    """The device name of a CUDA device: its UUID when torch exposes it, else ``cuda{i}``."""
    raw = getattr(props, "uuid", None)
    name = format_gpu_uuid(raw) if raw is not None else None
    return name or f"cuda{index}"


def _read_limit(path: Path) -> int | None:
    try:
        text = path.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    if text == "max":
        return None
    try:
        value = int(text)
    except ValueError:
        return None
    return value if 0 < value < V1_UNLIMITED else None


def _cgroup_limits(base: Path, cgroup: str, fname: str) -> list[int]:
    """Limits in ``fname`` of the cgroup and its ancestors below ``base``. Inside a container
    the path of /proc/self/cgroup may not exist under the mount (the mount is the container's
    own cgroup), so the walk up ends at the mount itself."""
    rel = Path(cgroup.lstrip("/"))
    out = []
    for d in (base / rel, *(base / p for p in rel.parents)):
        value = _read_limit(d / fname)
        if value is not None:
            out.append(value)
    return out


def meminfo_total_bytes(meminfo: Path = Path("/proc/meminfo")) -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


def memory_limit_bytes(
    *,
    proc_cgroup: Path = Path("/proc/self/cgroup"),
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    meminfo: Path = Path("/proc/meminfo"),
) -> int | None:
    """What this process may use: the tightest memory cgroup limit on its path (v1
    ``memory.limit_in_bytes``, v2 ``memory.max``; "max" and ~2^63 mean none), at most
    MemTotal; MemTotal when there is no limit; None when neither can be read."""
    limits: list[int] = []
    total = meminfo_total_bytes(meminfo)
    if total:
        limits.append(total)
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        lines = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            for base in (cgroup_root, cgroup_root / "unified"):
                limits.extend(_cgroup_limits(base, path, "memory.max"))
        elif "memory" in controllers.split(","):
            limits.extend(_cgroup_limits(cgroup_root / "memory", path, "memory.limit_in_bytes"))
    return min(limits) if limits else None


def _status_bytes(data: bytes, key: bytes) -> int:
    i = data.index(key) + len(key)
    return int(data[i : data.index(b"\n", i)].split()[0]) * 1024


class _ProcMemory:
    """This process's RSS, and its peak, through descriptors kept open (a pread costs
    microseconds; opening the file each time costs more). With the peak:
    ``/proc/self/status`` (VmRSS and VmHWM), then VmHWM is reset through
    ``/proc/self/clear_refs`` when ``peak_reset_s`` has passed since the previous reset;
    without: the cheaper ``/proc/self/statm``."""

    def __init__(
        self,
        track_peak: bool,
        peak_reset_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
        self.peak_reset_s = peak_reset_s
        self.clock = clock
        self.resets = 0  # writes to clear_refs (each takes the mmap lock)
        self._next_reset = 0.0
        self.statm_fd = self._open("/proc/self/statm", os.O_RDONLY)
        self.status_fd: int | None = None
        self.clear_fd: int | None = None
        if track_peak:
            self.status_fd = self._open("/proc/self/status", os.O_RDONLY)
            self.clear_fd = self._open("/proc/self/clear_refs", os.O_WRONLY)
            try:
                if self.status_fd is None or self.clear_fd is None:
                    raise OSError("not available")
                _status_bytes(os.pread(self.status_fd, 8192, 0), b"VmHWM:")
                self._reset_peak()  # fails here, once, where the kernel refuses it
            except (OSError, ValueError) as exc:
                log.info("oomcast hook: peak RSS cannot be reset here (%s); no peak sent", exc)
                self._close("status_fd")
                self._close("clear_fd")
        if self.statm_fd is None and self.clear_fd is None:
            log.warning("oomcast hook: no /proc/self; reporting ru_maxrss as used memory")

    @staticmethod
    def _open(path: str, flags: int) -> int | None:
        try:
            return os.open(path, flags)
        except OSError:
            return None

    def _reset_peak(self) -> None:
        assert self.clear_fd is not None
        os.write(self.clear_fd, b"5")  # 5: reset the peak RSS (Linux 4.0+)
        self.resets += 1
        self._next_reset = self.clock() + self.peak_reset_s

    def read(self) -> tuple[int, int | None]:
        """(rss, peak or None). The peak is the highest RSS since the last reset, which is at
        or before the previous read: the reset comes after VmHWM is read, so what a read
        returns covers everything up to it, and the next read starts where it ended."""
        if self.clear_fd is not None and self.status_fd is not None:
            data = os.pread(self.status_fd, 8192, 0)
            rss = _status_bytes(data, b"VmRSS:")
            peak = max(rss, _status_bytes(data, b"VmHWM:"))
            if self.clock() >= self._next_reset:
                try:
                    self._reset_peak()
                except OSError:  # the peak then covers more than it should, no harm done
                    self._next_reset = self.clock() + self.peak_reset_s
            return rss, peak
        if self.statm_fd is not None:
            return int(os.pread(self.statm_fd, 256, 0).split()[1]) * self.page, None
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, None

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(self, name, None)

    def close(self) -> None:
        for name in ("statm_fd", "status_fd", "clear_fd"):
            self._close(name)


# --- the hook ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class CheckpointRequest:
    id: str
    reason: str | None
    source: str  # "signal", "jobctl" or "api"
    ts: float


@dataclass
class HookStats:
    steps: int = 0  # step() calls
    samples: int = 0  # samples taken (queued, or dropped at once)
    queue_dropped: int = 0  # dropped because the queue was full (the thread fell behind)
    records_published: int = 0  # samples and events in Redis (the publisher counts both)
    publish_dropped: int = 0  # dropped by the publisher's buffer during a Redis outage
    publish_errors: int = 0
    events: int = 0  # events queued (oom, checkpoint_*)
    ooms: int = 0
    checkpoint_requests: int = 0
    control_ignored: int = 0  # control entries that were malformed or of unknown action
    read_errors: int = 0  # samples not taken because reading the figures failed

    @property
    def dropped(self) -> int:
        return self.queue_dropped + self.publish_dropped


@dataclass(slots=True, eq=False)
class _OutEvent:
    event: Event
    extra: dict[str, Any]
    seq: int = 0  # the hook's count of samples and events, in the order they were queued

    def fields(self) -> dict[str, str]:
        # Event readers ignore keys they do not know, so the request id and path ride along.
        obj = {**self.event.to_dict(), **{k: v for k, v in self.extra.items() if v is not None}}
        return {"v": ENTRY_VERSION, "event": json.dumps(obj, separators=(",", ":"))}


_LIVE: weakref.WeakSet[MemoryHook] = weakref.WeakSet()


def _after_fork_in_child() -> None:
    # The thread did not survive the fork and the domain is the parent's: go quiet.
    for hook in list(_LIVE):
        hook._forked = True
        hook._off = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class MemoryHook:
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
    ) -> None:
        """
        job: the job's name (default ``OOMCAST_JOB``); also names its control stream.
        redis_url, node, key_prefix, partitions: default ``OOMCAST_REDIS_URL``,
            ``OOMCAST_NODE`` (else the hostname), ``OOMCAST_KEY_PREFIX``, ``OOMCAST_PARTITIONS``.
        device: the CUDA device to watch (index, ``"cuda:1"``, torch.device); default current.
        mode: ``auto`` (cuda when available, else host), ``cuda``, ``host``; ``OOMCAST_HOOK``
            (``off``, ``host``, ``cuda``) overrides ``auto``, and ``off`` overrides anything.
        min_interval_s: take a sample at most this often (steps in between cost a clock read).
        queue_size: samples waiting for the thread; past that the oldest are dropped.
        checkpoint_signal: the signal that requests a checkpoint, or None for none. Its
            handler is installed only when the hook is created in the main thread, and calls
            the handler it replaced. Frameworks that only install their own SIGUSR1 handler
            when there is none (Lightning's SLURM auto-requeue) need another signal here.
        publish: False keeps everything in-process (embedding included) and sends nothing.
        control: read the job's control stream for commands (needs ``job`` and ``publish``).
        track_peak: report each sample's peak, resetting the allocator's peak at each sample
            (cuda) or the kernel's VmHWM (host, see ``peak_reset_s``).
        peak_reset_s: host mode: reset VmHWM at most this often (0: at every sample). The
            reset takes the process's mmap lock, so it waits behind (and holds up) other
            threads' page faults; a sample's peak covers at least the time since the
            previous sample, and up to ``peak_reset_s`` more.
        """
        if mode not in ("auto", "cuda", "host"):
            raise ValueError(f"mode={mode!r} must be auto, cuda or host")
        if queue_size < 1:
            raise ValueError(f"queue_size={queue_size} must be at least 1")
        if min_interval_s < 0:
            raise ValueError(f"min_interval_s={min_interval_s} must not be negative")
        if not peak_reset_s >= 0:
            raise ValueError(f"peak_reset_s={peak_reset_s} must not be negative")
        env = os.environ.get("OOMCAST_HOOK", "").strip().lower()
        if env in ("cuda", "host") and mode == "auto":
            mode = env
        elif env and env not in OFF_VALUES and env not in ("auto", "on", "cuda", "host"):
            log.warning("OOMCAST_HOOK=%r is not off, auto, cuda or host; using %s", env, mode)

        self.job = job or os.environ.get("OOMCAST_JOB") or None
        self.node = node or os.environ.get("OOMCAST_NODE") or os.uname().nodename
        if partitions is None:
            partitions = int(os.environ.get("OOMCAST_PARTITIONS") or 4)
        self.keys = Keys(
            key_prefix or os.environ.get("OOMCAST_KEY_PREFIX") or "oomcast", partitions
        )
        self.redis_url = redis_url or os.environ.get("OOMCAST_REDIS_URL") or DEFAULT_REDIS_URL
        self.stats = HookStats()
        self.device = ""
        self.mode = "off"

        self._off = True
        self._closed = False
        self._forked = False
        self._min_interval_s = min_interval_s
        self._next_sample_at = 0.0
        self._track_peak = track_peak
        self._peak_reset_s = peak_reset_s
        self._publish_interval_s = publish_interval_s
        self._control_poll_s = control_poll_s
        self._stream_maxlen = stream_maxlen
        self._redis_timeout_s = redis_timeout_s
        self._close_timeout_s = close_timeout_s
        self._oom_timeout_s = oom_timeout_s
        self._created = time.time()
        self._last_ts = 0.0
        # Samples and events are numbered as they are queued (itertools.count: atomic under the
        # GIL, no lock, so signal handlers may take numbers too); the thread publishes only
        # what was numbered before it started a round, so what one thread queued leaves in
        # the order it was queued, however the round interleaves with it.
        self._seq = itertools.count()
        self._queue: queue.Queue[tuple[int, Sample]] = queue.Queue(maxsize=queue_size)
        # Events, requests and flush waiters go through deques: appending takes no lock, so a
        # signal handler (which may interrupt the main thread anywhere) can use them.
        self._events: deque[_OutEvent] = deque(maxlen=EVENTS_BACKLOG)
        self._requests: deque[CheckpointRequest] = deque()
        self._callbacks: list[Callable[[CheckpointRequest], None]] = []
        self._flush_waiters: deque[threading.Event] = deque()
        # numbered after the round began: held for the next round (the thread's own)
        self._held_samples: list[tuple[int, Sample]] = []
        self._held_events: list[_OutEvent] = []
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._oom_lock = threading.Lock()
        self._oom_open = False
        self._oom_event: _OutEvent | None = None
        self._num_ooms: int | None = None
        self._torch: Any = None
        self._index = 0
        self._proc: _ProcMemory | None = None
        self._host_total = 0
        self._host_total_at = 0.0
        self._embedders: dict[str, EmbeddingState] = {}
        self._client: redis.Redis | None = None
        self._publisher: StreamPublisher | None = None
        self._control_key: str | None = None
        self._control_cursor = f"{max(0, int((self._created - CONTROL_LOOKBACK_S) * 1000))}-0"
        self._signal: int | None = None
        self._prev_handler: Any = None
        self._read_error_logged = False
        self._delivered_at_close = True

        if not enabled or env in OFF_VALUES:
            log.info("oomcast hook: mode=off (%s)", "OOMCAST_HOOK" if enabled else "enabled=False")
            return

        if mode in ("auto", "cuda"):
            self._torch = self._cuda_torch(mode == "cuda")
        if self._torch is not None:
            self._setup_cuda(device)
        else:
            self._setup_host()

        if publish:
            self._client = redis.Redis.from_url(
                self.redis_url,
                socket_timeout=redis_timeout_s,
                socket_connect_timeout=redis_timeout_s,
            )
            self._publisher = StreamPublisher(
                self._client, maxlen=stream_maxlen, buffer_samples=buffer_samples
            )
            if control and self.job:
                self._control_key = jobctl_key(self.keys.prefix, self.job)
        self._off = False
        self._thread = threading.Thread(target=self._run, name="oomcast-hook", daemon=True)
        self._thread.start()
        if checkpoint_signal is not None:
            self._install_signal(checkpoint_signal)
        atexit.register(self.close)
        _LIVE.add(self)
        log.info(
            "oomcast hook: mode=%s device=%s node=%s job=%s publish=%s",
            self.mode,
            self.device,
            self.node,
            self.job,
            "off" if self._publisher is None else redact_url(self.redis_url),
        )

    # --- set-up ----------------------------------------------------------------------------

    @staticmethod
    def _cuda_torch(required: bool) -> Any:
        try:
            import torch
        except ImportError:
            if required:
                raise RuntimeError("mode='cuda' needs torch, which is not installed") from None
            return None
        if torch.cuda.is_available():
            return torch
        if required:
            raise RuntimeError("mode='cuda' but torch.cuda.is_available() is False")
        return None

    def _setup_cuda(self, device: Any) -> None:
        torch = self._torch
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int):
            index = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"device={device!r} is not a CUDA device")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
        self._index = int(index)
        self.device = cuda_device_name(self._index, torch.cuda.get_device_properties(self._index))
        self.mode = "cuda"
        attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is not None:
            ref = weakref.ref(self)
            watched = self._index

            # Called by the caching allocator (in the allocating thread) just before it raises;
            # it only appends to a deque, and torch offers no way to detach it.
            def observer(*args: Any) -> None:
                hook = ref()
                if hook is None or hook._off:
                    return
                if args and isinstance(args[0], int) and args[0] != watched:
                    return
                hook._note_oom("observer")

            attach(observer)

    def _setup_host(self) -> None:
        self._proc = _ProcMemory(self._track_peak, self._peak_reset_s)
        self._refresh_host_total()
        self.device = f"proc:{os.getpid()}"
        self.mode = "host"

    def _refresh_host_total(self) -> None:
        total = memory_limit_bytes()
        if total is None:
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):
                total = 0
        self._host_total = total
        self._host_total_at = time.monotonic()

    def _install_signal(self, signum: int) -> None:
        if threading.current_thread() is not threading.main_thread():
            log.info("oomcast hook: created outside the main thread; no signal handler")
            return
        self._prev_handler = signal.getsignal(signum)
        signal.signal(signum, self._on_signal)
        self._signal = signum

    # --- the training loop's side -------------------------------------------------------------

    def step(self) -> None:
        """Take a sample and queue it (never blocks; never raises for a failed read)."""
        if self._off:
            return
        self.stats.steps += 1
        if self._min_interval_s:
            now = time.monotonic()
            if now < self._next_sample_at:
                return
            self._next_sample_at = now + self._min_interval_s
        self._sample()
        # A completed step after an OOM: the next OOM is a new one.
        self._oom_open = False

    def _sample(self) -> None:
        try:
            sample, ooms = self._read()
        except Exception as exc:
            self.stats.read_errors += 1
            if not self._read_error_logged:
                self._read_error_logged = True
                log.warning("oomcast hook: reading memory failed (%r); step goes on", exc)
            return
        if ooms is not None:
            if self._num_ooms is not None and ooms > self._num_ooms:
                # it happened during the step, before this sample: the sample is the first of
                # the history after it, not the last one before. The event is queued first,
                # so that the thread cannot publish (and embed) the sample before it.
                self._note_oom("num_ooms", ts=sample.ts - 1e-6)
            self._num_ooms = ooms
        self.stats.samples += 1
        item = (next(self._seq), sample)
        q = self._queue
        try:
            q.put_nowait(item)
        except queue.Full:
            # the newest matter most to a forecast: make room by dropping the oldest
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            self.stats.queue_dropped += 1
            try:
                q.put_nowait(item)
            except queue.Full:
                self.stats.queue_dropped += 1

    def _read(self) -> tuple[Sample, int | None]:
        ts = time.time()
        if ts <= self._last_ts:  # samples of a domain must be strictly in time order
            ts = self._last_ts + 1e-6
        self._last_ts = ts
        if self._torch is not None:
            cuda = self._torch.cuda
            i = self._index
            stats = cuda.memory_stats(i)
            allocated = int(stats.get("allocated_bytes.all.current", 0))
            reserved = int(stats.get("reserved_bytes.all.current", 0))
            retries = int(stats.get("num_alloc_retries", 0))
            ooms = int(stats.get("num_ooms", 0))
            peak_reserved = None
            if self._track_peak:
                # the figure torch.cuda.max_memory_reserved(i) returns, without a second
                # memory_stats call
                peak_reserved = int(stats.get("reserved_bytes.all.peak", reserved))
                cuda.reset_peak_memory_stats(i)
            free, total = cuda.mem_get_info(i)
            used = max(0, total - free)
            # other processes and the CUDA context do not move within a step: the device's
            # peak is today's use plus how far the allocator's reservation rose above today's
            peak = None if peak_reserved is None else used + max(0, peak_reserved - reserved)
            sample = Sample(
                ts=ts,
                node=self.node,
                device=self.device,
                kind="gpu",
                total_bytes=total,
                used_bytes=used,
                allocated_bytes=allocated,
                reserved_bytes=reserved,
                peak_bytes=peak,
                alloc_retries=retries,
                job=self.job,
            )
            return sample, ooms
        assert self._proc is not None
        used, peak = self._proc.read()
        sample = Sample(
            ts=ts,
            node=self.node,
            device=self.device,
            kind="host",
            total_bytes=self._host_total,
            used_bytes=used,
            peak_bytes=peak,
            job=self.job,
        )
        return sample, None

    # --- OOMs ------------------------------------------------------------------------------------

    def _make_event(self, name: str, ts: float | None = None, **extra: Any) -> _OutEvent:
        event = Event(
            ts=time.time() if ts is None else ts,
            node=self.node,
            device=self.device,
            event=name,
            job=self.job,
        )
        return _OutEvent(event, extra, next(self._seq))

    def _note_oom(
        self, source: str, detail: str | None = None, ts: float | None = None
    ) -> _OutEvent:
        """Queue an ``oom`` event unless this OOM was already reported; returns its event."""
        with self._oom_lock:
            if self._oom_open and self._oom_event is not None:
                return self._oom_event
            ev = self._make_event("oom", ts=ts, source=source, detail=detail)
            self._oom_open = True
            self._oom_event = ev
        self.stats.ooms += 1
        self.stats.events += 1
        self._events.append(ev)
        return ev

    def is_oom(self, exc: BaseException) -> bool:
        """Whether ``exc`` is an out-of-memory error of this hook's domain."""
        if self._off:
            return False
        torch = sys.modules.get("torch")
        oom_error = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
        if oom_error is not None and isinstance(exc, oom_error):
            return True
        return self.mode == "host" and isinstance(exc, MemoryError)

    def report_oom(self, exc: BaseException | None = None, timeout_s: float | None = None) -> bool:
        """Publish an ``oom`` event now, with what is queued before it, waiting at most
        ``timeout_s`` (default ``oom_timeout_s``). True once it is in Redis."""
        if self._off:
            return False
        timeout = self._oom_timeout_s if timeout_s is None else timeout_s
        ev = self._note_oom("exception", type(exc).__name__ if exc is not None else None)
        if self.flush(timeout):
            return True
        return self._send_directly(ev, timeout)

    def _send_directly(self, ev: _OutEvent, timeout_s: float) -> bool:
        """The thread did not get to it in time (stuck on a slow Redis, or gone): send it from
        here, unless the thread already took it (then it is in the publisher's hands)."""
        if self._publisher is None:
            return False
        try:
            self._events.remove(ev)
        except ValueError:
            return False
        client = redis.Redis.from_url(
            self.redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        try:
            client.xadd(self.keys.events, ev.fields(), maxlen=self._stream_maxlen, approximate=True)
            return True
        except redis.RedisError as exc:
            log.warning("oomcast hook: could not publish the oom event (%s)", exc)
            self._events.appendleft(ev)
            return False
        finally:
            client.close()

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
        return bool(self._requests)

    @property
    def checkpoint_request(self) -> CheckpointRequest | None:
        """The oldest pending request, or None."""
        try:
            return self._requests[0]
        except IndexError:
            return None

    def on_checkpoint_request(
        self, callback: Callable[[CheckpointRequest], None]
    ) -> Callable[[CheckpointRequest], None]:
        """Call ``callback(request)`` when a request is taken. It runs in the thread that
        received the request: the main thread, inside the signal handler, for a signal (so it
        interrupts whatever the loop was doing: keep it short, set a flag); the hook's
        background thread for a control-stream command; the caller's for
        :meth:`request_checkpoint`. Usable as a decorator."""
        self._callbacks.append(callback)
        return callback

    def request_checkpoint(self, reason: str | None = None) -> CheckpointRequest | None:
        """Ask for a checkpoint from code (as a signal or a control command would)."""
        if self._off:
            return None
        req = CheckpointRequest(id=_new_id(), reason=reason, source="api", ts=time.time())
        self._take_request(req)
        return req

    def _take_request(self, req: CheckpointRequest) -> None:
        # No lock anywhere on this path: it runs inside signal handlers.
        self._requests.append(req)
        self.stats.checkpoint_requests += 1
        self.stats.events += 1
        self._events.append(
            self._make_event(
                "checkpoint_requested", request_id=req.id, reason=req.reason, source=req.source
            )
        )
        for callback in list(self._callbacks):
            try:
                callback(req)
            except Exception:
                log.exception("oomcast hook: checkpoint request callback failed")

    def checkpoint_done(self, path: str | None = None, ok: bool = True) -> None:
        """Report the checkpoint taken for the pending request(s) (``ok=False``: it failed);
        clears ``checkpoint_requested``."""
        if self._off:
            return
        taken: list[CheckpointRequest] = []
        while True:
            try:
                taken.append(self._requests.popleft())
            except IndexError:
                break
        extra: dict[str, Any] = {
            "request_id": taken[0].id if taken else None,
            "path": None if path is None else str(path),
        }
        if len(taken) > 1:
            extra["request_ids"] = [r.id for r in taken]
        self.stats.events += 1
        self._events.append(
            self._make_event("checkpoint_done" if ok else "checkpoint_failed", **extra)
        )
        self._wake.set()

    def _on_signal(self, signum: int, frame: Any) -> None:
        if not self._off:
            self._take_request(
                CheckpointRequest(
                    id=_new_id(),
                    reason=f"signal {signal.Signals(signum).name}",
                    source="signal",
                    ts=time.time(),
                )
            )
        prev = self._prev_handler
        if callable(prev):
            prev(signum, frame)

    # --- the background thread ------------------------------------------------------------------

    def _run(self) -> None:
        next_control = 0.0
        while not self._stop.is_set():
            self._wake.wait(self._publish_interval_s)
            self._wake.clear()
            waiters: list[threading.Event] = []
            while True:
                try:
                    waiters.append(self._flush_waiters.popleft())
                except IndexError:
                    break
            try:
                self._publish_pending(force=bool(waiters))
                if self._control_key is not None and time.monotonic() >= next_control:
                    next_control = time.monotonic() + self._control_poll_s
                    self._poll_control()
                if self._proc is not None and (
                    time.monotonic() - self._host_total_at > HOST_TOTAL_REFRESH_S
                ):
                    self._refresh_host_total()
            except Exception:  # the thread must outlive anything
                log.exception("oomcast hook: background publishing failed")
            if self._held_samples or self._held_events:
                self._wake.set()  # they go out in the next round, right away
            delivered = self._publisher is None or (
                self._publisher.buffered_samples == 0
                and not self._held_samples
                and not self._held_events
            )
            for w in waiters:
                if delivered:
                    w.set()
                else:
                    self._flush_waiters.append(w)  # try again next round (flush() times out)

    def _take_pending(self) -> tuple[list[Sample], list[_OutEvent]]:
        """What was queued before now: a thread that queues an event and then a sample (an
        OOM, then the sample after it) may do so while the queues are being emptied; what
        was numbered after ``cut`` waits for the next round, so the sample cannot leave
        before its event, nor the event before the samples queued ahead of it."""
        cut = next(self._seq)
        numbered, self._held_samples = self._held_samples, []
        while True:
            try:
                numbered.append(self._queue.get_nowait())
            except queue.Empty:
                break
        events, self._held_events = self._held_events, []
        while True:
            try:
                events.append(self._events.popleft())
            except IndexError:
                break
        samples = [s for n, s in numbered if n < cut]
        if len(samples) < len(numbered):
            self._held_samples = [(n, s) for n, s in numbered if n > cut]
        if any(e.seq > cut for e in events):
            self._held_events = [e for e in events if e.seq > cut]
            events = [e for e in events if e.seq < cut]
        return samples, events

    def _publish_pending(self, force: bool) -> None:
        samples, events = self._take_pending()
        entries = self._build_entries(samples, events) if samples or events else []
        pub = self._publisher
        if pub is None:
            return
        if entries:
            pub.publish(entries)  # waits out its backoff after a failure
        if force and pub.buffered_samples:
            pub.flush()  # someone is waiting: try now
        self.stats.records_published = pub.stats.samples_sent
        self.stats.publish_dropped = pub.stats.samples_dropped
        self.stats.publish_errors = pub.stats.publish_errors

    def _build_entries(self, samples: list[Sample], events: list[_OutEvent]) -> list[Entry]:
        """Samples and events in time order, so that the samples before an OOM reach the
        service before it does, and those after it start the domain's history afresh."""
        items: list[tuple[float, int, Sample | _OutEvent]] = [(s.ts, 0, s) for s in samples]
        items.extend((e.event.ts, 1, e) for e in events)
        items.sort(key=lambda t: (t[0], t[1]))
        entries: list[Entry] = []
        run: list[dict[str, Any]] = []
        stream = self.keys.samples_for(self.node)

        def close_run() -> None:
            for i in range(0, len(run), SAMPLES_PER_ENTRY):
                chunk = run[i : i + SAMPLES_PER_ENTRY]
                entries.append(Entry(stream, encode_samples(self.node, chunk), len(chunk)))
            run.clear()

        for n, (_, _, item) in enumerate(items, 1):
            if n % YIELD_EVERY == 0:
                time.sleep(0)  # let the training thread have the GIL between chunks of work
            if isinstance(item, Sample):
                state = self._embedders.get(item.device)
                if state is None:
                    state = self._embedders[item.device] = EmbeddingState()
                run.append(sample_payload(item, state.embed(item), EMBEDDING_VERSION))
            else:
                close_run()
                entries.append(Entry(self.keys.events, item.fields(), 1))
                if item.event.event == "oom":
                    self._embedders.pop(item.event.device, None)  # as the node agent does
        close_run()
        return entries

    def _poll_control(self) -> None:
        assert self._client is not None and self._control_key is not None
        try:
            resp = self._client.xread({self._control_key: self._control_cursor}, count=32)
        except redis.RedisError as exc:
            log.debug("oomcast hook: control stream not read (%s)", exc)
            return
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                self._control_cursor = (
                    entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
                )
                self._handle_control(self._control_cursor, fields)

    def _handle_control(self, entry_id: str, fields: Mapping[Any, Any]) -> None:
        try:
            cmd = parse_jobctl(fields)
        except SchemaError as exc:
            self.stats.control_ignored += 1
            log.warning("oomcast hook: control entry %s ignored: %s", entry_id, exc)
            return
        if cmd.action != "checkpoint":
            self.stats.control_ignored += 1
            log.warning(
                "oomcast hook: control entry %s ignored: unknown action %r", entry_id, cmd.action
            )
            return
        self._take_request(
            CheckpointRequest(id=cmd.id, reason=cmd.reason, source="jobctl", ts=time.time())
        )

    # --- flushing and closing ---------------------------------------------------------------

    def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait (at most ``timeout_s``) until everything queued so far is in Redis."""
        thread = self._thread
        if thread is None or not thread.is_alive() or self._forked:
            return self._publisher is None or (
                self._queue.empty()
                and not self._events
                and not self._held_samples
                and not self._held_events
                and self._publisher.buffered_samples == 0
            )
        done = threading.Event()
        self._flush_waiters.append(done)
        self._wake.set()
        return done.wait(timeout_s)

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
        if self._forked or self._thread is None:
            return True
        timeout = self._close_timeout_s if timeout_s is None else timeout_s
        if threading.current_thread() is self._thread:  # from a control-request callback
            delivered = False
            self._stop.set()
        else:
            delivered = self.flush(timeout)
            self._stop.set()
            self._wake.set()
            self._thread.join(timeout=min(1.0, max(0.1, timeout)))
        self._restore_signal()
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)
        if self._proc is not None:
            self._proc.close()
        if self._client is not None:
            with contextlib.suppress(Exception):
                self._client.close()
        if not delivered:
            left = self._queue.qsize() + len(self._events)
            left += len(self._held_samples) + len(self._held_events)
            if self._publisher is not None:
                left += self._publisher.buffered_samples
            log.warning("oomcast hook: closing with %d samples/events not delivered", left)
        self._delivered_at_close = delivered
        return delivered

    def _restore_signal(self) -> None:
        if self._signal is None:
            return
        if threading.current_thread() is threading.main_thread():
            with contextlib.suppress(ValueError, TypeError):
                if signal.getsignal(self._signal) == self._on_signal:
                    prev = self._prev_handler
                    signal.signal(self._signal, prev if prev is not None else signal.SIG_DFL)
        self._signal = None

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


# --- benchmark --------------------------------------------------------------------------------


def bench_hook(
    steps: int = 20000, redis_url: str | None = None, *, key_prefix: str | None = None
) -> dict[str, float | int]:
    """Time ``step()`` in host mode, publishing to ``redis_url`` (default
    ``OOMCAST_REDIS_URL``; the keys are deleted afterwards) and with publishing off."""
    url = redis_url or os.environ.get("OOMCAST_REDIS_URL") or DEFAULT_REDIS_URL
    prefix = key_prefix or f"oomcast-bench-{_new_id()[:8]}"
    out: dict[str, float | int] = {"steps": steps}
    for suffix, publish in (("", True), ("_no_publish", False)):
        hook = MemoryHook(
            "bench",
            redis_url=url,
            key_prefix=prefix,
            node="bench",
            mode="host",
            publish=publish,
            checkpoint_signal=None,
        )
        try:
            for _ in range(min(200, steps)):  # warm up
                hook.step()
            times = []
            clock = time.perf_counter_ns
            for _ in range(steps):
                t0 = clock()
                hook.step()
                times.append(clock() - t0)
            hook.flush(10.0)
        finally:
            hook.close(10.0)
        times.sort()
        out[f"us_per_step_p50{suffix}"] = round(times[len(times) // 2] / 1e3, 2)
        out[f"us_per_step_mean{suffix}"] = round(statistics.fmean(times) / 1e3, 2)
        out[f"us_per_step_p99{suffix}"] = round(times[int(len(times) * 0.99)] / 1e3, 2)
        out[f"us_per_step_max{suffix}"] = round(times[-1] / 1e3, 2)
        out[f"samples_queue_dropped{suffix}"] = hook.stats.queue_dropped
        if publish:
            out["records_published"] = hook.stats.records_published
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()
    return out


if __name__ == "__main__":
    args = sys.argv[1:]
    print(
        json.dumps(bench_hook(int(args[0]) if args else 20000, args[1] if len(args) > 1 else None))
    )
