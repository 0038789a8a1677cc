"""model/network.py: the survival and time-to-OOM heads, calibration, the exported graph."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import binary_cross_entropy

from oomcast.model.network import (
    NetConfig,
    OOMForecastNet,
    SequenceModule,
    fit_calibration,
    survival_loss,
    tto_loss,
)

H = len(NetConfig().horizons_s)


def test_heads_give_log_survival_log_time_to_oom_and_state() -> None:
    torch.manual_seed(0)
    net = OOMForecastNet(NetConfig()).eval()
    x = torch.randn(4, 30, net.cfg.n_features) * 3
    log_s, log_tto, (h, c) = net.heads(x)
    assert log_s.shape == (4, 30, H) and log_tto.shape == (4, 30)
    assert h.shape == c.shape == (net.cfg.layers, 4, net.cfg.hidden)
    # survival up to a longer horizon is a product of more bins: never larger
    assert (log_s <= 0).all() and (log_s.diff(dim=-1) <= 0).all()
    # the state it returns continues the sequence exactly
    a, _, state = net.heads(x[:, :12])
    b, b_tto, _ = net.heads(x[:, 12:], state)
    assert torch.allclose(torch.cat([a, b], dim=1), log_s, atol=1e-6)
    assert torch.allclose(b_tto, log_tto[:, 12:], atol=1e-6)


def test_risk_never_decreases_with_the_horizon() -> None:
    torch.manual_seed(0)
    net = OOMForecastNet(NetConfig())
    risk, _ = net(torch.randn(4, 30, net.cfg.n_features) * 3)
    assert risk.shape == (4, 30, H)
    assert (risk.diff(dim=-1) >= 0).all()
    assert ((risk >= 0) & (risk <= 1)).all()


def test_calibrated_risk_is_non_decreasing_across_horizons_for_any_calibration() -> None:
    torch.manual_seed(3)
    net = OOMForecastNet(NetConfig())
    log_s = -torch.cumsum(torch.rand(500, H) * torch.rand(500, 1) * 3, dim=-1)
    crossed = 0
    for trial in range(20):
        with torch.no_grad():
            net.cal_a.copy_(torch.rand(H) * 4 + 0.05)
            net.cal_b.copy_(torch.randn(H) * 3)
        risk = net.calibrated(log_s)
        assert ((risk >= 0) & (risk <= 1)).all(), trial
        assert (risk.diff(dim=-1) >= 0).all(), trial
        # the per-horizon scaling alone would cross: the monotone envelope is doing work
        p = (1 - torch.exp(log_s)).clamp(1e-6, 1 - 1e-6)
        raw = torch.sigmoid((torch.log(p) - torch.log(1 - p)) * net.cal_a + net.cal_b)
        crossed += int((raw.diff(dim=-1) < 0).any())
        assert torch.allclose(risk[..., 0], raw[..., 0], atol=1e-7)
        assert torch.allclose(risk, torch.cummax(raw, dim=-1).values, atol=1e-5)
    assert crossed > 10


def test_calibration_with_a_1_b_0_is_the_uncalibrated_risk() -> None:
    torch.manual_seed(4)
    net = OOMForecastNet(NetConfig())
    assert torch.equal(net.cal_a, torch.ones(H)) and torch.equal(net.cal_b, torch.zeros(H))
    log_s = -torch.cumsum(torch.rand(2, 50, H) * 2, dim=-1)
    plain = 1 - torch.exp(log_s)
    assert torch.allclose(net.calibrated(log_s), plain, atol=2e-6)
    # and so is the forward pass: risk from the survival head, unscaled
    x = torch.randn(2, 20, net.cfg.n_features) * 3
    risk, _ = net(x)
    log_s, _ = net.log_survival(x)
    assert torch.allclose(risk, 1 - torch.exp(log_s), atol=2e-6)
    # a calibration that is not the identity changes it
    with torch.no_grad():
        net.cal_b.fill_(1.0)
    assert not torch.allclose(net(x)[0], risk, atol=1e-3)


def _miscalibrated(seed: int, n: int = 4000) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log survival, labels, mask) of shape (n, H): true risks p (rising with the horizon),
    labels drawn from p, and a model that reports sigmoid(3 logit(p) + 1): overconfident
    and too high."""
    g = torch.Generator().manual_seed(seed)
    base = torch.rand(n, 1, generator=g) * 6 - 5
    p = torch.sigmoid(base + torch.linspace(0.0, 1.5, H))
    y = (torch.rand(n, H, generator=g) < p).float()
    q = torch.sigmoid(3 * torch.logit(p) + 1)
    return torch.log(1 - q), y, torch.ones(n, H)


