"""model/network.py: the hazard head, its survival likelihood and the time to OOM read from
it, calibration, the evidence gate, the exported graph."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch
from torch.nn.functional import binary_cross_entropy

from oomcast.model.embedding import FEATURES, LEVEL, EmbeddingState
from oomcast.model.growth import squash_s
from oomcast.model.network import (
    BINS_S,
    NetConfig,
    OOMForecastNet,
    SequenceModule,
    evidence_gate,
    fit_calibration,
    hazard_loss,
    hazard_targets,
    median_time,
    served,
    straight_line,
)
from oomcast.model.schema import Sample

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
    # and so is the forward pass: risk from the survival head, unscaled, then gated
    x = torch.randn(2, 20, net.cfg.n_features) * 3
    risk, _ = net(x)
    log_s, _ = net.log_survival(x)
    gate = evidence_gate(x, net.cfg.horizons_s)
    assert 0 < gate.mean() < 1  # some open (the brink), some closed
    assert torch.allclose(risk, (1 - torch.exp(log_s)) * gate, atol=2e-6)
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
    with torch.no_grad():
        log_s, log_tto, _ = net.heads(x)
        _, want = served(net, log_s, log_tto, x)
    assert torch.allclose(tto_s, want, rtol=1e-5)


def _curve(cdf: list[float]) -> torch.Tensor:
    """Log survival at each bin's end from P(OOM by that end)."""
    return torch.log(1.0 - torch.tensor(cdf))


def test_the_time_to_oom_is_the_median_of_the_curve_given_an_oom_within_5_minutes() -> None:
    edges = torch.tensor((0.0, *BINS_S))
    # half the runs OOM, uniformly over the five minutes: the median given an OOM is 150 s
    uniform = _curve([0.5 * e / 300 for e in BINS_S])
    assert float(median_time(uniform, edges)) == pytest.approx(150.0, rel=1e-4)
    # all of it between 20 and 25 s: within the bin, at a constant hazard
    inside = _curve([0.0 if e <= 20 else 0.9 for e in BINS_S])
    assert 20.0 < float(median_time(inside, edges)) < 25.0
    # no risk at all: half a second, never NaN
    assert float(median_time(torch.zeros(len(BINS_S)), edges)) == 0.5
    net = OOMForecastNet(NetConfig()).eval()
    _, log_tto, _ = net.heads(torch.zeros(2, 3, net.cfg.n_features))
    assert log_tto.shape == (2, 3) and torch.isfinite(log_tto).all()


def test_hazard_targets_mark_survived_bins_and_the_oom_s_bin() -> None:
    inf = math.inf
    tto = torch.tensor([3.0, 30.0, 31.0, 400.0, inf, inf])
    known = torch.tensor([inf, inf, inf, inf, 25.0, 1000.0])
    survived, event = hazard_targets(tto, known, BINS_S)
    at = list(BINS_S).index  # the bin that ends at
    assert event.tolist()[0][0] == 1 and survived[0].sum() == 0
    assert survived[1].sum() == at(30) and event[1].argmax() == at(30)  # 25-30 s
    assert survived[2].sum() == at(35) and event[2].argmax() == at(35)  # 30-35 s
    assert survived[3].sum() == len(BINS_S) and event[3].sum() == 0  # beyond 5 minutes
    # censored 25 s ahead (a run that ended normally): only the bins that ended by then
    assert survived[4].tolist() == [1] * (at(25) + 1) + [0] * (len(BINS_S) - at(25) - 1)
    assert event[4].sum() == 0 and survived[5].sum() == len(BINS_S)


def test_hazard_loss_counts_weighted_ticks_and_learns_where_the_oom_falls() -> None:
    logits = torch.zeros(1, 2, len(BINS_S), requires_grad=True)
    tto = torch.tensor([[47.0, math.inf]])
    known = torch.tensor([[math.inf, 500.0]])
    survived, event = hazard_targets(tto, known, BINS_S)
    w = torch.tensor([[1.0, 0.0]])
    loss = hazard_loss(logits, survived, event, w)
    # the first tick: the bins before 45 s survived and the OOM's (45-50 s), each log(1/2);
    # the second weighs 0
    at = list(BINS_S).index
    assert float(loss.detach()) == pytest.approx((at(50) + 1) * math.log(2.0), rel=1e-5)
    opt = torch.optim.SGD([logits], lr=1.0)
    for _ in range(200):
        opt.zero_grad()
        hazard_loss(logits, survived, event, torch.ones(1, 2)).backward()
        opt.step()
    h = torch.sigmoid(logits.detach())
    assert h[0, 0, at(50)] > 0.9 and (h[0, 0, : at(50)] < 0.1).all()  # OOM in 45-50 s
    assert (h[0, 1] < 0.1).all()  # the censored tick survived everything it saw


def _features(level: float, age_s: float, ttl_lo_s: float, retries: float = 0.0) -> torch.Tensor:
    x = torch.zeros(len(FEATURES))
    x[LEVEL] = level
    x[FEATURES.index("log1p_growth_age_s")] = math.log1p(age_s)
    x[FEATURES.index("time_to_limit_lo")] = squash_s(ttl_lo_s)
    x[FEATURES.index("log1p_retries_per_min")] = retries
    return x


