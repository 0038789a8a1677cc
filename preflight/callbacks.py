"""Preflight at train start, from inside Hugging Face ``Trainer`` and PyTorch Lightning.

When training begins, each callback preflights the trainer's own model with one batch from
the trainer's own train dataloader, on fake tensors (no real memory: a copy of the model is
made under ``FakeTensorMode``, so its parameters are shapes, not data), against a target
GPU: ``gpu=`` (a name from the catalogue, docs/preflight.md), else ``capacity_bytes=``, else
``$OOMCAST_PREFLIGHT_GPU``, else this machine's first CUDA device. It prints the report (to
stderr) and, when the verdict is OOM, stops the run before its first step by raising
:class:`PreflightOOM` (which carries the report); ``on_oom="warn"`` prints and trains on.

Hugging Face::

    trainer = Trainer(..., callbacks=[PreflightTrainerCallback(gpu="A100-40GB")])

Lightning::

    trainer = L.Trainer(..., callbacks=[PreflightLightningCallback(gpu="A100-40GB")])

What is run, per framework (the rest is :func:`oomcast.preflight.preflight`):

* the **loss**: Hugging Face, the model's output ``loss`` on the batch (``model(**batch)``:
  the Trainer's default; a batch without labels has no loss and is refused); Lightning, the
  module's ``training_step(batch, 0)`` (a tensor, or a dict with ``loss``);
* the **eval**: under ``no_grad``, as both frameworks run it; the module's
  ``validation_step`` for Lightning when it has one; the eval batch is the train batch
  resized to the eval batch size (Hugging Face's ``per_device_eval_batch_size``);
* the **optimizer**: the trainer's, rebuilt over the fake parameters with the same class and
  defaults (parameter groups are not copied: the state an optimizer keeps does not depend
  on them); Adam when the trainer has none yet;
* the **checkpoint**: both frameworks save from host copies, so ``cpu_copy``;
* the **batch size**: the batch's first dimension; the remedies resize that dimension.

Drawing the batch starts a new iterator of the train dataloader: for a shuffled one, that
advances its sampler's random state by one draw. Neither library is needed to import this
module; the Lightning class is made on first use, as in :mod:`oomcast.collectors.integrations`.
"""

from __future__ import annotations

import copy
import inspect
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, Literal

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from oomcast.model.frameworks import HFCallback, lightning_class
from oomcast.preflight.api import preflight
from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES
from oomcast.preflight.job import PreflightJob
from oomcast.preflight.report import PreflightReport
from oomcast.preflight.session import GPU_ENV

OnOom = Literal["stop", "warn"]


class PreflightOOM(RuntimeError):
    """Raised at train start when the preflight's verdict is OOM (``on_oom="stop"``)."""

    def __init__(self, report: PreflightReport) -> None:
        super().__init__(
            f"oomcast preflight: {report.job} would not fit {report.gpu}:"
            f" {report.verdict_text()} (the report is printed above; on_oom='warn' trains"
            " anyway)"
        )
        self.report = report


def batch_size_of(batch: Any) -> int:
    """The first dimension of the batch's first tensor (ValueError when it has none)."""
    for t in tree_flatten(batch)[0]:
        if isinstance(t, torch.Tensor) and t.dim() > 0:
            return int(t.shape[0])
    raise ValueError(f"the batch has no tensor with a batch dimension: {type(batch).__name__}")


def resized_batch(batch: Any, size: int) -> Any:
    """The batch's structure with new tensors (fake ones, under fake mode) whose batch
    dimension is ``size``; tensors without that dimension keep their shape."""
    n = batch_size_of(batch)

    def resize(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        shape = (size, *t.shape[1:]) if t.dim() > 0 and t.shape[0] == n else tuple(t.shape)
        return torch.zeros(shape, dtype=t.dtype)

    return tree_map(resize, batch)


def first_batch(loader: Iterable[Any]) -> Any:
    """One batch from a new iterator of the train dataloader (ValueError when empty)."""
    for batch in loader:
        return batch
    raise ValueError("the train dataloader is empty: there is no batch to preflight")


def _optimizer_factory(
    optimizer: Any,
) -> Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]:
    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate / Lightning wrappers
    if not isinstance(inner, torch.optim.Optimizer):
        return lambda params: torch.optim.Adam(params, lr=1e-3)
    cls = type(inner)
    accepted: Mapping[str, inspect.Parameter]
    try:
        accepted = inspect.signature(cls.__init__).parameters
    except (TypeError, ValueError):
        accepted = {}
    takes_any = any(p.kind is p.VAR_KEYWORD for p in accepted.values())
    # defaults the constructor does not take (AdamW's decoupled_weight_decay) are set by it
    defaults = {k: v for k, v in inner.defaults.items() if takes_any or k in accepted}
    return lambda params: cls(params, **defaults)


