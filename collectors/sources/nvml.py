"""GPU memory as the driver sees it, from NVML: one sample per GPU per interval.

NVML knows the framebuffer's use per GPU and per process, but nothing inside PyTorch's
caching allocator, so a sample here carries ``total_bytes`` and ``used_bytes`` only
(allocated, reserved, peak and retries come from the in-process hook). ``total_bytes`` is
what processes can actually get: with the v2 query, ``used + free``, i.e. the total less what
the driver and firmware reserve; with the v1 query, which folds that reserve into ``used``,
the total. Either way ``used / total`` nears 1.0 when the next allocation would fail.

The sample's ``job`` is the job of the process holding the most memory on the GPU, and the
whole per-process table (pid, memory, job, priority) of the latest poll is kept for the
shedding action, which must pick a victim among them.

Failures stay local to one GPU. A GPU whose memory query fails is skipped for that tick
(a zero would read as a job that freed everything). A GPU that fell off the bus
(``GpuIsLost``) yields one ``gpu_lost`` event, is retried every ``retry_lost_s``, and reports
again if a reset brings it back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from oomcast.collectors.nvml import Nvml, ProcessMemory
from oomcast.collectors.procinfo import ProcResolver
from oomcast.model.processes import ProcessUse
from oomcast.model.schema import Event, Record, Sample

log = logging.getLogger(__name__)

DEVICE_NAMINGS = ("index", "uuid")
GPU_LOST_EVENT = "gpu_lost"

# (name, type, help, labels, value): the agent's /metrics takes these from ``metric_samples``
MetricSample = tuple[str, str, str, dict[str, str], float]


@dataclass(frozen=True, slots=True)
class GpuProcess:
    """A compute process on a GPU at the latest poll. ``start_time`` (from /proc) lets an
    action check that the pid still names this process before it signals it."""

    pid: int
    used_bytes: int | None
    job: str
    priority: int
    start_time: int | None


@dataclass
class NvmlSourceStats:
    polls: int = 0
    samples: int = 0
    skipped: int = 0  # GPU-ticks with no sample: a failed query, or a lost GPU not retried yet
    gpus_lost: int = 0  # gpu_lost events emitted
    poll_seconds: float = 0.0  # wall time in poll(), NVML and /proc included
    last_poll_seconds: float = 0.0
    last_poll_samples: int = 0
    last_poll_nvml_seconds: float = 0.0  # of which inside NVML calls

    @property
    def nvml_seconds_per_sample(self) -> float:
        """NVML call time per GPU sample at the latest poll (0 when it produced none)."""
        if not self.last_poll_samples:
            return 0.0
        return self.last_poll_nvml_seconds / self.last_poll_samples


@dataclass(slots=True)
class _Gpu:
    index: int
    handle: Any | None = None
    name: str | None = None
    job: str | None = None
    failing: bool = False
    lost_since: float | None = None
    retry_at: float = 0.0


def main_job(table: Sequence[GpuProcess]) -> str | None:
    """The job of the process with the most memory; where NVML gives no per-process memory,
    the job shared by all processes, or None when they disagree (better no job than a guess)."""
    if len(table) == 1:  # the usual GPU: one job's one process
        return table[0].job
    known = [p for p in table if p.used_bytes is not None]
    if known:
        return max(known, key=lambda p: (p.used_bytes or 0, -p.pid)).job
    jobs = {p.job for p in table}
    return jobs.pop() if len(jobs) == 1 else None


class NvmlSource:
    """The node agent's source of GPU samples (see the module docstring)."""

    def __init__(
        self,
        node: str,
        nvml: Nvml | None = None,
        procinfo: ProcResolver | None = None,
        *,
        interval_s: float = 1.0,
        device_naming: str = "index",
        retry_lost_s: float = 30.0,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        if not node:
            raise ValueError("node must be a non-empty name")
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        if device_naming not in DEVICE_NAMINGS:
            raise ValueError(
                f"device_naming={device_naming!r}; choose one of {', '.join(DEVICE_NAMINGS)}"
            )
        if retry_lost_s < 0:
            raise ValueError(f"retry_lost_s={retry_lost_s} must not be negative")
        self.name = "nvml"
        self.node = node
        self.nvml = nvml if nvml is not None else Nvml()
        self.procinfo = procinfo if procinfo is not None else ProcResolver()
        self.interval_s = interval_s
        self.device_naming = device_naming
        self.retry_lost_s = retry_lost_s
        self.stats = NvmlSourceStats()
        self._timer = timer
        self._next_ts: float | None = None
        self._gpus: dict[int, _Gpu] = {}
        self._tables: dict[str, tuple[GpuProcess, ...]] = {}
        self._count_failing = False

    # -- Source protocol -------------------------------------------------------------------

    def poll(self, now: float) -> list[Record]:
        if self._next_ts is not None and now < self._next_ts:
            return []
        # due on a fixed beat, as the cgroup source is: "now + interval" would drift late by
        # each tick's lateness and skip every few ticks of an agent ticking at this interval
        due = (now if self._next_ts is None else self._next_ts) + self.interval_s
        self._next_ts = due if due > now else now + self.interval_s  # no catch-up burst
        start = self._timer()
        nvml_before = self.nvml.stats.call_seconds
        samples_before = self.stats.samples
        try:
            return self._poll(now)
        finally:
            st = self.stats
            st.last_poll_seconds = self._timer() - start
            st.last_poll_nvml_seconds = self.nvml.stats.call_seconds - nvml_before
            st.last_poll_samples = st.samples - samples_before
            st.polls += 1
            st.poll_seconds += st.last_poll_seconds

    @property
    def exhausted(self) -> bool:
        return False

    # -- what the shedding action reads ----------------------------------------------------

    def devices(self) -> list[str]:
        """The GPUs that reported at the latest poll, by device name."""
        return list(self._tables)

    def processes(self, device: str) -> list[GpuProcess]:
        """The compute processes on ``device`` at the latest poll, most memory first (unknown
        memory last); empty for a GPU that did not report then."""
        return list(self._tables.get(device, ()))

    def measure(self, device: str) -> tuple[int, int] | None:
        """(used, capacity) of ``device`` from a fresh NVML query, measured as its samples
        are (capacity: what processes can get); None for a GPU this source does not know or
        that does not answer now. Called from the control listener's thread."""
        for gpu in list(self._gpus.values()):
            handle = gpu.handle
            if gpu.name != device or handle is None or gpu.lost_since is not None:
                continue
            mem = self.nvml.memory_info(handle)
            if mem is None or mem.usable <= 0:
                return None
            return mem.used, mem.usable
        return None

    def metric_samples(self) -> list[MetricSample]:
        """Figures for the agent's /metrics: NVML calls, time and errors; skipped and lost
        GPUs; processes per GPU."""
        st, ns = self.stats, self.nvml.stats
        out: list[MetricSample] = [
            (
                "oomcast_agent_nvml_gpus",
                "gauge",
                "GPUs reporting at the latest poll.",
                {},
                len(self._tables),
            ),
            (
                "oomcast_agent_nvml_skipped_total",
                "counter",
                "GPU polls that gave no sample (failed query, lost GPU).",
                {},
                st.skipped,
            ),
            (
                "oomcast_agent_nvml_gpus_lost_total",
                "counter",
                "GPUs that fell off the bus (NVML GpuIsLost).",
                {},
                st.gpus_lost,
            ),
            (
                "oomcast_agent_nvml_call_seconds_total",
                "counter",
                "Time spent inside NVML calls.",
                {},
                ns.call_seconds,
            ),
            (
                "oomcast_agent_nvml_seconds_per_sample",
                "gauge",
                "NVML call time per GPU sample at the latest poll.",
                {},
                st.nvml_seconds_per_sample,
            ),
            (
                "oomcast_agent_nvml_poll_seconds",
                "gauge",
                "Duration of the latest NVML poll, /proc lookups included.",
                {},
                st.last_poll_seconds,
            ),
        ]
        for function, n in sorted(ns.calls_by_function.items()):
            out.append(
                (
                    "oomcast_agent_nvml_calls_total",
                    "counter",
                    "NVML calls made.",
                    {"function": function},
                    n,
                )
            )
        for (function, error), n in sorted(ns.errors_by_call.items()):
            out.append(
                (
                    "oomcast_agent_nvml_errors_total",
                    "counter",
                    "NVML calls that failed, by function and NVML error.",
                    {"function": function, "error": error},
                    n,
                )
            )
        for device, table in list(self._tables.items()):  # /metrics runs in another thread
            out.append(
                (
                    "oomcast_agent_nvml_gpu_processes",
                    "gauge",
                    "Compute processes on a GPU at the latest poll.",
                    {"device": device},
                    len(table),
                )
            )
        return out

    def close(self) -> None:
        """Shut NVML down; handles are fetched again if the source is polled afterwards."""
        self.nvml.close()
        for gpu in self._gpus.values():
            gpu.handle = None

    # -- polling ---------------------------------------------------------------------------

    def _poll(self, now: float) -> list[Record]:
        count = self.nvml.device_count()
        if count is None:
            self.stats.skipped += max(1, len(self._gpus))
            self._tables.clear()
            if not self._count_failing:
                log.warning("NVML cannot count the GPUs (%s); no GPU samples", self._why())
            self._count_failing = True
            return []
        if self._count_failing:
            log.info("NVML counts %d GPUs again", count)
            self._count_failing = False
        for index in [i for i in self._gpus if i >= count]:
            gone = self._gpus.pop(index)
            log.warning("GPU index %d (%s) is no longer listed by NVML", index, gone.name)
            if gone.name is not None:
                self._tables.pop(gone.name, None)
        records: list[Record] = []
        for index in range(count):
            gpu = self._gpus.get(index)
            if gpu is None:
                gpu = self._gpus[index] = _Gpu(index)
            records.extend(self._poll_gpu(gpu, now))
        return records

    def _poll_gpu(self, gpu: _Gpu, now: float) -> list[Record]:
        if gpu.lost_since is not None and now < gpu.retry_at:
            self.stats.skipped += 1
            return []
        if gpu.handle is None:
            gpu.handle = self.nvml.handle(gpu.index)
            if gpu.handle is None:
                return self._failed(gpu, now, "get its handle")
        if gpu.name is None:
            if self.device_naming == "index":
                gpu.name = f"gpu{gpu.index}"
            else:
                gpu.name = self.nvml.uuid(gpu.handle)
                if gpu.name is None:
                    return self._failed(gpu, now, "read its UUID")
        mem = self.nvml.memory_info(gpu.handle)
        if mem is None:
            return self._failed(gpu, now, "read its memory")
        if mem.usable <= 0:  # not an NVML error, but nothing a forecast can use
            self.stats.skipped += 1
            self._tables.pop(gpu.name, None)
            if not gpu.failing:
                log.warning("GPU %s on %s reports no usable memory: %s", gpu.name, self.node, mem)
            gpu.failing = True
            return []
        if gpu.lost_since is not None:
            log.warning(
                "GPU %s on %s is back after %.0f s", gpu.name, self.node, now - gpu.lost_since
            )
            gpu.lost_since = None
        if gpu.failing:
            log.info("GPU %s on %s reports again", gpu.name, self.node)
            gpu.failing = False
        procs = self.nvml.compute_processes(gpu.handle)
        table = self._table(procs)
        self._tables[gpu.name] = table
        gpu.job = main_job(table)
        self.stats.samples += 1
        return [
            Sample(
                ts=round(now, 3),
                node=self.node,
                device=gpu.name,
                kind="gpu",
                total_bytes=mem.usable,
                used_bytes=mem.used,
                job=gpu.job,
                # who is on the GPU: the service's evidence of a neighbour (None: unknown)
                processes=None
                if procs is None
                else tuple(ProcessUse(p.pid, p.used_bytes, p.job or None) for p in table),
            )
        ]

    def _table(self, procs: list[ProcessMemory] | None) -> tuple[GpuProcess, ...]:
        if not procs:  # None (the query failed) or no process
            return ()
        table = []
        for p in procs:
            info = self.procinfo.lookup(p.pid)
            table.append(GpuProcess(p.pid, p.used_bytes, info.job, info.priority, info.start_time))
        if len(table) > 1:
            table.sort(key=lambda p: (p.used_bytes is None, -(p.used_bytes or 0), p.pid))
        return tuple(table)

    def _why(self) -> str:
        err = self.nvml.last_error
        return "unknown error" if err is None else f"{err.function}: {err.error}"

    def _failed(self, gpu: _Gpu, now: float, what: str) -> list[Record]:
        """No sample from ``gpu`` this tick, after an NVML call about it just failed; a lost
        GPU also yields its one ``gpu_lost`` event."""
        self.stats.skipped += 1
        label = gpu.name or f"gpu{gpu.index}"
        if gpu.name is not None:
            self._tables.pop(gpu.name, None)
        gpu.handle = None  # start afresh next time: the handle may be what went stale
        if not self.nvml.failed_with("GpuIsLost"):
            if not gpu.failing:
                log.warning(
                    "GPU %s on %s: cannot %s (%s); skipping it until it answers",
                    label,
                    self.node,
                    what,
                    self._why(),
                )
            gpu.failing = True
            return []
        gpu.retry_at = now + self.retry_lost_s
        if self.device_naming == "uuid":
            gpu.name = None  # and may not be the same GPU at this index
        if gpu.lost_since is not None:
            return []
        gpu.lost_since = now
        gpu.failing = True
        self.stats.gpus_lost += 1
        log.error(
            "GPU %s on %s is lost (NVML GpuIsLost: fallen off the bus); retrying every %.0f s."
            " Check `nvidia-smi` and the kernel log for Xid errors",
            label,
            self.node,
            self.retry_lost_s,
        )
        return [
            Event(ts=round(now, 3), node=self.node, device=label, event=GPU_LOST_EVENT, job=gpu.job)
        ]
