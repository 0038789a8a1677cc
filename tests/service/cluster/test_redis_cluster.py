"""oomcast on a real Redis Cluster (3 primaries, started from redis-server for this module):

- the partition leases, the fenced snapshot writes and every outbox script name keys of one
  hash slot per command (redis-py refuses any other before sending it) and work;
- one ``oomcast serve`` forecasts what node agents write (their writer and a real ``oomcast
  collect`` in cluster mode) and records its alerts;
- two ``oomcast serve`` processes split the partitions by lease, forecast every domain
  exactly once between them, and when one is killed the other takes its partitions over
  and loses nothing.
"""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, cast

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from cluster_support import (
    cluster_prefix,
    devices,
    group_backlog,
    local_cluster,
    nodes_per_partition,
    owned,
    serve_env,
    start_serve_logged,
    tick,
)
from redis.asyncio.cluster import RedisCluster
from support import WebhookReceiver, free_port, oomcast_cmd, wait_until

from oomcast.bench.local_cluster import LocalCluster
from oomcast.collectors.publisher import Entry, StreamPublisher
from oomcast.collectors.redis_connect import connect
from oomcast.model.wire import Keys
from oomcast.service.cluster.leases import PartitionLeases
from oomcast.service.cluster.snapshot import SnapshotStore
from oomcast.service.delivery.outbox import Delivery, Outbox

pytestmark = pytest.mark.slow

cluster = pytest.fixture(scope="module", name="cluster")(local_cluster)
PARTITIONS = 8  # spread over the 3 primaries' slots
TTL_S = 2.0
GROUP = "oomcast-service"
AGENT_ARGS = (
    "collect",
    "--source",
    "sim",
    "--node",
    "sim-node",
    "--gpus",
    "2",
    "--interval",
    "0.2",
)
AGENT_ARGS += ("--metrics-port", "0")


def test_leases_snapshots_and_the_outbox_work_on_a_cluster(cluster: LocalCluster) -> None:
    async def scenario() -> None:
        client = cast(aioredis.Redis, RedisCluster.from_url(cluster.url))
        prefix = cluster_prefix()
        a, b = (PartitionLeases(client, prefix, PARTITIONS, n, ttl_s=TTL_S) for n in "ab")
        await a.tick(force=True)  # alone: every partition
        assert a.owned() == frozenset(range(PARTITIONS))
        await b.tick(force=True)  # a second replica: none free yet
        await a.tick(force=True)  # gives back what is above its share
        await b.tick(force=True)  # and the newcomer takes it
        assert len(a.owned()) == len(b.owned()) == PARTITIONS // 2
        assert not a.owned() & b.owned()

        # snapshot writes are fenced by the partition's lease: two keys, one slot
        store = SnapshotStore(client, prefix)
        pipe = client.pipeline(transaction=False)
        for p in range(PARTITIONS):
            holder, other = (a, b) if p in a.owned() else (b, a)
            store.stage(pipe, p, {("n", f"gpu{p}"): b"ours"}, lease_token=holder.token)
            store.stage(pipe, p, {("n", f"gpu{p}"): b"stale"}, lease_token=other.token)
            store.drop(pipe, p, [("n", "gone")], lease_token=holder.token)
        assert await pipe.execute() == [1, 0, 1] * PARTITIONS
        for p in range(PARTITIONS):
            assert [v for _, v in await store.load(p)] == [b"ours"]
        # many domains: one script per chunk of 500, the lease checked in each
        holder = a if 0 in a.owned() else b
        many = {("n", f"cgroup:/{i}"): b"%d" % i for i in range(1200)}
        pipe = client.pipeline(transaction=False)
        queued = store.stage(pipe, 0, many, lease_token=holder.token)
        queued += store.drop(pipe, 0, list(many)[:700], lease_token=holder.token)
        assert await pipe.execute() == [1] * queued == [1] * 5
        assert sorted(v for _, v in await store.load(0)) == sorted(
            [b"ours", *list(many.values())[700:]]
        )

        # the outbox: every key of a target and each delivery's order queue share {o}
        outbox = Outbox(client, Keys(prefix, PARTITIONS))
        owed = [Delivery(f"d{i}", "webhook", f"n/gpu{i}", {"i": i}, 1.0) for i in range(3)]
        assert await outbox.put(owed, time.time()) == 3
        held = await outbox.claim("webhook", time.time(), claim_s=30, limit=10, worker="w")
        assert sorted(c.delivery.id for c in held) == ["d0", "d1", "d2"]
        assert await outbox.reschedule(held[0], time.time())
        assert all([await outbox.finish(c.delivery, time.time()) for c in held])
        outbox.targets = ["webhook"]
        assert (await outbox.health(time.time())).targets["webhook"].owed == 0

        assert await a.release_all() and await b.release_all()
        await client.aclose()

    asyncio.run(scenario())


def alert_records(client: redis.RedisCluster, keys: Keys) -> list[dict[str, Any]]:
    return [json.loads(f[b"alert"]) for _, f in client.xrange(keys.alerts)]


