"""From forecasts to alerts: one ``firing`` per episode, one ``resolved`` when it ends.

An episode starts when risk at the rule's horizon stays at or above ``fire_risk`` for
``fire_after`` consecutive samples, and ends when it stays below ``resolve_risk`` (a lower
threshold: hysteresis) for ``resolve_after`` samples, or when the domain OOMs.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any

from oomcast.model.forecast import AlertRule, Forecast
from oomcast.model.schema import Sample


@dataclass(frozen=True)
class AlertPolicy:
    rule: AlertRule
    resolve_risk: float = 0.2
    fire_after: int = 2
    resolve_after: int = 3
    action: str = "notify"

    def __post_init__(self) -> None:
        if not 0 <= self.resolve_risk < self.rule.fire_risk:
            raise ValueError("resolve_risk must be below the rule's fire_risk")
        if self.fire_after < 1 or self.resolve_after < 1:
            raise ValueError("fire_after and resolve_after must be at least 1")

    def describe(self) -> str:
        return (
            f"risk within {self.rule.horizon_s}s >= {self.rule.fire_risk} for {self.fire_after}"
            f" samples; resolves below {self.resolve_risk} for {self.resolve_after}"
        )


@dataclass(slots=True)
class AlertTracker:
    """Per-domain episode state."""

    firing: bool = False
    above: int = 0
    below: int = 0
    episode: str | None = None
    fired_at: float | None = None


def forecast_fields(
    status: str,
    sample: Sample,
    forecast: Forecast,
    *,
    job: str | None,
    fired_at: float | None,
    episode: str | None,
    reason: str,
) -> dict[str, Any]:
    """What every alert carries (DESIGN.md): the domain, and the forecast and sample that
    caused it, so the decision can be explained afterwards."""
    return {
        "status": status,
        "node": sample.node,
        "device": sample.device,
        "job": job if job is not None else sample.job,
        "risk": {str(h): round(p, 6) for h, p in forecast.risk.items()},
        "time_to_oom_s": forecast.time_to_oom_s,
        "observed_at": forecast.observed_at,
        "fired_at": fired_at,
        "sent_at": time.time(),
        "model_version": forecast.model_version,
        "episode": episode,
        "reason": reason,
        "used_bytes": sample.used_bytes,
        "total_bytes": sample.total_bytes,
    }


def alert_payload(
    status: str,
    sample: Sample,
    forecast: Forecast,
    tracker: AlertTracker,
    policy: AlertPolicy,
    reason: str,
    job: str | None = None,
) -> dict[str, Any]:
    out = forecast_fields(
        status,
        sample,
        forecast,
        job=job,
        fired_at=tracker.fired_at,
        episode=tracker.episode,
        reason=reason,
    )
    out["action"] = policy.action
    out["rule"] = policy.describe()
    return out


def update(
    tracker: AlertTracker, policy: AlertPolicy, sample: Sample, forecast: Forecast
) -> dict[str, Any] | None:
    """Advance a domain's episode by one forecast; returns an alert payload on a transition."""
    risk = forecast.risk_at(policy.rule.horizon_s)
    if not tracker.firing:
        tracker.above = tracker.above + 1 if risk >= policy.rule.fire_risk else 0
        if tracker.above >= policy.fire_after:
            tracker.firing = True
            tracker.below = 0
            tracker.episode = uuid.uuid4().hex[:16]
            tracker.fired_at = time.time()
            return alert_payload(
                "firing",
                sample,
                forecast,
                tracker,
                policy,
                f"risk {risk:.2f} at {policy.rule.horizon_s}s",
            )
        return None
    tracker.below = tracker.below + 1 if risk < policy.resolve_risk else 0
    if tracker.below >= policy.resolve_after:
        payload = alert_payload(
            "resolved", sample, forecast, tracker, policy, f"risk fell to {risk:.2f}"
        )
        reset(tracker)
        return payload
    return None


def reset(tracker: AlertTracker) -> None:
    tracker.firing = False
    tracker.above = 0
    tracker.below = 0
    tracker.episode = None
    tracker.fired_at = None
