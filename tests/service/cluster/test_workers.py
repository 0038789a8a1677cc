"""``oomcast serve --workers N``: the front merges what its workers know, and keeps them
running. The merging is checked on its own; then a real ``serve --workers 2`` on the real
Redis is fed samples, walked page by page, has a worker killed under it, and is stopped."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import quote

import httpx
import pytest
import redis
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support import free_port, oomcast_cmd, wait_until

from oomcast.model.schema import Sample
from oomcast.model.wire import Keys, encode_samples, sample_payload
from oomcast.service.api.device_query import encode_cursor
from oomcast.service.cluster.workers import (
    WorkersError,
    available_cpus,
    merge_device_pages,
    merge_metrics,
    parse_workers,
    worker_partitions,
)
from oomcast.service.settings import Settings

GIB = 1 << 30


def settings(**kw: Any) -> Settings:
    return Settings(**kw)


# --- partitions and counts -------------------------------------------------------------


def test_a_fixed_set_of_partitions_is_split_contiguously_and_whole() -> None:
    s = settings(partitions=8, partitions_owned="0-2,5,7")
    assert worker_partitions(s, 2) == ["0,1", "2,5,7"]
    shares = worker_partitions(s, 3)
    got = [int(p) for share in shares for p in (share or "").split(",")]
    assert sorted(got) == [0, 1, 2, 5, 7] and len(got) == len(set(got))
    assert worker_partitions(settings(partitions=4), 3) == [None, None, None]  # leases


def test_more_workers_than_partitions_is_refused_with_the_reason() -> None:
    with pytest.raises(WorkersError, match="more workers than partitions"):
        worker_partitions(settings(partitions=2), 3)
    with pytest.raises(WorkersError, match="OOMCAST_PARTITIONS_OWNED='1' names 1"):
        worker_partitions(settings(partitions=4, partitions_owned="1"), 2)
    with pytest.raises(WorkersError, match="at least 1"):
        worker_partitions(settings(partitions=4), 0)


def test_worker_counts_parse_and_auto_is_the_cores_capped_by_the_partitions() -> None:
    assert parse_workers("3", cap=8) == 3
    assert parse_workers(2, cap=8) == 2
    cores = available_cpus()
    assert 1 <= cores <= len(os.sched_getaffinity(0))
    assert parse_workers("auto", cap=64) == min(cores, 64)
    assert parse_workers("AUTO", cap=1) == 1
    with pytest.raises(WorkersError, match="a count"):
        parse_workers("two", cap=4)
    with pytest.raises(WorkersError, match="at least 1"):
        parse_workers("0", cap=4)


# --- /v1/devices merged ------------------------------------------------------------------


def _key(risk: float, node: str, device: str) -> tuple[float, float, float, str, str]:
    return (-risk, -risk, -0.5, node, device)


class FakeWorkerPages:
    """What a worker's /v1/devices answers for its own domains (the same keyset rule)."""

    def __init__(self, rows: list[tuple[tuple[float, float, float, str, str], dict[str, Any]]]):
        self.rows = sorted(rows, key=lambda r: r[0])

    def page(
        self, after: tuple[float, float, float, str, str] | None, limit: int
    ) -> dict[str, Any]:
        left = [r for r in self.rows if after is None or r[0] > after]
        shown = left[:limit]
        return {
            "alert_horizon_s": 120,
            "total": len(self.rows),
            "matched": len(self.rows),
            "count": len(self.rows),
            "next": encode_cursor(shown[-1][0]) if len(left) > limit else None,
            "devices": [r[1] for r in shown],
            "cursors": [encode_cursor(r[0]) for r in shown],
        }


