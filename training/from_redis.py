"""Turn what the collectors streamed to Redis into a labelled trace (``oomcast dump``).

This closes the loop for retraining: a job that really died on a node left its samples in
the node's sample stream and its ``oom`` event (from the cgroup source, or the in-process
hook's OOM observer) in the events stream. Reading both back, keeping one node (and
optionally some devices and a time range), gives a trace in the format of DESIGN.md that
``oomcast evaluate`` scores and ``oomcast train`` learns from.

Samples are written in time order per domain; a repeated sample (at-least-once delivery
can send an entry twice, and a sample of the same domain at the same ts is the same sample)
is kept once and counted. Events of other nodes are left out. Entries that do not decode are
counted and skipped, never guessed at. The streams are capped (``MAXLEN``), so a dump holds
what they still hold.

``dump_outcomes`` (``oomcast dump --outcomes``) writes out instead the traces the service
kept for its missed OOMs, false alarms and near misses (``service/kept.py``).
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from oomcast.model.schema import Domain, Event, Record, Sample, SchemaError
from oomcast.model.text import as_str
from oomcast.model.trace import TraceError, load_trace, write_trace
from oomcast.model.wire import Keys, answer, decode_event, decode_samples
from oomcast.service.kept import index_key, read_kept, trace_key

log = logging.getLogger(__name__)


@dataclass
class DumpResult:
    path: Path
    samples: int
    events: int
    ooms: int
    domains: list[str]
    skipped_entries: int
    duplicates: int


def _ms(ts: float | None) -> str:
    return "-" if ts is None else str(int(ts * 1000))


def _entries(
    client: redis.Redis, key: str, start: str, end: str
) -> Iterable[dict[bytes | str, bytes | str]]:
    """Every entry of a stream between two ids, a thousand at a time."""
    low = start
    while True:
        batch = answer(client.xrange(key, min=low, max=end, count=1000))
        if not batch:
            return
        for _entry_id, fields in batch:
            # redis' types allow an entry without fields (XRANGE gives none such): it would
            # decode as a skipped entry
            yield fields if fields is not None else {}
        last = batch[-1][0]
        low = "(" + as_str(last)


def nodes_seen(client: redis.Redis, keys: Keys, last: int = 200, most: int = 20) -> list[str]:
    """Node names in the newest ``last`` entries of every sample stream (at most ``most``):
    what to suggest when a dump names a node that streamed nothing."""
    names: set[str] = set()
    for p in range(keys.partitions):
        for _entry_id, fields in answer(client.xrevrange(keys.samples(p), count=last)):
            try:
                decoded = decode_samples(fields or {})
            except SchemaError:
                continue
            names.update(d.sample.node for d in decoded if not isinstance(d, SchemaError))
    return sorted(names)[:most]


def read_node(
    client: redis.Redis,
    keys: Keys,
    node: str,
    *,
    devices: set[str] | None = None,
    since: float | None = None,
    until: float | None = None,
) -> tuple[list[Record], dict[str, int]]:
    """Samples and events of ``node`` (and ``devices``, if given) between two unix times."""
    counts = {"skipped_entries": 0, "duplicates": 0}
    start, end = _ms(since), "+" if until is None else _ms(until)
    per_domain: dict[Domain, dict[float, Sample]] = {}
    for fields in _entries(client, keys.samples_for(node), start, end):
        try:
            decoded = decode_samples(fields)
        except SchemaError:
            counts["skipped_entries"] += 1
            continue
        for d in decoded:
            if isinstance(d, SchemaError):
                continue
            s = d.sample
            if s.node != node or (devices is not None and s.device not in devices):
                continue
            bucket = per_domain.setdefault(s.domain, {})
            if s.ts in bucket:
                counts["duplicates"] += 1
                continue
            bucket[s.ts] = s
    events: list[Event] = []
    for fields in _entries(client, keys.events, start, end):
        try:
            ev = decode_event(fields)
        except SchemaError:
            counts["skipped_entries"] += 1
            continue
        if ev.node == node and (devices is None or ev.device in devices):
            events.append(ev)
    records: list[Record] = []
    for bucket in per_domain.values():
        records.extend(bucket[ts] for ts in sorted(bucket))
    seen_events: set[tuple[float, str, str]] = set()
    for ev in events:
        key = (ev.ts, ev.device, ev.event)
        if key in seen_events:
            counts["duplicates"] += 1
            continue
        seen_events.add(key)
        records.append(ev)
    records.sort(key=lambda r: (r.ts, isinstance(r, Event)))
    return records, counts


def dump_trace(
    client: redis.Redis,
    keys: Keys,
    node: str,
    out: Path | str,
    *,
    devices: set[str] | None = None,
    since: float | None = None,
    until: float | None = None,
) -> DumpResult:
    records, counts = read_node(client, keys, node, devices=devices, since=since, until=until)
    samples = [r for r in records if isinstance(r, Sample)]
    if not samples:
        where = f" devices {sorted(devices)}" if devices else ""
        seen = nodes_seen(client, keys)
        hint = (
            f"; nodes with recent samples: {', '.join(seen)}"
            if seen
            else "; the sample streams hold no recent samples"
        )
        raise ValueError(
            f"no samples of node {node!r}{where} in {keys.samples_for(node)}{hint} (a node is"
            " named by its agent's --node, by default the node's hostname)"
        )
    path = Path(out)
    write_trace(path, records)
    events = [r for r in records if isinstance(r, Event)]
    return DumpResult(
        path=path,
        samples=len(samples),
        events=len(events),
        ooms=sum(1 for e in events if e.event == "oom"),
        domains=sorted({s.device for s in samples}),
        **counts,
    )


@dataclass
class OutcomesDump:
    folder: Path
    written: list[Path]
    by_outcome: dict[str, int]
    forged: int
    missing: int
    malformed: int
    sealed: bool


def _file_name(meta: dict[str, Any], tid: str) -> str:
    found = meta.get("outcome")
    o: dict[str, Any] = found if isinstance(found, dict) else {}
    parts = [str(o.get("outcome", "outcome"))]
    if o.get("outcome") == "oom":
        parts.append(f"warned-{o.get('warned', 'no')}")
    parts += [str(o.get("node", "node")), str(o.get("device", "device")), tid[:12]]
    name = "-".join(re.sub(r"[^A-Za-z0-9_.]+", "_", p).strip("_") or "_" for p in parts)
    return name + ".jsonl.gz"


def dump_outcomes(
    client: redis.Redis,
    keys: Keys,
    out: Path | str,
    *,
    seal_keys: tuple[str, ...] = (),
    since: float | None = None,
) -> OutcomesDump:
    """Write the traces the service kept for missed OOMs, false alarms and near misses
    (``service/kept.py``) into ``out``, one file each, and ``outcomes.json`` listing what
    each is about. ``out`` must not exist or be empty: evaluate and train read every trace
    in a folder, and an older dump's must not mix in. With ``seal_keys``, a trace whose
    seal fails is left out and counted. One trace is in memory at a time."""
    folder = Path(out)
    if folder.is_dir() and any(folder.iterdir()):
        raise ValueError(
            f"{folder} is not empty: evaluate and train read every trace in it, so an older"
            " dump's would mix in; give a new folder"
        )
    index = answer(
        client.zrangebyscore(
            index_key(keys.prefix), "-inf" if since is None else since, "+inf", withscores=True
        )
    )
    folder.mkdir(exist_ok=True)
    written: list[Path] = []
    listing: list[dict[str, Any]] = []
    by_outcome: dict[str, int] = {}
    left_out = {"forged": 0, "missing": 0, "malformed": 0}
    for raw_id, at in index:
        tid = as_str(raw_id)
        kept = read_kept(
            tid, float(at), answer(client.hgetall(trace_key(keys.prefix, tid))), seal_keys
        )
        if isinstance(kept, str):
            left_out[kept] += 1
            continue
        path = folder / _file_name(kept.meta, kept.id)
        path.write_bytes(kept.body)
        try:
            load_trace(path)  # what evaluate and train will read: checked here
        except (TraceError, OSError, EOFError) as exc:
            path.unlink()
            left_out["malformed"] += 1
            log.warning("kept trace %s left out: %s", kept.id, exc)
            continue
        written.append(path)
        outcome = str(kept.meta["outcome"].get("outcome", "?"))
        by_outcome[outcome] = by_outcome.get(outcome, 0) + 1
        listing.append({"file": path.name, "kept_at": kept.at, **kept.meta})
    (folder / "outcomes.json").write_text(json.dumps(listing, indent=1) + "\n")
    return OutcomesDump(
        folder,
        written,
        by_outcome,
        left_out["forged"],
        left_out["missing"],
        left_out["malformed"],
        bool(seal_keys),
    )
