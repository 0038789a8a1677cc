"""Preflight a training script as it is written: no ``PreflightJob``, no code change.

``trace_script(path, argv, ...)`` runs the script in this process with fake tensors active
from its first line, so nothing it builds takes real memory and no GPU is touched, and
records every allocation on the (emulated) GPU by phase. The phases are inferred from what
the script calls, not declared:

- ``forward``: from the first top-level module call with grad enabled on a module in
  ``train()`` mode, through the loss, until ``backward``; the batch moved to the device
  after an optimizer step counts towards the next step's forward.
- ``backward``: ``Tensor.backward`` / ``torch.autograd.backward`` / ``torch.autograd.grad``
  and what follows them (gradient clipping) until the optimizer step.
- ``optimizer``: ``Optimizer.step`` (PyTorch's global step hooks; the step counter moves on
  after it).
- ``eval``: a top-level module call under ``no_grad``/``inference_mode`` or on a module in
  ``eval()`` mode.
- ``checkpoint``: ``torch.save`` (which writes nothing here) and ``state_dict()`` calls and
  what copies their tensors afterwards.

The run stops by itself (a ``BaseException`` raised from PyTorch's optimizer-step hook or
from ``torch.save``) once ``steps`` optimizer steps, one eval and one checkpoint were seen,
or after ``steps + extra_steps`` optimizer steps when the script evaluates or saves later
than that: the first eval is then run by preflight itself (the model's last top-level
train call again, on new tensors of the same shapes, under ``no_grad`` and ``eval()``), and a
checkpoint the script did not reach is reported as not seen.

Where the GPU is. Emulated, on every build of torch: every tensor is a fake CPU tensor, and
device memory is the storages the script *moved* to the GPU (``.cuda()``, ``.to("cuda")``,
``device="cuda"``, ``Module.to``) and everything computed from them (an operator with a
device input makes device outputs; a factory inside a forward of a moved module does too).
``torch.cuda.is_available()`` answers True and ``get_device_properties`` describes the target
GPU while the script runs, so a script that picks its device with ``"cuda" if
torch.cuda.is_available() else "cpu"`` takes the GPU path. A real GPU, where there is one,
is never touched (no CUDA context is made): fake CUDA tensors would need one, and PyTorch's
module moves swap parameters in place, which fake parameters refuse. A call that is not
emulated and would make a context anyway (``torch.cuda._lazy_init`` wherever torch binds it,
raw allocations, external streams; streams and events themselves are emulated) stops the run
there with
:class:`RealGpuCall`, reported by the script's line; the script can tell it runs under
preflight from ``$OOMCAST_PREFLIGHT`` (``1``).

Values. Fake tensors have none. ``loss.item()``, ``.tolist()``, ``float(t)``, a Python ``if``
on a tensor get a stand-in (False for booleans, 1 for integers, 1.0 for floats) and the
report names each line that asked, once. A ``DataLoader`` runs in the script's process
(``num_workers=0``): its worker processes would have to send fake tensors back.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import runpy
import sys
import sysconfig
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from oomcast.preflight.allocconf import AllocConf
from oomcast.preflight.capture import foreach_like_cuda
from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES, DEFAULT_CAPABILITY
from oomcast.preflight.kernels import CudaKernels, cuda_functionals
from oomcast.preflight.kernels import patched as _patched
from oomcast.preflight.remedies import Remedy, largest_fitting, peak_of
from oomcast.preflight.replay import Replay
from oomcast.preflight.report import PreflightReport
from oomcast.preflight.target import Target
from oomcast.preflight.tracker import Listener, PhaseOp, PhaseTracker, StopCapture
from oomcast.training.allocator import format_size

PREFLIGHT_ENV = "OOMCAST_PREFLIGHT"  # "1" while a script runs under preflight
EXTRA_STEPS = 20  # optimizer steps past ``steps`` to wait for the script's own eval / save
TIME_BUDGET_S = 300.0  # wall-clock limit of one traced run


# Savers bound by name in libraries the script may have imported already (the names are
# patched where they are; torch.save is patched on torch)
_LIGHTNING_CHECKPOINT_MODULES = (
    "lightning.pytorch.callbacks.model_checkpoint",
    "pytorch_lightning.callbacks.model_checkpoint",
)
_SAVERS = (
    ("safetensors.torch", "save_file"),
    ("safetensors.torch", "save_model"),
    ("transformers.modeling_utils", "safe_save_file"),
    ("transformers.trainer", "safe_save_file"),
    ("accelerate.utils.other", "safe_save_file"),  # Accelerator.save_state / save_model
)
# Savers that are methods: Hugging Face's save_pretrained looks for shared storages by
# address before it writes, which fake tensors do not have; here it saves its state dict
# like torch.save (what it puts on the GPU is the state dict's references: nothing).
_METHOD_SAVERS = (("transformers.modeling_utils", "PreTrainedModel", "save_pretrained"),)


class ScriptDone(BaseException):  # a signal, not an error: ``except Exception`` lets it by
    """Raised inside the script when preflight has seen what it needs."""


class ScriptFailed(RuntimeError):
    """The script could not be traced; the message names the line and why."""


class RealGpuCall(BaseException):  # not an Exception: a script's ``except Exception`` lets it by
    """Raised where a call preflight does not emulate was about to start the real GPU
    (``torch.cuda._lazy_init``, which every path to a CUDA context goes through): the run
    stops there, before anything exists on the GPU. ``via`` names the torch function the
    script called, when it was one."""

    def __init__(self, via: str | None) -> None:
        super().__init__(via or "a CUDA call")
        self.via = via


# oomcast's own source: a wheel's ``oomcast/<folder>``, or in an editable install the
# checkout's top-level folders (setup.py's TOP), never the checkout itself, where a virtual
# environment (torch, the libraries) may sit beside them. The example scripts of the
# accuracy bench are scripts like any user's.
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_OURS = tuple(
    os.path.join(_ROOT, folder) + os.sep
    for folder in ("model", "collectors", "service", "training", "preflight", "cli", "bench")
)
_EXAMPLES = os.path.join(_ROOT, "bench", "preflight", "scripts") + os.sep


def _ours(filename: str) -> bool:
    """Whether a frame's file is oomcast's own code (not a script it runs)."""
    return filename.startswith(_OURS) and not filename.startswith(_EXAMPLES)


def _refuse_real_cuda(*args: Any, **kwargs: Any) -> None:
    """``torch.cuda._lazy_init`` while a script is traced: raise :class:`RealGpuCall`."""
    torch_dir = os.path.dirname(torch.__file__)
    via = None
    for frame in reversed(traceback.extract_stack()[:-1]):  # from here outwards
        if frame.filename.startswith(torch_dir):
            rel = os.path.relpath(frame.filename, os.path.dirname(torch_dir))
            mod = rel.removesuffix(".py").removesuffix("/__init__").replace(os.sep, ".")
            via = f"{mod}.{frame.name}"  # the outermost torch frame: what the script called
        elif not _ours(frame.filename):
            break
    raise RealGpuCall(via)


def _refuse(via: str) -> Callable[..., Any]:
    """A function that raises :class:`RealGpuCall` naming ``via``, for a torch call that
    allocates on the device directly."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise RealGpuCall(via)

    return refuse


def _refusing(cls: type) -> type:
    """``cls`` (a CUDA stream or event class) made so that constructing one raises
    :class:`RealGpuCall`; ``isinstance`` against the real class still holds for it."""

    def __new__(kind: type, *args: Any, **kwargs: Any) -> Any:
        raise RealGpuCall(f"torch.cuda.{cls.__name__}")

    return type(cls.__name__, (cls,), {"__new__": __new__, "__module__": cls.__module__})


class _Event:
    """``torch.cuda.Event`` on the emulated GPU: records and waits are no-ops (the trace
    has no time), ``query`` says done, and ``elapsed_time`` is a stand-in value (1.0 ms),
    named in the report like ``loss.item()``'s."""

    _tracker: ScriptTracker  # set on the class made for each traced run

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def record(self, stream: Any = None) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        return None

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        return None

    def elapsed_time(self, end_event: Any) -> float:
        self._tracker.note_stand_in("float")
        return 1.0

    cuda_event = 0

    def ipc_handle(self) -> Any:
        raise RealGpuCall("torch.cuda.Event.ipc_handle")

    @classmethod
    def from_ipc_handle(cls, device: Any, handle: Any) -> Any:
        raise RealGpuCall("torch.cuda.Event.from_ipc_handle")


class _Stream:
    """``torch.cuda.Stream`` (and the current and default streams) on the emulated GPU:
    every wait and sync is a no-op; ``with torch.cuda.stream(s):`` runs its body as is."""

    _tracker: ScriptTracker  # set on the class made for each traced run
    _event: type[_Event]

    device_index, device_type, stream_id, cuda_stream = 0, 1, 0, 0  # as the first GPU's

    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority

    @staticmethod
    def priority_range() -> tuple[int, int]:
        return (0, -1)

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def wait_stream(self, stream: Any) -> None:
        return None

    def wait_event(self, event: Any) -> None:
        return None

    def record_event(self, event: Any = None) -> Any:
        return event if event is not None else self._event()

    def is_capturing(self) -> bool:  # CUDA graph capture: never, on the emulated GPU
        return False

    def __enter__(self) -> _Stream:
        return self

    def __exit__(self, *exc: object) -> None:
        return None


