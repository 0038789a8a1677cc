"""Live per-domain state: the latest sample, the forecaster's state, recent history, alerts.

``LiveState.apply`` takes a batch of samples (from any number of domains), refuses those
out of time order, steps the forecaster once for the batch, and advances each domain's
alert episode. It is synchronous and does no I/O: the ingest loop and the HTTP routes call
it and handle Redis and webhooks themselves.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.forecast import Forecast, Forecaster, release_state
from oomcast.model.schema import Domain, Event, Sample, SchemaError
from oomcast.service import alerts
from oomcast.service.alerts import AlertPolicy, AlertTracker
from oomcast.service.rules import Rule, Tracker, end_episode, rule_payload, step_rule


@dataclass(slots=True)
class HistoryPoint:
    ts: float
    used_bytes: int
    total_bytes: int
    risk: float  # at the alert rule's horizon
    time_to_oom_s: float | None


@dataclass
class DomainState:
    domain: Domain
    forecaster_state: Any
    history: deque[HistoryPoint]
    last: Sample | None = None
    forecast: Forecast | None = None
    alert: AlertTracker = field(default_factory=AlertTracker)
    samples_seen: int = 0
    ooms_seen: int = 0
    last_oom_ts: float | None = None
    last_seen_wall: float = 0.0
    job: str | None = None
    trackers: dict[str, Tracker] = field(default_factory=dict)  # per rule, when rules run

    def summary(self, horizon_s: int) -> dict[str, Any]:
        s, f = self.last, self.forecast
        assert s is not None and f is not None
        return {
            "node": s.node,
            "device": s.device,
            "kind": s.kind,
            "job": self.job,
            "used_bytes": s.used_bytes,
            "total_bytes": s.total_bytes,
            "used_frac": round(s.used_frac, 4),
            "observed_at": s.ts,
            "risk": {str(h): round(p, 4) for h, p in f.risk.items()},
            "alert_risk": round(f.risk_at(horizon_s), 4),
            "time_to_oom_s": None if f.time_to_oom_s is None else round(f.time_to_oom_s, 1),
            "model_version": f.model_version,
            "alert": self._alert_summary(),
            "samples_seen": self.samples_seen,
            "ooms_seen": self.ooms_seen,
            "last_oom_ts": self.last_oom_ts,
        }

    def _alert_summary(self) -> dict[str, Any]:
        if not self.trackers:
            return {
                "firing": self.alert.firing,
                "episode": self.alert.episode,
                "fired_at": self.alert.fired_at,
            }
        firing = {n: t for n, t in self.trackers.items() if t.firing}
        first = min(firing.values(), key=lambda t: t.fired_at or 0.0) if firing else None
        return {
            "firing": bool(firing),
            "episode": first.episode if first else None,
            "fired_at": first.fired_at if first else None,
            "rules": {
                n: {"firing": t.firing, "episode": t.episode, "suppressed": t.suppressed}
                for n, t in self.trackers.items()
            },
        }


def _seen_before(st: DomainState, sample: Sample) -> bool:
    """A redelivered sample matches one already in the domain's history."""
    for point in reversed(st.history):
        if point.ts < sample.ts:
            return False
        if point.ts == sample.ts and point.used_bytes == sample.used_bytes:
            return True
    return False


@dataclass(slots=True)
class Applied:
    forecasts: list[tuple[DomainState, Forecast]]
    rejected: list[tuple[Sample, SchemaError]]
    duplicates: int
    alerts: list[dict[str, Any]]
    late: int = 0


