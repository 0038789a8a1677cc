"""A stand-in for the ``pynvml`` module, for machines without a GPU.

Only the tests and ``oomcast bench agent`` use it (the bench times the agent with eight
fake GPUs on a machine that may have none); the agent itself never imports it.

It has the names :mod:`oomcast.collectors.nvml` uses, spelled as nvidia-ml-py spells them
(functions, ``nvmlMemory_v2``, ``NVMLError`` with ``.value`` and its ``NVMLError_*``
subclasses, ``NVMLLibraryMismatchError``), and behaves as the real one does where it
matters: queries before ``nvmlInit`` raise ``NVMLError_Uninitialized``, init is
reference-counted, the v1 memory query folds the driver's reserve into ``used``. A test
configures GPUs and processes, and injects failures per function and device.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

GIB = 1 << 30
MIB = 1 << 20

NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_NO_PERMISSION = 4
NVML_ERROR_DRIVER_NOT_LOADED = 9
NVML_ERROR_LIBRARY_NOT_FOUND = 12
NVML_ERROR_FUNCTION_NOT_FOUND = 13
NVML_ERROR_GPU_IS_LOST = 15
NVML_ERROR_LIB_RM_VERSION_MISMATCH = 18
NVML_ERROR_ARGUMENT_VERSION_MISMATCH = 25
NVML_ERROR_UNKNOWN = 999

nvmlMemory_v2 = 0x02000028  # the value nvidia-ml-py gives it


class NVMLError(Exception):
    CODE = NVML_ERROR_UNKNOWN

    def __init__(self, value: int | None = None) -> None:
        self.value = type(self).CODE if value is None else value
        super().__init__(self.value)

    def __str__(self) -> str:
        return f"{type(self).__name__.removeprefix('NVMLError_')} (code {self.value})"


AnyNvmlError = NVMLError  # for annotations inside FakeNvml, whose NVMLError is an attribute


class NVMLError_Uninitialized(NVMLError):
    CODE = NVML_ERROR_UNINITIALIZED


class NVMLError_InvalidArgument(NVMLError):
    CODE = NVML_ERROR_INVALID_ARGUMENT


class NVMLError_NotSupported(NVMLError):
    CODE = NVML_ERROR_NOT_SUPPORTED


class NVMLError_NoPermission(NVMLError):
    CODE = NVML_ERROR_NO_PERMISSION


class NVMLError_DriverNotLoaded(NVMLError):
    CODE = NVML_ERROR_DRIVER_NOT_LOADED


class NVMLError_LibraryNotFound(NVMLError):
    CODE = NVML_ERROR_LIBRARY_NOT_FOUND


class NVMLError_FunctionNotFound(NVMLError):
    CODE = NVML_ERROR_FUNCTION_NOT_FOUND


class NVMLError_GpuIsLost(NVMLError):
    CODE = NVML_ERROR_GPU_IS_LOST


class NVMLError_LibRmVersionMismatch(NVMLError):
    CODE = NVML_ERROR_LIB_RM_VERSION_MISMATCH


class NVMLError_ArgumentVersionMismatch(NVMLError):
    CODE = NVML_ERROR_ARGUMENT_VERSION_MISMATCH


class NVMLError_Unknown(NVMLError):
    CODE = NVML_ERROR_UNKNOWN


class NVMLLibraryMismatchError(Exception):
    """What nvidia-ml-py raises when its unversioned call needs an entry point the driver
    lacks (it is not an NVMLError)."""


@dataclass
class FakeGpu:
    total: int = 80 * GIB
    used: int = 0
    reserved: int = 512 * MIB  # driver and firmware
    uuid: str = ""
    processes: list[tuple[int, int | None]] = field(default_factory=list)  # (pid, used bytes)

    @property
    def free(self) -> int:
        return self.total - self.reserved - self.used


@dataclass(frozen=True)
class FakeHandle:
    index: int


@dataclass
class Memory:
    total: int
    free: int
    used: int


@dataclass
class MemoryV2:
    version: int
    total: int
    reserved: int
    free: int
    used: int


@dataclass
class ProcessInfo:
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


MEMORY_V2_MODES = ("ok", "not_supported", "function_not_found", "no_version_kwarg")

# Functions failures can be injected into; a failure for device None hits every device.
FUNCTIONS = (
    "nvmlDeviceGetCount",
    "nvmlDeviceGetHandleByIndex",
    "nvmlDeviceGetUUID",
    "nvmlDeviceGetMemoryInfo",
    "nvmlDeviceGetComputeRunningProcesses",
)


class FakeNvml:
    """Use an instance where the ``pynvml`` module would go: ``Nvml(module=FakeNvml(...))``.

    ``memory_v2``: ``ok``; ``not_supported`` / ``function_not_found`` (a driver without the
    v2 query); ``no_version_kwarg`` (a binding too old to take ``version=``: TypeError).
    ``processes_v3=False``: a driver without the v3 process query (the unversioned call
    raises NVMLLibraryMismatchError, the ``_v2`` call works).
    """

    NVMLError = NVMLError
    NVMLError_Uninitialized = NVMLError_Uninitialized
    NVMLError_InvalidArgument = NVMLError_InvalidArgument
    NVMLError_NotSupported = NVMLError_NotSupported
    NVMLError_NoPermission = NVMLError_NoPermission
    NVMLError_DriverNotLoaded = NVMLError_DriverNotLoaded
    NVMLError_LibraryNotFound = NVMLError_LibraryNotFound
    NVMLError_FunctionNotFound = NVMLError_FunctionNotFound
    NVMLError_GpuIsLost = NVMLError_GpuIsLost
    NVMLError_LibRmVersionMismatch = NVMLError_LibRmVersionMismatch
    NVMLError_ArgumentVersionMismatch = NVMLError_ArgumentVersionMismatch
    NVMLError_Unknown = NVMLError_Unknown
    NVMLLibraryMismatchError = NVMLLibraryMismatchError
    nvmlMemory_v2 = nvmlMemory_v2

    def __init__(
        self,
        gpus: list[FakeGpu] | None = None,
        *,
        memory_v2: str = "ok",
        processes_v3: bool = True,
    ) -> None:
        if memory_v2 not in MEMORY_V2_MODES:
            raise ValueError(f"memory_v2={memory_v2!r}; choose one of {MEMORY_V2_MODES}")
        self.gpus = list(gpus) if gpus is not None else [FakeGpu()]
        for i, gpu in enumerate(self.gpus):
            if not gpu.uuid:
                gpu.uuid = f"GPU-{i:08x}-0000-4000-8000-00000000000{i % 10}"
        self.memory_v2 = memory_v2
        self.processes_v3 = processes_v3
        self.init_error: type[NVMLError] | None = None
        self.refcount = 0
        self.calls: Counter[str] = Counter()
        self.failures: dict[tuple[str, int | None], type[NVMLError]] = {}

    # -- configuration ---------------------------------------------------------------------

    def fail(self, function: str, error: type[AnyNvmlError], device: int | None = None) -> None:
        if function not in FUNCTIONS:
            raise ValueError(f"cannot inject into {function!r}; one of {FUNCTIONS}")
        self.failures[(function, device)] = error

    def heal(self, device: int | None = None) -> None:
        """Remove the failures injected for ``device`` (None: all of them)."""
        if device is None:
            self.failures.clear()
        else:
            self.failures = {k: v for k, v in self.failures.items() if k[1] != device}

    def lose(self, device: int) -> None:
        """The GPU falls off the bus: every query about it raises GpuIsLost."""
        for function in FUNCTIONS[1:]:
            self.fail(function, NVMLError_GpuIsLost, device)

    # -- the module's functions ------------------------------------------------------------

    def _check(self, function: str, device: int | None = None, *, key: str = "") -> None:
        """Count the call; raise what was injected for ``key`` (default: the function)."""
        self.calls[function] += 1
        if self.refcount == 0:
            raise NVMLError_Uninitialized()
        key = key or function
        error = self.failures.get((key, device)) or self.failures.get((key, None))
        if error is not None:
            raise error()

    def _gpu(self, handle: FakeHandle) -> FakeGpu:
        if not isinstance(handle, FakeHandle) or handle.index >= len(self.gpus):
            raise NVMLError_InvalidArgument()
        return self.gpus[handle.index]

    def nvmlInit(self) -> None:
        self.calls["nvmlInit"] += 1
        if self.init_error is not None:
            raise self.init_error()
        self.refcount += 1

    def nvmlShutdown(self) -> None:
        self._check("nvmlShutdown")
        self.refcount -= 1

    def nvmlDeviceGetCount(self) -> int:
        self._check("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeHandle:
        self._check("nvmlDeviceGetHandleByIndex", index)
        if not 0 <= index < len(self.gpus):
            raise NVMLError_InvalidArgument()
        return FakeHandle(index)

    def nvmlDeviceGetUUID(self, handle: FakeHandle) -> str:
        self._check("nvmlDeviceGetUUID", handle.index)
        return self._gpu(handle).uuid

    def nvmlDeviceGetMemoryInfo(
        self, handle: FakeHandle, version: int | None = None
    ) -> Memory | MemoryV2:
        if version is not None and self.memory_v2 == "no_version_kwarg":
            raise TypeError("nvmlDeviceGetMemoryInfo() got an unexpected keyword argument")
        self._check("nvmlDeviceGetMemoryInfo", handle.index)
        gpu = self._gpu(handle)
        if version is None:
            return Memory(total=gpu.total, free=gpu.free, used=gpu.used + gpu.reserved)
        if self.memory_v2 == "not_supported":
            raise NVMLError_NotSupported()
        if self.memory_v2 == "function_not_found":
            raise NVMLError_FunctionNotFound()
        if version != nvmlMemory_v2:
            raise NVMLError_ArgumentVersionMismatch()
        return MemoryV2(
            version=version, total=gpu.total, reserved=gpu.reserved, free=gpu.free, used=gpu.used
        )

    def _processes(self, function: str, handle: FakeHandle) -> list[ProcessInfo]:
        self._check(function, handle.index, key="nvmlDeviceGetComputeRunningProcesses")
        return [ProcessInfo(pid, used) for pid, used in self._gpu(handle).processes]

    def nvmlDeviceGetComputeRunningProcesses(self, handle: FakeHandle) -> list[ProcessInfo]:
        if not self.processes_v3:
            self.calls["nvmlDeviceGetComputeRunningProcesses"] += 1
            raise NVMLLibraryMismatchError("use a versioned function")
        return self._processes("nvmlDeviceGetComputeRunningProcesses", handle)

    def nvmlDeviceGetComputeRunningProcesses_v2(self, handle: FakeHandle) -> list[ProcessInfo]:
        return self._processes("nvmlDeviceGetComputeRunningProcesses_v2", handle)
