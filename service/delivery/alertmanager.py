"""Push oomcast's alerts to Prometheus Alertmanager (``POST /api/v2/alerts``).

Delivery is the outbox's (``service/delivery/outbox.py``, ``service/delivery/worker.py``):
a firing alert's first push and its resolve are owed durably, retried across restarts, and go
in order per alert (node, device, alertname), so a resolve never lands before an older firing
still being retried (Alertmanager would take that late firing as the newest word and bring the
alert back).

Alertmanager keeps an alert active until its ``endsAt`` passes, so a firing alert is posted
with ``endsAt`` a lease ahead (``max(3 * resend_s, 5 min)`` from each attempt) and re-sent
every ``resend_s`` while its episode fires (what Alertmanager asks of its clients); a resolved
one is posted with ``endsAt`` = the time it resolved, which ends it at once. Re-sends are
keep-alives, not owed alerts: the replica whose ingest holds the episode stages one every
``resend_s`` into the same ordered queue, only when nothing of that alert is owed already,
with a lifetime of one period and no audit record. If oomcast dies mid-episode, the re-sends
stop with it and the alert still ends on its own when its lease runs out.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from oomcast.model.text import compact_json
from oomcast.service.delivery.outbox import Delivery, Outbox

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
    # Why, and what to do: their own annotations, so a template or a runbook link can use them
    if payload.get("cause"):
        cause = str(payload["cause"])
        out["cause"] = cause + (f": {payload['evidence']}" if payload.get("evidence") else "")
        out["summary"] += f" [cause: {cause}]"
    remedies = payload.get("remedies") or []
    if remedies:
        out["remedies"] = "\n".join(f"- {r}" for r in remedies)
    thin = payload.get("cause_thin") or []
    if thin:
        out["evidence_thin"] = "; ".join(str(t) for t in thin)
    return out


@dataclass(slots=True)
class _Firing:
    payload: Mapping[str, Any]
    due: float  # time.monotonic() of the next re-send


class AlertmanagerTarget:
    name = "alertmanager"

    def __init__(
        self,
        url: str,
        outbox: Outbox,
        *,
        resend_s: float = 60.0,
        generator_url: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if resend_s <= 0:
            raise ValueError("resend_s must be positive")
        self.url = url.rstrip("/") + "/api/v2/alerts"
        self.outbox = outbox
        self.resend_s = resend_s
        self.lease_s = max(3 * resend_s, MIN_LEASE_S)
        self.generator_url = generator_url
        self._clock = clock
        self._firing: dict[AlertKey, _Firing] = {}
        self._resender: asyncio.Task[None] | None = None

    @property
    def firing(self) -> list[AlertKey]:
        """The alerts being kept alive by re-sends."""
        return list(self._firing)

    def order_key(self, payload: Mapping[str, Any]) -> str:
        return compact_json(list(alert_key(payload)))

    def owed(self, delivery: Delivery) -> None:
        """A firing alert is kept alive from now on, until its resolve is owed."""
        if delivery.quiet:
            return
        status = delivery.payload.get("status")
        if status == "firing":
            payload = dict(delivery.payload)
            if payload.get("fired_at") is None:
                payload["fired_at"] = delivery.created_at
            self.keep_alive(payload)
        elif status == "resolved":
            self._firing.pop(alert_key(delivery.payload), None)

    def forget(self, domains: set[tuple[str, str]]) -> None:
        """Stop re-sending the alerts of ``domains``: another replica owns them now, and a
        re-send from here after it resolved them would bring them back in Alertmanager."""
        for key in [k for k in self._firing if (k[0], k[1]) in domains]:
            del self._firing[key]

    def keep_alive(self, payload: Mapping[str, Any]) -> None:
        """Re-send this firing alert every ``resend_s`` from now on, until its resolve is
        owed: for an episode this replica took over from another (its first push was owed
        there), which Alertmanager would otherwise let lapse when its lease runs out."""
        self._firing[alert_key(payload)] = _Firing(payload, time.monotonic() + self.resend_s)

    async def start(self) -> None:
        self._resender = asyncio.create_task(self._resend(), name="alertmanager-resend")

    async def stop(self) -> None:
        """Stop re-sending. Alerts still firing in Alertmanager end when their lease runs
        out, unless another oomcast takes their domains over and fires them again."""
        if self._resender:
            self._resender.cancel()
            await asyncio.gather(self._resender, return_exceptions=True)

    async def _resend(self) -> None:
        while True:
            now = time.monotonic()
            wait = self.resend_s
            due = []
            for st in self._firing.values():
                if st.due <= now:
                    st.due = now + self.resend_s
                    due.append(self._keepalive(st.payload))
                wait = min(wait, st.due - now)
            if due:
                try:
                    # only where nothing of the alert is owed: one still owed carries the
                    # same alert, with a fresh lease at its next attempt
                    await self.outbox.put(due, self._clock(), idle_only=True)
                except Exception as exc:  # the next period tries again; the lease covers it
                    log.warning("alertmanager: re-sends not staged (%s)", exc)
            await asyncio.sleep(max(wait, 0.01))

    def _keepalive(self, payload: Mapping[str, Any]) -> Delivery:
        now = self._clock()
        return Delivery(
            id=f"{payload.get('episode')}.resend.{round(now * 1000)}.{self.name}",
            target=self.name,
            order=self.order_key(payload),
            payload=payload,
            created_at=now,
            quiet=True,
            max_age_s=self.resend_s,
        )

    def body(self, delivery: Delivery, now: float) -> bytes:
        """The JSON list of one alert, as Alertmanager's API v2 takes it."""
        payload = delivery.payload
        fired_at = payload.get("fired_at")
        starts_at = float(fired_at) if fired_at is not None else delivery.created_at
        if payload.get("status") == "resolved":
            resolved_at = float(payload.get("sent_at") or delivery.created_at)
            starts_at = min(starts_at, resolved_at)
            ends_at = resolved_at
        else:
            ends_at = max(now, starts_at) + self.lease_s
        alert: dict[str, Any] = {
            "labels": labels_for(payload),
            "annotations": annotations_for(payload),
            "startsAt": rfc3339(starts_at),
            "endsAt": rfc3339(ends_at),
        }
        if self.generator_url:
            alert["generatorURL"] = self.generator_url
        return compact_json([alert]).encode()

    def request(self, delivery: Delivery, now: float) -> tuple[str, bytes, dict[str, str]]:
        # built anew for each attempt: a firing's endsAt moves on
        headers = {"Content-Type": "application/json", "User-Agent": "oomcast"}
        return self.url, self.body(delivery, now), headers