def test_merged_pages_walk_the_whole_fleet_once_riskiest_first() -> None:
    rng = random.Random(7)
    rows = []
    for i in range(53):
        risk = rng.choice([0.0, 0.1, 0.5, 0.9, rng.random()])  # ties broken by name
        node, device = f"n{i % 9}", f"gpu{i}"
        rows.append((_key(risk, node, device), {"node": node, "device": device}))
    workers = [FakeWorkerPages(rows[k::3]) for k in range(3)]
    from oomcast.service.api.device_query import decode_cursor

    for limit in (1, 5, 17, 100):
        seen: list[str] = []
        after = None
        for _ in range(100):
            merged = merge_device_pages([w.page(after, limit) for w in workers], limit)
            assert merged["total"] == merged["matched"] == 53
            assert len(merged["devices"]) <= limit
            seen += [d["device"] for d in merged["devices"]]
            if merged["next"] is None:
                break
            after = decode_cursor(merged["next"])
        expected = [r[1]["device"] for r in sorted(rows, key=lambda r: r[0])]
        assert seen == expected, f"limit {limit}"


def test_a_worker_page_without_cursors_is_an_error_not_a_silent_misorder() -> None:
    from oomcast.service.api.device_query import BadCursor

    page = FakeWorkerPages([(_key(0.5, "a", "b"), {"node": "a"})]).page(None, 10)
    del page["cursors"]
    with pytest.raises(BadCursor):
        merge_device_pages([page], 10)


# --- /metrics merged ----------------------------------------------------------------------


def _worker_text(ingested: int, domains: int, latencies: list[float]) -> str:
    reg = CollectorRegistry()
    c = Counter("oomcast_samples_ingested", "Samples forecast", registry=reg)
    c.inc(ingested)
    g = Gauge("oomcast_domains", "Live domains", registry=reg)
    g.set(domains)
    h = Histogram("oomcast_lat_seconds", "Latency", buckets=(0.01, 0.1), registry=reg)
    for v in latencies:
        h.observe(v)
    return generate_latest(reg).decode()


def test_merged_metrics_sum_counters_and_histograms_and_label_gauges_by_worker() -> None:
    text = merge_metrics(
        [(0, _worker_text(10, 3, [0.005, 0.05])), (1, _worker_text(32, 4, [0.5]))]
    ).decode()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }
    assert samples[("oomcast_samples_ingested_total", ())] == 42
    assert samples[("oomcast_domains", (("worker", "0"),))] == 3
    assert samples[("oomcast_domains", (("worker", "1"),))] == 4
    assert samples[("oomcast_lat_seconds_bucket", (("le", "0.01"),))] == 1
    assert samples[("oomcast_lat_seconds_bucket", (("le", "0.1"),))] == 2
    assert samples[("oomcast_lat_seconds_bucket", (("le", "+Inf"),))] == 3
    assert samples[("oomcast_lat_seconds_count", ())] == 3
    # a counter's creation time is one figure for the service, not one per worker
    created = [k for k in samples if k[0] == "oomcast_samples_ingested_created"]
    assert created == [("oomcast_samples_ingested_created", ())]


# --- a real serve --workers 2 ---------------------------------------------------------------

TOKEN = "workers-test-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
NODES = 24
DEVICES = ("gpu0", "slice/pod 1%2F")  # a name with a slash, a space and a percent escape


def _write_tick(client: redis.Redis, keys: Keys, ts: float) -> None:
    pipe = client.pipeline(transaction=False)
    for i in range(NODES):
        node = f"wnode-{i:02d}"
        payloads = [
            sample_payload(
                Sample(ts, node, dev, "gpu", 80 * GIB, int((0.2 + 0.01 * i) * 80 * GIB)), None, None
            )
            for dev in DEVICES
        ]
        pipe.xadd(keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]
    pipe.execute()


@pytest.fixture
def front(redis_url: str, key_prefix: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    port = free_port()
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_PARTITIONS": "4",
        "OOMCAST_CONSUMER_NAME": "wtest",
        "OOMCAST_LEASE_TTL_S": "2",
        "OOMCAST_FORECASTER": "threshold_0.90",
        "OOMCAST_API_TOKEN": TOKEN,
    }
    proc = subprocess.Popen(
        oomcast_cmd("serve", "--port", str(port), "--workers", "2"),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        yield proc, base
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)


def _get(base: str, path: str, **params: Any) -> httpx.Response:
    return httpx.get(base + path, params=params, headers=AUTH, timeout=10)


def _readyz(base: str) -> dict[str, Any]:
    try:
        body: dict[str, Any] = _get(base, "/readyz").json()
        return body
    except (httpx.HTTPError, ValueError):
        return {}


