"""The forecasting network (torch): embedding -> LSTM -> discrete-time survival head.

For every sample the network outputs, per horizon bin (0-5 s, 5-15 s, ... 120-300 s), the
hazard: the probability that the OOM falls in that bin given it has not happened before.
Risk within horizon k is one minus the product of the survival of bins up to k, so it can
never decrease as the horizon grows. Inputs are normalized inside the network (the mean and
scale are buffers fitted on the training split), so the exported graph takes raw
embeddings. Only this module of ``model/`` imports torch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from oomcast.model.embedding import EMBEDDING_VERSION, N_FEATURES
from oomcast.model.forecast import HORIZONS_S


@dataclass
class NetConfig:
    n_features: int = N_FEATURES
    embed_dim: int = 32
    hidden: int = 64
    layers: int = 2
    horizons_s: tuple[int, ...] = field(default_factory=lambda: HORIZONS_S)
    embedding_version: int = EMBEDDING_VERSION

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["horizons_s"] = list(self.horizons_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NetConfig:
        return cls(**{**d, "horizons_s": tuple(d["horizons_s"])})


class OOMForecastNet(nn.Module):
    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("x_mean", torch.zeros(cfg.n_features))
        self.register_buffer("x_scale", torch.ones(cfg.n_features))
        self.embed = nn.Sequential(nn.Linear(cfg.n_features, cfg.embed_dim), nn.GELU())
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden, cfg.layers, batch_first=True)
        self.hazard = nn.Linear(cfg.hidden, len(cfg.horizons_s))

    def set_normalization(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        """A feature that hardly varies in training (a mask that is always 1 there) keeps
        scale 1: dividing by its tiny spread would turn the other value, met in service,
        into an input in the thousands."""
        self.x_mean.copy_(mean)
        self.x_scale.copy_(torch.where(scale < 1e-2, torch.ones_like(scale), scale))

    def log_survival(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (batch, time, features) -> log P(no OOM within horizon k): (batch, time, H)."""
        assert x.dim() == 3 and x.shape[-1] == self.cfg.n_features, x.shape
        # clipped: a value far outside anything seen in training saturates, never explodes
        z = self.embed(torch.clamp((x - self.x_mean) / self.x_scale, -8.0, 8.0))
        out, new_state = self.lstm(z, state)  # (batch, time, hidden)
        logits = self.hazard(out)  # (batch, time, H)
        # log(1 - sigmoid(l)) = -softplus(l); summed over bins: survival up to each horizon
        return torch.cumsum(-nn.functional.softplus(logits), dim=-1), new_state

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        log_s, new_state = self.log_survival(x, state)
        return 1.0 - torch.exp(log_s), new_state

    def zero_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.cfg.layers, batch, self.cfg.hidden)
        return torch.zeros(shape), torch.zeros(shape)


class SequenceModule(nn.Module):
    """The graph exported to ONNX: (x, h, c) -> (risk, h, c), with x: (batch, time,
    features); h, c: (layers, batch, hidden); risk: (batch, time, H). Batch and time are both
    dynamic, so the one graph serves streaming (time = 1, state carried between calls) and
    a whole window at once (zero state in, the window's risks out)."""

    def __init__(self, net: OOMForecastNet) -> None:
        super().__init__()
        self.net = net

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        risk, (h2, c2) = self.net(x, (h, c))
        return risk, h2, c2


def survival_loss(
    log_s: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, pos_weight: float = 1.0
) -> torch.Tensor:
    """Binary cross-entropy of risk per horizon, over the entries ``mask`` marks as known.
    labels: 1 where the OOM came within the horizon; log_s from ``log_survival``."""
    log_risk = torch.log(-torch.expm1(torch.clamp(log_s, max=-1e-6)))
    per = -(pos_weight * labels * log_risk + (1 - labels) * log_s)
    return (per * mask).sum() / mask.sum().clamp(min=1.0)