class LiveState:
    """``policy`` sets the horizon shown and ranked by; with ``rules`` (the service always
    passes them) every rule keeps its own episode per domain, else ``policy`` alone alerts."""

    def __init__(
        self,
        forecaster: Forecaster,
        policy: AlertPolicy,
        history_len: int = 600,
        rules: list[Rule] | None = None,
    ) -> None:
        self.forecaster = forecaster
        self.policy = policy
        self.history_len = history_len
        self.rules = rules
        self.domains: dict[Domain, DomainState] = {}

    def _end_rules(self, st: DomainState, reason: str, *, new_job: bool) -> list[dict[str, Any]]:
        """End every firing episode of the domain with a resolved alert saying why."""
        out = []
        for rule in self.rules or []:
            tracker = st.trackers.get(rule.name)
            if tracker is None:
                continue
            if tracker.firing and st.last is not None and st.forecast is not None:
                out.append(
                    rule_payload("resolved", rule, tracker, st.last, st.forecast, reason, st.job)
                )
            end_episode(tracker, forget_cooldown=new_job)
        return out

    def _state(self, domain: Domain) -> DomainState:
        st = self.domains.get(domain)
        if st is None:
            st = DomainState(domain, self.forecaster.init_state(), deque(maxlen=self.history_len))
            self.domains[domain] = st
        return st

    def apply(
        self,
        samples: list[Sample],
        now_wall: float | None = None,
        embeddings: list[list[float] | None] | None = None,
    ) -> Applied:
        """Forecast a batch; samples of one domain are applied in order, one per round, so
        each round steps the forecaster once for all the domains in it (a batched call).
        ``embeddings`` runs parallel to ``samples`` (the node's, where they match)."""
        now_wall = time.time() if now_wall is None else now_wall
        result = Applied([], [], 0, [])
        rounds: list[list[tuple[Sample, list[float] | None]]] = []
        depth: dict[Domain, int] = {}
        embs = embeddings if embeddings is not None else [None] * len(samples)
        for sample, emb in zip(samples, embs, strict=True):
            k = depth.get(sample.domain, 0)
            depth[sample.domain] = k + 1
            if k == len(rounds):
                rounds.append([])
            rounds[k].append((sample, emb))
        for round_samples in rounds:
            self._apply_round(round_samples, now_wall, result)
        return result

    def _apply_round(
        self,
        samples: list[tuple[Sample, list[float] | None]],
        now_wall: float,
        result: Applied,
    ) -> None:
        batch: list[tuple[DomainState, Sample, list[float] | None]] = []
        for sample, emb in samples:
            st = self._state(sample.domain)
            if st.last_oom_ts is not None and sample.ts <= st.last_oom_ts:
                result.late += 1  # from the job that already OOMed, read after its OOM event
                continue
            if st.last is not None and sample.ts <= st.last.ts:
                if _seen_before(st, sample):
                    result.duplicates += 1  # at-least-once delivery sends some entries twice
                else:
                    problem = SchemaError(
                        "ts",
                        f"{sample.ts} is not after the previous sample of"
                        f" {sample.node}/{sample.device} ({st.last.ts})",
                    )
                    result.rejected.append((sample, problem))
                continue
            if sample.job is not None and st.job is not None and sample.job != st.job:
                # Another job on the same device: its history is not this one's. The node
                # agent restarts its embedding here too; samples that come over HTTP have
                # their embedding computed in this state, so it must restart the same way.
                release_state(self.forecaster, st.forecaster_state)
                st.forecaster_state = self.forecaster.init_state()
                result.alerts.extend(
                    self._end_rules(st, f"job {sample.job} replaced {st.job}", new_job=True)
                )
            st.last = sample
            batch.append((st, sample, emb))
        if not batch:
            return
        forecasts = self.forecaster.step(
            [st.forecaster_state for st, _, _ in batch],
            [s for _, s, _ in batch],
            [e for _, _, e in batch],
        )
        horizon = self.policy.rule.horizon_s
        for (st, sample, _), fc in zip(batch, forecasts, strict=True):
            st.forecast = fc
            st.samples_seen += 1
            st.last_seen_wall = now_wall
            if sample.job is not None:
                st.job = sample.job
            st.history.append(
                HistoryPoint(
                    sample.ts,
                    sample.used_bytes,
                    sample.total_bytes,
                    fc.risk_at(horizon),
                    fc.time_to_oom_s,
                )
            )
            if self.rules is None:
                payload = alerts.update(st.alert, self.policy, sample, fc)
                if payload is not None:
                    payload["job"] = st.job
                    result.alerts.append(payload)
            else:
                for rule in self.rules:
                    tracker = st.trackers.get(rule.name)
                    if tracker is None:
                        tracker = st.trackers[rule.name] = Tracker()
                    payload = step_rule(tracker, rule, sample, fc, st.job)
                    if payload is not None:
                        result.alerts.append(payload)
            result.forecasts.append((st, fc))

    def on_event(self, event: Event, now_wall: float | None = None) -> list[dict[str, Any]]:
        """Record an event; an OOM ends the domain's episodes and restarts its forecaster."""
        if event.event != "oom":
            return []
        st = self._state(event.domain)
        st.last_seen_wall = time.time() if now_wall is None else now_wall
        st.ooms_seen += 1
        st.last_oom_ts = max(event.ts, st.last_oom_ts or event.ts)
        out: list[dict[str, Any]] = []
        if self.rules is not None:
            out = self._end_rules(st, "the job ran out of memory", new_job=True)
        elif st.alert.firing and st.last is not None and st.forecast is not None:
            out.append(
                alerts.alert_payload(
                    "resolved",
                    st.last,
                    st.forecast,
                    st.alert,
                    self.policy,
                    "the job ran out of memory",
                    job=event.job or st.job,
                )
            )
        alerts.reset(st.alert)
        # The job that OOMed is gone; its successor starts from a clean slate.
        release_state(self.forecaster, st.forecaster_state)
        st.forecaster_state = self.forecaster.init_state()
        return out

    def expire(self, now_wall: float, live_after_s: float) -> list[dict[str, Any]]:
        """Forget domains silent for ``live_after_s``; a firing episode ends with a resolved
        alert that says why, rather than just vanishing."""
        out = []
        for domain, st in list(self.domains.items()):
            if now_wall - st.last_seen_wall <= live_after_s:
                continue
            reason = f"no samples for {now_wall - st.last_seen_wall:.0f}s"
            out.extend(self._end_rules(st, reason, new_job=False))
            if st.alert.firing and st.last is not None and st.forecast is not None:
                out.append(
                    alerts.alert_payload(
                        "resolved", st.last, st.forecast, st.alert, self.policy, reason, job=st.job
                    )
                )
            release_state(self.forecaster, st.forecaster_state)
            del self.domains[domain]
        return out

    def live(self, now_wall: float, live_after_s: float) -> list[DomainState]:
        """Domains with a forecast and a sample within ``live_after_s``."""
        return [
            st
            for st in self.domains.values()
            if st.forecast is not None and now_wall - st.last_seen_wall <= live_after_s
        ]

    def ranked(self, now_wall: float, live_after_s: float) -> list[DomainState]:
        horizon = self.policy.rule.horizon_s
        states = self.live(now_wall, live_after_s)
        assert all(st.forecast is not None for st in states)
        return sorted(
            states,
            key=lambda st: (
                -st.forecast.risk_at(horizon),  # type: ignore[union-attr]
                -st.forecast.max_risk,  # type: ignore[union-attr]
                -(st.last.used_frac if st.last else 0.0),
            ),
        )
