"""Counting what a fault scenario kept and lost, from the durable record, never from hope.

Samples. The producers say how many samples Redis took (an agent's own summary on exit; the
202 answers of ``POST /v1/samples``). The streams say which samples Redis holds, and the
consumer group which entries the service has acknowledged: it acknowledges an entry only
once everything it caused (forecasts, alerts, commands, dead letters) is on record, so an
acknowledged entry is one the service has taken responsibility for, even when the replica
that did it has since been killed (its counters die with it; Redis does not). The
dead-letter stream says which samples were refused, and why. Per sample (node, device, ts):

- *in Redis*: some copy of it is in a sample stream (at-least-once delivery makes copies);
- *processed*: some copy is acknowledged and not every acknowledged copy was dead-lettered:
  forecast, or skipped as the service skips without refusing (a repeat of a sample already
  forecast; a sample of a job read after the job's OOM); the service's own counters of
  each are reported beside, for the replicas still alive at the end;
- *dead-lettered*: every acknowledged copy was refused; it is listed, with the reason;
- *lost*: accepted, and neither processed nor dead-lettered (missing from Redis, or never
  acknowledged by any replica).

Alerts. Owed: an alert record in the audit stream whose ``dispatched.webhook`` is ``owed``;
its delivery id is computed as the service computes it. Delivered: owed ids the receiver
answered 2xx; duplicated: 2xx answers beyond the first of an id.

Actions. Wrongly taken: an ``action_result`` event with outcome ``done`` of a live command
that was not the scenario's own control, or a victim process that died.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, cast

import redis

from oomcast.model.text import as_str
from oomcast.model.wire import DecodedSample, Keys, decode_samples
from oomcast.service.delivery.outbox import delivery_id

SampleId = tuple[str, str, float]  # node, device, ts
GROUP = "oomcast-service"  # the consumer group every replica of the bench reads in


def _id(entry_id: bytes | str) -> tuple[int, int]:
    ms, _, seq = as_str(entry_id).partition("-")
    return int(ms), int(seq or 0)


def xrange_all(client: redis.Redis, key: str) -> list[tuple[str, dict[bytes, bytes]]]:
    """Every entry of a stream, oldest first, read in pages."""
    out: list[tuple[str, dict[bytes, bytes]]] = []
    start = "-"
    while True:
        page = cast(Any, client.xrange(key, min=start, max="+", count=5000))
        if not page:
            return out
        for entry_id, fields in page:
            out.append((as_str(entry_id), fields))
        ms, seq = _id(page[-1][0])
        start = f"{ms}-{seq + 1}"


@dataclass
class StreamState:
    """A sample stream's entries and which of them the group has acknowledged."""

    entries: list[tuple[str, dict[bytes, bytes]]]
    acked: set[str]
    pending: int
    unread: int


def stream_state(client: redis.Redis, stream: str, group: str = GROUP) -> StreamState:
    entries = xrange_all(client, stream)
    info: dict[str, Any] | None = None
    try:
        for g in cast(Any, client.xinfo_groups(stream)):
            if as_str(g["name"]) == group:
                info = g
    except redis.ResponseError:  # no such stream
        info = None
    if info is None:
        return StreamState(entries, set(), 0, len(entries))
    last = _id(info["last-delivered-id"])
    pending_ids: set[str] = set()
    if int(info["pending"]):
        rows = cast(Any, client.xpending_range(stream, group, min="-", max="+", count=1_000_000))
        pending_ids = {as_str(r["message_id"]) for r in rows}
    acked = {eid for eid, _ in entries if _id(eid) <= last and eid not in pending_ids}
    unread = sum(1 for eid, _ in entries if _id(eid) > last)
    return StreamState(entries, acked, len(pending_ids), unread)


def drained(client: redis.Redis, keys: Keys, group: str = GROUP) -> bool:
    """True when every sample stream's entries have all been read and acknowledged."""
    try:
        for stream in keys.all_samples():
            st = stream_state(client, stream, group)
            if st.pending or st.unread:
                return False
    except redis.RedisError:
        return False
    return True


