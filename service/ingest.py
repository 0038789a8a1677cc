"""The stream consumer: read sample and event streams as a consumer group, and run each
batch of entries down one pipeline, top to bottom (``Ingestor.process``):

1. **decode** the entries (``decode_sample_entries`` / ``decode_event_entries``) into
   samples or events, and dead letters for what cannot be read;
2. **forecast and evaluate rules**: ``LiveState.apply`` forecasts each round of samples and
   runs every rule on each forecast (``service/pipeline/rules.py`` decides), giving ``Alert``s;
3. **dispatch** each alert (``Dispatcher.dispatch``): its audit record and node commands;
   webhook and Alertmanager deliveries of the finished record, to owe (never waited on);
4. **commit** the audit records, the deliveries they owe (into the outbox) and dead
   letters, then the node commands, to Redis;
5. **acknowledge** the entries (``XACK``), only once their effects are on record.

So a crash loses nothing: a partition acquired (at start too) is restored from its
snapshots and all its pending entries are claimed (``XAUTOCLAIM``); entries another
consumer left pending for ``claim_idle_ms`` are claimed too. Records and commands not
written (Redis failed) are kept (``Commit``) for the next batch.

A replica reads the partitions it holds a lease on (``service/cluster/ownership.py``; or the fixed
set ``OOMCAST_PARTITIONS_OWNED`` names), so each domain's state lives on exactly one
replica, and a dead replica's partitions are taken over, with their snapshots, within the
lease's takeover time. Before it acts on a batch the loop checks that the batch's partition
is still its own. Every replica reads the whole events stream through a consumer group of
its own and keeps the events of the nodes it owns.

A malformed entry goes to the dead-letter stream with the reason and is acknowledged;
ingest carries on. Lost connections are retried with backoff; the loop never exits on its
own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
import time
from collections.abc import Sequence
from typing import Any, Protocol, cast

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.model.forecast import embedding_version
from oomcast.model.schema import Event
from oomcast.model.text import as_str, compact_json
from oomcast.model.wire import Keys
from oomcast.service.cluster.leases import PartitionOwner, StaticPartitions
from oomcast.service.cluster.ownership import Ownership, Snapshots
from oomcast.service.cluster.snapshot import SnapshotStore
from oomcast.service.delivery.outbox import Outbox
from oomcast.service.kept import TraceKeeper
from oomcast.service.metrics import Metrics, observe_many
from oomcast.service.pipeline.actions import Dispatched
from oomcast.service.pipeline.commit import Commit, Evaluated
from oomcast.service.pipeline.decode import (
    AUDITED_EVENTS,
    Decoded,
    KeyForNode,
    StreamEntries,
    audit_record,
    deadletter,
    decode_event_entries,
    decode_sample_entries,
)
from oomcast.service.pipeline.outcomes import Outcome
from oomcast.service.pipeline.read import read_new
from oomcast.service.pipeline.rules import Alert
from oomcast.service.pipeline.state import LiveState
from oomcast.service.scorecard import OutcomeStore, added

log = logging.getLogger(__name__)

APPLY_CHUNK = 4096  # samples forecast between two yields to the event loop
# (until, partition, entry id, fields, event): an event of a partition not ours, held
Held = tuple[float, int, str, Any, Event]
HOLD_S = 120.0  # how long events of another replica's partition are held (a takeover's span)
MAX_HELD = 10_000
EXPIRE_EVERY_S = 5.0


def _reraise_if_cancelled(exc: BaseException) -> None:
    """redis-py can turn a cancellation during a blocking read into a ConnectionError; a
    task being cancelled must still stop, not retry."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError() from exc


class Follower(Protocol):
    """What follows model swaps (service/model_swap.py ModelSwitch)."""

    async def follow(self) -> None: ...