def fake_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are new tensors of the same shapes
    and dtypes: fake ones when called under ``FakeTensorMode`` (as preflight calls it), so
    no weights are copied. The structure is ``copy.deepcopy``'s, with each tensor replaced
    up front in its memo (tied weights stay tied); other tensor attributes are copied."""
    memo: dict[int, Any] = {}
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in memo:
            new = torch.empty_like(t)
            if isinstance(t, nn.Parameter):
                new = nn.Parameter(new, requires_grad=t.requires_grad)
            memo[id(t)] = new
    return copy.deepcopy(model, memo)


def module_job(
    model: nn.Module,
    batch: Any,
    *,
    name: str,
    loss: Callable[[nn.Module, Any], torch.Tensor],
    optimizer: Any = None,
    eval_step: Callable[[nn.Module, Any], Any] | None = None,
    eval_batch_size: int | None = None,
) -> PreflightJob:
    """A :class:`PreflightJob` of a model that exists already: preflight runs a
    :func:`fake_copy` of it (the real model is not touched), fed with ``batch`` resized to
    the size asked for."""
    return PreflightJob(
        name=name,
        model=lambda: fake_copy(model),
        batch=lambda size, step: resized_batch(batch, size),
        loss=loss,
        batch_size=batch_size_of(batch),
        optimizer=_optimizer_factory(optimizer),
        eval_step=eval_step,
        eval_batch_size=eval_batch_size,
        eval_no_grad=True,
        checkpoint="cpu_copy",
    )


def _target(gpu: str | None, capacity_bytes: int | None, context_bytes: int) -> dict[str, Any]:
    if gpu is not None or capacity_bytes is not None:
        return {"gpu": gpu, "capacity_bytes": capacity_bytes}
    env = os.environ.get(GPU_ENV)
    if env:
        return {"gpu": env}
    if not torch.cuda.is_available():
        raise ValueError(
            f"the preflight callback needs a GPU to check against: pass gpu=... (or"
            f" capacity_bytes=...), set ${GPU_ENV}, or train on a machine with a CUDA device"
        )
    total = int(torch.cuda.get_device_properties(0).total_memory)
    return {"capacity_bytes": total - context_bytes}


ANNOUNCED_PHASES = ("eval", "checkpoint", "optimizer")


def phase_figures(report: PreflightReport) -> tuple[dict[str, int], dict[str, int]]:
    """What a preflight run tells the in-job hook (docs/phases.md), in allocated bytes: the
    extra of an eval or a checkpoint (its first occurrence's peak above the allocated level
    just before it); for the first optimizer step, the most step 0 needs above the level it
    started from (the loaded weights: the service judges it from the start of the step), and
    its absolute peak (weights, gradients, optimizer state and activations at once). A phase
    the replay never reached (it stopped at an OOM before) has no figure."""
    replay = report.replay
    first: dict[str, int] = {}  # phase -> index into replay.phases of its first occurrence
    for i, p in enumerate(replay.phases):
        if p.phase in ANNOUNCED_PHASES and p.phase not in first:
            first[p.phase] = i
    level_before: dict[int, int] = {}
    prev = 0
    for allocated, _, i in replay.timeline:
        level_before.setdefault(i, prev)
        prev = allocated
    extra: dict[str, int] = {}
    for phase, i in first.items():
        if phase != "optimizer" and i in level_before:
            extra[phase] = max(0, replay.phases[i].peak_allocated_bytes - level_before[i])
    peaks: dict[str, int] = {}
    step0 = [i for i, p in enumerate(replay.phases) if p.step == 0]
    if "optimizer" in first and first["optimizer"] in level_before and step0[0] in level_before:
        peak = max(replay.phases[i].peak_allocated_bytes for i in step0)
        extra["optimizer"] = max(0, peak - level_before[step0[0]])
        peaks["optimizer"] = peak
    return extra, peaks


def announce_to_hooks(report: PreflightReport) -> int:
    """Hand the report's phase figures to every live oomcast hook of this process (the
    framework callbacks' own, or one the user made): the service then forecasts a phase
    that will not fit before it first runs. Returns how many hooks were told."""
    try:
        from oomcast.collectors.hook import live_hooks
    except ImportError:  # the collector extra is not installed: nobody to tell
        return 0
    extra, peaks = phase_figures(report)
    if not extra:
        return 0
    told = 0
    for hook in live_hooks():
        hook.set_phase_extra_bytes(extra, phase_peak_bytes=peaks)
        told += 1
    return told


class _PreflightAtStart:
    """What both callbacks share: the target, the options, the check and the decision."""

    def __init__(
        self,
        gpu: str | None = None,
        *,
        capacity_bytes: int | None = None,
        alloc_conf: str | None = None,
        on_oom: OnOom = "stop",
        steps: int = 3,
        remedies: bool = True,
        context_bytes: int = CONTEXT_ALLOWANCE_BYTES,
        name: str | None = None,
        announce: bool = True,
    ) -> None:
        super().__init__()
        if on_oom not in ("stop", "warn"):
            raise ValueError(f"on_oom must be 'stop' or 'warn', not {on_oom!r}")
        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        self.gpu, self.capacity_bytes, self.context_bytes = gpu, capacity_bytes, context_bytes
        self.alloc_conf = alloc_conf
        self.on_oom, self.steps, self.remedies, self.name = on_oom, steps, remedies, name
        self.announce = announce  # hand the phase figures to the process's oomcast hooks
        self.report: PreflightReport | None = None

    def check(self, make_job: Callable[[], PreflightJob]) -> PreflightReport:
        """Preflight the job ``make_job()`` describes (made once the target GPU is known),
        print the report, and stop (raise :class:`PreflightOOM`) on an OOM verdict."""
        target = _target(self.gpu, self.capacity_bytes, self.context_bytes)
        job = make_job()
        alloc_conf = self.alloc_conf or os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
        report = preflight(
            job,
            **target,
            alloc_conf=alloc_conf,
            steps=self.steps,
            context_bytes=self.context_bytes,
            remedies=self.remedies,
        )
        self.report = report
        print(report.text(), file=sys.stderr, flush=True)
        if self.announce:
            announce_to_hooks(report)
        if not report.fits and self.on_oom == "stop":
            raise PreflightOOM(report)
        return report


def hf_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The Trainer's default loss: the model's ``loss`` output on the batch."""
    out = model(**batch) if isinstance(batch, Mapping) else model(*batch)
    loss = out.get("loss") if isinstance(out, Mapping) else getattr(out, "loss", None)
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "the model returned no loss for the train batch: the preflight callback needs"
            " labels in the batch (the Trainer's default compute_loss); keys:"
            f" {sorted(batch) if isinstance(batch, Mapping) else type(batch).__name__}"
        )
    return loss


