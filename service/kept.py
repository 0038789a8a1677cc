"""Traces kept for what matters: the samples around a missed OOM, a false alarm or a near miss.

Every such outcome is a labelled example the model got wrong (or nearly), and the samples
that led to it pass through the node's sample stream, which forgets them within minutes to
hours (``MAXLEN``). When the scorecard records one (``service/scorecard.py``), the same
batch's round trip also queues a *keep request* (``TraceKeeper.stage``). A worker on every
replica takes requests one at a time (``ZPOPMIN``: each goes to one replica), reads the
domain's samples back from its node's stream, and stores them as a trace in the format of
DESIGN.md, gzip'ed, with the outcome's label: an OOM's trace ends in its ``oom`` event; a
false alarm's or near miss's has none (the job did not OOM while it was watched). ``oomcast
dump --outcomes`` writes them out as files that ``oomcast evaluate --traces`` and ``oomcast
train --extra-train`` read as they are.

What a trace holds:

- an OOM's: the ``window_s`` (default 600 s) of samples before it;
- a false alarm's or near miss's: ``window_s`` before the alert fired up to the moment the
  outcome was decided (``SETTLE_S`` after the alert ended), at most ``MAX_SPAN_S``.

Bounds: at most ``max_count`` traces (the oldest go first), each at most ``MAX_SAMPLES``
samples and ``MAX_TRACE_BYTES`` compressed (the oldest samples go first), each expiring after
``retention_s``; a request scans at most ``MAX_SCAN`` stream entries. A request is taken off
the queue before it is served: a replica that dies while serving it loses that trace (the
outcome itself is on record). A trace is kept once per OOM or alert, whatever repeats.

Everything here is read back from Redis, where others may write. Requests and traces are
sealed with a key derived from the service's control or webhook secret: a request whose
seal fails is dropped and counted, and ``oomcast dump --outcomes`` leaves out traces whose
seal fails. Where the service holds node keys (a control secret), only samples from entries
their node signed are kept: a forged sample must not become training data.
"""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import hashlib
import io
import json
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from oomcast.model.schema import Event, Sample, SchemaError
from oomcast.model.signing import service_keys, sign, verify
from oomcast.model.text import as_str
from oomcast.model.wire import Keys, decode_samples, entry_attested
from oomcast.service.pipeline.outcomes import Outcome, outcome_id

log = logging.getLogger(__name__)

KEPT_KEY_CONTEXT = b"oomcast:kept:v1"
WINDOW_S = 600.0  # samples kept before an OOM, or before an alert fired
MAX_SPAN_S = 3600.0  # a trace spans at most this much trace time
SLACK_S = 120.0  # stream ids are arrival times: read this much wider, filter by ts
MAX_SAMPLES = 40_000  # about an hour of one domain at 10 Hz
MAX_TRACE_BYTES = 4 * 1024 * 1024  # compressed
MAX_SCAN = 500_000  # stream entries one request reads at most
SCAN_CHUNK = 2000
MAX_COUNT = 1000
RETENTION_S = 14 * 86400.0
POLL_S = 2.0
RESULTS = ("kept", "repeat", "empty", "forged", "malformed", "failed")


def kept_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    return service_keys(control_secret, webhook_secret, KEPT_KEY_CONTEXT)


def keeps(o: Outcome) -> bool:
    """Whether an outcome's samples are worth keeping: an OOM not warned 30 s ahead, a false
    alarm, a near miss."""
    if o.outcome == "oom":
        return o.warned != "30s"
    return o.outcome in ("false_alarm", "near_miss")


def trace_id(o: Outcome) -> str:
    """One trace per OOM (whichever scored model missed it) or per scored alert; times to the
    millisecond, as an outcome is written (``Outcome.to_dict``)."""
    ts = round(o.ts, 3)
    if o.outcome == "oom":
        return outcome_id("kept", o.node, o.device, "oom", ts)
    alert_ts = None if o.alert_ts is None else round(o.alert_ts, 3)
    return outcome_id("kept", o.node, o.device, o.outcome, alert_ts, ts)


def window(o: Outcome, window_s: float = WINDOW_S) -> tuple[float, float]:
    """The trace time a kept trace spans (see the module's doc)."""
    if o.outcome == "oom":
        return o.ts - window_s, o.ts
    start = (o.alert_ts if o.alert_ts is not None else o.ts) - window_s
    return max(start, o.ts - MAX_SPAN_S), o.ts


def pending_key(prefix: str) -> str:
    return f"{prefix}:{{kept}}:pending"