def test_fit_calibration_reduces_the_log_loss_of_miscalibrated_risks() -> None:
    net = OOMForecastNet(NetConfig())
    log_s, y, m = _miscalibrated(5)
    before = binary_cross_entropy(net.calibrated(log_s), y)
    fit_calibration(net, log_s, y, m)
    after = binary_cross_entropy(net.calibrated(log_s), y)
    assert float(after) < 0.9 * float(before)
    # it recovers the distortion: a ~ 1/3, b ~ -1/3 on every horizon
    assert torch.allclose(net.cal_a, torch.full((H,), 1 / 3), atol=0.08)
    assert torch.allclose(net.cal_b, torch.full((H,), -1 / 3), atol=0.3)
    # on fresh data from the same distortion too (not just a fit of the noise)
    log_s2, y2, _ = _miscalibrated(6)
    assert float(binary_cross_entropy(net.calibrated(log_s2), y2)) < 0.9 * float(
        binary_cross_entropy(1 - torch.exp(log_s2).clamp(1e-6, 1 - 1e-6), y2)
    )


def test_fit_calibration_leaves_horizons_with_too_little_evidence_alone() -> None:
    net = OOMForecastNet(NetConfig())
    log_s, y, m = _miscalibrated(7)
    y[:, 0] = 0.0  # no OOM within the first horizon at all
    m[:, 1] = 0.0  # nothing known at the second
    y[:, 2] = 0.0
    y[:2, 2] = 1.0  # two positives: too few to fit
    fit_calibration(net, log_s, y, m)
    assert net.cal_a[:3].tolist() == [1.0, 1.0, 1.0] and net.cal_b[:3].tolist() == [0.0] * 3
    assert (net.cal_a[3:] != 1.0).all()  # the rest were fitted


def test_fit_calibration_never_makes_the_log_loss_worse_than_none() -> None:
    g = torch.Generator().manual_seed(8)
    n = 5000
    # a risk that goes *down* where OOMs are: the unconstrained fit wants a < 0
    y = (torch.rand(n, H, generator=g) < 0.01).float()
    z = torch.where(y > 0, 0.5, 0.9) + 0.05 * torch.randn(n, H, generator=g)
    log_s = torch.log(1 - torch.sigmoid(z))
    net = OOMForecastNet(NetConfig())
    before = float(binary_cross_entropy(net.calibrated(log_s), y))
    fit_calibration(net, log_s, y, torch.ones(n, H))
    after = float(binary_cross_entropy(net.calibrated(log_s), y))
    assert after <= before


def test_streaming_steps_equal_the_whole_sequence() -> None:
    torch.manual_seed(1)
    net = OOMForecastNet(NetConfig()).eval()
    with torch.no_grad():  # a calibration that is not the identity: the graph applies it
        net.cal_a.copy_(torch.linspace(0.5, 2.0, H))
        net.cal_b.copy_(torch.linspace(-1.0, 1.0, H))
    x = torch.randn(3, 25, net.cfg.n_features)
    with torch.no_grad():
        full, _ = net(x)
        _, log_tto, _ = net.heads(x)
    step = SequenceModule(net)  # the exported graph, fed one tick at a time
    h, c = net.zero_state(3)
    risks, ttos = [], []
    with torch.no_grad():
        for t in range(25):
            r, tto, h, c = step(x[:, t : t + 1], h, c)
            risks.append(r[:, 0])
            ttos.append(tto[:, 0])
    assert torch.allclose(torch.stack(risks, dim=1), full, atol=1e-5)
    tto_s = torch.stack(ttos, dim=1)
    assert (tto_s > 0).all()
    assert torch.allclose(tto_s, torch.exp(log_tto.clamp(-2.0, 9.0)), rtol=1e-5)


