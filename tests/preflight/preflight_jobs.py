"""Jobs for the preflight tests, with sizes whose memory is easy to reason about.

``wide_mlp``: ``layers`` bias-free ``Linear(width, width)`` (ReLU between), so the
parameters are ``layers * width**2 * 4`` bytes, Adam's state twice that, the gradients as
much again; the activations of a batch ``b`` are ``b * width * 4`` bytes per layer.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from oomcast.preflight import PreflightJob

MIB = 1 << 20


def _mlp(width: int, layers: int) -> nn.Module:
    mods: list[nn.Module] = []
    for i in range(layers):
        mods.append(nn.Linear(width, width, bias=False))
        if i < layers - 1:
            mods.append(nn.ReLU())
    return nn.Sequential(*mods)


def _mlp_batch(width: int) -> Any:
    def batch(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(size, width), torch.randint(0, width, (size,))

    return batch


def _ce(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return nn.functional.cross_entropy(model(batch[0]), batch[1])


def wide_mlp(width: int = 4096, layers: int = 8, batch_size: int = 8, **kw: Any) -> PreflightJob:
    return PreflightJob(
        name=f"mlp{layers}x{width}",
        model=lambda: _mlp(width, layers),
        batch=_mlp_batch(width),
        loss=_ce,
        batch_size=batch_size,
        **kw,
    )


def param_bytes(width: int = 4096, layers: int = 8) -> int:
    return layers * width * width * 4


def small_mlp() -> PreflightJob:
    """An --entry target: small enough to run in well under a second."""
    return wide_mlp(width=256, layers=3, batch_size=32)


class TinyLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True, dropout=0.0)
            for _ in range(layers)
        )
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # (batch, time) -> (batch, time, vocab)
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        out: torch.Tensor = self.head(h)
        return out


def lm_job(
    vocab: int = 1000,
    dim: int = 64,
    layers: int = 2,
    heads: int = 4,
    seq: int = 32,
    batch_size: int = 4,
    **kw: Any,
) -> PreflightJob:
    def batch(size: int, step: int) -> torch.Tensor:
        return torch.randint(0, vocab, (size, seq + 1))

    def loss(model: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = model(tokens[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    return PreflightJob(
        name=f"lm{layers}x{dim}",
        model=lambda: TinyLM(vocab, dim, layers, heads),
        batch=batch,
        loss=loss,
        batch_size=batch_size,
        **kw,
    )


def big_lm() -> PreflightJob:
    """About 8.3 billion parameters (33 GB in fp32), more than this machine's 24 GB of RAM:
    40 layers of width 4096 (12 * 4096**2 parameters each) and a 32000-token vocabulary."""
    return lm_job(vocab=32000, dim=4096, layers=40, heads=32, seq=512, batch_size=4)
