"""``oomcast bench ingest``: how fast one ``oomcast serve`` takes samples in, measured on
real processes (a private ``redis-server`` and the service as a subprocess) and fed the
real wire format: one stream entry per node tick, 8 GPUs per node, each sample carrying
the embedding its node computed, each entry signed with its node's key as agents sign.

Three modes:

- drain (the default): the streams are pre-filled with ``seconds`` of 10 Hz samples for
  ``domains`` GPUs before the service starts; ``samples_per_s`` is how fast it then
  acknowledges them, timed from the first entry it reads to the last it acknowledges
  (from the consumer group's ``entries-read``/``pending``/``lag`` in Redis, so that
  the timing costs the service nothing).
- rate (``rate``): samples are written at ``rate`` samples/s for ``seconds``; p50/p99
  come from the service's own ``oomcast_forecast_latency_seconds`` histogram (arrival in
  Redis to forecast), interpolated within its buckets as Prometheus does.
- soak (``soak``): the rate mode (5,000 samples/s unless given), with the service's RSS
  recorded every 10 s in ``rss_series``.

In every mode ``cpu_pct`` is the service process's CPU (all its threads) over the
measured window, from ``/proc/<pid>/stat``, and ``rss_mb_start``/``rss_mb_end`` its
resident memory before and after, from ``/proc/<pid>/status``.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

from oomcast.bench.load import (
    GPUS_PER_NODE,
    LATENCY,
    Fleet,
    cpu_seconds,
    group_progress,
    histogram_quantile,
    latency_buckets,
    process_tree,
    rss_mb,
)
from oomcast.bench.procs import (
    FaultBenchError,
    Procs,
    RedisServer,
    Service,
    start_service,
    wait_until,
)
from oomcast.collectors.streams import stream_fields
from oomcast.model.wire import Keys

DRAIN_HZ = 10.0
AGENT_MAXLEN = 100_000  # what agents trim each stream to (approximately)
SOAK_DEFAULT_RATE = 5000.0
SOAK_EVERY_S = 10.0
POLL_S = 0.05
SLOT_S = 0.01  # the rate mode writes in slots this long
INGESTED = "oomcast_samples_ingested_total"
DEADLETTERS = "oomcast_deadletters_total"


class IngestBenchError(FaultBenchError):
    """The ingest bench cannot run (no redis-server, a service that never started, a drain
    that never finished); the message says what."""


@dataclass
class Run:
    procs: Procs
    server: RedisServer
    client: redis.Redis
    keys: Keys
    env: dict[str, str]
    fleet: Fleet
    group: str = "oomcast-service"
    replicas: int = 1
    workers: int = 1
    services: list[Service] = field(default_factory=list)

    def start_services(self) -> list[Service]:
        """``replicas`` services of ``workers`` worker processes each; with more than one
        process, each owns a fixed, contiguous share of the partitions (as a StatefulSet
        pins them), so none waits for a lease to move."""
        n, parts = self.replicas, self.keys.partitions
        args = ("--workers", str(self.workers)) if self.workers > 1 else ()
        for k in range(n):
            env = dict(self.env, OOMCAST_CONSUMER_NAME=f"bench-ingest-{k}")
            if n > 1 or self.workers > 1:
                lo, hi = k * parts // n, (k + 1) * parts // n - 1
                env["OOMCAST_PARTITIONS_OWNED"] = f"{lo}-{hi}"
            self.services.append(start_service(self.procs, f"ingest-{k}", env, args))
        return self.services

    def alive(self) -> bool:
        return bool(self.services) and all(s.alive() for s in self.services)

    def pids(self) -> list[int]:
        """Every process of the services: with ``--workers``, the front and its workers."""
        return [p for s in self.services for p in process_tree(s.pid)]

    def cpu_s(self) -> float:
        return sum(cpu_seconds(p) for p in self.pids())

    def rss(self) -> float:
        return round(sum(rss_mb(p) for p in self.pids()), 1)

    def metric(self, name: str) -> float:
        return sum(s.metrics().get(name, 0.0) for s in self.services)

    def latency(self) -> list[tuple[float, float]]:
        """The services' latency histograms, bucket by bucket, summed."""
        total: dict[float, float] = {}
        for s in self.services:
            for le, n in latency_buckets(s.metrics()):
                total[le] = total.get(le, 0.0) + n
        return sorted(total.items())

    def has_group(self, stream: str) -> bool:
        try:
            groups: Any = self.client.xinfo_groups(stream)
        except redis.ResponseError:  # no such stream yet
            return False
        return any(g["name"] in (self.group, self.group.encode()) for g in groups)

    def drained(self) -> bool:
        _, pending, lag = group_progress(self.client, self.keys.all_samples(), self.group)
        return pending == 0 and lag == 0 and self.alive()


