"""Step 1 of ingest: stream entries read into samples and events, and dead letters, with
a ``code`` each (``REJECT_CODES``), for what cannot be used. Pure functions: no I/O, and the
only time they read is each entry's arrival in Redis (its id), passed in with it.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from oomcast.model.forecast import Embedding as ForecastEmbedding
from oomcast.model.schema import Event, Sample, SchemaError
from oomcast.model.text import as_str, compact_json
from oomcast.model.wire import (
    DecodedSample,
    Keys,
    decode_event,
    decode_sample_batch,
    entry_attested,
    event_attested,
)

log = logging.getLogger("oomcast.service.ingest")

Fields = Mapping[bytes | str, bytes | str]
StreamEntries = Sequence[tuple[bytes | str, Fields | None]]
DeadLetter = dict[str, bytes | str]
KeyForNode = Callable[[str], str | None]
Embedding = ForecastEmbedding | None
# One sample entry is one node's tick: a few KB for 8 GPUs. A field far past this is junk
# (or an attack) that must not reach the JSON parser.
MAX_ENTRY_BYTES = 4 * 1024 * 1024
MAX_KEPT_BYTES = 64 * 1024  # of each field of a dead-lettered entry


# What the node agents and in-job hooks report about actions: kept in the audit stream, next to
# the alerts that caused them, so /v1/alerts tells the whole story of an episode.
AUDITED_EVENTS = frozenset(
    {
        "action_result",
        "command_refused",
        "checkpoint_requested",
        "checkpoint_done",
        "checkpoint_failed",
        "diagnosis_saved",  # the in-job hook wrote a diagnosis bundle (docs/diagnosis.md)
    }
)


@dataclass
class Decoded:
    """A batch of entries, read: samples (with the node's embeddings, where they match the
    model's schema) or events, and dead letters for what could not be read."""

    samples: list[Sample] = field(default_factory=list)
    embeddings: list[Embedding] = field(default_factory=list)
    arrived_ms: list[int] = field(default_factory=list)  # when Redis received each sample
    attested: list[bool] = field(default_factory=list)  # signed by the sample's own node
    events: list[tuple[Event, Fields]] = field(default_factory=list)
    event_ids: list[str] = field(default_factory=list)  # each event's entry id
    events_attested: list[bool] = field(default_factory=list)  # signed by the node it names
    deadletters: list[DeadLetter] = field(default_factory=list)
    # Events of nodes in partitions this replica does not own: (partition, entry id, fields,
    # event). Ingest holds them a while: if the partition becomes ours (its owner died), an
    # OOM its owner never read is still scored.
    others: list[tuple[int, str, Fields, Event]] = field(default_factory=list)


# Why a sample or entry was dead-lettered: the ``code`` of its dead letter and the
# ``reason`` label of oomcast_samples_rejected_total.
REJECT_CODES = (
    "undecodable",  # the entry is not a sample entry at all
    "schema",  # a sample breaks the trace format (a name too long, a negative count, ...)
    "ts_skew",  # its ts is too far from when it reached Redis
    "out_of_order",  # not after the previous sample of its domain
    "unattested",  # unsigned, while the domain's own node signs its samples (or an oom so)
    "wrong_partition",  # in a partition's stream its node does not hash to
    "domain_cap",  # a new domain past the cap on live domains (per node, or in all)
)


def deadletter(
    stream: str, entry_id: bytes | str, fields: Fields, reason: str, code: str = "undecodable"
) -> DeadLetter:
    log.warning("dead-lettered entry %s of %s: %s", as_str(entry_id), stream, reason)
    out: DeadLetter = {
        "stream": stream,
        "entry_id": as_str(entry_id),
        "reason": reason,
        "code": code,
    }
    for k, v in fields.items():
        key = as_str(k)
        if key not in out:
            # what arrived, as it arrived (nothing accepted is lost), up to a bound: a
            # 500 MB field must not be copied into Redis a second time
            out[f"orig.{key}"] = v[:MAX_KEPT_BYTES]
            if len(v) > MAX_KEPT_BYTES:
                out[f"orig.{key}.truncated_from"] = str(len(v))
    return out


def arrival_ms(entry_id: str, now_ms: int) -> int:
    """When an entry reached Redis: its id's time, but never later than now. A writer may
    choose an entry id; one far in the future makes Redis stamp every later entry of the
    stream after it, and those must not all read as arrived in the future."""
    return min(int(entry_id.split("-")[0]), now_ms)


def _skew_problem(ts: float, arrived_s: float, max_skew_s: float) -> str | None:
    skew = ts - arrived_s
    if not max_skew_s or abs(skew) <= max_skew_s:
        return None
    return (
        f"ts {ts!r} is {abs(skew):.0f}s {'ahead of' if skew > 0 else 'behind'} its arrival in"
        f" Redis; the limit is {max_skew_s:g}s (OOMCAST_MAX_TS_SKEW_S)"
    )


def sample_deadletter(
    stream: str, entry_id: str, sample: Sample, reason: str, code: str
) -> DeadLetter:
    """One sample of an entry, refused: the sample as read, why, and the entry it came in."""
    return {
        "stream": stream,
        "entry_id": entry_id,
        "reason": reason,
        "code": code,
        "sample": compact_json(sample.to_dict()),
    }


def decode_sample_entries(
    stream: str,
    entries: StreamEntries,
    emb_version: int | None,
    *,
    max_skew_s: float = 0.0,
    key_for_node: KeyForNode | None = None,
    keys: Keys | None = None,
    now_ms: int | None = None,
) -> Decoded:
    """Step 1 for a sample stream. A sample whose ts lies more than ``max_skew_s`` (0: no
    limit) from the entry's arrival in Redis is dead-lettered. ``key_for_node`` gives a
    node's key: a sample is *attested* when its entry carries a valid signature under the
    key of the node that wrote it and the sample is of that node's own domains. With
    ``keys``, a sample of a node that hashes to another partition than ``stream``'s is
    dead-lettered (``wrong_partition``): its state would live on two replicas."""
    out = Decoded()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    home = keys.partition_of_stream(stream) if keys is not None else None
    readable: list[tuple[bytes | str, Fields]] = []
    for entry_id, fields in entries:
        if fields is None:
            continue  # trimmed away before we read it
        raw = fields.get(b"samples", fields.get("samples", b""))
        if raw is not None and len(raw) > MAX_ENTRY_BYTES:
            big = f"the samples field is {len(raw)} bytes; the limit is {MAX_ENTRY_BYTES}"
            out.deadletters.append(deadletter(stream, entry_id, fields, big))
            continue
        readable.append((entry_id, fields))
    batch = decode_sample_batch([fields for _, fields in readable])
    for (entry_id, fields), decoded in zip(readable, batch, strict=True):
        if isinstance(decoded, Exception):
            out.deadletters.append(deadletter(stream, entry_id, fields, _reason(decoded)))
            continue
        eid = as_str(entry_id)
        ms = arrival_ms(eid, now)
        signed_by = entry_signer(fields, key_for_node)
        for item in decoded:
            if not isinstance(item, DecodedSample):
                out.deadletters.append(deadletter(stream, entry_id, fields, str(item), "schema"))
                continue
            sample = item.sample
            if max_skew_s:
                why = _skew_problem(sample.ts, ms / 1000, max_skew_s)
                if why is not None:
                    out.deadletters.append(sample_deadletter(stream, eid, sample, why, "ts_skew"))
                    continue
            if home is not None and keys is not None and _partition(keys, sample.node) != home:
                wrong = (
                    f"node {sample.node} belongs to partition {keys.partition_of(sample.node)},"
                    f" not {home} (agents and service must agree on OOMCAST_PARTITIONS)"
                )
                out.deadletters.append(
                    sample_deadletter(stream, eid, sample, wrong, "wrong_partition")
                )
                continue
            out.samples.append(sample)
            # the node's embedding when it speaks the model's schema, else recomputed
            out.embeddings.append(item.emb if item.emb_v == emb_version else None)
            out.arrived_ms.append(ms)
            out.attested.append(signed_by is not None and signed_by == sample.node)
    return out


_PARTITION_OF: dict[tuple[str, int], int] = {}  # (node, partitions) -> partition
_PARTITION_OF_MAX = 200_000


def _partition(keys: Keys, node: str) -> int:
    """``keys.partition_of(node)``, remembered: every sample of every tick names its node,
    and a CRC of the name each time was a tenth of decoding. Bounded like schema's names."""
    key = (node, keys.partitions)
    p = _PARTITION_OF.get(key)
    if p is None:
        if len(_PARTITION_OF) >= _PARTITION_OF_MAX:
            _PARTITION_OF.clear()
        p = _PARTITION_OF[key] = keys.partition_of(node)
    return p


def entry_signer(fields: Fields, key_for_node: KeyForNode | None) -> str | None:
    """The node whose key signed this entry, or None (unsigned, forged, or no keys here)."""
    if key_for_node is None:
        return None
    try:
        if not entry_attested(fields, key_for_node):
            return None
    except Exception:  # a malformed signature field is an unsigned entry, nothing worse
        return None
    return as_str(fields.get(b"node", fields.get("node", b"")) or b"") or None


def _event_signed(fields: Fields, node: str, key_for_node: KeyForNode | None) -> bool:
    if key_for_node is None:
        return False
    try:
        return event_attested(fields, node, key_for_node)
    except Exception:  # a malformed signature field is an unsigned event, nothing worse
        return False


def decode_event_entries(
    stream: str,
    entries: StreamEntries,
    keys: Keys,
    partitions: Sequence[int],
    *,
    max_skew_s: float = 0.0,
    now_ms: int | None = None,
    key_for_node: KeyForNode | None = None,
) -> Decoded:
    """Step 1 for the events stream: the events of the nodes this replica owns, each marked
    attested when it carries a valid signature by the node it names (``key_for_node``;
    without it none is; whether an unattested event counts is the live state's call). An event
    stamped too far from its arrival is dead-lettered like a sample: an ``oom`` at
    ts=1e300 would otherwise make every later sample of its domain "late". An ``oom``
    stamped after its arrival (within the skew allowed) is taken as of its arrival: a job
    cannot have died after the news of it reached Redis, and samples stamped up to a
    future ``ts`` would all be dropped as the dead job's (an ``oom`` at now + 295 s hid a
    domain for 295 s)."""
    out = Decoded()
    now = int(time.time() * 1000) if now_ms is None else now_ms
    for entry_id, fields in entries:
        if fields is None:
            continue
        try:
            event = decode_event(dict(fields))
        except Exception as exc:  # any undecodable entry, not only the foreseen ones
            out.deadletters.append(deadletter(stream, entry_id, fields, _reason(exc)))
            continue
        arrived = arrival_ms(as_str(entry_id), now) / 1000
        why = _skew_problem(event.ts, arrived, max_skew_s)
        if why is not None:
            out.deadletters.append(deadletter(stream, entry_id, fields, why, "ts_skew"))
            continue
        if event.event == "oom" and event.ts > arrived:
            event = replace(event, ts=arrived)
        p = keys.partition_of(event.node)
        if p in partitions:
            out.events.append((event, fields))
            out.event_ids.append(as_str(entry_id))
            out.events_attested.append(_event_signed(fields, event.node, key_for_node))
        else:  # another replica's node, for now
            out.others.append((p, as_str(entry_id), fields, event))
    return out


def _reason(exc: Exception) -> str:
    if isinstance(exc, SchemaError):
        return str(exc)
    return f"undecodable entry ({type(exc).__name__}: {exc})"[:500]


def audit_record(name: str, fields: Fields, attested: bool = False) -> dict[str, Any]:
    """The event as its sender wrote it (with the keys readers do not model), marked so, and
    whether the node it names signed it (``attested``: an unsigned ``action_result`` may be
    anyone's words)."""
    raw = fields.get(b"event", fields.get("event"))
    try:
        obj = json.loads(raw) if raw is not None else {}
    except ValueError:
        obj = {}
    if not isinstance(obj, dict):
        obj = {}
    obj.setdefault("event", name)
    obj["record"] = "event"
    if "id" in obj:  # the command's id; "id" in /v1/alerts is the audit entry's own
        obj["command_id"] = obj.pop("id")
    obj["attested"] = attested
    return obj