def _walk(base: str, limit: int) -> list[tuple[str, str]]:
    out: list[tuple[str, str]] = []
    cursor = None
    while True:
        params: dict[str, Any] = {"limit": limit}
        if cursor:
            params["cursor"] = cursor
        page = _get(base, "/v1/devices", **params).json()
        out += [(d["node"], d["device"]) for d in page["devices"]]
        cursor = page["next"]
        if cursor is None:
            return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes
        return f.read().rpartition(")")[2].split()[0] != "Z"


@pytest.mark.slow
def test_serve_with_two_workers_is_one_service_and_outlives_a_killed_worker(
    front: tuple[subprocess.Popen[bytes], str], rclient: redis.Redis, key_prefix: str
) -> None:
    proc, base = front
    keys = Keys(key_prefix, 4)

    def ready_split() -> bool:
        body = _readyz(base)
        if body.get("status") != "ready":
            return False
        parts = [w["partitions"] for w in body["workers"]]
        return all(parts) and sorted(p for ps in parts for p in ps) == [0, 1, 2, 3]

    assert wait_until(ready_split, 60), _readyz(base)
    body = _readyz(base)
    assert len(body["workers"]) == 2 and body["partitions"] == [0, 1, 2, 3]
    pids = [w["pid"] for w in body["workers"]]
    assert len(set(pids)) == 2 and proc.pid not in pids

    _write_tick(rclient, keys, time.time())
    domains = NODES * len(DEVICES)
    assert wait_until(lambda: _get(base, "/v1/devices").json().get("total") == domains, 30)

    # every domain once, whichever worker holds it, at any page size
    every = sorted((f"wnode-{i:02d}", d) for i in range(NODES) for d in DEVICES)
    for limit in (1, 7, 1000):
        walked = _walk(base, limit)
        assert sorted(walked) == every, f"limit {limit}"
    one = _get(base, "/v1/devices/wnode-03/" + quote(DEVICES[1], safe="/"))
    assert one.status_code == 200 and one.json()["device"] == DEVICES[1]
    assert _get(base, "/v1/devices/nobody/gpu0").status_code == 404
    assert _get(base, "/v1/devices", limit=0).status_code == 422  # a worker's refusal, passed on
    assert httpx.get(base + "/v1/devices").status_code == 401  # the front guards /v1 too
    metrics = httpx.get(base + "/metrics").text
    assert f"oomcast_samples_ingested_total {float(domains)}" in metrics
    assert 'oomcast_workers{state="running"} 2.0' in metrics

    # a worker killed: the front starts it again and the fleet view comes back whole
    os.kill(pids[0], signal.SIGKILL)

    def restarted() -> bool:
        b = _readyz(base)
        return b.get("status") == "ready" and b["workers"][0]["restarts"] == 1

    assert wait_until(restarted, 60), _readyz(base)
    assert wait_until(ready_split, 30), _readyz(base)
    _write_tick(rclient, keys, time.time())
    assert wait_until(lambda: sorted(_walk(base, 10)) == every, 30)
    assert "oomcast_worker_restarts_total 1.0" in httpx.get(base + "/metrics").text

    # a model swap through the front: refused without a secret the workers could follow
    swap = httpx.post(base + "/v1/model", json={"model": "threshold_0.95"}, headers=AUTH)
    assert swap.status_code == 409 and "OOMCAST_CONTROL_SECRET" in swap.json()["detail"]
    assert _readyz(base)["model_version"] == "baseline/threshold_0.90"
    # SIGHUP reloads the model file (here there is none: a baseline); it stops nothing
    now = [w["pid"] for w in _readyz(base)["workers"]]
    proc.send_signal(signal.SIGHUP)
    assert not wait_until(lambda: proc.poll() is not None, 3)  # alive: the signal is handled
    assert _readyz(base)["status"] == "ready"
    assert [w["pid"] for w in _readyz(base)["workers"]] == now

    # stopping the service stops its workers
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(40) in (0, -signal.SIGTERM)  # uvicorn re-raises the signal it handled
    assert wait_until(lambda: not any(_alive(p) for p in now), 10), now
