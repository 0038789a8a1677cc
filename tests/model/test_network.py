from __future__ import annotations

import torch

from oomcast.model.network import NetConfig, OOMForecastNet, StepModule, survival_loss


def test_risk_never_decreases_with_the_horizon() -> None:
    torch.manual_seed(0)
    net = OOMForecastNet(NetConfig())
    risk, _ = net(torch.randn(4, 30, net.cfg.n_features) * 3)
    assert risk.shape == (4, 30, len(net.cfg.horizons_s))
    assert (risk.diff(dim=-1) >= 0).all()
    assert ((risk >= 0) & (risk <= 1)).all()


def test_streaming_steps_equal_the_whole_sequence() -> None:
    torch.manual_seed(1)
    net = OOMForecastNet(NetConfig()).eval()
    x = torch.randn(3, 25, net.cfg.n_features)
    full, _ = net(x)
    step = StepModule(net)
    h, c = net.zero_state(3)
    outs = []
    for t in range(25):
        r, h, c = step(x[:, t], h, c)
        outs.append(r)
    assert torch.allclose(torch.stack(outs, dim=1), full, atol=1e-5)


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
        first = first if first is not None else float(loss)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * first
    # masked entries do not count
    log_s, _ = net.log_survival(x)
    assert float(survival_loss(log_s, 1 - y, torch.zeros_like(m))) == 0.0
