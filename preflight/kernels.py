"""What CUDA's kernels put on the GPU where the CPU kernels preflight traces with do otherwise.

A script is traced on fake *CPU* tensors (``preflight/script.py``), so each operator
allocates what its CPU kernel allocates. For most operators that is what the CUDA kernel
allocates too. Three common ones differ enough to matter, and :class:`CudaKernels` makes
them allocate as they would on the target GPU:

- **Attention** (``F.scaled_dot_product_attention``, which ``nn.MultiheadAttention`` and the
  Hugging Face models call). The CPU build computes it with the math path, which keeps the
  (batch, heads, L, S) attention weights, the dropout mask and the dropped weights for the
  backward pass. On a GPU PyTorch picks a fused kernel where the inputs allow it:
  *flash* (fp16/bf16, no mask, head dim at most 256, compute capability 8.0 or later) or
  *memory-efficient* (fp16/bf16/fp32, any mask, head dim aligned), which keep the output
  and a log-sum-exp of (batch, heads, L) floats instead (the math path, where neither
  applies, upcasts half-precision inputs to fp32 on CUDA). :func:`sdpa_backend` follows
  PyTorch's choice (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``); each fused
  kernel's allocations, forward and backward, follow ``flash_api.cpp`` (``mha_fwd``,
  ``mha_bwd``) and ``attention.cu`` / ``attention_backward.cu``
  (``_efficient_attention_forward`` / ``_backward``): shapes, dtypes, the rounding of the
  sequence length, the temporary buffers and copies. Where neither fused kernel applies the
  math path runs as CUDA runs it (its dropout keeps a boolean mask, below).
- **Dropout** (``F.dropout`` in training, not in place). On CUDA it is one fused kernel
  that keeps a *boolean* mask (1 byte an element) for the backward pass; on the CPU it draws
  a float noise tensor (4 bytes an element, or 2 in half precision) and keeps that. In-place
  dropout multiplies by such a noise tensor on both, and is left alone.
- **The cuBLAS workspaces**: the first matrix product a thread runs on a stream takes a
  workspace from the caching allocator and keeps it for the life of the process
  (``aten/src/ATen/cuda/CublasHandlePool.cpp``: one per cuBLAS handle and stream, and the
  handles are per thread). A training step has two threads on the GPU: the script's, and
  the autograd engine's thread for the device, which runs the backward pass. 32 MiB each on
  compute capability 9.0, 4096 KiB x 2 + 16 KiB x 8 elsewhere (PyTorch's
  ``CUBLAS_WORKSPACE_CONFIG`` default).

Not modelled: cuDNN's attention (chosen before flash on 9.x GPUs with a recent cuDNN, for
fp16/bf16 without dropout; it keeps the same (batch, heads, L) statistics as flash), flash's
split-KV buffers (only without dropout, at small batch x heads), the memory-efficient
kernel's key/value gradient workspace (fp16/bf16 with head dims above 64-128), and cuDNN
convolution workspaces. ``docs/preflight.md`` lists them.
"""

from __future__ import annotations

import contextlib
import math
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_map

if TYPE_CHECKING:
    from oomcast.preflight.tracker import PhaseTracker

