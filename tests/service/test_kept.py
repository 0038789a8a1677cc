"""Traces kept for missed OOMs, false alarms and near misses (service/kept.py), on real Redis:
what a kept trace holds, once per OOM, sealed, bounded; the service keeping one for a missed
OOM, and ``oomcast dump --outcomes`` writing it where ``oomcast evaluate`` reads it."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Callable, Coroutine
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar, cast

import pytest
import redis
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from support import GIB, oomcast_cmd, wait_until

from oomcast.model.control import node_keys
from oomcast.model.schema import Event, Sample
from oomcast.model.trace import load_trace
from oomcast.model.wire import Keys, encode_event, encode_samples
from oomcast.service import kept as kept_module
from oomcast.service.kept import (
    TraceKeeper,
    index_key,
    keeps,
    kept_keys,
    pending_key,
    trace_id,
    trace_key,
    window,
)
from oomcast.service.main import create_app
from oomcast.service.pipeline.outcomes import CHAMPION, Outcome
from oomcast.service.settings import Settings
from oomcast.training.from_redis import dump_outcomes

SECRET = "c0ntrol"
SEAL = kept_keys(SECRET, None)
T = TypeVar("T")


def outcome(kind: str, ts: float, **kw: Any) -> Outcome:
    base: dict[str, Any] = dict(
        id=f"{kind}-{ts}", outcome=kind, ts=ts, node="n1", device="gpu0", kind="gpu", job="j1",
        role=CHAMPION, model_version="m1",
    )  # fmt: skip
    return Outcome(**(base | kw))


def payload(device: str, ts: float, frac: float, node: str = "n1") -> dict[str, Any]:
    return {"ts": ts, "node": node, "device": device, "kind": "gpu",
            "total_bytes": 80 * GIB, "used_bytes": int(frac * 80 * GIB)}  # fmt: skip


def publish(
    client: redis.Redis,
    keys: Keys,
    node: str,
    payloads: list[dict[str, Any]],
    signed: bool = True,
    arrived_at_ts: bool = False,
) -> None:
    """Entries of 10 samples each, as the node's agent writes them; with ``arrived_at_ts``,
    each entry's id is its first sample's time (as if written then), else now."""
    key = node_keys(SECRET)(node) if signed else None
    for i in range(0, len(payloads), 10):
        entry_id = f"{int(payloads[i]['ts'] * 1000)}-0" if arrived_at_ts else "*"
        fields = encode_samples(node, payloads[i : i + 10], key)
        client.xadd(keys.samples_for(node), cast(Any, fields), id=entry_id)


def with_keeper(
    redis_url: str, keys: Keys, body: Callable[[TraceKeeper], Coroutine[Any, Any, T]], **kw: Any
) -> T:
    """Run ``body(keeper)`` on a keeper with a client of its own event loop."""

    async def call() -> T:
        client = aioredis.from_url(redis_url)
        params: dict[str, Any] = {"seal_keys": SEAL, "key_for_node": node_keys(SECRET)} | kw
        try:
            return await body(TraceKeeper(client, keys, **params))
        finally:
            await client.aclose()

    return asyncio.run(call())


def keep(redis_url: str, keys: Keys, outcomes: list[Outcome], **kw: Any) -> list[str]:
    """Stage keep requests for ``outcomes`` and serve every one; the results in order."""
    results: list[str] = []

    async def body(k: TraceKeeper) -> list[str]:
        k.on_result = results.append
        pipe = k.client.pipeline(transaction=False)
        k.stage(pipe, outcomes)
        await pipe.execute()
        while await k.serve_one():
            pass
        return results

    return with_keeper(redis_url, keys, body, **kw)


def test_which_outcomes_are_kept_and_what_a_window_spans() -> None:
    assert keeps(outcome("oom", 1000.0, warned="no"))
    assert keeps(outcome("oom", 1000.0, warned="late"))
    assert keeps(outcome("oom", 1000.0, warned="10s"))
    assert not keeps(outcome("oom", 1000.0, warned="30s"))
    assert keeps(outcome("false_alarm", 1000.0, alert_ts=500.0))
    assert keeps(outcome("near_miss", 1000.0, alert_ts=500.0))
    # an alert settled by an OOM long after it ended: its samples run into that OOM
    assert not keeps(outcome("false_alarm", 1000.0, alert_ts=500.0, ended_by="oom"))
    assert not keeps(outcome("censored", 1000.0))
    assert not keeps(outcome("exposure", 1000.0, seconds=60.0))
    assert window(outcome("oom", 1000.0, warned="no"), 600.0) == (400.0, 1000.0)
    # a false alarm's: from a window before the alert to its settling
    assert window(outcome("false_alarm", 1000.0, alert_ts=650.0), 600.0) == (50.0, 1000.0)
    # one OOM missed by two scored models is one trace; two alerts of one domain are two
    shadow = outcome("oom", 1000.0, warned="no", role="shadow", id="x")
    assert trace_id(shadow) == trace_id(outcome("oom", 1000.0, warned="late"))
    fa1 = outcome("false_alarm", 1000.0, alert_ts=650.0)
    assert trace_id(fa1) != trace_id(outcome("false_alarm", 1000.0, alert_ts=700.0, id="y"))
    # the same alert decided again otherwise (a replay): still one trace
    assert trace_id(fa1) == trace_id(replace(fa1, outcome="near_miss", ts=1010.0))


def test_a_missed_oom_is_kept_once_with_its_domains_samples_and_its_oom(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 900
    # 15 minutes of gpu0, and of a neighbour device and another node that must stay out
    publish(rclient, keys, "n1", [payload("gpu0", start + t, 0.5 + t / 2000) for t in range(900)])
    publish(rclient, keys, "n1", [payload("gpu1", start + t, 0.3) for t in range(0, 900, 5)])
    publish(rclient, keys, "n2", [payload("gpu0", start + t, 0.3, "n2") for t in range(0, 900, 5)])
    missed = outcome("oom", start + 900, warned="no", oom_class="long")
    warned = outcome("oom", start + 800, warned="30s", device="gpu1", lead_s=40.0)
    assert keep(redis_url, keys, [missed, warned]) == ["kept"]  # the warned one asks nothing
    assert keep(redis_url, keys, [missed]) == ["repeat"]  # decided again: kept once
    assert rclient.zcard(index_key(key_prefix)) == 1
    ttl = rclient.ttl(trace_key(key_prefix, trace_id(missed)))
    assert 13 * 86400 < ttl <= 14 * 86400

    done = dump_outcomes(rclient, keys, tmp_path / "kept", seal_keys=SEAL)
    assert (len(done.written), done.forged, done.missing, done.sealed) == (1, 0, 0, True)
    trace = load_trace(done.written[0])
    assert list(trace.samples) == [("n1", "gpu0")]
    ts = [s.ts for s in trace.samples[("n1", "gpu0")]]
    # the 600 s before the OOM (t = 300 ... 899), every sample once, in order
    assert (ts[0], ts[-1]) == (missed.ts - 600, missed.ts - 1)
    assert len(ts) == len(set(ts)) == 600 and ts == sorted(ts)
    assert trace.events == [Event(missed.ts, "n1", "gpu0", "oom", "j1")]
    [listed] = json.loads((tmp_path / "kept" / "outcomes.json").read_text())
    assert listed["file"] == done.written[0].name
    assert listed["outcome"]["warned"] == "no" and listed["samples"] == 600


def test_a_false_alarm_is_kept_without_an_oom_and_unsigned_samples_stay_out(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 400
    publish(rclient, keys, "n1", [payload("gpu0", start + t, 0.6) for t in range(0, 400, 2)])
    # a forger's samples of the same domain, unsigned: left out where the service has keys
    forged = [payload("gpu0", start + t + 1, 0.99) for t in range(0, 400, 2)]
    publish(rclient, keys, "n1", forged, signed=False)
    fa = outcome("false_alarm", start + 399, alert_ts=start + 50)
    assert keep(redis_url, keys, [fa]) == ["kept"]
    done = dump_outcomes(rclient, keys, tmp_path, seal_keys=SEAL)
    trace = load_trace(done.written[0])
    assert trace.events == [] and not trace.ooms
    levels = [s.used_frac for s in trace.samples[("n1", "gpu0")]]
    assert len(levels) == 200 and max(levels) == pytest.approx(0.6)
    [listed] = json.loads((tmp_path / "outcomes.json").read_text())
    assert listed["unattested_left_out"] == 200


def test_what_anyone_could_write_to_redis_is_left_out(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 100
    publish(rclient, keys, "n1", [payload("gpu0", start + t, 0.7) for t in range(100)])
    # a keep request not sealed by the service is dropped and counted
    body = json.dumps({"o": outcome("oom", start + 99, warned="no").to_dict(), "at": time.time()})
    rclient.zadd(pending_key(key_prefix), {"bogus." + body: time.time()})
    rclient.zadd(pending_key(key_prefix), {"not json at all": time.time()})

    async def serve(k: TraceKeeper) -> list[str]:
        out: list[str] = []
        k.on_result = out.append
        while await k.serve_one():
            pass
        return out

    assert sorted(with_keeper(redis_url, keys, serve)) == ["forged", "forged"]
    assert rclient.zcard(index_key(key_prefix)) == 0
    # a kept trace changed in Redis fails its seal: dump leaves it out, and says so
    o = outcome("oom", start + 99, warned="no")
    assert keep(redis_url, keys, [o]) == ["kept"]
    key = trace_key(key_prefix, trace_id(o))
    meta = json.loads(rclient.hget(key, "meta") or b"{}")
    meta["outcome"]["outcome"] = "near_miss"
    rclient.hset(key, "meta", json.dumps(meta))
    done = dump_outcomes(rclient, keys, tmp_path / "a", seal_keys=SEAL)
    assert (len(done.written), done.forged) == (0, 1)
    unchecked = dump_outcomes(rclient, keys, tmp_path / "b")  # no key: written, unchecked
    assert (len(unchecked.written), unchecked.sealed) == (1, False)


def test_kept_traces_are_bounded_in_count_and_the_stream_they_come_from(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 100
    for d in range(3):
        publish(rclient, keys, "n1", [payload(f"gpu{d}", start + t, 0.7) for t in range(100)])
    ooms = [outcome("oom", start + 99, warned="no", device=f"gpu{d}") for d in range(3)]
    for o in ooms:  # kept one after another: the first is the oldest
        assert keep(redis_url, keys, [o], max_count=2) == ["kept"]
    left = [m.decode() for m in rclient.zrange(index_key(key_prefix), 0, -1)]
    assert len(left) == 2 and trace_id(ooms[0]) not in left  # the oldest went
    assert not rclient.exists(trace_key(key_prefix, trace_id(ooms[0])))
    # samples the stream no longer holds (or never held) keep nothing
    gone = outcome("oom", start - 5000, warned="no", device="gpu7")
    assert keep(redis_url, keys, [gone]) == ["empty"]


def settings(redis_url: str, prefix: str, **kw: Any) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        partitions=1,
        consumer_name="svc-1",
        forecaster="threshold_0.90",
        max_ts_skew_s=0,
        control_secret=SECRET,
        **kw,
    )


@pytest.mark.slow
def test_the_service_keeps_a_missed_oom_and_dump_writes_what_evaluate_reads(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    """Through the real app: a domain that OOMs with no alert (it never passed 90%) is a
    missed OOM; its trace is kept; ``oomcast dump --outcomes`` writes it, ``oomcast
    evaluate`` scores it as one OOM the threshold missed, and ``oomcast train`` trains on it."""
    keys = Keys(key_prefix, 1)
    start = time.time() - 300
    with TestClient(create_app(settings(redis_url, key_prefix))) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        climb = [payload("gpu3", start + t, 0.5 + t / 1000) for t in range(200)]
        publish(rclient, keys, "n1", climb)

        def seen() -> int:
            r = c.get("/v1/devices/n1/gpu3")
            return int(r.json()["samples_seen"]) if r.status_code == 200 else 0

        assert wait_until(lambda: seen() == 200)
        oom = Event(start + 200, "n1", "gpu3", "oom")
        rclient.xadd(keys.events, encode_event(oom, node_keys(SECRET)("n1")))
        assert wait_until(lambda: rclient.zcard(index_key(key_prefix)) == 1)
        assert 'oomcast_kept_traces_total{result="kept"} 1.0' in c.get("/metrics").text
    env = {**os.environ, "OOMCAST_KEY_PREFIX": key_prefix, "OOMCAST_CONTROL_SECRET": SECRET}
    out = tmp_path / "kept"
    done = subprocess.run(
        oomcast_cmd("dump", "--outcomes", "--out", str(out), "--redis-url", redis_url),
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "wrote 1 kept traces" in done.stdout and "1 oom" in done.stdout
    assert "NOT checked" not in done.stderr
    [path] = out.glob("*.jsonl.gz")
    samples = [r for r in load_trace(path).records() if isinstance(r, Sample)]
    assert len(samples) == 200
    scored = subprocess.run(
        oomcast_cmd("evaluate", "--traces", str(out), "--json", "--no-progress"),
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert scored.returncode == 0, scored.stderr
    threshold = json.loads(scored.stdout)["detectors"]["threshold_0.90"]
    # the OOM came 200 s into the job: a long one, and the threshold (never crossed) missed it
    assert (threshold["oom_traces"], threshold["ok_traces"]) == (1, 0)
    assert threshold["classes"]["oom_long"] | {"median_lead_s": None} == {
        "n": 1, "warned_30s": 0, "recall_30s": 0.0, "warned_10s": 0, "recall_10s": 0.0,
        "median_lead_s": None,
    }  # fmt: skip
    # and train reads them as they are (one epoch, beside a few plain shapes to validate on)
    trained = subprocess.run(
        oomcast_cmd("train", "--data", "", "--corpus", "", "--corpus-v1", "", "--host-traces",
                    "", "--shapes", "40", "--extra-train", str(out), "--epochs", "1", "--out",
                    str(tmp_path / "run"), "--no-progress"),
        env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert trained.returncode == 0, trained.stderr
    assert "sequences: train extra 1," in trained.stdout + trained.stderr
    assert (tmp_path / "run" / "checkpoint.pt").is_file()


def test_an_outcome_decided_long_after_its_samples_arrived_keeps_them_all(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    """A domain that went silent is settled when it expires, ten minutes after its last
    sample arrived: the read follows the samples' time, not only the request's."""
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 1500
    publish(rclient, keys, "n1", [payload("gpu0", start + t, 0.8) for t in range(400)],
            arrived_at_ts=True)  # fmt: skip
    fa = outcome("false_alarm", start + 399, alert_ts=start + 100)  # decided now, 1100 s on
    assert keep(redis_url, keys, [fa]) == ["kept"]
    done = dump_outcomes(rclient, keys, tmp_path / "out", seal_keys=SEAL)
    assert len(load_trace(done.written[0]).samples[("n1", "gpu0")]) == 400


def test_only_the_outcomes_job_and_the_newest_samples_when_the_scan_stops_early(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path, monkeypatch: Any
) -> None:
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 300
    # the job before (it OOMed at 100 s) and the job that OOMs at 300 s, on one device
    before = [payload("gpu0", start + t, 0.9) | {"job": "j0"} for t in range(100)]
    after = [payload("gpu0", start + t, 0.5 + t / 1000) | {"job": "j1"} for t in range(100, 300)]
    publish(rclient, keys, "n1", before + after)
    o = outcome("oom", start + 300, warned="no", job="j1")
    assert keep(redis_url, keys, [o]) == ["kept"]
    done = dump_outcomes(rclient, keys, tmp_path / "a", seal_keys=SEAL)
    samples = load_trace(done.written[0]).samples[("n1", "gpu0")]
    assert {s.job for s in samples} == {"j1"} and len(samples) == 200
    # a scan cut short keeps the newest samples, those right before the OOM
    monkeypatch.setattr(kept_module, "SCAN_CHUNK", 5)
    monkeypatch.setattr(kept_module, "MAX_SCAN", 10)  # entries: 100 of the 200 samples
    o2 = outcome("oom", start + 300, warned="no", job="j1", device="gpu0", node="n1", id="z")
    rclient.delete(index_key(key_prefix))
    assert keep(redis_url, keys, [o2]) == ["kept"]
    done = dump_outcomes(rclient, keys, tmp_path / "b", seal_keys=SEAL)
    ts = [s.ts for s in load_trace(done.written[0]).samples[("n1", "gpu0")]]
    assert len(ts) == 100 and ts[-1] == start + 299


def test_without_node_keys_every_sample_is_kept_and_stale_requests_are_dropped(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix, 1)
    start = float(int(time.time())) - 100
    publish(rclient, keys, "n1", [payload("gpu0", start + t, 0.7) for t in range(100)],
            signed=False)  # fmt: skip
    o = outcome("oom", start + 100, warned="no")
    assert keep(redis_url, keys, [o]) == ["unsigned"]  # the service has node keys: none kept
    assert keep(redis_url, keys, [o], key_for_node=None) == ["kept"]

    async def stale(k: TraceKeeper) -> list[str]:
        out: list[str] = []
        k.on_result = out.append
        pipe = k.client.pipeline(transaction=False)
        k.stage(pipe, [replace(o, ts=o.ts - 1)], now=time.time() - 2 * 3600)
        await pipe.execute()
        await k.serve_one()
        return out

    assert with_keeper(redis_url, keys, stale) == ["stale"]


def test_dump_refuses_a_folder_that_holds_something(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    (tmp_path / "old.jsonl").write_text("")
    with pytest.raises(ValueError, match="not empty"):
        dump_outcomes(rclient, Keys(key_prefix, 1), tmp_path, seal_keys=SEAL)
