"""Run a :class:`PreflightJob` for a few steps and record every allocation and free, by phase.

``capture_job(job, fake=True)`` runs the model, optimizer, batches and steps under
``FakeTensorMode``: tensors carry shapes, dtypes and devices but no data, so a model far
larger than the machine's memory takes none. ``fake=False`` runs the same job on real
tensors under the same tracker (``preflight/tracker.py``); that is the ground truth the
fake capture is measured against, and both account bytes the same way: a storage's
``nbytes``, counted once however many views it has, freed when the storage dies.

The run, in order: the model and optimizer are built (their tensors are ``persistent``),
then train step 0, one eval and one checkpoint after each of the first ``evals`` and
``checkpoints`` steps, then the remaining steps. A train step is ``grad_accum``
micro-batches of forward (batch creation included) and backward, then the optimizer step
and ``zero_grad(set_to_none=True)`` (phase ``optimizer``).

The device. ``device="cuda"`` asks for the GPU's code paths. Fake CUDA tensors need a
CUDA-built torch: on a CPU-only build, autograd's ``InputMetadata`` asks for the CUDA device
guard when it records a fake CUDA tensor and the process aborts (torch 2.13, checked), so
there the job runs on (fake or real) CPU tensors and :attr:`JobCapture.device` says
``cpu``. To keep the one CUDA default that changes memory the most, an optimizer whose
``foreach`` is unset is switched to its ``foreach`` implementation when the target is
``cuda`` (PyTorch's default for CUDA parameters; its temporaries span all parameters at
once). This holds for ``fake=False`` as well, so a fake and a real capture with the same
``device`` run the same code. Given ``kernels``, a CUDA target captured on the CPU also
has its attention, dropout and cuBLAS workspaces allocate as CUDA's kernels do
(``preflight/kernels.py``: what :func:`oomcast.preflight.preflight` asks for); cuDNN's
kernels are not emulated.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from oomcast.preflight.devices import DeviceMap, module_moves_in_place
from oomcast.preflight.job import PreflightJob
from oomcast.preflight.kernels import CudaKernels, cuda_functionals
from oomcast.preflight.tracker import PHASES, Listener, PhaseOp, PhaseTracker, StopCapture

__all__ = [
    "PHASES",
    "TEARDOWN",
    "CaptureError",
    "JobCapture",
    "Listener",
    "PhaseOp",
    "StopCapture",
    "capture_job",
    "resolve_device",
]


TEARDOWN = "teardown"  # the phase of the frees when the run ends (no allocations)


class CaptureError(RuntimeError):
    """The job could not be run under the tracker (the message says where and why)."""


@dataclass
class JobCapture:
    """What one captured run allocated: the persistent storages, then every op in order."""

    job: str
    batch_size: int
    device: str
    fake: bool
    persistent: list[PhaseOp] = field(default_factory=list)
    ops: list[PhaseOp] = field(default_factory=list)  # the frees at the end: phase "teardown"
    complete: bool = True  # False: a listener stopped the run early (see capture_job)

    def persistent_bytes(self) -> int:
        return sum(op.size for op in self.persistent if op.alloc)

    def peak_live_bytes(self, phase: str | None = None, step: int | None = None) -> int:
        """Highest live bytes (persistent included) reached in ``phase`` (None: any) of train
        step ``step`` (None: any)."""
        live = self.persistent_bytes()
        peak = live if phase is None and step is None else 0
        sizes: dict[int, int] = {}
        for op in self.ops:
            if op.alloc:
                sizes[op.sid] = op.size
                live += op.size
                if (phase is None or op.phase == phase) and (step is None or op.step == step):
                    peak = max(peak, live)
            else:
                live -= sizes.pop(op.sid, 0)
        return peak

    def phases(self) -> list[tuple[int, str]]:
        """``(step, phase)`` pairs in the order they first ran."""
        seen: dict[tuple[int, str], None] = {}
        for op in self.ops:
            if op.alloc:
                seen.setdefault((op.step, op.phase), None)
        return list(seen)


def resolve_device(device: str) -> str:
    """The device type tensors can live on here: ``cuda`` needs a CUDA-built torch."""
    kind = device.partition(":")[0]
    if kind not in ("cuda", "cpu"):
        raise ValueError(f"device must be cuda or cpu, not {device!r}")
    if kind == "cuda" and not torch.backends.cuda.is_built():  # type: ignore[no-untyped-call]
        return "cpu"
    return kind


def _to_device(batch: Any, device: torch.device) -> Any:
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


def _on_device(model: nn.Module, device: torch.device) -> nn.Module:
    # built under torch.device(device) already; .to() would swap fake parameters needlessly
    tensors = [*model.parameters(), *model.buffers()]
    if any(t.device != device for t in tensors):
        model = model.to(device)
    return model


def foreach_like_cuda(opt: torch.optim.Optimizer) -> None:
    for group in opt.param_groups:
        if "foreach" in group and group["foreach"] is None and not group.get("fused"):
            group["foreach"] = True


@contextlib.contextmanager
def _fake_mode(fake: bool) -> Iterator[None]:
    if not fake:
        yield
        return
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode(allow_non_fake_inputs=True):
        yield


@dataclass
class _Run:
    job: PreflightJob
    tracker: PhaseTracker
    device: torch.device
    batch_size: int
    model: nn.Module
    optimizer: torch.optim.Optimizer

    def train_step(self, step: int) -> None:
        t = self.tracker
        t.step = step
        accum = self.job.grad_accum
        micro = self.batch_size // accum
        for i in range(accum):
            with t.in_phase("forward"):
                batch = _to_device(self.job.batch(micro, step * accum + i), self.device)
                loss = self.job.loss(self.model, batch)
                if accum > 1:
                    loss = loss / accum
            with t.in_phase("backward"):
                loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
                del loss, batch
        with t.in_phase("optimizer"):
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

    def eval_step(self, step: int) -> None:
        t = self.tracker
        t.step = step
        fn = self.job.eval_step or self.job.loss
        size = self.job.eval_batch_size or self.batch_size
        self.model.eval()
        grad = torch.no_grad() if self.job.eval_no_grad else contextlib.nullcontext()
        try:
            with t.in_phase("eval"), grad:
                batch = _to_device(self.job.batch(size, step), self.device)
                out = fn(self.model, batch)
                del out, batch
        finally:
            self.model.train()

    def checkpoint(self, step: int) -> None:
        mode = self.job.checkpoint
        if mode == "none":
            return
        t = self.tracker
        t.step = step
        tensors = [v for v in self.model.state_dict().values() if isinstance(v, torch.Tensor)]
        for st in self.optimizer.state.values():
            tensors.extend(v for v in st.values() if isinstance(v, torch.Tensor))
        with t.in_phase("checkpoint"), torch.no_grad():
            if mode == "device_copy":
                snapshot = [v.detach().clone() for v in tensors]
            else:  # cpu_copy: host memory, which the device does not see
                with t.host_memory():
                    snapshot = [v.detach().to("cpu", copy=True) for v in tensors]
            del snapshot


def _state_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out: list[torch.Tensor] = []
    for st in opt.state.values():
        out.extend(v for v in tree_flatten(st)[0] if isinstance(v, torch.Tensor))
    return out


def capture_job(
    job: PreflightJob,
    *,
    fake: bool = True,
    device: str = "cuda",
    steps: int = 3,
    evals: int = 1,
    checkpoints: int = 1,
    batch_size: int | None = None,
    listener: Listener | None = None,
    kernels: CudaKernels | None = None,
) -> JobCapture:
    """Run ``job`` for ``steps`` train steps (plus evals and checkpoints) and record it.

    ``batch_size`` overrides the job's (it must stay divisible by ``job.grad_accum``).
    ``listener`` sees each op as it happens (persistent ones first); if it raises
    :class:`StopCapture` the run ends there and the capture has ``complete`` False.
    ``kernels``: for a ``cuda`` target, cuBLAS's workspaces are added, and where the target
    is captured on CPU kernels (this torch has no CUDA) attention and dropout allocate as on
    that GPU too (``preflight/kernels.py``); a CPU target does not use it.
    """
    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    if evals < 0 or checkpoints < 0:
        raise ValueError(f"evals and checkpoints must be >= 0, not {evals} and {checkpoints}")
    size = job.batch_size if batch_size is None else batch_size
    if size < 1 or size % job.grad_accum:
        raise ValueError(
            f"batch_size {size} must be at least 1 and divisible by grad_accum {job.grad_accum}"
        )
    kind = resolve_device(device)
    target = device.partition(":")[0]
    dev = torch.device(kind, 0) if kind == "cuda" else torch.device("cpu")
    tracker = PhaseTracker(kind, listener)
    if kernels is not None and target == "cuda":
        tracker.kernels = kernels  # attention and dropout only where kind is cpu
    result = JobCapture(job=job.name, batch_size=size, device=kind, fake=fake)
    try:
        with (
            _fake_mode(fake),
            torch.device(dev),
            module_moves_in_place(dev),
            DeviceMap(dev),
            cuda_functionals(tracker),
        ):
            model = _on_device(job.model(), dev)
            model.train()
            optimizer = job.optimizer(model.parameters())
            if target == "cuda":
                foreach_like_cuda(optimizer)
            tracker.watch(model)
            result.persistent = tracker.adopt(
                [*model.parameters(), *model.buffers(), *_state_tensors(optimizer)]
            )
            for op in result.persistent:
                tracker.tell(op)
            run = _Run(job, tracker, dev, size, model, optimizer)
            with tracker:
                _run_schedule(run, steps, evals, checkpoints)
                tracker.phase = TEARDOWN  # what dies with the run: not part of any phase
                del run, model, optimizer
            result.ops = tracker.ops
            result.complete = not tracker.stopped  # the job may have caught StopCapture
    except Exception as exc:
        if not tracker.stopped:
            raise _explain(exc, tracker) from exc
        result.ops = tracker.ops
        result.complete = False
    finally:
        tracker.close()
    return result


def _run_schedule(run: _Run, steps: int, evals: int, checkpoints: int) -> None:
    for step in range(steps):
        run.train_step(step)
        if step < evals:
            run.eval_step(step)
        if step < checkpoints:
            run.checkpoint(step)
    for step in range(steps, max(evals, checkpoints)):
        if step < evals:
            run.eval_step(step)
        if step < checkpoints:
            run.checkpoint(step)


def _explain(exc: Exception, tracker: PhaseTracker) -> Exception:
    if isinstance(exc, (CaptureError, ValueError, TypeError)) and not is_fake_error(exc):
        return exc
    phase, step = tracker.failed_in or (tracker.phase, tracker.step)
    where = f"phase {phase} of step {step}"
    if is_fake_error(exc):
        return CaptureError(
            f"the job cannot run on fake tensors ({where}): {type(exc).__name__}: {exc}."
            " An operator that needs the data (.item(), .tolist(), nonzero, a Python `if`"
            " on a tensor) has no value to give; move it out of loss/eval or run with fake=False"
        )
    return CaptureError(f"the job failed in {where}: {type(exc).__name__}: {exc}")


def is_fake_error(exc: Exception) -> bool:
    from torch._subclasses import fake_tensor

    names = ("DataDependentOutputException", "DynamicOutputShapeException")
    return any(isinstance(exc, getattr(fake_tensor, n, ())) for n in names) or (
        "data-dependent" in str(exc).lower()
    )
