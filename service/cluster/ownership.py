"""Which partitions this replica reads, and the hand-over of their domains' state.

The ingest loop asks ``Ownership.tick()`` before every read. Ownership comes from leases in
Redis (``service/cluster/leases.py``; the default) or from a fixed ``OOMCAST_PARTITIONS_OWNED``.

- A partition **acquired** is first restored from its snapshots (``service/cluster/snapshot.py``):
  each domain's forecaster state, recent history and open episodes, as the previous owner
  last wrote them. The loop then claims every entry still pending in that partition's
  stream, whoever read it, and processes it: the lease says the previous reader has
  stopped, so they would otherwise never be acknowledged.
- A partition **lost** (its lease lapsed, or was handed to a newcomer) is forgotten at once:
  its domains leave this replica's live state without a resolved alert, because their
  episodes go on at the new owner.
- With each batch, ``snapshots_for`` picks the domains to snapshot: those with an alert in
  the batch (always: their episodes changed) and the others every ``snapshot_every_s``.
  The ingest loop writes them in the round trip that writes the batch's alert records,
  before it acknowledges the entries. With leases the writes are fenced by the lease token:
  a replica that lost a partition cannot overwrite the new owner's snapshots.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.schema import Domain
from oomcast.model.wire import Keys
from oomcast.service.cluster.leases import LeaseChange, PartitionOwner
from oomcast.service.cluster.snapshot import Restored, SnapshotSchedule, SnapshotStore
from oomcast.service.pipeline.rules import Alert
from oomcast.service.pipeline.state import LiveState

log = logging.getLogger("oomcast.service.ingest")
COMMIT_MARGIN = 0.2  # of the lease TTL


@dataclass
class Snapshots:
    """The snapshots to write with one batch, per partition, and the domains to drop."""

    write: dict[int, dict[Domain, bytes]] = field(default_factory=dict)
    drop: dict[int, list[Domain]] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.write or self.drop)

    def merge(self, other: Snapshots) -> None:
        for p, blobs in other.write.items():
            self.write.setdefault(p, {}).update(blobs)
        for p, domains in other.drop.items():
            self.drop.setdefault(p, []).extend(domains)


class Ownership:
    def __init__(
        self,
        keys: Keys,
        live: LiveState,
        owner: PartitionOwner,
        store: SnapshotStore | None = None,
        *,
        snapshot_every_s: float = 5.0,
        snapshot_history: int = 32,
    ) -> None:
        self.keys = keys
        self.live = live
        self.owner = owner
        self.store = store
        self.schedule = SnapshotSchedule(snapshot_every_s)
        self.snapshot_history = snapshot_history
        self.token: str | None = getattr(owner, "token", None)
        # A batch is committed only while its lease has this long left: with the gap between
        # the local deadline and the key's expiry (a fifth of the TTL too) it covers a round
        # trip of up to OOMCAST_LEASE_TTL_S * 0.4, the Redis client's socket timeout.
        self.commit_margin_s = COMMIT_MARGIN * float(getattr(owner, "ttl_s", 0.0))
        self.on_restore: Callable[[list[Alert]], None] | None = None
        self.on_forget: Callable[[set[Domain]], None] | None = None
        if hasattr(owner, "before_release"):  # leases: a partition given up is handed over
            owner.before_release = self.hand_over

    async def hand_over(self, partitions: list[int]) -> None:
        """A partition given up to rebalance (a replica or worker joined): every one of its
        domains is snapshotted now, fenced by the lease that is still ours in Redis, so the
        new owner carries on from the last sample this replica forecast instead of from a
        snapshot up to ``snapshot_every_s`` old (or none, for a domain seen only since)."""
        if self.store is None or self.token is None:
            return
        wanted = set(partitions)
        blobs: dict[int, dict[Domain, bytes]] = {}
        for d in self.live.domains:
            p = self.keys.partition_of(d[0])
            if p in wanted:
                blobs.setdefault(p, {})[d] = self.live.snapshot(
                    d, history_points=self.snapshot_history
                )
        if not blobs:
            return
        pipe = self.store.client.pipeline(transaction=False)
        for p, items in blobs.items():
            self.store.stage(pipe, p, items, lease_token=self.token)
        await pipe.execute()
        log.info(
            "partitions %s handed over: %d domains snapshotted",
            sorted(blobs), sum(len(b) for b in blobs.values()),
        )  # fmt: skip

    def keep_alive_in(self, target: Any) -> None:
        """Alertmanager ends an alert nobody re-sends: on a partition's hand-over the new
        owner re-sends its restored firing episodes (``target.keep_alive``), the old one
        stops (``target.forget``)."""

        def restored(alerts: list[Alert]) -> None:
            for a in alerts:
                if target.name in a.rule.actions:
                    target.keep_alive(a.to_payload())

        self.on_restore = restored
        self.on_forget = target.forget

    @property
    def partitions(self) -> list[int]:
        return sorted(self.owner.owned())

    def streams(self) -> list[str]:
        return [self.keys.samples(p) for p in self.partitions]

    def partition_of_stream(self, stream: str) -> int | None:
        return self.keys.partition_of_stream(stream)

    def owns_stream(self, stream: str, for_s: float = 0.0) -> bool:
        p = self.partition_of_stream(stream)
        return p is None or self.owner.owns(p, for_s)

    def domains_of(self, partitions: Iterable[int]) -> list[Domain]:
        wanted = set(partitions)
        return [d for d in self.live.domains if self.keys.partition_of(d[0]) in wanted]

    async def tick(self) -> LeaseChange:
        """Renew and rebalance; forget what was lost. The caller restores and claims what was
        acquired (``restore``), since claiming means processing entries."""
        change = await self.owner.tick()
        if change.error:
            log.warning("partition leases: %s", change.error)
        if change.lost:
            self.forget(change.lost)
        return change

    def forget(self, partitions: Iterable[int]) -> None:
        lost = sorted(set(partitions))
        domains = self.domains_of(lost)
        self.live.forget(domains)
        self.schedule.forget(domains)
        if self.on_forget is not None:
            self.on_forget(set(domains))
        log.info("partitions %s are no longer ours: %d domains handed on", lost, len(domains))

    async def restore(self, partition: int) -> Restored:
        """Install the partition's snapshots: what was restored, and what was not. Their
        firing episodes go to ``on_restore`` (Alertmanager must keep hearing of them)."""
        if self.store is None:
            return Restored()
        restored = await self.store.restore(self.live, partition)
        if self.on_restore is not None:
            self.on_restore(self.live.firing([st.domain for st in restored.states], time.time()))
        if restored.ignored:
            log.warning(
                "partition %d: %d snapshots could not be restored; those domains start cold",
                partition,
                restored.ignored,
            )
        return restored

    def snapshots_for(self, touched: Iterable[Domain], urgent: Iterable[Domain]) -> Snapshots:
        out = Snapshots()
        if self.store is None:
            return out
        for d in self.schedule.pick(touched, urgent, time.monotonic()):
            if d not in self.live.domains:
                continue
            p = self.keys.partition_of(d[0])
            blob = self.live.snapshot(d, history_points=self.snapshot_history)
            out.write.setdefault(p, {})[d] = blob
        return out

    def dropped(self, domains: Iterable[Domain]) -> Snapshots:
        """Snapshots to delete: domains that expired (silent for OOMCAST_LIVE_AFTER_S)."""
        out = Snapshots()
        ds = list(domains)
        self.schedule.forget(ds)
        for d in ds:
            out.drop.setdefault(self.keys.partition_of(d[0]), []).append(d)
        return out

    def stage(self, pipe: object, snaps: Snapshots) -> None:
        """Queue the writes of ``snaps`` on the batch's records pipeline."""
        if self.store is None:
            return
        for p, blobs in snaps.write.items():
            if self.owner.owns(p):
                self.store.stage(pipe, p, blobs, lease_token=self.token)
        for p, domains in snaps.drop.items():
            if self.owner.owns(p):
                self.store.drop(pipe, p, domains, lease_token=self.token)
