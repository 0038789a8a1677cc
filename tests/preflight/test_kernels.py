"""CUDA's kernels where they allocate otherwise than the CPU's (preflight/kernels.py): which
attention kernel PyTorch picks, what each keeps, dropout's mask, cuBLAS's workspaces."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

from oomcast.preflight.kernels import MIB, CudaKernels, sdpa_backend
from oomcast.preflight.script import preflight_script, trace_script
from oomcast.preflight.tracker import PhaseTracker

H100, A100, V100 = (9, 0), (8, 0), (7, 0)


def _qkv(
    b: int, h: int, length: int, d: int, dtype: torch.dtype = torch.float32, grad: bool = True
) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(b, h, length, d, dtype=dtype, requires_grad=grad) for _ in range(3))


@pytest.mark.parametrize(
    ("capability", "dtype", "d", "mask", "expected"),
    [
        (H100, torch.float16, 64, False, "flash"),
        (H100, torch.bfloat16, 256, False, "flash"),
        (H100, torch.bfloat16, 320, False, "efficient"),  # flash stops at a head dim of 256
        (H100, torch.float16, 64, True, "efficient"),  # flash takes no mask
        (H100, torch.float32, 64, False, "efficient"),  # flash is fp16/bf16 only
        (V100, torch.float16, 64, False, "efficient"),  # flash needs compute capability 8.0
        (A100, torch.float32, 6, False, "math"),  # fp32 needs a head dim that is a multiple of 4
        (A100, torch.float16, 12, True, "math"),  # fp16 a multiple of 8
        (A100, torch.float64, 64, False, "math"),
        (V100, torch.bfloat16, 64, False, "math"),  # no bf16 before 8.0
        (V100, torch.float32, 6, False, "efficient"),  # and no fp32 alignment either
        ((8, 6), torch.float16, 200, False, "efficient"),  # flash's backward: not 193-224 there
        (A100, torch.float16, 200, False, "flash"),
    ],
)
def test_the_kernel_pytorch_would_pick(
    capability: tuple[int, int], dtype: torch.dtype, d: int, mask: bool, expected: str
) -> None:
    q, k, v = _qkv(2, 4, 16, d, dtype)
    m = torch.ones(16, 16, dtype=torch.bool) if mask else None
    assert sdpa_backend(capability, q, k, v, m, 0.1, False, False) == expected


def test_the_kernel_choice_follows_shapes_and_heads() -> None:
    q, k, v = _qkv(2, 8, 16, 64, torch.float16)
    k2, v2 = k[:, :2].detach(), v[:, :2].detach()
    assert sdpa_backend(A100, q, k2, v2, None, 0.0, False, True) == "flash"  # GQA
    assert sdpa_backend(A100, q.float(), k2.float(), v2.float(), None, 0.0, False, True) == "math"
    assert sdpa_backend(A100, q[0], k[0], v[0], None, 0.0, False, False) == "math"  # 3-D
    short = q[:, :, :8]  # causal with a query shorter than the keys: not flash
    assert sdpa_backend(A100, short, k, v, None, 0.0, True, False) == "efficient"


@pytest.mark.parametrize(
    ("capability", "dtype", "d", "mask", "backend"),
    [
        (H100, torch.float16, 64, None, "flash"),
        (H100, torch.bfloat16, 60, None, "flash"),  # head dim padded to 64 inside
        (A100, torch.float32, 64, "bool", "efficient"),
        (A100, torch.float32, 64, "float", "efficient"),
        (A100, torch.float32, 6, None, "math"),
    ],
)
def test_the_emulated_kernels_give_what_torch_gives_and_take_gradients(
    capability: tuple[int, int], dtype: torch.dtype, d: int, mask: str | None, backend: str
) -> None:
    q, k, v = _qkv(2, 4, 24, d, dtype)
    m: torch.Tensor | None = None
    if mask == "bool":
        m = torch.ones(24, 24, dtype=torch.bool).tril()
    elif mask == "float":
        m = torch.zeros(1, 1, 24, 24, dtype=dtype)
    kernels = CudaKernels(capability)
    out = kernels.attention(q, k, v, attn_mask=m, dropout_p=0.1)
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=m, dropout_p=0.1)
    assert kernels.seen[backend] == 1
    assert (out.shape, out.dtype) == (want.shape, want.dtype)
    out.float().sum().backward()
    for t in (q, k, v):
        assert t.grad is not None and (t.grad.shape, t.grad.dtype) == (t.shape, t.dtype)


def _live_after(fn: Callable[[], Any], *inputs: torch.Tensor) -> tuple[int, int, Any]:
    """Run ``fn`` under a tracker that already holds ``inputs``: (bytes still live after
    it, peak bytes, its result), both over what the inputs hold."""
    tracker = PhaseTracker("cpu")
    tracker.adopt(inputs)
    held = tracker.live_bytes
    with tracker:
        result = fn()
    live, peak = tracker.live_bytes - held, tracker.peak_bytes - held
    tracker.close()
    return live, peak, result


def test_the_fused_kernels_keep_no_attention_weights_for_the_backward_pass() -> None:
    b, h, length, d = 2, 4, 100, 32
    q, k, v = _qkv(b, h, length, d)
    weights = b * h * length * length * 4  # one (B, H, L, S) fp32 tensor
    # the CPU's math path (which it takes with dropout) keeps the weights, the dropout's
    # noise and the dropped weights until the backward pass
    kept_math, _, out_math = _live_after(
        lambda: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1), q, k, v
    )
    assert kept_math >= weights
    # the memory-efficient kernel keeps its output and a log-sum-exp of (B, H, L rounded up
    # to 32) floats, nothing else
    kernels = CudaKernels(A100)
    kept, _, out = _live_after(lambda: kernels.attention(q, k, v, dropout_p=0.1), q, k, v)
    assert kept == b * length * h * d * 4 + b * h * 128 * 4
    # flash, in half precision: the output and (B, H, L) floats, unrounded
    qh, kh, vh = (t.detach().half().requires_grad_() for t in (q, k, v))
    kept_flash, _, _ = _live_after(lambda: CudaKernels(H100).attention(qh, kh, vh), qh, kh, vh)
    assert kept_flash == b * length * h * d * 2 + b * h * length * 4
    del out, out_math


def test_flash_s_backward_takes_its_fp32_accumulators_for_the_call() -> None:
    b, h, length, d = 2, 4, 100, 32
    q, k, v = _qkv(b, h, length, d, torch.float16)
    out = CudaKernels(H100).attention(q, k, v)
    grad = torch.ones_like(out)
    live, peak, _ = _live_after(lambda: out.backward(grad), q, k, v, out, grad)
    grads = 3 * b * h * length * d * 2
    assert live == grads  # the accumulators are gone after the call
    # (B, H, L rounded to 128) floats, and dQ in fp32 with L to 128 and the head dim to 32
    assert peak >= grads + b * h * 128 * 4 + b * 128 * h * 32 * 4


def test_a_boolean_mask_becomes_a_float_bias_kept_as_small_as_it_was() -> None:
    b, h, length, d = 2, 4, 64, 32
    q, k, v = _qkv(b, h, length, d)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    kept, _, _ = _live_after(
        lambda: CudaKernels(A100).attention(q, k, v, attn_mask=mask), q, k, v, mask
    )
    # output + log-sum-exp + the (L, S) fp32 bias: not one (B, H, L, S)
    assert kept == b * length * h * d * 4 + b * h * 64 * 4 + length * length * 4


def test_cuda_dropout_keeps_a_boolean_mask() -> None:
    x = torch.randn(1000, 100, requires_grad=True)
    kernels = CudaKernels(A100)
    assert kernels.fused_dropout_applies(x, 0.1, True)
    assert not kernels.fused_dropout_applies(x, 0.1, False)
    assert not kernels.fused_dropout_applies(x, 0.0, True)
    kept_cpu, _, _ = _live_after(lambda: F.dropout(x, 0.1, True), x)
    kept_cuda, _, y = _live_after(lambda: kernels.dropout(x, 0.1), x)
    assert kept_cpu == 2 * x.numel() * 4  # output and a float noise tensor
    assert kept_cuda == x.numel() * 4 + x.numel()  # output and one byte an element
    assert y.shape == x.shape and kernels.seen["dropout"] == 1


ENCODER = textwrap.dedent(
    """
    import torch
    from torch import nn
    import torch.nn.functional as F
    from torch.nn.functional import scaled_dot_product_attention as bound
    import builtins
    builtins._oomcast_bound_sdpa = bound  # a binding the script makes keeps the wrapper
    layer = nn.TransformerEncoderLayer(64, 4, 256, batch_first=True).cuda()
    opt = torch.optim.SGD(layer.parameters(), lr=0.1)
    print(torch.cuda.get_device_capability())
    for step in range(3):
        x = torch.randn(16, 128, 64, device="cuda")
        layer(x).sum().backward()
        opt.step()
        opt.zero_grad()
    """
)


def _trace(tmp_path: Path, text: str, **kw: Any) -> Any:
    path = tmp_path / "train.py"
    path.write_text(text)
    return trace_script(str(path), [], total_bytes=1 << 40, steps=2, extra_steps=0, **kw)


def _peak(trace: Any) -> int:
    live = peak = 0
    sizes: dict[int, int] = {}
    for op in trace.ops:
        if op.alloc:
            sizes[op.sid] = op.size
            live += op.size
            peak = max(peak, live)
        else:
            live -= sizes.pop(op.sid, 0)
    return peak


def test_a_transformer_script_is_traced_with_cuda_s_kernels(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import builtins

    on_gpu = _trace(tmp_path, ENCODER, capability=A100)
    assert "(8, 0)" in capsys.readouterr().err  # what get_device_capability answered
    on_cpu = _trace(tmp_path, ENCODER, cuda_kernels=False)
    # the math path keeps (16, 4, 128, 128) fp32 weights, the dropout's float noise and the
    # dropped weights: 12 MiB; the fused kernel keeps none of them (and CUDA adds cuBLAS's
    # two workspaces, 8.1 MiB each on an A100)
    workspaces = 2 * CudaKernels(A100).blas_workspace_bytes
    assert _peak(on_cpu) - (_peak(on_gpu) - workspaces) >= 8 * MIB
    note = [n for n in on_gpu.notes if "CUDA's kernels" in n]
    assert note and "memory-efficient kernel" in note[0] and "boolean mask" in note[0]
    assert not [n for n in on_cpu.notes if "CUDA's kernels" in n]
    # after the run the wrapper the script bound is torch's own again
    assert F.scaled_dot_product_attention is torch._C._nn.scaled_dot_product_attention
    q, k, v = _qkv(1, 2, 8, 16, grad=False)
    bound = builtins._oomcast_bound_sdpa  # type: ignore[attr-defined]
    torch.testing.assert_close(bound(q, k, v), F.scaled_dot_product_attention(q, k, v))
    del builtins._oomcast_bound_sdpa  # type: ignore[attr-defined]


LINEAR = textwrap.dedent(
    """
    import torch
    from torch import nn
    model = nn.Linear(32, 32).cuda()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        model(torch.randn(8, 32, device="cuda")).sum().backward()
        opt.step()
    """
)


@pytest.mark.parametrize(
    ("capability", "size"), [(H100, 32 * MIB), (A100, 4096 * 1024 * 2 + 16 * 1024 * 8)]
)
def test_cublas_keeps_a_workspace_for_the_script_s_thread_and_autograd_s(
    tmp_path: Path, capability: tuple[int, int], size: int
) -> None:
    trace = _trace(tmp_path, LINEAR, capability=capability)
    workspaces = [op for op in trace.ops if op.alloc and op.size == size]
    assert [op.phase for op in workspaces] == ["forward", "backward"]
    freed = {op.sid for op in trace.ops if not op.alloc and op.phase != "teardown"}
    assert not freed & {op.sid for op in workspaces}  # held for the whole run
    assert not [op for op in _trace(tmp_path, LINEAR, cuda_kernels=False).ops if op.size == size]


@pytest.mark.slow  # seconds of fake training
def test_the_report_says_which_kernels_ran_as_on_the_named_gpu(tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(ENCODER)
    report = preflight_script(str(path), [], gpu="V100-16GB", steps=2, remedies=False)
    note = [n for n in report.notes if "CUDA's kernels" in n]
    assert note and "compute capability 7.0" in note[0]
    assert "memory-efficient" in note[0] and "flash" not in note[0]


AUTOCAST = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, 128, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            q = (x @ w).float()  # fp32, as a rotary embedding computed in fp32 leaves it
            y = F.scaled_dot_product_attention(q, q, q, is_causal=True)
        y.float().sum().backward()
        opt.step()
    """
)