MIB = 1 << 20
_HALF = (torch.float16, torch.bfloat16)
_BLAS_OPS = frozenset(
    getattr(torch.ops.aten, name).default
    for name in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "mv", "addmv", "_addmm_activation")
)


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass
class CudaKernels:
    """The target GPU's compute capability, and a count of what was emulated (the report's
    note)."""

    capability: tuple[int, int] = (8, 0)
    seen: Counter[str] = field(default_factory=Counter)

    @property
    def blas_workspace_bytes(self) -> int:
        if self.capability == (9, 0):
            return 32 * MIB
        return 4096 * 1024 * 2 + 16 * 1024 * 8

    def is_blas(self, func: Any) -> bool:
        return func in _BLAS_OPS

    def note(self) -> str | None:
        """One line for the report: which kernels ran as on the GPU, and how often."""
        parts = []
        for key, label in (
            ("flash", "attention as the flash kernel"),
            ("efficient", "attention as the memory-efficient kernel"),
            ("math", "attention as the math path"),
            ("dropout", "dropout with a boolean mask"),
        ):
            if self.seen[key]:
                parts.append(f"{label} ({self.seen[key]} calls)")
        if self.seen["blas"]:
            n = self.seen["blas"]
            each = f"{self.blas_workspace_bytes / MIB:.2f} MiB"
            parts.append(
                f"{n} cuBLAS workspaces of {each} (the training thread's and autograd's)"
                if n > 1
                else f"the cuBLAS workspace ({each})"
            )
        if not parts:
            return None
        major, minor = self.capability
        return (
            f"CUDA's kernels were emulated where they allocate differently from the CPU's, as on"
            f" compute capability {major}.{minor}: " + ", ".join(parts)
        )

    # -- dropout ----------------------------------------------------------------------------
    @staticmethod
    def fused_dropout_applies(input: torch.Tensor, p: float, training: bool) -> bool:
        """Whether CUDA runs this (out-of-place) ``F.dropout`` as its fused kernel (ATen's
        ``is_fused_kernel_acceptable``): in training, 0 < p < 1, a non-empty input. In-place
        dropout never is: ``dropout_`` multiplies by a noise tensor of the input's type on
        CUDA as on the CPU."""
        return bool(training) and 0.0 < p < 1.0 and input.numel() > 0

    def dropout(self, input: torch.Tensor, p: float) -> torch.Tensor:
        """``F.dropout`` as CUDA runs it in training: ``native_dropout``, which keeps a
        boolean mask."""
        self.seen["dropout"] += 1
        return torch.native_dropout(input, p, True)[0]

    # -- attention --------------------------------------------------------------------------
    def attention(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attn_mask: torch.Tensor | None = None,
        dropout_p: float = 0.0,
        is_causal: bool = False,
        scale: float | None = None,
        enable_gqa: bool = False,
    ) -> torch.Tensor:
        """``F.scaled_dot_product_attention`` with the allocations of the kernel PyTorch
        would pick on the target GPU."""
        backend = sdpa_backend(
            self.capability, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa
        )
        self.seen[backend] += 1
        if backend == "flash":
            # a head dim that is not a multiple of 8 is padded outside the kernel (copies of
            # q, k and v, which the kernel keeps), and the output sliced back: a view
            d = query.size(-1)
            pad = (8 - d % 8) % 8
            if pad:
                query, key, value = (
                    torch.nn.functional.pad(t, (0, pad)) for t in (query, key, value)
                )
            out: torch.Tensor = _Flash.apply(query, key, value)  # type: ignore[no-untyped-call]
            return out[..., :d] if pad else out
        if backend == "efficient":
            bias = _efficient_bias(query, attn_mask)
            # the log-sum-exp is kept only when the backward pass will need it
            grad = torch.is_grad_enabled() and any(
                t is not None and t.requires_grad for t in (query, key, value, bias)
            )
            out = _Efficient.apply(query, key, value, bias, grad)  # type: ignore[no-untyped-call]
            return out
        return _math(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)


