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


def run_at(policy: AlertPolicy, risks: list[float], every_s: float) -> list[tuple[int, str]]:
    """``run``, one forecast every ``every_s`` seconds of sample time."""
    rule, ep = policy_rule(policy), Episode()
    out = []
    for i, r in enumerate(risks):
        ts = 1000.0 + i * every_s
        alert = evaluate(ep, rule, sample(ts), fc(r, ts), None, ts + 1.0)
        if alert is not None:
            out.append((i, alert.status))
    return out


def test_a_dip_shorter_than_the_calm_time_keeps_the_episode_open() -> None:
    # The demo's flap: at a 0.5 s interval three calm forecasts are 1.5 s of calm. With 30 s
    # asked for, the episode stays open through the dip, and the climb after it is the same
    # episode, not a second firing (which a cooldown would swallow).
    policy = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=3)
    dip = [0.9] * 4 + [0.1] * 3 + [0.9] * 4
    assert run_at(policy, dip, 0.5) == [(0, "firing"), (6, "resolved"), (7, "firing")]
    held = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=3,
                       resolve_after_s=30.0)  # fmt: skip
    assert run_at(held, dip, 0.5) == [(0, "firing")]
    # a real calm-down still resolves, on the first forecast 30 s after the calm began
    calm = [0.9] * 4 + [0.1] * 80
    assert run_at(held, calm, 0.5) == [(0, "firing"), (4 + 60, "resolved")]


def test_a_forecast_over_the_bar_restarts_the_calm_clock() -> None:
    held = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=1,
                       resolve_after_s=10.0)  # fmt: skip
    # 8 s calm, one forecast between the bars (0.3: not calm, not firing), 10 s calm again
    risks = [0.9] + [0.1] * 8 + [0.3] + [0.1] * 11
    assert run_at(held, risks, 1.0) == [(0, "firing"), (10 + 10, "resolved")]


def test_the_calm_clock_survives_a_handover() -> None:
    # a replica that takes the domain over restores the episode from its snapshot
    held = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=1,
                       resolve_after_s=10.0)  # fmt: skip
    rule, ep = policy_rule(held), Episode()
    assert evaluate(ep, rule, sample(0.0), fc(0.9, 0.0), None, 1.0) is not None
    assert evaluate(ep, rule, sample(1.0), fc(0.1, 1.0), None, 2.0) is None
    restored = Episode.from_dict(ep.to_dict())
    assert restored.calm_since == 1.0
    assert evaluate(restored, rule, sample(10.0), fc(0.1, 10.0), None, 11.0) is None  # 9 s
    alert = evaluate(restored, rule, sample(11.0), fc(0.1, 11.0), None, 12.0)
    assert alert is not None and alert.status == "resolved"
    with pytest.raises(ValueError, match="calm_since"):
        Episode.from_dict({**ep.to_dict(), "calm_since": "soon"})


def test_policy_refuses_a_negative_calm_time() -> None:
    with pytest.raises(ValueError, match="resolve_after_s"):
        AlertPolicy(60, 0.5, resolve_after_s=-1.0)
