"""``oomcast bench cluster``: how fast one, then several ``oomcast serve`` replicas drain the
sample streams of a real Redis Cluster between them, splitting the partitions by lease.

The bench starts a local cluster of 3 primaries (``bench/local_cluster.py``) and, for each
replica count N asked for (``--replicas 1,2``), on a key prefix of its own:

1. pre-fills the partitions' streams with ``seconds`` of 10 Hz samples of ``domains`` GPUs,
   written as agents write them (``bench_ingest.Fleet``: one entry per node tick, 8 GPUs a
   node, node-computed embeddings, signed);
2. creates the service's consumer group at the end of each stream, starts N replicas with
   ``OOMCAST_REDIS_CLUSTER`` and waits until they have split the partitions by lease
   (every partition held, none twice), so no replica has read anything yet;
3. rewinds the groups to the start and times until every entry is acknowledged (each
   stream's group: nothing pending, no lag), polling XINFO GROUPS every 50 ms.

``samples_per_s`` is the samples written over that time. ``cpu_pct`` is each replica's CPU
(all threads) over the drain, ``redis_cpu_pct`` the cluster nodes' together, and
``redis_calls_per_sample`` the commands the nodes ran during the drain per sample, less the
bench's own, from INFO commandstats (the commands a script runs count too; ``redis_calls``
has them by command). Every process runs on this machine: the replicas, the cluster's nodes
and the bench share its cores, which bounds what N replicas can show here.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from oomcast.bench.ingest import DRAIN_HZ
from oomcast.bench.load import GPUS_PER_NODE, Fleet, cpu_seconds, group_progress, rss_mb
from oomcast.bench.local_cluster import LocalCluster, LocalClusterError
from oomcast.bench.procs import FaultBenchError, Procs, Service, start_service, wait_until
from oomcast.collectors.streams import stream_fields
from oomcast.model.wire import Keys

GROUP = "oomcast-service"
POLL_S = 0.05
WRITE_CHUNK = 1000  # entries a pipeline while pre-filling
SETTLE_S = 60.0  # how long the replicas may take to split the partitions
# What the bench itself sends while it times a drain (left out of the replicas' calls).
BENCH_COMMANDS = frozenset({"xinfo|groups", "xgroup|setid", "xlen", "info"})


class ClusterBenchError(FaultBenchError):
    """The cluster bench cannot run (no redis-server, a replica that never became ready, a
    drain that never finished); the message says what."""


def parse_replicas(text: str) -> list[int]:
    """ "1,2" -> [1, 2]: the replica counts to measure, each at least 1."""
    try:
        counts = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(
            f"--replicas {text!r}: a comma-separated list of counts, e.g. 1,2"
        ) from None
    if not counts or min(counts) < 1:
        raise ValueError(f"--replicas {text!r}: every count must be at least 1")
    return counts


@dataclass
class Drain:
    """One replica count's run."""

    client: redis.RedisCluster
    keys: Keys
    procs: Procs
    env: dict[str, str]
    replicas: list[Service]


def prefill(
    client: redis.RedisCluster, keys: Keys, fleet: Fleet, seconds: float
) -> tuple[int, int]:
    """Write ``seconds`` of 10 Hz ticks of every node; (samples, entries) written."""
    ticks = max(1, round(seconds * DRAIN_HZ))
    start = time.time() - ticks / DRAIN_HZ
    samples = entries = 0
    for t in range(ticks):
        nodes = range(len(fleet.nodes))
        for first in range(0, len(nodes), WRITE_CHUNK):
            pipe: Any = client.pipeline(transaction=False)  # type: ignore[no-untyped-call]
            for i in nodes[first : first + WRITE_CHUNK]:
                stream = keys.samples_for(fleet.nodes[i])
                pipe.xadd(stream, stream_fields(fleet.entry(i, start + t / DRAIN_HZ)))
                samples += fleet.size(i)
                entries += 1
            pipe.execute()
    return samples, entries


def command_calls(cluster: LocalCluster) -> dict[str, int]:
    """Calls of each command so far, over every node (INFO commandstats; the commands a
    script runs count too)."""
    total: dict[str, int] = {}
    for port in cluster.ports:
        with cluster.node(port) as node:
            stats: Any = node.info("commandstats")
        for name, row in stats.items():
            command = name.removeprefix("cmdstat_")
            total[command] = total.get(command, 0) + int(row["calls"])
    return total


