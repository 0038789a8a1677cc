"""The one door to NVML: every call the node agent makes to the GPU driver goes through here.

NVML fails in two very different ways, and the agent must treat them differently:

* **Fatal**: the Python binding is missing, ``libnvidia-ml.so.1`` cannot be loaded (no driver,
  or a container started without the NVIDIA runtime), the kernel driver is not loaded, or we
  may not talk to it. Nothing will work until a person fixes the node, so these raise
  :class:`NvmlUnavailable`, whose message names the cause and the fix.
* **Per field**: one query on one GPU is not supported, not permitted, or the GPU fell off
  the bus. The other GPUs, and the other fields, are still worth reporting, so these become
  ``None`` and are counted (:class:`NvmlStats`) for the agent's ``/metrics``.

The binding (``nvidia-ml-py``, imported as ``pynvml``) is injectable so the tests can run a
fake on machines without a GPU. Initialisation is lazy: constructing an :class:`Nvml` never
touches the driver; the first query (or :meth:`Nvml.init`, to fail fast at start-up) does.
"""

from __future__ import annotations

import importlib
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

INSTALL_HINT = (
    "install the collector extra (`pip install 'oomcast[collector]'`, which brings"
    " nvidia-ml-py) in the agent's environment"
)
LIBRARY_HINT = (
    "libnvidia-ml.so.1 could not be loaded: install the NVIDIA driver on the host; in a"
    " container, run it with the NVIDIA Container Toolkit (`--gpus all`, or the nvidia"
    " runtimeClass / device plugin on Kubernetes) or mount libnvidia-ml.so.1 from the host"
    " into the container's library path"
)
DRIVER_HINT = (
    "the NVIDIA kernel driver is not loaded: check `nvidia-smi` and `lsmod | grep nvidia` on"
    " the host (a driver upgrade may need a reboot)"
)
PERMISSION_HINT = (
    "NVML refused access: run the agent as a user that may open /dev/nvidiactl and"
    " /dev/nvidia* (root, or the video group), and in a container expose the GPU devices"
)
MISMATCH_HINT = (
    "the loaded libnvidia-ml does not match the kernel driver (usually a driver upgrade"
    " without a reboot): reboot the node or reload the nvidia kernel modules"
)


class NvmlUnavailable(RuntimeError):
    """NVML cannot be used on this machine at all; ``hint`` says what a person should do."""

    def __init__(self, reason: str, hint: str) -> None:
        super().__init__(f"NVML unavailable: {reason}; {hint}")
        self.reason = reason
        self.hint = hint


@dataclass(frozen=True, slots=True)
class MemoryInfo:
    """One GPU's framebuffer, in bytes. ``reserved`` is what the driver and firmware keep for
    themselves (NVML v2 only; ``None`` from the v1 query, whose ``used`` includes it)."""

    total: int
    free: int
    used: int
    reserved: int | None
    version: int

    @property
    def usable(self) -> int:
        """What processes can allocate: total minus the driver's reserve where NVML says it."""
        if self.reserved is None:
            return self.total
        return self.used + self.free


@dataclass(frozen=True, slots=True)
class ProcessMemory:
    """A compute process on a GPU; ``used_bytes`` is ``None`` where NVML cannot tell (some
    vGPU / MIG / Windows WDDM setups)."""

    pid: int
    used_bytes: int | None


@dataclass(frozen=True, slots=True)
class NvmlFailure:
    """The last per-call failure: which function, which NVML error (``NotSupported``...)."""

    function: str
    error: str
    code: int | None


