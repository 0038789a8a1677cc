"""Reading new entries of several partitions' streams: one XREADGROUP on one Redis server;
on a real Redis Cluster (3 primaries) one per stream, all at once, a short block when idle,
and a failed read raised only once the others have ended."""

from __future__ import annotations

import asyncio
import time
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from cluster_support import cluster_prefix, local_cluster
from redis.asyncio.cluster import RedisCluster
from redis.exceptions import ResponseError

from oomcast.bench.local_cluster import LocalCluster
from oomcast.model.text import as_str
from oomcast.model.wire import Keys
from oomcast.service.pipeline.read import CLUSTER_BLOCK_MS, is_cluster, read_new

cluster = pytest.fixture(scope="module", name="cluster")(local_cluster)
GROUP, CONSUMER = "g", "c"
PARTITIONS = 4


async def fill(client: aioredis.Redis, keys: Keys, per_stream: int, group: bool = True) -> None:
    for stream in keys.all_samples():
        if group:
            await client.xgroup_create(stream, GROUP, id="0", mkstream=True)
        for i in range(per_stream):
            await client.xadd(stream, {"i": str(i)})


async def read_all_then_idle(client: aioredis.Redis, keys: Keys) -> None:
    streams = keys.all_samples()
    got = await read_new(client, GROUP, CONSUMER, streams, 2, 1000)
    assert [as_str(s) for s, _ in got] == streams  # every stream, in order
    assert all(len(entries) == 2 for _, entries in got)  # count applies per stream
    got = await read_new(client, GROUP, CONSUMER, streams, 10, 1000)
    assert [len(entries) for _, entries in got] == [1] * PARTITIONS
    t0 = time.monotonic()
    assert await read_new(client, GROUP, CONSUMER, streams, 10, 1000) == []
    return_s = time.monotonic() - t0
    if is_cluster(client):  # blocked briefly, not for the whole second
        assert CLUSTER_BLOCK_MS / 1000 * 0.8 <= return_s < 0.5, return_s
    else:
        assert return_s >= 0.9, return_s


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_one_server_is_read_with_one_blocking_read(redis_url: str, key_prefix: str) -> None:
    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        assert not is_cluster(client)
        keys = Keys(key_prefix, PARTITIONS)
        await fill(client, keys, 3)
        await read_all_then_idle(client, keys)
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_cluster_is_read_stream_by_stream_with_a_short_block(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        client = cast(aioredis.Redis, RedisCluster.from_url(cluster.url))
        assert is_cluster(client)
        keys = Keys(cluster_prefix(), PARTITIONS)
        await fill(client, keys, 3)
        await read_all_then_idle(client, keys)

        # an idle replica still sees a new entry: the next blocking round returns it
        streams = keys.all_samples()
        waiting = asyncio.create_task(read_new(client, GROUP, CONSUMER, streams, 10, 500))
        await client.xadd(streams[2], {"i": "late"})
        got = await waiting or await read_new(client, GROUP, CONSUMER, streams, 10, 500)
        assert [(as_str(s), len(e)) for s, e in got] == [(streams[2], 1)]
        await client.aclose()

    asyncio.run(scenario())


@pytest.mark.slow
def test_a_failed_read_is_raised_after_the_others_delivered(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        client = cast(aioredis.Redis, RedisCluster.from_url(cluster.url))
        keys = Keys(cluster_prefix(), PARTITIONS)
        await fill(client, keys, 2)
        streams = keys.all_samples()
        await client.xgroup_destroy(streams[1], GROUP)  # its read fails: NOGROUP
        with pytest.raises(ResponseError, match="NOGROUP"):
            await read_new(client, GROUP, CONSUMER, streams, 10, 500)
        # the others' entries were delivered: pending to this consumer, read again from 0
        for stream in (streams[0], streams[2], streams[3]):
            pending: Any = await client.xpending(stream, GROUP)
            assert pending["pending"] == 2
        await client.aclose()

    asyncio.run(scenario())