def index_key(prefix: str) -> str:
    return f"{prefix}:{{kept}}:index"


def trace_key(prefix: str, tid: str) -> str:
    return f"{prefix}:{{kept}}:trace:{tid}"


def _sealed_bytes(tid: str, meta: bytes, body: bytes) -> bytes:
    return (
        KEPT_KEY_CONTEXT
        + b"\n"
        + tid.encode()
        + b"\n"
        + meta
        + b"\n"
        + hashlib.sha256(body).hexdigest().encode()
    )


@dataclass
class KeptTrace:
    """One kept trace as read back: its id, what it is about, and the gzip'ed JSONL body."""

    id: str
    meta: dict[str, Any]
    body: bytes
    at: float  # when it was kept (wall time)


@dataclass
class KeptRead:
    traces: list[KeptTrace] = field(default_factory=list)
    forged: int = 0
    missing: int = 0  # in the index, its trace expired or never written
    sealed: bool = False


def _field(fields: Mapping[Any, Any], key: str) -> bytes | None:
    v = fields.get(key.encode(), fields.get(key))
    if v is None:
        return None
    return v if isinstance(v, bytes) else str(v).encode("utf-8", "surrogateescape")


def read_kept(
    fields_of: Callable[[str], Mapping[Any, Any]],
    index: Sequence[tuple[Any, float]],
    seal_keys: Sequence[str],
) -> KeptRead:
    """Kept traces from their index entries (id, when kept) and a getter of a trace's hash
    fields; seals checked with ``seal_keys`` (none given: unchecked, ``sealed`` False)."""
    out = KeptRead(sealed=bool(seal_keys))
    for raw_id, at in index:
        tid = as_str(raw_id)
        fields = fields_of(tid)
        meta, body, sig = _field(fields, "meta"), _field(fields, "body"), _field(fields, "sig")
        if meta is None or body is None:
            out.missing += 1
            continue
        if seal_keys and not any(verify(_sealed_bytes(tid, meta, body), sig, k) for k in seal_keys):
            out.forged += 1
            continue
        try:
            data = orjson.loads(meta)
            if not isinstance(data, dict):
                raise ValueError("not an object")
        except ValueError:
            out.forged += 1
            continue
        out.traces.append(KeptTrace(tid, data, body, float(at)))
    return out