@dataclass
class NvmlStats:
    """Counters for ``/metrics``: calls made, seconds spent inside NVML, failures."""

    calls: int = 0
    call_seconds: float = 0.0
    errors: int = 0
    calls_by_function: Counter[str] = field(default_factory=Counter)
    errors_by_call: Counter[tuple[str, str]] = field(default_factory=Counter)  # (function, error)

    @property
    def errors_by_function(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (function, _), n in self.errors_by_call.items():
            out[function] += n
        return out

    @property
    def errors_by_error(self) -> Counter[str]:
        out: Counter[str] = Counter()
        for (_, error), n in self.errors_by_call.items():
            out[error] += n
        return out


@dataclass(frozen=True, slots=True)
class _Errors:
    """Exception classes of one binding (an old binding lacks some)."""

    any_call: tuple[type[BaseException], ...]  # what a query may raise: NVMLError, mismatch
    no_v2_memory: tuple[type[BaseException], ...]  # the driver has no v2 memory query
    mismatch: tuple[type[BaseException], ...]  # NVMLLibraryMismatchError, where it exists

    @classmethod
    def of(cls, m: Any) -> _Errors:
        def present(*names: str) -> tuple[type[BaseException], ...]:
            return tuple(c for c in (getattr(m, n, None) for n in names) if c is not None)

        mismatch = present("NVMLLibraryMismatchError")
        return cls(
            any_call=(m.NVMLError, *mismatch),
            no_v2_memory=present(
                "NVMLError_NotSupported",
                "NVMLError_FunctionNotFound",
                "NVMLError_ArgumentVersionMismatch",
            ),
            mismatch=mismatch,
        )


def _error_name(exc: BaseException) -> str:
    return type(exc).__name__.removeprefix("NVMLError_")


class Nvml:
    """Lazily initialised, counting wrapper of the ``pynvml`` module (or a fake of it)."""

    def __init__(
        self,
        module: ModuleType | Any | None = None,
        *,
        timer: Callable[[], float] = time.perf_counter,
    ) -> None:
        self._module: Any = module
        self._timer = timer
        self._lock = threading.Lock()
        self._initialized = False
        self.stats = NvmlStats()
        self.last_error: NvmlFailure | None = None
        self._v2_memory = True  # until the driver or the binding says otherwise
        self._processes_fn = "nvmlDeviceGetComputeRunningProcesses"
        self._errors: _Errors | None = None  # the binding's exception classes, looked up once

    # -- lifecycle -------------------------------------------------------------------------

    @property
    def initialized(self) -> bool:
        return self._initialized

    @property
    def module(self) -> Any:
        """The binding; imports ``pynvml`` on first use when none was given."""
        if self._module is None:
            try:
                self._module = importlib.import_module("pynvml")
            except ImportError as exc:
                raise NvmlUnavailable(
                    f"the pynvml module cannot be imported ({exc})", INSTALL_HINT
                ) from exc
        return self._module

    def init(self) -> None:
        """Initialise NVML now if it is not yet; raises :class:`NvmlUnavailable` if it cannot."""
        if self._initialized:
            return
        with self._lock:
            if self._initialized:
                return
            m = self.module
            start = self._timer()
            try:
                m.nvmlInit()
            except m.NVMLError as exc:
                raise self._fatal(exc) from exc
            finally:
                self._account("nvmlInit", start)
            self._initialized = True
            log.debug("NVML initialised")

    def close(self) -> None:
        """Shut NVML down (handles obtained before become invalid); the next query re-inits."""
        with self._lock:
            if not self._initialized:
                return
            self._initialized = False
            m = self.module
            start = self._timer()
            try:
                m.nvmlShutdown()
            except m.NVMLError as exc:
                self._record_error("nvmlShutdown", exc)
                log.warning("nvmlShutdown failed: %s", exc)
            finally:
                self._account("nvmlShutdown", start)

    def __enter__(self) -> Nvml:
        self.init()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fatal(self, exc: Exception) -> NvmlUnavailable:
        m = self.module
        desc = f"nvmlInit failed with {_error_name(exc)} ({exc})"
        for cls_name, hint in (
            ("NVMLError_LibraryNotFound", LIBRARY_HINT),
            ("NVMLError_DriverNotLoaded", DRIVER_HINT),
            ("NVMLError_NoPermission", PERMISSION_HINT),
            ("NVMLError_LibRmVersionMismatch", MISMATCH_HINT),
        ):
            cls = getattr(m, cls_name, None)
            if cls is not None and isinstance(exc, cls):
                return NvmlUnavailable(desc, hint)
        return NvmlUnavailable(desc, "check `nvidia-smi` on this node")

    # -- the calling convention ------------------------------------------------------------

    @property
    def _err(self) -> _Errors:
        """The exception classes the calls catch, looked up on the binding once rather than
        at every query (the agent makes two or three per GPU per tick)."""
        if self._errors is None:
            self._errors = _Errors.of(self.module)
        return self._errors

    def _account(self, function: str, start: float) -> None:
        self.stats.calls += 1
        self.stats.calls_by_function[function] += 1
        self.stats.call_seconds += self._timer() - start

    def _record_error(self, function: str, exc: BaseException) -> None:
        name = _error_name(exc)
        self.stats.errors += 1
        self.stats.errors_by_call[(function, name)] += 1
        self.last_error = NvmlFailure(function, name, getattr(exc, "value", None))

    def _raw(self, function: str, *args: Any, **kwargs: Any) -> Any:
        """Call ``function`` of the binding, timed and counted; NVML errors propagate. (The
        agent makes two or three of these per GPU per tick: ``_account`` is inlined.)"""
        if not self._initialized:
            self.init()
        fn = getattr(self._module, function)
        timer = self._timer
        start = timer()
        try:
            return fn(*args, **kwargs)
        finally:
            stats = self.stats
            stats.calls += 1
            stats.calls_by_function[function] += 1
            stats.call_seconds += timer() - start

    def _call(self, function: str, *args: Any, **kwargs: Any) -> Any | None:
        """Call ``function``; an NVML error becomes ``None``, counted in ``stats``."""
        try:
            return self._raw(function, *args, **kwargs)
        except self._err.any_call as exc:
            self._on_error(function, exc)
            return None

    def _on_error(self, function: str, exc: BaseException) -> None:
        self._record_error(function, exc)
        uninit = getattr(self.module, "NVMLError_Uninitialized", None)
        if uninit is not None and isinstance(exc, uninit):
            # Someone shut NVML down under us: initialise again on the next call.
            self._initialized = False
        log.debug("%s failed: %s", function, _error_name(exc))

    def failed_with(self, error: str) -> bool:
        """Whether the most recent failed call failed with ``error`` (``"GpuIsLost"``...)."""
        return self.last_error is not None and self.last_error.error == error

    # -- queries ---------------------------------------------------------------------------

    def device_count(self) -> int | None:
        count = self._call("nvmlDeviceGetCount")
        return None if count is None else int(count)

    def handle(self, index: int) -> Any | None:
        return self._call("nvmlDeviceGetHandleByIndex", index)

    def uuid(self, handle: Any) -> str | None:
        value = self._call("nvmlDeviceGetUUID", handle)
        if isinstance(value, bytes):  # bindings before 11.515 return bytes
            value = value.decode("ascii", "replace")
        return None if value is None else str(value)

    def memory_info(self, handle: Any) -> MemoryInfo | None:
        """Memory of one GPU: the v2 query (which separates the driver's reserve) where the
        driver and the binding have it, else v1; remembered after the first fallback."""
        fn = "nvmlDeviceGetMemoryInfo"
        if self._v2_memory:
            m = self.module
            try:
                mem = self._raw(fn, handle, version=m.nvmlMemory_v2)
            except AttributeError:  # a binding without nvmlMemory_v2
                self._v2_memory = False
            except TypeError:  # a binding whose nvmlDeviceGetMemoryInfo takes no version
                self._v2_memory = False
            except self._err.no_v2_memory as exc:  # looked up only when a call fails
                self._record_error(fn, exc)
                self._v2_memory = False
                log.info("NVML memory info v2 unavailable (%s); using v1", _error_name(exc))
            except m.NVMLError as exc:
                self._on_error(fn, exc)
                return None
            else:
                return MemoryInfo(
                    total=int(mem.total),
                    free=int(mem.free),
                    used=int(mem.used),
                    reserved=int(mem.reserved),
                    version=2,
                )
        mem = self._call(fn, handle)
        if mem is None:
            return None
        return MemoryInfo(
            total=int(mem.total), free=int(mem.free), used=int(mem.used), reserved=None, version=1
        )

    def compute_processes(self, handle: Any) -> list[ProcessMemory] | None:
        """Compute processes on one GPU with their memory, or ``None`` if NVML cannot say."""
        m = self.module
        try:
            procs = self._raw(self._processes_fn, handle)
        except m.NVMLError as exc:
            self._on_error(self._processes_fn, exc)
            return None
        except self._err.mismatch as exc:  # looked up only when a call fails
            # The unversioned call needs a driver with the v3 entry point; an older driver
            # gets the _v2 one (same fields), from then on.
            self._record_error(self._processes_fn, exc)
            older = "nvmlDeviceGetComputeRunningProcesses_v2"
            if self._processes_fn == older or not hasattr(m, older):
                return None
            self._processes_fn = older
            log.info("NVML driver is older than the binding; using %s", older)
            return self.compute_processes(handle)
        out: list[ProcessMemory] = []
        for p in procs:
            used = getattr(p, "usedGpuMemory", None)
            out.append(
                ProcessMemory(pid=int(p.pid), used_bytes=None if used is None else int(used))
            )
        return out
