"""Let a job written for CUDA run where the capture runs.

A job's code says ``.cuda()``, ``.to("cuda")`` or ``device="cuda"``. On a CPU-only torch the
capture runs on the CPU (see ``capture.py``), so those moves are mapped to the capture's
device; on a CUDA-built torch, ``cuda`` without an index becomes ``cuda:0`` (fake tensors
need the index). And ``Module.to``/``Module.cuda`` of a model whose tensors are on that device
already return the model unchanged: under ``FakeTensorMode``, ``Module._apply`` swaps every
parameter for its converted copy even when nothing changes, and the swap fails (the fake
parameters carry weak references). A dtype conversion of a fake module (``.half()``,
``.to(torch.bfloat16)``) still fails for that reason: build such a model in its dtype.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode


class DeviceMap(TorchFunctionMode):
    """Maps ``cuda`` device arguments of tensor moves and factories to ``device``."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device

    def _map(self, value: Any) -> Any:
        if isinstance(value, str) and value.split(":")[0] == "cuda":
            return self.device
        if isinstance(value, torch.device) and value.type == "cuda":
            return self.device
        if isinstance(value, int) and not isinstance(value, bool) and self.device.type == "cpu":
            return self.device  # .cuda(0) / .to(0)
        return value

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.cuda:
            return args[0].to(self.device, non_blocking=kwargs.get("non_blocking", False))
        if "device" in kwargs:
            kwargs["device"] = self._map(kwargs["device"])
        if func is torch.Tensor.to and len(args) > 1:
            args = (args[0], self._map(args[1]), *args[2:])
        return func(*args, **kwargs)


def _on(module: nn.Module, device: torch.device) -> bool:
    return all(t.device == device for t in [*module.parameters(), *module.buffers()])


@contextlib.contextmanager
def module_moves_in_place(device: torch.device) -> Iterator[None]:
    """``Module.to(device)``/``.cuda()`` on a model already there: the model itself."""
    orig_to: Callable[..., nn.Module] = nn.Module.to
    orig_cuda: Callable[..., nn.Module] = nn.Module.cuda

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        dev, dtype, _, fmt = torch._C._nn._parse_to(*args, **kwargs)
        target = device if dev is not None and dev.type == "cuda" else dev
        unchanged = dtype is None and fmt is None and (target is None or target == device)
        if unchanged and _on(self, device):
            return self
        return orig_to(self, *args, **kwargs)

    def cuda(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        if _on(self, device):
            return self
        return orig_to(self, device)

    nn.Module.to = to  # type: ignore[method-assign,assignment]
    nn.Module.cuda = cuda  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        nn.Module.to = orig_to  # type: ignore[method-assign,assignment]
        nn.Module.cuda = orig_cuda  # type: ignore[method-assign,assignment]
