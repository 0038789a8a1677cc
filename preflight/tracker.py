"""The allocation tracker preflight runs a job under, for fake and real tensors alike.

A ``TorchDispatchMode`` sees the outputs of every operator. The first time a storage of the
tracked device type appears it is an allocation of ``storage.nbytes()`` bytes; a
``weakref.finalize`` on the storage reports its free when the storage dies. Storages are keyed
by ``UntypedStorage._cdata`` (the address of the C++ ``StorageImpl``), which fake (meta-backed)
storages have too, unlike a ``data_ptr``; a storage is counted once however many views of it
exist. The key is dropped when the storage dies, before its address can be reused.

The same class runs under ``FakeTensorMode`` (it must be entered after the fake mode, so it
sits on top of the mode stack and sees fake outputs) and on real tensors, so both account
bytes identically.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oomcast.training.module_stack import ModuleStack

if TYPE_CHECKING:
    from oomcast.preflight.kernels import CudaKernels

PHASES = ("forward", "backward", "optimizer", "eval", "checkpoint", "other")


@dataclass
class PhaseOp:
    """One allocation (``alloc`` True, ``size`` > 0 bytes) or free (``alloc`` False, ``size``
    0) of tensor storage ``sid``, in ``phase`` of train step ``step`` (-1 before step 0)."""

    alloc: bool
    sid: int
    size: int
    phase: str
    step: int
    module: str


class StopCapture(Exception):  # a signal to stop, not an error
    """Raised by a listener to end the run early (the replay saw an OOM)."""


Listener = Callable[[PhaseOp], None]


class PhaseTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: unannotated
    """Records storage allocations and frees of ``device_type`` tensors made under it."""

    def __init__(self, device_type: str, listener: Listener | None = None) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: unannotated __init__
        self.device_type = device_type
        self.listener = listener  # sees every op as it happens; may raise StopCapture
        self.stopped = False
        self.phase = "other"
        self.step = -1
        self.ops: list[PhaseOp] = []
        self.untracked = False  # while True, new storages are not recorded (host copies)
        self.failed_in: tuple[str, int] | None = None  # (phase, step) of the first failed op
        self._live: dict[int, int] = {}  # StorageImpl address -> storage id
        self._next_id = 1
        self.modules = ModuleStack()
        self._finalizers: list[weakref.finalize[Any, Any]] = []
        self._sizes: dict[int, int] = {}  # sid -> bytes, of the live storages
        self.live_bytes = 0  # what torch.cuda.memory_allocated would say, as the run goes
        self.peak_bytes = 0
        # CUDA's kernels where they allocate otherwise than the CPU's (None: as traced), and
        # cuBLAS's workspaces, per thread, held for the run (preflight/kernels.py)
        self.kernels: CudaKernels | None = None
        self.blas_workspaces: dict[str, torch.Tensor] = {}

    # -- modules ------------------------------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """Label allocations with the module whose forward is running."""
        self.modules.watch(model)

    def close(self) -> None:
        """Remove the module hooks and stop reporting frees (the run is over)."""
        self.kernels = None  # wrappers a library bound during the run fall back to torch's
        self.modules.close()
        for f in self._finalizers:
            f.detach()
        self._finalizers.clear()
        self.blas_workspaces.clear()  # after the finalizers: no free of them is reported
        self._live.clear()

    # -- storages -----------------------------------------------------------------------------
    def adopt(self, tensors: Iterable[torch.Tensor]) -> list[PhaseOp]:
        """Register storages that exist already (parameters, buffers, state) as persistent."""
        out = []
        for t in tensors:
            op = self._see(t, "persistent", "")
            if op is not None:
                out.append(op)
        return out

    def _see(
        self, t: torch.Tensor, phase: str, module: str, size: int | None = None
    ) -> PhaseOp | None:
        if t.device.type != self.device_type or t.is_sparse:
            return None
        st = t.untyped_storage()
        size = st.nbytes() if size is None else size
        key = st._cdata
        if size == 0 or key in self._live:
            return None
        sid = self._next_id
        self._next_id += 1
        self._live[key] = sid
        self._sizes[sid] = size
        self.live_bytes += size
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._finalizers.append(weakref.finalize(st, self._freed, key, sid))
        return PhaseOp(True, sid, size, phase, self.step, module)

    def _freed(self, key: int, sid: int) -> None:
        if self._live.get(key) == sid:
            del self._live[key]
            self.live_bytes -= self._sizes.pop(sid, 0)
            op = PhaseOp(False, sid, 0, self.phase, self.step, "")
            self.ops.append(op)
            if self.listener is not None and not self.stopped:
                self.listener(op)  # frees never stop a run

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            out = func(*args, **(kwargs or {}))
        except Exception:
            if self.failed_in is None:
                self.failed_in = (self.phase, self.step)
            raise
        if self.untracked or not self.records(args, kwargs):
            return out
        module = self.modules.current
        sizes = fake_workspace_sizes(func, args, out)
        for i, t in enumerate(tree_flatten(out)[0]):
            if isinstance(t, torch.Tensor):
                op = self._see(t, self.phase, module, sizes.get(i))
                if op is not None:
                    self.ops.append(op)
                    self.tell(op)
        if self.kernels is not None and self.kernels.is_blas(func):
            self._blas_workspace(module)
        return out

    def is_device(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is on the tracked device (a subclass may tell otherwise)."""
        return t.device.type == self.device_type and not t.is_sparse

    def _blas_workspace(self, module: str) -> None:
        """cuBLAS keeps one workspace per (handle, stream), and its handles are per thread:
        the script's thread, and the autograd engine's thread for the device, which runs
        every backward node on a GPU. The first matrix product on each takes one for good."""
        assert self.kernels is not None
        thread = "autograd" if torch._C._current_autograd_node() is not None else "main"
        if thread in self.blas_workspaces:
            return
        ws = torch.empty(self.kernels.blas_workspace_bytes, dtype=torch.uint8)
        self.blas_workspaces[thread] = ws
        self.kernels.seen["blas"] += 1
        op = self._see(ws, self.phase, module)
        if op is not None:
            self.ops.append(op)
            self.tell(op)

    def records(self, args: Any, kwargs: Any) -> bool:
        """Whether the outputs of an operator called with ``args`` are recorded (those on
        ``device_type`` are): a subclass that tells device memory apart otherwise says no."""
        return True

    def tell(self, op: PhaseOp) -> None:
        """Pass ``op`` to the listener; a StopCapture from it marks the run stopped."""
        if self.listener is None:
            return
        try:
            self.listener(op)
        except StopCapture:
            self.stopped = True
            raise

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        """Label what runs inside with ``phase``."""
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    @contextlib.contextmanager
    def host_memory(self) -> Iterator[None]:
        """Storages made inside are host memory (a checkpoint's CPU copies): not recorded."""
        before, self.untracked = self.untracked, True
        try:
            yield
        finally:
            self.untracked = before


