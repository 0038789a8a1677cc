"""The node agent: poll sources each tick, embed, publish one stream entry per node.

Every sample leaves the node with its memory-access embedding, computed here so the
service's hot path can skip it (DESIGN.md). Events (``oom``) go to the events stream.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from oomcast.collectors.publisher import Entry, StreamPublisher
from oomcast.collectors.sources.base import Source
from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState
from oomcast.model.schema import Domain, Event, Sample
from oomcast.model.wire import Keys, encode_event, encode_samples, sample_payload

log = logging.getLogger(__name__)


@dataclass
class AgentStats:
    ticks: int = 0
    samples: int = 0
    events: int = 0


class NodeAgent:
    def __init__(
        self,
        sources: list[Source],
        publisher: StreamPublisher,
        keys: Keys,
        *,
        interval_s: float = 1.0,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not sources:
            raise ValueError("a node agent needs at least one source")
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        self.sources = sources
        self.publisher = publisher
        self.keys = keys
        self.interval_s = interval_s
        self.stats = AgentStats()
        self._clock = clock
        self._embedders: dict[Domain, EmbeddingState] = {}

    def build_entries(self, now: float) -> list[Entry]:
        by_node: dict[str, list[dict[str, object]]] = {}
        events: list[Entry] = []
        for source in self.sources:
            for record in source.poll(now):
                if isinstance(record, Event):
                    events.append(Entry(self.keys.events, encode_event(record), 1))
                    self.stats.events += 1
                    if record.event == "oom":
                        self._embedders.pop(record.domain, None)  # that job is gone
                    continue
                assert isinstance(record, Sample)
                state = self._embedders.get(record.domain)
                if state is None or (
                    state.prev is not None and record.job and record.job != state.prev.job
                ):
                    # a new job starts its history afresh: age, trends, high-water mark
                    state = self._embedders[record.domain] = EmbeddingState()
                emb = state.embed(record)
                payload = sample_payload(record, emb, EMBEDDING_VERSION)
                by_node.setdefault(record.node, []).append(payload)
                self.stats.samples += 1
        entries = [
            Entry(self.keys.samples_for(node), encode_samples(node, payloads), len(payloads))
            for node, payloads in by_node.items()
        ]
        # Samples first: an OOM event should not reach the service before the samples leading to it.
        return entries + events

    def tick(self) -> None:
        self.stats.ticks += 1
        self.publisher.publish(self.build_entries(self._clock()))

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
