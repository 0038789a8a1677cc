"""Publish stream entries to Redis, riding out outages with a bounded local buffer.

When Redis is unreachable the agent keeps sampling: entries wait in a buffer that holds at
most ``buffer_samples`` samples; past that the oldest are dropped (the newest matter most
to a forecast) and counted. Once Redis answers again the buffer is flushed oldest first.

A Redis that answers but refuses writes (``maxmemory`` reached under ``noeviction``, a
read-only replica after a failover) may take some entries of a pipelined batch and refuse
the rest. Each entry's reply is looked at: the ones Redis took leave the buffer, the refused
ones stay, in their order, for the next try, so back-pressure never duplicates a sample.
Delivery is at least once only across a broken connection: entries written just before it
broke, whose replies never came, are sent again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis
from redis.exceptions import RedisClusterException

from oomcast.collectors.streams import stream_fields

log = logging.getLogger(__name__)


@dataclass(slots=True)
class Entry:
    stream: str
    fields: dict[str, str]
    n_samples: int  # samples in it (an event entry counts as one)


@dataclass
class PublisherStats:
    entries_sent: int = 0
    samples_sent: int = 0
    samples_dropped: int = 0
    publish_errors: int = 0
    entries_refused: int = 0  # entries Redis answered with an error (kept and sent again)
    partial_flushes: int = 0  # batches of which Redis took some entries and refused others


class StreamPublisher:
    def __init__(
        self,
        client: redis.Redis,
        *,
        maxlen: int = 100_000,
        buffer_samples: int = 100_000,
        max_backoff_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if buffer_samples < 1:
            raise ValueError(f"buffer_samples={buffer_samples} must be at least 1")
        self.client = client
        self.maxlen = maxlen
        self.buffer_samples = buffer_samples
        self.max_backoff_s = max_backoff_s
        self.stats = PublisherStats()
        self._clock = clock
        self._buffer: deque[Entry] = deque()
        self._buffered = 0
        self._retry_at = 0.0
        self._backoff_s = 0.0
        self.connected = True  # False from a failed write until the next one succeeds

    @property
    def buffered_samples(self) -> int:
        return self._buffered

    def publish(self, entries: list[Entry]) -> bool:
        """Queue entries and try to send everything queued; True when nothing is left."""
        for entry in entries:
            self._buffer.append(entry)
            self._buffered += entry.n_samples
        while self._buffered > self.buffer_samples and self._buffer:
            dropped = self._buffer.popleft()
            self._buffered -= dropped.n_samples
            self.stats.samples_dropped += dropped.n_samples
        if self._clock() < self._retry_at:
            return False
        return self.flush()

    def flush(self, chunk: int = 500) -> bool:
        """Send the buffer, oldest first, ``chunk`` entries a round trip; True when it is empty."""
        while self._buffer:
            batch = [self._buffer[i] for i in range(min(chunk, len(self._buffer)))]
            try:
                pipe = self.client.pipeline(transaction=False)
                for e in batch:
                    pipe.xadd(
                        e.stream, stream_fields(e.fields), maxlen=self.maxlen, approximate=True
                    )
                replies = pipe.execute(raise_on_error=False)
            except (redis.RedisError, RedisClusterException) as exc:
                # the connection broke (on a Redis Cluster: no node answers, so the client
                # cannot learn the slots' owners): which entries got in is unknown, keep all
                self._failed(exc, 0)
                return False
            refused = [(e, r) for e, r in zip(batch, replies, strict=True) if _is_error(r)]
            for _ in batch:
                e = self._buffer.popleft()
                self._buffered -= e.n_samples
            for e, _ in reversed(refused):  # back at the front, in their order
                self._buffer.appendleft(e)
                self._buffered += e.n_samples
            taken = [e for e, r in zip(batch, replies, strict=True) if not _is_error(r)]
            self.stats.entries_sent += len(taken)
            self.stats.samples_sent += sum(e.n_samples for e in taken)
            if refused:
                # A full (maxmemory) or read-only (failover) Redis: keep what it refused and
                # keep sampling until it takes writes again.
                self.stats.entries_refused += len(refused)
                if taken:
                    self.stats.partial_flushes += 1
                self._failed(refused[0][1], len(taken))
                return False
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.connected = True
        return True

    def _failed(self, exc: object, taken: int) -> None:
        self.stats.publish_errors += 1
        self.connected = False
        self._backoff_s = min(self.max_backoff_s, max(0.25, self._backoff_s * 2))
        self._retry_at = self._clock() + self._backoff_s
        log.warning(
            "Redis did not take samples (%s); %d entries taken this try, %d samples buffered,"
            " %d dropped; retry in %.1fs",
            exc,
            taken,
            self._buffered,
            self.stats.samples_dropped,
            self._backoff_s,
        )


def _is_error(reply: object) -> bool:
    return isinstance(reply, Exception)
