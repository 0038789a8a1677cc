"""The node agent: poll sources each tick, embed, publish one stream entry per node.

Every sample leaves the node with its memory-access embedding, computed here so the
service's hot path can skip it (DESIGN.md). Events (``oom``) go to the events stream.

Each source keeps its own sampling interval (NVML every second, cgroups every second, a
replay at its trace's spacing) and returns nothing when it is not due; the agent ticks at
the shortest of them. A source that raises is counted and logged, and the others go on: one
broken GPU or an unreadable cgroup must not blind the agent to the rest of the node.

With its node key (``node_key``) the agent signs every sample entry of its own node
(:func:`oomcast.model.wire.encode_samples`), so the service can tell its samples from ones
forged in Redis or posted over HTTP; entries of other nodes (a replayed trace of a cluster)
are sent unsigned: this agent can vouch for its own node only.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from oomcast.collectors.publisher import Entry, StreamPublisher
from oomcast.collectors.sources.base import Source
from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState
from oomcast.model.schema import Domain, Event, Sample
from oomcast.model.wire import Keys, encode_event, encode_samples, sample_payload

log = logging.getLogger(__name__)

_MAX_CACHED_STREAMS = 4096  # nodes whose stream name is kept (an agent has one, a replay more)


@dataclass
class AgentStats:
    ticks: int = 0
    samples: int = 0
    events: int = 0
    source_errors: dict[str, int] = field(default_factory=dict)
    last_tick_s: float = 0.0  # how long the last tick took (poll, embed, publish)
    last_tick_at: float = 0.0  # monotonic time the last tick ended
    domains: int = 0  # domains sampled within the agent's memory window (forget_after_s)


class NodeAgent:
    def __init__(
        self,
        sources: list[Source],
        publisher: StreamPublisher,
        keys: Keys,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
        forget_after_s: float = 600.0,
        node: str | None = None,
        node_key: str | None = None,
    ) -> None:
        if not sources:
            raise ValueError("a node agent needs at least one source")
        if node_key is not None and not (node and node_key):
            raise ValueError("a node key needs the agent's node name, and must be non-empty")
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        self.sources = sources
        self.publisher = publisher
        self.keys = keys
        self.interval_s = interval_s
        self.stats = AgentStats()
        self._clock = clock
        self._embedders: dict[Domain, EmbeddingState] = {}
        self._last_seen: dict[Domain, float] = {}
        self.forget_after_s = forget_after_s
        self._next_sweep = 0.0
        self.node = node
        self._node_key = node_key
        self._unsigned_warned: set[str] = set()
        self._streams: dict[str, str] = {}  # node -> its sample stream, hashed once

    def __repr__(self) -> str:  # never the key
        return f"NodeAgent(node={self.node!r}, attesting={self._node_key is not None})"

    def _encode(self, node: str, payloads: list[dict[str, object]]) -> dict[str, str]:
        key = self._node_key if node == self.node else None
        if self._node_key is not None and key is None and node not in self._unsigned_warned:
            self._unsigned_warned.add(node)
            log.warning(
                "samples of node %s are sent unsigned: this agent holds the key of %s only",
                node,
                self.node,
            )
        return encode_samples(node, payloads, key)

    def _source_failed(self, name: str, exc: Exception) -> None:
        n = self.stats.source_errors[name] = self.stats.source_errors.get(name, 0) + 1
        if n in (1, 10, 100) or n % 1000 == 0:
            log.warning("source %s failed (%d times so far): %s", name, n, exc)

    def build_entries(self, now: float) -> list[Entry]:
        by_node: dict[str, list[dict[str, object]]] = {}
        events: list[Entry] = []
        for source in self.sources:
            name = getattr(source, "name", type(source).__name__)
            try:
                records = source.poll(now)
            except Exception as exc:  # one source must not stop the others
                self._source_failed(name, exc)
                continue
            for record in records:
                try:
                    self._add(record, now, by_node, events)
                except Exception as exc:  # nor one odd record (a zero capacity, say)
                    self._source_failed(name, exc)
        self._forget_stale(now)
        self.stats.domains = len(self._last_seen)
        entries = [
            Entry(self._stream(node), self._encode(node, payloads), len(payloads))
            for node, payloads in by_node.items()
        ]
        # Samples first: an OOM event should not reach the service before the samples leading to it.
        return entries + events

    def _stream(self, node: str) -> str:
        stream = self._streams.get(node)
        if stream is None:
            if len(self._streams) >= _MAX_CACHED_STREAMS:  # a replay of a huge cluster
                self._streams.clear()
            stream = self._streams[node] = self.keys.samples_for(node)
        return stream

    def _add(
        self,
        record: object,
        now: float,
        by_node: dict[str, list[dict[str, object]]],
        events: list[Entry],
    ) -> None:
        if isinstance(record, Event):
            key = self._node_key if record.node == self.node else None  # its own node's only
            events.append(Entry(self.keys.events, encode_event(record, key), 1))
            self.stats.events += 1
            if record.event == "oom":
                self._embedders.pop(record.domain, None)  # that job is gone
            return
        if not isinstance(record, Sample):
            raise TypeError(f"a source returned {type(record).__name__}, not a Sample or Event")
        if record.total_bytes <= 0:
            raise ValueError(f"{record.node}/{record.device}: total_bytes={record.total_bytes}")
        domain = record.domain
        state = self._embedders.get(domain)
        if state is None or (
            state.prev is not None and record.job and record.job != state.prev.job
        ):
            # a new job starts its history afresh: age, trends, high-water mark
            state = self._embedders[domain] = EmbeddingState()
        emb = state.embed(record)
        self._last_seen[domain] = now
        payload = sample_payload(record, emb, EMBEDDING_VERSION)
        by_node.setdefault(record.node, []).append(payload)
        self.stats.samples += 1

    def _forget_stale(self, now: float) -> None:
        """Drop the history of domains not sampled for ``forget_after_s`` (containers come
        and go all day: an agent must not keep every one it ever saw)."""
        if now < self._next_sweep:
            return
        self._next_sweep = now + min(60.0, self.forget_after_s)
        for domain, seen in list(self._last_seen.items()):
            if now - seen > self.forget_after_s:
                del self._last_seen[domain]
                self._embedders.pop(domain, None)

    def tick(self) -> None:
        started = time.monotonic()
        self.stats.ticks += 1
        self.publisher.publish(self.build_entries(self._clock()))
        self.stats.last_tick_at = time.monotonic()
        self.stats.last_tick_s = self.stats.last_tick_at - started

    @property
    def exhausted(self) -> bool:
        return all(s.exhausted for s in self.sources)

    def run(self, stop: threading.Event, *, drain_timeout_s: float = 10.0) -> None:
        """Tick until ``stop`` is set or every source is exhausted, then try to drain the buffer."""
        next_tick = time.monotonic()
        while not stop.is_set() and not self.exhausted:
            self.tick()
            next_tick += self.interval_s
            stop.wait(max(0.0, next_tick - time.monotonic()))
        deadline = time.monotonic() + drain_timeout_s
        while self.publisher.buffered_samples and time.monotonic() < deadline:
            if self.publisher.flush():
                break
            time.sleep(0.25)
        if self.publisher.buffered_samples:
            log.warning("exiting with %d samples not delivered", self.publisher.buffered_samples)
