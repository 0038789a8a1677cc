"""The demo's closing summary (``summarize``): the alerts the webhook receiver got, scored
against the OOMs the service saw. A pure function of them, so tests pin it exactly."""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from oomcast.collectors.sources.sim import OOM_PATTERNS


@dataclass(frozen=True)
class Oom:
    """An OOM the service saw: the domain, the ``ts`` of its ``oom`` event, the job."""

    node: str
    device: str
    ts: float
    job: str | None = None
    from_alert: bool = False  # no event seen: the time is its resolved alert's observed_at


@dataclass
class _Episode:
    node: str
    device: str
    first: dict[str, Any]  # the earliest firing webhook of the episode
    resolved: dict[str, Any] | None
    oom: Oom | None = None


def _oom_resolution(alert: dict[str, Any]) -> bool:
    return "out of memory" in str(alert.get("reason"))


def _hms(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def summarize(
    received: Sequence[tuple[dict[str, Any], bool]],
    ooms: Sequence[Oom],
    patterns: Mapping[tuple[str, str], str] | None = None,
    started_at: float | None = None,
    clock: Callable[[float], str] = _hms,
) -> list[str]:
    """The demo's closing summary, from the webhooks received (payload, signature valid) and
    the OOMs the service saw; a pure function of them.

    Webhooks with a bad signature are counted and otherwise ignored, and repeated deliveries
    of the same body count once. An *alert* is an episode, the webhooks sharing ``node``,
    ``device``, ``rule_name`` and ``episode``, of which at least one is ``firing``; it opens
    at the ``observed_at`` of its first firing and closes at the ``observed_at`` of its
    ``resolved`` webhook, if one came. An alert *warned of* an OOM on its domain if it was
    open at the OOM (at or after it opened and, unless it resolved because the job ran out
    of memory, no later than it closed) and its first firing's ``observed_at`` is before
    the OOM; a ``resolved`` "ran out of memory" with no OOM seen after the alert opened is
    taken as an OOM at that alert's ``observed_at``. A *false alarm* is an alert that no
    OOM of its domain fell in: it resolved without an OOM, or was still open at the end on
    a domain whose pattern (``patterns``) never OOMs. One still open on a domain that may
    yet OOM is neither, and is counted as still open.

    The first line is the totals; then, per OOM in time order, one line: warned (when the
    first firing alert fired, its predicted ``time_to_oom_s``, the actual time from its
    ``observed_at`` to the OOM, and the lead: from its firing to the OOM) or missed; then
    a line per false alarm. ``t+`` times count from ``started_at``.
    """
    patterns = dict(patterns or {})

    def at(ts: float) -> str:
        return clock(ts) if started_at is None else f"{clock(ts)} (t+{ts - started_at:.1f}s)"

    bad = sum(1 for _, ok in received if not ok)
    unique: dict[str, dict[str, Any]] = {}
    for alert, ok in received:
        if ok:
            unique.setdefault(json.dumps(alert, sort_keys=True, default=str), alert)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for alert in unique.values():
        key = (
            alert.get("node"),
            alert.get("device"),
            alert.get("rule_name"),
            alert.get("episode") or alert.get("fired_at"),
        )
        groups.setdefault(key, []).append(alert)
    episodes = []
    for (node, device, _, _), alerts in groups.items():
        firing = [a for a in alerts if a.get("status") == "firing"]
        if not firing:
            continue  # the receiver never heard this one fire
        first = min(firing, key=lambda a: (float(a["observed_at"]), a.get("sent_at") or 0.0))
        ends = [a for a in alerts if a.get("status") == "resolved"]
        resolved = min(ends, key=lambda a: a.get("sent_at") or 0.0) if ends else None
        episodes.append(_Episode(str(node), str(device), first, resolved))
    episodes.sort(key=lambda e: (float(e.first["observed_at"]), e.node, e.device))

    all_ooms = sorted(ooms, key=lambda o: (o.ts, o.node, o.device))
    for e in episodes:
        opened = float(e.first["observed_at"])
        closed = None if e.resolved is None else float(e.resolved["observed_at"])
        by_oom = e.resolved is not None and _oom_resolution(e.resolved)
        e.oom = next(
            (
                o
                for o in all_ooms
                if (o.node, o.device) == (e.node, e.device)
                and o.ts >= opened
                and (closed is None or by_oom or o.ts <= closed)
            ),
            None,
        )
        if e.oom is None and by_oom:
            assert e.resolved is not None and closed is not None
            e.oom = Oom(e.node, e.device, closed, e.resolved.get("job"), from_alert=True)
            all_ooms = sorted([*all_ooms, e.oom], key=lambda o: (o.ts, o.node, o.device))

    def never_ooms(e: _Episode) -> bool:
        pattern = patterns.get((e.node, e.device))
        return pattern is not None and pattern not in OOM_PATTERNS

    unmatched = [e for e in episodes if e.oom is None]
    false_alarms = [e for e in unmatched if e.resolved is not None or never_ooms(e)]
    still_open = len(unmatched) - len(false_alarms)
    lines = []
    warned = 0
    for o in all_ooms:
        before = [e for e in episodes if e.oom is o and float(e.first["observed_at"]) < o.ts]
        where = f"{o.node}/{o.device}"
        if not before:
            lines.append(f"  missed OOM {where} job={o.job}: OOM at {at(o.ts)}, no alert before it")
            continue
        warned += 1
        e = min(before, key=lambda e: float(e.first.get("fired_at") or e.first["observed_at"]))
        fired = float(e.first.get("fired_at") or e.first.get("sent_at") or e.first["observed_at"])
        tto = e.first.get("time_to_oom_s")
        predicted = "none" if tto is None else f"{float(tto):.0f}s"
        actual = o.ts - float(e.first["observed_at"])
        source = "; OOM time from the resolved alert" if o.from_alert else ""
        lines.append(
            f"  warned OOM {where} job={e.first.get('job')}: first firing {at(fired)},"
            f" predicted time_to_oom_s {predicted}, actual {actual:.1f}s from its observed_at"
            f" to the OOM at {at(o.ts)}; lead {o.ts - fired:.1f}s{source}"
        )
        if e.first.get("cause"):
            fix = (e.first.get("remedies") or ["-"])[0]
            lines.append(f"    cause {e.first['cause']}; fix: {fix}")
    for e in false_alarms:
        fired = float(e.first.get("fired_at") or e.first.get("sent_at") or e.first["observed_at"])
        if e.resolved is not None:
            ended = float(e.resolved.get("sent_at") or e.resolved["observed_at"])
            how = f"resolved {at(ended)} without an OOM ({e.resolved.get('reason')})"
        else:
            how = f"still open at the end; a {patterns[(e.node, e.device)]} job never OOMs"
        lines.append(
            f"  false alarm {e.node}/{e.device} job={e.first.get('job')}: fired {at(fired)}, {how}"
        )
    alarms = _plural(len(false_alarms), "false alarm")
    head = (
        f"demo over: {_plural(len(all_ooms), 'OOM')}, {warned} of them warned of in advance;"
        f" {_plural(len(episodes), 'alert')} fired in all, {alarms}"
        + (f", {still_open} still open" if still_open else "")
        + f"; {_plural(len(received), 'webhook')} received, {bad} with a bad signature."
    )
    return [head, *lines]
