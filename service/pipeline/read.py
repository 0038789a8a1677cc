"""Reading new entries of several partitions' sample streams as one consumer of a group.

On one Redis server a single ``XREADGROUP`` names every stream and blocks until any of
them has something. On a Redis Cluster each partition's stream lives in its own hash slot
(the ``{<p>}`` hash tag), usually on another node, and a command may only name keys of one
slot (``CROSSSLOT`` otherwise; redis-py refuses it before sending). There the read is one
``XREADGROUP`` per stream, all sent at once (each to its own node):

1. without blocking: under load every stream answers at once, with up to ``count`` entries;
2. only when every stream came back empty, once more, each blocking for at most
   ``CLUSTER_BLOCK_MS``: a read that blocked for the whole ``block_ms`` would hold up the
   streams that do have entries, since all reads of a round are awaited together.

So an idle replica costs one round of reads per ``CLUSTER_BLOCK_MS``, and a sample that
reaches an idle replica waits at most that long for it to look. Nothing is cancelled: a
read cancelled after Redis delivered its entries would leave them pending unseen until
they are claimed as stale.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from oomcast.service.pipeline.decode import StreamEntries

CLUSTER_BLOCK_MS = 50  # how long an idle replica's reads block, on a Redis Cluster

StreamBatch = tuple[Any, StreamEntries]  # (stream name as Redis gave it, its entries)


def is_cluster(client: object) -> bool:
    """Whether ``client`` talks to a Redis Cluster (see ``service/main.py``)."""
    return isinstance(client, RedisCluster)


async def read_new(
    client: aioredis.Redis,
    group: str,
    consumer: str,
    streams: Sequence[str],
    count: int,
    block_ms: int,
) -> list[StreamBatch]:
    """Entries of ``streams`` never delivered to ``group`` (``>``), up to ``count`` a stream,
    as ``(stream, entries)`` for each stream that had some; waits up to ``block_ms`` (0: not
    at all) for the first when there are none (see the module's doc for a cluster)."""
    if not streams:
        return []
    if not is_cluster(client):
        resp = await client.xreadgroup(  # BLOCK 0 would wait for ever: 0 is no wait here
            group, consumer, dict.fromkeys(streams, ">"), count=count, block=block_ms or None
        )
        return list(resp or [])
    got = await _each(client, group, consumer, streams, count, None)
    if not got and block_ms > 0:
        got = await _each(client, group, consumer, streams, count, min(block_ms, CLUSTER_BLOCK_MS))
    return got


async def _each(
    client: aioredis.Redis,
    group: str,
    consumer: str,
    streams: Sequence[str],
    count: int,
    block_ms: int | None,
) -> list[StreamBatch]:
    """One XREADGROUP per stream, all in flight together, in the order of ``streams``. When
    one fails, its error is raised once every read has ended: what the others delivered is
    then pending to this consumer, and the ingest loop, restarting, reads it again."""
    replies = await asyncio.gather(
        *(
            client.xreadgroup(group, consumer, {stream: ">"}, count=count, block=block_ms)
            for stream in streams
        ),
        return_exceptions=True,
    )
    out: list[StreamBatch] = []
    for resp in replies:
        if isinstance(resp, BaseException):
            raise resp
        for stream, entries in resp or []:
            if entries:
                out.append((stream, entries))
    return out
