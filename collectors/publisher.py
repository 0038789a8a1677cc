"""Publish stream entries to Redis, riding out outages with a bounded local buffer.

When Redis is unreachable the agent keeps sampling: entries wait in a buffer that holds at
most ``buffer_samples`` samples; past that the oldest are dropped (the newest matter most
to a forecast) and counted. Once Redis answers again the buffer is flushed oldest first.
Delivery is at least once: an entry written just before a connection broke may be sent again.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import redis

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
        while self._buffer:
            batch = [self._buffer[i] for i in range(min(chunk, len(self._buffer)))]
            try:
                pipe = self.client.pipeline(transaction=False)
                for e in batch:
                    pipe.xadd(
                        e.stream, stream_fields(e.fields), maxlen=self.maxlen, approximate=True
                    )
                pipe.execute()
            except redis.RedisError as exc:
                # Connection loss, but also a full (maxmemory) or read-only (failover) Redis:
                # keep the samples and keep sampling until it takes writes again.
                self.stats.publish_errors += 1
                self.connected = False
                self._backoff_s = min(self.max_backoff_s, max(0.25, self._backoff_s * 2))
                self._retry_at = self._clock() + self._backoff_s
                log.warning(
                    "Redis did not take samples (%s); %d buffered, %d dropped; retry in %.1fs",
                    exc,
                    self._buffered,
                    self.stats.samples_dropped,
                    self._backoff_s,
                )
                return False
            for _ in batch:
                e = self._buffer.popleft()
                self._buffered -= e.n_samples
                self.stats.entries_sent += 1
                self.stats.samples_sent += e.n_samples
        self._backoff_s = 0.0
        self._retry_at = 0.0
        self.connected = True
        return True
