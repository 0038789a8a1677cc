"""The stream consumer against the real Redis: dead letters, acks, and recovery of entries
left pending by a crashed or dead replica (including a real SIGKILL of `oomcast serve`)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from support import GIB, T0, free_port, start_serve, wait_until

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.wire import Keys, encode_samples
from oomcast.service.main import create_app
from oomcast.service.pipeline.state import LiveState
from oomcast.service.settings import Settings

GROUP = "oomcast-service"


def payload(node: str, device: str, ts: float, frac: float = 0.5) -> dict[str, Any]:
    return {
        "ts": ts,
        "node": node,
        "device": device,
        "kind": "gpu",
        "total_bytes": 80 * GIB,
        "used_bytes": int(frac * 80 * GIB),
    }


def add(client: redis.Redis, keys: Keys, node: str, payloads: list[dict[str, Any]]) -> bytes:
    return client.xadd(keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]


def pending(client: redis.Redis, keys: Keys) -> int:
    total = 0
    for stream in [*keys.all_samples(), keys.events]:
        with contextlib.suppress(redis.ResponseError):  # no group yet
            total += client.xpending(stream, GROUP)["pending"]
    return total


def app_settings(redis_url: str, prefix: str, **kw: Any) -> Settings:
    base: dict[str, Any] = {
        "redis_url": redis_url,
        "key_prefix": prefix,
        "partitions": 2,
        "consumer_name": "svc-1",
        "forecaster": "predict_linear_w60s_h60s_gate0.80_full",
        # the samples here are stamped around support.T0 (2025): no clock-skew bound
        # (test_input_bounds.py tests it)
        "max_ts_skew_s": 0,
    }
    base.update(kw)
    return Settings(**base)


def seen(c: TestClient, node: str, device: str) -> int:
    r = c.get(f"/v1/devices/{node}/{device}")
    return int(r.json()["samples_seen"]) if r.status_code == 200 else 0


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_malformed_entries_are_dead_lettered_and_ingest_goes_on(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    keys = Keys(key_prefix, 2)
    stream = keys.samples_for("n1")
    rclient.xadd(stream, {"v": "1", "node": "n1"})  # no samples field
    rclient.xadd(stream, {"v": "1", "samples": "{not json"})
    rclient.xadd(stream, {"samples": b"\xff\xfe"})  # not UTF-8
    bad_and_good = [payload("n1", "gpu0", T0), {**payload("n1", "gpu1", T0), "total_bytes": -1}]
    add(rclient, keys, "n1", bad_and_good)
    add(rclient, keys, "n1", [payload("n1", "gpu0", T0 + 1)])
    with TestClient(create_app(app_settings(redis_url, key_prefix))) as c:
        # The events group of a new replica starts at the stream's end: send once it is up.
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        rclient.xadd(keys.events, {"event": "[1,2]"})
        rclient.xadd(
            keys.events,
            {
                "event": '{"ts": 1, "node": "n1", "device": "gpu0",'
                ' "event": "oom", "pad": ' + "[" * 100_000 + "]" * 100_000 + "}"
            },
        )
        huge = json.dumps([payload("n1", "gpu2", T0)]).replace(
            '"used_bytes": ', '"used_bytes": ' + "9" * 5000 + "0 + ", 1
        )
        rclient.xadd(stream, {"v": "1", "node": "n1", "samples": huge})
        emb = [{**payload("n1", "gpu3", T0), "emb": [int("1" + "0" * 400)], "emb_v": 1}]
        rclient.xadd(stream, {"v": "1", "node": "n1", "samples": json.dumps(emb)})
        add(rclient, keys, "n1", [payload("n1", "gpu0", T0 + 2)])
        assert wait_until(lambda: seen(c, "n1", "gpu0") == 3)
        assert wait_until(lambda: pending(rclient, keys) == 0)
        dead = rclient.xrange(keys.deadletter)
        reasons = [f[b"reason"].decode() for _, f in dead]
        assert len(reasons) == 8
        assert any("no 'samples' field" in r for r in reasons)
        assert any("not valid JSON" in r for r in reasons)
        assert any("UTF-8" in r for r in reasons)
        assert any("samples[1].total_bytes" in r for r in reasons)
        assert any(r.startswith("event") for r in reasons)
        assert any("RecursionError" in r for r in reasons)  # nesting deeper than Python's stack
        assert any("digits" in r or "JSON" in r for r in reasons if "gpu2" not in r)
        assert any(r.startswith("samples[0].emb") for r in reasons)
        # The dead letter keeps what arrived, so nothing accepted is lost.
        assert any(f.get(b"orig.samples") == b"{not json" for _, f in dead)
        assert seen(c, "n1", "gpu1") == 0
        assert "oomcast_deadletters_total 8.0" in c.get("/metrics").text


def test_restart_processes_entries_it_had_read_but_not_acked(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    keys = Keys(key_prefix, 2)
    stream = keys.samples_for("n1")
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(5):
        add(rclient, keys, "n1", [payload("n1", "gpu0", T0 + i)])
    # What a replica killed mid-batch leaves behind: entries delivered to it, never acked.
    rclient.xreadgroup(GROUP, "svc-1", {stream: ">"}, count=100)
    assert pending(rclient, keys) == 5
    with TestClient(create_app(app_settings(redis_url, key_prefix))) as c:
        assert wait_until(lambda: seen(c, "n1", "gpu0") == 5)
        assert wait_until(lambda: pending(rclient, keys) == 0)
        assert "oomcast_claimed_entries_total 5.0" in c.get("/metrics").text


def test_entries_of_a_dead_replica_are_claimed(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    keys = Keys(key_prefix, 2)
    stream = keys.samples_for("n1")
    rclient.xgroup_create(stream, GROUP, id="0", mkstream=True)
    for i in range(3):
        add(rclient, keys, "n1", [payload("n1", "gpu0", T0 + i)])
    rclient.xreadgroup(GROUP, "replica-that-died", {stream: ">"}, count=100)
    s = app_settings(redis_url, key_prefix, consumer_name="svc-2", claim_idle_ms=200)
    with TestClient(create_app(s)) as c:
        assert wait_until(lambda: seen(c, "n1", "gpu0") == 3)
        assert wait_until(lambda: pending(rclient, keys) == 0)


@pytest.fixture
def served(redis_url: str, key_prefix: str) -> Iterator[Any]:
    port = free_port()
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_PARTITIONS": "2",
        "OOMCAST_CONSUMER_NAME": "svc-kill",
        "OOMCAST_MAX_TS_SKEW_S": "0",  # samples stamped around support.T0 (2025)
    }
    procs: list[subprocess.Popen[bytes]] = []

    def start() -> subprocess.Popen[bytes]:
        proc = start_serve(env, port)
        procs.append(proc)
        return proc

    start.base = f"http://127.0.0.1:{port}"  # type: ignore[attr-defined]
    yield start
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_sigkill_loses_no_pending_sample(
    served: Any, rclient: redis.Redis, key_prefix: str
) -> None:
    keys = Keys(key_prefix, 2)
    proc = served()

    # Freeze the service while it waits in XREADGROUP: Redis hands the next entry to the
    # blocked reader, which can then never ack it. Then kill it for real.
    def state() -> str:  # R running, S sleeping, T stopped (proc(5))
        return Path(f"/proc/{proc.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    for attempt in range(50):
        os.kill(proc.pid, signal.SIGSTOP)
        assert wait_until(lambda: state() == "T", 5, 0.005)
        add(rclient, keys, "n1", [payload("n1", f"victim{attempt}", T0)])
        if wait_until(lambda: pending(rclient, keys) > 0, 0.1, 0.01):
            break
        os.kill(proc.pid, signal.SIGCONT)
        assert wait_until(lambda: state() != "T", 5, 0.005)
    else:
        pytest.fail("could not catch the service inside XREADGROUP")
    assert pending(rclient, keys) == 1
    victim = f"victim{attempt}"
    proc.kill()
    proc.wait()
    served()  # same consumer name, as a restarted replica has
    base = served.base

    def processed() -> bool:
        r = httpx.get(f"{base}/v1/devices/n1/{victim}")
        return r.status_code == 200 and r.json()["samples_seen"] == 1

    assert wait_until(processed, 20)
    assert wait_until(lambda: pending(rclient, keys) == 0)
    metrics = httpx.get(f"{base}/metrics").text
    assert "oomcast_claimed_entries_total 1.0" in metrics
    assert json.loads(httpx.get(f"{base}/readyz").text)["status"] == "ready"


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_two_replicas_split_the_nodes_by_partition(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    keys = Keys(key_prefix, 2)
    nodes = [f"node-{i}" for i in range(8)]
    owners = {n: keys.partition_of(n) for n in nodes}
    assert set(owners.values()) == {0, 1}
    apps = [
        create_app(
            app_settings(
                redis_url, key_prefix, partitions_owned=str(p), consumer_name=f"replica-{p}"
            )
        )
        for p in (0, 1)
    ]
    with TestClient(apps[0]) as c0, TestClient(apps[1]) as c1:
        clients = [c0, c1]
        assert wait_until(lambda: all(c.get("/readyz").status_code == 200 for c in clients))
        for n in nodes:
            add(rclient, keys, n, [payload(n, "gpu0", T0)])
        for p, c in enumerate(clients):
            mine = sorted(n for n in nodes if owners[n] == p)

            def listed(c: TestClient = c, mine: list[str] = mine) -> bool:
                return sorted(d["node"] for d in c.get("/v1/devices").json()["devices"]) == mine

            assert wait_until(listed)
            assert c.get("/readyz").json()["partitions"] == [p]
        # Events only once the samples are in: an OOM read first would (rightly) make its
        # domain's earlier samples count as late.
        for n in nodes:
            event = {"ts": T0 + 1, "node": n, "device": "gpu0", "event": "oom"}
            rclient.xadd(keys.events, {"event": json.dumps(event)})
        for p, c in enumerate(clients):
            mine = sorted(n for n in nodes if owners[n] == p)

            def oomed(c: TestClient = c, mine: list[str] = mine) -> bool:
                return all(c.get(f"/v1/devices/{n}/gpu0").json()["ooms_seen"] == 1 for n in mine)

            assert wait_until(oomed)
    assert pending(rclient, keys) == 0


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_alert_survives_a_failed_audit_write(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: Any
) -> None:
    keys = Keys(key_prefix, 2)
    rclient.set(keys.alerts, "not a stream")  # every XADD to the audit stream now fails
    s = app_settings(
        redis_url,
        key_prefix,
        webhook_url=webhook_receiver.url,
        webhook_secret="k",
        forecaster="threshold_0.90",
        alert_fire_after=1,
    )
    with TestClient(create_app(s)) as c:
        add(rclient, keys, "n1", [payload("n1", "gpu0", T0, 0.95)])
        assert webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing")
        assert pending(rclient, keys) == 1  # not acked while its alert is unrecorded
        rclient.delete(keys.alerts)
        assert wait_until(lambda: c.get("/v1/alerts").json()["count"] == 1, 20)
        assert wait_until(lambda: pending(rclient, keys) == 0)
        assert c.get("/v1/alerts").json()["alerts"][0]["status"] == "firing"
    assert len(webhook_receiver.requests) == 1  # the retry did not page anyone twice


def test_a_lease_that_lapsed_here_but_was_still_ours_is_taken_afresh(
    redis_url: str, key_prefix: str
) -> None:
    """The leases report such a partition as lost and acquired in one change (lost first):
    the loop must restore and claim it again, not drop it from what it is to take."""
    from oomcast.service.cluster.leases import PartitionLeases
    from oomcast.service.ingest import Ingestor
    from oomcast.service.metrics import Metrics
    from oomcast.service.pipeline.actions import Dispatcher

    keys = Keys(key_prefix, 2)
    now = [100.0]

    async def scenario() -> tuple[set[int], set[int]]:
        client = aioredis.from_url(redis_url)
        leases = PartitionLeases(client, key_prefix, 2, "a", ttl_s=2.0, clock=lambda: now[0])
        live = LiveState(ThresholdBaseline(0.9), [], horizon_s=60)
        ing = Ingestor(
            client, keys, live, Metrics(), group="g", consumer="c", owner=leases,
            dispatcher=Dispatcher(keys, []),
        )  # fmt: skip
        await ing._keep_leases()
        first = set(ing._to_take)
        ing._to_take.clear()  # as _own does once it has taken them
        now[0] += 2.0 * leases.safety  # the loop stalled past the leases' local deadline
        await ing._keep_leases()
        again = set(ing._to_take)
        await leases.release_all()
        await client.aclose()
        return first, again

    first, again = asyncio.run(scenario())
    assert first == {0, 1}
    assert again == {0, 1}, "partitions still ours after a lapse must be restored and claimed"


def test_an_oom_event_counts_only_when_the_node_that_signs_its_domain_sent_it(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """The reported attack: one XADD of an ``oom`` naming another node's domain (with a
    job's or another node's Redis user) ended its episodes and restarted its forecaster,
    as often as the attacker liked. Now an ``oom`` for a domain whose node signs its
    samples must carry that node's signature: a forged one is dead-lettered as
    ``unattested`` and changes nothing; the node's own signed one ends the job as before;
    an unsigned one still counts for a domain no node signs (an in-job hook's)."""
    from oomcast.model.control import node_key
    from oomcast.model.schema import Event
    from oomcast.model.wire import encode_event

    secret = "the-master-secret"
    keys = Keys(key_prefix, 2)
    key = node_key(secret, "n1")
    now = time.time()
    s = app_settings(redis_url, key_prefix, control_secret=secret, max_ts_skew_s=300)

    def signed(ts: float) -> None:
        rclient.xadd(keys.samples_for("n1"), encode_samples("n1", [payload("n1", "gpu0", ts)], key))  # type: ignore[arg-type]

    def ooms(c: TestClient, device: str) -> int:
        return int(c.get(f"/v1/devices/n1/{device}").json()["ooms_seen"])

    def unattested() -> list[dict[bytes, bytes]]:
        return [f for _, f in rclient.xrange(keys.deadletter) if f[b"code"] == b"unattested"]

    with TestClient(create_app(s)) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        for i in range(3):
            signed(now - 3 + i)
        add(rclient, keys, "n1", [payload("n1", "GPU-hook", now)])  # unsigned: a hook's
        assert wait_until(lambda: seen(c, "n1", "gpu0") == 3 and seen(c, "n1", "GPU-hook") == 1)
        forged = [
            encode_event(Event(ts=now, node="n1", device="gpu0", event="oom")),  # unsigned
            encode_event(
                Event(ts=now, node="n1", device="gpu0", event="oom"), node_key(secret, "n2")
            ),  # another node's key
            {
                **encode_event(Event(ts=now, node="n1", device="gpu0", event="oom"), key),
                "sig": "sha256=" + "0" * 64,
            },
        ]
        for fields in forged:
            rclient.xadd(keys.events, fields)  # type: ignore[arg-type]
        assert wait_until(lambda: len(unattested()) == 3)
        assert ooms(c, "gpu0") == 0
        assert all(b"not signed by node n1" in f[b"reason"] for f in unattested())
        signed(now + 1)  # the domain was not blinded: its next sample counts
        assert wait_until(lambda: seen(c, "n1", "gpu0") == 4)
        # the node's own signed oom counts; an unsigned one for the hook's domain too
        rclient.xadd(
            keys.events,
            encode_event(Event(ts=now + 1.5, node="n1", device="gpu0", event="oom"), key),
        )  # type: ignore[arg-type]
        rclient.xadd(
            keys.events,
            encode_event(Event(ts=now + 1.5, node="n1", device="GPU-hook", event="oom")),
        )  # type: ignore[arg-type]
        assert wait_until(lambda: ooms(c, "gpu0") == 1 and ooms(c, "GPU-hook") == 1)
        assert len(unattested()) == 3
        assert 'oomcast_samples_rejected_total{reason="unattested"} 3.0' in c.get("/metrics").text


@pytest.mark.slow
def test_an_oom_written_during_a_read_of_its_samples_does_not_overtake_them(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """An agent writes a burst of ticks, and the OOM event with the last. When the service
    reads the sample streams mid-burst, the rest of the burst and the event land before its
    next read. The event must not be processed before those samples, or they count as late
    (from a job that already OOMed) and are lost: the service reads events before samples."""
    keys = Keys(key_prefix, 2)
    ts = [T0 + i for i in range(40)]
    add(rclient, keys, "n1", [payload("n1", "gpu0", t) for t in ts[:20]])
    with TestClient(create_app(app_settings(redis_url, key_prefix))) as c:
        ingestor = c.app.state.ctx.ingestor  # type: ignore[attr-defined]
        real = ingestor.client.xreadgroup
        burst = {"done": False}

        async def read_then_burst(*args: Any, **kw: Any) -> Any:
            got = await real(*args, **kw)
            streams = args[2] if len(args) > 2 else kw.get("streams", {})
            new_samples = keys.events not in streams and ">" in streams.values()
            if new_samples and any(entries for _, entries in got or []) and not burst["done"]:
                burst["done"] = True  # the agent goes on writing while this read returns
                add(rclient, keys, "n1", [payload("n1", "gpu0", t) for t in ts[20:]])
                event = {"ts": T0 + 40, "node": "n1", "device": "gpu0", "event": "oom"}
                rclient.xadd(keys.events, {"event": json.dumps(event)})
            return got

        ingestor.client.xreadgroup = read_then_burst
        assert wait_until(lambda: burst["done"] and seen(c, "n1", "gpu0") >= 20)
        assert wait_until(lambda: 'oomcast_events_total{event="oom"} 1.0' in c.get("/metrics").text)
        assert seen(c, "n1", "gpu0") == 40
        assert "oomcast_late_samples_total 0.0" in c.get("/metrics").text