class AlertDispatcher(Protocol):
    outbox: Outbox | None  # where the deliveries it decides are owed

    def dispatch(self, alert: Alert, now: float) -> Dispatched: ...


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
        partitions: Sequence[int] | None = None,
        read_count: int = 500,
        block_ms: int = 500,
        claim_idle_ms: int = 30_000,
        alerts_maxlen: int = 10_000,
        deadletter_maxlen: int = 10_000,
        live_after_s: float = 600.0,
        max_skew_s: float = 0.0,
        key_for_node: KeyForNode | None = None,
        owner: PartitionOwner | None = None,
        snapshots: SnapshotStore | None = None,
        snapshot_every_s: float = 5.0,
        snapshot_history: int = 32,
        dispatcher: AlertDispatcher,
        outcomes: OutcomeStore | None = None,
        keeper: TraceKeeper | None = None,
    ) -> None:
        self.client = client
        self.keys = keys
        self.live = live
        self.metrics = metrics
        self.group = group
        self.consumer = consumer
        fixed = sorted(set(range(keys.partitions) if partitions is None else partitions))
        if not fixed or not all(0 <= p < keys.partitions for p in fixed):
            raise ValueError(f"owned partitions {partitions} must lie in 0..{keys.partitions - 1}")
        # Leases when given (the service's default), else the fixed set.
        self.ownership = Ownership(
            keys,
            live,
            owner if owner is not None else StaticPartitions(frozenset(fixed)),
            snapshots,
            snapshot_every_s=snapshot_every_s,
            snapshot_history=snapshot_history,
        )
        self.read_count = read_count
        self.block_ms = block_ms
        self.claim_idle_ms = claim_idle_ms
        self.alerts_maxlen = alerts_maxlen
        self.deadletter_maxlen = deadletter_maxlen
        self.live_after_s = live_after_s
        self.max_skew_s = max_skew_s
        self.key_for_node = key_for_node
        self.dispatcher = dispatcher
        # Events: one group per replica, so every replica sees the events of its own nodes.
        self.events_group = f"{group}:{consumer}"
        self.ready = asyncio.Event()  # set once groups exist and our own backlog is drained
        self.last_ok = 0.0  # monotonic time of the last Redis round trip that worked
        # Records and commands not yet written (Redis failed): they go with the next batch.
        self._unwritten = Commit()
        # Outcomes decided and not yet on record (service/scorecard.py); they go with the
        # next batch when Redis fails, and are counted once whenever they are written.
        self.outcome_store = outcomes
        self._outcomes: list[Outcome] = []
        # Keep requests for the samples of outcomes worth a trace (service/kept.py).
        self.keeper = keeper
        # Events of other replicas' partitions, held a while (``_hold``).
        self._held: list[Held] = []
        self._replay_due: set[int] = set()  # taken partitions whose held events are due
        # Follows model swaps made on other replicas (service/model_swap.py); set by main.py.
        self.switch: Follower | None = None
        self._last_claim = 0.0
        self._to_take: set[int] = set()  # acquired, not yet restored and claimed
        self._last_expire = time.monotonic()
        self._stopping = False

    @property
    def partitions(self) -> list[int]:
        """The partitions this replica reads now."""
        return self.ownership.partitions

    @property
    def sample_streams(self) -> list[str]:
        return self.ownership.streams()

    def healthy(self, within_s: float = 10.0) -> bool:
        return self.ready.is_set() and time.monotonic() - self.last_ok < within_s

    async def stop(self, task: asyncio.Task[None]) -> None:
        """Let the loop finish its current read and batch, then end it. Cancelling a task in
        the middle of a blocking XREADGROUP can leave redis-py waiting on a dead future, so
        cancellation is only the fallback."""
        self._stopping = True
        _, pending = await asyncio.wait([task], timeout=self.block_ms / 1000 + 2.0)
        if pending:
            task.cancel()
            await asyncio.wait([task], timeout=2.0)
        try:  # snapshot every domain, so the next owner carries on from the last sample
            await self.ownership.hand_over(list(self.partitions))
        except Exception as exc:  # Redis gone: the next owner starts from older snapshots
            log.warning("could not snapshot the domains on the way out (%s)", exc)
        try:  # hand the partitions over now, not when the leases lapse
            await self.ownership.owner.release_all()
        except Exception as exc:  # Redis gone: the leases lapse on their own
            log.warning("could not release partition leases (%s)", exc)

    async def run(self) -> None:
        backoff = 0.2
        while not self._stopping:
            try:
                await self._ensure_groups()
                await self._follow_swaps()  # before restoring: snapshots are of that model
                await self._own()  # restore and claim first: pending entries need their state
                await self._drain_own_pending()
                self.metrics.redis_up.set(1)
                self.last_ok = time.monotonic()
                self.ready.set()
                backoff = 0.2
                while not self._stopping:
                    await self._step()
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

    def _lose(self, partitions: list[int]) -> None:
        """Partitions no longer ours: their domains go, and so does whatever of theirs is
        still waiting to be written (the new owner forecasts it again and writes it)."""
        self.ownership.forget(partitions)
        self._unwritten.drop(self.keys, set(partitions))

    async def _keep_leases(self) -> None:
        """Renew (a no-op between renewals); note what was lost and what is to be taken.
        Called between the batches of long claims and drains too, so a big backlog cannot
        outlast the leases it is processed under."""
        change = await self.ownership.tick()
        self._unwritten.drop(self.keys, set(change.lost))
        # lost before acquired: a lease that lapsed here but was still ours in Redis is in
        # both, and must be taken afresh (restored, its pending entries claimed)
        self._to_take = (self._to_take - set(change.lost)) | set(change.acquired)

    async def _own(self) -> None:
        """Renew the partitions; restore and claim the ones just acquired."""
        await self._keep_leases()
        while self._to_take:
            p = min(self._to_take)
            self._to_take.discard(p)
            restored = await self.ownership.restore(p)
            if restored.forged:
                self.metrics.snapshots_refused.labels(reason="forged").inc(restored.forged)
            stream = self.keys.samples(p)
            await self._create_group(stream, self.group, "0")
            claimed = await self._claim(stream, 0)  # the lease says their reader has stopped
            self._replay_due.add(p)  # after its backlog (``_step``)
            log.info(
                "partition %d is ours: %d domains restored, %d pending entries claimed",
                p,
                len(restored.states),
                claimed,
            )
        self.metrics.partitions_owned.set(len(self.partitions))

    async def _follow_swaps(self) -> None:
        if self.switch is not None:
            await self.switch.follow()

    def _hold(self, others: list[tuple[int, str, Any, Event]]) -> None:
        """Keep events of partitions not ours for HOLD_S (at most MAX_HELD): one whose
        owner dies before reading it is replayed when the partition becomes ours."""
        if not others:
            return
        until = time.monotonic() + HOLD_S
        self._held.extend((until, p, entry_id, fields, ev) for p, entry_id, fields, ev in others)
        if len(self._held) > MAX_HELD:
            del self._held[: len(self._held) - MAX_HELD]

    async def _replay_held(self, partition: int) -> None:
        """The held events of ``partition``, just acquired and restored, processed now. An
        OOM its snapshot already knows (the old owner read it: an OOM snapshots its domain
        with the batch that took it) is not replayed: it would restart the domain's model."""
        now = time.monotonic()
        keep: list[Held] = []
        mine: list[Held] = []
        for held in self._held:
            if held[0] >= now:
                (mine if held[1] == partition else keep).append(held)
        self._held = keep
        entries = []
        for _, _, entry_id, fields, ev in mine:
            st = self.live.domains.get(ev.domain)
            known = st is not None and st.last_oom_ts is not None and ev.ts <= st.last_oom_ts
            if not (ev.event == "oom" and known):
                entries.append((entry_id, fields))
        if entries:
            log.info("partition %d: %d events read before it was ours, replayed", partition,
                     len(entries))  # fmt: skip
            await self.process(self.keys.events, entries)

    async def _step(self) -> None:
        await self._follow_swaps()
        await self._own()
        now = time.monotonic()
        if now - self._last_claim >= max(1.0, self.claim_idle_ms / 1000):
            await self._claim_stale()
        if now - self._last_expire >= EXPIRE_EVERY_S:
            self._last_expire = now
            before = set(self.live.domains)
            expired = self.live.expire(time.time(), self.live_after_s)
            batch = self.dispatch(Evaluated(alerts=expired))
            batch.snapshots = self.ownership.dropped(before - set(self.live.domains))
            await self.commit(batch)
        # Events are read before the samples and processed after them: an agent writes a
        # tick's samples before its events, so every sample written before an event read here
        # is in the streams when they are read next, and an OOM never overtakes its samples
        # (read the other way round, samples read mid-burst left the rest of the burst to
        # the next round, after the OOM had made them late). A backlog beyond read_count can
        # still leave some behind.
        events = await self.client.xreadgroup(
            self.events_group, self.consumer, {self.keys.events: ">"}, count=self.read_count
        )
        streams = self.sample_streams
        resp = None
        if streams:  # one XREADGROUP; on a Redis Cluster one per partition (streams_read.py)
            resp = await read_new(
                self.client,
                self.group,
                self.consumer,
                streams,
                self.read_count,
                0 if events else self.block_ms,  # events in hand: do not sit on them
            )
        elif not events:  # no partition is ours (more replicas than partitions): wait for one
            await asyncio.sleep(self.block_ms / 1000)
        self.last_ok = time.monotonic()
        for stream, entries in [*(resp or []), *(events or [])]:
            await self.process(as_str(stream), entries)
        if self._replay_due:
            # once a taken partition's backlog of samples is read (a read that came back
            # short), the events held for it: an OOM must not overtake its job's samples
            behind = {as_str(s) for s, e in resp or [] if len(e) >= self.read_count}
            for p in sorted(self._replay_due):
                if self.keys.samples(p) not in behind:
                    self._replay_due.discard(p)
                    await self._replay_held(p)

    async def _ensure_groups(self) -> None:
        """The group of every partition's stream, held now or not (again after a Redis, or a
        Cluster node, restarted without its data: NOGROUP otherwise): a lease that lapsed
        while Redis was away is found ours again without being acquired afresh."""
        await self._warn_unread_partitions()
        for stream in self.keys.all_samples():
            await self._create_group(stream, self.group, "0")
        # A replica new to the events stream starts at its end: older events concern jobs
        # it never saw.
        await self._create_group(self.keys.events, self.events_group, "$")

    async def _create_group(self, stream: str, group: str, start: str) -> None:
        try:
            await self.client.xgroup_create(stream, group, id=start, mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def _warn_unread_partitions(self) -> None:
        """Agents configured with more partitions than the service write streams no replica
        reads; say so instead of losing those nodes silently."""
        pattern = re.compile(re.escape(self.keys.prefix) + r":samples:\{(\d+)\}$")
        async for key in self.client.scan_iter(match=f"{self.keys.prefix}:samples:*", count=1000):
            m = pattern.match(as_str(key))
            if m is None or int(m.group(1)) >= self.keys.partitions:
                log.error(
                    "stream %s is read by no replica (OOMCAST_PARTITIONS=%d here); agents and"
                    " service must agree on OOMCAST_PARTITIONS",
                    as_str(key),
                    self.keys.partitions,
                )

    async def _drain_own_pending(self) -> None:
        """Entries delivered to this consumer before a restart of the loop and never
        acknowledged (a partition acquired later has its pending entries claimed then)."""
        groups = [(s, self.group) for s in self.sample_streams]
        for stream, group in [*groups, (self.keys.events, self.events_group)]:
            last = "0"
            while True:
                resp = await self.client.xreadgroup(
                    group, self.consumer, {stream: last}, count=self.read_count
                )
                entries: StreamEntries = cast(Any, resp)[0][1] if resp else []
                if not entries:
                    break
                self.metrics.claimed.inc(len(entries))
                await self.process(stream, entries)
                await self._keep_leases()
                last = as_str(entries[-1][0])

    async def _claim_stale(self) -> None:
        """Entries another consumer left pending for ``claim_idle_ms`` (it died)."""
        self._last_claim = time.monotonic()
        for stream in self.sample_streams:
            await self._claim(stream, self.claim_idle_ms)

    async def _claim(self, stream: str, min_idle_ms: int) -> int:
        """Claim and process the entries of ``stream`` pending for ``min_idle_ms``."""
        start, claimed = "0-0", 0
        while True:
            nxt, entries, *_ = await self.client.xautoclaim(
                stream,
                self.group,
                self.consumer,
                min_idle_ms,
                start_id=start,
                count=self.read_count,
            )
            if entries:
                claimed += len(entries)
                self.metrics.claimed.inc(len(entries))
                await self.process(stream, entries)
                await self._keep_leases()
                if not self.ownership.owns_stream(stream):
                    return claimed  # lost meanwhile: the new owner claims the rest
            start = as_str(nxt)
            if start == "0-0":
                return claimed

    async def process(self, stream: str, entries: StreamEntries) -> None:
        """One batch of entries of one stream, down the pipeline (see the module's doc)."""
        if not entries:
            return
        self.metrics.entries.labels(stream=stream).inc(len(entries))
        if stream == self.keys.events:
            group = self.events_group
            decoded = decode_event_entries(
                stream,
                entries,
                self.keys,
                self.partitions,
                max_skew_s=self.max_skew_s,
                key_for_node=self.key_for_node,
            )
            self._hold(decoded.others)
            evaluated = self.evaluate_events(decoded)
        else:
            group = self.group
            version = embedding_version(self.live.forecaster)
            decoded = decode_sample_entries(
                stream,
                entries,
                version,
                max_skew_s=self.max_skew_s,
                key_for_node=self.key_for_node,
                keys=self.keys,
            )
            evaluated = await self.forecast_and_evaluate(stream, decoded)
        if not self.ownership.owns_stream(stream, for_s=self.ownership.commit_margin_s):
            # The lease lapsed while we forecast, or may before the commit is done: act on
            # nothing, acknowledge nothing; the new owner claims these entries and forecasts
            # them from our last snapshots.
            p = self.ownership.partition_of_stream(stream)
            log.warning("lost partition %s mid-batch; its %d entries go on", p, len(entries))
            self._lose([p] if p is not None else [])
            return
        batch = self.dispatch(evaluated)
        # Domains that alerted or decided an outcome are snapshotted with this batch, whatever
        # the schedule: a successor must not decide again what is on record here.
        urgent = [(a.node, a.device) for a in evaluated.alerts]
        urgent += [(o.node, o.device) for o in self.live.outcomes]
        batch.snapshots = self.ownership.snapshots_for(evaluated.touched, urgent)
        await self.commit(batch)
        for dl in evaluated.deadletters:  # counted once on record, by why
            self.metrics.rejected.labels(reason=as_str(dl.get("code", "undecodable"))).inc()
        await self.acknowledge(stream, group, [entry_id for entry_id, _ in entries])

    def evaluate_events(self, decoded: Decoded) -> Evaluated:
        """Step 2 for events: an OOM ends its domain's episodes; action reports are audited."""
        out = Evaluated(deadletters=decoded.deadletters)
        now = time.time()
        for (event, fields), entry_id, attested in zip(
            decoded.events, decoded.event_ids, decoded.events_attested, strict=True
        ):
            why = self.live.why_refused_event(event, attested, now)
            if why is not None:
                out.deadletters.append(deadletter(self.keys.events, entry_id, fields, why,
                                                  "unattested"))  # fmt: skip
                continue
            self.metrics.events.labels(event=event.event).inc()
            out.alerts.extend(self.live.on_event(event, now))
            if event.event == "oom":  # the domain's forecaster restarted: snapshot it now
                out.touched.append(event.domain)
            if event.event in AUDITED_EVENTS:
                out.audit_events.append(audit_record(event.event, fields, attested))
        return out

    async def forecast_and_evaluate(self, stream: str, decoded: Decoded) -> Evaluated:
        """Step 2 for samples: forecast, and run the rules on each forecast."""
        out = Evaluated(deadletters=decoded.deadletters)
        samples, embs = decoded.samples, decoded.embeddings
        for start in range(0, len(samples), APPLY_CHUNK):
            chunk = slice(start, start + APPLY_CHUNK)
            applied = self.live.apply(
                samples[chunk], time.time(), embs[chunk], decoded.attested[chunk]
            )
            self.metrics.samples.inc(len(applied.forecasts))
            self.metrics.duplicates.inc(applied.duplicates)
            self.metrics.late.inc(applied.late)
            self.metrics.clock_resets.inc(applied.clock_resets)
            for sample, problem, code in applied.rejected:
                out.deadletters.append(
                    {
                        "stream": stream,
                        "reason": str(problem),
                        "code": code,
                        "sample": compact_json(sample.to_dict()),
                    }
                )
            out.alerts.extend(applied.alerts)
            out.touched.extend(st.domain for st, _ in applied.forecasts)
            if start + APPLY_CHUNK < len(samples):
                await asyncio.sleep(0)  # let HTTP requests in between big chunks
        done_ms = time.time() * 1000
        for ms, count in itertools.groupby(decoded.arrived_ms):  # an entry's samples together
            observe_many(
                self.metrics.forecast_latency, max(0.0, done_ms - ms) / 1000, sum(1 for _ in count)
            )
        return out

    def dispatch(self, evaluated: Evaluated) -> Commit:
        """Step 3: act on each alert; what must then be on record, in order."""
        out = Commit(records=list(evaluated.audit_events), deadletters=evaluated.deadletters)
        now = time.time()
        for alert in evaluated.alerts:
            self.metrics.alerts.labels(status=alert.status).inc()
            done = self.dispatcher.dispatch(alert, now)
            out.records.append(done.record)
            out.commands.extend(done.commands)
            out.deliveries.extend(done.deliveries)
        return out

    async def commit(self, batch: Commit) -> None:
        """Step 4: audit records, the deliveries they owe (into the outbox) and dead letters,
        then node commands, each in one round trip. What cannot be written now (Redis failed:
        this raises) is kept for the next batch, deliveries included (owing one twice owes
        it once); dead letters are not: their entries stay unacknowledged and are read
        again."""
        self._unwritten.records.extend(batch.records)
        self._unwritten.deliveries.extend(batch.deliveries)
        self._unwritten.commands.extend(batch.commands)
        self._unwritten.snapshots.merge(batch.snapshots)
        snaps = self._unwritten.snapshots
        records, commands = self._unwritten.records, self._unwritten.commands
        deliveries = self._unwritten.deliveries
        outbox = self.dispatcher.outbox
        outcomes = self._outcomes
        outcomes.extend(self.live.take_outcomes())
        store = self.outcome_store
        if records or deliveries or batch.deadletters or snaps or outcomes:
            # Records first, in their own round trip: a pipeline runs every command even when
            # one fails, and neither the commands nor the ack may go unless the records did.
            # Deliveries in the same round trip: owed before the first try, and never on
            # record without being owed.
            pipe = self.client.pipeline(transaction=False)
            # Outcomes ahead of the snapshots that no longer hold what decided them (an OOM
            # is not seen again by a successor restoring a snapshot made after it).
            n = store.stage(pipe, outcomes) if store is not None else 0
            if self.keeper is not None and store is not None:  # after them: results[:n]
                self.keeper.stage(pipe, outcomes)
            if deliveries and outbox is not None:
                outbox.stage(pipe, deliveries, time.time())
            for record in records:
                pipe.xadd(
                    self.keys.alerts,
                    {"alert": compact_json(record)},
                    maxlen=self.alerts_maxlen,
                    approximate=True,
                )
            for dl in batch.deadletters:
                pipe.xadd(
                    self.keys.deadletter,
                    cast(Any, dl),
                    maxlen=self.deadletter_maxlen,
                    approximate=True,
                )
            # Snapshots too: a successor must find an episode fired here already firing.
            self.ownership.stage(pipe, snaps)
            results = await pipe.execute()
            self._count_outcomes(outcomes, added(results[:n]) if store else [True] * len(outcomes))
            outcomes.clear()
            records.clear()
            self._unwritten.snapshots = Snapshots()
            if deliveries and outbox is not None:
                outbox.wake()  # this replica's worker need not wait for its next poll
            deliveries.clear()
            self.metrics.deadletters.inc(len(batch.deadletters))
        if commands:
            # Node commands only once their alerts are on record; a command whose write
            # fails goes with the next batch, within its expiry.
            pipe = self.client.pipeline(transaction=False)
            for command in commands:
                pipe.xadd(
                    command.stream, cast(Any, dict(command.fields)), maxlen=1000, approximate=True
                )
            await pipe.execute()
            commands.clear()

    def _count_outcomes(self, outcomes: list[Outcome], added: list[bool]) -> None:
        """Count the outcomes that went on record now (not those already there)."""
        for o, new in zip(outcomes, added, strict=True):
            if not new:
                continue
            if o.outcome == "exposure":
                self.metrics.watched.labels(o.role, o.model_version, o.kind).inc(o.seconds)
            else:
                self.metrics.outcomes.labels(
                    o.role, o.model_version, o.outcome, o.oom_class or "", o.warned or "", o.kind
                ).inc()

    async def acknowledge(self, stream: str, group: str, ids: list[bytes | str]) -> None:
        """Step 5: the entries are done with, their effects recorded."""
        if ids:
            await self.client.xack(stream, group, *ids)
