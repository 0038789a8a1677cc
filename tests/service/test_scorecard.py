"""The fleet's scorecard (service/scorecard.py): outcomes on record once, sealed, summed; and
the service deciding them from what it reads, through GET /v1/scorecard and /metrics."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from support import GIB, wait_until

from oomcast.model.runtime import ModelLoadError
from oomcast.model.wire import Keys, encode_samples
from oomcast.service.cluster.snapshot import field_of
from oomcast.service.main import build_context, create_app
from oomcast.service.pipeline.outcomes import CHAMPION, SHADOW, Outcome
from oomcast.service.scorecard import (
    OutcomeStore,
    figures,
    outcome_keys,
    parse_since,
    scorecard,
    stream_key,
)
from oomcast.service.settings import Settings

NOW = float(int(time.time()))


def outcome(i: int, kind: str, **kw: Any) -> Outcome:
    base: dict[str, Any] = dict(
        id=f"o{i}", outcome=kind, ts=NOW - 3600 + i, node="n1", device=f"gpu{i}", kind="gpu",
        job=None, role=CHAMPION, model_version="m1",
    )  # fmt: skip
    return Outcome(**(base | kw))


# a week by hand: 4 OOMs (two warned 30 s ahead, one 12 s, one missed), a false alarm, a
# near miss, a censored alert, two hours of jobs watched
WEEK = [
    outcome(1, "oom", warned="30s", oom_class="long", lead_s=45.0, tto_error=0.2),
    outcome(2, "oom", warned="30s", oom_class="long", lead_s=90.0, tto_error=0.4),
    outcome(3, "oom", warned="10s", oom_class="long", lead_s=12.0),
    outcome(4, "oom", warned="no", oom_class="sudden"),
    outcome(5, "false_alarm"),
    outcome(6, "near_miss", max_level=0.95),
    outcome(7, "censored"),
    outcome(8, "exposure", seconds=3600.0),
    outcome(9, "exposure", seconds=3600.0),
]


def on(redis_url: str, prefix: str, keys: tuple[str, ...], method: str, *args: Any) -> Any:
    """One call of an OutcomeStore's ``method``, on a client of its own event loop."""

    async def call() -> Any:
        client = aioredis.from_url(redis_url)
        try:
            return await getattr(OutcomeStore(client, prefix, seal_keys=keys), method)(*args)
        finally:
            await client.aclose()

    return asyncio.run(call())


def test_the_figures_match_a_count_by_hand() -> None:
    f = figures(WEEK)
    assert (f["ooms"], f["warned_30s"], f["warned_10s"], f["missed_30s"]) == (4, 2, 3, 2)
    assert (f["recall_30s"], f["recall_10s"]) == (0.5, 0.75)
    assert f["by_class"]["long"] == {
        "n": 3, "warned_30s": 2, "warned_10s": 3, "recall_30s": 0.6667, "recall_10s": 1.0,
    }  # fmt: skip
    assert f["precision"] == 0.75  # 3 alerts an OOM followed, 1 false alarm
    assert (f["false_alarms"], f["near_misses_alerted"], f["censored"]) == (1, 1, 1)
    assert f["median_lead_s"] == 45.0
    assert f["median_tto_error"] == pytest.approx(0.3)
    assert f["job_hours"] == 2.0
    assert f["false_alarms_per_1000_job_hours"] == 500.0


def test_since_takes_spans_and_unix_seconds_and_names_what_is_wrong() -> None:
    assert parse_since("7d", NOW) == NOW - 7 * 86400
    assert parse_since("90m", NOW) == NOW - 5400
    assert parse_since(str(NOW - 5), NOW) == NOW - 5
    assert parse_since("0h", NOW) == NOW  # an empty window
    assert parse_since("99999999d", NOW) == 0.0  # as far back as there is
    for bad in ("seven days", "-1d", "12", "1e20", "1e300d", "nan", ""):
        with pytest.raises(ValueError, match="since="):
            parse_since(bad, NOW)


def test_an_outcome_recorded_twice_is_on_record_once(redis_url: str, key_prefix: str) -> None:
    async def scenario() -> tuple[list[bool], list[bool], list[Outcome]]:
        client = aioredis.from_url(redis_url)
        store = OutcomeStore(client, key_prefix, seal_keys=outcome_keys("s3cret", None))
        first = await store.record(WEEK, now=NOW)
        again = await store.record(WEEK[:3], now=NOW)  # a batch decided again after a crash
        read = await store.read(NOW - 60)
        await client.aclose()
        return first, again, read.outcomes

    first, again, back = asyncio.run(scenario())
    assert first == [True] * len(WEEK) and again == [False] * 3
    assert back == WEEK