@dataclass
class Producer:
    """Who put legitimate samples into Redis, and how many Redis took: exactly which, when
    known (``ids``), else how many (an agent's count: every sample it made, when it dropped
    and left undelivered none)."""

    name: str
    node: str
    accepted: int
    ids: set[SampleId] | None = None
    note: str | None = None


def _sample_ids(fields: Mapping[bytes, bytes]) -> list[SampleId]:
    try:
        decoded = decode_samples(dict(fields))
    except Exception:  # not a sample entry: the forged junk some scenarios write
        return []
    return [
        (d.sample.node, d.sample.device, d.sample.ts)
        for d in decoded
        if isinstance(d, DecodedSample)
    ]


@dataclass
class Copies:
    """How many copies of each sample are in the streams, acknowledged, and refused."""

    stored: Counter[SampleId] = field(default_factory=Counter)
    acked: Counter[SampleId] = field(default_factory=Counter)
    refused: Counter[SampleId] = field(default_factory=Counter)
    reasons: dict[SampleId, set[str]] = field(default_factory=dict)


def _deadletter_ids(fields: Mapping[bytes, bytes]) -> list[SampleId]:
    raw = fields.get(b"sample")
    if raw is not None:
        try:
            obj = json.loads(raw)
            return [(str(obj["node"]), str(obj["device"]), float(obj["ts"]))]
        except (ValueError, KeyError, TypeError):
            return []
    orig = {k[len(b"orig.") :]: v for k, v in fields.items() if k.startswith(b"orig.")}
    return _sample_ids(orig) if orig else []


def copies(
    client: redis.Redis, keys: Keys, skip_entries: Collection[str] = (), group: str = GROUP
) -> Copies:
    """Count the copies of every sample, leaving out the entries ``skip_entries`` (forged)."""
    out = Copies()
    for stream in keys.all_samples():
        st = stream_state(client, stream, group)
        for eid, fields in st.entries:
            if eid in skip_entries:
                continue
            for sid in _sample_ids(fields):
                out.stored[sid] += 1
                if eid in st.acked:
                    out.acked[sid] += 1
    # every dead letter counts, forged entries' too: forged and legitimate samples never
    # share an id (node, device, ts), and what became of the forged ones is a figure
    for _, fields in xrange_all(client, keys.deadletter):
        for sid in _deadletter_ids(fields):
            out.refused[sid] += 1
            out.reasons.setdefault(sid, set()).add(as_str(fields.get(b"code", b"undecodable")))
    return out


def sample_figures(c: Copies, producers: Iterable[Producer]) -> dict[str, Any]:
    """The sample figures of a scenario: accepted, processed, dead-lettered, lost (see the
    module docstring), in all and per producer."""
    total: Counter[str] = Counter()
    reasons: Counter[str] = Counter()
    per: dict[str, dict[str, Any]] = {}
    for p in producers:
        mine = {sid for sid in c.stored if sid[0] == p.node}
        if p.ids is not None:
            mine &= p.ids
        forecast = {sid for sid in mine if c.acked[sid] > c.refused[sid]}
        refused = {sid for sid in mine if c.acked[sid] and sid not in forecast}
        unacked = {sid for sid in mine if not c.acked[sid]}
        if p.ids is not None:
            lost = len(p.ids - forecast - refused)
        else:
            lost = max(0, p.accepted - len(forecast) - len(refused))
        for sid in refused:
            reasons.update(c.reasons.get(sid, {"?"}))
        row: dict[str, Any] = {
            "samples_accepted": p.accepted,
            "samples_in_redis": len(mine),
            "samples_processed": len(forecast),
            "samples_deadlettered": len(refused),
            "samples_never_acknowledged": len(unacked),
            "samples_lost": lost,
            "extra_copies_in_redis": sum(c.stored[sid] - 1 for sid in mine),
        }
        if p.note:
            row["note"] = p.note
        per[p.name] = row
        total.update({k: v for k, v in row.items() if isinstance(v, int)})
    return {
        "samples_accepted": total["samples_accepted"],
        "samples_processed": total["samples_processed"],
        "samples_deadlettered": total["samples_deadlettered"],
        "samples_deadlettered_by_reason": dict(reasons),
        "samples_lost": total["samples_lost"],
        "samples_extra_copies": total["extra_copies_in_redis"],
        "producers": per,
    }


