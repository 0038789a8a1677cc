"""Ready-made callbacks that put a :class:`~oomcast.collectors.hook.MemoryHook` into the
training loops of PyTorch Lightning and Hugging Face ``transformers``.

Neither library is needed to import this module. The Hugging Face callback is duck-typed
(the ``Trainer`` calls callbacks by method name); the Lightning one must subclass
Lightning's ``Callback``, so that class is made on first use by
:func:`lightning_callback_class`, which imports ``lightning`` (or ``pytorch_lightning``).

Hugging Face::

    trainer = Trainer(..., callbacks=[OomcastTrainerCallback(job="bert-ft-42")])

Lightning::

    trainer = L.Trainer(..., callbacks=[OomcastLightningCallback(job="bert-ft-42")])

Either takes a hook of its own making (``hook=``) or the arguments of ``MemoryHook`` to
make one, which it then closes when training ends. A requested checkpoint is saved by the
framework (Lightning: ``trainer.save_checkpoint``; Hugging Face: ``control.should_save``)
and reported with ``hook.checkpoint_done``.

**Several ranks.** Each rank has its own hook, and a request does not reach them together:
a signal may be sent to one rank only, and each rank reads a control-stream command at its
own step. The save, though, needs every rank (Lightning's ``save_checkpoint`` waits at a
barrier, and so does the Trainer's save path), so one rank saving alone would hang the job.
The callbacks therefore agree at every step, when training is distributed, whether any rank
has a request (Lightning: ``trainer.strategy.reduce_boolean_decision(requested, all=False)``;
Hugging Face: an all-reduce MAX of a 0/1 tensor over ``torch.distributed``'s default group),
and then every rank saves. Only the flag travels, not the request id: each rank answers its
own pending requests with ``checkpoint_done`` (or ``checkpoint_failed``), and a rank with
none saves without reporting anything. A signal to rank 0 is answered by rank 0 alone; a
control command, read by every rank, is answered by each (one ``checkpoint_done`` per rank,
all with the command's id), and when the ranks read it at different steps each such step
saves (the later ranks' requests are still pending at the first save). Training in one
process makes no ``torch.distributed`` call. The agreement costs a collective per step (and,
on GPUs, waiting for the step's kernels to finish).

**The schedule.** At the start of training each callback tells the hook when eval and
checkpoints come (:mod:`oomcast.collectors.hook_phases`): Hugging Face from
``TrainingArguments`` (``eval_steps`` with ``eval_strategy="steps"``, ``save_steps`` with
``save_strategy="steps"``; a ratio below 1 is of ``max_steps``); Lightning from the trainer
(``val_check_batch``, the batches between validations that ``val_check_interval`` works
out to, divided by ``accumulate_grad_batches``; the smallest ``every_n_train_steps`` of its
``ModelCheckpoint`` callbacks). Periods the hook already has (``hook.set_schedule``) are
kept. Samples carry ``trainer.global_step`` / ``state.global_step``, and the phases are
marked: Hugging Face reports only the end of an eval (``on_evaluate``) and a save
(``on_save``), so each is measured from the sample before it; Lightning's validation runs
between ``on_validation_start`` and ``on_validation_end``, and the callback's own requested
saves are a ``checkpoint`` phase. ``phase_extra_bytes=`` gives the phases' figures before
they are measured.

On SLURM, Lightning only installs its auto-requeue handler for SIGUSR1 when no handler is
there yet: give the hook another signal (``checkpoint_signal=signal.SIGUSR2``) or none.
"""

from __future__ import annotations

import inspect
import logging
import math
import os
import sys
from collections.abc import Mapping
from typing import Any

from oomcast.collectors.hook import MemoryHook
from oomcast.model.frameworks import HFCallback, lightning_class

log = logging.getLogger(__name__)


def any_rank(flag: bool) -> bool:
    """Whether ``flag`` is true on any rank of ``torch.distributed``'s default group (an
    all-reduce MAX of a 0/1 tensor, on the current CUDA device when the backend is NCCL, else
    on the CPU); every rank must call it at the same point. Without a process group of more
    than one rank (or without torch loaded) it is ``flag``, and no collective is made."""
    torch = sys.modules.get("torch")
    dist = getattr(torch, "distributed", None) if torch is not None else None
    if torch is None or dist is None or not dist.is_available() or not dist.is_initialized():
        return flag
    if dist.get_world_size() <= 1:
        return flag
    t = torch.tensor([1 if flag else 0], dtype=torch.int32, device=reduce_device(torch, dist))
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def reduce_device(torch: Any, dist: Any) -> Any:
    """Where a tensor for a collective on the default group lives: NCCL only takes CUDA
    tensors (the rank's current device), Gloo and the rest take CPU ones."""
    if str(dist.get_backend()).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _is_steps(strategy: Any) -> bool:
    return bool(getattr(strategy, "value", strategy) == "steps")