def test_one_service_forecasts_what_agents_write_and_records_its_alerts(
    cluster: LocalCluster, tmp_path: Path, webhook_receiver: WebhookReceiver
) -> None:
    keys = Keys(cluster_prefix(), PARTITIONS)
    env = serve_env(
        cluster,
        keys.prefix,
        PARTITIONS,
        OOMCAST_CONSUMER_NAME="solo",
        OOMCAST_LEASE_TTL_S=str(TTL_S),
        OOMCAST_FORECASTER="threshold_0.90",
        OOMCAST_ALERT_FIRE_AFTER="1",
        OOMCAST_WEBHOOK_URL=webhook_receiver.url,
        OOMCAST_WEBHOOK_SECRET="k",
    )
    port = free_port()
    proc = start_serve_logged(env, port, tmp_path / "serve.log")
    agent = None
    try:
        # the agents' writer, on the agents' cluster client: one node in each partition
        nodes = [names[0] for names in nodes_per_partition(keys, 1).values()]
        writer = StreamPublisher(
            connect(cluster.url, cluster=True, connect_timeout_s=1, timeout_s=5)
        )
        t = time.time()
        ticks = [Entry(keys.samples_for(n), tick(n, 2, 0.95, t), 2) for n in nodes]
        assert writer.publish(ticks), writer.stats
        # and a real agent in cluster mode, whose simulated GPUs the service forecasts too
        with (tmp_path / "agent.log").open("wb") as log:
            agent = subprocess.Popen(
                oomcast_cmd(*AGENT_ARGS),
                env=env,
                stdout=log,
                stderr=log,
            )
        wanted = {(n, f"gpu{g}") for n in [*nodes, "sim-node"] for g in range(2)}
        assert wait_until(lambda: {(d["node"], d["device"]) for d in devices(port)} >= wanted, 30)

        client = cluster.client()

        def fired() -> set[str]:
            return {
                r["node"]
                for r in alert_records(client, keys)
                if r.get("status") == "firing" and r.get("rule_name")
            }

        assert wait_until(lambda: fired() >= set(nodes), 20), fired()

        # and their webhooks, owed in the outbox (one slot) with the records, then delivered
        def paged() -> set[str]:
            return {r["json"]["node"] for r in list(webhook_receiver.requests)}

        assert wait_until(lambda: paged() >= set(nodes), 20), paged()
        assert agent.poll() is None, (tmp_path / "agent.log").read_text()
    finally:
        if agent is not None:
            agent.kill()
            agent.wait(10)
        proc.kill()
        proc.wait(10)


@pytest.fixture
def replicas(cluster: LocalCluster, tmp_path: Path) -> Iterator[tuple[Keys, dict[str, Any]]]:
    keys = Keys(cluster_prefix(), PARTITIONS)
    started: dict[str, Any] = {}
    try:
        for name in ("replica-a", "replica-b"):
            env = serve_env(
                cluster,
                keys.prefix,
                PARTITIONS,
                OOMCAST_CONSUMER_NAME=name,
                OOMCAST_LEASE_TTL_S=str(TTL_S),
                OOMCAST_SNAPSHOT_EVERY_S="0.5",
            )
            port = free_port()
            started[name] = (start_serve_logged(env, port, tmp_path / f"{name}.log"), port)
        yield keys, started
    finally:
        for proc, _ in started.values():
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


def by_domain(port: int) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["node"], d["device"]): d for d in devices(port)}


def test_two_services_split_the_partitions_forecast_each_domain_once_and_take_over(
    cluster: LocalCluster, replicas: tuple[Keys, dict[str, Any]]
) -> None:
    keys, started = replicas
    (proc_a, port_a), (_, port_b) = started["replica-a"], started["replica-b"]
    share = PARTITIONS // 2
    assert wait_until(lambda: len(owned(port_a)) == len(owned(port_b)) == share, 30)
    parts_a, parts_b = set(owned(port_a)), set(owned(port_b))
    assert not parts_a & parts_b and parts_a | parts_b == set(range(PARTITIONS))

    nodes = [n for names in nodes_per_partition(keys, 3).values() for n in names]
    domains = {(n, f"gpu{g}") for n in nodes for g in range(2)}
    writer = StreamPublisher(connect(cluster.url, cluster=True, connect_timeout_s=1, timeout_s=5))
    t0 = time.time()

    def write(first: int, count: int) -> float:
        for i in range(first, first + count):
            ticks = [Entry(keys.samples_for(n), tick(n, 2, 0.5, t0 + i), 2) for n in nodes]
            assert writer.publish(ticks), writer.stats
        return t0 + first + count - 1

    last = write(0, 5)

    def forecast_by_both() -> bool:
        seen = [by_domain(port_a), by_domain(port_b)]
        return set(seen[0]) | set(seen[1]) == domains and all(
            d["observed_at"] == last for s in seen for d in s.values()
        )

    assert wait_until(forecast_by_both, 30)
    view_a, view_b = by_domain(port_a), by_domain(port_b)
    assert not set(view_a) & set(view_b)  # each domain forecast by one replica ...
    assert all(d["samples_seen"] == 5 for d in [*view_a.values(), *view_b.values()])  # ... once
    assert {keys.partition_of(n) for n, _ in view_a} == parts_a  # its own partitions' domains
    assert {keys.partition_of(n) for n, _ in view_b} == parts_b

    # A dies without handing over: B takes its partitions, with their domains' state
    proc_a.send_signal(signal.SIGKILL)
    proc_a.wait(10)
    assert wait_until(lambda: len(owned(port_b)) == PARTITIONS, 30)
    last = write(5, 5)

    def b_has_everything() -> bool:
        view = by_domain(port_b)
        return set(view) == domains and all(d["observed_at"] == last for d in view.values())

    assert wait_until(b_has_everything, 30)
    client = cluster.client()
    assert wait_until(lambda: group_backlog(client, keys, GROUP) == (0, 0), 10)  # nothing lost
    view_b = by_domain(port_b)
    for domain in view_a:  # restored from A's snapshots: a cold start would have seen 5
        assert view_b[domain]["samples_seen"] > 5, view_b[domain]
    for domain in set(view_b) - set(view_a):
        assert view_b[domain]["samples_seen"] == 10


