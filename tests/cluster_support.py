"""A real Redis Cluster for the tests: 3 primaries started from the ``redis-server`` binary
(``bench/local_cluster.py`` starts and joins them), and what tests on it share.

A test module takes the cluster as a fixture of its own scope::

    cluster = pytest.fixture(scope="module", name="cluster")(local_cluster)

It is skipped, saying why, where ``redis-server`` or ``redis-cli`` is missing. Tests keep
to a key prefix of their own (``cluster_prefix``), so one cluster serves a whole module.
"""

from __future__ import annotations

import os
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import oomcast_cmd, wait_until

from oomcast.bench.load import group_progress
from oomcast.bench.local_cluster import LocalCluster, LocalClusterError, binaries
from oomcast.model.schema import Sample
from oomcast.model.wire import Keys, encode_samples, sample_payload

GIB = 1 << 30


def local_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    """A started 3-primary cluster, stopped afterwards (wrap it in ``pytest.fixture``)."""
    try:
        binaries()
    except LocalClusterError as exc:
        pytest.skip(str(exc))
    cluster = LocalCluster(tmp_path_factory.mktemp("redis-cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


def cluster_prefix() -> str:
    return f"oomcast-cluster-test-{uuid.uuid4().hex[:10]}"


def serve_env(cluster: LocalCluster, prefix: str, partitions: int, **extra: str) -> dict[str, str]:
    """The environment of an ``oomcast serve`` on ``cluster`` (nothing of this process's own
    ``OOMCAST_*`` settings leaks in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
    env.update(
        OOMCAST_REDIS_URL=cluster.url,
        OOMCAST_REDIS_CLUSTER="1",
        OOMCAST_KEY_PREFIX=prefix,
        OOMCAST_PARTITIONS=str(partitions),
    )
    env.update(extra)
    return env


def nodes_per_partition(keys: Keys, per_partition: int) -> dict[int, list[str]]:
    """Node names, ``per_partition`` of them hashed to each partition."""
    out: dict[int, list[str]] = {p: [] for p in range(keys.partitions)}
    i = 0
    while any(len(names) < per_partition for names in out.values()):
        name = f"cnode-{i}"
        names = out[keys.partition_of(name)]
        if len(names) < per_partition:
            names.append(name)
        i += 1
    return out


def tick(node: str, gpus: int, frac: float, ts: float) -> dict[str, str]:
    """One node tick as an agent writes it: one entry, one sample per GPU."""
    payloads = [
        sample_payload(
            Sample(ts, node, f"gpu{g}", "gpu", 80 * GIB, int(frac * 80 * GIB), job=f"job-{node}"),
            None,
            None,
        )
        for g in range(gpus)
    ]
    return encode_samples(node, payloads)


def devices(port: int) -> list[dict[str, Any]]:
    """Every live domain a service on ``port`` forecasts ([] while it does not answer)."""
    try:
        body = httpx.get(f"http://127.0.0.1:{port}/v1/devices", params={"limit": 1000}).json()
    except (httpx.HTTPError, ValueError):
        return []
    found: list[dict[str, Any]] = body.get("devices", [])
    return found


def start_serve_logged(
    env: dict[str, str], port: int, log: Path, ready_s: float = 60.0
) -> subprocess.Popen[bytes]:
    """``oomcast serve`` as ``support.start_serve`` starts it, its output in ``log`` (for a
    test that waits on what the service says, and to say why one never became ready)."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            oomcast_cmd("serve", "--port", str(port)), env=env, stdout=out, stderr=out
        )
    if not wait_until(lambda: httpx_ok(f"http://127.0.0.1:{port}/readyz"), ready_s):
        proc.kill()
        proc.wait()
        raise AssertionError(f"oomcast serve did not become ready: {log.read_text()[-2000:]}")
    return proc


def httpx_ok(url: str) -> bool:
    try:
        return httpx.get(url).status_code == 200
    except httpx.HTTPError:
        return False


def owned(port: int) -> list[int]:
    """The partitions a service on ``port`` reads ([] while it does not answer)."""
    try:
        parts: list[int] = httpx.get(f"http://127.0.0.1:{port}/readyz").json()["partitions"]
    except (httpx.HTTPError, ValueError, KeyError):
        return []
    return parts


def group_backlog(client: redis.RedisCluster, keys: Keys, group: str) -> tuple[int, int]:
    """(pending, lag) of ``group`` summed over every partition's stream: (0, 0) once every
    entry written was read and acknowledged."""
    _, pending, lag = group_progress(client, keys.all_samples(), group)
    return pending, lag