def _absolute_steps(steps: Any, max_steps: Any) -> int | None:
    """A Hugging Face step setting as steps: a ratio below 1 is of ``max_steps``."""
    if isinstance(steps, bool) or not isinstance(steps, int | float) or steps <= 0:
        return None
    if steps < 1:
        if not isinstance(max_steps, int) or max_steps <= 0:
            return None
        return max(1, math.ceil(steps * max_steps))
    return int(steps)


def hf_schedule(args: Any, state: Any) -> dict[str, int]:
    """``eval_every_steps`` / ``checkpoint_every_steps`` from Hugging Face
    ``TrainingArguments`` (and the ``TrainerState``'s ``max_steps``, for ratios); only what
    the arguments say."""
    out: dict[str, int] = {}
    max_steps = getattr(state, "max_steps", None)
    strategy = getattr(args, "eval_strategy", getattr(args, "evaluation_strategy", None))
    if _is_steps(strategy):
        raw = getattr(args, "eval_steps", None)
        eval_steps = _absolute_steps(
            raw if raw is not None else getattr(args, "logging_steps", None), max_steps
        )
        if eval_steps is not None:
            out["eval_every_steps"] = eval_steps
    if _is_steps(getattr(args, "save_strategy", None)):
        save_steps = _absolute_steps(getattr(args, "save_steps", None), max_steps)
        if save_steps is not None:
            out["checkpoint_every_steps"] = save_steps
    return out


