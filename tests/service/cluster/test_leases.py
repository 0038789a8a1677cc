"""service/cluster/leases.py against real Redis: partitions split fairly between replicas, are taken
over when one dies, handed over at once when one leaves, and are never owned by two at once,
even by a replica that stalls or loses Redis while holding them.

Short leases (1 s) keep the tests quick; ``drive`` ticks the replicas every 20 ms and checks,
between every two ticks, that no partition is owned twice and that a holder's lease is
still its own in Redis."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

import pytest
import redis
import redis.asyncio as aioredis
from support import PrivateRedis

from oomcast.service.cluster.leases import (
    PartitionLeases,
    StaticPartitions,
    lease_key,
    partition_owner,
    replicas_key,
)
from oomcast.service.settings import Settings

P = 4
TTL = 1.0
PACE_S = 0.02  # between two rounds of ticks: the ingest loop ticks between reads


def make(url: str, prefix: str, owner: str, **kw: object) -> PartitionLeases:
    client = aioredis.from_url(url, socket_connect_timeout=0.5, socket_timeout=0.5)
    return PartitionLeases(client, prefix, P, owner, ttl_s=TTL, **kw)  # type: ignore[arg-type]


def assert_exclusive(replicas: Sequence[PartitionLeases], sync: redis.Redis, prefix: str) -> None:
    """No partition owned by two; a holder's lease holds its token in Redis right now."""
    for p in range(P):
        owners = [r for r in replicas if r.owns(p)]
        assert len(owners) <= 1, f"partition {p} owned by {[r.token for r in owners]}"
        if owners:
            value = sync.get(lease_key(prefix, p))
            assert value == owners[0].token.encode(), (
                f"{owners[0].token} trusts partition {p} but Redis holds {value!r}"
            )


async def drive(
    ticking: Sequence[PartitionLeases],
    everyone: Sequence[PartitionLeases],
    sync: redis.Redis,
    prefix: str,
    until: Callable[[], bool],
    timeout_s: float,
) -> float:
    """Tick ``ticking`` until ``until()``, checking exclusivity throughout; the seconds it
    took (AssertionError after ``timeout_s``)."""
    start = time.monotonic()
    while not until():
        assert time.monotonic() - start < timeout_s, "the leases did not settle in time"
        for r in ticking:
            await r.tick()
            assert_exclusive(everyone, sync, prefix)
        await asyncio.sleep(PACE_S)
    return time.monotonic() - start


def counts(*replicas: PartitionLeases) -> list[int]:
    return [len(r.owned()) for r in replicas]


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_two_replicas_split_fairly_and_a_newcomer_gets_work(
    redis_url: str, key_prefix: str
) -> None:
    sync = redis.Redis.from_url(redis_url)

    async def scenario() -> None:
        a, b = make(redis_url, key_prefix, "a"), make(redis_url, key_prefix, "b")
        first = await a.tick()
        assert first.acquired == frozenset(range(P)) and first.owned == first.acquired
        # b starts: a gives up what is above its new fair share, b takes it
        await drive([a, b], [a, b], sync, key_prefix, lambda: counts(a, b) == [2, 2], 5 * TTL)
        assert a.owned().isdisjoint(b.owned())
        # and it stays that way: no flapping over several renewals
        t_end = time.monotonic() + 3 * a.renew_s  # type: ignore[operator]
        while time.monotonic() < t_end:
            for r in (a, b):
                change = await r.tick()
                assert not change.changed, f"{r.token} changed {change} in a steady state"
                assert_exclusive([a, b], sync, key_prefix)
            await asyncio.sleep(PACE_S)
        await a.release_all()
        await b.release_all()

    asyncio.run(scenario())


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_stalled_replica_is_taken_over_and_never_owns_twice(
    redis_url: str, key_prefix: str
) -> None:
    sync = redis.Redis.from_url(redis_url)

    async def scenario() -> None:
        a, b = make(redis_url, key_prefix, "a"), make(redis_url, key_prefix, "b")
        await drive([a, b], [a, b], sync, key_prefix, lambda: counts(a, b) == [2, 2], 5 * TTL)
        mine = a.owned()
        # a stalls (its loop is stuck: it does not tick); b goes on ticking. a stops
        # trusting its leases before they expire in Redis, so b may take them.
        took = await drive([b], [a, b], sync, key_prefix, lambda: counts(b) == [P], 5 * TTL)
        assert took <= b.takeover_s + 2.0, f"takeover took {took:.2f}s"
        assert a.owned() == frozenset()
        # a comes back: its first tick says what it lost; then the two share again
        change = await a.tick()
        assert change.lost == mine and not change.acquired
        await drive([a, b], [a, b], sync, key_prefix, lambda: counts(a, b) == [2, 2], 5 * TTL)
        await a.release_all()
        await b.release_all()

    asyncio.run(scenario())


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_dead_replicas_partitions_are_taken_over_within_the_stated_time(
    redis_url: str, key_prefix: str
) -> None:
    sync = redis.Redis.from_url(redis_url)

    async def scenario() -> None:
        a, b = make(redis_url, key_prefix, "a"), make(redis_url, key_prefix, "b")
        await drive([a, b], [a, b], sync, key_prefix, lambda: counts(a, b) == [2, 2], 5 * TTL)
        await a.tick(force=True)  # its last renewal: it dies right after, releasing nothing
        died = time.monotonic()
        await drive([b], [a, b], sync, key_prefix, lambda: counts(b) == [P], 5 * TTL)
        took = time.monotonic() - died
        # the stated bound: ttl + one renewal interval (+ the pace of this loop)
        assert took <= TTL + b.renew_s + 2.0, f"takeover took {took:.2f}s"  # type: ignore[operator]
        assert took >= TTL * 0.9, "the dead replica's lease was taken before it expired"
        await b.release_all()

    asyncio.run(scenario())


