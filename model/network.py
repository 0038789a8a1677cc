"""The forecasting network (torch): embedding -> LSTM -> survival head and time-to-OOM head.

For every step the network outputs, per horizon bin (0-5 s, 5-15 s, ... 120-300 s), the
hazard: the probability that the OOM falls in that bin given it has not happened before.
Risk within horizon k is one minus the product of the survival of bins up to k. A second
head estimates the time to the OOM (log seconds), trained only where an OOM followed: it
answers "if this ends in an OOM, when?", and the runtime reports it only when the risk
says an OOM is in sight. Risks are calibrated per horizon after training (Platt scaling on
the validation split, ``calibrate``), then made non-decreasing across horizons.

The LSTM steps at most once per ``tick_s`` of trace time (``docs/design.md``): a domain
sampled at 10 Hz and one sampled at 1 Hz advance the same number of steps per minute, and
every feature is a function of trace time, so the same curve gives the same forecast.
Inputs are normalized inside the network (the mean and scale are buffers fitted on the
training split), so the exported graph takes raw embeddings. Only this module of
``model/`` imports torch.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import partial
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
    tick_s: float = 1.0  # the LSTM advances once per tick of trace time, at most

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["horizons_s"] = list(self.horizons_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NetConfig:
        return cls(**{**d, "horizons_s": tuple(d["horizons_s"])})


class OOMForecastNet(nn.Module):
    # buffers (register_buffer): declared so that they type as tensors, not as whatever
    # nn.Module.__getattr__ may return
    x_mean: torch.Tensor
    x_scale: torch.Tensor
    cal_a: torch.Tensor
    cal_b: torch.Tensor

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("x_mean", torch.zeros(cfg.n_features))
        self.register_buffer("x_scale", torch.ones(cfg.n_features))
        self.embed = nn.Sequential(nn.Linear(cfg.n_features, cfg.embed_dim), nn.GELU())
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden, cfg.layers, batch_first=True)
        self.hazard = nn.Linear(cfg.hidden, len(cfg.horizons_s))
        self.tto = nn.Linear(cfg.hidden, 1)  # log seconds to the OOM, if one follows
        self.register_buffer("cal_a", torch.ones(len(cfg.horizons_s)))
        self.register_buffer("cal_b", torch.zeros(len(cfg.horizons_s)))

    def set_normalization(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        """A feature that hardly varies in training (a mask that is always 1 there) keeps
        scale 1: dividing by its tiny spread would turn the other value, met in service,
        into an input in the thousands."""
        self.x_mean.copy_(mean)
        self.x_scale.copy_(torch.where(scale < 1e-2, torch.ones_like(scale), scale))

    def heads(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (batch, time, features) -> (log P(no OOM within horizon k): (batch, time, H),
        log seconds to the OOM: (batch, time), new state). Uncalibrated: for training."""
        assert x.dim() == 3 and x.shape[-1] == self.cfg.n_features, x.shape
        # clipped: a value far outside anything seen in training saturates, never explodes
        z = self.embed(torch.clamp((x - self.x_mean) / self.x_scale, -8.0, 8.0))
        out, new_state = self.lstm(z, state)  # (batch, time, hidden)
        logits = self.hazard(out)  # (batch, time, H)
        # log(1 - sigmoid(l)) = -softplus(l); summed over bins: survival up to each horizon
        log_s = torch.cumsum(-nn.functional.softplus(logits), dim=-1)
        log_tto = self.tto(out).squeeze(-1)
        return log_s, log_tto, new_state

    def log_survival(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        log_s, _, new_state = self.heads(x, state)
        return log_s, new_state

    def calibrated(self, log_s: torch.Tensor) -> torch.Tensor:
        """Risk per horizon from log survival, through the fitted calibration, made
        non-decreasing across horizons (a calibrated curve may not be by itself)."""
        risk = (1.0 - torch.exp(log_s)).clamp(1e-6, 1 - 1e-6)  # ops ONNX has (no expm1, logit)
        z = (torch.log(risk) - torch.log(1.0 - risk)) * self.cal_a + self.cal_b
        risk = torch.sigmoid(z)
        cols = [risk[..., 0]]
        for k in range(1, risk.shape[-1]):
            cols.append(torch.maximum(cols[-1], risk[..., k]))
        return torch.stack(cols, dim=-1)

    def forward(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        log_s, _, new_state = self.heads(x, state)
        return self.calibrated(log_s), new_state

    def zero_state(self, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        shape = (self.cfg.layers, batch, self.cfg.hidden)
        return torch.zeros(shape), torch.zeros(shape)


class SequenceModule(nn.Module):
    """The graph exported to ONNX: (x, h, c) -> (risk, tto_s, h, c), with x: (batch, time,
    features); h, c: (layers, batch, hidden); risk: (batch, time, H); tto_s: (batch, time)
    seconds. Batch and time are both dynamic; the service streams with time = 1, carrying
    each domain's state between calls and committing it once per tick."""

    def __init__(self, net: OOMForecastNet) -> None:
        super().__init__()
        self.net = net

    def forward(
        self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        log_s, log_tto, (h2, c2) = self.net.heads(x, (h, c))
        return self.net.calibrated(log_s), torch.exp(log_tto.clamp(-2.0, 9.0)), h2, c2


def tto_loss(log_tto: torch.Tensor, tto_s: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """L1 on log seconds where ``mask`` marks a known time to OOM: its minimizer is the
    median, so the error it leaves is a relative one."""
    err = (log_tto - torch.log(tto_s.clamp(min=0.5))).abs()
    return (err * mask).sum() / mask.sum().clamp(min=1.0)


def fit_calibration(
    net: OOMForecastNet, log_s: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor
) -> None:
    """Platt scaling per horizon: a > 0 and b minimizing the log loss of sigmoid(a *
    logit(risk) + b) on held-out (log survival, label, known) triples of shape (n, H). The
    slope is fitted as exp(alpha), so it stays positive (a calibration may not reverse the
    network's ordering); a horizon keeps the identity when the fit does not beat it."""
    risk = (1.0 - torch.exp(log_s)).clamp(1e-6, 1 - 1e-6)
    z = torch.log(risk) - torch.log(1.0 - risk)  # as ``calibrated`` computes it
    bce = nn.functional.binary_cross_entropy_with_logits
    for k in range(z.shape[1]):
        keep = mask[:, k] > 0
        zk, yk = z[keep, k], labels[keep, k]
        if len(zk) < 10 or yk.sum() < 3:
            continue
        alpha = torch.zeros((), requires_grad=True)
        b = torch.zeros((), requires_grad=True)
        opt = torch.optim.LBFGS([alpha, b], max_iter=200, line_search_fn="strong_wolfe")
        # torch's LBFGS.step is not annotated (its stubs leave it untyped)
        opt.step(partial(_platt_closure, opt, alpha, b, zk, yk))  # type: ignore[no-untyped-call]
        with torch.no_grad():
            a_fit = float(torch.exp(alpha.clamp(-4.0, 3.0)))
            b_fit = float(b.clamp(-20.0, 20.0))
            fitted = float(bce(a_fit * zk + b_fit, yk))
            if not math.isfinite(fitted) or fitted >= float(bce(zk, yk)):
                a_fit, b_fit = 1.0, 0.0
            net.cal_a[k] = a_fit
            net.cal_b[k] = b_fit


def _platt_closure(
    opt: torch.optim.Optimizer,
    alpha: torch.Tensor,
    b: torch.Tensor,
    z: torch.Tensor,
    y: torch.Tensor,
) -> torch.Tensor:
    opt.zero_grad()
    loss = nn.functional.binary_cross_entropy_with_logits(torch.exp(alpha) * z + b, y)
    loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
    return loss


def survival_loss(
    log_s: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor, pos_weight: float = 1.0
) -> torch.Tensor:
    """Binary cross-entropy of risk per horizon, over the entries ``mask`` marks as known.
    labels: 1 where the OOM came within the horizon; log_s from ``log_survival``."""
    log_risk = torch.log(-torch.expm1(torch.clamp(log_s, max=-1e-6)))
    per = -(pos_weight * labels * log_risk + (1 - labels) * log_s)
    return (per * mask).sum() / mask.sum().clamp(min=1.0)
