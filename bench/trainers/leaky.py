"""A real PyTorch training job (CPU) with a genuine memory leak, instrumented with oomcast's
in-process hook: the workload behind the end-to-end tests of the collectors and actions.

The model is a small MLP regressing a synthetic target; it trains for real (the loss falls).
From step ``--leak-after`` on it makes a common mistake: it keeps every step's output tensor
to compute an epoch-level metric later (``outputs.append(out)`` instead of
``out.detach().cpu()`` of a summary), so each step pins ``batch x width`` floats more. Under a
memory cgroup limit the kernel eventually kills it. With ``--device cuda`` the same loop runs
on a GPU, where ``--memory-fraction`` caps the process
(``torch.cuda.set_per_process_memory_fraction``) so that the leak meets a real CUDA
``OutOfMemoryError`` in seconds rather than after filling the whole card.

It honours checkpoint requests through the hook: when ``hook.checkpoint_requested`` is set
it saves model, optimizer and step to ``--checkpoint-dir`` (write to a temporary name, then
rename, so a kill mid-write never leaves a torn file) and reports ``checkpoint_done``.

    python -m oomcast.bench.trainers.leaky --job leaky --steps 100000 --leak-after 20
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path


def save_checkpoint(directory: Path, step: int, model: object, optimizer: object) -> Path:
    import torch

    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"ckpt-step{step:06d}.pt"
    tmp = path.with_suffix(".pt.tmp")
    torch.save(
        {"step": step, "model": model.state_dict(), "optimizer": optimizer.state_dict()},  # type: ignore[attr-defined]
        tmp,
    )
    os.replace(tmp, path)
    return path


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--job", default=os.environ.get("OOMCAST_JOB", "leaky-trainer"))
    ap.add_argument("--steps", type=int, default=100_000)
    ap.add_argument("--leak-after", type=int, default=20, help="first step that leaks")
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument(
        "--width", type=int, default=1024, help="hidden width; the leak is batch x width"
    )
    ap.add_argument("--step-s", type=float, default=0.05, help="pause per step (data loading)")
    ap.add_argument("--checkpoint-dir", type=Path, default=None)
    ap.add_argument("--device", default="cpu", help="cpu, or cuda (needs a GPU)")
    ap.add_argument(
        "--memory-fraction",
        type=float,
        default=None,
        help="cuda: cap this process at this fraction of the GPU (0-1]",
    )
    ap.add_argument("--no-hook", action="store_true", help="run without oomcast")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    from oomcast.collectors.hook import MemoryHook

    if args.memory_fraction is not None and not 0.0 < args.memory_fraction <= 1.0:
        ap.error(f"--memory-fraction must be in (0, 1], not {args.memory_fraction}")
    if args.memory_fraction is not None and args.device != "cuda":
        ap.error("--memory-fraction caps a GPU: it needs --device cuda")
    device = torch.device(args.device)
    if args.memory_fraction is not None:
        # torch wants an index here (a bare "cuda" device is refused): None is the current one
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction, device.index)
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, args.width),
        torch.nn.ReLU(),
        torch.nn.Linear(args.width, 1),
    ).to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    w_true = torch.randn(64, 1, device=device)
    on_gpu = device.type == "cuda"
    hook = MemoryHook(
        job=args.job,
        enabled=not args.no_hook,
        mode="cuda" if on_gpu else "host",
        device=device if on_gpu else None,
    )
    outputs: list[torch.Tensor] = []  # the bug: every step's activations, kept "for later"
    saved: list[str] = []
    print(f"pid {os.getpid()} job {args.job} hook mode {hook.mode}", flush=True)
    try:
        with hook.guard():
            for step in range(1, args.steps + 1):
                x = torch.randn(args.batch, 64, device=device)
                y = x @ w_true
                hidden = model[:4](x)
                out = model[4](hidden)
                loss = torch.nn.functional.mse_loss(out, y)
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
                opt.step()
                if step >= args.leak_after:
                    outputs.append(hidden)  # batch x width floats (and a graph node) per step
                hook.step()
                if hook.checkpoint_requested:
                    if args.checkpoint_dir is None:  # answer, so the asker need not wait
                        hook.checkpoint_done(None, ok=False)
                        print(f"step {step}: checkpoint asked, no --checkpoint-dir", flush=True)
                    else:
                        path = save_checkpoint(args.checkpoint_dir, step, model, opt)
                        saved.append(str(path))
                        hook.checkpoint_done(str(path))
                        print(f"step {step}: saved {path}", flush=True)
                if step % 50 == 0:
                    print(f"step {step} loss {loss.item():.4f} kept {len(outputs)}", flush=True)
                time.sleep(args.step_s)
    finally:
        hook.close()
    print(f"finished {args.steps} steps; checkpoints: {saved}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