def test_entries_not_sealed_by_the_service_are_left_out_and_counted(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """Anyone who can write to Redis can add to the stream; only the service's seal counts."""
    stream = stream_key(key_prefix)
    forged = json.dumps(outcome(20, "oom", warned="30s", oom_class="long").to_dict())
    rclient.xadd(stream, {"o": forged, "sig": ""})
    rclient.xadd(stream, {"o": forged, "sig": "sha256=" + "0" * 64})
    mine = OutcomeStore(aioredis.from_url(redis_url), key_prefix, seal_keys=outcome_keys("k", None))
    theirs = OutcomeStore(
        aioredis.from_url(redis_url), key_prefix, seal_keys=outcome_keys("other", None)
    )

    async def scenario() -> dict[str, Any]:
        await theirs.record([outcome(21, "oom", warned="30s", oom_class="long")], now=NOW)
        await mine.record([outcome(22, "oom", warned="no", oom_class="long")], now=NOW)
        read = await mine.read(NOW - 60, None)
        return scorecard(read, NOW - 60, time.time())

    card = asyncio.run(scenario())
    assert card["left_out"] == {"forged": 3, "malformed": 0, "repeats": 0}
    [model] = card["models"]
    assert (model["ooms"], model["warned_30s"]) == (1, 0)


def test_copies_of_a_sealed_entry_count_once_and_a_garbled_seal_is_forged(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """A writer to Redis cannot forge a seal, but could copy a genuine warned OOM many
    times, or write a seal that is not text."""
    keys = outcome_keys("k", None)
    on(redis_url, key_prefix, keys, "record", [outcome(30, "oom", warned="30s", oom_class="long")])
    stream = stream_key(key_prefix)
    [(_, genuine)] = rclient.xrange(stream)
    for _ in range(5):
        rclient.xadd(stream, genuine)
    rclient.xadd(stream, {"o": genuine[b"o"], "sig": b"\xff\xfe"})
    read = on(redis_url, key_prefix, keys, "read", NOW - 60)
    assert len(read.outcomes) == 1 and read.repeats == 5 and read.forged == 1


def test_an_outcome_older_than_the_retention_is_still_refused_when_repeated(
    redis_url: str, key_prefix: str
) -> None:
    """Replays keep their traces' own times: the ids are kept by when they were recorded."""
    old = outcome(40, "oom", warned="no", oom_class="long", ts=NOW - 90 * 86400)
    assert on(redis_url, key_prefix, (), "record", [old]) == [True]
    assert on(redis_url, key_prefix, (), "record", [old]) == [False]


def test_an_alert_is_decided_once_even_if_a_replay_decides_it_differently(
    redis_url: str, key_prefix: str
) -> None:
    """An OOM that claims an alert records the alert as claimed: the same alert decided
    again as censored (a successor restored from an older snapshot) is a repeat."""
    claimed = outcome(50, "oom", warned="30s", oom_class="long", claims="alert-1")
    censored = outcome(51, "censored", id="alert-1")
    assert on(redis_url, key_prefix, (), "record", [claimed, censored]) == [True, False]


def settings(redis_url: str, prefix: str, **kw: Any) -> Settings:
    given: dict[str, Any] = {"forecaster": "threshold_0.90"} | kw
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        partitions=1,
        consumer_name="svc-1",
        max_ts_skew_s=0,
        control_secret="c0ntrol",
        **given,
    )


def payload(device: str, ts: float, frac: float) -> dict[str, Any]:
    return {"ts": ts, "node": "n1", "device": device, "kind": "gpu",
            "total_bytes": 80 * GIB, "used_bytes": int(frac * 80 * GIB)}  # fmt: skip


@pytest.mark.slow
def test_the_service_decides_outcomes_and_serves_the_scorecard(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """Through the real app on real Redis: a warned OOM, a missed one; /v1/scorecard and
    /metrics agree, and the unsigned samples' node is this test (no node key: unattested
    samples still forecast and score)."""
    keys = Keys(key_prefix, 1)
    start = time.time() - 600
    # a domain is snapshotted once an hour unless something urgent happens to it
    with TestClient(create_app(settings(redis_url, key_prefix, snapshot_every_s=3600))) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        warned = [payload("gpu0", start + t, 0.5 if t < 100 else 0.95) for t in range(140)]
        missed = [payload("gpu1", start + t, 0.5) for t in range(140)]
        for i in range(0, 140, 20):
            rclient.xadd(keys.samples_for("n1"), encode_samples("n1", warned[i : i + 20]))
            rclient.xadd(keys.samples_for("n1"), encode_samples("n1", missed[i : i + 20]))

        def seen(device: str) -> int:
            r = c.get(f"/v1/devices/n1/{device}")
            return int(r.json()["samples_seen"]) if r.status_code == 200 else 0

        assert wait_until(lambda: seen("gpu0") == 140 and seen("gpu1") == 140)
        for device in ("gpu0", "gpu1"):
            event = {"ts": start + 140, "node": "n1", "device": device, "event": "oom"}
            rclient.xadd(keys.events, {"event": json.dumps(event)})

        def card() -> dict[str, Any]:
            r = c.get("/v1/scorecard", params={"since": str(start - 10)})
            assert r.status_code == 200, r.text
            body: dict[str, Any] = r.json()
            return body

        assert wait_until(lambda: card()["outcomes"] >= 4)  # 2 OOMs, 2 exposures
        [model] = card()["models"]
        assert model["role"] == CHAMPION
        assert (model["ooms"], model["warned_30s"], model["missed_30s"]) == (2, 1, 1)
        assert model["median_lead_s"] == pytest.approx(40.0, abs=2.0)
        assert card()["sealed"] is True
        # the OOMs' domains were snapshotted with the batch that decided them, whatever the
        # snapshot schedule: a successor restoring them would not decide them again
        # (gpu1's: with no alert, nothing else makes its OOM batch snapshot it)
        blob = rclient.hget(f"{key_prefix}:snapshot:{{0}}", field_of(("n1", "gpu1")))
        assert blob is not None
        body = json.loads(blob.split(b"\n", 2)[2])
        assert body["watches"][CHAMPION]["start_ts"] is None
        metrics = c.get("/metrics").text
        assert 'outcome="oom"' in metrics and 'warned="30s"' in metrics and 'warned="no"' in metrics
        by_device = c.get("/v1/scorecard", params={"since": "7d", "by": "cause"})
        assert by_device.status_code == 200
        bad = c.get("/v1/scorecard", params={"since": "last week"})
        assert bad.status_code == 422 and bad.json()["detail"][0]["loc"] == ["query", "since"]
        empty = c.get("/v1/scorecard", params={"since": "1h", "until": "0"})  # ends before
        assert empty.status_code == 200 and empty.json()["outcomes"] == 0
        future = c.get("/v1/scorecard", params={"since": "2" + "0" * 16})  # past any stream id
        assert future.status_code == 200 and future.json()["outcomes"] == 0


@pytest.mark.slow
def test_a_shadow_model_is_scored_beside_the_champion_and_acts_on_nothing(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """OOMCAST_SHADOW_MODEL_PATH names a baseline here (an ONNX path works the same): the
    champion (95%) misses a climb to 92% that OOMs, the shadow (90%) warns of it; the
    scorecard has both, each with its own version; only the champion's alerts are raised."""
    keys = Keys(key_prefix, 1)
    start = time.time() - 600
    app = create_app(
        settings(
            redis_url, key_prefix, forecaster="threshold_0.95", shadow_model_path="threshold_0.90"
        )
    )
    with TestClient(app) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        assert c.get("/readyz").json()["shadow_model_version"] == "baseline/threshold_0.90"
        climb = [payload("gpu0", start + t, 0.5 if t < 100 else 0.92) for t in range(160)]
        for i in range(0, 160, 20):
            rclient.xadd(keys.samples_for("n1"), encode_samples("n1", climb[i : i + 20]))

        def seen() -> int:
            r = c.get("/v1/devices/n1/gpu0")
            return int(r.json()["samples_seen"]) if r.status_code == 200 else 0

        assert wait_until(lambda: seen() == 160)
        event = {"ts": start + 160, "node": "n1", "device": "gpu0", "event": "oom"}
        rclient.xadd(keys.events, {"event": json.dumps(event)})

        def models() -> dict[str, dict[str, Any]]:
            r = c.get("/v1/scorecard", params={"since": str(start - 10)})
            assert r.status_code == 200, r.text
            return {m["role"]: m for m in r.json()["models"]}

        assert wait_until(lambda: all(m.get("ooms") == 1 for m in models().values())
                          and len(models()) == 2)  # fmt: skip
        found = models()
        assert found[CHAMPION]["model_version"] == "baseline/threshold_0.95"
        assert (found[CHAMPION]["warned_30s"], found[CHAMPION]["missed_30s"]) == (0, 1)
        assert found[SHADOW]["model_version"] == "baseline/threshold_0.90"
        assert (found[SHADOW]["warned_30s"], found[SHADOW]["missed_30s"]) == (1, 0)
        assert rclient.xlen(keys.alerts) == 0  # the shadow's alert was scored, not raised
        metrics = c.get("/metrics").text
        assert 'oomcast_shadow_model_info{version="baseline/threshold_0.90"} 1.0' in metrics
        assert 'role="shadow"' in metrics


def test_a_shadow_model_that_cannot_be_loaded_stops_the_service(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    bad = tmp_path / "nope.onnx"
    named = settings(redis_url, key_prefix, shadow_model_path=str(bad))
    with pytest.raises(ModelLoadError, match=r"OOMCAST_SHADOW_MODEL_PATH=.*nope\.onnx"):
        build_context(named)
    no_scores = settings(redis_url, key_prefix, shadow_model_path="threshold_0.90", outcomes=False)
    with pytest.raises(ValueError, match="OOMCAST_OUTCOMES=false"):
        build_context(no_scores)
