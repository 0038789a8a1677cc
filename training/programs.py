"""Real programs for the recorded corpus (``training/record_corpus.py``).

Eleven PyTorch programs of different shapes, each a complete loop that runs on CPU: training
loops (MLP on tabular data, CNN classifier, Transformer and LSTM language models, a conv
autoencoder, a recommender with large embedding tables, a GAN, a CNN fed by a multi-worker
``DataLoader`` that reads its samples from files, and a Hugging Face ``Trainer`` on a small
BERT) and no-grad serving loops (a batched inference server, an embedding indexer). Every
program also does what healthy jobs do: a periodic evaluation under ``no_grad`` and a
checkpoint written to disk, so spikes and page cache are part of every run.

A *cause* can be switched on in any program; each is a way real jobs run out of memory, and
each acts on the program's own tensors:

- ``leak``: a debugging forward hook left on, keeping a layer's output every few steps.
- ``cache``: decoded inputs memoized per sample id (unbounded, or fits: a near miss).
- ``growth``: the batch (or sequence length) ramps up over the run.
- ``step_up``: the batch doubles once, mid-run (a new phase of a curriculum).
- ``eval_spike``: evaluation without ``no_grad`` over a hold-out set that grows.
- ``checkpoint``: ``torch.save`` into memory every few steps, the last few kept.
- ``churn``: a shuffle buffer of variable-size samples whose size cap rises.
- ``neighbour``: a second job (another program of this module) starts in the same cgroup.
- ``none``: nothing; the program as written.

Whether a run OOMs is decided by the limit it runs under, by the kernel. The loop is paced
to ``--duration-s`` (a fixed period per step), so memory per step, not CPU speed, sets how
fast memory moves.

    python -m oomcast.training.programs cnn_classifier --cause leak --steps 300 --duration-s 90
"""

from __future__ import annotations

import argparse
import atexit
import io
import itertools
import math
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oomcast.training.workloads import small_cnn  # the same CNN as the first host traces

MIB = 1 << 20
CAUSES = (
    "none",
    "leak",
    "cache",
    "growth",
    "step_up",
    "eval_spike",
    "checkpoint",
    "churn",
    "neighbour",
)
# The causes whose OOM shows in the stream before it comes (memory grows); the others come
# from one step with no prior change, and are reported apart (``docs/model-card.md``).
GROWTH_CAUSES = ("leak", "cache", "growth", "churn")
SUDDEN_CAUSES = ("step_up", "eval_spike", "checkpoint", "neighbour")


