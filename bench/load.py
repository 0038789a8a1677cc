"""The load and the readings of ``oomcast bench ingest`` (``bench/ingest.py``): a
simulated fleet that writes what node agents write, and what the bench reads of a service
(its CPU and RSS from ``/proc``, its latency histogram) and of Redis (a consumer group's
progress)."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from oomcast.bench.procs import read_status
from oomcast.model.control import node_key
from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState
from oomcast.model.schema import Sample
from oomcast.model.text import as_str
from oomcast.model.wire import answer, encode_samples, sample_payload

GPUS_PER_NODE = 8
GIB = 1 << 30
TOTAL_BYTES = 80 * GIB
LATENCY = "oomcast_forecast_latency_seconds"


@dataclass
class _Gpu:
    device: str
    used: float  # fraction of capacity
    drift: float  # per second
    emb: EmbeddingState = field(default_factory=EmbeddingState)


class Fleet:
    """Simulated nodes of 8 GPUs whose memory drifts; ``entry(node, ts)`` is the stream
    entry that node's agent would write at ``ts`` (embeddings computed and signed here)."""

    def __init__(self, domains: int, secret: str, seed: int = 0) -> None:
        rng = random.Random(seed)
        self.nodes: list[str] = []
        self.gpus: list[list[_Gpu]] = []
        self.keys: list[str] = []
        for i in range(math.ceil(domains / GPUS_PER_NODE)):
            name = f"bench-node-{i:05d}"
            n = min(GPUS_PER_NODE, domains - i * GPUS_PER_NODE)
            self.nodes.append(name)
            self.keys.append(node_key(secret, name))
            self.gpus.append(
                [
                    _Gpu(f"gpu{g}", rng.uniform(0.2, 0.6), rng.uniform(-0.002, 0.004))
                    for g in range(n)
                ]
            )
        self.domains = domains
        self._last: dict[int, float] = {}

    def entry(self, i: int, ts: float) -> dict[str, str]:
        node = self.nodes[i]
        dt = ts - self._last.get(i, ts - 0.1)
        self._last[i] = ts
        payloads: list[dict[str, object]] = []
        for gpu in self.gpus[i]:
            gpu.used += gpu.drift * dt
            if not 0.05 < gpu.used < 0.97:  # a job ended, or was restarted smaller
                gpu.used, gpu.drift = 0.3, -gpu.drift
            used = int(gpu.used * TOTAL_BYTES)
            sample = Sample(
                ts=round(ts, 3), node=node, device=gpu.device, kind="gpu",
                total_bytes=TOTAL_BYTES, used_bytes=used, allocated_bytes=int(used * 0.9),
                reserved_bytes=used, peak_bytes=used, job=f"job-{node}-{gpu.device}",
            )  # fmt: skip
            payloads.append(sample_payload(sample, gpu.emb.embed(sample), EMBEDDING_VERSION))
        return encode_samples(node, payloads, self.keys[i])

    def size(self, i: int) -> int:
        return len(self.gpus[i])


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds, from ``/proc/<pid>/stat``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return float("nan")
    fields = stat.rpartition(")")[2].split()  # after the command name, which may hold spaces
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def rss_mb(pid: int) -> float:
    return round(read_status(pid).get("VmRSS", 0) / 1e6, 1)


def process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the workers of ``serve --workers``), from
    ``/proc/<pid>/task/<tid>/children``."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = list(Path(f"/proc/{p}/task").iterdir())
        except OSError:
            continue
        for task in tasks:
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except (OSError, ValueError):
                continue
    return out


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """The ``q`` quantile of a cumulative histogram ``[(le, count)]`` (``le`` ascending,
    the last +Inf), interpolated linearly within the bucket it falls in, as Prometheus's
    ``histogram_quantile`` does; the top finite bound when it falls in +Inf; None if empty."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lower, below = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lower
            if count == below:
                return le
            return lower + (le - lower) * (rank - below) / (count - below)
        lower, below = le, count
    return lower


def latency_buckets(metrics: dict[str, float]) -> list[tuple[float, float]]:
    out = []
    for name, value in metrics.items():
        if name.startswith(LATENCY + "_bucket{"):
            le = name.partition('le="')[2].partition('"')[0]
            out.append((float(le), value))
    return sorted(out)


def group_progress(
    client: redis.Redis | redis.RedisCluster, streams: list[str], group: str
) -> tuple[int, int, int]:
    """(entries read, pending, lag) of the service's group, summed over the streams; a
    stream without the group yet counts as nothing read."""
    read = pending = lag = 0
    for stream in streams:
        try:
            groups: Any = client.xinfo_groups(stream)
        except redis.ResponseError:
            lag += int(answer(client.xlen(stream)))
            continue
        for g in groups:
            name = as_str(g["name"])
            if name == group:
                entries_read = int(g.get("entries-read") or 0)
                read += entries_read
                pending += int(g["pending"])
                unknown = g.get("lag") is None  # Redis cannot tell: count from the length
                lag += int(answer(client.xlen(stream))) - entries_read if unknown else int(g["lag"])
                break
        else:
            lag += int(answer(client.xlen(stream)))
    return read, pending, lag