def test_cuda_autocast_runs_attention_in_its_lower_precision(tmp_path: Path) -> None:
    # CUDA's autocast casts attention's inputs to bf16, and so takes flash; without the
    # cast the fp32 inputs would have taken the memory-efficient kernel
    trace = _trace(tmp_path, AUTOCAST, capability=A100)
    note = next(n for n in trace.notes if "CUDA's kernels" in n)
    assert "attention as the flash kernel" in note and "memory-efficient" not in note
    plain = _trace(tmp_path, AUTOCAST.replace('"cuda", dtype', '"cuda", enabled=False, dtype'))
    note = next(n for n in plain.notes if "CUDA's kernels" in n)
    assert "memory-efficient" in note and "flash" not in note


def test_the_backends_the_script_allows_are_the_ones_chosen_from() -> None:
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, k, v = _qkv(2, 4, 16, 64, torch.float16)
    with sdpa_kernel(SDPBackend.MATH):  # a script that asks for the math path gets its memory
        assert sdpa_backend(H100, q, k, v, None, 0.0, False, False) == "math"
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert sdpa_backend(H100, q, k, v, None, 0.0, False, False) == "efficient"
    assert sdpa_backend(H100, q, k, v, None, 0.0, False, False) == "flash"


def test_flash_s_head_dim_limit_on_smaller_gpus_is_for_training_only() -> None:
    q, k, v = _qkv(2, 4, 16, 200, torch.float16, grad=False)
    assert sdpa_backend((8, 6), q, k, v, None, 0.0, False, False) == "flash"