def _on_the_gpu(device: Any) -> bool:
    """Whether a device argument of ``torch.Stream``/``torch.Event`` names the emulated GPU:
    ``"cuda"``, ``"cuda:N"``, a CUDA ``torch.device``, an index or nothing (the current
    accelerator, which is the GPU under preflight)."""
    if device is None or (isinstance(device, int) and not isinstance(device, bool)):
        return True
    if isinstance(device, str):
        return device.split(":")[0] == "cuda"
    return isinstance(device, torch.device) and device.type == "cuda"


def _device_generic(original: type, emulated: type) -> type:
    """``torch.Stream`` or ``torch.Event`` (device-generic, torch 2.5+) under preflight: one
    for the GPU is the emulated class's; one for any other device is torch's own."""

    def __new__(cls: type, device: Any = None, *args: Any, **kwargs: Any) -> Any:
        if _on_the_gpu(device) and not args:
            return emulated(**kwargs)
        return original(device, *args, **kwargs)

    return type(original.__name__, (), {"__new__": __new__, "__module__": original.__module__})


def _pinned(self: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    """``Tensor.pin_memory`` under preflight: page-locked host memory is not GPU memory,
    and pinning would start the real GPU; the tensor is returned as it is."""
    return self


@dataclass
class StandIn:
    """A value-dependent call that got a stand-in value instead of stopping the run."""

    where: str  # file:line
    code: str  # the line's source
    dtype: str
    count: int = 1


@dataclass
class ScriptTrace:
    """What one traced run of a script recorded."""

    script: str
    device: str  # the device type the tensors lived on (cpu on a CPU-only torch)
    ops: list[PhaseOp] = field(default_factory=list)
    steps_done: int = 0
    saw_eval: bool = False
    saw_checkpoint: bool = False
    eval_synthesized: bool = False
    checkpoint_allocated: bool = False  # the checkpoint made copies on the GPU
    stopped_by: str = ""  # why the run ended: done, extra_steps, time, oom, script_ended
    batch_size: int | None = None
    stand_ins: list[StandIn] = field(default_factory=list)
    internal_stand_ins: int = 0  # value reads inside torch itself that got a stand-in
    notes: list[str] = field(default_factory=list)
    elapsed_s: float = 0.0
    # torch.cuda.set_per_process_memory_fraction's, the last the script set (None: never)
    memory_fraction: float | None = None
    compiled: bool = False  # the script called torch.compile / Module.compile


class ScriptTracker(PhaseTracker):  # type: ignore[no-untyped-call]  # torch: unannotated
    """A :class:`PhaseTracker` that knows which CPU storages stand for device memory and
    gives value-dependent calls a stand-in instead of failing."""

    def __init__(self, listener: Listener | None, script: str) -> None:
        super().__init__("cpu", listener)  # device storages are the marked CPU ones
        self.forced = 0  # > 0: every tensor made now is device memory (a move, a factory)
        self.script = script
        self.stand_ins: dict[str, StandIn] = {}
        self.internal_stand_ins = 0
        self.step = 0
        self.phase = "forward"  # until the first step: what the script moves is its batch
        self.started = False  # a module call has run: moved modules are no longer "persistent"
        self.cuda_before = False  # this process had a CUDA context before the script ran
        self.memory_fraction: float | None = None  # set_per_process_memory_fraction's
        self.on_fraction: Callable[[float], None] | None = None

    def set_memory_fraction(self, fraction: Any, device: Any = None) -> None:
        """``torch.cuda.set_per_process_memory_fraction`` on the emulated GPU: checked as
        torch checks it, kept, and passed on (the replay's allocator may reserve that share
        of the device from now on, as the real one may)."""
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        self.memory_fraction = fraction
        if self.on_fraction is not None:
            self.on_fraction(fraction)

    def is_device(self, t: torch.Tensor) -> bool:
        if t.device.type != "cpu" or t.is_sparse:
            return False
        return t.untyped_storage()._cdata in self._live

    def mark(self, t: torch.Tensor, phase: str | None = None) -> None:
        """``t``'s storage is device memory from now on (a module or tensor moved there)."""
        op = self._see(t, phase or self.phase, self.modules.current)
        if op is not None:
            self.ops.append(op)
            self.tell(op)

    def note_stand_in(self, dtype: str) -> None:
        """Count a value read at the line that asked (once per line in the report)."""
        where, code = self._caller()
        if not where:  # asked inside torch (Adam's step count, a mask check): not the script's
            self.internal_stand_ins += 1
            return
        seen = self.stand_ins.get(where)
        if seen is None:
            self.stand_ins[where] = StandIn(where, code, dtype)
        else:
            seen.count += 1

    def _stand_in(self, t: torch.Tensor) -> bool | int | float:
        self.note_stand_in(str(t.dtype).removeprefix("torch."))
        if t.dtype == torch.bool:
            return False
        return 1.0 if (t.dtype.is_floating_point or t.dtype.is_complex) else 1

    def _caller(self) -> tuple[str, str]:
        """The line that asked for a value: the innermost frame outside oomcast, or ("", "")
        when that frame is inside torch itself."""
        theirs = os.path.dirname(torch.__file__)
        machinery = tuple(
            os.path.join(theirs, *part.split("/"))
            for part in ("_compile.py", "_dynamo/", "utils/_python_dispatch.py", "_subclasses/")
        )
        for frame in reversed(traceback.extract_stack()):
            if _ours(frame.filename) or frame.filename.startswith(machinery):
                continue
            if frame.filename.startswith(theirs):
                return "", ""
            line = frame.line or linecache.getline(frame.filename, frame.lineno or 0)
            return f"{frame.filename}:{frame.lineno}", line.strip()
        return "", ""

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return self._stand_in(args[0])
        return super().__torch_dispatch__(func, types, args, kwargs)

    def records(self, args: Any, kwargs: Any) -> bool:
        """Device memory: a move or factory aimed at the GPU, an operator with a device
        input, or a factory inside a moved module's forward."""
        inputs = [a for a in tree_flatten((args, kwargs or {}))[0] if isinstance(a, torch.Tensor)]
        return (
            self.forced > 0
            or any(self.is_device(a) for a in inputs)
            or (not inputs and bool(self.modules.current))
        )


def _is_cuda(value: Any) -> bool:
    if isinstance(value, str):
        return value.split(":")[0] == "cuda"
    if isinstance(value, torch.device):
        return value.type == "cuda"
    return isinstance(value, int) and not isinstance(value, bool)  # .cuda(0) / .to(0)


class _Moves(TorchFunctionMode):
    """Tensor moves and factories aimed at ``cuda`` make device memory (a move copies, as it
    would to a GPU); a device tensor moved back to the CPU is a host copy."""

    def __init__(self, tracker: ScriptTracker) -> None:
        super().__init__()
        self.tracker = tracker

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        t = self.tracker
        if func is torch.Tensor.cuda:
            return self._move(args[0], {})
        if func is torch.Tensor.cpu and t.is_device(args[0]):
            return self._to_host(args[0], {})
        if func is torch.Tensor.to:
            target, rest = _to_target(args[1:], kwargs)
            if target is not None:
                return self._move(args[0], rest)
            if _is_cpu(_device_arg(args[1:], kwargs)) and t.is_device(args[0]):
                return self._to_host(args[0], rest)
            return func(*args, **kwargs)
        if func is torch.nn.functional.linear:
            return _linear(*args, **kwargs)
        if "device" in kwargs and _is_cuda(kwargs["device"]):
            kwargs["device"] = torch.device("cpu")
            t.forced += 1
            try:
                return func(*args, **kwargs)
            finally:
                t.forced -= 1
        return func(*args, **kwargs)

    def _to_host(self, src: torch.Tensor, rest: dict[str, Any]) -> torch.Tensor:
        """A device tensor copied to host memory: a new storage the GPU does not hold."""
        with self.tracker.host_memory():
            out = src.to(**rest) if rest else src
            return (
                out.clone() if out.untyped_storage()._cdata == src.untyped_storage()._cdata else out
            )

    def _move(self, src: torch.Tensor, rest: dict[str, Any]) -> torch.Tensor:
        t = self.tracker
        if t.is_device(src):
            return src.to(**rest) if rest else src
        t.forced += 1
        try:
            out = src.to(**rest) if rest else src
            if out.untyped_storage()._cdata == src.untyped_storage()._cdata:
                out = out.clone()
        finally:
            t.forced -= 1
        return out


def _linear(
    input: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``F.linear`` as PyTorch's own kernel runs it on plain tensors. On an input that is not
    a contiguous 2-D or 3-D tensor (an LSTM's batch-first output, a transposed activation)
    it multiplies and then adds the bias *in place*; under a dispatch mode or on fake tensors
    (tensor-subclass-like) it adds out of place, which holds a second output-sized tensor for
    a moment: +20 MB at the peak of a word-level LM's logits, seen against the allocator."""
    if bias is None or input.dim() < 3 or (input.dim() == 3 and input.is_contiguous()):
        return torch.nn.functional.linear(input, weight, bias)
    return torch.matmul(input, weight.t()).add_(bias)


def _is_cpu(value: Any) -> bool:
    if isinstance(value, str):
        return value.split(":")[0] == "cpu"
    return isinstance(value, torch.device) and value.type == "cpu"


def _device_arg(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The device ``Tensor.to`` was given, if any (a device, a string or an int)."""
    if "device" in kwargs:
        return kwargs["device"]
    for a in args:
        if isinstance(a, (str, torch.device)) or (isinstance(a, int) and not isinstance(a, bool)):
            return a
        if isinstance(a, torch.Tensor):
            return a.device
    return None


def _to_target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``Tensor.to``'s arguments: (the cuda target or None, the rest as keywords)."""
    rest = {k: v for k, v in kwargs.items() if k != "device"}
    target = kwargs.get("device")
    for a in args:
        if isinstance(a, torch.dtype):
            rest["dtype"] = a
        elif isinstance(a, torch.Tensor):
            rest["dtype"] = a.dtype
            if a.device.type == "cuda":
                target = a.device
        elif isinstance(a, bool):
            rest["non_blocking"] = a
        else:
            target = a
    return (target if _is_cuda(target) else None), rest


@dataclass
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype


class _Phases:
    """Infers the phase from what the script calls (module docstring) and stops the run."""

    def __init__(
        self, tracker: ScriptTracker, trace: ScriptTrace, steps: int, extra: int, budget_s: float
    ) -> None:
        self.t = tracker
        self.trace = trace
        self.steps = steps
        self.extra = extra
        self.deadline = time.monotonic() + budget_s
        self.depth = 0
        self.last_call: tuple[nn.Module, Any, Any] | None = None
        self.hooked: set[int] = set()
        self.hf_patched = False
        self.lightning_patched: set[str] = set()
        self.in_step = False  # inside Optimizer.step: a closure's backward returns to it
        self.in_backward = False  # module calls now are a checkpoint's recomputation
        self.saver: Callable[..., None] | None = None
        self.savers_patched: set[tuple[str, str]] = set()
        self.restore: list[Callable[[], None]] = []  # undoes patches made during the run
        self.handles: list[Any] = []  # per-module hooks, removed when the run ends

    # -- module calls ---------------------------------------------------------------------
    def pre(self, module: nn.Module, args: Any) -> None:
        self.depth += 1
        if self.depth != 1 or self.in_backward:
            return
        self.t.started = True
        train = module.training and torch.is_grad_enabled()
        train = train and not torch.is_inference_mode_enabled()
        if not train:
            self._enter("eval")
            self.trace.saw_eval = True
            return
        self._enter("forward")
        # PyTorch's global hooks see positional arguments only; a model called with keywords
        # (Hugging Face's ``model(**batch)``) is heard from its own hook from its 2nd call on
        if id(module) not in self.hooked:
            self.hooked.add(id(module))
            self.handles.append(module.register_forward_pre_hook(self.remember, with_kwargs=True))
            self.remember(module, args, {})

    def remember(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        """The top-level train call's shapes: the batch size, and the eval preflight runs
        itself when the script runs none."""
        if self.depth != 1 or self.t.phase != "forward":
            return
        if self.trace.batch_size is None:
            first = next(
                (a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)),
                None,
            )
            if first is not None and first.dim() > 0:
                self.trace.batch_size = int(first.shape[0])
        if args or kwargs:
            self.last_call = (module, tree_map(_spec, args), tree_map(_spec, kwargs))

    def post(self, module: nn.Module, args: Any, *rest: Any) -> None:
        self.depth -= 1

    # -- the rest of a step -----------------------------------------------------------------
    def _enter(self, phase: str) -> None:
        self.t.phase = phase
        done = self.trace.steps_done
        # an eval or a checkpoint belongs to the step it follows (as in capture_job)
        self.t.step = max(done - 1, 0) if phase in ("eval", "checkpoint") else done

    def train_mode(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def train(module: nn.Module, mode: bool = True) -> Any:
            if not mode and self.depth == 0:
                self._enter("eval")  # model.eval(): what follows (the eval batch) is eval
            return fn(module, mode)

        return train

    def backward(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            # Gradient checkpointing runs module forwards again inside the backward: the
            # reentrant kind through a backward of its own (nested here), the non-reentrant
            # kind stopping them part-way (no forward hook after). Either way they are the
            # backward's, and leave the call depth and the module labels where they were.
            outer = not self.in_backward
            if outer:
                self._enter("backward")
            depth, height = self.depth, self.t.modules.height()
            self.in_backward = True
            try:
                out = fn(*args, **kwargs)
            finally:
                self.depth, self.in_backward = depth, not outer
                self.t.modules.cut(height)
            if outer and self.in_step:  # optimizer.step(closure): the closure is done
                self._enter("optimizer")
            return out

        return wrapped

    def optimizer_pre(self, opt: Any, args: Any, kwargs: Any) -> None:
        self._enter("optimizer")
        self.in_step = True
        # PyTorch picks the foreach implementation for CUDA parameters (its temporaries span
        # all parameters at once); for the CPU tensors here it would not, so ask for it
        foreach_like_cuda(opt)

    def optimizer_post(self, opt: Any, args: Any, kwargs: Any) -> None:
        self.trace.steps_done += 1
        self.t.step = self.trace.steps_done
        self.t.phase = "forward"  # the next batch's move belongs to the next step
        self.in_step = False
        self.patch_savers()
        self._hf_schedule()
        self._lightning_schedule()
        self.maybe_stop()

    def _lightning_schedule(self) -> None:
        """Lightning saves at the end of an epoch (``ModelCheckpoint``) and validates at the
        start (its sanity check) and per ``val_check_interval``. After the ``steps``-th
        optimizer step the trainer saves a checkpoint through its own ``save_checkpoint``
        (what ``ModelCheckpoint`` calls), if it has not saved yet."""
        phases = self
        for name in _LIGHTNING_CHECKPOINT_MODULES:
            mod = sys.modules.get(name)
            cls = getattr(mod, "ModelCheckpoint", None)
            if cls is None or name in self.lightning_patched:
                continue
            self.lightning_patched.add(name)
            orig = cls.on_train_batch_end

            def on_train_batch_end(
                self: Any,
                trainer: Any,
                *args: Any,
                _orig: Any = orig,
                _phases: _Phases = phases,
                **kwargs: Any,
            ) -> None:
                _orig(self, trainer, *args, **kwargs)
                tr = _phases.trace
                if tr.steps_done >= _phases.steps and not tr.saw_checkpoint:
                    with tempfile.TemporaryDirectory(prefix="oomcast-preflight-") as tmp:
                        # torch.save writes nothing here: the file Lightning makes is empty
                        trainer.save_checkpoint(os.path.join(tmp, "preflight.ckpt"))

            cls.on_train_batch_end = on_train_batch_end
            self.restore.append(functools.partial(setattr, cls, "on_train_batch_end", orig))

    def patch_savers(self) -> None:
        """safetensors' savers, where the script's libraries bound them, save like
        ``torch.save`` here: nothing is written. Called again after each optimizer step, for
        libraries imported since."""
        if self.saver is None:
            return
        for mod_name, attr in _SAVERS:
            mod = sys.modules.get(mod_name)
            if mod is None or (mod_name, attr) in self.savers_patched or not hasattr(mod, attr):
                continue
            self.savers_patched.add((mod_name, attr))
            orig = getattr(mod, attr)
            setattr(mod, attr, self.saver)
            self.restore.append(functools.partial(setattr, mod, attr, orig))
        saver = self.saver

        def save_method(model: Any, save_directory: Any, *args: Any, **kwargs: Any) -> None:
            state = kwargs.get("state_dict")
            saver(model.state_dict() if state is None else state, save_directory)

        for mod_name, cls_name, attr in _METHOD_SAVERS:
            cls = getattr(sys.modules.get(mod_name), cls_name, None)
            if cls is None or (mod_name, attr) in self.savers_patched:
                continue
            self.savers_patched.add((mod_name, attr))
            orig = cls.__dict__[attr]
            setattr(cls, attr, save_method)
            self.restore.append(functools.partial(setattr, cls, attr, orig))

    def _hf_schedule(self) -> None:
        """A Hugging Face ``Trainer`` runs its own eval and checkpoint right after the
        ``steps``-th optimizer step (its ``eval_steps``/``save_steps`` may say 500): its
        callback handler's ``on_step_end`` asks for them, as a callback may. Only what the
        run's arguments enable (an ``eval_strategy`` or ``save_strategy`` of "no" stays)."""
        mod = sys.modules.get("transformers.trainer_callback")
        handler = getattr(mod, "CallbackHandler", None)
        if handler is None or self.hf_patched:
            return
        self.hf_patched = True
        orig = handler.on_step_end
        phases = self

        def on_step_end(self: Any, args: Any, state: Any, control: Any) -> Any:
            control = orig(self, args, state, control)
            tr = phases.trace
            if tr.steps_done >= phases.steps:
                if not tr.saw_eval and _strategy(args, "eval_strategy") != "no":
                    control.should_evaluate = True
                if not tr.saw_checkpoint and _strategy(args, "save_strategy") != "no":
                    control.should_save = True
            return control

        handler.on_step_end = on_step_end
        self.restore.append(lambda: setattr(handler, "on_step_end", orig))
        trainer = getattr(sys.modules.get("transformers.trainer"), "Trainer", None)
        if trainer is not None:
            # Its checkpoint copies the model and optimizer state to host memory (nothing on
            # the GPU) and then checks for shared storages by address, which fake tensors do
            # not have: it is seen, and not written.
            orig_save = trainer._save_checkpoint

            def _save_checkpoint(self: Any, *args: Any, **kwargs: Any) -> None:
                phases.checkpoint()
                phases.stop_if_seen()

            trainer._save_checkpoint = _save_checkpoint
            self.restore.append(lambda: setattr(trainer, "_save_checkpoint", orig_save))

    def checkpoint(self) -> None:
        self._enter("checkpoint")
        self.trace.saw_checkpoint = True

    def stop_if_seen(self) -> None:
        """At a checkpoint: stop if the steps and an eval were seen too."""
        if self.trace.steps_done >= self.steps and self.trace.saw_eval:
            self.trace.stopped_by = "done"
            raise ScriptDone

    def maybe_stop(self) -> None:
        tr = self.trace
        if time.monotonic() > self.deadline:
            tr.stopped_by = "time"
            raise ScriptDone
        if tr.steps_done >= self.steps and tr.saw_eval and tr.saw_checkpoint:
            tr.stopped_by = "done"
            raise ScriptDone
        if tr.steps_done >= self.steps + self.extra:
            tr.stopped_by = "extra_steps"
            raise ScriptDone

    def synthesize_eval(self) -> bool:
        """The script's model called once more, as an eval, on new tensors of its last train
        call's shapes. False when there was no train call to repeat."""
        if self.last_call is None:
            return False
        module, args, kwargs = self.last_call
        self._enter("eval")
        was = module.training
        module.eval()
        try:
            with torch.no_grad():
                out = module(*tree_map(self._make, args), **tree_map(self._make, kwargs))
                del out
        finally:
            module.train(was)
        return True

    def _make(self, x: Any) -> Any:
        if not isinstance(x, _Spec):
            return x
        self.t.forced += 1
        try:
            return torch.zeros(x.shape, dtype=x.dtype)
        finally:
            self.t.forced -= 1


def _numpy_stand_in(tracker: ScriptTracker, orig: Callable[..., Any]) -> Callable[..., Any]:
    """``Tensor.numpy()`` of a fake tensor: zeros of its shape and dtype that take no memory
    (a read-only broadcast view), noted like any other value read."""

    def numpy(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

        if not isinstance(self, FakeTensor):
            return orig(self, *args, **kwargs)
        import numpy as np

        tracker.note_stand_in(str(self.dtype).removeprefix("torch."))
        with unset_fake_temporarily():  # a dtype numpy lacks (bfloat16) fails as it would
            dtype = orig(torch.empty((), dtype=self.dtype)).dtype
        return np.broadcast_to(np.zeros((), dtype=dtype), tuple(self.shape))

    return numpy


def _fake_deepcopy(orig: Callable[..., Any]) -> Callable[..., Any]:
    """``copy.deepcopy`` of a fake tensor (a metric's state, an EMA model, a state-dict copy):
    a clone, as the real deepcopy makes; PyTorch's own copies the storage through the CPU,
    which a fake (meta) tensor refuses."""

    def __deepcopy__(self: torch.Tensor, memo: dict[int, Any]) -> Any:
        from torch._subclasses.fake_tensor import is_fake

        if not is_fake(self):
            return orig(self, memo)
        if id(self) in memo:
            return memo[id(self)]
        with torch.no_grad():
            new: torch.Tensor = self.detach().clone()
        if isinstance(self, nn.Parameter):
            new = nn.Parameter(new, requires_grad=self.requires_grad)
        else:
            new.requires_grad_(self.requires_grad)
        memo[id(self)] = new
        return new

    return __deepcopy__


def _strategy(args: Any, name: str) -> str:
    value = getattr(args, name, None)
    if value is None and name == "eval_strategy":  # transformers before 4.41
        value = getattr(args, "evaluation_strategy", "no")
    return str(getattr(value, "value", value)).lower()


def _spec(x: Any) -> Any:
    return _Spec(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x


class _FakeProps:
    def __init__(self, name: str, total: int, capability: tuple[int, int]) -> None:
        self.name = name
        self.total_memory = total
        self.major, self.minor = capability
        self.multi_processor_count = 132
        self.is_integrated = False
        self.is_multi_gpu_board = False

    def __repr__(self) -> str:
        return f"_CudaDeviceProperties(name='{self.name}', total_memory={self.total_memory})"


def _rng_state() -> torch.Tensor:
    """A real (not fake) CUDA generator state stand-in: frameworks save and restore it
    (Lightning's ``isolate_rng``); the real call would make a CUDA context."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        return torch.zeros(16, dtype=torch.uint8)


@contextlib.contextmanager
def _emulated_cuda(
    tracker: ScriptTracker, gpu: str, total: int, capability: tuple[int, int]
) -> Iterator[None]:
    """``torch.cuda`` as a script sees it on the target GPU; the memory figures are the
    traced ones."""
    cuda = torch.cuda

    noop: Callable[..., None] = lambda *a, **k: None  # noqa: E731
    # per run, so that an elapsed_time's stand-in is counted by this run's tracker
    event = type("Event", (_Event,), {"_tracker": tracker})
    stream = type("Stream", (_Stream,), {"_tracker": tracker, "_event": event})
    current = stream()  # the one current (and default) stream: the same object each time
    patches = {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_name": lambda *a, **k: gpu,
        "get_device_properties": lambda *a, **k: _FakeProps(gpu, total, capability),
        "get_device_capability": lambda *a, **k: capability,
        # natively from 8.0; before, torch answers True unless asked without emulation
        "is_bf16_supported": lambda including_emulation=True: (
            bool(including_emulation) or capability >= (8, 0)
        ),
        "mem_get_info": lambda *a, **k: (total, total),
        "set_device": noop,
        "synchronize": noop,
        "empty_cache": noop,
        "manual_seed": noop,
        "manual_seed_all": noop,
        "get_rng_state": lambda *a, **k: _rng_state(),
        "get_rng_state_all": lambda *a, **k: [_rng_state()],
        "set_rng_state": noop,
        "set_rng_state_all": noop,
        "seed": noop,
        "seed_all": noop,
        "initial_seed": lambda: 0,
        # streams and events, for timing and overlap: emulated (nothing to allocate)
        "Event": event,
        "Stream": stream,
        "current_stream": lambda *a, **k: current,
        "default_stream": lambda *a, **k: current,
        "set_stream": noop,
        "stream": lambda stream=None: contextlib.nullcontext(stream),
        "is_current_stream_capturing": lambda: False,
        # every other way to a CUDA context (a custom kernel, a tensor made on the device
        # outside the fake mode, an external stream, a raw allocation) stops the run before
        # it gets one
        "_lazy_init": _refuse_real_cuda,
        # a cap on the process: the replay's allocator honours it (a lower capacity)
        "set_per_process_memory_fraction": tracker.set_memory_fraction,
        "get_per_process_memory_fraction": lambda *a, **k: (
            1.0 if tracker.memory_fraction is None else tracker.memory_fraction
        ),
        "caching_allocator_alloc": _refuse("torch.cuda.caching_allocator_alloc"),
        # the traced bytes as the run goes (a script that logs them sees its own use); the
        # reserved figures need the allocator's replay, which the report has: here they
        # read the same as allocated (a lower bound; reserved - allocated reads 0)
        "memory_allocated": lambda *a, **k: tracker.live_bytes,
        "max_memory_allocated": lambda *a, **k: tracker.peak_bytes,
        "memory_reserved": lambda *a, **k: tracker.live_bytes,
        "max_memory_reserved": lambda *a, **k: tracker.peak_bytes,
        "reset_peak_memory_stats": lambda *a, **k: setattr(
            tracker, "peak_bytes", tracker.live_bytes
        ),
        "memory_stats": lambda *a, **k: _traced_stats(tracker),
        "reset_accumulated_memory_stats": noop,
    }
    if isinstance(getattr(cuda, "ExternalStream", None), type):
        # an external stream wraps a real one, made in C++ without torch.cuda._lazy_init:
        # its constructor stops the run instead
        patches["ExternalStream"] = _refusing(cuda.ExternalStream)
    # torch.accelerator (torch 2.6+), the device-generic spelling that newer scripts and
    # tutorials use (``torch.accelerator.current_accelerator().type if
    # torch.accelerator.is_available() else "cpu"``): the same GPU, the same figures
    accelerator = {
        "is_available": lambda *a, **k: True,
        "device_count": lambda: 1,
        "current_accelerator": lambda *a, **k: torch.device("cuda"),
        "current_device_index": lambda: 0,
        "current_device_idx": lambda: 0,
        "set_device_index": noop,
        "set_device_idx": noop,
        "device_index": lambda *a, **k: contextlib.nullcontext(),
        # what torch.accelerator reports: the dtypes the device can hold
        "get_device_capability": lambda *a, **k: {"supported_dtypes": _GPU_DTYPES},
        "current_stream": lambda *a, **k: current,
        "set_stream": noop,
        "synchronize": noop,
        "empty_cache": noop,
        "empty_host_cache": noop,
        "reset_accumulated_memory_stats": noop,
        "get_memory_info": lambda *a, **k: (total, total),
        **{k: patches[k] for k in _TRACED_FIGURES},
    }
    with contextlib.ExitStack() as stack:
        _patch_everywhere(stack, "torch.cuda", patches)
        _patch_everywhere(stack, "torch.accelerator", accelerator)
        for generic, emulated in (("Stream", stream), ("Event", event)):
            if isinstance(getattr(torch, generic, None), type):
                made = _device_generic(getattr(torch, generic), emulated)
                stack.enter_context(_patched(torch, generic, made))
        # Mixed precision: the tensors here are CPU tensors, which autocast("cuda") leaves
        # alone; the same autocast on the CPU casts the same kind of ops (matmuls, convs,
        # attention) to the lower precision, so activations are counted at their size.
        stack.enter_context(_patched(torch, "autocast", _CudaAutocastOnCpu))
        stack.enter_context(_patched(torch.amp, "autocast", _CudaAutocastOnCpu))
        stack.enter_context(_patched(torch.cuda.amp, "autocast", _cuda_amp_autocast))
        # fp16's GradScaler skips the optimizer step when a gradient is inf or NaN, which it
        # learns from a value (found_inf.item()); fake tensors have none, and the stand-in
        # would skip every step: the step is always taken (an overflow is rare, and the
        # memory is the same either way)
        scaler = torch.amp.grad_scaler.GradScaler
        stack.enter_context(_patched(scaler, "_maybe_opt_step", _always_step))
        yield


_GPU_DTYPES = {
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.complex64,
    torch.complex128, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
    torch.bool, torch.float8_e4m3fn, torch.float8_e5m2,
}  # fmt: skip

# the memory figures a script may log: the traced bytes (torch.cuda's and torch.accelerator's)
_TRACED_FIGURES = (
    "memory_allocated",
    "max_memory_allocated",
    "memory_reserved",
    "max_memory_reserved",
    "reset_peak_memory_stats",
    "memory_stats",
)


def _traced_stats(tracker: ScriptTracker) -> dict[str, int]:
    """``memory_stats()`` as torch's caching allocator keys it (the keys torch 2.13 documents,
    every one ``memory_summary`` reads), from the traced bytes: reserved reads as allocated,
    as ``memory_reserved`` does here; the pool split, block and segment counts are not
    traced (the large pool holds it all, the counts read 0); no retries or OOMs happen in a
    trace."""
    live, peak = tracker.live_bytes, tracker.peak_bytes
    total = sum(op.size for op in tracker.ops if op.alloc)
    traced = {"current": live, "peak": peak, "allocated": total, "freed": max(0, total - live)}
    zero = dict.fromkeys(traced, 0)
    stats: dict[str, int] = {}
    for metric in ("allocated_bytes", "active_bytes", "requested_bytes", "reserved_bytes"):
        for pool, figures in (("all", traced), ("large_pool", traced), ("small_pool", zero)):
            stats |= {f"{metric}.{pool}.{k}": v for k, v in figures.items()}
    for metric in ("inactive_split_bytes", "allocation", "active", "segment", "inactive_split"):
        for pool in ("all", "large_pool", "small_pool"):
            stats |= {f"{metric}.{pool}.{k}": 0 for k in traced}
    for metric in ("oversize_allocations", "oversize_segments"):
        stats |= {f"{metric}.{k}": 0 for k in traced}
    counts = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc")
    return stats | dict.fromkeys((*counts, "num_device_free", "max_split_size"), 0)


def _patch_everywhere(stack: contextlib.ExitStack, package: str, patches: dict[str, Any]) -> None:
    """Patch ``package``'s functions, and every binding of the same function in its
    submodules: torch's own modules bind some by name (``from . import _lazy_init``;
    ``torch.cuda.random.get_rng_state`` is ``torch.cuda.get_rng_state``), and a call through
    an unpatched binding would reach the GPU. Names the installed torch lacks are skipped."""
    top = sys.modules.get(package)
    if top is None:
        return
    modules = [m for n, m in list(sys.modules.items()) if n.startswith(package + ".")]
    for name, value in patches.items():
        if not hasattr(top, name):
            continue
        original = getattr(top, name)
        stack.enter_context(_patched(top, name, value))
        for mod in modules:
            if getattr(mod, name, None) is original:
                stack.enter_context(_patched(mod, name, value))


_SDP_FLAGS = (
    ("flash_sdp_enabled", "enable_flash_sdp"),
    ("mem_efficient_sdp_enabled", "enable_mem_efficient_sdp"),
    ("math_sdp_enabled", "enable_math_sdp"),
    ("cudnn_sdp_enabled", "enable_cudnn_sdp"),
    ("fp16_bf16_reduction_math_sdp_allowed", "allow_fp16_bf16_reduction_math_sdp"),
)


def _sdp_flags() -> dict[str, bool]:
    """``torch.backends.cuda``'s attention settings (process-wide: a script may change them)."""
    cuda = torch.backends.cuda
    return {setter: bool(getattr(cuda, getter)()) for getter, setter in _SDP_FLAGS}


def _set_sdp_flags(flags: dict[str, bool]) -> None:
    for setter, value in flags.items():
        getattr(torch.backends.cuda, setter)(value)


@contextlib.contextmanager
def _noting_compile(trace: ScriptTrace) -> Iterator[None]:
    """``torch.compile`` and ``Module.compile`` leave the model as it is, and the trace notes
    that the script asked for them: the model runs eagerly (the report says its figure errs
    high)."""

    def compile(model: Any = None, *args: Any, **kwargs: Any) -> Any:
        # the model itself, uncompiled: dynamo would not compile under preflight's modes
        # anyway, and with fullgraph=True it raises for that ("found no compiled frames")
        trace.compiled = True
        if model is None:  # @torch.compile(mode=...): a decorator
            return lambda fn: compile(fn)
        return model

    def compile_module(self: nn.Module, *args: Any, **kwargs: Any) -> None:
        trace.compiled = True

    with _patched(torch, "compile", compile), _patched(nn.Module, "compile", compile_module):
        yield


def _data_parallel_forward(tracker: ScriptTracker) -> Callable[..., Any]:
    """``nn.DataParallel.forward`` on the one emulated GPU, as torch runs it with a single
    device: the weights must be on it (torch's own check, against what preflight counts as
    GPU memory: torch's would see the capture's CPU), then the inputs are moved to it and the
    module is called as it is. Over several devices it is not emulated: GPU 0 would hold
    replicas and gathered outputs that one emulated GPU does not have."""

    def forward(self: nn.DataParallel, *inputs: Any, **kwargs: Any) -> Any:  # type: ignore[type-arg]
        if len(self.device_ids) > 1:
            raise RuntimeError(
                f"nn.DataParallel over device_ids {self.device_ids}: preflight emulates one"
                " GPU; check the single-GPU run (device_ids=[0]) or one DDP rank instead"
            )
        for t in [*self.module.parameters(), *self.module.buffers()]:
            if not tracker.is_device(t):
                raise RuntimeError(
                    "module must have its parameters and buffers on device cuda:0"
                    " (device_ids[0]) but found one of them on device: cpu"
                )
        moved = tree_map(
            lambda t: t.to("cuda") if isinstance(t, torch.Tensor) else t, (inputs, kwargs)
        )
        return self.module(*moved[0], **moved[1])

    return forward


@contextlib.contextmanager
def _default_device(tracker: ScriptTracker) -> Iterator[None]:
    """``torch.set_default_device("cuda")`` and ``with torch.device("cuda"):`` on the
    emulated GPU. Both put torch's ``DeviceContext`` at the bottom of the mode stack, under
    :class:`_Moves`, to give factories a device; its class is swapped for one that makes
    them device memory on the capture's CPU instead (torch's C++ looks the class up by name
    at each ``with``), persistent while nothing has run yet (a model built there is loaded,
    as ``.cuda()`` would have it), and ``torch.get_default_device()`` says ``cuda:0``. A
    default device the script set is undone when its run ends, so nothing after it makes
    tensors on a GPU that is not there."""
    import torch.utils._device as device_mod
    from torch.overrides import _get_current_function_mode_stack

    base = device_mod.DeviceContext
    orig_get = torch.get_default_device

    class EmulatedDeviceContext(base):  # type: ignore[misc,valid-type]
        def __torch_function__(
            self, func: Any, types: Any, args: Any = (), kwargs: Any = None
        ) -> Any:
            kwargs = dict(kwargs or {})
            if func in device_mod._device_constructors() and kwargs.get("device") is None:
                if self.device.type != "cuda":
                    kwargs["device"] = self.device
                    return func(*args, **kwargs)
                kwargs["device"] = torch.device("cpu")
                phase = tracker.phase if tracker.started else "persistent"
                tracker.forced += 1
                try:
                    with tracker.in_phase(phase):
                        return func(*args, **kwargs)
                finally:
                    tracker.forced -= 1
            return func(*args, **kwargs)

    def get_default_device() -> torch.device:
        stack = _get_current_function_mode_stack()  # type: ignore[no-untyped-call]
        modes = [m for m in stack if isinstance(m, base)]
        ctx = modes[-1] if modes else getattr(torch._GLOBAL_DEVICE_CONTEXT, "device_context", None)
        if ctx is not None and ctx.device.type == "cuda":
            return torch.device("cuda", ctx.device.index or 0)
        return orig_get()

    glob = torch._GLOBAL_DEVICE_CONTEXT
    had = getattr(glob, "device_context", None)
    device_mod.DeviceContext = EmulatedDeviceContext  # type: ignore[misc]
    torch.get_default_device = get_default_device
    try:
        yield
    finally:
        device_mod.DeviceContext = base  # type: ignore[misc]
        torch.get_default_device = orig_get
        now = getattr(glob, "device_context", None)
        if now is not had and isinstance(now, EmulatedDeviceContext):
            torch.set_default_device(None if had is None else had.device)


def _always_step(scaler: Any, optimizer: Any, state: Any, *args: Any, **kwargs: Any) -> Any:
    return optimizer.step(*args, **kwargs)


class _CudaAutocastOnCpu(torch.amp.autocast_mode.autocast):
    """``torch.autocast("cuda", ...)`` as the emulated GPU runs it: on the CPU tensors."""

    def __init__(self, device_type: str, *args: Any, **kwargs: Any) -> None:
        if device_type == "cuda":
            device_type = "cpu"
            if args:  # autocast(device_type, dtype, enabled, cache_enabled)
                kwargs.setdefault("dtype", args[0])
                kwargs.update(zip(("enabled", "cache_enabled"), args[1:], strict=False))
                args = ()
            if kwargs.get("dtype") is None:
                kwargs["dtype"] = torch.float16  # CUDA autocast's default; the CPU's is bf16
        super().__init__(device_type, *args, **kwargs)


def _cuda_amp_autocast(*args: Any, **kwargs: Any) -> _CudaAutocastOnCpu:
    """``torch.cuda.amp.autocast(enabled, dtype, cache_enabled)``, deprecated but common."""
    names = ("enabled", "dtype", "cache_enabled")
    kw = {**dict(zip(names, args, strict=False)), **kwargs}
    kw.setdefault("dtype", torch.float16)
    return _CudaAutocastOnCpu("cuda", **kw)


def _convert(module: nn.Module, dtype: torch.dtype) -> nn.Module:
    """``module``'s floating-point parameters and buffers in ``dtype``, by replacing them
    (fake parameters refuse ``Module._apply``'s in-place swap). A parameter shared by two
    modules (tied embeddings) stays shared."""
    memo: dict[int, nn.Parameter] = {}
    for m in module.modules():
        for key, p in m._parameters.items():
            if p is None or not p.is_floating_point() or p.dtype == dtype:
                continue
            new = memo.get(id(p))
            if new is None:
                with torch.no_grad():
                    new = memo[id(p)] = nn.Parameter(p.to(dtype), requires_grad=p.requires_grad)
            m._parameters[key] = new
        for key, buf in m._buffers.items():
            if buf is not None and buf.is_floating_point() and buf.dtype != dtype:
                m._buffers[key] = buf.to(dtype)
    return module


def _module_moves(tracker: ScriptTracker) -> contextlib.AbstractContextManager[None]:
    """On a CPU-only torch every tensor stays on the CPU: ``Module.to("cuda")`` / ``.cuda()``
    make the module's tensors device memory in place, ``.to("cpu")`` / ``.cpu()`` leave it
    alone, and dtype conversions (``.half()``, ``.to(torch.bfloat16)``) replace the
    parameters (``_convert``)."""

    def adopt(module: nn.Module) -> None:
        tracker.modules.watch(module)
        for t in [*module.parameters(), *module.buffers()]:
            tracker.mark(t, None if tracker.started else "persistent")

    def to(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        dev, dtype, _, _fmt = torch._C._nn._parse_to(*args, **kwargs)
        if dtype is not None:
            _convert(self, dtype)
        if dev is not None and dev.type == "cuda":
            adopt(self)
        return self

    def cuda(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        adopt(self)
        return self

    def keep(self: nn.Module, *args: Any, **kwargs: Any) -> nn.Module:
        return self

    def as_dtype(dtype: torch.dtype) -> Callable[[nn.Module], nn.Module]:
        return lambda self: _convert(self, dtype)

    return _swap(
        nn.Module,
        {
            "to": to,
            "cuda": cuda,
            "cpu": keep,
            "half": as_dtype(torch.float16),
            "bfloat16": as_dtype(torch.bfloat16),
            "float": as_dtype(torch.float32),
            "double": as_dtype(torch.float64),
        },
    )


@contextlib.contextmanager
def _swap(target: Any, values: dict[str, Any]) -> Iterator[None]:
    before = {k: getattr(target, k) for k in values}
    for k, v in values.items():
        setattr(target, k, v)
    try:
        yield
    finally:
        for k, v in before.items():
            setattr(target, k, v)


def _in_process_loader() -> Any:
    from torch.utils.data import DataLoader

    orig = DataLoader.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        # positional num_workers is the 6th argument of DataLoader(dataset, batch_size,
        # shuffle, sampler, batch_sampler, num_workers, ...)
        if len(args) > 5:
            args = (*args[:5], 0, *args[6:])
        kwargs["num_workers"] = 0
        kwargs.pop("prefetch_factor", None)
        kwargs["persistent_workers"] = False
        kwargs["pin_memory"] = False
        orig(self, *args, **kwargs)

    return _swap(DataLoader, {"__init__": init})


def trace_script(
    path: str | None,
    argv: list[str],
    *,
    module: str | None = None,
    gpu: str = "GPU",
    total_bytes: int,
    steps: int = 3,
    extra_steps: int = EXTRA_STEPS,
    time_budget_s: float = TIME_BUDGET_S,
    listener: Listener | None = None,
    on_submit: Callable[[BaseException], Any] | None = None,
    on_fraction: Callable[[float], None] | None = None,
    capability: tuple[int, int] = DEFAULT_CAPABILITY,
    cuda_kernels: bool = True,
) -> ScriptTrace:
    """Run the script at ``path`` (or ``-m module``) with ``argv`` as its arguments under
    fake tensors and record it (module docstring). ``listener`` sees each op as it happens
    and may end the run with :class:`~oomcast.preflight.tracker.StopCapture` (an OOM in the
    replay); ``on_fraction`` hears each ``set_per_process_memory_fraction`` the script
    makes, when it makes it. ``capability`` is the target GPU's compute capability (what
    ``get_device_capability`` answers, and which attention kernel PyTorch would pick);
    with ``cuda_kernels`` the operators whose CUDA kernels allocate otherwise than the CPU
    ones allocate as on the GPU (``preflight/kernels.py``), without it as the CPU kernels
    do (to compare against a real run on the CPU). Raises :class:`ScriptFailed` when the
    script fails for a reason of its own."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    if steps < 1:
        raise ValueError(f"steps must be at least 1, not {steps}")
    name = path if path is not None else f"-m {module}"
    trace = ScriptTrace(script=name, device="cpu")
    tracker = ScriptTracker(listener, name)
    tracker.on_fraction = on_fraction
    kernels = CudaKernels(capability) if cuda_kernels else None
    tracker.kernels = kernels
    phases = _Phases(tracker, trace, steps, extra_steps, time_budget_s)
    started = time.monotonic()
    cuda_before = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]
    tracker.cuda_before = cuda_before
    handles: list[Any] = []
    saved_argv, saved_path = sys.argv[:], sys.path[:]
    saved_dtype = torch.get_default_dtype()  # a script's set_default_dtype stays its own
    saved_sdp = _sdp_flags()  # and so do its attention backend choices
    saved_env = os.environ.get(PREFLIGHT_ENV)
    os.environ[PREFLIGHT_ENV] = "1"
    sys.argv = [path if path is not None else str(module), *argv]
    if path is not None:
        sys.path.insert(0, str(Path(path).resolve().parent))

    orig_sd = nn.Module.state_dict
    orig_opt_sd = torch.optim.Optimizer.state_dict

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        phases.checkpoint()  # torch.save copies device tensors to host: nothing on the GPU
        phases.stop_if_seen()
        phases._enter("forward")  # what comes next is the next step's batch

    # A state_dict() taken after training began starts a checkpoint (what copies its tensors
    # next is the checkpoint's); frameworks also take them while setting up, which is not.
    def state_dict(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if phases.depth == 0 and trace.steps_done > 0:
            phases.checkpoint()
        return orig_sd(self, *args, **kwargs)

    def opt_state_dict(self: torch.optim.Optimizer) -> Any:
        if trace.steps_done > 0:
            phases.checkpoint()
        return orig_opt_sd(self)

    try:
        with contextlib.ExitStack() as stack:
            # the script's own output goes to stderr: stdout is the report's (--json)
            stack.enter_context(contextlib.redirect_stdout(sys.stderr))
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(tracker)
            stack.enter_context(_Moves(tracker))
            stack.enter_context(_module_moves(tracker))
            stack.enter_context(_emulated_cuda(tracker, gpu, total_bytes, capability))
            stack.enter_context(_default_device(tracker))
            stack.enter_context(cuda_functionals(tracker))
            stack.enter_context(_noting_compile(trace))
            stack.enter_context(_fresh_accelerate())
            stack.enter_context(
                _patched(nn.DataParallel, "forward", _data_parallel_forward(tracker))
            )
            stack.enter_context(_in_process_loader())
            stack.enter_context(_patched(torch, "save", save))
            phases.saver = save
            phases.patch_savers()
            stack.enter_context(
                _swap(
                    nn.Module,
                    {"state_dict": state_dict, "train": phases.train_mode(nn.Module.train)},
                )
            )
            stack.enter_context(_swap(torch.optim.Optimizer, {"state_dict": opt_state_dict}))
            stack.enter_context(
                _swap(
                    torch.Tensor,
                    {
                        "backward": phases.backward(torch.Tensor.backward),
                        "numpy": _numpy_stand_in(tracker, torch.Tensor.numpy),
                        "pin_memory": _pinned,
                        "record_stream": lambda self, stream: None,
                        "__deepcopy__": _fake_deepcopy(torch.Tensor.__deepcopy__),
                    },
                )
            )
            stack.enter_context(
                _swap(nn.Parameter, {"__deepcopy__": _fake_deepcopy(nn.Parameter.__deepcopy__)})
            )
            stack.enter_context(
                _patched(torch.autograd, "backward", phases.backward(torch.autograd.backward))
            )
            stack.enter_context(
                _patched(torch.autograd, "grad", phases.backward(torch.autograd.grad))
            )
            handles += [
                nn.modules.module.register_module_forward_pre_hook(phases.pre),
                nn.modules.module.register_module_forward_hook(phases.post),
                register_optimizer_step_pre_hook(phases.optimizer_pre),
                register_optimizer_step_post_hook(phases.optimizer_post),
            ]
            _run_main(path, module, trace, tracker, on_submit)
            if not tracker.stopped and trace.stopped_by != "submitted" and not trace.saw_eval:
                try:
                    trace.eval_synthesized = phases.synthesize_eval()
                except StopCapture:
                    trace.stopped_by = "oom"
            tracker.phase = "teardown"
    finally:
        for h in [*handles, *phases.handles]:
            h.remove()
        for undo in phases.restore:
            undo()
        sys.argv, sys.path[:] = saved_argv, saved_path
        torch.set_default_dtype(saved_dtype)
        _set_sdp_flags(saved_sdp)
        if saved_env is None:
            os.environ.pop(PREFLIGHT_ENV, None)
        else:
            os.environ[PREFLIGHT_ENV] = saved_env
        trace.ops = tracker.ops
        tracker.close()
    trace.stand_ins = list(tracker.stand_ins.values())
    trace.memory_fraction = tracker.memory_fraction
    kernel_note = kernels.note() if kernels is not None else None
    if kernel_note:
        trace.notes.append(kernel_note)
    if torch.cuda.is_initialized() and not cuda_before:  # type: ignore[no-untyped-call]
        trace.notes.append(
            "the script made a CUDA context on this machine's GPU through a call preflight does"
            " not emulate (about 500 MB there); nothing else was put on it"
        )
    trace.checkpoint_allocated = any(op.alloc and op.phase == "checkpoint" for op in trace.ops)
    trace.internal_stand_ins = tracker.internal_stand_ins
    trace.elapsed_s = time.monotonic() - started
    return trace


def _run_main(
    path: str | None,
    module: str | None,
    trace: ScriptTrace,
    tracker: ScriptTracker,
    on_submit: Callable[[BaseException], Any] | None,
) -> None:
    """Run the script's ``__main__`` and say in ``trace.stopped_by`` how it ended."""
    name = trace.script
    try:
        if path is not None:
            runpy.run_path(path, run_name="__main__")
        else:
            runpy.run_module(str(module), run_name="__main__", alter_sys=True)
        trace.stopped_by = trace.stopped_by or "script_ended"
    except ScriptDone:
        pass
    except StopCapture:
        trace.stopped_by = "oom"
    except SystemExit as exc:
        if tracker.stopped:
            trace.stopped_by = "oom"
        elif exc.code not in (None, 0):
            raise ScriptFailed(
                f"{name} exited with status {exc.code} after {trace.steps_done}"
                " optimizer steps under preflight"
            ) from None
        else:
            trace.stopped_by = "script_ended"
    except BaseException as exc:
        if tracker.stopped:
            trace.stopped_by = "oom"
        elif on_submit is not None and on_submit(exc):
            trace.stopped_by = "submitted"
        elif isinstance(exc, KeyboardInterrupt):
            raise
        else:
            raise ScriptFailed(_explain(exc, name, tracker)) from exc


_ACCELERATE_STATES = ("PartialState", "AcceleratorState", "GradientState")


def _accelerate_shared() -> list[dict[str, Any]]:
    """Accelerate's process-wide state dicts (empty where it is not imported)."""
    state = sys.modules.get("accelerate.state")
    out = []
    for name in _ACCELERATE_STATES:
        shared = getattr(getattr(state, name, None), "_shared_state", None)
        if isinstance(shared, dict):
            out.append(shared)
    return out


@contextlib.contextmanager
def _fresh_accelerate() -> Iterator[None]:
    """Accelerate keeps its settings (mixed precision, the device) in process-wide
    singletons that refuse to change once set. A traced run starts without them, as a fresh
    ``python train.py`` would, and whatever the process had is back when it ends (a batch
    probe, the next script, or the caller's own Accelerator)."""
    saved = [dict(shared) for shared in _accelerate_shared()]
    for shared in _accelerate_shared():
        shared.clear()
    try:
        yield
    finally:
        now = _accelerate_shared()  # the script may have imported accelerate itself
        for k, shared in enumerate(now):
            shared.clear()
            if len(now) == len(saved):
                shared.update(saved[k])


def _explain(exc: BaseException, name: str, tracker: ScriptTracker) -> str:
    """Where the script failed, by its own line, and whether fake tensors were the cause."""
    from oomcast.preflight.capture import is_fake_error

    frames = [
        f
        for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(os.path.dirname(torch.__file__))
        and not _ours(f.filename)
        and f.filename not in ("<frozen runpy>", runpy.__file__)
    ]
    where = ""
    own = [f for f in frames if not _is_library(f.filename)]
    if own:  # the script's line; the library's after it when the failure came from one
        f = own[-1]
        where = f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
        if frames[-1] is not f:
            lib = frames[-1]
            where += f", through {lib.filename}:{lib.lineno}"
    elif frames:
        f = frames[-1]
        where = f" at {f.filename}:{f.lineno} (`{(f.line or '').strip()}`)"
    phase, step = tracker.failed_in or (tracker.phase, tracker.step)
    made = bool(torch.cuda.is_initialized()) and not tracker.cuda_before  # type: ignore[no-untyped-call]
    untouched = (
        "A CUDA context was made on this machine's GPU earlier in the run, by a call"
        " preflight does not see; the job did not run there."
        if made
        else "Nothing ran on the GPU."
    )
    if isinstance(exc, RealGpuCall):
        via = f" ({exc.via})" if exc.via else ""
        return (
            f"{name} stopped{where}, in phase {phase} of step {step}: this call{via} would"
            " start the real GPU (a CUDA context, then memory on it), and preflight does not"
            f" emulate it. It was stopped before it did. {untouched} Preflight sets"
            f" ${PREFLIGHT_ENV}=1 while it runs the script: a line that is not needed to"
            " train can be skipped when it is set."
        )
    if isinstance(exc, Exception) and is_fake_error(exc):
        why = (
            "this operator's output shape depends on tensor values (nonzero, boolean-mask"
            " indexing, unique), which fake tensors do not have"
        )
        return (
            f"{name} cannot run on fake tensors{where}, in phase {phase} of step {step}:"
            f" {why} ({type(exc).__name__}). {untouched}"
        )
    lazy = "UninitializedParameter" in str(exc) or "uninitialized parameter" in str(exc)
    hint = (
        " Lazy modules (nn.LazyLinear and the like) are not supported by preflight yet: give"
        " the layer its input size."
        if lazy
        else ""
    )
    return (
        f"{name} failed{where}, in phase {phase} of step {step}, before preflight had seen"
        f" what it needs: {type(exc).__name__}: {exc}. {untouched}{hint}"
    )


def _is_library(filename: str) -> bool:
    """Whether a frame's file is an installed library or the standard library's, not the
    user's script (or a module of theirs beside it)."""
    parts = Path(filename).parts
    stdlib = sysconfig.get_paths()["stdlib"]
    return "site-packages" in parts or "dist-packages" in parts or filename.startswith(stdlib)


def preflight_script(
    path: str | None,
    argv: list[str],
    *,
    module: str | None = None,
    gpu: str | None = None,
    capacity_bytes: int | None = None,
    alloc_conf: str | AllocConf | None = None,
    steps: int = 3,
    context_bytes: int = CONTEXT_ALLOWANCE_BYTES,
    remedies: bool = True,
    extra_steps: int = EXTRA_STEPS,
    time_budget_s: float = TIME_BUDGET_S,
) -> PreflightReport:
    """Will the script fit ``gpu``? Traced as written (:func:`trace_script`), replayed as it
    runs through the caching-allocator simulator; a script that calls ``submit(job)`` is
    checked by its job instead (``preflight()``, with remedies)."""
    from oomcast.preflight.api import preflight
    from oomcast.preflight.session import PreflightSubmitted, session

    target = Target.resolve(gpu, capacity_bytes, context_bytes, alloc_conf)
    rep = target.replayer()
    with session() as s:
        trace = trace_script(
            path,
            argv,
            module=module,
            gpu=target.label,
            total_bytes=target.device_bytes,
            steps=steps,
            extra_steps=extra_steps,
            time_budget_s=time_budget_s,
            listener=rep.listen,
            on_submit=lambda exc: isinstance(exc, PreflightSubmitted),
            on_fraction=lambda fraction: rep.cap(fraction, target.device_bytes),
            capability=target.capability,
        )
    if trace.stopped_by != "submitted" and trace.stopped_by != "oom" and not trace.ops:
        raise ScriptFailed(
            f"{trace.script} ended after {trace.steps_done} optimizer step(s) with nothing put on"
            " the GPU: nothing to check (does it train when run with these arguments?)"
        )
    if trace.stopped_by == "submitted" and s.job is not None:
        options = {
            "gpu": gpu,
            "capacity_bytes": capacity_bytes,
            "alloc_conf": target.conf,
            "steps": steps,
            "context_bytes": context_bytes,
            "remedies": remedies,
            **{k: v for k, v in s.options.items() if k != "device"},
        }
        return preflight(s.job, **options)
    report = target.report(
        job=Path(path).name if path is not None else f"-m {module}",
        batch_size=trace.batch_size or 0,
        device=trace.device,
        steps=trace.steps_done,
        replay=rep.result,
    )
    report.notes[:0] = [
        *script_notes(trace, steps, extra_steps),
        "the GPU is emulated on fake CPU tensors (no GPU is touched): attention, dropout and"
        " the cuBLAS workspace allocate as CUDA's kernels do; other CUDA-only workspaces"
        " (cuDNN convolution, NCCL) are not seen",
    ]
    fraction = rep.fraction_at_peak
    if fraction is not None and rep.result.capacity_bytes < target.capacity_bytes:
        report.capacity_bytes = rep.result.capacity_bytes
        later = trace.memory_fraction != fraction
        report.notes.insert(
            0,
            f"the script caps itself with set_per_process_memory_fraction({fraction}):"
            f" the allocator may reserve {format_size(rep.result.capacity_bytes)} of"
            f" {format_size(target.device_bytes)} where the run "
            + ("ran out" if rep.result.oom is not None else "peaked")
            + ", and the verdict is against that"
            + (f" (it sets {trace.memory_fraction} later)" if later else ""),
        )
    if remedies:
        found = batch_argument(argv)
        if found is None:
            if not rep.result.fits:
                report.notes.append(
                    "no batch-size argument found among the script's arguments"
                    f" ({', '.join(BATCH_FLAGS[:3])}, ...): rerun with a smaller batch, or give"
                    " it as one of those for preflight to find the largest that fits"
                )
        else:

            def probe(batch: int) -> Replay:
                return _probe(path, found.argv(batch), batch, found.value, trace.batch_size,
                              module, target, steps, extra_steps, time_budget_s)  # fmt: skip

            report.remedies.append(script_largest_batch(found, probe, rep.result))
        capped = trace.memory_fraction is not None and report.capacity_bytes < target.capacity_bytes
        if capped and not rep.result.fits:
            report.remedies.append(
                _fraction_remedy(path, argv, module, target, steps, extra_steps, time_budget_s)
            )
    return report


def _fraction_remedy(
    path: str | None,
    argv: list[str],
    module: str | None,
    target: Target,
    steps: int,
    extra_steps: int,
    time_budget_s: float,
) -> Remedy:
    """The script's own ``set_per_process_memory_fraction`` is what it runs out of: the
    script traced once more without the cap, on the whole GPU, says what it needs and so
    the smallest fraction (in hundredths, rounded up) that holds it. The peak reserved
    without a cap is an upper bound: under a cap the allocator frees its cache and retries
    before it fails."""
    rep = target.replayer()
    total = target.device_bytes
    try:
        trace_script(path, argv, module=module, gpu=target.label, total_bytes=total,
                     steps=steps, extra_steps=extra_steps, time_budget_s=time_budget_s,
                     listener=rep.listen, capability=target.capability)  # fmt: skip
    except Exception as exc:  # ScriptFailed, or anything else: the report stands without it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        return Remedy(
            "memory_fraction", f"none found: without its cap the script failed ({first})", 0, False
        )
    need = peak_of(rep.result)
    if not rep.result.fits:
        return Remedy(
            "memory_fraction",
            f"none: even the whole GPU ({format_size(target.capacity_bytes)} for the allocator)"
            f" is too small, it needs at least {format_size(need)}",
            need,
            False,
        )
    hundredths = -(-need * 100 // total)  # rounded up
    return Remedy(
        "memory_fraction",
        f"set_per_process_memory_fraction({hundredths / 100:.2f}): the job needs at most"
        f" {format_size(need)} of the GPU's {format_size(total)}",
        need,
        True,
        hundredths,
    )


# Batch-size options that training scripts commonly take (argparse, HF's TrainingArguments
# through HfArgumentParser); the first one found is the one preflight varies.
BATCH_FLAGS = (
    "--batch-size",
    "--batch_size",
    "--per-device-train-batch-size",
    "--per_device_train_batch_size",
    "--train-batch-size",
    "--train_batch_size",
    "--bs",
)


def batch_argument(argv: list[str]) -> _FoundBatch | None:
    """The script's batch-size option and its value, where it has one of ``BATCH_FLAGS``;
    given more than once, the last (as argparse reads it)."""
    found = None
    for i, arg in enumerate(argv):
        for flag in BATCH_FLAGS:
            if arg == flag and i + 1 < len(argv) and argv[i + 1].isdecimal():
                found = _FoundBatch(list(argv), flag, int(argv[i + 1]), i, False)
            elif arg.startswith(flag + "=") and arg[len(flag) + 1 :].isdecimal():
                found = _FoundBatch(list(argv), flag, int(arg[len(flag) + 1 :]), i, True)
    return found


@dataclass(frozen=True)
class _FoundBatch:
    original: list[str]
    flag: str
    value: int
    index: int
    joined: bool

    def argv(self, batch: int) -> list[str]:
        """The script's arguments with the batch size set to ``batch``."""
        out, i = list(self.original), self.index
        if self.joined:
            out[i] = f"{self.flag}={batch}"
        else:
            out[i + 1] = str(batch)
        return out


SEARCH_BUDGET_S = 600.0  # wall-clock for all the probes of one batch search


class _SearchStopped(Exception):
    """A probe said the search cannot go on; its message says why."""


def _probe(
    path: str | None,
    argv: list[str],
    batch: int,
    own: int,
    seen: int | None,
    module: str | None,
    target: Target,
    steps: int,
    extra_steps: int,
    time_budget_s: float,
) -> Replay:
    """The script traced once more at batch size ``batch`` (its own is ``own``, whose first
    train call took ``seen``), replayed at the same capacity (the trace stops at the first
    OOM). Raises :class:`_SearchStopped` when the run says nothing about that batch: it
    failed, trained no step, or ignored the option."""
    rep = target.replayer()
    total = target.device_bytes
    try:
        trace = trace_script(path, argv, module=module, gpu=target.label, total_bytes=total,
                             steps=steps, extra_steps=extra_steps, time_budget_s=time_budget_s,
                             listener=rep.listen, capability=target.capability,
                             on_fraction=lambda f: rep.cap(f, total))  # fmt: skip
    except Exception as exc:  # ScriptFailed, or anything else: the report stands without it
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise _SearchStopped(f"at {batch} the script failed ({first})") from None
    if trace.stopped_by == "oom":
        return rep.result
    if trace.steps_done == 0:
        raise _SearchStopped(f"at {batch} the script trained no step")
    # The first call's batch (a micro-batch, with accumulation) must move when the asked
    # batch doubles or halves; where it stays put, the script does not read the option
    far = batch >= 2 * own or 2 * batch <= own
    if far and seen is not None and trace.batch_size == seen:
        raise _SearchStopped(
            f"the script's batch does not follow the option (asked {batch}, its first call"
            f" still took {seen})"
        )
    return rep.result


def script_largest_batch(
    found: _FoundBatch,
    probe: Callable[[int], Replay],
    base: Replay | None = None,
    budget_s: float = SEARCH_BUDGET_S,
) -> Remedy:
    """The largest value of the script's batch option that fits, by tracing the script again
    (the same search as for a described job: one answer whatever the starting batch).
    ``base`` is the run already made at the script's own batch."""
    results: dict[int, Replay] = {} if base is None else {found.value: base}
    deadline = time.monotonic() + budget_s
    name = "largest_batch"

    def run(batch: int) -> Replay:
        if batch not in results:
            if time.monotonic() > deadline:
                raise _SearchStopped(f"the search took over {budget_s:.0f} s")
            results[batch] = probe(batch)
        return results[batch]

    try:
        lo, hi = largest_fitting(run, found.value)
    except _SearchStopped as exc:
        fitting = [b for b, r in results.items() if r.fits]
        best = max(fitting, default=0)
        said = f"no search past what was tried: {exc}"
        if best:
            change = f"{found.flag} {best} fits ({said})"
            return Remedy(name, change, peak_of(results[best]), True, best)
        return Remedy(name, f"none found ({said})", 0, False)
    if lo == 0:
        return Remedy(name, f"no {found.flag} fits, not even 1", peak_of(run(1)), False)
    if hi is None:
        change = f"{found.flag} {lo} fits (searched no further)"
    else:
        change = f"{found.flag} {lo} (the run uses {found.value}; {hi} does not fit)"
    return Remedy(name, change, peak_of(run(lo)), True, lo)


def script_notes(trace: ScriptTrace, steps: int, extra_steps: int) -> list[str]:
    """What the report must say about how the traced run went."""
    notes = [
        f"ran the script as written on fake tensors for {trace.steps_done} optimizer"
        f" step(s) in {trace.elapsed_s:.1f} s ({_STOPS.get(trace.stopped_by, trace.stopped_by)})",
        *trace.notes,
    ]
    if trace.steps_done == 0 and trace.stopped_by != "oom":
        notes.append(
            "no optimizer step was seen: the train phases are not checked (does the script"
            " train under this entry point and these arguments?)"
        )
    if trace.eval_synthesized:
        notes.append(
            f"the script ran no eval in its first {trace.steps_done} steps: preflight ran the"
            " model's last train call again under no_grad and eval() (an eval batch of another"
            " size is not seen)"
        )
    elif not trace.saw_eval and trace.stopped_by != "oom":
        notes.append("no eval was seen and none could be run: the eval phase is not checked")
    if trace.saw_checkpoint and not trace.checkpoint_allocated:
        notes.append(
            "the script's checkpoint put nothing new on the GPU (torch.save copies each tensor"
            " to host memory)"
        )
    if not trace.saw_checkpoint and trace.stopped_by != "oom":
        notes.append(
            f"no checkpoint in the first {trace.steps_done} steps: the checkpoint phase is not"
            " checked (torch.save itself copies to host memory; copies on the GPU are the risk)"
        )
    if trace.compiled:
        notes.append(
            "the script compiles its model (torch.compile): preflight ran it eagerly, op by op;"
            " a compiled model fuses operators and may recompute activations instead of keeping"
            " them, so it usually needs less than this report says (the verdict errs on the"
            " safe side)"
        )
    for s in trace.stand_ins:
        times = "" if s.count == 1 else f" ({s.count} times)"
        notes.append(
            f"{s.where}: `{s.code}` reads a value the traced run does not have (fake tensors"
            f" have no values, emulated CUDA events no times), so it got a stand-in"
            f" ({s.dtype}){times}"
        )
    return notes


_STOPS = {
    "done": "it had run the steps, an eval and a checkpoint",
    "extra_steps": f"no eval or checkpoint came within {EXTRA_STEPS} more steps",
    "time": "the time budget ran out",
    "oom": "the replay ran out of memory",
    "script_ended": "the script ended",
}
