"""The in-process hook's settings: its arguments and its ``OOMCAST_*`` environment, read once.

An explicit argument wins over its environment variable, which wins over the default:

=====================  =========================  ===========================================
setting                variable                   default
=====================  =========================  ===========================================
``job``                ``OOMCAST_JOB``            none (no control stream, no ``job`` key)
``node``               ``OOMCAST_NODE``           the hostname
``redis_url``          ``OOMCAST_REDIS_URL``      :data:`oomcast.model.wire.DEFAULT_REDIS_URL`
``keys``               ``OOMCAST_KEY_PREFIX``,    :class:`oomcast.model.wire.Keys` defaults
                       ``OOMCAST_PARTITIONS``
``mode``               ``OOMCAST_HOOK``           ``auto``; the variable's ``cuda``/``host``
                                                  apply to ``auto`` only, ``off`` to any
``bundle_dir``         ``OOMCAST_BUNDLE_DIR``     ``<tmp>/oomcast-bundles``; ``off``: none
=====================  =========================  ===========================================
"""

from __future__ import annotations

import logging
import os
import signal
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass

from oomcast.model.wire import Keys, redis_url_from_env
from oomcast.model.wire import redact_url as redact_url  # re-exported: the hook logs with it

log = logging.getLogger(__name__)

MODES = ("cuda", "host", "off")
OFF_VALUES = ("off", "0", "false", "no", "disabled")
_ON_VALUES = ("auto", "on", "cuda", "host")


@dataclass(frozen=True, slots=True)
class HookSettings:
    """Everything a :class:`~oomcast.collectors.hook.MemoryHook` is configured with (its
    constructor takes each as an argument); build it with :meth:`from_env`.

    job: the job's name (default ``OOMCAST_JOB``); also names its control stream.
    node, redis_url, keys: default ``OOMCAST_NODE`` (else the hostname),
        ``OOMCAST_REDIS_URL``, ``OOMCAST_KEY_PREFIX`` and ``OOMCAST_PARTITIONS``.
    mode: ``auto`` (cuda when available, else host), ``cuda``, ``host``; ``OOMCAST_HOOK``
        (``off``, ``host``, ``cuda``) overrides ``auto``, and ``off`` overrides anything.
    enabled: False (the argument, or ``OOMCAST_HOOK=off``: ``off_by`` says which) makes
        every call of the hook a no-op.
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
    publish_interval_s, control_poll_s: how often the thread publishes and reads commands.
    buffer_samples, stream_maxlen: the publisher's outage buffer, the streams' MAXLEN ~.
    redis_timeout_s, close_timeout_s, oom_timeout_s: socket timeouts; how long ``close()``
        flushes and an OOM report waits, by default.
    """

    job: str | None
    node: str
    redis_url: str
    keys: Keys
    mode: str = "auto"  # auto, cuda or host (what the hook ends up in is ``hook.mode``)
    enabled: bool = True
    off_by: str | None = None  # why it is off: "enabled=False" or "OOMCAST_HOOK"
    min_interval_s: float = 0.0
    queue_size: int = 1024
    checkpoint_signal: int | None = signal.SIGUSR1
    publish: bool = True
    control: bool = True
    track_peak: bool = True
    peak_reset_s: float = 1.0
    publish_interval_s: float = 0.2
    control_poll_s: float = 0.5
    buffer_samples: int = 10_000
    stream_maxlen: int = 100_000
    redis_timeout_s: float = 2.0
    close_timeout_s: float = 5.0
    oom_timeout_s: float = 2.0
    bundle_dir: str | None = None  # diagnosis bundles (hook_bundle.py); None: none written

    def __post_init__(self) -> None:
        if self.mode not in ("auto", "cuda", "host"):
            raise ValueError(f"mode={self.mode!r} must be auto, cuda or host")
        if self.queue_size < 1:
            raise ValueError(f"queue_size={self.queue_size} must be at least 1")
        if self.min_interval_s < 0:
            raise ValueError(f"min_interval_s={self.min_interval_s} must not be negative")
        if not self.peak_reset_s >= 0:
            raise ValueError(f"peak_reset_s={self.peak_reset_s} must not be negative")

    @classmethod
    def from_env(
        cls,
        environ: Mapping[str, str] | None = None,
        *,
        job: str | None = None,
        node: str | None = None,
        redis_url: str | None = None,
        key_prefix: str | None = None,
        partitions: int | None = None,
        mode: str = "auto",
        enabled: bool = True,
        **tuning: float | int | bool | None,
    ) -> HookSettings:
        """The settings from explicit arguments (``None``: not given) over ``environ``
        (default ``os.environ``); ``tuning`` holds the other fields, which no variable sets."""
        env = os.environ if environ is None else environ
        if mode not in ("auto", "cuda", "host"):
            raise ValueError(f"mode={mode!r} must be auto, cuda or host")
        hook_env = env.get("OOMCAST_HOOK", "").strip().lower()
        if hook_env in ("cuda", "host") and mode == "auto":
            mode = hook_env
        elif hook_env and hook_env not in OFF_VALUES and hook_env not in _ON_VALUES:
            log.warning("OOMCAST_HOOK=%r is not off, auto, cuda or host; using %s", hook_env, mode)
        layout = {k: v for k, v in env.items() if k in ("OOMCAST_KEY_PREFIX", "OOMCAST_PARTITIONS")}
        if key_prefix:
            layout["OOMCAST_KEY_PREFIX"] = key_prefix
        if partitions is not None:
            layout["OOMCAST_PARTITIONS"] = str(partitions)
        off_by = None
        if not enabled:
            off_by = "enabled=False"
        elif hook_env in OFF_VALUES:
            off_by = "OOMCAST_HOOK"
        return cls(
            job=job or env.get("OOMCAST_JOB") or None,
            node=node or env.get("OOMCAST_NODE") or os.uname().nodename,
            redis_url=redis_url or redis_url_from_env(env),
            keys=Keys.from_env(layout),
            mode=mode,
            enabled=off_by is None,
            off_by=off_by,
            bundle_dir=_bundle_dir(env, tuning.pop("bundle_dir", None)),
            **tuning,  # type: ignore[arg-type]
        )


def _bundle_dir(env: Mapping[str, str], given: object) -> str | None:
    """Where diagnosis bundles go: the argument, else ``OOMCAST_BUNDLE_DIR``, else a folder
    under the system's temporary directory; ``off`` (either way) writes none."""
    raw = str(given) if given is not None else env.get("OOMCAST_BUNDLE_DIR", "").strip()
    if raw.lower() in OFF_VALUES:
        return None
    return raw or os.path.join(tempfile.gettempdir(), "oomcast-bundles")