def test_the_math_path_keeps_its_weights_in_fp32_for_half_inputs() -> None:
    # review finding: CUDA's math path upcasts fp16/bf16 and keeps fp32 weights
    b, h, length = 2, 4, 32
    # a mask rules flash out, a head dim of 12 (not 8-aligned) the memory-efficient kernel
    q, k, v = _qkv(b, h, length, 12, torch.bfloat16)
    mask = torch.ones(length, length, dtype=torch.bool).tril()
    kernels = CudaKernels(A100)
    tracker = PhaseTracker("cpu")
    tracker.adopt((q, k, v, mask))
    with tracker:
        out = kernels.attention(q, k, v, attn_mask=mask, dropout_p=0.1)
    sizes = [op.size for op in tracker.ops if op.alloc]
    tracker.close()
    assert kernels.seen["math"] == 1 and out.dtype == torch.bfloat16
    assert b * h * length * length * 4 in sizes  # fp32 weights, not bf16 ones


@pytest.mark.parametrize(
    ("capability", "dtype", "d", "mask"),
    [
        (H100, torch.float16, 60, False),
        (H100, torch.float16, 64, False),
        (A100, torch.float32, 64, True),
    ],
)
def test_the_attention_output_may_be_changed_in_place(
    capability: tuple[int, int], dtype: torch.dtype, d: int, mask: bool
) -> None:
    # review finding: a view made inside the autograd Function refused in-place changes in
    # the forward pass, which the real output allows
    q, k, v = _qkv(2, 4, 16, d, dtype)
    m = torch.zeros(1, 1, 16, 16, dtype=dtype, requires_grad=True) if mask else None
    out = CudaKernels(capability).attention(q, k, v, attn_mask=m)
    F.dropout(out, 0.1, True, inplace=True).mul_(2.0)  # an eval loop without no_grad
    assert out.shape == q.shape and out.requires_grad