@contextmanager
def bench_run(
    domains: int,
    partitions: int,
    replicas: int = 1,
    workers: int = 1,
    shadow_model: str | None = None,
) -> Iterator[Run]:
    """A private Redis, the fleet, and the service's environment; every process and the
    temporary folder gone on the way out."""
    logs = Path(tempfile.mkdtemp(prefix="oomcast-bench-ingest-"))
    procs = Procs(logs)
    try:
        server = RedisServer(procs, logs, persist=False)  # what is timed is oomcast, not the disk
        server.start()
        secret = secrets.token_hex(16)
        keys = Keys(f"bench-{secrets.token_hex(4)}", partitions)
        env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
        env.update(
            OOMCAST_REDIS_URL=server.url,
            OOMCAST_KEY_PREFIX=keys.prefix,
            OOMCAST_PARTITIONS=str(partitions),
            OOMCAST_CONTROL_SECRET=secret,
        )
        if shadow_model:  # a second model scored beside the one that acts
            env["OOMCAST_SHADOW_MODEL_PATH"] = shadow_model
        fleet = Fleet(domains, secret)
        client = server.client()
        yield Run(procs, server, client, keys, env, fleet, replicas=replicas, workers=workers)
    except IngestBenchError:
        raise
    except FaultBenchError as exc:
        raise IngestBenchError(f"{exc}; logs were in {logs}") from None
    finally:
        procs.close()
        shutil.rmtree(logs, ignore_errors=True)


def _entry(run: Run, i: int, ts: float) -> tuple[str, dict[Any, Any]]:
    """Node ``i``'s stream and the entry its agent would write at ``ts``."""
    return run.keys.samples_for(run.fleet.nodes[i]), stream_fields(run.fleet.entry(i, ts))


def _write(run: Run, batch: list[tuple[int, float]], maxlen: int | None) -> int:
    """XADD one entry per (node, ts) in one pipeline, as agents do; samples written."""
    return _write_entries(run, [_entry(run, i, ts) for i, ts in batch], maxlen)


def _write_entries(run: Run, batch: list[tuple[str, dict[Any, Any]]], maxlen: int | None) -> int:
    pipe = run.client.pipeline(transaction=False)
    n = 0
    for stream, fields in batch:
        if maxlen is None:
            pipe.xadd(stream, fields)
        else:
            pipe.xadd(stream, fields, maxlen=maxlen, approximate=True)
        n += int(fields["n"])
    pipe.execute()
    return n


def redis_load(client: redis.Redis) -> tuple[int, float]:
    """Commands Redis has run, and the CPU seconds it has used, since it started."""
    stats: Any = client.info("commandstats")
    cpu: Any = client.info("cpu")
    calls = sum(int(v["calls"]) for v in stats.values() if isinstance(v, dict))
    return calls, float(cpu["used_cpu_user"]) + float(cpu["used_cpu_sys"])


def _redis_figures(
    before: tuple[int, float], after: tuple[int, float], samples: int, wall: float
) -> dict[str, Any]:
    """What the service's side of the work cost Redis: commands per 1,000 samples (the
    pre-filled writes happened before ``before``; the one waking tick and the bench's
    polling are in) and Redis's CPU over the window."""
    calls, cpu = after[0] - before[0], after[1] - before[1]
    return {
        "redis_calls_per_1k_samples": round(1000 * calls / max(samples, 1), 1),
        "redis_cpu_pct": round(100 * cpu / max(wall, 1e-6), 1),
    }


def _common(run: Run, written: int, entries: int) -> dict[str, Any]:
    return {
        "domains": run.fleet.domains,
        "nodes": len(run.fleet.nodes),
        "gpus_per_node": GPUS_PER_NODE,
        "partitions": run.keys.partitions,
        "replicas": run.replicas,
        "workers_per_replica": run.workers,
        "signed": True,
        "entries_written": entries,
        "samples_written": written,
        "samples_ingested": int(run.metric(INGESTED)),
        "samples_ingested_per_replica": [int(s.metrics().get(INGESTED, 0)) for s in run.services],
        "deadletters": int(run.metric(DEADLETTERS)),
    }