def test_the_graph_clamps_the_time_to_oom_to_seconds_it_can_mean() -> None:
    net = OOMForecastNet(NetConfig()).eval()
    x = torch.zeros(1, 2, net.cfg.n_features)
    h, c = net.zero_state(1)
    with torch.no_grad():
        net.tto.weight.zero_()
        for bias, want in (
            (20.0, torch.exp(torch.tensor(9.0))),
            (-20.0, torch.exp(torch.tensor(-2.0))),
            (4.0, torch.exp(torch.tensor(4.0))),
        ):
            net.tto.bias.fill_(bias)
            _, tto, _, _ = SequenceModule(net)(x, h, c)
            assert torch.allclose(tto, want.expand(1, 2)), bias


def test_tto_loss_is_l1_on_log_seconds_where_known_and_its_minimum_is_the_median() -> None:
    tto_s = torch.tensor([[10.0, 20.0, 1000.0, 5.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0, 0.0]])

    def loss(seconds: float) -> float:
        return float(
            tto_loss(torch.full((1, 4), float(torch.log(torch.tensor(seconds)))), tto_s, mask)
        )

    assert loss(20.0) < loss(10.0) and loss(20.0) < loss(100.0)
    assert loss(20.0) == pytest.approx(
        (float(torch.log(torch.tensor(2.0))) + float(torch.log(torch.tensor(50.0)))) / 3, rel=1e-5
    )
    # a masked entry does not count; with nothing known the loss is 0, not NaN
    assert float(tto_loss(torch.zeros(1, 4), tto_s, torch.zeros(1, 4))) == 0.0
    # zero seconds (an OOM at this very tick) is read as half a second, never log(0)
    at_oom = tto_loss(torch.log(torch.tensor([[0.5]])), torch.zeros(1, 1), torch.ones(1, 1))
    assert float(at_oom) == pytest.approx(0.0, abs=1e-6)


@pytest.mark.slow
def test_survival_loss_learns_a_simple_pattern() -> None:
    torch.manual_seed(2)
    cfg = NetConfig(embed_dim=8, hidden=16, layers=1)
    net = OOMForecastNet(cfg)
    x = torch.randn(64, 10, cfg.n_features)
    y = (x[..., :1] > 0).float().expand(-1, -1, len(cfg.horizons_s)).contiguous()
    m = torch.ones_like(y)
    opt = torch.optim.Adam(net.parameters(), lr=1e-2)
    first = None
    for _ in range(150):
        log_s, _ = net.log_survival(x)
        loss = survival_loss(log_s, y, m)
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss.detach()) < 0.5 * first
    # masked entries do not count
    log_s, _ = net.log_survival(x)
    assert float(survival_loss(log_s, 1 - y, torch.zeros_like(m)).detach()) == 0.0


def test_features_that_never_varied_in_training_cannot_explode() -> None:
    net = OOMForecastNet(NetConfig()).eval()
    n = net.cfg.n_features
    std = torch.full((n,), 0.5)
    std[2] = 0.0  # a mask that was 1 in every training sample
    net.set_normalization(torch.ones(n), std)
    assert net.x_scale[2] == 1.0 and net.x_scale[0] == 0.5
    x = torch.ones(1, 3, n)
    x[..., 2] = 0.0  # the mask off, as a source without that field sends it
    far = x.clone()
    far[..., 0] = 1e6  # absurdly far out of range
    risk, _ = net(far)
    assert torch.isfinite(risk).all()
    # clipped at 8 scales: as far as 1e6 is the same as 1 + 8 * 0.5
    edge = x.clone()
    edge[..., 0] = 1 + 8 * 0.5
    assert torch.allclose(net(edge)[0], risk)


def test_config_round_trips_with_its_tick() -> None:
    cfg = NetConfig(hidden=16, tick_s=0.5)
    again = NetConfig.from_dict(cfg.to_dict())
    assert again == cfg and again.tick_s == 0.5 and NetConfig().tick_s == 1.0
    # the calibration travels with the weights
    net = OOMForecastNet(cfg)
    assert {"cal_a", "cal_b", "x_mean", "x_scale"} <= set(net.state_dict())
