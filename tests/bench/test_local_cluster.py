"""The local Redis Cluster the bench and the tests start: 3 primaries that agree on every
slot, gone when stopped; a clear refusal where the Redis binaries are missing."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from oomcast.bench.local_cluster import LocalCluster, LocalClusterError


def test_missing_binaries_are_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(LocalClusterError, match="redis-server and redis-cli not on PATH"):
        LocalCluster(tmp_path).start()
    with pytest.raises(ValueError, match="at least 3"):
        LocalCluster(tmp_path, masters=2)


@pytest.mark.slow
def test_three_primaries_serve_every_slot_until_stopped(tmp_path: Path) -> None:
    with LocalCluster(tmp_path) as cluster:
        client = cluster.client()
        primaries = client.get_primaries()
        assert len(primaries) == 3
        for i in range(30):  # keys land on every primary and are read back through any
            client.set(f"k:{{{i}}}", i)
        assert [int(client.get(f"k:{{{i}}}")) for i in range(30)] == list(range(30))
        counts = [client.dbsize(target_nodes=node) for node in primaries]
        assert all(n > 0 for n in counts) and sum(counts) == 30
        ports = list(cluster.ports)
        client.close()
    for port in ports:
        with pytest.raises(redis.ConnectionError):
            redis.Redis(port=port, socket_connect_timeout=0.5).ping()