class TraceKeeper:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        *,
        seal_keys: Sequence[str] = (),
        key_for_node: Callable[[str], str | None] | None = None,
        window_s: float = WINDOW_S,
        max_count: int = MAX_COUNT,
        retention_s: float = RETENTION_S,
        poll_s: float = POLL_S,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.seal_keys = tuple(seal_keys)
        self.key_for_node = key_for_node
        self.window_s = window_s
        self.max_count = max_count
        self.retention_s = retention_s
        self.poll_s = poll_s
        self.on_result = on_result
        self._wake = asyncio.Event()

    @property
    def pending(self) -> str:
        return pending_key(self.keys.prefix)

    @property
    def index(self) -> str:
        return index_key(self.keys.prefix)

    def stage(self, pipe: Any, outcomes: Sequence[Outcome], now: float | None = None) -> int:
        """Queue keep requests for the outcomes worth a trace (``keeps``) on ``pipe``;
        returns how many. Repeats are harmless: a trace is kept once per id."""
        now = time.time() if now is None else now
        n = 0
        for o in outcomes:
            if not keeps(o):
                continue
            body = orjson.dumps({"o": o.to_dict(), "at": round(now, 3)})
            sig = sign(body, self.seal_keys[0]) if self.seal_keys else ""
            pipe.zadd(self.pending, {sig.encode() + b"." + body: now})
            n += 1
        if n:
            self._wake.set()
        return n

    async def run(self) -> None:
        """Serve requests until cancelled."""
        while True:
            try:
                served = await self.serve_one()
            except asyncio.CancelledError:
                raise
            except Exception:  # Redis away: the request (if taken) is lost, the loop goes on
                log.exception("keeping a trace failed")
                self._count("failed")
                served = False
            if not served:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def serve_one(self, now: float | None = None) -> bool:
        """Take one request off the queue and serve it; False when there was none."""
        popped = await self.client.zpopmin(self.pending, 1)
        if not popped:
            return False
        member, _ = popped[0]
        result = await self._serve(member if isinstance(member, bytes) else str(member).encode())
        self._count(result)
        return True

    def _count(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _serve(self, member: bytes) -> str:
        sig, _, body = member.partition(b".")
        if self.seal_keys and not any(verify(body, sig, k) for k in self.seal_keys):
            log.warning("a keep request with a bad seal was dropped")
            return "forged"
        try:
            data = orjson.loads(body)
            o = Outcome.from_dict(data["o"])
            at = float(data["at"])
            if not math.isfinite(at):
                raise ValueError("at: not finite")
        except (ValueError, KeyError, TypeError) as exc:
            log.warning("a malformed keep request was dropped: %s", exc)
            return "malformed"
        tid = trace_id(o)
        if await self.client.zscore(self.index, tid) is not None:
            return "repeat"
        start, end = window(o, self.window_s)
        samples, left_out = await self._samples(o, at, start, end)
        if not samples:
            return "empty"
        records: list[Sample | Event] = list(samples)
        if o.outcome == "oom":
            records.append(Event(ts=o.ts, node=o.node, device=o.device, event="oom", job=o.job))
        gz = _gzip_trace(records)
        while len(gz) > MAX_TRACE_BYTES and len(records) > 2:  # the oldest samples go first
            records = records[len(records) // 4 :]
            gz = _gzip_trace(records)
        kept_samples = sum(isinstance(r, Sample) for r in records)
        meta = orjson.dumps(
            {
                "id": tid,
                "outcome": o.to_dict(),
                "from_ts": round(records[0].ts, 3),
                "to_ts": round(end, 3),
                "samples": kept_samples,
                "unattested_left_out": left_out,
                "kept_at": round(time.time(), 3),
            }
        )
        seal = sign(_sealed_bytes(tid, meta, gz), self.seal_keys[0]) if self.seal_keys else ""
        now = time.time()
        if not await self.client.zadd(self.index, {tid: now}, nx=True):
            return "repeat"  # another replica kept it meanwhile
        key = trace_key(self.keys.prefix, tid)
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping={"meta": meta, "body": gz, "sig": seal})
        pipe.expire(key, max(1, int(self.retention_s)))
        pipe.zremrangebyscore(self.index, "-inf", f"({now - self.retention_s}")
        await pipe.execute()
        await self._trim()
        return "kept"

    async def _trim(self) -> None:
        """At most ``max_count`` traces: the oldest go."""
        extra = await self.client.zcard(self.index) - self.max_count
        if extra <= 0:
            return
        old = await self.client.zpopmin(self.index, extra)
        if old:
            await self.client.delete(*(trace_key(self.keys.prefix, as_str(m)) for m, _ in old))

    async def _samples(
        self, o: Outcome, at: float, start: float, end: float
    ) -> tuple[list[Sample], int]:
        """The domain's samples with start <= ts <= end, from its node's stream: entries
        that arrived from (end - start + SLACK_S) before the request to SLACK_S after it.
        With node keys, only entries the node signed; returns those and how many samples of
        the domain were left out unsigned."""
        stream = self.keys.samples_for(o.node)
        lo = max(0, int((at - (end - start) - SLACK_S) * 1000))
        cursor, last = f"{lo}-0", f"{int((at + SLACK_S) * 1000)}-0"
        node = o.node.encode()
        by_ts: dict[float, Sample] = {}
        left_out = scanned = 0
        while scanned < MAX_SCAN:
            entries = await self.client.xrange(stream, min=cursor, max=last, count=SCAN_CHUNK)
            for _, fields in entries:
                if not fields or _field(fields, "node") != node:
                    continue
                try:
                    decoded = decode_samples(fields)
                except SchemaError:
                    continue
                signed = self.key_for_node is None or _signed(fields, self.key_for_node)
                for d in decoded:
                    if isinstance(d, SchemaError):
                        continue
                    s = d.sample
                    if s.node != o.node or s.device != o.device or not start <= s.ts <= end:
                        continue
                    if not signed:
                        left_out += 1
                        continue
                    by_ts.setdefault(s.ts, s)
            scanned += len(entries)
            if len(entries) < SCAN_CHUNK:
                break
            cursor = "(" + as_str(entries[-1][0])
            await asyncio.sleep(0)  # ingest goes on between chunks
        samples = [by_ts[ts] for ts in sorted(by_ts)]
        return samples[-MAX_SAMPLES:], left_out


def _signed(fields: Mapping[Any, Any], key_for_node: Callable[[str], str | None]) -> bool:
    try:
        return entry_attested(fields, key_for_node)
    except Exception:  # a malformed signature is an unsigned entry
        return False


def _gzip_trace(records: Sequence[Sample | Event]) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write(json.dumps(r.to_dict(), separators=(",", ":")).encode())
            gz.write(b"\n")
    return buf.getvalue()
