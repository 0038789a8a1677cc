"""The in-process hook's way out: what ``step()`` queues, and the thread that publishes it.

``step()`` puts samples on a bounded queue (when full, the oldest is dropped and counted);
events (OOMs, checkpoint answers) go on a deque, which takes no lock, so a signal handler
may append to it. Both are numbered as they are queued (``itertools.count``: atomic under
the GIL), and a publishing round takes only what was numbered before it began, so what one
thread queued leaves in the order it was queued. The daemon thread embeds the samples and
publishes them in batches, exactly as the node agent does (one entry holds many samples),
riding out Redis outages with :class:`~oomcast.collectors.publisher.StreamPublisher`'s
bounded buffer; events go through :func:`oomcast.model.wire.encode_event`.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis

from oomcast.collectors.publisher import Entry, StreamPublisher
from oomcast.collectors.streams import stream_fields
from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState
from oomcast.model.events import DetailedEvent
from oomcast.model.schema import Sample
from oomcast.model.wire import Keys, encode_event, encode_samples, sample_payload

log = logging.getLogger(__name__)

SAMPLES_PER_ENTRY = 500  # a long backlog goes out as several entries, not one huge one
EVENTS_BACKLOG = 10_000  # events waiting for the thread (they are rare; this is a safety cap)
YIELD_EVERY = 8  # samples the thread embeds before it offers the GIL to the training loop


@dataclass
class HookStats:
    steps: int = 0  # step() calls
    samples: int = 0  # samples taken (queued, or dropped at once)
    queue_dropped: int = 0  # dropped because the queue was full (the thread fell behind)
    records_published: int = 0  # samples and events in Redis (the publisher counts both)
    publish_dropped: int = 0  # dropped by the publisher's buffer during a Redis outage
    publish_errors: int = 0
    events: int = 0  # events queued (oom, checkpoint_*)
    ooms: int = 0
    checkpoint_requests: int = 0
    control_ignored: int = 0  # control entries that were malformed or of unknown action
    read_errors: int = 0  # samples not taken because reading the figures failed

    @property
    def dropped(self) -> int:
        return self.queue_dropped + self.publish_dropped


@dataclass(slots=True, eq=False)
class OutEvent:
    event: DetailedEvent
    seq: int = 0  # the hook's count of samples and events, in the order they were queued


class HookOutbox:
    """The queues between the training loop and Redis, and the thread that empties them.

    publisher: None to keep everything in-process (samples are still embedded).
    chores: called by the thread after each round (the hook polls its control stream).
    """

    def __init__(
        self,
        node: str,
        keys: Keys,
        publisher: StreamPublisher | None,
        stats: HookStats,
        *,
        queue_size: int,
        publish_interval_s: float,
        chores: Callable[[], None] = lambda: None,
    ) -> None:
        self.node = node
        self.keys = keys
        self.publisher = publisher
        self.stats = stats
        self.publish_interval_s = publish_interval_s
        self.chores = chores
        self.seq = itertools.count()
        self.queue: queue.Queue[tuple[int, Sample]] = queue.Queue(maxsize=queue_size)
        self.events: deque[OutEvent] = deque(maxlen=EVENTS_BACKLOG)
        self.flush_waiters: deque[threading.Event] = deque()
        # numbered after the round began: held for the next round (the thread's own)
        self.held_samples: list[tuple[int, Sample]] = []
        self.held_events: list[OutEvent] = []
        self.embedders: dict[str, EmbeddingState] = {}
        self.wake = threading.Event()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    # --- the training loop's side -------------------------------------------------------------

    def put_sample(self, sample: Sample) -> None:
        """Queue a sample; never blocks (the oldest is dropped to make room)."""
        item = (next(self.seq), sample)
        q = self.queue
        try:
            q.put_nowait(item)
        except queue.Full:
            # the newest matter most to a forecast: make room by dropping the oldest
            with contextlib.suppress(queue.Empty):
                q.get_nowait()
            self.stats.queue_dropped += 1
            try:
                q.put_nowait(item)
            except queue.Full:
                self.stats.queue_dropped += 1

    def put_event(self, event: DetailedEvent) -> OutEvent:
        """Queue an event (no lock: safe in a signal handler); returns it as queued."""
        out = OutEvent(event, next(self.seq))
        self.stats.events += 1
        self.events.append(out)
        return out

    def unqueue_event(self, ev: OutEvent) -> bool:
        """Take back an event the thread has not taken yet; False when it has."""
        try:
            self.events.remove(ev)
        except ValueError:
            return False
        return True

    def send_directly(self, ev: OutEvent, redis_url: str, timeout_s: float, maxlen: int) -> bool:
        """Send ``ev`` from the calling thread, on a connection of its own: the thread did not
        get to it in time (stuck on a slow Redis, or gone). Unless the thread already took it
        (then it is in the publisher's hands: False)."""
        if self.publisher is None or not self.unqueue_event(ev):
            return False
        client = redis.Redis.from_url(
            redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s
        )
        try:
            fields = stream_fields(encode_event(ev.event))
            client.xadd(self.keys.events, fields, maxlen=maxlen, approximate=True)
            return True
        except redis.RedisError as exc:
            log.warning("oomcast hook: could not publish the oom event (%s)", exc)
            self.events.appendleft(ev)
            return False
        finally:
            client.close()

    def pending(self) -> int:
        """Samples and events not in Redis yet."""
        left = self.queue.qsize() + len(self.events)
        left += len(self.held_samples) + len(self.held_events)
        if self.publisher is not None:
            left += self.publisher.buffered_samples
        return left

    def delivered(self) -> bool:
        """Whether everything taken by the thread so far is in Redis."""
        return self.publisher is None or (
            self.publisher.buffered_samples == 0 and not self.held_samples and not self.held_events
        )

    # --- the thread ---------------------------------------------------------------------------

    def start(self) -> None:
        self.thread = threading.Thread(target=self.run, name="oomcast-hook", daemon=True)
        self.thread.start()

    def alive(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def run(self) -> None:
        while not self.stop_event.is_set():
            self.wake.wait(self.publish_interval_s)
            self.wake.clear()
            waiters: list[threading.Event] = []
            while True:
                try:
                    waiters.append(self.flush_waiters.popleft())
                except IndexError:
                    break
            try:
                self.publish_pending(force=bool(waiters))
                self.chores()
            except Exception:  # the thread must outlive anything
                log.exception("oomcast hook: background publishing failed")
            if self.held_samples or self.held_events:
                self.wake.set()  # they go out in the next round, right away
            delivered = self.delivered()
            for w in waiters:
                if delivered:
                    w.set()
                else:
                    self.flush_waiters.append(w)  # try again next round (flush() times out)

    def flush(self, timeout_s: float) -> bool:
        """Wait (at most ``timeout_s``) until everything queued so far is in Redis; without a
        thread, whether it is already."""
        if not self.alive():
            return self.publisher is None or (
                self.queue.empty() and not self.events and self.delivered()
            )
        done = threading.Event()
        self.flush_waiters.append(done)
        self.wake.set()
        return done.wait(timeout_s)

    def stop(self, join_timeout_s: float) -> None:
        self.stop_event.set()
        self.wake.set()
        if self.thread is not None and threading.current_thread() is not self.thread:
            self.thread.join(timeout=join_timeout_s)

    def take_pending(self) -> tuple[list[Sample], list[OutEvent]]:
        """What was queued before now: a thread that queues an event and then a sample (an
        OOM, then the sample after it) may do so while the queues are being emptied; what
        was numbered after ``cut`` waits for the next round, so the sample cannot leave
        before its event, nor the event before the samples queued ahead of it."""
        cut = next(self.seq)
        numbered, self.held_samples = self.held_samples, []
        while True:
            try:
                numbered.append(self.queue.get_nowait())
            except queue.Empty:
                break
        events, self.held_events = self.held_events, []
        while True:
            try:
                events.append(self.events.popleft())
            except IndexError:
                break
        samples = [s for n, s in numbered if n < cut]
        if len(samples) < len(numbered):
            self.held_samples = [(n, s) for n, s in numbered if n > cut]
        if any(e.seq > cut for e in events):
            self.held_events = [e for e in events if e.seq > cut]
            events = [e for e in events if e.seq < cut]
        return samples, events

    def publish_pending(self, force: bool) -> None:
        samples, events = self.take_pending()
        entries = self.build_entries(samples, events) if samples or events else []
        pub = self.publisher
        if pub is None:
            return
        if entries:
            pub.publish(entries)  # waits out its backoff after a failure
        if force and pub.buffered_samples:
            pub.flush()  # someone is waiting: try now
        self.stats.records_published = pub.stats.samples_sent
        self.stats.publish_dropped = pub.stats.samples_dropped
        self.stats.publish_errors = pub.stats.publish_errors

    def build_entries(self, samples: list[Sample], events: list[OutEvent]) -> list[Entry]:
        """Samples and events in time order, so that the samples before an OOM reach the
        service before it does, and those after it start the domain's history afresh."""
        items: list[tuple[float, int, Sample | OutEvent]] = [(s.ts, 0, s) for s in samples]
        items.extend((e.event.ts, 1, e) for e in events)
        items.sort(key=lambda t: (t[0], t[1]))
        entries: list[Entry] = []
        run: list[dict[str, Any]] = []
        stream = self.keys.samples_for(self.node)

        def close_run() -> None:
            for i in range(0, len(run), SAMPLES_PER_ENTRY):
                chunk = run[i : i + SAMPLES_PER_ENTRY]
                entries.append(Entry(stream, encode_samples(self.node, chunk), len(chunk)))
            run.clear()

        for n, (_, _, item) in enumerate(items, 1):
            if n % YIELD_EVERY == 0:
                time.sleep(0)  # let the training thread have the GIL between chunks of work
            if isinstance(item, Sample):
                state = self.embedders.get(item.device)
                if state is None:
                    state = self.embedders[item.device] = EmbeddingState()
                run.append(sample_payload(item, state.embed(item), EMBEDDING_VERSION))
            else:
                close_run()
                entries.append(Entry(self.keys.events, encode_event(item.event), 1))
                if item.event.event == "oom":
                    self.embedders.pop(item.event.device, None)  # as the node agent does
        close_run()
        return entries