def lightning_schedule(trainer: Any) -> dict[str, int]:
    """``eval_every_steps`` / ``checkpoint_every_steps`` from a Lightning trainer that has
    started fitting (``val_check_batch`` is known then)."""
    out: dict[str, int] = {}
    accumulate = getattr(trainer, "accumulate_grad_batches", 1)
    accumulate = accumulate if isinstance(accumulate, int) and accumulate > 0 else 1
    batches = getattr(trainer, "val_check_batch", None)  # float("inf"): never within fit
    if getattr(trainer, "enable_validation", True) and type(batches) is int and batches > 0:
        out["eval_every_steps"] = max(1, batches // accumulate)
    every = [getattr(cb, "_every_n_train_steps", 0) for cb in _checkpoint_callbacks(trainer)]
    every = [n for n in every if type(n) is int and n > 0]
    if every:
        out["checkpoint_every_steps"] = min(every)
    return out


def _checkpoint_callbacks(trainer: Any) -> list[Any]:
    found = getattr(trainer, "checkpoint_callbacks", None)
    return list(found) if isinstance(found, list | tuple) else []


def announce_schedule(
    hook: MemoryHook, found: Mapping[str, int], phase_extra_bytes: Mapping[str, int] | None
) -> None:
    """Tell the hook what the framework says, keeping periods it already has; nothing when
    there is nothing to say."""
    wanted = {k: v for k, v in found.items() if k not in hook.schedule}
    if wanted or phase_extra_bytes:
        hook.set_schedule(**wanted, phase_extra_bytes=phase_extra_bytes)


class OomcastTrainerCallback(HFCallback):
    """A Hugging Face ``TrainerCallback``: samples at every optimizer step (with the global
    step), tells the hook the job's schedule and marks its evals and saves (see the module
    docstring), saves when a checkpoint is requested on any rank (``control.should_save``
    on every rank) and reports the save once done, on each rank that had a request. Events
    it does not use are accepted and ignored, whatever ``transformers`` adds."""

    def __init__(
        self,
        hook: MemoryHook | None = None,
        *,
        phase_extra_bytes: Mapping[str, int] | None = None,
        **hook_kwargs: Any,
    ) -> None:
        self._owns_hook = hook is None
        self.hook = hook if hook is not None else MemoryHook(**hook_kwargs)
        self.phase_extra_bytes = phase_extra_bytes

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        announce_schedule(self.hook, hf_schedule(args, state), self.phase_extra_bytes)
        return control

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        step = getattr(state, "global_step", None)
        self.hook.step(step if isinstance(step, int) else None)
        # every rank takes part, request or not: all of them must save at the same step
        if any_rank(self.hook.checkpoint_requested):
            control.should_save = True
        return control

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.hook.end_phase("eval")  # its peak covers the eval, since the step's sample
        return control

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        self.hook.end_phase("checkpoint")
        # called after every save, on every rank; any save answers this rank's pending
        # requests, and a rank without one (it saved for another rank's) reports nothing
        if self.hook.checkpoint_requested:
            self.hook.checkpoint_done(hf_checkpoint_dir(args, state))
        return control

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> Any:
        if self._owns_hook:
            self.hook.close()
        return control


def hf_checkpoint_dir(args: Any, state: Any) -> str:
    """Where ``transformers``' Trainer writes the checkpoint of ``state.global_step``."""
    return os.path.join(str(args.output_dir), f"checkpoint-{state.global_step}")


class _LightningLogic:
    """What the Lightning callback does; mixed with Lightning's ``Callback`` on first use."""

    def __init__(
        self,
        hook: MemoryHook | None = None,
        *,
        dirpath: str | os.PathLike[str] | None = None,
        phase_extra_bytes: Mapping[str, int] | None = None,
        **hook_kwargs: Any,
    ) -> None:
        super().__init__()
        self._owns_hook = hook is None
        self.hook = hook if hook is not None else MemoryHook(**hook_kwargs)
        self.dirpath = None if dirpath is None else os.fspath(dirpath)
        self.phase_extra_bytes = phase_extra_bytes

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        announce_schedule(self.hook, lightning_schedule(trainer), self.phase_extra_bytes)

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        self.hook.begin_phase("eval")

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self.hook.end_phase("eval")

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        step = getattr(trainer, "global_step", None)
        self.hook.step(step if isinstance(step, int) else None)
        if self.any_rank_requested(trainer, self.hook.checkpoint_requested):
            self.save_requested_checkpoint(trainer)

    @staticmethod
    def any_rank_requested(trainer: Any, requested: bool) -> bool:
        """Whether any rank has a request, through the strategy's
        ``reduce_boolean_decision`` (a collective: every rank calls it at every batch).
        One process, or a strategy without it: this rank's own ``requested``."""
        world = getattr(trainer, "world_size", None)
        if isinstance(world, int) and world <= 1:
            return requested
        reduce = getattr(getattr(trainer, "strategy", None), "reduce_boolean_decision", None)
        if reduce is None:
            return requested
        try:
            takes_all = "all" in inspect.signature(reduce).parameters
        except (TypeError, ValueError):
            takes_all = True
        if takes_all:
            return bool(reduce(requested, all=False))
        # older releases only decide "on every rank": any rank = not (every rank not)
        return not reduce(not requested)

    def save_requested_checkpoint(self, trainer: Any) -> None:
        """Save (every rank calls this at the same batch) and answer this rank's pending
        requests; a rank that had none saved for another's and reports nothing."""
        path = self.checkpoint_path(trainer)
        try:
            with self.hook.phase("checkpoint"):
                trainer.save_checkpoint(path)
        except Exception:
            # a failed requested save must not end the training it was meant to protect
            log.exception("oomcast: the requested checkpoint %s could not be saved", path)
            if self.hook.checkpoint_requested:
                self.hook.checkpoint_done(path, ok=False)
            return
        if self.hook.checkpoint_requested:
            self.hook.checkpoint_done(path)

    def checkpoint_path(self, trainer: Any) -> str:
        dirpath = self.dirpath
        if dirpath is None:
            dirpath = getattr(getattr(trainer, "checkpoint_callback", None), "dirpath", None)
        if dirpath is None:
            dirpath = os.path.join(str(trainer.default_root_dir), "checkpoints")
        return os.path.join(str(dirpath), f"oomcast-step={trainer.global_step}.ckpt")

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        if self.hook.is_oom(exception):
            self.hook.report_oom(exception)

    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if self._owns_hook:
            self.hook.close()


def lightning_callback_class() -> type:
    """``OomcastLightningCallback``, a subclass of Lightning's ``Callback``, made (once) by
    importing ``lightning`` or else ``pytorch_lightning``."""
    return lightning_class(
        _LightningLogic,
        "OomcastLightningCallback",
        __name__,
        "for a plain training loop call hook.step() yourself",
    )


def OomcastLightningCallback(
    hook: MemoryHook | None = None,
    *,
    dirpath: str | os.PathLike[str] | None = None,
    phase_extra_bytes: Mapping[str, int] | None = None,
    **hook_kwargs: Any,
) -> Any:
    """A Lightning callback: samples after every training batch; when a checkpoint is
    requested (on any rank: see the module docstring), saves one with
    ``trainer.save_checkpoint`` (into ``dirpath``, else the
    ``ModelCheckpoint``'s directory, else ``default_root_dir/checkpoints``) and reports it;
    reports an OOM that ends the fit. Raises ImportError without Lightning."""
    return lightning_callback_class()(
        hook, dirpath=dirpath, phase_extra_bytes=phase_extra_bytes, **hook_kwargs
    )
