"""A real PyTorch training job (CPU) whose first eval needs more memory than it has: the
workload behind the end-to-end test of phase-aware warnings (docs/phases.md).

Training is steady: a small MLP regressing a synthetic target, one step every ``--step-s``
seconds (the pause stands for data loading), with the same memory from one step to the
next. Every ``--eval-every`` steps it evaluates, and the eval makes a common mistake: it runs
without ``torch.no_grad()`` and keeps every batch's output to average later, so the graph of
each of ``--eval-batches`` batches of ``--eval-batch`` rows stays alive until the eval ends.
Under a memory cgroup that the training fits in, the kernel kills the job at its first eval.

Before the loop the job tells oomcast what is coming, with the in-process hook: the schedule
(``set_schedule(eval_every_steps=..., step_s=...)``) and the eval's extra bytes as a preflight
measures them: its own ``evaluate`` run through :func:`oomcast.preflight.capture.capture_job`
on fake tensors (no real memory), announced with ``set_phase_extra_bytes``. It honours
checkpoint requests at the end of a step (``--checkpoint-dir``) and answers them through the
hook.

Everything the job does that a test needs to time is one JSON line on stdout with the wall
clock: ``{"ts": ..., "event": "start" | "announced" | "checkpoint_requested" |
"checkpoint_saved" | "eval_begin" | "eval_end", "step": ..., ...}``.

    python -m oomcast.bench.trainers.eval_spike --eval-every 180 --step-s 0.25
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

FEATURES = 64


def log_event(event: str, **fields: Any) -> None:
    print(json.dumps({"ts": time.time(), "event": event, **fields}), flush=True)


def build_model(width: int) -> torch.nn.Module:
    import torch

    return torch.nn.Sequential(
        torch.nn.Linear(FEATURES, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, width),
        torch.nn.ReLU(),
        torch.nn.Linear(width, 1),
    )


def make_batch(size: int) -> torch.Tensor:
    import torch

    return torch.randn(size, FEATURES)


def train_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    import torch

    target = x.sum(dim=1, keepdim=True)
    loss: torch.Tensor = torch.nn.functional.mse_loss(model(x), target)
    return loss


def evaluate(
    model: torch.nn.Module, next_batch: Callable[[], torch.Tensor], batches: int
) -> torch.Tensor:
    """The eval with the bug: no ``no_grad``, and every output kept until the end, so each
    batch's graph (the activations its backward would need) stays alive."""
    import torch

    outputs = []
    for _ in range(batches):
        x = next_batch()
        outputs.append((model(x) - x.sum(dim=1, keepdim=True)) ** 2)
    return torch.cat(outputs).mean()


def eval_extra_bytes(
    width: int, batch: int, eval_batch: int, eval_batches: int, *, fake: bool = True
) -> int:
    """What a preflight says the eval needs above the level before it: the job's own code
    (model, optimizer, one train step, then the eval) on fake tensors, so nothing is
    allocated; the figure is the eval's peak of live tensor bytes less the live bytes when
    it began. ``fake=False`` runs the same on real tensors (the check of the figure)."""
    import torch

    from oomcast.preflight.capture import capture_job
    from oomcast.preflight.job import PreflightJob

    job = PreflightJob(
        name="eval-spike",
        model=lambda: build_model(width),
        batch=lambda size, step: make_batch(size),
        loss=train_loss,
        batch_size=batch,
        optimizer=lambda params: torch.optim.Adam(params, lr=1e-3),
        eval_step=lambda model, b: evaluate(model, lambda: make_batch(eval_batch), eval_batches),
        eval_batch_size=eval_batch,
        eval_no_grad=False,
        checkpoint="none",
    )
    cap = capture_job(job, fake=fake, device="cpu", steps=1, evals=1, checkpoints=0)
    live = cap.persistent_bytes()
    sizes: dict[int, int] = {}
    level: int | None = None
    peak = 0
    for op in cap.ops:
        if op.phase == "eval" and level is None:
            level = live
        if op.alloc:
            sizes[op.sid] = op.size
            live += op.size
        else:
            live -= sizes.pop(op.sid, 0)
        if op.phase == "eval":
            peak = max(peak, live)
    if level is None:
        raise RuntimeError("the preflight capture ran no eval")
    return max(0, peak - level)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=os.environ.get("OOMCAST_JOB", "eval-spike"))
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--eval-every", type=int, default=180, help="steps between evals")
    ap.add_argument("--step-s", type=float, default=0.25, help="seconds per step (paced)")
    ap.add_argument("--width", type=int, default=1024, help="hidden width of the MLP")
    ap.add_argument("--batch", type=int, default=64, help="training batch")
    ap.add_argument("--eval-batch", type=int, default=1024)
    ap.add_argument("--eval-batches", type=int, default=48, help="batches the eval keeps alive")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument(
        "--announce",
        choices=("preflight", "none"),
        default="preflight",
        help="announce the eval's extra bytes from a preflight on fake tensors, or not",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    for name in ("steps", "eval_every", "width", "batch", "eval_batch", "eval_batches"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.step_s <= 0:
        ap.error(f"--step-s must be positive, got {args.step_s}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)

    import torch

    from oomcast.bench.trainers.leaky import save_checkpoint
    from oomcast.collectors.hook import MemoryHook

    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    hook = MemoryHook(job=args.job)
    log_event("start", pid=os.getpid(), job=args.job, mode=hook.mode, device=hook.device)
    if args.announce == "preflight":
        extra = eval_extra_bytes(args.width, args.batch, args.eval_batch, args.eval_batches)
        log_event("announced", eval_extra_bytes=extra)
    model = build_model(args.width)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    hook.set_schedule(eval_every_steps=args.eval_every, step_s=args.step_s)
    if args.announce == "preflight":
        hook.set_phase_extra_bytes({"eval": extra})
    seen_requests: set[str] = set()
    start = time.monotonic()
    try:
        with hook.guard():
            for step in range(1, args.steps + 1):
                loss = train_loss(model, make_batch(args.batch))
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
                opt.step()
                del loss
                hook.step(step)
                req = hook.checkpoint_request
                if req is not None and req.id not in seen_requests:
                    seen_requests.add(req.id)
                    log_event("checkpoint_requested", step=step, id=req.id, source=req.source)
                if hook.checkpoint_requested:
                    if args.checkpoint_dir is None:
                        hook.checkpoint_done(None, ok=False)
                    else:
                        path = save_checkpoint(args.checkpoint_dir, step, model, opt)
                        hook.checkpoint_done(str(path))
                        log_event("checkpoint_saved", step=step, path=str(path))
                if step % args.eval_every == 0:
                    log_event("eval_begin", step=step)
                    with hook.phase("eval"):
                        metric = evaluate(
                            model, lambda: make_batch(args.eval_batch), args.eval_batches
                        )
                        value = float(metric.item())
                        del metric
                    log_event("eval_end", step=step, eval_mse=value)
                # paced: step n ends n x step_s after the start, whatever the step cost
                time.sleep(max(0.0, start + step * args.step_s - time.monotonic()))
    finally:
        hook.close()
    log_event("finished", steps=args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
