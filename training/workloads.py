"""Real PyTorch CPU training loops that run out of host memory the ways real jobs do.

Each scenario trains a small model on random data, one thread, sleeping a little per step so
that a run lasts about 20-90 s and a sampler at 0.25-0.5 s sees its shape. Memory sizes are
absolute and scale with ``--scale``; whether a run OOMs is decided by the limit it runs
under (``cgroup_recorder --limit``), exactly as for a real job that never looks at its limit.

OOM scenarios (each a bug or a schedule seen in real jobs):

- ``leak``: per-token losses kept, with their autograd graphs, in a list for epoch metrics.
- ``growing_seq``: the sequence length grows every few steps (a length curriculum); a
  Transformer with explicit attention (memory quadratic in length) or an LSTM (linear).
- ``growing_batch``: a batch-size ramp on a small CNN.
- ``eval_no_grad``: periodic evaluation without ``torch.no_grad()`` over a hold-out set that
  grows as training streams in, with the last validation loss kept as a tensor (graph and
  all) until the next evaluation.
- ``optimizer_state``: gradual unfreezing of a frozen backbone; Adam creates its state for
  the newly trainable layers on their first step, a staircase that ends at the limit.
- ``checkpoint_spike``: ``torch.save`` of model and optimizer state into memory every few
  steps, the last few snapshots kept for rollback.
- ``fragment_shapes``: variable-length batches (long-tailed lengths, a rising cap) padded
  per batch: a different activation shape every step.

Near misses, which stay under a limit set a little above their peak:

- ``steady``: a fixed-size loop, a sawtooth per step at a high fraction of the limit.
- ``plateau``: an in-memory cache of decoded samples that fills, then stops growing.
- ``spikes``: periodic large no-grad inference batches that come and go.

The OOM scenarios are near misses too under a roomier limit (or fewer ``--steps``).
``python -m oomcast.training.workloads SCENARIO --help`` lists a scenario's knobs.
"""

from __future__ import annotations

import argparse
import io
import math
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

MIB = 1 << 20


# --- shared pieces -------------------------------------------------------------------------


