"""The alert engine (service/pipeline/rules.py) on the rule a policy makes (``policy_rule``): one
firing per episode, hysteresis, and the payload every alert carries (DESIGN.md)."""

from __future__ import annotations

import pytest
from support import sample

from oomcast.model.forecast import HORIZONS_S, AlertRule, Forecast
from oomcast.service.pipeline.rules import AlertPolicy, Episode, evaluate, policy_rule


def fc(risk60: float, ts: float = 1.0) -> Forecast:
    risk = {h: (risk60 if h >= 60 else 0.0) for h in HORIZONS_S}
    return Forecast(
        risk=risk, time_to_oom_s=40.0 if risk60 else None, observed_at=ts, model_version="test"
    )


def run(policy: AlertPolicy, risks: list[float]) -> list[tuple[int, str]]:
    rule, ep = policy_rule(policy), Episode()
    out = []
    for i, r in enumerate(risks):
        alert = evaluate(ep, rule, sample(1000.0 + i), fc(r, 1000.0 + i), None, 2000.0 + i)
        if alert is not None:
            out.append((i, alert.status))
    return out


def test_fires_once_per_episode_after_consecutive_samples() -> None:
    policy = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=2, resolve_after=3)
    assert run(policy, [0.6, 0.1, 0.6, 0.7, 0.9, 0.9, 0.9]) == [(3, "firing")]


def test_resolves_only_below_the_lower_bar_for_long_enough() -> None:
    policy = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=2)
    # 0.3 is below fire_risk but above resolve_risk: hysteresis keeps it firing.
    risks = [0.9, 0.3, 0.3, 0.1, 0.3, 0.1, 0.1, 0.9]
    assert run(policy, risks) == [(0, "firing"), (6, "resolved"), (7, "firing")]


def test_payload_carries_the_design_fields_and_the_time_given() -> None:
    rule, ep = policy_rule(AlertPolicy(60, 0.5, fire_after=1)), Episode()
    s = sample(1234.5, 0.9, job="j1")
    alert = evaluate(ep, rule, s, fc(0.8, s.ts), None, now=5000.0)
    assert alert is not None
    payload = alert.to_payload()
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
    assert payload["episode"] == ep.episode
    assert payload["fired_at"] == payload["sent_at"] == 5000.0  # no clock inside the engine
    assert payload["rule_name"] == "oom-forecast" and payload["actions"] == ["webhook"]
    with pytest.raises(AttributeError):
        alert.status = "resolved"  # type: ignore[misc]


def test_policy_refuses_resolve_above_fire() -> None:
    with pytest.raises(ValueError, match="resolve_risk"):
        AlertPolicy(60, 0.5, resolve_risk=0.6)
    with pytest.raises(ValueError, match="horizon"):
        AlertPolicy(61, 0.5)
    with pytest.raises(ValueError, match="horizon"):
        AlertRule(61, 0.5)
