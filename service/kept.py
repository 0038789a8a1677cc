"""Traces kept for what matters: the samples around a missed OOM, a false alarm or a near miss.

Every such outcome is a labelled example the model got wrong (or nearly), and the samples
that led to it pass through the node's sample stream, which forgets them within minutes to
hours (``MAXLEN``). When the scorecard records one (``service/scorecard.py``), the same
batch's round trip also queues a *keep request* (``TraceKeeper.stage``). A worker on every
replica takes requests one at a time (``ZPOPMIN``: each goes to one replica), reads the
domain's samples of the outcome's job back from its node's stream, newest first, and stores
them as a trace in the format of DESIGN.md, gzip'ed, with the outcome's label: an OOM's
trace ends in its ``oom`` event; a false alarm's or near miss's has none (the job did not
OOM while it was watched). ``oomcast dump --outcomes`` writes them out as files that
``oomcast evaluate --traces`` and ``oomcast train --extra-train`` read as they are.

What a trace holds:

- an OOM's: the ``window_s`` (default 600 s) of samples before it;
- a false alarm's or near miss's: ``window_s`` before the alert fired up to the moment the
  outcome was decided (``SETTLE_S`` after the alert ended), at most ``MAX_SPAN_S``. One
  settled by an OOM (``ended_by``) is not kept: its samples run into that OOM.

Bounds: at most ``max_count`` traces (the oldest go first), each at most ``MAX_SAMPLES``
samples and ``MAX_TRACE_BYTES`` compressed (the oldest samples go first), each expiring after
``retention_s``; a request scans at most ``MAX_SCAN`` stream entries (the newest); at most
``MAX_PENDING`` requests wait, none older than ``MAX_REQUEST_AGE_S`` is served. A request
is taken off the queue before it is served: a replica that dies while serving it loses that
trace (the outcome itself is on record). A trace is kept once per OOM or alert.

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
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import redis.asyncio as aioredis

from oomcast.model.schema import Event, Sample, SchemaError
from oomcast.model.signing import service_keys, sign, verify
from oomcast.model.text import as_str, compact_json
from oomcast.model.wire import Keys, answer_async, decode_samples, field_bytes
from oomcast.service.pipeline.decode import entry_signer
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
MAX_REQUEST_AGE_S = 3600.0  # an older request is dropped: replayed, or its samples gone
MAX_PENDING = 10_000  # requests waiting at most (the oldest go)
STOP_S = 5.0  # how long shutting down waits for the worker
RESULTS = ("kept", "repeat", "empty", "unsigned", "stale", "forged", "malformed", "failed")
# KEYS: the index. ARGV: the most traces kept. Pops the oldest ids beyond it, atomically
# (two replicas trimming at once must not trim twice).
TRIM = """
local n = redis.call('ZCARD', KEYS[1]) - tonumber(ARGV[1])
if n <= 0 then return {} end
return redis.call('ZPOPMIN', KEYS[1], n)
"""


def kept_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    return service_keys(control_secret, webhook_secret, KEPT_KEY_CONTEXT)


def keeps(o: Outcome) -> bool:
    """Whether an outcome's samples are worth keeping: an OOM not warned 30 s ahead, a false
    alarm, a near miss."""
    if o.outcome == "oom":
        return o.warned != "30s"
    # an alert settled by an OOM long after it ended: its samples run into that OOM, which
    # is kept (if missed) as an OOM's trace
    return o.outcome in ("false_alarm", "near_miss") and o.ended_by is None


def trace_id(o: Outcome) -> str:
    """One trace per OOM (whichever scored model missed it; its time to the millisecond, as
    an outcome is written) or per scored alert (its outcome's id, one per alert whatever it
    is decided to be)."""
    if o.outcome == "oom":
        return outcome_id("kept", o.node, o.device, "oom", round(o.ts, 3))
    return outcome_id("kept", o.id)


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


def read_kept(
    tid: str, at: float, fields: Mapping[Any, Any], seal_keys: Sequence[str]
) -> KeptTrace | str:
    """One kept trace from its hash's fields, or why not: ``missing`` (expired, or never
    written), ``forged`` (with ``seal_keys``: the seal fails), ``malformed``."""
    meta, body, sig = (
        field_bytes(fields, "meta"),
        field_bytes(fields, "body"),
        field_bytes(fields, "sig"),
    )
    if meta is None or body is None:
        return "missing"
    if seal_keys and not any(verify(_sealed_bytes(tid, meta, body), sig, k) for k in seal_keys):
        return "forged"
    try:
        data = orjson.loads(meta)
    except ValueError:
        return "malformed"
    if not isinstance(data, dict) or not isinstance(data.get("outcome"), dict):
        return "malformed"
    return KeptTrace(tid, data, body, at)


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
        self._stopping = False

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
        """Serve requests until cancelled (``stop``)."""
        while not self._stopping:
            try:
                served = await self.serve_one()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: nothing was taken; try again later
                log.warning("keep requests: cannot reach Redis (%s)", exc)
                served = False
            if not served:
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.poll_s)

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Stop the worker: it finishes the request it holds, or is cancelled after
        ``STOP_S`` (a Redis command can swallow a cancellation: never wait on it unbounded)."""
        self._stopping = True
        self._wake.set()
        _, pending = await asyncio.wait({task}, timeout=STOP_S)
        if pending:
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_S)

    async def serve_one(self, now: float | None = None) -> bool:
        """Take one request off the queue and serve it; False when there was none."""
        popped = await self.client.zpopmin(self.pending, 1)
        if not popped:
            return False
        member, _ = popped[0]
        raw = member if isinstance(member, bytes) else str(member).encode()
        try:
            result = await self._serve(raw, time.time() if now is None else now)
        except asyncio.CancelledError:
            raise
        except Exception:  # this request is lost (its outcome is on record); the loop goes on
            log.exception("keeping a trace failed")
            result = "failed"
        self._count(result)
        return True

    def _count(self, result: str) -> None:
        if self.on_result is not None:
            self.on_result(result)

    async def _serve(self, member: bytes, now: float) -> str:
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
        if not now - MAX_REQUEST_AGE_S <= at <= now + SLACK_S:
            return "stale"  # replayed, or queued so long ago its samples are gone
        tid = trace_id(o)
        if await self.client.zscore(self.index, tid) is not None:
            return "repeat"
        start, end = window(o, self.window_s)
        samples, left_out = await self._samples(o, at, start, end)
        if not samples:
            return "unsigned" if left_out else "empty"
        records: list[Sample | Event] = list(samples)
        if o.outcome == "oom":
            records.append(Event(ts=o.ts, node=o.node, device=o.device, event="oom", job=o.job))
        gz = await asyncio.to_thread(_bounded_gzip, records)
        meta = orjson.dumps(
            {
                "id": tid,
                "outcome": o.to_dict(),
                "from_ts": round(gz[1], 3),
                "to_ts": round(end, 3),
                "samples": gz[2],
                "unattested_left_out": left_out,
                "kept_at": round(time.time(), 3),
            }
        )
        seal = sign(_sealed_bytes(tid, meta, gz[0]), self.seal_keys[0]) if self.seal_keys else ""
        key = trace_key(self.keys.prefix, tid)
        # the trace first, then its id: an id is never on the index without its trace
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(key, mapping={"meta": meta, "body": gz[0], "sig": seal})
        pipe.expire(key, max(1, int(self.retention_s)))
        await pipe.execute()
        if not await self.client.zadd(self.index, {tid: time.time()}, nx=True):
            return "repeat"  # another replica kept it meanwhile (the same samples)
        await self._trim(time.time())
        return "kept"

    async def _trim(self, now: float) -> None:
        """At most ``max_count`` traces, none older than the retention: the oldest go;
        at most ``MAX_PENDING`` requests waiting."""
        await self.client.zremrangebyscore(self.index, "-inf", f"({now - self.retention_s}")
        old: Any = await answer_async(self.client.eval(TRIM, 1, self.index, str(self.max_count)))
        ids = [as_str(m) for m in (old or [])[::2]]  # ZPOPMIN answers id, score, id, ...
        if ids:
            await self.client.delete(*(trace_key(self.keys.prefix, i) for i in ids))
        await self.client.zremrangebyrank(self.pending, 0, -MAX_PENDING - 1)

    async def _samples(
        self, o: Outcome, at: float, start: float, end: float
    ) -> tuple[list[Sample], int]:
        """The domain's samples of the outcome's job with start <= ts <= end, newest first
        read from its node's stream, at most ``MAX_SAMPLES``. Stream ids are arrival times:
        the read spans from the window's start to the request, in whichever clock is earlier
        (a sample arrives near its ts; a replayed trace's ts can lie far back), SLACK_S
        wider. With node keys, only entries the node signed; returns those samples and how
        many of the domain's were left out unsigned."""
        stream = self.keys.samples_for(o.node)
        lo = max(0, int((min(at - (end - start), start) - SLACK_S) * 1000))
        hi = int((max(at, end) + SLACK_S) * 1000)
        cursor, floor = f"{hi}-0", f"{lo}-0"
        by_ts: dict[float, Sample] = {}
        left_out = scanned = 0
        while scanned < MAX_SCAN and len(by_ts) < MAX_SAMPLES:
            entries = await self.client.xrevrange(stream, max=cursor, min=floor, count=SCAN_CHUNK)
            found, unsigned = await asyncio.to_thread(self._matching, entries, o, start, end)
            left_out += unsigned
            for s in found:
                by_ts.setdefault(s.ts, s)
            scanned += len(entries)
            if len(entries) < SCAN_CHUNK:
                break
            cursor = "(" + as_str(entries[-1][0])
        samples = [by_ts[ts] for ts in sorted(by_ts)]
        return samples[-MAX_SAMPLES:], left_out

    def _matching(
        self, entries: Sequence[tuple[Any, Mapping[Any, Any]]], o: Outcome, start: float, end: float
    ) -> tuple[list[Sample], int]:
        """The samples of ``o``'s domain and job in [start, end] among ``entries`` (in a
        thread: decoding and checking signatures of a chunk takes a fifth of a second)."""
        node = o.node.encode()
        found: list[Sample] = []
        unsigned = 0
        for _, fields in entries:
            if not fields or field_bytes(fields, "node") != node:
                continue
            try:
                decoded = decode_samples(fields)
            except SchemaError:
                continue
            mine = [
                d.sample
                for d in decoded
                if not isinstance(d, SchemaError)
                and d.sample.node == o.node
                and d.sample.device == o.device
                and start <= d.sample.ts <= end
                # not the job before it (a sample naming no job is the domain's)
                and (o.job is None or d.sample.job in (None, o.job))
            ]
            if not mine:
                continue
            if self.key_for_node is not None and entry_signer(fields, self.key_for_node) is None:
                unsigned += len(mine)
                continue
            found.extend(mine)
        return found, unsigned


def _bounded_gzip(records: list[Sample | Event]) -> tuple[bytes, float, int]:
    """The records gzip'ed, within ``MAX_TRACE_BYTES`` (the oldest samples go first); with
    the first record's ts and how many samples are in."""
    gz = _gzip_trace(records)
    while len(gz) > MAX_TRACE_BYTES and len(records) > 2:
        records = records[len(records) // 4 :]
        gz = _gzip_trace(records)
    return gz, records[0].ts, sum(isinstance(r, Sample) for r in records)


def _gzip_trace(records: Sequence[Sample | Event]) -> bytes:
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz:
        for r in records:
            gz.write(compact_json(r.to_dict()).encode())
            gz.write(b"\n")
    return buf.getvalue()
