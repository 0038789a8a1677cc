"""The node agent's Redis client: one server's, or a Redis Cluster's.

With ``OOMCAST_REDIS_CLUSTER`` the URL names one node of a cluster and the client is a
``redis.RedisCluster``, which asks that node for the others and sends each command to the
node that serves its key's hash slot; a pipeline of entries for several partitions is split
by node and sent to all of them at once. An agent writes one key per command (a partition's
stream, the events stream, its own control stream), so nothing it sends crosses slots.

redis-py connects a cluster client in its constructor, and raises there when no node
answers; a plain client connects on first use. So that an agent started before its Redis
samples and buffers as it does with one server, the cluster client is made on first use
too, and until a node answers every use raises ``redis.ConnectionError``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import redis
from redis.exceptions import RedisClusterException

from oomcast.model.cluster import cluster_url_problem


class LazyCluster:
    """A ``redis.RedisCluster`` made by ``make`` on first use (see the module's doc)."""

    def __init__(self, make: Callable[[], redis.RedisCluster]) -> None:
        self._make = make
        self._client: redis.RedisCluster | None = None

    @property
    def client(self) -> redis.RedisCluster:
        if self._client is None:
            try:
                self._client = self._make()
            except RedisClusterException as exc:  # no startup node answered
                raise redis.ConnectionError(f"no Redis Cluster node answers: {exc}") from exc
        return self._client

    def __getattr__(self, name: str) -> Any:
        return getattr(self.client, name)

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def connect(
    url: str, *, cluster: bool = False, connect_timeout_s: float, timeout_s: float
) -> redis.Redis:
    """A client for ``url``; with ``cluster``, for the Redis Cluster that ``url``'s node
    belongs to. ValueError, saying why, for a URL that cannot name a cluster node. Typed as
    ``Redis``: the cluster client takes the commands an agent sends with the same arguments
    and answers them the same way."""
    if not cluster:
        return redis.Redis.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s
        )
    problem = cluster_url_problem(url)
    if problem:
        raise ValueError(problem)
    lazy = LazyCluster(
        lambda: redis.RedisCluster.from_url(
            url, socket_connect_timeout=connect_timeout_s, socket_timeout=timeout_s
        )
    )
    return cast(redis.Redis, lazy)