def test_the_evidence_gate_needs_30_s_of_growth_and_the_limit_within_the_horizon() -> None:
    horizons = NetConfig().horizons_s  # 5, 15, 30, 45, 60, 120, 300
    gate = evidence_gate(torch.stack([
        _features(0.5, 29.0, 10.0),  # growth too young
        _features(0.5, 30.0, 50.0),  # the limit 50 s away at the earliest: 60 s and longer
        _features(0.5, 600.0, 3600.0),  # growing, but nowhere near
        _features(0.985, 0.0, 3600.0),  # the brink
        _features(0.92, 0.0, 3600.0, retries=1.0),  # retries climbing above 90%
        _features(0.85, 0.0, 3600.0, retries=1.0),  # ... not below
    ]), horizons)  # fmt: skip
    assert gate.tolist() == [
        [0] * 7, [0, 0, 0, 0, 1, 1, 1], [0] * 7, [1] * 7, [1] * 7, [0] * 7,
    ]  # fmt: skip


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


def _embedded(level: Callable[[float], float], seconds: int) -> torch.Tensor:
    """The embeddings of ``level`` (fraction of a 16 GiB GPU) sampled once a second."""
    emb = EmbeddingState()
    total = 16 << 30
    rows = []
    for t in range(seconds):
        used = int(min(1.0, level(float(t))) * total)
        rows.append(emb.embed(Sample(1_900_000_000.0 + t, "n", "gpu0", "gpu", total, used,
                                     peak_bytes=used)))  # fmt: skip
    return torch.tensor(rows)


def test_a_straight_leak_is_taken_at_its_word_once_the_gate_opens() -> None:
    horizons = NetConfig().horizons_s  # 5, 15, 30, 45, 60, 120, 300
    x = _embedded(lambda t: t / 60.0, 31)  # a one-minute leak from the job's first second
    risk, holds, line_s = straight_line(x, horizons)
    assert risk[20].tolist() == [0.0] * 7 and not holds[20]  # 20 s of growth: not yet
    assert holds[30] and line_s[30] == pytest.approx(30.0, rel=0.02)
    # the limit 30 s away on a clean line: surely not within 15 s, surely within 45 s
    at = dict(zip(horizons, risk[30].tolist(), strict=True))
    assert at[15] < 0.01 and at[45] > 0.99 and at[300] > 0.99


def test_a_sawtooth_tooth_a_climb_that_slows_and_one_that_stopped_are_not_lines() -> None:
    horizons = NetConfig().horizons_s
    k45 = horizons.index(45)
    # the 45 s tooth of a sawtooth from 60% to 95%: 43 s into its second tooth it climbs
    # exactly as the first did, at its high, 8 s from the limit at its pace; the drop 43 s
    # ago is all that says it is no leak
    saw = _embedded(lambda t: 0.6 + 0.35 * ((t % 45.0) / 45.0), 89)
    risk, holds, _ = straight_line(saw, horizons)
    assert float(risk[88, k45]) == 0.0 and not holds[88]
    # a climb that slows as it goes, towards a level past the limit (the gate stays open):
    # once it slows beyond its noise the line adds no risk, though its time still stands
    slow = _embedded(lambda t: 0.02 + 1.0 * (1 - math.exp(-t / 60.0)), 70)
    risk, holds, line_s = straight_line(slow, horizons)
    assert float(risk[40:, k45].max()) == 0.0
    assert holds[60] and line_s[60] == pytest.approx(44.0, abs=2.0)
    # weights landing in a few seconds, then a flat line: 30 s after the jump began, its 15 s
    # and 30 s fits are still steep, but the last 10 s did not rise
    jump = _embedded(lambda t: 0.05 + 0.65 * min(1.0, max(0.0, t - 17.0) / 5.0), 40)
    risk, _, _ = straight_line(jump, horizons)
    assert float(risk[:, k45].max()) == 0.0


def test_served_risk_is_the_higher_of_network_and_line_through_the_gate() -> None:
    torch.manual_seed(2)
    net = OOMForecastNet(NetConfig()).eval()
    flat = _embedded(lambda t: 0.5, 40)
    leak = _embedded(lambda t: t / 60.0, 40)
    x = torch.stack([flat, leak])
    with torch.no_grad():
        log_s, log_tto, _ = net.heads(x)
        risk, tto = served(net, log_s, log_tto, x)
        cal = net.calibrated(log_s) * evidence_gate(x, net.cfg.horizons_s)
    line, holds, line_s = straight_line(x, net.cfg.horizons_s)
    gate = evidence_gate(x, net.cfg.horizons_s)
    assert torch.allclose(risk, torch.maximum(cal, line * gate))
    assert (risk[0] == 0).all()  # a flat line: the gate is shut, whatever the network says
    assert holds[1, 35] and tto[1, 35] == pytest.approx(float(line_s[1, 35]))
    assert not holds[0].any()
    assert torch.allclose(tto[0], torch.exp(log_tto[0].clamp(-2.0, 9.0)))
