"""Which replica owns which partition: leases in Redis, so replicas scale out and take over
from each other without ever owning a partition twice.

A partition's lease is one key, ``<prefix>:lease:{<p>}`` (the hash tag puts it in the
partition stream's Cluster slot), holding the owner's token with a TTL. A replica:

- **announces itself** in ``<prefix>:replicas``, a sorted set of token -> expiry, written
  and read with the Redis server's own clock (``TIME`` in a script), so the replicas' clocks
  never matter. The live replicas give the fair share, ``ceil(partitions / live)``;
- **renews** the leases it holds (compare the token, then ``PEXPIRE``), **acquires** free
  ones (``SET NX PX``) up to its fair share, and **releases** those above it (compare, then
  ``DEL``) so a replica that just started gets work at once.

All of it happens in ``PartitionLeases.tick()``, which the ingest loop calls between reads;
it talks to Redis once every ``renew_s`` (``ttl_s / 3``) and is free in between.

Never owned by two at once: a holder counts a lease as its own only until a local,
monotonic deadline, ``(start of the last renew that worked) + ttl_s * safety`` with
``safety < 1``. Redis set the key's expiry after that moment, so the holder stops before
the key can expire and be taken by anyone else; a holder that cannot reach Redis, or whose
loop stalls, loses its leases locally first. ``owns(p)`` is the check to make right before
processing or committing a partition's entries. A lease whose local deadline passed is
reported lost even when the renew then finds it still ours (then it is reported acquired
too): whatever the loop skipped in between must be re-read as by a new owner.

Takeover: a replica that dies holding a lease leaves it to expire within ``ttl_s`` of its
last renew; the next ``tick()`` of a live replica after that acquires it. So a dead
replica's partitions are owned again within ``ttl_s + renew_s`` (10 s + 3.3 s by default),
plus however long the ingest loop goes between two ``tick()`` calls (one read's
``block_ms`` and one batch). A clean shutdown (``release_all()``) hands over at the other
replicas' next renew.

``StaticPartitions`` has the same interface for a replica configured with fixed partitions
(``OOMCAST_PARTITIONS_OWNED``, a StatefulSet that pins them): no leases, always owned.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import zlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from oomcast.model.wire import answer_async

if TYPE_CHECKING:
    from oomcast.service.settings import Settings

log = logging.getLogger(__name__)

# Announce ourselves and count the live replicas, by the server's clock.
HEARTBEAT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[1])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
redis.call('PEXPIRE', KEYS[1], 10 * tonumber(ARGV[2]))
return redis.call('ZCARD', KEYS[1])
"""
RENEW = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('PEXPIRE', KEYS[1], ARGV[2])
end
return 0
"""
RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""
LEAVE = """
redis.call('ZREM', KEYS[1], ARGV[1])
return 1
"""


def lease_key(prefix: str, partition: int) -> str:
    return f"{prefix}:lease:{{{partition}}}"


def replicas_key(prefix: str) -> str:
    return f"{prefix}:replicas"


@dataclass(frozen=True)
class LeaseChange:
    """What one ``tick()`` changed. Handle ``lost`` before ``acquired``: one partition can
    be in both (its lease lapsed locally, then turned out still ours)."""

    acquired: frozenset[int] = frozenset()
    lost: frozenset[int] = frozenset()  # released ones included
    released: frozenset[int] = frozenset()  # given up above the fair share
    owned: frozenset[int] = frozenset()
    error: str | None = None  # Redis could not be reached this tick

    @property
    def changed(self) -> bool:
        return bool(self.acquired or self.lost)


@dataclass
class _Held:
    deadline: float  # local monotonic time after which the lease is not trusted


@dataclass
class PartitionLeases:
    """Leases on ``partitions`` partitions under ``prefix``, held by ``owner`` (the
    consumer name; a random suffix makes each process's token its own, so a restarted
    replica never mistakes its predecessor's leases for its own)."""

    client: aioredis.Redis
    prefix: str
    partitions: int
    owner: str
    ttl_s: float = 10.0
    safety: float = 0.8  # of the TTL that a holder trusts a renew for
    renew_s: float | None = None  # default ttl_s / 3
    clock: Callable[[], float] = time.monotonic
    token: str = ""
    _held: dict[int, _Held] = field(default_factory=dict, init=False, repr=False)
    # lapsed locally, maybe still ours in Redis: the next round tries them as new ones
    _lapsed: set[int] = field(default_factory=set, init=False, repr=False)
    _last_tick: float = field(default=-math.inf, init=False, repr=False)
    _live: int = field(default=1, init=False, repr=False)
    # Called with the partitions given up to rebalance, while their leases are still ours
    # in Redis (no longer locally): service/cluster/ownership.py writes their snapshots there.
    before_release: Callable[[list[int]], Awaitable[None]] | None = field(
        default=None, init=False, repr=False
    )

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError(f"partitions={self.partitions} must be at least 1")
        if not 0.1 <= self.ttl_s <= 3600:
            raise ValueError(f"lease ttl_s={self.ttl_s} must be within 0.1..3600 seconds")
        if not 0.1 <= self.safety < 1.0:
            raise ValueError(f"lease safety={self.safety} must be within 0.1..1 (below 1)")
        if self.renew_s is None:
            self.renew_s = self.ttl_s / 3
        if not 0 < self.renew_s < self.ttl_s * self.safety:
            raise ValueError(
                f"lease renew_s={self.renew_s} must be positive and below ttl_s * safety"
                f" ({self.ttl_s * self.safety:g}), or leases would lapse between renewals"
            )
        if not self.token:
            self.token = f"{self.owner}/{uuid.uuid4().hex[:12]}"

    @property
    def ttl_ms(self) -> int:
        return max(1, round(self.ttl_s * 1000))

    @property
    def takeover_s(self) -> float:
        """The longest a dead replica's partitions stay unowned, given ticks this often."""
        assert self.renew_s is not None
        return self.ttl_s + self.renew_s

    def owns(self, partition: int, for_s: float = 0.0) -> bool:
        """Whether this replica may process and commit ``partition`` now, and still will in
        ``for_s`` seconds (a commit that may take that long must not outlive the lease)."""
        held = self._held.get(partition)
        return held is not None and self.clock() + for_s < held.deadline

    def owned(self) -> frozenset[int]:
        now = self.clock()
        return frozenset(p for p, h in self._held.items() if now < h.deadline)

    def _expire_local(self) -> set[int]:
        """Drop the leases whose local deadline passed: they are no longer ours to use (the
        next round tries to renew them, as new ones)."""
        now = self.clock()
        gone = {p for p, h in self._held.items() if now >= h.deadline}
        for p in gone:
            del self._held[p]
        self._lapsed |= gone
        return gone

    async def tick(self, *, force: bool = False) -> LeaseChange:
        """Renew, acquire up to the fair share, release above it; at most once every
        ``renew_s`` unless ``force``. Never raises for Redis being unreachable: the leases
        then lapse locally, on time, and the change says so (``error``)."""
        assert self.renew_s is not None
        lapsed = self._expire_local()
        start = self.clock()
        if not force and not lapsed and start - self._last_tick < self.renew_s:
            return LeaseChange(owned=self.owned())
        self._last_tick = start
        try:
            acquired, lost, released = await self._round(start)
        except (RedisError, OSError) as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                # redis-py can turn a cancellation into a ConnectionError: still stop
                raise asyncio.CancelledError() from exc
            log.warning("partition leases: Redis unavailable (%s); leases lapse locally", exc)
            return LeaseChange(lost=frozenset(lapsed), owned=self.owned(), error=str(exc))
        if acquired or lost:
            log.info(
                "partition leases of %s: acquired %s, lost %s (released %s); own %s of %d,"
                " %d replicas live",
                self.token,
                sorted(acquired),
                sorted(lost),
                sorted(released),
                sorted(self._held),
                self.partitions,
                self._live,
            )
        return LeaseChange(
            acquired=frozenset(acquired),
            lost=frozenset(lost | lapsed),
            released=frozenset(released),
            owned=self.owned(),
        )

    async def _round(self, start: float) -> tuple[set[int], set[int], set[int]]:
        """One tick's round trips: heartbeat, renewals and a look at every lease; then
        acquisitions and releases."""
        lapsed = set(self._lapsed)
        # A lease that lapsed locally is renewed if it is still ours, but counts as new.
        renewing = sorted(self._held) + sorted(lapsed)
        pipe = self.client.pipeline(transaction=False)
        pipe.eval(HEARTBEAT, 1, replicas_key(self.prefix), self.token, self.ttl_ms)
        for p in renewing:
            pipe.eval(RENEW, 1, lease_key(self.prefix, p), self.token, self.ttl_ms)
        for p in range(self.partitions):
            pipe.exists(lease_key(self.prefix, p))
        # Replies one by one: under maxmemory the heartbeat's ZADD is refused while the
        # renewals (PEXPIRE) still work, and that must not cost the leases.
        replies: list[Any] = await pipe.execute(raise_on_error=False)
        for reply in replies[1:]:
            if isinstance(reply, Exception):
                raise reply
        if not isinstance(replies[0], Exception):
            self._live = max(1, int(replies[0]))
        renewed = replies[1 : 1 + len(renewing)]
        taken = replies[1 + len(renewing) :]
        self._lapsed -= lapsed
        deadline = start + self.ttl_s * self.safety
        lost: set[int] = set()
        acquired: set[int] = set()
        for p, ok in zip(renewing, renewed, strict=True):
            if not ok:
                self._held.pop(p, None)
                if p not in lapsed:
                    lost.add(p)
            elif p in lapsed:
                self._held[p] = _Held(deadline)
                acquired.add(p)  # still ours in Redis, but the loop must start it afresh
            else:
                self._held[p].deadline = deadline
        share = math.ceil(self.partitions / self._live)
        released = await self._rebalance(share, [p for p, t in enumerate(taken) if not t], acquired)
        lost |= released
        return acquired, lost, released

    async def _rebalance(self, share: int, free: list[int], acquired: set[int]) -> set[int]:
        """Take free partitions up to ``share``, give back those above it."""
        want = share - len(self._held)
        released: set[int] = set()
        if want > 0 and free:
            # Start the scan at a place of our own, so replicas do not all race for one key.
            offset = zlib.crc32(self.token.encode()) % self.partitions
            free.sort(key=lambda p: (p - offset) % self.partitions)
            candidates = free[:want]
            start = self.clock()
            try:
                pipe = self.client.pipeline(transaction=False)
                for p in candidates:
                    pipe.set(lease_key(self.prefix, p), self.token, nx=True, px=self.ttl_ms)
                replies = await pipe.execute()
            except (RedisError, OSError) as exc:
                # What the renewals changed still stands and is reported; a lease set but
                # not answered is simply not ours, and expires.
                log.warning("partition leases: could not acquire %s (%s)", candidates, exc)
                return released
            deadline = start + self.ttl_s * self.safety
            for p, ok in zip(candidates, replies, strict=True):
                if ok:
                    self._held[p] = _Held(deadline)
                    acquired.add(p)
        elif want < 0:
            extras = sorted(self._held, reverse=True)[:-want]
            for p in extras:
                del self._held[p]  # not ours from here on, whatever Redis answers
            released.update(extras)
            acquired.difference_update(extras)
            if self.before_release is not None:
                try:
                    await self.before_release(extras)
                except Exception as exc:  # the hand-over is a courtesy; the release is not
                    log.warning("partitions %s: hand-over before release failed (%s)", extras, exc)
            await self._release(extras)
        return released

    async def _release(self, partitions: Iterable[int]) -> None:
        """Delete our leases on ``partitions``; on a Redis error they just expire."""
        try:
            pipe = self.client.pipeline(transaction=False)
            for p in partitions:
                pipe.eval(RELEASE, 1, lease_key(self.prefix, p), self.token)
            await pipe.execute()
        except (RedisError, OSError) as exc:
            log.warning(
                "could not release partition leases (%s); they expire in %gs", exc, self.ttl_s
            )

    async def release_all(self) -> frozenset[int]:
        """On a clean shutdown, after the last batch is committed: every lease and the
        heartbeat go at once, so the other replicas take over at their next renew. Returns
        the partitions given up; Redis errors are logged (the leases then just expire)."""
        held = frozenset(self._held)
        self._held.clear()
        self._lapsed.clear()
        await self._release(held)
        try:
            await answer_async(self.client.eval(LEAVE, 1, replicas_key(self.prefix), self.token))
        except (RedisError, OSError) as exc:
            log.warning(
                "could not leave the replica set (%s); it forgets us in %gs", exc, self.ttl_s
            )
        return held


@dataclass
class StaticPartitions:
    """Fixed partitions (``OOMCAST_PARTITIONS_OWNED``): the same interface as
    ``PartitionLeases``, without leases. The first ``tick()`` reports them all acquired."""

    partitions: frozenset[int]
    _started: bool = field(default=False, init=False, repr=False)

    def owns(self, partition: int, for_s: float = 0.0) -> bool:
        return partition in self.partitions

    def owned(self) -> frozenset[int]:
        return self.partitions

    async def tick(self, *, force: bool = False) -> LeaseChange:
        if self._started:
            return LeaseChange(owned=self.partitions)
        self._started = True
        return LeaseChange(acquired=self.partitions, owned=self.partitions)

    async def release_all(self) -> frozenset[int]:
        return frozenset()


class PartitionOwner(Protocol):
    """What the ingest loop needs of either kind of ownership."""

    def owns(self, partition: int, for_s: float = 0.0) -> bool: ...

    def owned(self) -> frozenset[int]: ...

    async def tick(self, *, force: bool = False) -> LeaseChange: ...

    async def release_all(self) -> frozenset[int]: ...


def partition_owner(settings: Settings, client: aioredis.Redis) -> PartitionOwner:
    """Leases (no ``OOMCAST_PARTITIONS_OWNED``), or the fixed partitions it names."""
    if settings.uses_leases():
        return PartitionLeases(
            client,
            settings.key_prefix,
            settings.partitions,
            settings.consumer_name,
            ttl_s=settings.lease_ttl_s,
        )
    return StaticPartitions(frozenset(settings.owned_partitions()))