def test_a_primary_lost_with_its_data_pauses_ingest_then_it_resumes(tmp_path: Path) -> None:
    own = LocalCluster(tmp_path / "cluster").start()  # this one loses a node: not shared
    keys = Keys(cluster_prefix(), PARTITIONS)
    env = serve_env(own, keys.prefix, PARTITIONS, OOMCAST_LEASE_TTL_S=str(TTL_S))
    port, log = free_port(), tmp_path / "serve.log"
    proc = start_serve_logged(env, port, log)
    try:
        assert wait_until(lambda: len(owned(port)) == PARTITIONS, 30)
        nodes = [names[0] for names in nodes_per_partition(keys, 1).values()]
        writer = StreamPublisher(connect(own.url, cluster=True, connect_timeout_s=0.5, timeout_s=2))
        t0 = time.time()

        def write(i: int) -> None:
            writer.publish([Entry(keys.samples_for(n), tick(n, 1, 0.5, t0 + i), 1) for n in nodes])

        def all_seen(i: int) -> bool:
            view = devices(port)
            return len(view) == len(nodes) and all(d["observed_at"] == t0 + i for d in view)

        write(0)
        assert wait_until(lambda: all_seen(0), 20)
        own.kill(0)  # the node the URL names, with the slots of some partitions
        # the leases on it cannot be renewed: the service stops owning rather than guess
        assert wait_until(lambda: owned(port) == [], 20)
        write(1)  # the agent buffers what it cannot write
        # down long enough for the ingest loop's retries to wait longer than a lease lives
        # (5 s, 0.8 x 2 s): it comes back to no lease and must find them, and the groups, anew
        assert wait_until(lambda: "retrying in 5.0s" in log.read_text(), 30)
        own.restart(0)  # back without its data: its streams and their groups are gone
        for i in (2, 3):
            write(i)
        assert writer.buffered_samples == 0, writer.stats
        assert wait_until(lambda: all_seen(3), 40), devices(port)
        assert wait_until(lambda: group_backlog(own.client(), keys, GROUP) == (0, 0), 10)
    finally:
        proc.kill()
        proc.wait(10)
        own.stop()


def test_a_post_of_samples_of_several_partitions_is_taken_on_a_cluster(
    cluster: LocalCluster, tmp_path: Path
) -> None:
    """A transaction cannot span hash slots: the route writes one per partition."""
    keys = Keys(cluster_prefix(), PARTITIONS)
    env = serve_env(cluster, keys.prefix, PARTITIONS, OOMCAST_LEASE_TTL_S=str(TTL_S))
    port = free_port()
    proc = start_serve_logged(env, port, tmp_path / "serve.log")
    try:
        nodes = [names[0] for names in nodes_per_partition(keys, 1).values()]  # all partitions
        t = time.time()
        body = {
            "samples": [
                {"ts": t, "node": n, "device": "gpu0", "kind": "gpu"}
                | {"total_bytes": 80 << 30, "used_bytes": 40 << 30}
                for n in nodes
            ]
        }
        resp = httpx.post(f"http://127.0.0.1:{port}/v1/samples", json=body, timeout=10)
        assert resp.status_code == 202, resp.text
        assert resp.json()["accepted"] == len(nodes) == PARTITIONS
        assert len(resp.json()["entries"]) == PARTITIONS
        client = redis.RedisCluster.from_url(cluster.url)
        assert [client.xlen(keys.samples(p)) for p in range(PARTITIONS)] == [1] * PARTITIONS
        assert wait_until(lambda: {d["node"] for d in devices(port)} == set(nodes), 30)
    finally:
        proc.kill()
        proc.wait(10)
