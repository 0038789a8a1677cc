"""Replays whose verdict follows from the shapes alone."""

from __future__ import annotations

from preflight_jobs import MIB, param_bytes, wide_mlp

from oomcast.preflight.allocconf import AllocConf
from oomcast.preflight.capture import JobCapture, PhaseOp, capture_job
from oomcast.preflight.replay import replay

GIB = 1 << 30
P = param_bytes(4096, 8)  # 512 MiB of weights


def test_weights_and_adam_state_over_capacity_oom_at_the_first_optimizer_step() -> None:
    # forward + backward need weights + gradients (2P = 1 GiB); Adam adds 2P of state
    cap = capture_job(wide_mlp(4096, 8, 8))
    rep = replay(cap, 3 * P)
    assert not rep.fits and rep.oom is not None
    assert (rep.oom.phase, rep.oom.step) == ("optimizer", 0)
    assert [(p.step, p.phase) for p in rep.phases] == [
        (-1, "other"),
        (0, "forward"),
        (0, "backward"),
        (0, "optimizer"),
    ]
    assert rep.oom.reserved_bytes + rep.oom.requested_bytes > 3 * P
    assert rep.headroom_bytes < 0


def _eval_job(no_grad: bool) -> JobCapture:
    # eval batch 32768 x 4096 fp32: 512 MiB per activation; with a graph all 8 layers keep
    # theirs (>= 4 GiB), without one at most two are alive
    job = wide_mlp(4096, 8, 8, eval_batch_size=32768, eval_no_grad=no_grad, checkpoint="none")
    return capture_job(job)


def test_eval_without_no_grad_oom_at_eval_and_with_it_fits() -> None:
    capacity = 5 * GIB  # training needs < 3 GiB (weights, grads, Adam state, foreach temps)
    graph = replay(_eval_job(no_grad=False), capacity)
    assert graph.oom is not None and (graph.oom.phase, graph.oom.step) == ("eval", 0)
    train_peak = max(p.peak_reserved_bytes for p in graph.phases if p.phase != "eval")
    assert train_peak < 3 * GIB
    plain = replay(_eval_job(no_grad=True), capacity)
    assert plain.fits and plain.oom is None
    assert plain.peak_reserved_bytes <= capacity
    assert plain.headroom_bytes == capacity - plain.peak_reserved_bytes


def _growing_requests(sizes_mib: list[int]) -> JobCapture:
    """Allocate and free ever larger blocks: each size needs a segment of its own."""
    ops: list[PhaseOp] = []
    for sid, size in enumerate(sizes_mib, start=1):
        ops.append(PhaseOp(True, sid, size * MIB, "forward", 0, ""))
        ops.append(PhaseOp(False, sid, 0, "forward", 0, ""))
    return JobCapture("growing", 1, "cpu", True, [], ops)


def test_expandable_segments_lower_reserved_on_a_fragmenting_pattern() -> None:
    sizes = [22, 44, 66, 88, 110]
    cap = _growing_requests(sizes)
    fixed = replay(cap, 10 * GIB)
    grown = replay(cap, 10 * GIB, AllocConf(expandable_segments=True))
    # without expandable segments no cached segment is large enough for the next request,
    # so every one stays reserved; with them, the one segment is extended in place
    assert fixed.peak_reserved_bytes == sum(sizes) * MIB
    assert grown.peak_reserved_bytes <= 120 * MIB
    assert fixed.peak_allocated_bytes == grown.peak_allocated_bytes == 110 * MIB
    # below 330 MiB the allocator releases its cached segments and retries before an OOM,
    # so the fixed-segment replay still fits, with reserved capped by the capacity
    tight = replay(cap, 200 * MIB)
    assert tight.fits and tight.peak_reserved_bytes <= 200 * MIB


def test_cached_free_share_at_the_peak_is_the_unused_share_of_reserved() -> None:
    rep = replay(_growing_requests([22, 44, 66, 88, 110]), 10 * GIB)
    # peak reserved 330 MiB is reached when the 110 MiB block is live
    assert abs(rep.cached_free_frac - (330 - 110) / 330) < 1e-9
    assert rep.timeline[-1][1] == 330 * MIB
