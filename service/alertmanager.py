"""Push oomcast's alerts to Prometheus Alertmanager (``POST /api/v2/alerts``), off the ingest path.

The lifecycle is the webhook sender's: ``submit`` never waits (a full queue drops the alert and
counts the drop), deliveries run as background tasks with exponential backoff up to a cap.

Alertmanager keeps an alert active until its ``endsAt`` passes, so a firing alert is posted
with ``endsAt`` a few re-send periods ahead and re-sent every ``resend_s`` while its episode
fires (what Alertmanager asks of its clients); a resolved one is posted with ``endsAt`` = the
time it resolved, which ends it at once. If oomcast dies mid-episode, or a resolve is lost,
the alert still ends on its own within ``max(3 * resend_s, 5 min)``.

Deliveries of one alert, keyed by (node, device, alertname), stay in order: a resolve never
lands before an older firing that is still being retried (Alertmanager would take that late
firing as the newest word and bring the alert back). A re-send is skipped while an earlier
delivery of the same alert is still queued or retrying, and one that failed outright is made
good by the next re-send.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections import Counter
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, cast

from oomcast.service.delivery import OrderedSender

log = logging.getLogger(__name__)

DEFAULT_ALERTNAME = "OomcastOOMForecast"
DEFAULT_SEVERITY = "warning"
MIN_LEASE_S = 300.0  # a firing alert's endsAt is at least this far ahead of its sending
GIB = float(1 << 30)

AlertKey = tuple[str, str, str]  # (node, device, alertname)


def rfc3339(ts: float) -> str:
    """A Unix time as RFC 3339 in UTC with a 'Z', to the millisecond."""
    return datetime.fromtimestamp(ts, tz=UTC).isoformat(timespec="milliseconds")[:-6] + "Z"


def alert_key(payload: Mapping[str, Any]) -> AlertKey:
    return (
        str(payload.get("node") or ""),
        str(payload.get("device") or ""),
        str(payload.get("rule_name") or DEFAULT_ALERTNAME),
    )


def labels_for(payload: Mapping[str, Any]) -> dict[str, str]:
    node, device, alertname = alert_key(payload)
    labels = {
        "alertname": alertname,
        "node": node,
        "device": device,
        "severity": str(payload.get("severity") or DEFAULT_SEVERITY),
    }
    if payload.get("job") is not None:
        labels["job"] = str(payload["job"])
    # Alertmanager treats an empty label value as no label at all; say so here too.
    return {k: v for k, v in labels.items() if v != ""}


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def _risks(payload: Mapping[str, Any]) -> list[tuple[float, float]]:
    out = []
    for h, p in (payload.get("risk") or {}).items():
        with contextlib.suppress(TypeError, ValueError):
            out.append((float(h), float(p)))
    return sorted(out)


def _headline_risk(payload: Mapping[str, Any]) -> tuple[float, float] | None:
    """The (horizon, risk) to quote: the rule's horizon when the payload or its rule text
    names one, else the shortest horizon that covers the time to OOM, else the riskiest."""
    risks = _risks(payload)
    if not risks:
        return None
    by_h = dict(risks)
    wanted = payload.get("horizon_s")
    if wanted is None:
        m = re.search(r"within (\d+(?:\.\d+)?)\s*s", str(payload.get("rule") or ""))
        wanted = m.group(1) if m else None
    if wanted is not None:
        with contextlib.suppress(TypeError, ValueError):
            if float(wanted) in by_h:
                return float(wanted), by_h[float(wanted)]
    tto = payload.get("time_to_oom_s")
    if tto is not None:
        covering = [(h, p) for h, p in risks if h >= tto]
        if covering:
            return covering[0]
    return max(risks, key=lambda hp: (hp[1], -hp[0]))


def annotations_for(payload: Mapping[str, Any]) -> dict[str, str]:
    node, device = payload.get("node"), payload.get("device")
    tto = payload.get("time_to_oom_s")
    headline = _headline_risk(payload)
    risk_txt = f"risk {headline[1]:.2f} within {headline[0]:g} s" if headline else None
    if payload.get("status") == "resolved":
        summary = f"{device} on {node}: the OOM forecast has ended"
        if payload.get("reason"):
            summary += f" ({payload['reason']})"
    elif tto is not None:
        summary = f"{device} on {node} is forecast to run out of memory in ~{_duration(tto)}"
        summary += f" ({risk_txt})" if risk_txt else ""
    else:
        summary = f"{device} on {node} is at risk of running out of memory"
        summary += f" ({risk_txt})" if risk_txt else ""

    parts = []
    used, total = payload.get("used_bytes"), payload.get("total_bytes")
    if used is not None and total:
        parts.append(f"memory {used / GIB:.1f}/{total / GIB:.1f} GiB ({100 * used / total:.0f}%)")
    elif used is not None:
        parts.append(f"memory {used / GIB:.1f} GiB used")
    if tto is not None:
        parts.append(f"time_to_oom_s {tto:.0f}")
    risks = _risks(payload)
    if risks:
        parts.append("risk " + " ".join(f"{h:g}s={p:.2f}" for h, p in risks))
    for field in ("reason", "model_version", "episode", "rule", "action"):
        if payload.get(field) not in (None, ""):
            parts.append(f"{field} {payload[field]}")
    out = {"summary": summary, "description": "; ".join(parts)}
    if payload.get("episode"):
        out["episode"] = str(payload["episode"])
    return out


@dataclass(slots=True)
class _Delivery:
    key: AlertKey
    payload: Mapping[str, Any]
    starts_at: float
    ends_at: float | None  # None: firing, endsAt is set when each attempt is made


@dataclass(slots=True)
class _Firing:
    payload: Mapping[str, Any]
    starts_at: float
    due: float  # time.monotonic() of the next re-send


class AlertmanagerSender(OrderedSender):
    what = "alertmanager"

    def __init__(
        self,
        url: str,
        *,
        resend_s: float = 60.0,
        timeout_s: float = 5.0,
        max_attempts: int = 6,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        queue_size: int = 1000,
        on_result: Callable[[str], None] | None = None,
        generator_url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if resend_s <= 0:
            raise ValueError("resend_s must be positive")
        super().__init__(
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            queue_size=queue_size,
            on_result=on_result,
        )
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.resend_s = resend_s
        self.lease_s = max(3 * resend_s, MIN_LEASE_S)
        self.generator_url = generator_url
        self._clock = clock
        self._resender: asyncio.Task[None] | None = None
        self._firing: dict[AlertKey, _Firing] = {}
        self._pending: Counter[AlertKey] = Counter()  # queued or in flight, per alert

    @property
    def firing(self) -> list[AlertKey]:
        """The alerts being kept alive by re-sends."""
        return list(self._firing)

    def submit(self, payload: Mapping[str, Any]) -> bool:
        """Queue a firing or resolved alert; never waits. False if it was not queued."""
        status = payload.get("status")
        key = alert_key(payload)
        now = self._clock()
        if status == "firing":
            fired_at = payload.get("fired_at")
            starts_at = float(fired_at) if fired_at is not None else now
            # Kept even when the queue is full: the next re-send delivers it.
            self._firing[key] = _Firing(payload, starts_at, time.monotonic() + self.resend_s)
            return self._enqueue(_Delivery(key, payload, starts_at, None))
        if status == "resolved":
            was = self._firing.pop(key, None)
            fired_at = payload.get("fired_at")
            if fired_at is not None:
                starts_at = float(fired_at)
            else:
                starts_at = was.starts_at if was is not None else now
            return self._enqueue(_Delivery(key, payload, min(starts_at, now), now))
        log.error("alertmanager: ignored an alert with status %r for %s/%s", status, *key[:2])
        return False

    def _enqueue(self, delivery: _Delivery) -> bool:
        if not self._put(delivery.key, delivery, _describe(delivery)):
            return False
        self._pending[delivery.key] += 1
        return True

    def _finished(self, key: Hashable) -> None:
        alert = cast(AlertKey, key)  # this sender queues by AlertKey
        self._pending[alert] -= 1
        if self._pending[alert] <= 0:
            del self._pending[alert]

    async def start(self) -> None:
        await super().start()
        self._resender = asyncio.create_task(self._resend(), name="alertmanager-resend")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop re-sending; give queued and in-flight deliveries ``grace_s`` to finish, then
        cancel them. Alerts still firing in Alertmanager end when their ``endsAt`` passes."""
        if self._resender:
            self._resender.cancel()
            await asyncio.gather(self._resender, return_exceptions=True)
        await super().stop(grace_s)

    async def _resend(self) -> None:
        while True:
            now = time.monotonic()
            wait = self.resend_s
            for key, st in list(self._firing.items()):
                if st.due <= now:
                    st.due = now + self.resend_s
                    # One still queued or retrying carries the same alert, fresher at its
                    # next attempt: no need to stack another behind it.
                    if self._pending[key] == 0:
                        self._enqueue(_Delivery(key, st.payload, st.starts_at, None))
                wait = min(wait, st.due - now)
            await asyncio.sleep(max(wait, 0.01))

    def _body(self, delivery: _Delivery) -> bytes:
        """The JSON list of one alert, as Alertmanager's API v2 takes it."""
        ends_at = delivery.ends_at
        if ends_at is None:
            ends_at = max(self._clock(), delivery.starts_at) + self.lease_s
        alert: dict[str, Any] = {
            "labels": labels_for(delivery.payload),
            "annotations": annotations_for(delivery.payload),
            "startsAt": rfc3339(delivery.starts_at),
            "endsAt": rfc3339(ends_at),
        }
        if self.generator_url:
            alert["generatorURL"] = self.generator_url
        return json.dumps([alert], separators=(",", ":")).encode()

    async def _deliver(self, delivery: _Delivery) -> None:
        headers = {"Content-Type": "application/json", "User-Agent": "oomcast"}
        # the body anew for each attempt: a firing's endsAt moves on
        await self._post(self.url, lambda: self._body(delivery), headers, _describe(delivery))


def _describe(delivery: _Delivery) -> str:
    node, device, name = delivery.key
    return f"{delivery.payload.get('status')} {name} for {node}/{device}"
