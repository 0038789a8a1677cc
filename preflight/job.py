"""What preflight needs to know of a training job: how to build its model and optimizer,
how to make a batch of a given size, and what one train step, one eval step and one
checkpoint do. Everything here is called with fake tensors active, so a model far larger
than the machine's memory can be described and checked."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn

CheckpointMode = Literal["device_copy", "cpu_copy", "none"]


def _adam(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.Adam(params, lr=1e-3)


@dataclass
class PreflightJob:
    """A training job as preflight runs it.

    ``model()`` builds the network; ``batch(batch_size, step)`` makes one batch (any
    structure of tensors); ``loss(model, batch)`` runs the forward pass and returns the
    scalar loss (preflight calls ``backward`` and the optimizer itself). ``eval_step``
    defaults to ``loss`` run in eval mode; ``eval_no_grad`` says whether the job's eval
    runs under ``torch.no_grad()`` (a common OOM when it does not). ``checkpoint`` says
    where the job's checkpoint copies the weights and optimizer state: ``device_copy``
    (clones on the GPU, the costly kind), ``cpu_copy`` (copies to host memory, no device
    memory) or ``none``. ``grad_accum`` splits each step's batch into that many
    micro-batches of ``batch_size // grad_accum``.
    """

    name: str
    model: Callable[[], nn.Module]
    batch: Callable[[int, int], Any]
    loss: Callable[[nn.Module, Any], torch.Tensor]
    batch_size: int
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] = _adam
    eval_step: Callable[[nn.Module, Any], Any] | None = None
    eval_batch_size: int | None = None
    eval_no_grad: bool = True
    checkpoint: CheckpointMode = "device_copy"
    grad_accum: int = 1

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ValueError(f"batch_size must be at least 1, not {self.batch_size}")
        if self.grad_accum < 1 or self.batch_size % self.grad_accum:
            raise ValueError(
                f"grad_accum must divide batch_size: {self.grad_accum} does not divide"
                f" {self.batch_size}"
            )
        if self.eval_batch_size is not None and self.eval_batch_size < 1:
            raise ValueError(f"eval_batch_size must be at least 1, not {self.eval_batch_size}")
        if self.checkpoint not in ("device_copy", "cpu_copy", "none"):
            raise ValueError(
                f"checkpoint must be device_copy, cpu_copy or none, not {self.checkpoint!r}"
            )