def drain(run: Run, seconds: float, timeout_s: float) -> dict[str, Any]:
    """Pre-fill, hold the service off the backlog until it is ready (its group starts at
    the end of each stream), then rewind the group and time the drain."""
    ticks = max(1, round(seconds * DRAIN_HZ))
    start = time.time() - ticks / DRAIN_HZ
    written = entries = 0
    for t in range(ticks):
        batch = [(i, start + t / DRAIN_HZ) for i in range(len(run.fleet.nodes))]
        for k in range(0, len(batch), 1000):
            written += _write(run, batch[k : k + 1000], None)
        entries += len(batch)
    streams = run.keys.all_samples()
    for stream in streams:
        run.client.xgroup_create(stream, run.group, id="$", mkstream=True)
    run.start_services()
    rss_start = run.rss()
    load0 = redis_load(run.client)
    cpu0, t0 = run.cpu_s(), time.monotonic()
    for stream in streams:
        run.client.xgroup_setid(stream, run.group, "0", entries_read=0)
    # one more tick wakes the service's blocked XREADGROUP (a rewind alone does not)
    written += _write(run, [(0, time.time())], None)
    entries += 1
    deadline = t0 + timeout_s
    while True:
        now, cpu = time.monotonic(), run.cpu_s()
        read, pending, lag = group_progress(run.client, streams, run.group)
        if pending == 0 and lag == 0:
            break
        if not run.alive() or now > deadline:
            raise IngestBenchError(
                f"the service acknowledged {read - pending} of {entries} entries in"
                f" {timeout_s:.0f} s" + ("" if run.alive() else " and died (serve-ingest-*.log)")
            )
        time.sleep(POLL_S)
    wall = max(now - t0, 1e-6)
    load1 = redis_load(run.client)
    out: dict[str, Any] = {"mode": "drain", "seconds_prefilled": ticks / DRAIN_HZ}
    out |= _common(run, written, entries)
    out |= {
        "drain_s": round(wall, 3),
        "samples_per_s": round(written / wall),
        "timing_note": f"from the group's rewind to no entry pending or unread, polled"
        f" every {POLL_S * 1000:.0f} ms",
        "cpu_pct": round(100 * (cpu - cpu0) / wall, 1),
        "rss_mb_start": rss_start,
        "rss_mb_end": run.rss(),
        "p50_ms": None,
        "p99_ms": None,
    }
    # the bench's own polling (3 commands a stream every 50 ms) is in these too
    out |= _redis_figures(load0, load1, written, wall)
    return out


PRECOMPUTE_MAX_SAMPLES = 2_000_000  # about 900 MB of entries held in memory, at most


def _slots(rate: float, seconds: float, nodes: int) -> list[list[int]]:
    """Which nodes write in each 10 ms slot: ``rate`` samples/s, nodes in turn."""
    per_slot = rate * SLOT_S / GPUS_PER_NODE  # entries
    owed, cursor, out = 0.0, 0, []
    for _ in range(max(1, round(seconds / SLOT_S))):
        owed += per_slot
        batch = []
        while owed >= 1:
            batch.append(cursor)
            cursor = (cursor + 1) % nodes
            owed -= 1
        out.append(batch)
    return out


@dataclass
class Plan:
    """What the rate mode writes: the nodes of each 10 ms slot, and for a short run the
    entries themselves, made before the clock starts (see ``plan``)."""

    slots: list[list[int]]
    entries: list[list[tuple[str, dict[Any, Any]]]] | None = None

    @property
    def producer(self) -> str:
        return "live" if self.entries is None else "precomputed"


def plan(run: Run, rate: float, seconds: float) -> Plan:
    """``rate`` samples/s for ``seconds``, nodes in turn. A short run's entries are made
    now ("precomputed"): computing the agents' embeddings in this process costs more CPU
    than the service spends on them, and on 2 cores the producer would otherwise be what
    is measured. Their ``ts`` then lags the wall clock by the time that takes (well within
    OOMCAST_MAX_TS_SKEW_S); latency is timed from each entry's arrival in Redis, not from
    its ``ts``. A long run (a soak) makes each entry as it writes it ("live", ``ts`` the
    wall clock)."""
    slots = _slots(rate, seconds, len(run.fleet.nodes))
    if sum(len(b) for b in slots) * GPUS_PER_NODE > PRECOMPUTE_MAX_SAMPLES:
        return Plan(slots)
    t_plan = time.time()
    entries = [[_entry(run, i, t_plan + k * SLOT_S) for i in b] for k, b in enumerate(slots)]
    return Plan(slots, entries)


