"""``preflight(job, gpu=...)``: capture, replay, remedies, in one call."""

from __future__ import annotations

from dataclasses import dataclass

from oomcast.preflight.allocconf import AllocConf
from oomcast.preflight.capture import capture_job, resolve_device
from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES
from oomcast.preflight.job import PreflightJob
from oomcast.preflight.kernels import CudaKernels
from oomcast.preflight.remedies import find_remedies
from oomcast.preflight.replay import Replay
from oomcast.preflight.report import PreflightReport
from oomcast.preflight.target import Target


@dataclass(frozen=True)
class _Checker:
    target: Target
    steps: int
    device: str

    def __call__(
        self, job: PreflightJob, conf: AllocConf, kernels: CudaKernels | None = None
    ) -> Replay:
        # replayed as it runs, so a run that OOMs early ends there
        rep = self.target.replayer(conf)
        capture_job(
            job,
            fake=True,
            device=self.device,
            steps=self.steps,
            listener=rep.listen,
            kernels=kernels or CudaKernels(self.target.capability),
        )
        return rep.result


def preflight(
    job: PreflightJob,
    *,
    gpu: str | None = None,
    capacity_bytes: int | None = None,
    alloc_conf: str | AllocConf | None = None,
    steps: int = 3,
    context_bytes: int = CONTEXT_ALLOWANCE_BYTES,
    remedies: bool = True,
    device: str = "cuda",
) -> PreflightReport:
    """Will ``job`` fit ``gpu`` (or ``capacity_bytes``)? Runs it on fake tensors, no memory.

    ``alloc_conf`` is a ``PYTORCH_CUDA_ALLOC_CONF`` string (or a parsed :class:`AllocConf`).
    ``capacity_bytes`` is the memory the caching allocator may reserve; without it, the
    GPU's total less ``context_bytes``.
    """
    target = Target.resolve(gpu, capacity_bytes, context_bytes, alloc_conf)
    check = _Checker(target, steps, device)
    kernels = CudaKernels(target.capability)
    base = check(job, target.conf, kernels)
    report = target.report(
        job=job.name,
        batch_size=job.batch_size,
        device=resolve_device(device),
        steps=steps,
        replay=base,
    )
    if remedies:
        report.remedies = find_remedies(job, target.conf, check, base)
    if report.device != "cuda" and device.partition(":")[0] == "cuda":
        report.notes[:0] = [
            "captured on CPU kernels (this torch has no CUDA): attention, dropout and the"
            " cuBLAS workspaces allocate as CUDA's kernels do, other CUDA-only workspaces"
            " (cuDNN) are not seen; the optimizer runs its foreach path as it would on CUDA",
            *filter(None, [kernels.note()]),
        ]
    elif report.device != "cuda":
        report.notes.insert(0, "captured on CPU kernels, for a CPU target")
    return report
