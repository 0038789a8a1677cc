"""The fake capture against the real one, and what each phase records."""

from __future__ import annotations

import pytest
import torch
from preflight_jobs import MIB, lm_job, param_bytes, wide_mlp

from oomcast.preflight.capture import CaptureError, capture_job

PHASES = ("forward", "backward", "optimizer", "eval", "checkpoint")


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("make", [lambda: wide_mlp(256, 3, 32), lambda: lm_job()])
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_fake_and_real_captures_account_the_same_bytes(make, device: str) -> None:  # type: ignore[no-untyped-def]
    job = make()
    fake = capture_job(job, fake=True, device=device)
    real = capture_job(job, fake=False, device=device)
    assert fake.fake and not real.fake
    assert fake.persistent_bytes() == real.persistent_bytes() > 0
    assert fake.phases() == real.phases()
    for phase in (None, *PHASES):
        assert fake.peak_live_bytes(phase) == real.peak_live_bytes(phase), phase
    assert [(o.alloc, o.size, o.phase, o.step) for o in fake.ops] == [
        (o.alloc, o.size, o.phase, o.step) for o in real.ops
    ]


def test_the_run_has_the_phases_in_order_and_frees_what_it_allocates() -> None:
    cap = capture_job(wide_mlp(256, 3, 32), steps=3)
    assert cap.phases()[:5] == [
        (0, "forward"),
        (0, "backward"),
        (0, "optimizer"),
        (0, "eval"),
        (0, "checkpoint"),
    ]
    assert cap.phases()[5:] == [
        (s, p) for s in (1, 2) for p in ("forward", "backward", "optimizer")
    ]
    allocated = {o.sid for o in [*cap.persistent, *cap.ops] if o.alloc}
    freed = {o.sid for o in cap.ops if not o.alloc}
    assert allocated == freed  # everything dies when the run ends


def test_adam_state_appears_at_the_first_optimizer_step() -> None:
    p = param_bytes(1024, 4)
    cap = capture_job(wide_mlp(1024, 4, 8))
    assert cap.persistent_bytes() == p
    # weights + gradients + exp_avg + exp_avg_sq, at least
    assert cap.peak_live_bytes("optimizer") >= 4 * p
    assert cap.peak_live_bytes("forward", step=0) < 2 * p  # no state yet
    assert cap.peak_live_bytes("forward", step=1) >= 3 * p  # weights and the state


def test_device_checkpoint_copies_weights_and_state_and_cpu_checkpoint_none() -> None:
    p = param_bytes(1024, 4)
    dev = capture_job(wide_mlp(1024, 4, 8, checkpoint="device_copy"))
    cpu = capture_job(wide_mlp(1024, 4, 8, checkpoint="cpu_copy"))
    ckpt = [o for o in dev.ops if o.alloc and o.phase == "checkpoint"]
    assert sum(o.size for o in ckpt) >= 3 * p  # weights, exp_avg, exp_avg_sq (+ steps)
    assert not [o for o in cpu.ops if o.alloc and o.phase == "checkpoint"]


def test_grad_accum_runs_micro_batches() -> None:
    whole = capture_job(wide_mlp(1024, 2, 4096))
    split = capture_job(wide_mlp(1024, 2, 4096, grad_accum=4))
    act = 4096 * 1024 * 4
    assert whole.peak_live_bytes("forward") - split.peak_live_bytes("forward") >= act
    forwards = [o for o in split.ops if o.alloc and o.phase == "forward" and o.step == 0]
    inputs = [o for o in forwards if o.size == 1024 * 1024 * 4]  # a (1024, 1024) micro-batch
    assert len(inputs) >= 4


def test_fake_capture_needs_no_memory_for_a_large_model() -> None:
    # 16 GiB of parameters: far more than a test may allocate
    cap = capture_job(wide_mlp(32768, 4, 8), steps=1, evals=0, checkpoints=0)
    assert cap.persistent_bytes() == 4 * 32768 * 32768 * 4
    assert cap.peak_live_bytes() >= 4 * cap.persistent_bytes()


def test_a_data_dependent_loss_is_refused_with_a_reason() -> None:
    job = wide_mlp(64, 2, 8)

    def loss(model, batch):  # type: ignore[no-untyped-def]
        out = model(batch[0])
        if out.sum().item() > 0:  # needs the data
            return out.mean()
        return out.sum()

    job.loss = loss
    with pytest.raises(CaptureError, match=r"fake tensors \(phase forward of step 0\)"):
        capture_job(job)


def test_bad_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="steps"):
        capture_job(wide_mlp(64, 2, 8), steps=0)
    with pytest.raises(ValueError, match="divisible by grad_accum 2"):
        capture_job(wide_mlp(64, 2, 8, grad_accum=2), batch_size=3)
    with pytest.raises(ValueError, match="device"):
        capture_job(wide_mlp(64, 2, 8), device="tpu")


def test_cpu_only_torch_captures_on_cpu() -> None:
    cap = capture_job(wide_mlp(64, 2, 8), device="cuda")
    assert cap.device == ("cuda" if torch.backends.cuda.is_built() else "cpu")
    assert MIB > 0