IN_PLACE_DROPOUT = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        h = torch.randn(8, 64, device="cuda") @ w
        h = F.dropout(h, 0.1, True, INPLACE)
        h.sum().backward()
        opt.step()
    """
)


def test_in_place_dropout_is_not_the_fused_kernel(tmp_path: Path) -> None:
    # review finding: CUDA's dropout_ multiplies by a noise tensor, as the CPU's does
    inplace = _trace(tmp_path, IN_PLACE_DROPOUT.replace("INPLACE", "True"), capability=A100)
    assert not [n for n in inplace.notes if "dropout with a boolean mask" in n]
    fused = _trace(tmp_path, IN_PLACE_DROPOUT.replace("INPLACE", "False"), capability=A100)
    assert [n for n in fused.notes if "dropout with a boolean mask" in n]


def test_a_module_whose_getattr_raises_does_not_stop_the_trace(tmp_path: Path) -> None:
    # review finding: binding lookups ran every module's __getattr__, which may raise anything
    import sys
    import types

    class Lazy(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            raise ImportError(f"lazy import of {name} failed")

    sys.modules["oomcast_test_lazy"] = Lazy("oomcast_test_lazy")
    try:
        trace = _trace(tmp_path, LINEAR, capability=A100)
    finally:
        del sys.modules["oomcast_test_lazy"]
    assert trace.steps_done == 2


def _encoder_job() -> Any:
    from oomcast.preflight.job import PreflightJob

    return PreflightJob(
        name="encoder",
        model=lambda: torch.nn.TransformerEncoderLayer(64, 4, 256, batch_first=True),
        batch=lambda size, step: torch.randn(size, 128, 64),
        loss=lambda model, x: model(x).sum(),
        batch_size=16,
        checkpoint="none",
    )


def test_a_described_job_for_a_gpu_gets_cuda_s_kernels_too() -> None:
    # preflight(job) and the Trainer / Lightning callbacks that call it capture on the CPU
    # here: the same three operators allocate as on the GPU named
    from oomcast.preflight import preflight
    from oomcast.preflight.capture import capture_job

    report = preflight(_encoder_job(), gpu="A100-40GB", remedies=False)
    note = [n for n in report.notes if "CUDA's kernels were emulated" in n]
    assert note and "memory-efficient kernel" in note[0] and "compute capability 8.0" in note[0]
    on_cpu = capture_job(_encoder_job())  # no kernels given: the CPU's, as the zoo's truth
    on_gpu = capture_job(_encoder_job(), kernels=CudaKernels(A100))
    workspaces = 2 * CudaKernels(A100).blas_workspace_bytes
    # the math path's (16, 4, 128, 128) fp32 weights, noise and dropped weights: 12 MiB
    assert on_cpu.peak_live_bytes() - (on_gpu.peak_live_bytes() - workspaces) >= 8 * MIB
    # a CPU target keeps the CPU's kernels whatever it is given
    cpu_target = capture_job(_encoder_job(), device="cpu", kernels=CudaKernels(A100))
    assert cpu_target.peak_live_bytes() == on_cpu.peak_live_bytes()


def test_a_script_s_attention_settings_do_not_outlive_its_trace(tmp_path: Path) -> None:
    # review finding: a script that turned flash off left it off for every later check
    text = (
        "import torch\n"
        "torch.backends.cuda.enable_flash_sdp(False)\n"
        "torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)\n"
    ) + LINEAR
    before = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(),
    )
    _trace(tmp_path, text, capability=A100)
    after = (
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.fp16_bf16_reduction_math_sdp_allowed(),
    )
    assert after == before == (True, False)


MATH_UNDER_AUTOCAST = textwrap.dedent(
    """
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel
    w = torch.nn.Parameter(torch.randn(64, 64, device="cuda"))
    opt = torch.optim.SGD([w], lr=0.1)
    for step in range(3):
        x = torch.randn(4, 8, 256, 64, device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16), sdpa_kernel(SDPBackend.MATH):
            q = x @ w
            y = F.scaled_dot_product_attention(q, q, q)
        y.float().sum().backward()
        opt.step()
    """
)


def test_the_math_path_under_autocast_keeps_fp32_weights(tmp_path: Path) -> None:
    # review finding: CUDA's autocast is off inside attention, so the math path's
    # products stay in fp32; they were cast back to bf16 here
    trace = _trace(tmp_path, MATH_UNDER_AUTOCAST, capability=A100)
    assert any("attention as the math path" in n for n in trace.notes)
    weights = 4 * 8 * 256 * 256  # elements of the (B, H, L, S) weights; no other tensor's
    assert any(op.alloc and op.size == weights * 4 for op in trace.ops)
    assert not any(op.alloc and op.size == weights * 2 for op in trace.ops)


def test_bf16_support_is_the_target_s(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    text = (
        "import torch\n"
        "print('BF16', torch.cuda.is_bf16_supported(),"
        " torch.cuda.is_bf16_supported(including_emulation=False))\n"
    ) + LINEAR
    _trace(tmp_path, text, capability=(7, 5))  # a T4: emulated only
    _trace(tmp_path, text, capability=A100)
    printed = [line for line in capsys.readouterr().err.splitlines() if line.startswith("BF16")]
    assert printed == ["BF16 True False", "BF16 True True"]
