"""The stream consumer: read sample and event streams as a consumer group, forecast, ack.

Order of work for each batch: decode, forecast, record alerts, dead-letter what is broken,
then ``XACK``. An entry is acknowledged only after its samples have been forecast and its
alerts recorded, so a crash loses nothing: on restart the service first re-reads its own
pending entries (``XREADGROUP`` from id 0), and periodically claims entries that another,
dead, consumer left pending for longer than ``claim_idle_ms`` (``XAUTOCLAIM``).
A malformed entry goes to the dead-letter stream with the reason and is acknowledged;
ingest carries on. Lost connections are retried with backoff; the loop never exits on its
own.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Callable
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.model.schema import Sample, SchemaError
from oomcast.model.wire import DecodedSample, Keys, decode_event, decode_samples
from oomcast.service.metrics import Metrics
from oomcast.service.state import LiveState

log = logging.getLogger(__name__)

StreamEntries = list[tuple[bytes, dict[bytes, bytes] | None]]


def _reraise_if_cancelled(exc: BaseException) -> None:
    """redis-py can turn a cancellation during a blocking read into a ConnectionError; a
    task being cancelled must still stop, not retry."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


def _s(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Ingestor:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        live: LiveState,
        metrics: Metrics,
        *,
        group: str,
        consumer: str,
        read_count: int = 500,
        block_ms: int = 500,
        claim_idle_ms: int = 30_000,
        alerts_maxlen: int = 10_000,
        deadletter_maxlen: int = 10_000,
        on_alert: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.live = live
        self.metrics = metrics
        self.group = group
        self.consumer = consumer
        self.read_count = read_count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.alerts_maxlen = alerts_maxlen
        self.deadletter_maxlen = deadletter_maxlen
        self.on_alert = on_alert or (lambda payload: None)
        self.streams = [*keys.all_samples(), keys.events]
        self.ready = asyncio.Event()  # set once groups exist and our own backlog is drained
        self._last_claim = 0.0
        self._stopping = False

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Let the loop finish its current read and batch, then end it. Cancelling a task in
        the middle of a blocking XREADGROUP can leave redis-py waiting on a dead future, so
        cancellation is only the fallback."""
        self._stopping = True
        _, pending = await asyncio.wait([task], timeout=self.block_ms / 1000 + 2.0)
        if pending:
            task.cancel()
            await asyncio.wait([task], timeout=2.0)

    async def run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            try:
                await self._ensure_groups()
                await self._drain_own_pending()
                self.metrics.redis_up.set(1)
                self.ready.set()
                backoff = 0.2
                while not self._stopping:
                    if time.monotonic() - self._last_claim >= max(1.0, self.claim_idle_ms / 1000):
                        await self._claim_stale()
                    resp = await self.client.xreadgroup(
                        self.group,
                        self.consumer,
                        dict.fromkeys(self.streams, ">"),
                        count=self.read_count,
                        block=self.block_ms,
                    )
                    for stream, entries in resp or []:
                        await self.process(_s(stream), entries)
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                _reraise_if_cancelled(exc)
                self.metrics.redis_up.set(0)
                log.warning("Redis unavailable (%s); retrying in %.1fs", exc, backoff)
            except Exception as exc:
                _reraise_if_cancelled(exc)
                # A bug must not stop ingest for good; say so loudly and go on.
                log.exception("ingest loop failed; restarting it in %.1fs", backoff)
            if not self._stopping:
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _ensure_groups(self) -> None:
        await self._warn_unread_partitions()
        for stream in self.streams:
            try:
                await self.client.xgroup_create(stream, self.group, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _warn_unread_partitions(self) -> None:
        """Agents configured with more partitions than the service write streams nobody
        reads; say so instead of losing those nodes silently."""
        ours = set(self.streams)
        async for key in self.client.scan_iter(match=f"{self.keys.prefix}:samples:*", count=1000):
            name = _s(key)
            if name not in ours:
                log.error(
                    "stream %s is not read by this service (OOMCAST_PARTITIONS=%d here);"
                    " agents and service must agree on OOMCAST_PARTITIONS",
                    name,
                    self.keys.partitions,
                )

    async def _drain_own_pending(self) -> None:
        """Entries delivered to this consumer before a restart and never acknowledged."""
        for stream in self.streams:
            last = "0"
            while True:
                resp = await self.client.xreadgroup(
                    self.group, self.consumer, {stream: last}, count=self.read_count
                )
                entries = resp[0][1] if resp else []
                if not entries:
                    break
                self.metrics.claimed.inc(len(entries))
                await self.process(stream, entries)
                last = _s(entries[-1][0])

    async def _claim_stale(self) -> None:
        self._last_claim = time.monotonic()
        for stream in self.streams:
            start = "0-0"
            while True:
                nxt, entries, *_ = await self.client.xautoclaim(
                    stream,
                    self.group,
                    self.consumer,
                    self.claim_idle_ms,
                    start_id=start,
                    count=self.read_count,
                )
                if entries:
                    self.metrics.claimed.inc(len(entries))
                    await self.process(stream, entries)
                start = _s(nxt)
                if start == "0-0":
                    break

    async def process(self, stream: str, entries: StreamEntries) -> None:
        """Forecast a batch of entries of one stream, record alerts and dead letters, ack."""
        if not entries:
            return
        self.metrics.entries.labels(stream=stream).inc(len(entries))
        deadletters: list[dict[str, Any]] = []
        ids = [entry_id for entry_id, _ in entries]
        fired: list[dict[str, Any]] = []
        if stream == self.keys.events:
            for entry_id, fields in entries:
                if fields is None:
                    continue  # trimmed away before we read it
                try:
                    event = decode_event(fields)
                except SchemaError as exc:
                    deadletters.append(self._deadletter(stream, entry_id, fields, str(exc)))
                    continue
                self.metrics.events.labels(event=event.event).inc()
                payload = self.live.on_event(event)
                if payload is not None:
                    fired.append(payload)
        else:
            samples: list[Sample] = []
            arrived_ms: list[int] = []
            for entry_id, fields in entries:
                if fields is None:
                    continue
                try:
                    decoded = decode_samples(fields)
                except SchemaError as exc:
                    deadletters.append(self._deadletter(stream, entry_id, fields, str(exc)))
                    continue
                ms = int(_s(entry_id).split("-")[0])
                for item in decoded:
                    if isinstance(item, DecodedSample):
                        samples.append(item.sample)
                        arrived_ms.append(ms)
                    else:
                        deadletters.append(self._deadletter(stream, entry_id, fields, str(item)))
            applied = self.live.apply(samples)
            done_ms = time.time() * 1000
            for ms in arrived_ms:
                self.metrics.forecast_latency.observe(max(0.0, done_ms - ms) / 1000)
            self.metrics.samples.inc(len(applied.forecasts))
            self.metrics.duplicates.inc(applied.duplicates)
            for sample, problem in applied.rejected:
                deadletters.append(
                    {
                        "stream": stream,
                        "reason": str(problem),
                        "sample": json.dumps(sample.to_dict(), separators=(",", ":")),
                    }
                )
            fired.extend(applied.alerts)
        # Webhooks first: they do not depend on Redis, and an alert must not wait on it.
        for payload in fired:
            self.metrics.alerts.labels(status=payload["status"]).inc()
            self.on_alert(payload)
        pipe = self.client.pipeline(transaction=False)
        for payload in fired:
            pipe.xadd(
                self.keys.alerts,
                {"alert": json.dumps(payload, separators=(",", ":"))},
                maxlen=self.alerts_maxlen,
                approximate=True,
            )
        for dl in deadletters:
            pipe.xadd(self.keys.deadletter, dl, maxlen=self.deadletter_maxlen, approximate=True)
        pipe.xack(stream, self.group, *ids)
        await pipe.execute()
        self.metrics.deadletters.inc(len(deadletters))

    def _deadletter(
        self, stream: str, entry_id: bytes | str, fields: dict[Any, Any], reason: str
    ) -> dict[str, Any]:
        log.warning("dead-lettered entry %s of %s: %s", _s(entry_id), stream, reason)
        out: dict[str, Any] = {"stream": stream, "entry_id": _s(entry_id), "reason": reason}
        for k, v in fields.items():
            key = _s(k)
            if key not in out:
                out[f"orig.{key}"] = v
        return out
