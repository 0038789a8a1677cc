"""``preflight(job, gpu=...)``: capture, replay, remedies, in one call."""

from __future__ import annotations

from dataclasses import dataclass

from oomcast.preflight.allocconf import AllocConf, parse_alloc_conf
from oomcast.preflight.capture import capture_job, resolve_device
from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES, capacity_for
from oomcast.preflight.job import PreflightJob
from oomcast.preflight.remedies import find_remedies
from oomcast.preflight.replay import Replay, Replayer
from oomcast.preflight.report import PreflightReport


@dataclass(frozen=True)
class _Checker:
    capacity_bytes: int
    total_bytes: int | None
    steps: int
    device: str

    def __call__(self, job: PreflightJob, conf: AllocConf) -> Replay:
        # replayed as it runs, so a run that OOMs early ends there
        rep = Replayer(self.capacity_bytes, conf, self.total_bytes)
        capture_job(job, fake=True, device=self.device, steps=self.steps, listener=rep.listen)
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
    label, capacity, total = capacity_for(gpu, capacity_bytes, context_bytes)
    conf = alloc_conf if isinstance(alloc_conf, AllocConf) else parse_alloc_conf(alloc_conf)
    check = _Checker(capacity, total, steps, device)
    base = check(job, conf)
    report = PreflightReport(
        job=job.name,
        gpu=label,
        capacity_bytes=capacity,
        total_bytes=total,
        alloc_conf=conf.to_string(),
        batch_size=job.batch_size,
        device=resolve_device(device),
        steps=steps,
        replay=base,
    )
    if remedies:
        report.remedies = find_remedies(job, conf, check, base)
    if report.device != "cuda":
        report.notes.append(
            "captured on CPU kernels (this torch has no CUDA): CUDA-only kernels and"
            " workspaces (cuDNN, cuBLAS, flash attention) are not seen; the optimizer runs"
            " its foreach path as it would on CUDA"
        )
    for key in conf.ignored():
        report.notes.append(f"{key} is accepted but not modelled (see docs/preflight.md)")
    return report
