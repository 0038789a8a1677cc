"""The ground-truth set for preflight: small training jobs of different families.

Each :class:`ZooRow` is a :class:`~oomcast.preflight.job.PreflightJob` and the two batch
sizes it is measured at. Every job is small enough to run for real on a CPU in a second or
two, so the preflight's fake-tensor capture can be compared with a real run
(``oomcast.bench.preflight.accuracy``) and, when a GPU is lent, with real CUDA runs
(``oomcast.bench.preflight.gpu``).

Batches are built from shapes only (``torch.randn`` / ``torch.randint`` at the default
device), so the same code runs under fake tensors, which have no values. Nothing here
branches on a tensor's value. The one job whose sequence length varies draws it from a
``random.Random`` seeded by the step, so a fake run and a real run see the same lengths.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from oomcast.preflight.job import PreflightJob

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ZooRow:
    """One job of the ground-truth set and the two batch sizes it is measured at."""

    family: str
    job: PreflightJob
    batch_sizes: tuple[int, int]

    @property
    def name(self) -> str:
        return self.job.name


def _classes(batch_size: int, n: int) -> torch.Tensor:
    return torch.randint(0, n, (batch_size,))


def _xent(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    return F.cross_entropy(model(x), y)


def _lm_xent(model: nn.Module, batch: Batch) -> torch.Tensor:
    x, y = batch
    logits = model(x)  # (batch, time, vocab)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))


def _tokens(vocab: int, seq: int) -> Callable[[int, int], Batch]:
    def batch(batch_size: int, step: int) -> Batch:
        x = torch.randint(0, vocab, (batch_size, seq))
        return x, torch.randint(0, vocab, (batch_size, seq))

    return batch


def _sgd(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _adamw(params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


# -- MLP ------------------------------------------------------------------------------------


def _mlp(dim: int = 256, hidden: int = 512) -> nn.Module:
    return nn.Sequential(
        nn.Linear(dim, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(),
        nn.Linear(hidden, 10),
    )  # fmt: skip


def _mlp_batch(batch_size: int, step: int) -> Batch:
    return torch.randn(batch_size, 256), _classes(batch_size, 10)


# -- CNNs (by hand: no torchvision) ---------------------------------------------------------


def _cnn_bn() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1), nn.BatchNorm2d(16), nn.ReLU(), nn.MaxPool2d(2),
        nn.Conv2d(16, 32, 3, padding=1), nn.BatchNorm2d(32), nn.ReLU(), nn.MaxPool2d(2),
        nn.Flatten(), nn.Linear(32 * 8 * 8, 10),
    )  # fmt: skip


def _images(side: int) -> Callable[[int, int], Batch]:
    def batch(batch_size: int, step: int) -> Batch:
        return torch.randn(batch_size, 3, side, side), _classes(batch_size, 10)

    return batch


class _BasicBlock(nn.Module):
    """ResNet's basic block: two 3x3 convolutions and a shortcut (1x1 when the shape changes)."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        result: torch.Tensor = F.relu(out + self.shortcut(x))
        return result


def _resnet() -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
        _BasicBlock(16, 16, 1), _BasicBlock(16, 32, 2), _BasicBlock(32, 64, 2),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
    )  # fmt: skip


# -- recurrent ------------------------------------------------------------------------------


class _LSTMLM(nn.Module):
    def __init__(self, vocab: int = 2000, dim: int = 96, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))  # (batch, time, dim)
        logits: torch.Tensor = self.head(out)
        return logits


class _Seq2Seq(nn.Module):
    """GRU encoder-decoder with teacher forcing; ``generate`` decodes greedily."""

    def __init__(self, vocab: int = 1000, dim: int = 96) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.encoder = nn.GRU(dim, dim, batch_first=True)
        self.decoder = nn.GRU(dim, dim, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        _, h = self.encoder(self.embed(src))  # h: (1, batch, dim)
        out, _ = self.decoder(self.embed(tgt), h)
        logits: torch.Tensor = self.head(out)
        return logits

    def generate(self, src: torch.Tensor, length: int) -> torch.Tensor:
        _, h = self.encoder(self.embed(src))
        token = src[:, :1]
        outs = []
        for _ in range(length):
            out, h = self.decoder(self.embed(token), h)
            token = self.head(out).argmax(-1)  # (batch, 1)
            outs.append(token)
        return torch.cat(outs, dim=1)


def _s2s_batch(batch_size: int, step: int) -> Batch:
    return torch.randint(0, 1000, (batch_size, 24)), torch.randint(0, 1000, (batch_size, 20))


def _s2s_loss(model: nn.Module, batch: Batch) -> torch.Tensor:
    src, tgt = batch
    logits = model(src, tgt[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), tgt[:, 1:].reshape(-1))


def _s2s_eval(model: nn.Module, batch: Batch) -> Any:
    assert isinstance(model, _Seq2Seq)
    return model.generate(batch[0], 12)


# -- transformers ---------------------------------------------------------------------------


class _Encoder(nn.Module):
    """BERT-like: torch's TransformerEncoder over token embeddings, a token-level head."""

    def __init__(self, vocab: int = 1000, dim: int = 64, layers: int = 2, heads: int = 4) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(1, 128, dim))
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.1, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x) + self.pos[:, : x.shape[1]]
        logits: torch.Tensor = self.head(self.encoder(h))
        return logits


class _CausalBlock(nn.Module):
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.ln2 = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        # (batch, heads, time, head_dim)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        out: torch.Tensor = x + self.mlp(self.ln2(x))
        return out