# --- the programs ------------------------------------------------------------------------
class Job:
    """One program: what a step does and which of its tensors the causes may touch."""

    sequence = False  # growth lengthens sequences instead of batches
    trains = True

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.batch = args.batch
        self.model: nn.Module = nn.Identity()
        self.opt: torch.optim.Optimizer | None = None

    def inputs(self, n: int, size: int) -> Any:
        """A batch of ``n`` fresh samples; ``size`` is the sequence length where it applies."""
        raise NotImplementedError

    def loss(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def leak_layer(self) -> nn.Module:
        """The layer whose output a forgotten debugging hook would keep."""
        raise NotImplementedError

    def step(self, batch: Any) -> float:
        if not self.trains:
            with torch.no_grad():
                return float(self.loss(batch))
        assert self.opt is not None
        self.opt.zero_grad(set_to_none=True)
        loss = self.loss(batch)
        loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        self.opt.step()
        return float(loss.item())

    def evaluate(self, batches: list[Any], grad: bool) -> float:
        """Evaluation; ``grad=True`` is the bug: the summed loss keeps every batch's graph."""
        self.model.eval()
        total = torch.zeros(())
        ctx = torch.enable_grad() if grad else torch.no_grad()
        with ctx:
            for b in batches:
                total = total + self.loss(b)
        self.model.train()
        return float(total.detach()) / max(1, len(batches))


def _mlp(widths: Sequence[int]) -> nn.Sequential:
    layers: list[nn.Module] = []
    for a, b in itertools.pairwise(widths):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


class MLPTabular(Job):
    model: nn.Sequential

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.model = _mlp([128, args.width, args.width, args.width, 10])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def inputs(self, n: int, size: int) -> Any:
        return torch.randn(n, 128), torch.randint(0, 10, (n,))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def leak_layer(self) -> nn.Module:
        return self.model[2]


class CNNClassifier(Job):
    model: nn.Sequential

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.model = small_cnn(args.width // 32)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.01, momentum=0.9)

    def inputs(self, n: int, size: int) -> Any:
        return torch.randn(n, 3, 64, 64), torch.randint(0, 10, (n,))

    def loss(self, batch: Any) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.model(x), y)

    def leak_layer(self) -> nn.Module:
        return self.model[2]


class CausalSelfAttention(nn.Module):
    """Attention written out (as research code often is): T x T scores kept for backward."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        att = (q @ k.transpose(-2, -1)) / math.sqrt(d // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool).triu(1)
        att = att.masked_fill(mask, float("-inf")).softmax(-1)
        out: torch.Tensor = self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
        return out


class DecoderBlock(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.att = CausalSelfAttention(d, heads)
        self.ff = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.att(self.ln1(x))
        out: torch.Tensor = x + self.ff(self.ln2(x))
        return out


class TransformerLM(Job):
    sequence = True
    vocab = 2000

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        d = args.width // 4
        self.emb = nn.Embedding(self.vocab, d)
        self.blocks = nn.Sequential(*(DecoderBlock(d, 4) for _ in range(2)))
        self.head = nn.Linear(d, self.vocab)
        self.model = nn.Sequential(self.emb, self.blocks, self.head)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=3e-4)

    def inputs(self, n: int, size: int) -> Any:
        return torch.randint(0, self.vocab, (n, size + 1))

    def loss(self, batch: Any) -> torch.Tensor:
        logits = self.model(batch[:, :-1])
        return F.cross_entropy(logits.reshape(-1, self.vocab), batch[:, 1:].reshape(-1))

    def leak_layer(self) -> nn.Module:
        return self.blocks[0]


class LSTMLM(Job):
    sequence = True
    vocab = 3000

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        d = args.width // 4
        self.emb = nn.Embedding(self.vocab, d)
        self.lstm = nn.LSTM(d, d, num_layers=2, batch_first=True)
        self.head = nn.Linear(d, self.vocab)
        self.model = nn.ModuleList([self.emb, self.lstm, self.head])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def inputs(self, n: int, size: int) -> Any:
        return torch.randint(0, self.vocab, (n, size + 1))

    def loss(self, batch: Any) -> torch.Tensor:
        out, _ = self.lstm(self.emb(batch[:, :-1]))
        logits = self.head(out)
        return F.cross_entropy(logits.reshape(-1, self.vocab), batch[:, 1:].reshape(-1))

    def leak_layer(self) -> nn.Module:
        return self.emb


class ConvAutoencoder(Job):
    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        c = args.width // 32
        self.enc = nn.Sequential(
            nn.Conv2d(3, c, 4, 2, 1), nn.ReLU(), nn.Conv2d(c, 2 * c, 4, 2, 1), nn.ReLU()
        )
        self.dec = nn.Sequential(
            nn.ConvTranspose2d(2 * c, c, 4, 2, 1), nn.ReLU(), nn.ConvTranspose2d(c, 3, 4, 2, 1)
        )
        self.model = nn.Sequential(self.enc, self.dec)
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def inputs(self, n: int, size: int) -> Any:
        return torch.rand(n, 3, 64, 64)

    def loss(self, batch: Any) -> torch.Tensor:
        return F.mse_loss(self.model(batch), batch)

    def leak_layer(self) -> nn.Module:
        return self.enc


class RecSys(Job):
    """Two-tower recommender: large embedding tables, sparse ids, a small MLP on top."""

    users, items = 200_000, 50_000

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        d = 64
        self.user = nn.EmbeddingBag(self.users, d, mode="mean")
        self.item = nn.Embedding(self.items, d)
        self.mlp = _mlp([2 * d, args.width, 1])
        self.model = nn.ModuleList([self.user, self.item, self.mlp])
        self.opt = torch.optim.Adam(self.model.parameters(), lr=1e-3)

    def inputs(self, n: int, size: int) -> Any:
        hist = torch.randint(0, self.users, (n, 20))
        return hist, torch.randint(0, self.items, (n,)), torch.rand(n)

    def loss(self, batch: Any) -> torch.Tensor:
        hist, item, y = batch
        z = torch.cat([self.user(hist), self.item(item)], dim=1)
        return F.binary_cross_entropy_with_logits(self.mlp(z).squeeze(1), y)

    def leak_layer(self) -> nn.Module:
        return self.mlp[0]


class GAN(Job):
    """DCGAN-style generator and discriminator on 32x32 images, two optimizers."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        c = args.width // 16
        self.gen = nn.Sequential(
            nn.ConvTranspose2d(64, 2 * c, 4, 1, 0),
            nn.BatchNorm2d(2 * c),
            nn.ReLU(),
            nn.ConvTranspose2d(2 * c, c, 4, 2, 1),
            nn.BatchNorm2d(c),
            nn.ReLU(),
            nn.ConvTranspose2d(c, 3, 4, 2, 1),
            nn.Upsample(scale_factor=2),
            nn.Tanh(),
        )
        self.disc = nn.Sequential(
            nn.Conv2d(3, c, 4, 2, 1),
            nn.LeakyReLU(0.2),
            nn.Conv2d(c, 2 * c, 4, 2, 1),
            nn.LeakyReLU(0.2),
            nn.Flatten(),
            nn.LazyLinear(1),
        )
        self.disc(torch.zeros(1, 3, 32, 32))
        self.model = nn.ModuleList([self.gen, self.disc])
        self.opt_g = torch.optim.Adam(self.gen.parameters(), lr=2e-4, betas=(0.5, 0.999))
        self.opt = torch.optim.Adam(self.disc.parameters(), lr=2e-4, betas=(0.5, 0.999))

    def inputs(self, n: int, size: int) -> Any:
        return torch.rand(n, 3, 32, 32) * 2 - 1

    def loss(self, batch: Any) -> torch.Tensor:
        z = torch.randn(batch.shape[0], 64, 1, 1)
        fake = self.gen(z)
        real_logit, fake_logit = self.disc(batch), self.disc(fake)
        ones, zeros = torch.ones_like(real_logit), torch.zeros_like(fake_logit)
        return F.binary_cross_entropy_with_logits(
            real_logit, ones
        ) + F.binary_cross_entropy_with_logits(fake_logit, zeros)

    def step(self, batch: Any) -> float:
        assert self.opt is not None
        self.opt.zero_grad(set_to_none=True)
        d_loss = self.loss(batch)
        d_loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        self.opt.step()
        self.opt_g.zero_grad(set_to_none=True)
        fake_logit = self.disc(self.gen(torch.randn(batch.shape[0], 64, 1, 1)))
        g_loss = F.binary_cross_entropy_with_logits(fake_logit, torch.ones_like(fake_logit))
        g_loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        self.opt_g.step()
        return float(d_loss.item())

    def leak_layer(self) -> nn.Module:
        return self.gen[3]


class FileImages(torch.utils.data.Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Images stored one file per shard: reading them fills the page cache, as data does."""

    def __init__(self, folder: Path, shards: int, per_shard: int) -> None:
        self.folder, self.shards, self.per_shard = folder, shards, per_shard

    def __len__(self) -> int:
        return self.shards * self.per_shard

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        shard = torch.load(self.folder / f"{i // self.per_shard}.pt", weights_only=True)
        return shard[i % self.per_shard].float() / 255.0, torch.tensor(i % 10)


class DataLoaderTrain(CNNClassifier):
    """A CNN fed by a two-worker DataLoader that reads its images from files on disk."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.tmp = tempfile.TemporaryDirectory(prefix="oomcast-data-")
        folder = Path(self.tmp.name)
        gen = torch.Generator().manual_seed(args.seed)
        shards, per = 40, 64
        for s in range(shards):
            imgs = torch.randint(0, 256, (per, 3, 64, 64), dtype=torch.uint8, generator=gen)
            torch.save(imgs, folder / f"{s}.pt")
        self.dataset = FileImages(folder, shards, per)
        self.loader = torch.utils.data.DataLoader(
            self.dataset, batch_size=self.batch, shuffle=True, num_workers=2,
            persistent_workers=True, prefetch_factor=2,
        )  # fmt: skip
        self._it = iter(self.loader)

    def inputs(self, n: int, size: int) -> Any:
        if n != self.batch:  # a bigger batch than the loader's: draw more of them
            parts = [self._next() for _ in range(-(-n // self.batch))]
            return torch.cat([p[0] for p in parts])[:n], torch.cat([p[1] for p in parts])[:n]
        return self._next()

    def _next(self) -> Any:
        try:
            return next(self._it)
        except StopIteration:
            self._it = iter(self.loader)
            return next(self._it)


class InferenceServer(Job):
    """Batched no-grad inference: requests of varying batch size through a small encoder."""

    sequence = True
    trains = False
    vocab = 5000
    model: nn.Sequential

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        d = args.width // 4
        self.model = nn.Sequential(
            nn.Embedding(self.vocab, d), *(DecoderBlock(d, 4) for _ in range(2)), nn.Linear(d, 8)
        )
        self.model.eval()
        self.rng = random.Random(args.seed)

    def inputs(self, n: int, size: int) -> Any:
        burst = max(1, int(n * self.rng.uniform(0.3, 1.7)))  # load varies request by request
        return torch.randint(0, self.vocab, (burst, size))

    def loss(self, batch: Any) -> torch.Tensor:
        top: torch.Tensor = self.model(batch).softmax(-1).amax(-1).mean()
        return top

    def leak_layer(self) -> nn.Module:
        return self.model[1]


class EmbedIndexer(InferenceServer):
    """Encodes a stream of documents and appends their vectors to an index, flushed to a
    file on disk every ``--flush-every`` steps (the ``cache`` cause never flushes)."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__(args)
        self.index: list[torch.Tensor] = []
        self.flush_every = args.flush_every
        fd, self.out_path = tempfile.mkstemp(prefix="oomcast-index-")
        os.close(fd)
        atexit.register(Path(self.out_path).unlink, missing_ok=True)
        self.steps = 0

    def step(self, batch: Any) -> float:
        with torch.no_grad():
            h = self.model[:-1](batch)  # (batch, time, d)
            self.index.append(torch.cat([h.mean(1), h.amax(1), h[:, -1]], dim=1).repeat(1, 8))
        self.steps += 1
        if self.flush_every and self.steps % self.flush_every == 0:
            torch.save(torch.cat(self.index), self.out_path)
            self.index.clear()
        return float(len(self.index))


class HFBert(Job):
    """A Hugging Face ``Trainer`` fine-tuning a small, randomly initialised BERT classifier
    (nothing downloaded): a program whose loop none of this code wrote. Run by ``main`` as
    a whole, since ``Trainer.train`` owns the loop; the causes act through its hooks."""

    sequence = True


PROGRAMS: dict[str, Callable[[argparse.Namespace], Job]] = {
    "mlp_tabular": MLPTabular,
    "cnn_classifier": CNNClassifier,
    "transformer_lm": TransformerLM,
    "lstm_lm": LSTMLM,
    "autoencoder": ConvAutoencoder,
    "recsys": RecSys,
    "gan": GAN,
    "dataloader_train": DataLoaderTrain,
    "inference_server": InferenceServer,
    "embed_indexer": EmbedIndexer,
    "hf_bert": HFBert,
}


# --- the causes --------------------------------------------------------------------------
class Cause:
    """What a cause does to the loop: the size of the next batch, and what happens after."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        self.args, self.job = args, job
        self.kept: list[Any] = []

    def size(self, step: int) -> tuple[int, int]:
        """(batch, sequence length) for ``step``."""
        return self.job.batch, self.args.seq

    def before(self, step: int) -> None:
        pass

    def after(self, step: int) -> None:
        pass


class Leak(Cause):
    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        super().__init__(args, job)
        self.armed = False

        def hook(_m: nn.Module, _i: Any, out: Any) -> None:
            if self.armed:
                self.kept.append((out[0] if isinstance(out, tuple) else out).detach().clone())

        job.leak_layer().register_forward_hook(hook)

    def before(self, step: int) -> None:
        self.armed = step >= self.args.onset and step % self.args.every == 0


class Growth(Cause):
    def size(self, step: int) -> tuple[int, int]:
        a = self.args
        ramp = max(0.0, (step - a.onset) / max(1, a.steps - a.onset))
        factor = 1.0 + a.amount * ramp
        if self.job.sequence:
            return self.job.batch, max(4, round(a.seq * factor))
        return max(1, round(self.job.batch * factor)), a.seq


class StepUp(Cause):
    def size(self, step: int) -> tuple[int, int]:
        a = self.args
        factor = 1.0 + a.amount if step >= a.onset else 1.0
        if self.job.sequence:
            return self.job.batch, max(4, round(a.seq * factor))
        return max(1, round(self.job.batch * factor)), a.seq


class Cache(Cause):
    """Inputs memoized per sample id: ids drawn from ``--amount`` x 100 distinct ones."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        super().__init__(args, job)
        self.memo: dict[int, Any] = {}
        self.ids = max(1, int(args.amount * 100))
        self.rng = random.Random(args.seed + 7)
        if isinstance(job, EmbedIndexer):
            job.flush_every = 0  # the indexer's own cache: an index never flushed

    def after(self, step: int) -> None:
        if step < self.args.onset or isinstance(self.job, EmbedIndexer):
            return
        for _ in range(max(1, self.job.batch // 4)):
            key = self.rng.randrange(self.ids)
            if key not in self.memo:
                self.memo[key] = self.job.inputs(4, self.args.seq)


class EvalSpike(Cause):
    """Every ``--every`` steps, evaluation with autograd on; the hold-out set grows by a
    batch every ``--every // 2`` steps from ``--onset``, starting with ``--amount`` batches."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        super().__init__(args, job)
        self.holdout = [job.inputs(job.batch, args.seq) for _ in range(max(1, int(args.amount)))]

    def after(self, step: int) -> None:
        a = self.args
        if step >= a.onset and step % max(1, a.every // 2) == 0:
            self.holdout.append(self.job.inputs(self.job.batch, a.seq))
        if step >= a.onset and step % a.every == 0:
            self.job.evaluate(self.holdout, grad=True)


class Checkpoint(Cause):
    """Every ``--every`` steps the state is serialized into memory; the last
    ``--amount`` snapshots are kept for rollback."""

    def after(self, step: int) -> None:
        a = self.args
        if step < a.onset or step % a.every:
            return
        buf = io.BytesIO()
        state: dict[str, Any] = {"model": self.job.model.state_dict()}
        if self.job.opt is not None:
            state["optim"] = self.job.opt.state_dict()
        torch.save(state, buf)
        self.kept.append(bytearray(buf.getbuffer()))
        del self.kept[: -max(1, int(a.amount))]


class Churn(Cause):
    """A shuffle buffer of 200 variable-length samples (long-tailed lengths) whose length
    cap rises from 64 KiB to ``--amount`` MiB over the run: a different size every time."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        super().__init__(args, job)
        self.rng = random.Random(args.seed + 11)

    def after(self, step: int) -> None:
        a = self.args
        if step < a.onset:
            return
        ramp = (step - a.onset) / max(1, a.steps - a.onset)
        cap = 64 * 1024 + ramp * a.amount * MIB
        for _ in range(8):
            n = int(min(cap, self.rng.lognormvariate(math.log(cap / 4), 0.8))) // 4
            self.kept.append(torch.empty(max(16, n)).uniform_())
        while len(self.kept) > 200:
            self.kept.pop(self.rng.randrange(len(self.kept)))


class Neighbour(Cause):
    """At ``--onset`` another job (``--neighbour`` program) starts in the same cgroup."""

    def __init__(self, args: argparse.Namespace, job: Job) -> None:
        super().__init__(args, job)
        self.proc: subprocess.Popen[bytes] | None = None

    def after(self, step: int) -> None:
        a = self.args
        if step != a.onset or self.proc is not None:
            return
        remaining = (a.steps - step) * a.duration_s / max(1, a.steps)
        cmd = [
            sys.executable, "-m", "oomcast.training.programs", a.neighbour,
            "--seed", str(a.seed + 1), "--steps", str(max(10, a.steps - step)),
            "--duration-s", f"{remaining:.1f}", "--batch", str(int(a.batch * a.amount)),
        ]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

    def close(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=30)


CAUSE_CLASSES: dict[str, Callable[[argparse.Namespace, Job], Cause]] = {
    "none": Cause,
    "leak": Leak,
    "cache": Cache,
    "growth": Growth,
    "step_up": StepUp,
    "eval_spike": EvalSpike,
    "checkpoint": Checkpoint,
    "churn": Churn,
    "neighbour": Neighbour,
}


# --- the loop ----------------------------------------------------------------------------
def run(args: argparse.Namespace) -> None:
    torch.manual_seed(args.seed)
    torch.set_num_threads(1)
    if args.program == "hf_bert":
        run_hf(args)
        return
    job = PROGRAMS[args.program](args)
    cause = CAUSE_CLASSES[args.cause](args, job)
    period_s = args.duration_s / max(1, args.steps)
    ckpt = Path(tempfile.gettempdir()) / f"oomcast-ckpt-{os.getpid()}.pt"
    held_out = [job.inputs(job.batch, args.seq) for _ in range(2)]
    started = time.monotonic()
    try:
        for step in range(args.steps):
            cause.before(step)
            batch, seq = cause.size(step)
            job.step(job.inputs(batch, seq))
            cause.after(step)
            if step and step % args.eval_every == 0:
                job.evaluate(held_out, grad=False)  # the healthy evaluation
            if step and step % args.ckpt_every == 0 and job.trains:
                torch.save(job.model.state_dict(), ckpt)  # the healthy checkpoint, to disk
            if step % 50 == 0:
                print(f"[{args.program}/{args.cause}] step {step} batch {batch} seq {seq}",
                      file=sys.stderr, flush=True)  # fmt: skip
            wait = started + (step + 1) * period_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)
    finally:
        if isinstance(cause, Neighbour):
            cause.close()
        ckpt.unlink(missing_ok=True)


def run_hf(args: argparse.Namespace) -> None:
    """The Hugging Face ``Trainer`` loop. Causes through its own extension points: a
    ``compute_loss`` that keeps outputs (leak), a collator whose padding length ramps
    (growth, step_up), evaluation that accumulates every logit (eval_spike: the Trainer's
    default without ``eval_accumulation_steps``), in-memory snapshots from a callback."""
    import transformers
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]  # unannotated
    # num_labels goes to PretrainedConfig through **kwargs, which BertConfig's typed
    # dataclass signature does not show
    cfg = BertConfig(  # type: ignore[call-arg]
        vocab_size=8000, hidden_size=args.width // 4, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=args.width, num_labels=4,
        max_position_embeddings=2048,
    )  # fmt: skip
    model = BertForSequenceClassification(cfg)
    gen = torch.Generator().manual_seed(args.seed)
    progress = {"step": 0}
    period_s = args.duration_s / max(1, args.steps)
    cause = args.cause

    def length() -> int:
        step, a = progress["step"], args
        seq: int = a.seq
        amount: float = a.amount
        onset: int = a.onset
        steps: int = a.steps
        if cause == "growth" and step >= onset:
            return round(seq * (1 + amount * (step - onset) / max(1, steps - onset)))
        if cause == "step_up" and step >= onset:
            return round(seq * (1 + amount))
        return int(seq)

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"label": torch.tensor(i % 4)}

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        t = length()
        ids = torch.randint(0, 8000, (len(items), t), generator=gen)
        return {"input_ids": ids, "labels": torch.stack([it["label"] for it in items])}

    kept: list[Any] = []

    class Bench(Trainer):
        def compute_loss(self, model: Any, inputs: Any, *a: Any, **kw: Any) -> Any:
            out = super().compute_loss(model, inputs, *a, **kw)
            step = progress["step"]
            if cause == "leak" and step >= args.onset and step % args.every == 0:
                kept.append(model.bert.embeddings.word_embeddings(inputs["input_ids"]).detach())
            return out

    run_args = args  # on_step_end's own ``args`` are the Trainer's (TrainerCallback's names)

    class Pace(TrainerCallback):
        started = time.monotonic()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            progress["step"] = state.global_step
            step = state.global_step
            a = run_args
            if cause == "checkpoint" and step >= a.onset and step % a.every == 0:
                buf = io.BytesIO()
                torch.save(model.state_dict(), buf)
                kept.append(bytearray(buf.getbuffer()))
                del kept[: -max(1, int(a.amount))]
            wait = self.started + state.global_step * period_s - time.monotonic()
            if wait > 0:
                time.sleep(wait)

    eval_n = args.batch * (int(args.amount) * 40 if cause == "eval_spike" else 4)
    targs = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="oomcast-hf-"), max_steps=args.steps,
        per_device_train_batch_size=args.batch, per_device_eval_batch_size=args.batch,
        eval_strategy="steps", eval_steps=args.every if cause == "eval_spike" else args.eval_every,
        save_strategy="no", logging_strategy="no", report_to=[], use_cpu=True,
        dataloader_num_workers=0, disable_tqdm=True, seed=args.seed,
    )  # fmt: skip
    Bench(
        model=model, args=targs, train_dataset=Tokens(10**6), eval_dataset=Tokens(eval_n),
        data_collator=collate, callbacks=[Pace()],
    ).train()  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m oomcast.training.programs",
        description="Real PyTorch programs (CPU) with switchable causes of OOM, for the corpus.",
    )
    p.add_argument("program", choices=sorted(PROGRAMS))
    p.add_argument("--cause", choices=CAUSES, default="none")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--duration-s", type=float, default=60.0, help="pace the steps over this")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=64, help="sequence length (sequence programs)")
    p.add_argument("--width", type=int, default=512, help="model width")
    p.add_argument("--onset", type=int, default=0, help="step at which the cause starts")
    p.add_argument("--every", type=int, default=5, help="period of the cause, in steps")
    p.add_argument("--amount", type=float, default=1.0, help="the cause's size (see above)")
    p.add_argument("--eval-every", type=int, default=50)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--flush-every", type=int, default=20, help="embed_indexer: index flushes")
    p.add_argument("--neighbour", default="mlp_tabular", help="the neighbour's program")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    run(build_parser().parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
