"""The agent's Redis client on a real Redis Cluster (3 primaries): its writer spreads one
flush over the partitions' slots; started before any node answers it samples and buffers,
and a cluster gone away costs it nothing but a retry."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis
from cluster_support import cluster_prefix, local_cluster, tick
from support import free_port

from oomcast.bench.local_cluster import LocalCluster
from oomcast.collectors.publisher import Entry, StreamPublisher
from oomcast.collectors.redis_connect import LazyCluster, connect
from oomcast.model.wire import Keys

cluster = pytest.fixture(scope="module", name="cluster")(local_cluster)


def test_a_url_that_cannot_name_a_cluster_node_is_refused() -> None:
    with pytest.raises(ValueError, match="database '2'"):
        connect("redis://127.0.0.1:7000/2", cluster=True, connect_timeout_s=1, timeout_s=1)
    plain = connect("redis://127.0.0.1:7000/2", connect_timeout_s=1, timeout_s=1)
    assert isinstance(plain, redis.Redis)  # one server has databases: fine


def test_an_agent_started_before_its_cluster_buffers_instead_of_failing() -> None:
    url = f"redis://127.0.0.1:{free_port()}"  # nothing listens there
    client = connect(url, cluster=True, connect_timeout_s=0.2, timeout_s=0.5)
    assert isinstance(client, LazyCluster)  # made on first use, not here
    with pytest.raises(redis.ConnectionError, match="no Redis Cluster node answers"):
        client.ping()
    writer = StreamPublisher(client)
    keys = Keys("unreached")
    assert not writer.publish([Entry(keys.samples_for("n1"), tick("n1", 2, 0.5, 1.0), 2)])
    assert writer.buffered_samples == 2 and writer.stats.publish_errors == 1


@pytest.mark.slow
def test_one_flush_lands_in_every_partitions_stream(cluster: LocalCluster) -> None:
    keys = Keys(cluster_prefix(), 8)
    writer = StreamPublisher(connect(cluster.url, cluster=True, connect_timeout_s=1, timeout_s=5))
    nodes = [f"n{i}" for i in range(40)]
    entries = [Entry(keys.samples_for(n), tick(n, 2, 0.5, 1.0), 2) for n in nodes]
    entries.append(Entry(keys.events, {"event": "{}"}, 1))
    assert writer.publish(entries)
    client = cluster.client()
    per_stream = {s: client.xlen(s) for s in keys.all_samples()}
    expected = {s: sum(keys.samples_for(n) == s for n in nodes) for s in keys.all_samples()}
    assert per_stream == expected and sum(per_stream.values()) == len(nodes)
    assert client.xlen(keys.events) == 1
    assert writer.stats.samples_sent == 2 * len(nodes) + 1


@pytest.mark.slow
def test_a_cluster_gone_away_leaves_samples_buffered(tmp_path: Path) -> None:
    own = LocalCluster(tmp_path).start()
    try:
        writer = StreamPublisher(connect(own.url, cluster=True, connect_timeout_s=0.2, timeout_s=1))
        keys = Keys(cluster_prefix(), 4)
        assert writer.publish([Entry(keys.samples_for("n1"), tick("n1", 2, 0.5, 1.0), 2)])
    finally:
        own.stop()
    # every node gone: redis-py cannot even learn the slots (not a RedisError): buffered
    assert not writer.publish([Entry(keys.samples_for("n2"), tick("n2", 2, 0.5, 2.0), 2)])
    assert writer.buffered_samples == 2 and writer.stats.publish_errors >= 1
