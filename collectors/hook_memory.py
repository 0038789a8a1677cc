"""What the in-process hook reads at each step: the figures of one memory domain.

* :class:`CudaReader`: the caching allocator's figures for one GPU (``torch.cuda.memory_stats``:
  allocated, reserved, ``num_alloc_retries``, ``num_ooms``), the device's total and free
  memory (``torch.cuda.mem_get_info``; used = total - free, so other processes count), and
  the step's peak: the allocator's peak reserved since the previous sample (the figure
  ``torch.cuda.max_memory_reserved`` returns, then ``reset_peak_memory_stats``), added on
  top of the current use, so it is on the same scale as ``used_bytes``. The allocated peak
  since the previous sample (``allocated_bytes.all.peak``, reset by the same call) is kept
  on the reader, :attr:`CudaReader.allocated_peak_bytes`, for the hook's phase measure in
  allocation terms (docs/phases.md); it is not a sample field.
  The device is named by its UUID as NVML writes it (``GPU-xxxxxxxx-...``), else
  ``cuda{i}``; never ``gpu{i}``, the node agent's NVML name for the whole GPU.
  A process capped by ``torch.cuda.set_per_process_memory_fraction(f)`` runs out when its
  allocator's reservation would pass ``f x total``, long before the device is full: the
  sample's total is then that allowance and its used is ``max(reserved, allowance - free)``
  (the reservation, or less room where other processes leave the device fuller), so the
  sample's headroom is the tighter of the two limits. NVML cannot see the cap: the node
  agent's view of the same GPU stays the whole device. A fraction of 0 (torch then refuses
  every allocation: the job cannot run) is read as no cap.
* :class:`HostReader` (no CUDA): this process's resident memory (``proc:{pid}``, through
  :class:`~oomcast.collectors.procinfo.SelfMemory`) against its memory cgroup's limit
  (:func:`memory_limit_bytes`), or MemTotal when it has none. The peak is the kernel's
  VmHWM (at least the current RSS), reset through ``/proc/self/clear_refs`` at most once
  per ``peak_reset_s`` (default 1 s), right after a sample has read it: the reset takes the
  process's mmap lock, so doing it at every step would make ``step()`` wait behind other
  threads' page faults (DataLoader workers' threads, pinned memory) and stall them. A
  sample's peak therefore covers at least the time since the previous sample, and at most
  the time since the last reset (up to ``peak_reset_s`` before it); no peak between resets
  is lost, since the sample that triggers a reset has read VmHWM first. Where the kernel
  refuses the reset the peak is left out.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from oomcast.collectors.procinfo import PROC, SelfMemory, meminfo_total_bytes, own_cgroup_lines
from oomcast.model.schema import Sample

V1_UNLIMITED = 1 << 62  # cgroup v1 reports "no limit" as ~9.2e18 bytes
HOST_TOTAL_REFRESH_S = 60.0


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


def memory_limit_bytes(
    *,
    proc_cgroup: Path = PROC / "self" / "cgroup",
    cgroup_root: Path = Path("/sys/fs/cgroup"),
    meminfo: Path = PROC / "meminfo",
) -> int | None:
    """What this process may use: the tightest memory cgroup limit on its path (v1
    ``memory.limit_in_bytes``, v2 ``memory.max``; "max" and ~2^63 mean none), at most
    MemTotal; MemTotal when there is no limit; None when neither can be read."""
    limits: list[int] = []
    total = meminfo_total_bytes(meminfo)
    if total:
        limits.append(total)
    for hierarchy, controllers, path in own_cgroup_lines(proc_cgroup):
        if hierarchy == "0" and not controllers:
            for base in (cgroup_root, cgroup_root / "unified"):
                limits.extend(_cgroup_limits(base, path, "memory.max"))
        elif "memory" in controllers:
            limits.extend(_cgroup_limits(cgroup_root / "memory", path, "memory.limit_in_bytes"))
    return min(limits) if limits else None


def is_oom_error(exc: BaseException, mode: str) -> bool:
    """Whether ``exc`` is an out-of-memory error of a hook in ``mode``: torch's
    ``OutOfMemoryError`` (when torch is loaded), and in host mode ``MemoryError`` too."""
    torch = sys.modules.get("torch")
    oom_error = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    if oom_error is not None and isinstance(exc, oom_error):
        return True
    return mode == "host" and isinstance(exc, MemoryError)


def cuda_torch(required: bool) -> Any:
    """torch, when it is installed and sees CUDA; else None, or RuntimeError if ``required``."""
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


class CudaReader:
    """One CUDA device's figures (see the module docstring)."""

    mode = "cuda"

    def __init__(self, torch: Any, device: Any, track_peak: bool) -> None:
        self.torch = torch
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int):
            index = device
        else:
            dev = torch.device(device)
            if dev.type != "cuda":
                raise ValueError(f"device={device!r} is not a CUDA device")
            index = dev.index if dev.index is not None else torch.cuda.current_device()
        self.index = int(index)
        self.device = cuda_device_name(self.index, torch.cuda.get_device_properties(self.index))
        self.track_peak = track_peak
        # the allocator's allocated peak over the span of the last sample read (since the
        # sample before it); None without track_peak or where torch does not report it
        self.allocated_peak_bytes: int | None = None

    def attach_oom_observer(self, on_oom: Callable[[], None]) -> None:
        """Call ``on_oom()`` when the caching allocator is about to raise an OOM on this
        device (in the allocating thread; torch offers no way to detach it)."""
        attach = getattr(self.torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach is None:
            return
        watched = self.index

        def observer(*args: Any) -> None:
            if args and isinstance(args[0], int) and args[0] != watched:
                return
            on_oom()

        attach(observer)

    def read(
        self,
        ts: float,
        node: str,
        job: str | None,
        step: int | None = None,
        phase: str | None = None,
    ) -> tuple[Sample, int | None]:
        """The sample (with the job's ``step`` and ``phase``), and the allocator's count of
        OOMs so far."""
        cuda = self.torch.cuda
        i = self.index
        stats = cuda.memory_stats(i)
        allocated = int(stats.get("allocated_bytes.all.current", 0))
        reserved = int(stats.get("reserved_bytes.all.current", 0))
        retries = int(stats.get("num_alloc_retries", 0))
        ooms = int(stats.get("num_ooms", 0))
        peak_reserved = None
        peak_allocated = None
        if self.track_peak:
            # the figures torch.cuda.max_memory_reserved(i) and max_memory_allocated(i)
            # return, without a second memory_stats call; the reset clears both
            peak_reserved = int(stats.get("reserved_bytes.all.peak", reserved))
            raw = stats.get("allocated_bytes.all.peak")
            peak_allocated = None if raw is None else max(allocated, int(raw))
            cuda.reset_peak_memory_stats(i)
        self.allocated_peak_bytes = peak_allocated
        free, total = cuda.mem_get_info(i)
        used = max(0, total - free)
        allowance = self._allowance(total)
        if allowance is not None:
            # the allocator stops at the allowance; the device's free memory still counts
            # where neighbours leave less than the allowance's own headroom
            total, used = allowance, max(reserved, allowance - free)
        # other processes and the CUDA context do not move within a step: the device's
        # peak is today's use plus how far the allocator's reservation rose above today's
        peak = None if peak_reserved is None else used + max(0, peak_reserved - reserved)
        sample = Sample(
            ts=ts,
            node=node,
            device=self.device,
            kind="gpu",
            total_bytes=total,
            used_bytes=used,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            peak_bytes=peak,
            alloc_retries=retries,
            job=job,
            step=step,
            phase=phase,
        )
        return sample, ooms

    def _allowance(self, total: int) -> int | None:
        """``fraction x total`` when ``set_per_process_memory_fraction`` capped this process
        below the whole device; None when it did not, or torch cannot say."""
        get = getattr(self.torch.cuda, "get_per_process_memory_fraction", None)
        if get is None:  # torch before 2.7 has no getter
            return None
        try:
            fraction = float(get(self.index))
        except Exception:  # a reading that fails is no cap, not a lost sample
            return None
        if not 0.0 < fraction < 1.0:
            return None
        return int(fraction * total)

    def refresh(self) -> None:
        """Nothing to refresh: the device reports its total at every read."""

    def close(self) -> None:
        pass


class HostReader:
    """This process's memory (see the module docstring)."""

    mode = "host"

    def __init__(self, track_peak: bool, peak_reset_s: float) -> None:
        self.memory = SelfMemory(track_peak, peak_reset_s)
        self.device = f"proc:{os.getpid()}"
        self.total_bytes = 0
        self._total_at = 0.0
        self._refresh_total()

    def _refresh_total(self) -> None:
        total = memory_limit_bytes()
        if total is None:
            try:
                total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            except (ValueError, OSError):
                total = 0
        self.total_bytes = total
        self._total_at = time.monotonic()

    def refresh(self) -> None:
        """Read the limit again once ``HOST_TOTAL_REFRESH_S`` have passed (it can change)."""
        if time.monotonic() - self._total_at > HOST_TOTAL_REFRESH_S:
            self._refresh_total()

    def read(
        self,
        ts: float,
        node: str,
        job: str | None,
        step: int | None = None,
        phase: str | None = None,
    ) -> tuple[Sample, int | None]:
        used, peak = self.memory.read()
        sample = Sample(
            ts=ts,
            node=node,
            device=self.device,
            kind="host",
            total_bytes=self.total_bytes,
            used_bytes=used,
            peak_bytes=peak,
            job=job,
            step=step,
            phase=phase,
        )
        return sample, None

    def close(self) -> None:
        self.memory.close()
