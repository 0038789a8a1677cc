"""The forecasting network (torch): embedding -> LSTM -> a discrete-time hazard head.

For every step the network outputs, per bin of the next five minutes (``BINS_S``: 0-5 s,
5-10 s, ... 240-300 s), the hazard: the probability that the OOM falls in that bin given it
has not happened before. The survival curve is the running product of one minus the
hazards; the risk within a horizon is one minus the survival at its end. It is trained with
the discrete-time survival likelihood (``hazard_loss``), in which a run that ended normally
is *censored*: it says the job survived the bins that ended before its exit, and nothing of
the later ones.

The time to OOM is read from the same curve: the median of the OOM's time given that it
comes within five minutes (``median_time``), interpolated within a bin at a constant hazard.
The runtime reports it only where the risk says an OOM is in sight.

Risks are calibrated per horizon after training (Platt scaling on the validation split,
``calibrate``), made non-decreasing across horizons, and then passed through the evidence
gate (``evidence_gate``), a fixed rule outside the network: no risk at a horizon before the
level has grown beyond noise for 30 s with the projection's earliest time to the limit
within that horizon, unless the domain is at the brink (98% of capacity, or allocation
retries climbing above 90%).

Beside the network, a straight climb is taken at its word (``straight_line``): where the
gate is open, the level has not fallen in the last two minutes, and the climb is neither
levelling off nor slowing beyond its noise, the risk within each horizon is at
least the chance, from the fitted slope and its standard error, that the line reaches the
limit inside it, and the time to OOM is the line's. A leak that keeps its pace is warned as
soon as the gate opens, however young the job; a start-up or a cache that slows down, and a
sawtooth's next tooth, are left to the network.

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

from oomcast.model.embedding import EMBEDDING_VERSION, FEATURES, LEVEL, N_FEATURES
from oomcast.model.forecast import HORIZONS_S
from oomcast.model.growth import squash_s

# The hazard bins' ends (seconds); every reported horizon is one of them.
# Finer where an alert is decided (a minute and less), so the median read from the curve can
# say 30 s when it means 30 s.
BINS_S: tuple[int, ...] = (
    5, 10, 15, 20, 25, 30, 35, 40, 45, 50, 60, 75, 90, 120, 150, 180, 240, 300
)  # fmt: skip
GATE_GROWTH_S = 30.0  # growth beyond noise needed before the gate opens
BRINK_LEVEL = 0.98
RETRIES_LEVEL = 0.9
# A climb that is slowing down towards a level this far below the limit (or further) is a
# start-up or a cache filling, not a leak: the gate stays shut until the brink.
PLATEAU_MARGIN = 0.03
# The straight-line component (``straight_line``): the deceleration (``model/growth.py``) a
# line may show, the largest fall in the last 120 s as a share of its rise over the last
# 30 s, and how many standard errors of the 10 s fit its pace now may lag the 30 s fit's.
STRAIGHT = {"max_deceleration": 0.25, "drawdown_share": 0.5, "slowing_se": 1.0}
_AGE = FEATURES.index("log1p_growth_age_s")
_TTL_LO = FEATURES.index("time_to_limit_lo")
_RETRIES = FEATURES.index("log1p_retries_per_min")
_PLATEAU = FEATURES.index("plateau_headroom")
_TTL = [FEATURES.index(f) for f in ("time_to_limit", "time_to_limit_lo", "time_to_limit_hi")]
_DECEL = FEATURES.index("deceleration")
_SLOPE_10 = FEATURES.index("slope_10s_pct_per_s")
_SLOPE_30 = FEATURES.index("slope_30s_pct_per_s")
_SE_10 = FEATURES.index("slope_se_10s_pct_per_s")
_SE_30 = FEATURES.index("slope_se_30s_pct_per_s")
_DRAWDOWN = FEATURES.index("drawdown_120s")
_LOG_CAP = math.log1p(3600.0)  # the squashing of times (model/growth.py squash_s)


@dataclass
class NetConfig:
    n_features: int = N_FEATURES
    embed_dim: int = 32
    hidden: int = 64
    layers: int = 2
    horizons_s: tuple[int, ...] = field(default_factory=lambda: HORIZONS_S)
    bins_s: tuple[int, ...] = field(default_factory=lambda: BINS_S)
    embedding_version: int = EMBEDDING_VERSION
    tick_s: float = 1.0  # the LSTM advances once per tick of trace time, at most

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["horizons_s"] = list(self.horizons_s)
        d["bins_s"] = list(self.bins_s)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> NetConfig:
        return cls(**{**d, "horizons_s": tuple(d["horizons_s"]), "bins_s": tuple(d["bins_s"])})

    def horizon_bins(self) -> list[int]:
        """Index of the bin each reported horizon ends."""
        missing = [h for h in self.horizons_s if h not in self.bins_s]
        if missing:
            raise ValueError(f"horizons {missing} are not ends of the hazard bins {self.bins_s}")
        return [self.bins_s.index(h) for h in self.horizons_s]


class OOMForecastNet(nn.Module):
    # buffers (register_buffer): declared so that they type as tensors, not as whatever
    # nn.Module.__getattr__ may return
    x_mean: torch.Tensor
    x_scale: torch.Tensor
    edges: torch.Tensor
    log_ends: torch.Tensor
    cal_a: torch.Tensor
    cal_b: torch.Tensor

    def __init__(self, cfg: NetConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("x_mean", torch.zeros(cfg.n_features))
        self.register_buffer("x_scale", torch.ones(cfg.n_features))
        self.embed = nn.Sequential(nn.Linear(cfg.n_features, cfg.embed_dim), nn.GELU())
        self.lstm = nn.LSTM(cfg.embed_dim, cfg.hidden, cfg.layers, batch_first=True)
        self.hazard = nn.Linear(cfg.hidden, len(cfg.bins_s))
        # where the projection to the limit puts each bin: a small net, shared by the bins,
        # of (log of the bin's end over the projected, earliest and latest time to the
        # limit), weighed per step by how far the LSTM trusts the projection now
        self.by_projection = nn.Sequential(nn.Linear(3, 16), nn.GELU(), nn.Linear(16, 1))
        self.trust = nn.Linear(cfg.hidden, 1)
        self.register_buffer("edges", torch.tensor((0.0, *cfg.bins_s)))
        self._reported = cfg.horizon_bins()
        self.register_buffer("log_ends", torch.log(torch.tensor(cfg.bins_s, dtype=torch.float32)))
        self.register_buffer("cal_a", torch.ones(len(cfg.horizons_s)))
        self.register_buffer("cal_b", torch.zeros(len(cfg.horizons_s)))

    def set_normalization(self, mean: torch.Tensor, scale: torch.Tensor) -> None:
        """A feature that hardly varies in training (a mask that is always 1 there) keeps
        scale 1: dividing by its tiny spread would turn the other value, met in service,
        into an input in the thousands."""
        self.x_mean.copy_(mean)
        self.x_scale.copy_(torch.where(scale < 1e-2, torch.ones_like(scale), scale))

    def hazard_logits(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (batch, time, features) -> (hazard logits per bin: (batch, time, bins), new
        state)."""
        assert x.dim() == 3 and x.shape[-1] >= self.cfg.n_features, x.shape
        # a network trained on an earlier schema reads the features it knew: the schema only
        # ever grows at its end
        xn = x[..., : self.cfg.n_features]
        # clipped: a value far outside anything seen in training saturates, never explodes
        z = self.embed(torch.clamp((xn - self.x_mean) / self.x_scale, -8.0, 8.0))
        out, new_state = self.lstm(z, state)  # (batch, time, hidden)
        # log seconds of the projection and its bounds, from their squashed features
        proj = torch.log((torch.exp(x[..., _TTL] * _LOG_CAP) - 1.0).clamp(min=0.5))  # (b, t, 3)
        rel = self.log_ends.unsqueeze(-1) - proj.unsqueeze(-2)  # (b, t, bins, 3): log(end / proj)
        shaped = self.by_projection(rel.clamp(-6.0, 6.0)).squeeze(-1)  # (b, t, bins)
        trust = nn.functional.softplus(self.trust(out))  # (b, t, 1)
        return self.hazard(out) + trust * shaped, new_state

    def heads(
        self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """x: (batch, time, features) -> (log P(no OOM within horizon k): (batch, time, H),
        log seconds to the OOM (the survival curve's median): (batch, time), new state).
        Uncalibrated and ungated."""
        logits, new_state = self.hazard_logits(x, state)
        # log(1 - sigmoid(l)) = -softplus(l); summed over bins: survival to each bin's end
        log_s_bins = torch.cumsum(-nn.functional.softplus(logits), dim=-1)
        log_s = log_s_bins[..., self._reported]
        return log_s, torch.log(median_time(log_s_bins, self.edges)), new_state

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
        """Risk as the service reports it: calibrated, then gated (``evidence_gate``)."""
        log_s, log_tto, new_state = self.heads(x, state)
        return served(self, log_s, log_tto, x)[0], new_state

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
        risk, tto = served(self.net, log_s, log_tto, x)
        return risk, tto, h2, c2


def served(
    net: OOMForecastNet, log_s: torch.Tensor, log_tto: torch.Tensor, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(risk per horizon, seconds to the OOM) as the service reports them, from the
    network's heads and the raw features x (..., features): the network's calibrated risk
    or the straight line's, whichever is higher, through the evidence gate; the straight
    line's time to the limit where it holds, else the network's."""
    line, holds, line_s = straight_line(x, net.cfg.horizons_s)
    risk = torch.maximum(net.calibrated(log_s), line) * evidence_gate(x, net.cfg.horizons_s)
    tto = torch.where(holds, line_s.clamp(0.5, 3600.0), torch.exp(log_tto.clamp(-2.0, 9.0)))
    return risk, tto


def median_time(log_s_bins: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
    """The median time of the OOM given it comes within the last bin, from the survival at
    each bin's end (..., bins) and the bins' edges (0 and the ends): seconds (...). Within a
    bin the hazard is taken as constant, so the curve is interpolated in log survival."""
    f = 1.0 - torch.exp(log_s_bins)  # P(OOM by each bin's end)
    g = f / f[..., -1:].clamp(min=1e-9)  # ... given it comes within the last one
    g_prev = torch.cat([torch.zeros_like(g[..., :1]), g[..., :-1]], dim=-1)
    crossed = (g >= 0.5) & (g_prev < 0.5)
    frac = ((0.5 - g_prev) / (g - g_prev).clamp(min=1e-9)).clamp(0.0, 1.0)
    t = edges[:-1] + frac * (edges[1:] - edges[:-1])
    seconds = (t * crossed.to(t.dtype)).sum(-1)
    return seconds.clamp(min=0.5)


def evidence_gate(x: torch.Tensor, horizons_s: tuple[int, ...]) -> torch.Tensor:
    """1 where a horizon may carry risk, from the raw features x (..., features): growth
    beyond noise for ``GATE_GROWTH_S`` with the earliest projected time to the limit within
    the horizon, unless the climb is slowing down towards a level ``PLATEAU_MARGIN`` or more
    below the limit; or the brink (level at 98%, or allocation retries climbing above 90%).
    Returns (..., horizons) of 0.0 / 1.0."""
    level = x[..., LEVEL]
    grown = (x[..., _AGE] >= math.log1p(GATE_GROWTH_S) - 1e-4) & (x[..., _PLATEAU] < PLATEAU_MARGIN)
    brink = (level >= BRINK_LEVEL) | ((x[..., _RETRIES] > 0.05) & (level >= RETRIES_LEVEL))
    limits = torch.tensor([squash_s(h) for h in horizons_s], dtype=x.dtype)
    inside = x[..., _TTL_LO].unsqueeze(-1) <= limits + 1e-6
    return ((grown.unsqueeze(-1) & inside) | brink.unsqueeze(-1)).to(x.dtype)


def straight_line(
    x: torch.Tensor, horizons_s: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The straight-line component, from the raw features x (..., features). Where the climb
    is a straight one (the gate's growth condition, a projection to the limit, deceleration
    at most ``max_deceleration``, and no fall in the last 120 s larger than
    ``drawdown_share`` of the last 30 s's rise), the chance that the line reaches the limit
    within each horizon: the 30 s fit's pace taken as normal with its standard error, so a
    clean line gives nearly 0 or 1 and a noisy one something between. Where the pace of the
    last 10 s lags the 30 s fit's by more than ``slowing_se`` of its standard errors, it
    adds no risk (a climb that is slowing down, or one that stopped a few seconds ago, is
    the network's to judge); its time to the limit still stands while the last 10 s still
    climb beyond their noise. Returns (risk (..., H), where its time holds with the limit
    more likely than not inside the longest horizon (...), the line's seconds to the limit
    (...))."""
    grown = (x[..., _AGE] >= math.log1p(GATE_GROWTH_S) - 1e-4) & (x[..., _PLATEAU] < PLATEAU_MARGIN)
    ttl = x[..., _TTL[0]]
    rise_30s = 30.0 * (x[..., _SLOPE_30] / 100.0).clamp(min=0.0)
    line = (
        grown
        & (ttl < 1.0 - 1e-6)
        & (x[..., _DECEL] <= STRAIGHT["max_deceleration"])
        & (x[..., _DRAWDOWN] <= STRAIGHT["drawdown_share"] * rise_30s)
    )
    steady = x[..., _SLOPE_10] >= x[..., _SLOPE_30] - STRAIGHT["slowing_se"] * x[..., _SE_10]
    # still climbing now, beyond its noise: a climb that stopped gets no time from the line
    climbing = x[..., _SLOPE_10] > 2.0 * x[..., _SE_10]
    mid_s = torch.exp(ttl * _LOG_CAP) - 1.0
    # the pace's relative standard error, from the 30 s fit that sets the pace
    rel = (x[..., _SE_30] / x[..., _SLOPE_30].clamp(min=1e-6)).clamp(min=1e-3)
    ends = torch.tensor([float(h) for h in horizons_s], dtype=x.dtype)
    z = (1.0 - mid_s.unsqueeze(-1) / ends) / rel.unsqueeze(-1)
    p = 0.5 * (1.0 + torch.erf(z / math.sqrt(2.0)))
    risk = p * (line & steady).unsqueeze(-1).to(x.dtype)
    return risk, line & climbing & (p[..., -1] >= 0.5), mid_s


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


def hazard_targets(
    tto_s: torch.Tensor, known_s: torch.Tensor, bins_s: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per tick, which bins it survived and which one its OOM fell in: (..., bins) masks.
    ``tto_s``: seconds to the OOM (inf when none follows in the trace); ``known_s``: how
    far ahead the trace knows the future (inf for a run that OOMs; for a run that ended
    normally, the seconds to its end: a bin counts as survived only if it ends by then)."""
    ends = torch.tensor(bins_s, dtype=tto_s.dtype)
    starts = torch.cat([torch.zeros(1, dtype=tto_s.dtype), ends[:-1]])
    t = tto_s.unsqueeze(-1)
    event = (t > starts) & (t <= ends) | ((t <= 0) & (starts == 0))
    survived = ends <= torch.minimum(t, known_s.unsqueeze(-1))
    survived = survived & ~event & (ends < t)
    return survived.to(tto_s.dtype), event.to(tto_s.dtype)


def hazard_loss(
    logits: torch.Tensor,
    survived: torch.Tensor,
    event: torch.Tensor,
    weight: torch.Tensor,
    pos_weight: float = 1.0,
) -> torch.Tensor:
    """The discrete-time survival likelihood: log(1 - h) for every bin a tick is known to
    have survived, log h for the bin its OOM fell in; ``weight`` (..., ) weighs each tick
    (0 for padding or warm-up). Averaged over the weighted ticks."""
    logsig = nn.functional.logsigmoid
    per = -(survived * logsig(-logits) + pos_weight * event * logsig(logits)).sum(-1)
    return (per * weight).sum() / weight.sum().clamp(min=1.0)