class PreflightTrainerCallback(_PreflightAtStart, HFCallback):
    """A Hugging Face ``TrainerCallback`` (duck-typed: the Trainer calls callbacks by method
    name) that preflights the model and one train batch at ``on_train_begin`` and stops an
    OOM before the first step. Arguments: see the module docstring and
    :func:`oomcast.preflight.preflight`."""

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        model, loader = kwargs.get("model"), kwargs.get("train_dataloader")
        if not isinstance(model, nn.Module) or loader is None:
            raise ValueError("the Trainer gave the preflight callback no model or dataloader")
        eval_size = getattr(args, "per_device_eval_batch_size", None)
        self.check(
            lambda: module_job(
                model,
                first_batch(loader),
                name=self.name or type(model).__name__,
                loss=hf_loss,
                optimizer=kwargs.get("optimizer"),
                eval_batch_size=eval_size if isinstance(eval_size, int) else None,
            )
        )
        return control


def lightning_loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """A LightningModule's ``training_step(batch, 0)`` as a loss (on the fake copy, which
    has no trainer: its ``self.log`` calls do nothing, and their warning is not shown)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
        out = module.training_step(batch, 0)  # type: ignore[operator]
    loss = out.get("loss") if isinstance(out, Mapping) else out
    if not isinstance(loss, torch.Tensor):
        raise ValueError(
            "training_step returned no loss (manual optimization?): the preflight callback"
            " needs a tensor, or a dict with 'loss'"
        )
    return loss


def _has_own_validation_step(module: nn.Module) -> bool:
    step = getattr(type(module), "validation_step", None)
    for base in type(module).__mro__:
        if base.__name__ == "LightningModule":
            return step is not getattr(base, "validation_step", None)
    return step is not None


class _LightningPreflight(_PreflightAtStart):
    """What the Lightning callback does; mixed with Lightning's ``Callback`` on first use."""

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        loader = getattr(trainer, "train_dataloader", None)
        if loader is None:
            raise ValueError("the Lightning trainer has no train dataloader to preflight")
        optimizers = getattr(trainer, "optimizers", None) or [None]

        def eval_step(module: nn.Module, b: Any) -> Any:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=r".*self\.log\(\)")
                return module.validation_step(b, 0)  # type: ignore[operator]

        self.check(
            lambda: module_job(
                pl_module,
                first_batch(loader),
                name=self.name or type(pl_module).__name__,
                loss=lightning_loss,
                optimizer=optimizers[0],
                eval_step=eval_step if _has_own_validation_step(pl_module) else None,
            )
        )


def lightning_preflight_class() -> type:
    """``PreflightLightningCallback``'s class, a subclass of Lightning's ``Callback``, made
    once by importing ``lightning`` or else ``pytorch_lightning``."""
    return lightning_class(_LightningPreflight, "PreflightLightningCallback", __name__, "")


def PreflightLightningCallback(gpu: str | None = None, **options: Any) -> Any:
    """A Lightning callback that preflights the module and one train batch at
    ``on_train_start`` and stops an OOM before the first step (options: those of
    :class:`PreflightTrainerCallback`). Raises ImportError without Lightning."""
    return lightning_preflight_class()(gpu, **options)