def test_a_clean_release_hands_over_at_once(redis_url: str, key_prefix: str) -> None:
    sync = redis.Redis.from_url(redis_url)

    async def scenario() -> None:
        a, b = make(redis_url, key_prefix, "a"), make(redis_url, key_prefix, "b")
        await drive([a, b], [a, b], sync, key_prefix, lambda: counts(a, b) == [2, 2], 5 * TTL)
        gone = await b.release_all()
        assert len(gone) == 2 and b.owned() == frozenset()
        assert sync.zscore(replicas_key(key_prefix), b.token) is None
        change = await a.tick(force=True)  # its next renewal, whenever that falls due
        assert change.acquired == gone and a.owned() == frozenset(range(P))
        await a.release_all()

    asyncio.run(scenario())


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_replica_that_loses_redis_stops_owning_before_its_leases_expire(
    redis_url: str, key_prefix: str, private_redis: PrivateRedis
) -> None:
    sync = redis.Redis.from_url(redis_url)
    private_redis.stop()  # a Redis this replica's requests now go to: none answers

    async def scenario() -> None:
        a, b = make(redis_url, key_prefix, "a"), make(redis_url, key_prefix, "b")
        assert (await a.tick()).owned == frozenset(range(P))
        a.client = aioredis.from_url(private_redis.url, socket_connect_timeout=0.2)
        seen_error = False

        def a_gave_up() -> bool:
            return not a.owned()

        start = time.monotonic()
        while not a_gave_up():
            assert time.monotonic() - start < 3 * TTL
            change = await a.tick(force=True)
            seen_error = seen_error or change.error is not None
            assert_exclusive([a, b], sync, key_prefix)
            await asyncio.sleep(PACE_S)
        assert seen_error
        # a let go while its leases were still alive in Redis: nobody could have had them
        ttls = [sync.pttl(lease_key(key_prefix, p)) for p in range(P)]
        assert all(t > 0 for t in ttls), f"leases expired in Redis before a let go: {ttls}"
        await drive([b], [a, b], sync, key_prefix, lambda: counts(b) == [P], 5 * TTL)
        await b.release_all()

    asyncio.run(scenario())


def test_a_lease_that_lapsed_locally_is_lost_then_acquired_afresh(
    redis_url: str, key_prefix: str
) -> None:
    """The loop may have skipped a partition while its lease was not trusted: even when the
    lease turns out still ours, the loop must hear of it as lost and acquired."""
    now = [100.0]
    a = make(redis_url, key_prefix, "a", clock=lambda: now[0])

    async def scenario() -> None:
        assert (await a.tick()).owned == frozenset(range(P))
        now[0] += TTL * a.safety  # the loop did not tick in time (no real time passes)
        assert not any(a.owns(p) for p in range(P))
        change = await a.tick()
        assert change.lost == frozenset(range(P)) == change.acquired
        assert a.owned() == frozenset(range(P))
        await a.release_all()

    asyncio.run(scenario())


def test_ticks_between_renewals_cost_no_round_trip(redis_url: str, key_prefix: str) -> None:
    now = [100.0]
    a = make(redis_url, key_prefix, "a", clock=lambda: now[0])

    async def scenario() -> None:
        await a.tick()
        a.client = aioredis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
        now[0] += a.renew_s / 2  # type: ignore[operator]
        change = await a.tick()  # no Redis call: it would fail
        assert change.error is None and change.owned == frozenset(range(P))
        now[0] += a.renew_s  # type: ignore[operator]
        assert (await a.tick()).error is not None

    asyncio.run(scenario())


def test_bad_lease_settings_are_refused_with_the_reason(redis_url: str, key_prefix: str) -> None:
    with pytest.raises(ValueError, match="renew_s"):
        make(redis_url, key_prefix, "a", renew_s=0.9)
    with pytest.raises(ValueError, match="safety"):
        make(redis_url, key_prefix, "a", safety=1.0)


def test_fixed_partitions_need_no_leases(redis_url: str, key_prefix: str) -> None:
    client = aioredis.from_url(redis_url)
    static = partition_owner(Settings(partitions=4, partitions_owned="1-2"), client)
    assert isinstance(static, StaticPartitions)
    leased = partition_owner(Settings(partitions=4, key_prefix=key_prefix), client)
    assert isinstance(leased, PartitionLeases)

    async def scenario() -> None:
        first = await static.tick()
        assert first.acquired == frozenset({1, 2}) and static.owns(1) and not static.owns(0)
        assert not (await static.tick()).changed

    asyncio.run(scenario())
