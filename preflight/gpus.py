"""The GPUs preflight knows: total memory as NVML reports it, less a CUDA-context allowance.

``total_bytes`` is what ``nvidia-smi --query-gpu=memory.total`` (NVML's
``nvmlDeviceGetMemoryInfo().total``) prints for the board, in MiB times 2**20. The memory a
training process's tensors can use is less: the CUDA context, the kernels' module images,
cuDNN workspaces and NCCL buffers take device memory outside the caching allocator (cuBLAS's
workspaces are taken from it: ``preflight/kernels.py``).
:data:`CONTEXT_ALLOWANCE_BYTES` (768 MiB) is the default allowance subtracted for those; a
bare context is about 300-500 MiB on recent drivers and it grows with the libraries loaded,
so override it (``--context-bytes``) with what ``nvidia-smi`` shows for your job before its
first allocation, or give the capacity outright (``--capacity-bytes``).
"""

from __future__ import annotations

from dataclasses import dataclass

MIB = 1 << 20
CONTEXT_ALLOWANCE_BYTES = 768 * MIB


@dataclass(frozen=True)
class Gpu:
    name: str
    total_bytes: int
    note: str
    capability: tuple[int, int]  # CUDA compute capability: which kernels PyTorch picks


GPUS: dict[str, Gpu] = {
    g.name: g
    for g in (
        Gpu("H200", 143771 * MIB, "H200 SXM 141 GB HBM3e", (9, 0)),
        Gpu("H100-80GB", 81559 * MIB, "H100 SXM/PCIe 80 GB", (9, 0)),
        Gpu("H100-94GB", 95830 * MIB, "H100 NVL 94 GB", (9, 0)),
        Gpu("A100-80GB", 81920 * MIB, "A100 SXM4/PCIe 80 GB", (8, 0)),
        Gpu("A100-40GB", 40960 * MIB, "A100 SXM4/PCIe 40 GB", (8, 0)),
        Gpu("L40S", 46068 * MIB, "L40S 48 GB", (8, 9)),
        Gpu("A10G", 23028 * MIB, "A10G 24 GB (AWS g5)", (8, 6)),
        Gpu("L4", 23034 * MIB, "L4 24 GB", (8, 9)),
        Gpu("RTX4090", 24564 * MIB, "GeForce RTX 4090 24 GB", (8, 9)),
        Gpu("V100-32GB", 32768 * MIB, "V100 SXM2/PCIe 32 GB", (7, 0)),
        Gpu("V100-16GB", 16384 * MIB, "V100 SXM2/PCIe 16 GB", (7, 0)),
        Gpu("T4", 15360 * MIB, "T4 16 GB", (7, 5)),
    )
}


class UnknownGpuError(ValueError):
    """A GPU name the catalogue does not have; the message lists the known ones."""


def lookup_gpu(name: str) -> Gpu:
    for key, gpu in GPUS.items():
        if key.lower() == name.strip().lower():
            return gpu
    raise UnknownGpuError(
        f"unknown GPU {name!r}; known: {', '.join(GPUS)} (or give --capacity-bytes)"
    )


DEFAULT_CAPABILITY = (8, 0)  # where no GPU is named: an A100's kernels


def capability_of(name: str | None) -> tuple[int, int] | None:
    """The compute capability of a catalogued GPU, None for another name or none."""
    if not name:
        return None
    try:
        return lookup_gpu(name).capability
    except UnknownGpuError:
        return None


def capacity_for(
    gpu: str | None,
    capacity_bytes: int | None = None,
    context_bytes: int = CONTEXT_ALLOWANCE_BYTES,
) -> tuple[str, int, int | None]:
    """``(gpu label, capacity for the allocator, total bytes or None)``.

    ``capacity_bytes`` wins over the catalogue (no allowance is subtracted from it).
    """
    if capacity_bytes is not None:
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be positive, not {capacity_bytes}")
        total = lookup_gpu(gpu).total_bytes if gpu else None
        return (gpu or "custom", capacity_bytes, total)
    if not gpu:
        raise ValueError("give a GPU name (gpu=..., --gpu) or capacity_bytes")
    if context_bytes < 0:
        raise ValueError(f"context_bytes must be >= 0, not {context_bytes}")
    found = lookup_gpu(gpu)
    capacity = found.total_bytes - context_bytes
    if capacity <= 0:
        raise ValueError(f"context_bytes {context_bytes} leaves no memory on {found.name}")
    return (found.name, capacity, found.total_bytes)