def produce(
    run: Run, todo: Plan, tick: Callable[[float], None] | None = None
) -> tuple[int, int, float]:
    """Write what ``todo`` holds, one slot every 10 ms; ``tick(elapsed)`` after each slot.
    (samples, entries, seconds it took.)"""
    written = entries = 0
    t0 = time.monotonic()
    for k, batch in enumerate(todo.slots):
        if batch:
            if todo.entries is not None:
                written += _write_entries(run, todo.entries[k], AGENT_MAXLEN)
                todo.entries[k] = []  # let what is written go
            else:
                written += _write(run, [(i, time.time()) for i in batch], AGENT_MAXLEN)
            entries += len(batch)
        if tick is not None:
            tick(time.monotonic() - t0)
        pause = t0 + (k + 1) * SLOT_S - time.monotonic()
        if pause > 0:
            time.sleep(pause)
    return written, entries, time.monotonic() - t0


def rated(run: Run, rate: float, seconds: float, soak: bool, timeout_s: float) -> dict[str, Any]:
    todo = plan(run, rate, seconds)  # before the services start and the clock does
    run.start_services()
    streams = run.keys.all_samples()
    if not wait_until(lambda: all(run.has_group(s) for s in streams), 30):
        raise IngestBenchError("the service did not create its consumer groups in 30 s")
    before = run.latency()
    rss_start, cpu0, t0 = run.rss(), run.cpu_s(), time.monotonic()
    series: list[list[float]] = [[0.0, rss_start]]

    def record(elapsed: float) -> None:
        if soak and elapsed >= len(series) * SOAK_EVERY_S:
            series.append([round(elapsed, 1), run.rss()])

    written, entries, took = produce(run, todo, record)
    backlog = group_progress(run.client, streams, run.group)[2]
    if not wait_until(run.drained, timeout_s):
        raise IngestBenchError(f"the service had not caught up {timeout_s:.0f} s after the run")
    wall = time.monotonic() - t0
    cpu = run.cpu_s() - cpu0
    after = run.latency()
    base = dict(before)
    delta = [(le, n - base.get(le, 0.0)) for le, n in after]
    p50, p99 = histogram_quantile(0.5, delta), histogram_quantile(0.99, delta)
    out: dict[str, Any] = {"mode": "soak" if soak else "rate"}
    out |= _common(run, written, entries)
    out |= {
        "rate_target": rate,
        "producer": todo.producer,
        "rate_achieved": round(written / took),
        "seconds": round(took, 2),
        "backlog_entries_at_end": backlog,
        "catch_up_s": round(wall - took, 2),
        "samples_per_s": round(written / wall),
        "p50_ms": None if p50 is None else round(p50 * 1000, 2),
        "p99_ms": None if p99 is None else round(p99 * 1000, 2),
        "latency_note": f"from {LATENCY} (arrival in Redis to forecast), interpolated"
        " linearly within its buckets as histogram_quantile does",
        "latency_samples": int(delta[-1][1]) if delta else 0,
        "cpu_pct": round(100 * cpu / wall, 1),
        "rss_mb_start": rss_start,
        "rss_mb_end": run.rss(),
    }
    if soak:
        series.append([round(wall, 1), out["rss_mb_end"]])
        out["rss_series"] = series
    return out


def bench_ingest(
    domains: int,
    seconds: float,
    rate: float | None = None,
    soak: bool = False,
    partitions: int = 4,
    timeout_s: float = 600.0,
    replicas: int = 1,
    workers: int = 1,
    shadow_model: str | None = None,
) -> dict[str, Any]:
    """Run one measurement (see the module docstring) and return its figures; with
    ``shadow_model``, the service also scores that model beside its own."""
    if domains < 1 or seconds <= 0 or partitions < 1:
        raise ValueError(
            f"bench ingest: --domains ({domains}) and --partitions ({partitions}) must be at"
            f" least 1 and --seconds ({seconds:g}) positive"
        )
    if replicas < 1 or workers < 1 or workers * replicas > partitions:
        raise ValueError(
            f"bench ingest: --workers {workers} x --replicas {replicas} must be between 1 and"
            f" --partitions ({partitions}): a worker without a partition reads nothing"
        )
    if rate is not None and rate <= 0:
        raise ValueError(f"bench ingest: --rate {rate:g} must be positive")
    if soak and rate is None:
        rate = SOAK_DEFAULT_RATE
    with bench_run(domains, partitions, replicas, workers, shadow_model) as run:
        if rate is None:
            return drain(run, seconds, timeout_s)
        return rated(run, rate, seconds, soak, timeout_s)
