from __future__ import annotations

import pytest
from support import sample

from oomcast.model.forecast import HORIZONS_S, AlertRule, Forecast
from oomcast.service import alerts
from oomcast.service.alerts import AlertPolicy, AlertTracker


def fc(risk60: float, ts: float = 1.0) -> Forecast:
    risk = {h: (risk60 if h >= 60 else 0.0) for h in HORIZONS_S}
    return Forecast(
        risk=risk, time_to_oom_s=40.0 if risk60 else None, observed_at=ts, model_version="test"
    )


def run(policy: AlertPolicy, risks: list[float]) -> list[tuple[int, str]]:
    tracker = AlertTracker()
    out = []
    for i, r in enumerate(risks):
        payload = alerts.update(tracker, policy, sample(1000.0 + i), fc(r, 1000.0 + i))
        if payload is not None:
            out.append((i, payload["status"]))
    return out


def test_fires_once_per_episode_after_consecutive_samples() -> None:
    policy = AlertPolicy(AlertRule(60, 0.5), resolve_risk=0.2, fire_after=2, resolve_after=3)
    assert run(policy, [0.6, 0.1, 0.6, 0.7, 0.9, 0.9, 0.9]) == [(3, "firing")]


def test_resolves_only_below_the_lower_threshold_for_long_enough() -> None:
    policy = AlertPolicy(AlertRule(60, 0.5), resolve_risk=0.2, fire_after=1, resolve_after=2)
    # 0.3 is below fire_risk but above resolve_risk: hysteresis keeps it firing.
    risks = [0.9, 0.3, 0.3, 0.1, 0.3, 0.1, 0.1, 0.9]
    assert run(policy, risks) == [(0, "firing"), (6, "resolved"), (7, "firing")]


def test_payload_carries_the_design_fields() -> None:
    policy = AlertPolicy(AlertRule(60, 0.5), fire_after=1)
    tracker = AlertTracker()
    s = sample(1234.5, 0.9, job="j1")
    payload = alerts.update(tracker, policy, s, fc(0.8, s.ts))
    assert payload is not None
    for key in (
        "status",
        "node",
        "device",
        "job",
        "risk",
        "time_to_oom_s",
        "observed_at",
        "fired_at",
        "action",
        "model_version",
    ):
        assert key in payload
    assert payload["observed_at"] == 1234.5
    assert payload["job"] == "j1"
    assert payload["risk"]["60"] == 0.8
    assert payload["episode"] == tracker.episode


def test_policy_refuses_resolve_above_fire() -> None:
    with pytest.raises(ValueError, match="resolve_risk"):
        AlertPolicy(AlertRule(60, 0.5), resolve_risk=0.6)
    with pytest.raises(ValueError, match="horizon"):
        AlertRule(61, 0.5)
