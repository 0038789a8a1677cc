"""The in-process hook's diagnosis bundles (docs/diagnosis.md).

:class:`BundleHook` is mixed into :class:`~oomcast.collectors.hook.MemoryHook`. When an
alert asks the job to checkpoint (a checkpoint request, from the control stream or a
signal) and when the job reports an OOM, the hook writes one bundle
(:func:`oomcast.collectors.diagnosis.write_bundle`) into ``bundle_dir``: the last
``BUNDLE_SAMPLES`` samples it took, the allocator's figures, the other processes on the GPU
(NVML, where installed), and on CUDA ``torch.cuda.memory._snapshot()``. It then publishes a
``diagnosis_saved`` event (the path, the request it answers, why) that the service keeps in
its audit stream beside the alert, so ``/v1/alerts`` says where the bundle is. The file is
written from a thread of its own: a request may arrive in a signal handler, and a snapshot
of a large cache takes a while. ``oomcast explain BUNDLE`` reads it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomcast.collectors.diagnosis import growing_sites, site_bytes, write_bundle
from oomcast.collectors.hook_jobctl import CheckpointRequest, CheckpointRequests
from oomcast.collectors.hook_phases import PhaseHook
from oomcast.collectors.hook_settings import HookSettings
from oomcast.model.events import DetailedEvent
from oomcast.model.schema import Sample

log = logging.getLogger(__name__)

BUNDLE_SAMPLES = 600  # the samples a bundle keeps: minutes of history at the usual rates
# On CUDA the hook keeps each allocation site's live bytes, refreshed this often (from a
# thread of its own), so that a bundle can say which sites grew: a leak's suspects.
BASELINE_EVERY_S = 300.0
DIAGNOSIS_SAVED = "diagnosis_saved"


class BundleHook(PhaseHook):
    """The bundle (and, inherited, the phase) half of the hook. The hook provides
    ``settings``, ``_requests``, ``_reader`` and ``_event`` besides what :class:`PhaseHook`
    needs, and calls ``_init_mixins`` from its constructor."""

    settings: HookSettings
    _requests: CheckpointRequests
    _reader: Any
    _event: Callable[..., DetailedEvent]

    def _init_mixins(self) -> None:
        self._init_phases()
        self._recent: deque[Sample] = deque(maxlen=BUNDLE_SAMPLES)
        self._bundle_lock = threading.Lock()  # one bundle at a time
        self.bundles: list[Path] = []  # written so far, oldest first
        self._requests.callbacks.append(self._bundle_for_request)
        self._baseline: tuple[float, dict[str, int]] | None = None  # (when, site -> bytes)
        self._baseline_due = 0.0  # monotonic time of the next refresh

    def _noted(self, sample: Sample) -> None:
        self._recent.append(sample)
        super()._noted(sample)
        now = time.monotonic()
        if now >= self._baseline_due and self.settings.bundle_dir is not None:
            self._baseline_due = now + BASELINE_EVERY_S
            if getattr(self._reader, "torch", None) is not None:  # CUDA only: a snapshot
                threading.Thread(
                    target=self._refresh_baseline, name="oomcast-baseline", daemon=True
                ).start()

    def _refresh_baseline(self) -> None:
        try:
            torch, i = self._reader.torch, self._reader.index
            self._baseline = (time.time(), site_bytes(torch.cuda.memory._snapshot(i)))
        except Exception:  # a baseline is a nicety: never a reason to fail
            log.debug("oomcast hook: no allocation-site baseline", exc_info=True)

    def _bundle_for_request(self, req: CheckpointRequest) -> None:
        self.bundle_soon(f"checkpoint requested: {req.reason or req.source}", req.id)

    def bundle_soon(self, why: str, request_id: str | None = None) -> threading.Thread | None:
        """Write a bundle from a thread of its own (safe in a signal handler); the thread,
        or None when bundles are off (``bundle_dir`` unset) or the hook is."""
        if self._off or self.settings.bundle_dir is None:
            return None
        t = threading.Thread(
            target=self._bundle_quietly, args=(why, request_id), name="oomcast-bundle", daemon=True
        )
        t.start()
        return t

    def _bundle_quietly(self, why: str, request_id: str | None) -> None:
        try:
            self.write_bundle(why, request_id)
        except Exception:  # a diagnosis must never take the job down
            log.exception("oomcast hook: writing a diagnosis bundle failed")

    def write_bundle(self, why: str, request_id: str | None = None) -> Path | None:
        """Write a bundle now and queue its ``diagnosis_saved`` event; its path."""
        folder = self.settings.bundle_dir
        if self._off or folder is None:
            return None
        with self._bundle_lock:
            samples = list(self._recent)
            allocator, snapshot, processes = self._allocator_state(samples)
            growing: list[dict[str, Any]] = []
            since: float | None = None
            if snapshot is not None and self._baseline is not None:
                at, before = self._baseline
                growing, since = growing_sites(before, site_bytes(snapshot)), time.time() - at
            path = write_bundle(
                folder,
                node=self.node,
                device=self.device,
                job=self.job,
                alert={"why": why, "request_id": request_id},
                samples=[s.to_dict() for s in samples],
                allocator=allocator,
                processes=processes,
                snapshot=snapshot,
                growing=growing,
                growing_since_s=since,
            )
            self.bundles.append(path)
        extra = {"path": str(path), "request_id": request_id, "reason": why}
        self._outbox.put_event(self._event(DIAGNOSIS_SAVED, **extra))
        self._outbox.wake.set()
        log.info("oomcast hook: diagnosis bundle %s (%s)", path, why)
        return path

    def _allocator_state(
        self, samples: list[Sample]
    ) -> tuple[dict[str, Any], dict[str, Any] | None, list[dict[str, Any]]]:
        """The allocator's figures, the CUDA snapshot (None on the host) and the processes."""
        reader = self._reader
        torch = getattr(reader, "torch", None)
        if torch is None:  # host mode: the cgroup's figures from the newest sample
            last = samples[-1] if samples else None
            host: dict[str, Any] = {}
            if last is not None:
                host = {
                    "capacity_bytes": last.total_bytes,
                    "reserved_bytes": last.used_bytes,
                    "allocated_bytes": last.allocated_bytes or last.used_bytes,
                }
            return host, None, []
        i = reader.index
        stats = torch.cuda.memory_stats(i)
        allocator = {
            "capacity_bytes": int(torch.cuda.get_device_properties(i).total_memory),
            "allocated_bytes": int(stats.get("allocated_bytes.all.current", 0)),
            "reserved_bytes": int(stats.get("reserved_bytes.all.current", 0)),
            "peak_reserved_bytes": int(stats.get("reserved_bytes.all.peak", 0)),
            "num_alloc_retries": int(stats.get("num_alloc_retries", 0)),
            "num_ooms": int(stats.get("num_ooms", 0)),
        }
        snapshot = torch.cuda.memory._snapshot(i)
        return allocator, snapshot, _gpu_processes(i)


def _gpu_processes(index: int) -> list[dict[str, Any]]:
    """Every process on the GPU with its memory, from NVML; empty without it."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
        return [{"pid": int(p.pid), "used_bytes": int(p.usedGpuMemory or 0)} for p in procs]
    except Exception:  # an NVML without this call, or no permission: not worth failing for
        return []