class _GPT(nn.Module):
    """nanoGPT-shaped decoder: tied embeddings, causal SDPA; optional gradient checkpointing."""

    def __init__(
        self, vocab: int = 1000, dim: int = 64, layers: int = 2, heads: int = 4,
        ctx: int = 128, grad_checkpoint: bool = False,
    ) -> None:  # fmt: skip
        super().__init__()
        self.wte = nn.Embedding(vocab, dim)
        self.wpe = nn.Embedding(ctx, dim)
        self.blocks = nn.ModuleList(_CausalBlock(dim, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.wte.weight
        self.grad_checkpoint = grad_checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        t = x.shape[1]
        h = self.wte(x) + self.wpe(torch.arange(t, device=x.device))
        for block in self.blocks:
            if self.grad_checkpoint and self.training:
                # preserve_rng_state=False: there is no dropout, and a fake CUDA device has
                # no RNG state to save.
                h = checkpoint(block, h, use_reentrant=False, preserve_rng_state=False)
            else:
                h = block(h)
        logits: torch.Tensor = self.head(self.ln_f(h))
        return logits


def varlen_seq(step: int, low: int = 8, high: int = 64) -> int:
    """The sequence length of a step of the variable-length job (the same in every run)."""
    return random.Random(1000 + step).randint(low, high)


def _varlen_batch(batch_size: int, step: int) -> Batch:
    seq = varlen_seq(step)
    return torch.randint(0, 1000, (batch_size, seq)), torch.randint(0, 1000, (batch_size, seq))


# -- recommender ----------------------------------------------------------------------------


class _Recommender(nn.Module):
    """DLRM-like: large embedding tables for a few sparse features, a small dense tower."""

    def __init__(self, rows: tuple[int, ...] = (20000, 10000, 5000), dim: int = 32) -> None:
        super().__init__()
        self.tables = nn.ModuleList(nn.Embedding(n, dim) for n in rows)
        self.bottom = nn.Sequential(nn.Linear(13, 64), nn.ReLU(), nn.Linear(64, dim))
        self.top = nn.Sequential(
            nn.Linear(dim * (len(rows) + 1), 128), nn.ReLU(), nn.Linear(128, 1)
        )
        self.rows = rows

    def forward(self, dense: torch.Tensor, sparse: torch.Tensor) -> torch.Tensor:
        feats = [self.bottom(dense)]
        feats += [table(sparse[:, i]) for i, table in enumerate(self.tables)]
        out: torch.Tensor = self.top(torch.cat(feats, dim=1)).squeeze(1)
        return out


_REC_ROWS = (20000, 10000, 5000)


def _rec_batch(batch_size: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    sparse = torch.stack([torch.randint(0, n, (batch_size,)) for n in _REC_ROWS], dim=1)
    return torch.randn(batch_size, 13), sparse, torch.rand(batch_size)


def _rec_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> Any:
    dense, sparse, label = batch
    return F.binary_cross_entropy_with_logits(model(dense, sparse), label)


# -- the set --------------------------------------------------------------------------------


def _row(family: str, batch_sizes: tuple[int, int], **job: Any) -> ZooRow:
    return ZooRow(family, PreflightJob(batch_size=batch_sizes[0], **job), batch_sizes)


def build_zoo() -> list[ZooRow]:
    """The ground-truth set, in a fixed order."""
    lm = _tokens(2000, 32)
    return [
        _row("mlp", (64, 1024), name="mlp", model=_mlp, batch=_mlp_batch, loss=_xent),
        _row("cnn", (16, 64), name="cnn_bn", model=_cnn_bn, batch=_images(32), loss=_xent,
             optimizer=_sgd, checkpoint="cpu_copy"),
        _row("cnn", (8, 32), name="resnet", model=_resnet, batch=_images(32), loss=_xent),
        _row("rnn", (8, 32), name="lstm_lm", model=_LSTMLM, batch=lm, loss=_lm_xent),
        _row("rnn", (8, 32), name="gru_seq2seq", model=_Seq2Seq, batch=_s2s_batch,
             loss=_s2s_loss, eval_step=_s2s_eval, checkpoint="none"),
        _row("transformer", (8, 32), name="encoder", model=_Encoder,
             batch=_tokens(1000, 48), loss=_lm_xent, optimizer=_adamw),
        _row("transformer", (8, 32), name="gpt", model=_GPT, batch=_tokens(1000, 48),
             loss=_lm_xent, optimizer=_adamw),
        _row("transformer", (8, 32), name="gpt_varlen", model=_GPT, batch=_varlen_batch,
             loss=_lm_xent),
        _row("transformer", (8, 32), name="gpt_grad_ckpt",
             model=lambda: _GPT(layers=4, grad_checkpoint=True), batch=_tokens(1000, 64),
             loss=_lm_xent),
        _row("mlp", (32, 256), name="mlp_eval_grad", model=lambda: _mlp(256, 1024),
             batch=_mlp_batch, loss=_xent, eval_batch_size=512, eval_no_grad=False,
             checkpoint="none"),
        _row("mlp", (16, 64), name="wide_device_ckpt", model=lambda: _mlp(256, 2048),
             batch=_mlp_batch, loss=_xent, checkpoint="device_copy"),
        _row("recsys", (128, 512), name="recommender", model=_Recommender, batch=_rec_batch,
             loss=_rec_loss),
        _row("transformer", (8, 32), name="encoder_accum", model=_Encoder,
             batch=_tokens(1000, 48), loss=_lm_xent, grad_accum=2, checkpoint="cpu_copy"),
    ]  # fmt: skip


def zoo_row(name: str) -> ZooRow:
    """One row of the set by job name."""
    rows = {r.name: r for r in build_zoo()}
    if name not in rows:
        raise ValueError(f"no zoo job named {name!r}; choose one of {', '.join(rows)}")
    return rows[name]