# -- kernels whose fake implementation under-reports what the real one allocates ----------------

_WORKSPACE_CACHE: dict[tuple[Any, ...], int] = {}
# Up to this size (estimated) the real kernel is run at the job's own batch to size the
# workspace exactly; past it, the figure is extrapolated from batches of 1 and 2 (within 5%
# on the shapes measured), so a large LSTM is still checked without its memory.
EXACT_WORKSPACE_BYTES = 256 << 20


def fake_workspace_sizes(func: Any, args: Any, out: Any) -> dict[int, int]:
    """Real byte sizes for outputs of ``func`` that a fake run sizes wrongly, by position in
    the flattened output. One such kernel is known: the CPU LSTM/GRU layer
    (``aten.mkldnn_rnn_layer``), whose fake implementation returns an empty workspace while
    oneDNN's keeps one of about 60 bytes per (batch, step, hidden) element alive until the
    backward pass (a fifth of an LSTM language model's training peak). The real kernel is run
    on zeros with batches of 1 and 2 (a few KiB, cached per shape); where the line through
    them puts the workspace under ``EXACT_WORKSPACE_BYTES``, once more at the job's batch for
    the exact figure, else the line's figure is used."""
    if func is not torch.ops.aten.mkldnn_rnn_layer.default:
        return {}
    flat = tree_flatten(out)[0]
    if len(flat) < 4 or not isinstance(flat[3], FakeTensor) or flat[3].numel() != 0:
        return {}
    x, hx = args[0], args[5]
    # nn.LSTM hands the layer (seq, batch, features) whatever its batch_first; hx is (batch,
    # hidden). Any other layout is not corrected rather than guessed at.
    if x.dim() != 3 or hx.dim() != 2 or x.shape[1] != hx.shape[0]:
        return {}
    batch = int(hx.shape[0])
    key = (tuple(x.shape), *(tuple(a.shape) for a in args[1:7]), *map(repr, args[7:]))
    if key not in _WORKSPACE_CACHE:
        one, two = (_real_workspace(args, b) for b in (1, 2))
        guess = one + (two - one) * (batch - 1)
        # oneDNN pads small shapes (the line is off by up to 2x under ~1 MiB): where the
        # real kernel's own figure is cheap to get, get it
        exact = guess <= EXACT_WORKSPACE_BYTES
        _WORKSPACE_CACHE[key] = _real_workspace(args, batch) if exact else guess
    return {3: _WORKSPACE_CACHE[key]}


def _real_workspace(args: Any, batch: int) -> int:
    """The workspace bytes the real ``mkldnn_rnn_layer`` returns for ``args`` at ``batch``."""
    with unset_fake_temporarily(), torch.enable_grad():  # the kernel keeps no workspace without
        real: list[Any] = []
        for i, a in enumerate(args):
            if not isinstance(a, torch.Tensor):
                real.append(a)
                continue
            shape = list(a.shape)
            if i == 0:  # input: (seq, batch, features)
                shape[1] = batch
            elif i in (5, 6):  # hx, cx: (batch, hidden)
                shape[0] = batch
            real.append(torch.zeros(shape, dtype=a.dtype))
        ws = torch.ops.aten.mkldnn_rnn_layer.default(*real)[3]
        return int(ws.untyped_storage().nbytes())
