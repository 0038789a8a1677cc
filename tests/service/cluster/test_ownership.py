"""service/cluster/ownership.py: a partition's hand-over, as the ingest loop drives it, with real
Redis snapshots: the new owner restores the domains and keeps Alertmanager hearing of the
episodes that were firing; the old owner forgets them and stops re-sending them."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis
from support import sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.wire import Keys
from oomcast.service.cluster.leases import StaticPartitions
from oomcast.service.cluster.ownership import Ownership
from oomcast.service.cluster.snapshot import SnapshotStore
from oomcast.service.pipeline.rules import Rule
from oomcast.service.pipeline.state import LiveState

T0 = 1_750_000_000.0  # in the past: a restored time ahead of the clock is refused


class Receiver:
    """Stands in for AlertmanagerTarget's keep-alive bookkeeping (the HTTP side is
    test_alertmanager.py's)."""

    name = "alertmanager"

    def __init__(self) -> None:
        self.kept: list[dict[str, Any]] = []
        self.forgotten: list[set[tuple[str, str]]] = []

    def keep_alive(self, payload: dict[str, Any]) -> None:
        self.kept.append(payload)

    def forget(self, domains: set[tuple[str, str]]) -> None:
        self.forgotten.append(domains)


def live() -> LiveState:
    rules = [
        Rule("page", ("alertmanager",), 1, 3, horizon_s=60, fire_risk=0.5),
        Rule("hook", ("webhook",), 1, 3, horizon_s=60, fire_risk=0.5),
    ]
    return LiveState(ThresholdBaseline(0.9), rules, horizon_s=60)


def test_the_new_owner_keeps_restored_firing_episodes_alive_and_the_old_one_stops(
    redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix, 1)

    async def go() -> tuple[Receiver, Receiver, Ownership]:
        client = aioredis.from_url(redis_url)
        store = SnapshotStore(client, key_prefix)
        old, new = live(), live()
        fired = old.apply([sample(T0, 0.95, node="n1"), sample(T0, 0.5, node="n2")], T0)
        assert {a.node for a in fired.alerts} == {"n1"}
        mine = Ownership(keys, old, StaticPartitions(frozenset({0})), store)
        theirs = Ownership(keys, new, StaticPartitions(frozenset({0})), store)
        old_am, new_am = Receiver(), Receiver()
        mine.keep_alive_in(old_am)
        theirs.keep_alive_in(new_am)
        snaps = mine.snapshots_for([("n1", "gpu0"), ("n2", "gpu0")], [("n1", "gpu0")])
        pipe = client.pipeline(transaction=False)
        mine.stage(pipe, snaps)
        await pipe.execute()
        assert len((await theirs.restore(0)).states) == 2
        mine.forget([0])
        await client.aclose()
        return old_am, new_am, mine

    old_am, new_am, mine = asyncio.run(go())
    # only the alertmanager rule's firing episode, as a firing alert of the same episode
    assert [(p["node"], p["rule_name"], p["status"]) for p in new_am.kept] == [
        ("n1", "page", "firing")
    ]
    assert new_am.kept[0]["episode"]
    assert old_am.forgotten == [{("n1", "gpu0"), ("n2", "gpu0")}]
    assert mine.live.domains == {}