def replicas_calls(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    """What the nodes ran between ``before`` and ``after``, less the bench's own commands
    (its polls, the rewinds, the counting), most called first."""
    delta = {k: n - before.get(k, 0) for k, n in after.items() if k not in BENCH_COMMANDS}
    return dict(sorted(((k, n) for k, n in delta.items() if n > 0), key=lambda kv: -kv[1]))


def split(drain: Drain) -> bool:
    """Whether the replicas hold every partition between them, none twice, each its share
    (the leases give each ``ceil(partitions / replicas)`` at most, so at least the floor)."""
    held: list[int] = []
    share = drain.keys.partitions // len(drain.replicas)
    for svc in drain.replicas:
        body = svc.readyz()
        if body is None or len(body.get("partitions") or []) < share:
            return False
        held += body["partitions"]
    return sorted(held) == list(range(drain.keys.partitions))


@contextmanager
def fresh_prefix(
    cluster: LocalCluster, client: redis.RedisCluster, partitions: int, secret: str
) -> Iterator[Drain]:
    """Room for replicas on a fresh prefix of ``cluster``; they and their keys go on the way out."""
    logs = Path(tempfile.mkdtemp(prefix="oomcast-bench-cluster-"))
    procs = Procs(logs)
    keys = Keys(f"bench-{secrets.token_hex(4)}", partitions)
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
    env.update(
        OOMCAST_REDIS_URL=cluster.url,
        OOMCAST_REDIS_CLUSTER="1",
        OOMCAST_KEY_PREFIX=keys.prefix,
        OOMCAST_PARTITIONS=str(partitions),
        OOMCAST_CONTROL_SECRET=secret,
    )
    try:
        yield Drain(client, keys, procs, env, [])
    except ClusterBenchError:
        raise
    except FaultBenchError as exc:
        raise ClusterBenchError(f"{exc}; logs were in {logs}") from None
    finally:
        procs.close()
        shutil.rmtree(logs, ignore_errors=True)
        client.flushall(target_nodes=redis.RedisCluster.PRIMARIES)


def drain_with(
    cluster: LocalCluster,
    client: redis.RedisCluster,
    n: int,
    domains: int,
    seconds: float,
    partitions: int,
    timeout_s: float,
) -> dict[str, Any]:
    """Pre-fill, start ``n`` replicas, wait for their split, rewind and time the drain."""
    secret = secrets.token_hex(16)
    with fresh_prefix(cluster, client, partitions, secret) as run:
        samples, entries = prefill(client, run.keys, Fleet(domains, secret), seconds)
        streams = run.keys.all_samples()
        for stream in streams:
            client.xgroup_create(stream, GROUP, id="$", mkstream=True)
        for i in range(n):
            env = {**run.env, "OOMCAST_CONSUMER_NAME": f"replica-{i}"}
            run.replicas.append(start_service(run.procs, f"replica-{i}", env))
        if not wait_until(lambda: split(run), SETTLE_S):
            raise ClusterBenchError(
                f"{n} replicas did not split the partitions in {SETTLE_S:.0f} s"
            )
        rss_start = [rss_mb(s.pid) for s in run.replicas]
        pids = [*(s.pid for s in run.replicas), *cluster.pids]
        cpu0 = [cpu_seconds(pid) for pid in pids]
        calls0 = command_calls(cluster)
        t0 = time.monotonic()
        for stream in streams:
            client.xgroup_setid(stream, GROUP, "0", entries_read=0)
        while True:
            now = time.monotonic()
            cpu = [cpu_seconds(pid) for pid in pids]
            _, pending, unread = group_progress(client, streams, GROUP)
            if pending == 0 and unread == 0:
                break
            if now - t0 > timeout_s or not all(s.alive() for s in run.replicas):
                raise ClusterBenchError(
                    f"{n} replicas left {pending} entries pending and {unread} unread after"
                    f" {now - t0:.0f} s"
                    + ("" if all(s.alive() for s in run.replicas) else "; one died")
                )
            time.sleep(POLL_S)
        wall = max(now - t0, 1e-6)
        calls = replicas_calls(calls0, command_calls(cluster))
        used = [round(100 * (c - c0) / wall, 1) for c, c0 in zip(cpu, cpu0, strict=True)]
        held = {s.name: (s.readyz() or {}).get("partitions") for s in run.replicas}
        return {
            "replicas": n,
            "samples_written": samples,
            "entries_written": entries,
            "drain_s": round(wall, 3),
            "samples_per_s": round(samples / wall),
            "cpu_pct": used[:n],
            "redis_cpu_pct": round(sum(used[n:]), 1),
            "redis_calls_per_sample": round(sum(calls.values()) / samples, 4),
            "redis_calls": calls,
            "partitions_held": held,
            "rss_mb_start": rss_start,
            "rss_mb_end": [rss_mb(s.pid) for s in run.replicas],
        }


def bench_cluster(
    domains: int,
    seconds: float,
    counts: Sequence[int] = (1, 2),
    partitions: int = 4,
    timeout_s: float = 600.0,
) -> dict[str, Any]:
    """Drain the same load with each replica count in ``counts`` (module docstring)."""
    if domains < 1 or seconds <= 0 or partitions < 1 or not counts or min(counts) < 1:
        raise ValueError(
            f"bench cluster: --domains ({domains}), --partitions ({partitions}) and every"
            f" --replicas count ({list(counts)}) must be at least 1, --seconds ({seconds:g})"
            " positive"
        )
    runs = []
    tmp = Path(tempfile.mkdtemp(prefix="oomcast-bench-cluster-nodes-"))
    try:
        with LocalCluster(tmp) as cluster:
            client = cluster.client()
            for n in counts:
                run = drain_with(cluster, client, n, domains, seconds, partitions, timeout_s)
                runs.append(run)
            client.close()
    except LocalClusterError as exc:
        raise ClusterBenchError(str(exc)) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    by_count = {str(r["replicas"]): r for r in runs}
    out: dict[str, Any] = {
        "mode": "drain",
        "cluster_primaries": cluster.masters,
        "partitions": partitions,
        "domains": domains,
        "gpus_per_node": GPUS_PER_NODE,
        "seconds_prefilled": max(1, round(seconds * DRAIN_HZ)) / DRAIN_HZ,
        "cores": os.cpu_count(),
        "samples_per_s": {k: r["samples_per_s"] for k, r in by_count.items()},
        "runs": runs,
        "note": "replicas, cluster nodes and the bench (the producer) share this machine's"
        " cores: on few cores more replicas are bounded by the cores, not by oomcast",
    }
    if "1" in by_count:
        one = by_count["1"]["samples_per_s"]
        out["speedup_vs_1"] = {k: round(r["samples_per_s"] / one, 2) for k, r in by_count.items()}
    return out