def cgroup_limit_bytes() -> int | None:
    """This process's memory cgroup limit (v1 or v2), or None when unlimited or unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hier, ctrls, path = line.split(":", 2)
        if "memory" in ctrls.split(","):
            f = Path("/sys/fs/cgroup/memory") / path.lstrip("/") / "memory.limit_in_bytes"
        elif hier == "0":
            f = Path("/sys/fs/cgroup") / path.lstrip("/") / "memory.max"
        else:
            continue
        try:
            text = f.read_text().strip()
        except OSError:
            continue
        if text != "max" and int(text) < (1 << 62):
            return int(text)
    return None


class Run:
    """Step pacing and a little progress output (to stderr, a line every few seconds)."""

    def __init__(self, name: str, args: argparse.Namespace) -> None:
        self.name = name
        self.args = args
        self.started = time.monotonic()
        self._last_log = 0.0
        torch.manual_seed(args.seed)
        torch.set_num_threads(1)
        limit = cgroup_limit_bytes()
        lim = f"{limit / MIB:.0f}MiB" if limit else "none"
        self.log(f"start seed={args.seed} steps={args.steps} scale={args.scale} limit={lim}")

    def log(self, msg: str) -> None:
        print(f"[{self.name} {time.monotonic() - self.started:6.1f}s] {msg}", file=sys.stderr)

    def step_done(self, step: int, loss: float, **info: object) -> None:
        now = time.monotonic()
        if now - self._last_log >= self.args.log_every:
            self._last_log = now
            extra = " ".join(f"{k}={v}" for k, v in info.items())
            self.log(f"step {step} loss {loss:.3f} {extra}")
        if self.args.sleep > 0:
            time.sleep(self.args.sleep)

    def finish(self) -> None:
        self.log("done")


def scaled(n: float, scale: float, minimum: int = 1) -> int:
    return max(minimum, round(n * scale))


class Attention(nn.Module):
    """Multi-head self-attention written out, as research code often does: it keeps the
    T x T score and probability tensors for backward, so memory grows with length squared."""

    def __init__(self, d: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        if pad is not None:
            att = att.masked_fill(pad[:, None, None, :], float("-inf"))
        att = self.drop(att.softmax(dim=-1))
        out: torch.Tensor = self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return out


class Block(nn.Module):
    def __init__(self, d: int, heads: int, dropout: float = 0.1) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.att = Attention(d, heads, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.att(self.ln1(x), pad)
        out: torch.Tensor = x + self.ff(self.ln2(x))
        return out


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        x = self.emb(tokens)
        for blk in self.blocks:
            x = blk(x, pad)
        logits: torch.Tensor = self.head(x.mean(dim=1))
        return logits


class TinyLSTM(nn.Module):
    def __init__(self, vocab: int, d: int, layers: int, classes: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=layers, batch_first=True)
        self.head = nn.Linear(d, classes)

    def forward(self, tokens: torch.Tensor, pad: torch.Tensor | None = None) -> torch.Tensor:
        out, _ = self.lstm(self.emb(tokens))
        logits: torch.Tensor = self.head(out.mean(dim=1))
        return logits


def small_cnn(channels: int, classes: int = 10) -> nn.Sequential:
    """A CNN on 3x64x64 images; activations, not parameters, dominate its memory."""
    c = channels
    return nn.Sequential(
        nn.Conv2d(3, c, 3, padding=1),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.Conv2d(c, c, 3, padding=1),
        nn.BatchNorm2d(c),
        nn.ReLU(),
        nn.MaxPool2d(2),
        nn.Conv2d(c, 2 * c, 3, padding=1),
        nn.BatchNorm2d(2 * c),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(4),
        nn.Flatten(),
        nn.Linear(2 * c * 16, classes),
    )


def images(batch: int, classes: int = 10, size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(batch, 3, size, size), torch.randint(0, classes, (batch,))


def train_step(
    model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor
) -> float:
    opt.zero_grad(set_to_none=True)
    loss = F.cross_entropy(model(x), y)
    loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
    opt.step()
    return float(loss.item())


# --- OOM scenarios ---------------------------------------------------------------------


def run_leak(args: argparse.Namespace) -> None:
    """A small language model; after each step the per-token losses are appended to a list
    for the epoch report without .detach(): each keeps its log-softmax (batch x seq x vocab)
    alive through its graph. Cleared at each epoch end (``--epoch-steps``)."""
    run = Run("leak", args)
    vocab, d, seq = args.vocab, 64, 32
    batch = scaled(args.batch, args.scale)
    model = nn.Sequential(nn.Embedding(vocab, d), nn.Linear(d, 4 * d), nn.GELU())
    head = nn.Linear(4 * d, vocab)
    opt = torch.optim.AdamW([*model.parameters(), *head.parameters()], lr=1e-3)
    epoch_token_losses: list[torch.Tensor] = []
    per_step = batch * seq * vocab * 4
    run.log(f"batch={batch} retains ~{per_step / MIB:.1f}MiB per step")
    for step in range(args.steps):
        if args.epoch_steps and step % args.epoch_steps == 0 and epoch_token_losses:
            mean = torch.cat([t.detach() for t in epoch_token_losses]).mean()
            run.log(f"epoch end: mean token loss {float(mean):.3f}")
            epoch_token_losses.clear()
        tokens = torch.randint(0, vocab, (batch, seq + 1))
        logits = head(model(tokens[:, :-1]))
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        opt.step()
        # the bug: per-token losses for the epoch report, still attached to the graph
        tok = F.cross_entropy(
            logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1), reduction="none"
        )
        epoch_token_losses.append(tok)
        run.step_done(step, float(loss.item()), kept=len(epoch_token_losses))
    run.finish()


def _tokens(batch: int, seq: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randint(0, vocab, (batch, seq)), torch.randint(0, 4, (batch,))


def run_growing_seq(args: argparse.Namespace) -> None:
    """Sequence-length curriculum: the length grows by ``--seq-step`` every ``--every``
    steps. With --arch transformer the attention keeps T x T tensors (quadratic growth)."""
    run = Run("growing_seq", args)
    batch = scaled(args.batch, args.scale)
    vocab = 1000
    model: nn.Module
    if args.arch == "lstm":
        model = TinyLSTM(vocab, 128, 2, 4)
    else:
        model = TinyTransformer(vocab, 64, 4, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        seq = args.seq0 + args.seq_step * (step // args.every)
        x, y = _tokens(batch, seq, vocab)
        loss = train_step(model, opt, x, y)
        run.step_done(step, loss, seq=seq)
    run.finish()


def run_growing_batch(args: argparse.Namespace) -> None:
    """Batch-size ramp (as in large-batch warm-up schedules): +``--batch-step`` every
    ``--every`` steps on a small CNN whose activations grow with the batch."""
    run = Run("growing_batch", args)
    model = small_cnn(args.channels)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    b0, db = scaled(args.batch, args.scale), scaled(args.batch_step, args.scale)
    for step in range(args.steps):
        batch = b0 + db * (step // args.every)
        x, y = images(batch)
        loss = train_step(model, opt, x, y)
        run.step_done(step, loss, batch=batch)
    run.finish()


def run_eval_no_grad(args: argparse.Namespace) -> None:
    """Every ``--eval-every`` steps, evaluate on the hold-out set without torch.no_grad():
    the per-batch losses are summed into one tensor, so every batch's activations stay alive
    until the evaluation ends, and the result is kept (graph and all) as ``last_val`` until
    the next one. The hold-out set grows by one batch every ``--holdout-every`` steps."""
    run = Run("eval_no_grad", args)
    model = small_cnn(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = scaled(args.batch, args.scale)
    holdout: list[tuple[torch.Tensor, torch.Tensor]] = []
    last_val: torch.Tensor | None = None
    for step in range(args.steps):
        x, y = images(batch)
        if step % args.holdout_every == 0:
            holdout.append((x, y))  # set aside as it streams in
        loss = train_step(model, opt, x, y)
        if step and step % args.eval_every == 0:
            model.eval()
            total = torch.zeros(())
            for hx, hy in holdout:  # the bug: no torch.no_grad()
                total = total + F.cross_entropy(model(hx), hy, reduction="sum")
            model.train()
            last_val = total / (len(holdout) * batch)
            run.log(f"eval on {len(holdout)} batches: {last_val.item():.3f}")
        run.step_done(step, loss, holdout=len(holdout))
    del last_val
    run.finish()


def run_optimizer_state(args: argparse.Namespace) -> None:
    """Gradual unfreezing of a frozen MLP backbone, top layer first, every ``--every`` steps.
    Each newly trainable layer gets gradients and, on its first optimizer step, Adam's two
    state tensors: the memory climbs in stairs and the last one is created at the limit."""
    run = Run("optimizer_state", args)
    width, layers = scaled(args.width, math.sqrt(args.scale), 8), args.layers
    backbone = nn.ModuleList(nn.Linear(width, width) for _ in range(layers))
    head = nn.Linear(width, 10)
    for p in backbone.parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam(head.parameters(), lr=1e-4)
    per_layer = width * width * 4
    run.log(f"width={width}: each unfrozen layer adds ~{3 * per_layer / MIB:.0f}MiB")
    unfrozen = 0
    for step in range(args.steps):
        if step and step % args.every == 0 and unfrozen < layers:
            layer = backbone[layers - 1 - unfrozen]
            for p in layer.parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(layer.parameters()), "lr": 1e-5})
            unfrozen += 1
            run.log(f"unfroze layer {layers - unfrozen} ({unfrozen} of {layers})")
        x, y = torch.randn(args.batch, width), torch.randint(0, 10, (args.batch,))
        opt.zero_grad(set_to_none=True)
        h = x
        for lin in backbone:
            h = F.relu(lin(h))
        loss = F.cross_entropy(head(h), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        opt.step()  # Adam's state for a new group appears here
        run.step_done(step, float(loss.item()), unfrozen=unfrozen)
    run.finish()


def run_checkpoint_spike(args: argparse.Namespace) -> None:
    """Every ``--every`` steps, model and optimizer state are torch.save'd into memory (a
    BytesIO, then bytes to keep): a spike of about twice the state; the last ``--keep``
    snapshots are kept for rollback, so the floor rises with the first few."""
    run = Run("checkpoint_spike", args)
    width = scaled(args.width, math.sqrt(args.scale), 8)
    model = nn.Sequential(
        nn.Linear(256, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 10)
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    params = sum(p.numel() for p in model.parameters()) * 4
    run.log(f"params {params / MIB:.0f}MiB, a snapshot ~{3 * params / MIB:.0f}MiB")
    snapshots: list[bytes] = []
    for step in range(args.steps):
        x, y = torch.randn(args.batch, 256), torch.randint(0, 10, (args.batch,))
        loss = train_step(model, opt, x, y)
        if step and step % args.every == 0:
            buf = io.BytesIO()
            torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, buf)
            snapshots.append(buf.getvalue())
            del buf
            del snapshots[: -args.keep]
            run.log(f"snapshot at step {step}, keeping {len(snapshots)}")
        run.step_done(step, loss, snapshots=len(snapshots))
    run.finish()


def run_fragment_shapes(args: argparse.Namespace) -> None:
    """Variable-length batches: lengths drawn from a long tail, padded to the longest in the
    batch, under a cap that rises over training. Every step has another activation shape;
    the peaks climb irregularly and the allocator's heap fragments."""
    run = Run("fragment_shapes", args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    batch = scaled(args.batch, args.scale)
    vocab = 1000
    model = TinyTransformer(vocab, 64, 4, 2, 4)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    for step in range(args.steps):
        cap = args.cap0 + (args.cap1 - args.cap0) * step / max(1, args.steps - 1)
        mu = math.log(args.median)
        lens = torch.exp(torch.randn(batch, generator=gen) * args.sigma + mu)
        lens = lens.clamp(8, cap).long()
        t = int(lens.max())
        x = torch.randint(0, vocab, (batch, t), generator=gen)
        pad = torch.arange(t)[None, :] >= lens[:, None]
        y = torch.randint(0, 4, (batch,), generator=gen)
        opt.zero_grad(set_to_none=True)
        loss = F.cross_entropy(model(x, pad), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        opt.step()
        run.step_done(step, float(loss.item()), len=t, cap=int(cap))
    run.finish()


# --- near misses ---------------------------------------------------------------------------


def run_steady(args: argparse.Namespace) -> None:
    """A fixed-size CNN loop: each step's activations come and go, a sawtooth whose top
    sits at the same height all run long."""
    run = Run("steady", args)
    model = small_cnn(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = scaled(args.batch, args.scale)
    for step in range(args.steps):
        x, y = images(batch)
        loss = train_step(model, opt, x, y)
        run.step_done(step, loss, batch=batch)
    run.finish()


def run_plateau(args: argparse.Namespace) -> None:
    """The first epoch decodes and caches every sample in RAM (a common data-loader
    speed-up); once the ``--cache-batches`` are all cached, memory stops growing."""
    run = Run("plateau", args)
    model = small_cnn(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch = scaled(args.batch, args.scale)
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for step in range(args.steps):
        key = step % args.cache_batches
        if key not in cache:
            cache[key] = images(batch)  # "decode" and keep
        x, y = cache[key]
        loss = train_step(model, opt, x, y)
        run.step_done(step, loss, cached=len(cache))
    run.finish()


def run_spikes(args: argparse.Namespace) -> None:
    """Training with a small batch, and every ``--every`` steps a large no-grad inference
    batch (scoring a buffer for hard-example mining): spikes that come and go."""
    run = Run("spikes", args)
    model = small_cnn(16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    batch, big = scaled(args.batch, args.scale), scaled(args.big_batch, args.scale)
    for step in range(args.steps):
        x, y = images(batch)
        loss = train_step(model, opt, x, y)
        if step and step % args.every == 0:
            with torch.no_grad():
                bx, _ = images(big)
                scores = model(bx).softmax(-1).amax(-1)
                del bx
            run.log(f"scored {big} samples, hardest {float(scores.min()):.3f}")
        run.step_done(step, loss)
    run.finish()


# --- command line --------------------------------------------------------------------------

Adder = Callable[[argparse.ArgumentParser], None]
SCENARIOS: dict[str, tuple[Callable[[argparse.Namespace], None], Adder, int, float]] = {}


def _scenario(
    name: str, fn: Callable[[argparse.Namespace], None], steps: int, sleep: float, add: Adder
) -> None:
    SCENARIOS[name] = (fn, add, steps, sleep)


def _opts(**opts: tuple[type, object]) -> Adder:
    def add(p: argparse.ArgumentParser) -> None:
        for key, (typ, default) in opts.items():
            p.add_argument(f"--{key.replace('_', '-')}", type=typ, default=default)

    return add


_scenario(
    "leak", run_leak, 300, 0.1, _opts(batch=(int, 8), vocab=(int, 2000), epoch_steps=(int, 0))
)
_scenario(
    "growing_seq",
    run_growing_seq,
    100,
    0.02,
    _opts(
        batch=(int, 8),
        seq0=(int, 128),
        seq_step=(int, 64),
        every=(int, 8),
        arch=(str, "transformer"),
    ),
)
_scenario(
    "growing_batch",
    run_growing_batch,
    100,
    0.02,
    _opts(batch=(int, 16), batch_step=(int, 16), every=(int, 5), channels=(int, 8)),
)
_scenario(
    "eval_no_grad",
    run_eval_no_grad,
    300,
    0.08,
    _opts(batch=(int, 16), eval_every=(int, 30), holdout_every=(int, 8)),
)
_scenario(
    "optimizer_state",
    run_optimizer_state,
    200,
    0.1,
    _opts(width=(int, 2048), layers=(int, 12), every=(int, 15), batch=(int, 16)),
)
_scenario(
    "checkpoint_spike",
    run_checkpoint_spike,
    175,
    0.1,
    _opts(width=(int, 3072), every=(int, 25), keep=(int, 3), batch=(int, 32)),
)
_scenario(
    "fragment_shapes",
    run_fragment_shapes,
    300,
    0.05,
    _opts(
        batch=(int, 8),
        median=(float, 96.0),
        sigma=(float, 0.6),
        cap0=(int, 256),
        cap1=(int, 640),
    ),
)
_scenario("steady", run_steady, 150, 0.1, _opts(batch=(int, 96)))
_scenario("plateau", run_plateau, 300, 0.1, _opts(batch=(int, 32), cache_batches=(int, 200)))
_scenario(
    "spikes", run_spikes, 300, 0.1, _opts(batch=(int, 16), big_batch=(int, 512), every=(int, 30))
)

OOM_SCENARIOS = (
    "leak",
    "growing_seq",
    "growing_batch",
    "eval_no_grad",
    "optimizer_state",
    "checkpoint_spike",
    "fragment_shapes",
)
NEAR_MISS_SCENARIOS = ("steady", "plateau", "spikes")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m oomcast.training.workloads",
        description="Real PyTorch CPU training loops that OOM (or nearly) the ways jobs do.",
    )
    sub = parser.add_subparsers(dest="scenario", required=True, metavar="SCENARIO")
    for name, (fn, add, steps, sleep) in SCENARIOS.items():
        summary = " ".join(re.split(r"\.\s", fn.__doc__ or "", maxsplit=1)[0].split())
        p = sub.add_parser(name, help=summary)
        p.add_argument("--seed", type=int, default=0)
        p.add_argument("--steps", type=int, default=steps)
        p.add_argument("--scale", type=float, default=1.0, help="multiplies the memory sizes")
        p.add_argument("--sleep", type=float, default=sleep, help="seconds to sleep per step")
        p.add_argument("--log-every", type=float, default=5.0, help="seconds between logs")
        add(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    SCENARIOS[args.scenario][0](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
