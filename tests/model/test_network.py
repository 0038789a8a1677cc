from __future__ import annotations

import torch

from oomcast.model.network import NetConfig, OOMForecastNet, SequenceModule, survival_loss


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
    step = SequenceModule(net)  # the exported graph, fed one sample at a time
    h, c = net.zero_state(3)
    outs = []
    for t in range(25):
        r, h, c = step(x[:, t : t + 1], h, c)
        outs.append(r[:, 0])
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