@contextlib.contextmanager
def cuda_functionals(tracker: PhaseTracker) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` and ``F.dropout`` on ``tracker``'s device tensors
    allocate as CUDA's kernels do (``tracker.kernels``). They are patched where they are
    bound, not caught by a function mode: ``F.multi_head_attention_forward`` calls attention
    inside itself, where a mode that caught the outer call no longer sees. A binding a
    library makes during the run keeps the wrapper, which falls back to torch's own once the
    run is over (the tracker's ``kernels`` is then None)."""
    functional = torch.nn.functional
    sdpa, dropout = functional.scaled_dot_product_attention, functional.dropout
    # only where CPU tensors stand for the GPU: on fake CUDA tensors (a CUDA build) the
    # kernels' own fakes already allocate as CUDA's do (cuBLAS's workspaces are still added)
    emulate = tracker.device_type == "cpu"

    def attention(query: Any, *args: Any, **kwargs: Any) -> Any:
        k = tracker.kernels
        if k is None or not emulate:
            return sdpa(query, *args, **kwargs)
        if not isinstance(query, torch.Tensor) or not tracker.is_device(query):
            return sdpa(query, *args, **kwargs)
        on = [d for d in ("cpu", "cuda") if torch.is_autocast_enabled(d)]
        if on:  # CUDA's autocast (emulated on the CPU, or CUDA's own on a CUDA build)
            # CUDA's autocast runs attention in its lower precision: its floating inputs
            # (the mask too) are cast first, which is what lets it pick flash
            low = torch.get_autocast_dtype(on[0])

            def cast(t: Any) -> Any:
                eligible = isinstance(t, torch.Tensor) and t.is_floating_point()
                return t.to(low) if eligible and t.dtype not in (low, torch.float64) else t

            query, args, kwargs = cast(query), tree_map(cast, args), tree_map(cast, kwargs)
        # and inside the kernel autocast is off (the math path's products stay in fp32)
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return k.attention(query, *args, **kwargs)

    def fused_dropout(
        input: Any, p: float = 0.5, training: bool = True, inplace: bool = False
    ) -> Any:
        k = tracker.kernels
        if k is None or not emulate:
            return dropout(input, p, training, inplace)
        if not isinstance(input, torch.Tensor) or not tracker.is_device(input):
            return dropout(input, p, training, inplace)
        if inplace or not k.fused_dropout_applies(input, p, training):
            return dropout(input, p, training, inplace)
        return k.dropout(input, p)

    with contextlib.ExitStack() as stack:
        for name, original, value in (
            ("scaled_dot_product_attention", sdpa, attention),
            ("dropout", dropout, fused_dropout),
        ):
            for mod in [functional, *(m for m in list(sys.modules.values()) if m is not None)]:
                try:  # a module's __getattr__ may raise anything (a lazy import that fails)
                    bound = mod is functional or getattr(mod, name, None) is original
                except Exception:
                    continue
                if bound:
                    stack.enter_context(patched(mod, name, value))
        yield


@contextlib.contextmanager
def patched(target: Any, name: str, value: Any) -> Iterator[None]:
    """``target.name`` is ``value`` inside, and what it was before after."""
    before = getattr(target, name)
    setattr(target, name, value)
    try:
        yield
    finally:
        setattr(target, name, before)


def sdpa_backend(
    capability: tuple[int, int],
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None,
    dropout_p: float,
    is_causal: bool,
    enable_gqa: bool,
) -> str:
    """``flash``, ``efficient`` or ``math``: what PyTorch's CUDA dispatch picks for these
    dense inputs in its default order (flash, then memory-efficient, then math), among the
    backends the script leaves enabled (``sdpa_kernel``; where it allows neither fused
    kernel nor math, PyTorch raises and the math path stands in)."""
    major = capability[0]
    # what the script allows (torch.nn.attention.sdpa_kernel, torch.backends.cuda.enable_*)
    flash_on = torch.backends.cuda.flash_sdp_enabled()  # type: ignore[no-untyped-call]
    efficient_on = torch.backends.cuda.mem_efficient_sdp_enabled()  # type: ignore[no-untyped-call]
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "math"
    if any(t.stride(-1) != 1 and t.size(-1) != 1 for t in (q, k, v)):
        return "math"
    if q.size(0) != k.size(0) or k.size(0) != v.size(0) or k.size(1) != v.size(1):
        return "math"
    if 0 in (q.size(-2), k.size(-2)):
        return "math"
    same_heads = q.size(1) == k.size(1)
    gqa_ok = enable_gqa and k.size(1) > 0 and q.size(1) % k.size(1) == 0
    d = q.size(-1)
    # on 8.6-8.9 and 12.x (less shared memory) flash's backward refuses head dims 193-224,
    # and above 224 with dropout
    training = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    small_smem = (major == 8 and capability[1] in (6, 7, 9)) or major == 12
    flash_dims = not (small_smem and training and (192 < d <= 224 or (d > 224 and dropout_p > 0.0)))
    if (
        flash_on
        and flash_dims
        and 8 <= major <= 12
        and q.dtype in _HALF
        and k.dtype == q.dtype == v.dtype
        and attn_mask is None
        and d == k.size(-1) == v.size(-1)
        and d <= 256
        and not (is_causal and q.size(-2) != k.size(-2))
        and (same_heads or gqa_ok)
    ):
        return "flash"
    # minimum_gemm_alignment: with tensor cores 8 for fp16/bf16 (7.0 and later) and 4 for
    # fp32 (8.0 and later), else none; bf16 is not supported before 8.0 at all
    align = (8 if major >= 7 else 1) if q.dtype in _HALF else (4 if major >= 8 else 1)
    if (
        efficient_on
        and major >= 5
        and (
            q.dtype in (torch.float16, torch.float32) or (q.dtype == torch.bfloat16 and major >= 8)
        )
        and k.dtype == q.dtype == v.dtype
        and same_heads
        and d == k.size(-1)
        and d % align == 0
        and v.size(-1) % align == 0
        and (attn_mask is None or attn_mask.stride(-1) == 1)
    ):
        return "efficient"
    return "math"


def _efficient_bias(q: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor | None:
    """The memory-efficient kernel's bias: a boolean mask becomes a new float tensor of its
    shape (True: attend); one whose rows are not 8-aligned is copied padded to a multiple of
    8 (``preprocess_mask``). It is then viewed as (B, H, L, S): never materialised."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        bias = q.new_zeros(mask.shape).masked_fill_(mask.logical_not(), -math.inf)
    else:
        bias = mask
    while bias.dim() < 4:
        bias = bias.unsqueeze(0)
    if bias.stride(-1) != 1 or any(s % 8 for s in bias.stride()[:-1]):
        s = bias.size(-1)
        padded = torch.nn.functional.pad(bias, (0, 8 - s % 8))
        bias = padded[..., :s]
    return bias


class _Flash(torch.autograd.Function):
    """``_scaled_dot_product_flash_attention``'s allocations: the output (laid out as the
    query is) and the log-sum-exp, (B, H, L) floats, kept for the backward pass; the
    backward's dQ accumulator and row sums in fp32 for the length of its call. The output
    is a tensor of its own, not a view, so a script may change it in place as it may the
    real one's."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(q)  # mha_fwd's empty_like of the (B, L, H, D) view: q's layout
        lse = q.new_empty((q.size(0), q.size(1), q.size(2)), dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor, ...]:
        q, k, v, out, _lse = ctx.saved_tensors
        g = dout.transpose(1, 2).contiguous()  # _flash_attention_backward's copies
        o = out.transpose(1, 2).contiguous()
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        dq, dk, dv = (torch.empty_like(t) for t in (qt, kt, vt))
        b, lq, hq, d = qt.shape
        hd_rounded = _round_up(d, 32) if d <= 128 else _round_up(d, 64)
        softmax_d = q.new_empty((b, hq, _round_up(lq, 128)), dtype=torch.float32)
        dq_accum = q.new_empty((b, _round_up(lq, 128), hq, hd_rounded), dtype=torch.float32)
        expanded: tuple[torch.Tensor, ...] = ()
        if kt.size(2) != hq:  # grouped-query attention: dk, dv for every query head, summed
            expanded = tuple(q.new_empty((b, t.size(1), hq, t.size(3))) for t in (kt, vt))
        del g, o, softmax_d, dq_accum, expanded
        return tuple(t.transpose(1, 2) for t in (dq, dk, dv))


class _Efficient(torch.autograd.Function):
    """``_scaled_dot_product_efficient_attention``'s allocations: the output, (B, L, H, D)
    contiguous, and the log-sum-exp, (B, H, L rounded up to 32) floats, kept; in fp16/bf16
    with a head dim above 128 an fp32 output accumulator for the length of the call."""

    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        bias: torch.Tensor | None,
        grad: bool,
    ) -> torch.Tensor:
        b, hq, lq, _ = q.shape
        dv = v.size(-1)
        # (B, L, H, Dv) in memory, handed out as (B, H, L, Dv): a tensor, not a view
        res = q.new_empty_strided((b, hq, lq, dv), (lq * hq * dv, dv, hq * dv, 1))
        lse = q.new_empty((b, hq, _round_up(lq, 32) if grad else 0), dtype=torch.float32)
        if q.dtype in _HALF and dv > 128:
            accum = q.new_empty((b, lq, hq, dv), dtype=torch.float32)
            del accum
        ctx.save_for_backward(q, k, v, res, lse, bias)
        ctx.bias_grad = bias is not None and bias.requires_grad
        return res

    @staticmethod
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, res, _lse, bias = ctx.saved_tensors
        g = dout.transpose(1, 2).contiguous()  # (B, L, H, Dv)
        b, hq, lq, d = q.shape
        grad_q = q.new_empty((b, lq, hq, d))
        grad_k = q.new_empty((b, k.size(2), hq, d))
        grad_v = q.new_empty((b, v.size(2), hq, v.size(-1)))
        grad_bias = None
        if ctx.bias_grad:  # computed for the expanded (B, H, L, S) bias, then reduced
            full = q.new_empty((b, hq, lq, _round_up(k.size(2), 16)))[..., : k.size(2)]
            grad_bias = full.sum_to_size(bias.shape)
        if q.dtype in _HALF:
            delta = q.new_empty((b, hq, lq), dtype=torch.float32)
        else:  # computed on the host side: a full fp32 product, then its sum
            delta = (g.float() * res.transpose(1, 2).float()).sum(-1).transpose(-2, -1).contiguous()
        # the fp32 accumulator of dQ, in 64 x 64 tiles (16 bytes of header each)
        tiles = -(-lq // 64) * -(-d // 64)
        size = b * hq * _round_up(tiles * (4 + 64 * 64), 4) * 4
        workspace = q.new_empty((size,), dtype=torch.uint8)
        del g, delta, workspace
        grads = (grad_q.transpose(1, 2), grad_k.transpose(1, 2), grad_v.transpose(1, 2))
        return (*grads, grad_bias, None)


def _math(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    p: float,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
) -> torch.Tensor:
    """``_scaled_dot_product_attention_math`` as CUDA runs it: half-precision inputs copied
    to fp32 (unless ``allow_fp16_bf16_reduction_math_sdp``), q and k each scaled by the
    square root of the scale, the weights, the mask added, softmax, dropout with a boolean
    mask (``native_dropout``), times v, and the output cast back."""
    reduced = torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed()  # type: ignore[no-untyped-call]
    low = q.dtype if q.dtype in _HALF else None
    if low is not None and not reduced:
        # the math path upcasts half-precision inputs and keeps what it computes in fp32
        q, k, v = q.float(), k.float(), v.float()
    else:
        low = None
    factor = math.sqrt(scale if scale is not None else 1.0 / math.sqrt(q.size(-1)))
    if enable_gqa and q.dim() >= 3 and k.size(-3) != q.size(-3):
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
        v = v.repeat_interleave(q.size(-3) // v.size(-3), -3)
    attn = (q * factor) @ (k.transpose(-2, -1) * factor)
    if is_causal:
        mask = q.new_ones((q.size(-2), k.size(-2)), dtype=torch.bool).tril()
    if mask is not None:
        if mask.dtype == torch.bool:
            attn = attn.masked_fill_(mask.logical_not(), -math.inf)
        else:
            attn = attn.add_(mask)
    attn = torch.softmax(attn, -1)
    if p > 0.0:
        attn = torch.native_dropout(attn, p, True)[0]
    out = attn @ v
    return out.to(low) if low is not None else out