def forged_figures(c: Copies, forged: Collection[SampleId]) -> dict[str, Any]:
    """What became of forged samples: refused (by reason) or forecast (which is wrong)."""
    reasons: Counter[str] = Counter()
    forecast = 0
    for sid in forged:
        if c.refused[sid]:
            reasons.update(c.reasons.get(sid, {"?"}))
        else:
            forecast += 1
    return {
        "forged_samples": len(forged),
        "forged_samples_refused_by_reason": dict(reasons),
        "forged_samples_not_refused": forecast,
    }


def _json_fields(client: redis.Redis, stream: str, field: bytes) -> list[dict[str, Any]]:
    """Every entry of ``stream`` whose ``field`` holds a JSON object, decoded; the rest
    (a missing field, bad JSON, another type) is skipped."""
    out = []
    for _, fields in xrange_all(client, stream):
        raw = fields.get(field)
        if raw is None:
            continue
        try:
            obj = json.loads(raw)
        except ValueError:
            continue
        if isinstance(obj, dict):
            out.append(obj)
    return out


def audit_records(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return _json_fields(client, keys.alerts, b"alert")


def owed_webhooks(records: Iterable[Mapping[str, Any]]) -> dict[str, Mapping[str, Any]]:
    """Delivery id -> alert record, for every alert on record that owes a webhook."""
    out = {}
    for r in records:
        dispatched = r.get("dispatched")
        if "record" in r or not isinstance(dispatched, dict):
            continue
        if r.get("status") in ("firing", "resolved") and dispatched.get("webhook") == "owed":
            out[delivery_id(r, "webhook")] = r
    return out


def alert_figures(
    records: list[dict[str, Any]],
    received: Mapping[str, int],
    first_at: Mapping[str, float] | None = None,
) -> dict[str, Any]:
    """Owed, delivered, duplicated and lost webhooks; with ``first_at`` (id -> when the
    receiver first got it), how long after its decision each delivered one arrived."""
    owed = owed_webhooks(records)
    delivered = [i for i in owed if received.get(i, 0) > 0]
    delays = sorted(
        max(0.0, first_at[i] - float(owed[i].get("sent_at") or 0))
        for i in delivered
        if first_at and i in first_at
    )
    ends: Counter[str] = Counter(
        str(r.get("outcome"))
        for r in records
        if r.get("record") == "delivery" and r.get("target") == "webhook"
    )
    return {
        "alerts_owed": len(owed),
        "alerts_delivered": len(delivered),
        "alerts_duplicated": sum(received[i] - 1 for i in delivered if received[i] > 1),
        "alerts_lost": len(owed) - len(delivered),
        "alert_delivery_p50_s": round(delays[len(delays) // 2], 2) if delays else None,
        "alert_delivery_max_s": round(delays[-1], 2) if delays else None,
        "deliveries_ended_by_outcome": dict(ends),
        "deliveries_received_not_on_record": len(set(received) - set(owed)),
    }


def events(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return _json_fields(client, keys.events, b"event")


def action_figures(
    evs: Iterable[Mapping[str, Any]], allowed: Collection[str] = (), victims_killed: int = 0
) -> dict[str, Any]:
    """Live actions the agents carried out: the ``allowed`` command ids (a scenario's own
    control) are right; any other, and any victim that died, is wrong."""
    done = [
        e
        for e in evs
        if e.get("event") == "action_result" and e.get("outcome") == "done" and not e.get("dry_run")
    ]
    refused: Counter[str] = Counter(
        str(e.get("reason")) for e in evs if e.get("event") == "command_refused"
    )
    wrong = [e for e in done if e.get("id") not in allowed]
    return {
        "actions_wrongly_taken": len(wrong) + victims_killed,
        "actions_taken_by_control": len(done) - len(wrong),
        "victims_killed": victims_killed,
        "commands_refused_by_reason": dict(refused),
    }
