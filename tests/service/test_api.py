"""The REST API against a real Redis, through the app's real lifespan and ingest loop."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import GIB, T0, free_port, wait_until

from oomcast.model.wire import Keys
from oomcast.service.main import create_app
from oomcast.service.settings import Settings


def body(n: int = 3, **over: Any) -> dict[str, Any]:
    samples = []
    for i in range(n):
        s = {
            "ts": T0 + i,
            "node": "n1",
            "device": "gpu0",
            "kind": "gpu",
            "total_bytes": 80 * GIB,
            "used_bytes": (40 + i) * GIB,
            "job": "j",
        }
        samples.append(s)
    samples[-1].update(over)
    return {"samples": samples}


BASELINE = "predict_linear_w60s_h60s_gate0.80_full"  # these tests pin the rule they reason about


def settings(redis_url: str, key_prefix: str, **kw: Any) -> Settings:
    kw.setdefault("forecaster", BASELINE)
    kw.setdefault("max_ts_skew_s", 0)  # samples stamped around support.T0 (2025)
    return Settings(
        redis_url=redis_url, key_prefix=key_prefix, partitions=2, consumer_name="api-test", **kw
    )


def ramp(start_frac: float, n: int) -> list[dict[str, Any]]:
    """A GPU whose use grows by 1% of capacity per second from ``start_frac``."""
    return [
        {
            "ts": T0 + i,
            "node": "n1",
            "device": "gpu0",
            "kind": "gpu",
            "total_bytes": 100 * GIB,
            "used_bytes": int((start_frac + 0.01 * i) * 100 * GIB),
            "job": "j",
        }
        for i in range(n)
    ]


@pytest.fixture
def client(redis_url: str, key_prefix: str) -> Iterator[TestClient]:
    with TestClient(create_app(settings(redis_url, key_prefix))) as c:
        yield c


def test_samples_are_ingested_and_listed_riskiest_first(client: TestClient) -> None:
    calm = [
        {
            "ts": T0 + i,
            "node": "n2",
            "device": "cgroup:/kubepods/pod-a",
            "kind": "host",
            "total_bytes": 8 * GIB,
            "used_bytes": 2 * GIB,
        }
        for i in range(3)
    ]
    # 90% full after growing 1%/s for a minute: the default rule (predict_linear over a full
    # 60 s window, gated at 80%) projects an OOM in 10 s.
    hot = ramp(0.3, 61)
    r = client.post("/v1/samples", json={"samples": calm + hot})
    assert r.status_code == 202, r.text
    assert r.json()["accepted"] == 64
    assert wait_until(lambda: client.get("/v1/devices").json()["count"] == 2)
    devices = client.get("/v1/devices").json()["devices"]
    assert [d["device"] for d in devices] == ["gpu0", "cgroup:/kubepods/pod-a"]
    assert devices[0]["alert_risk"] == 1.0
    assert devices[0]["time_to_oom_s"] == pytest.approx(10, abs=1)
    detail = client.get("/v1/devices/n2/cgroup:/kubepods/pod-a").json()
    assert detail["kind"] == "host"
    assert [p["ts"] for p in detail["history"]] == [T0, T0 + 1, T0 + 2]
    assert client.get("/v1/devices/n2/nope").status_code == 404


def test_predict_returns_risk_per_horizon(client: TestClient) -> None:
    r = client.post("/v1/predict", json=body(3))
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out["risk"]) == {"5", "15", "30", "45", "60", "120", "300"}
    assert out["model_version"].startswith("baseline/")
    assert "time_to_oom_s" in out


@pytest.mark.parametrize(
    ("change", "loc", "words"),
    [
        ({"total_bytes": None}, ["body", "samples", 2, "total_bytes"], "required"),
        ({"total_bytes": -5}, ["body", "samples", 2, "total_bytes"], "negative"),
        ({"used_bytes": 500 * GIB}, ["body", "samples", 2, "used_bytes"], "total_bytes"),
        ({"ts": T0}, ["body", "samples", 2, "ts"], "not after"),
        ({"kind": "tpu"}, ["body", "samples", 2, "kind"], "gpu"),
        ({"device": "gpu1"}, ["body", "samples", 2, "device"], "one domain"),
    ],
)
def test_predict_rejects_bad_samples_naming_the_field(
    client: TestClient, change: dict[str, Any], loc: list[Any], words: str
) -> None:
    b = body(3)
    for k, v in change.items():
        if v is None:
            del b["samples"][2][k]
        else:
            b["samples"][2][k] = v
    r = client.post("/v1/predict", json=b)
    assert r.status_code == 422
    (err,) = r.json()["detail"]
    assert err["loc"] == loc
    assert words in err["msg"]


def test_predict_rejects_an_empty_or_shapeless_body(client: TestClient) -> None:
    assert client.post("/v1/predict", json={"samples": []}).status_code == 422
    r = client.post("/v1/predict", json={"sample": []})
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "samples"]


def test_bad_sample_rejects_the_whole_request_and_writes_nothing(
    client: TestClient, rclient: Any, key_prefix: str
) -> None:
    b = body(3)
    b["samples"][1]["used_bytes"] = -1
    r = client.post("/v1/samples", json=b)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["body", "samples", 1, "used_bytes"]
    keys = Keys(key_prefix, 2)
    assert sum(rclient.xlen(k) for k in keys.all_samples()) == 0


def test_token_guards_v1_but_not_health(redis_url: str, key_prefix: str) -> None:
    app = create_app(settings(redis_url, key_prefix, api_token="tok"))
    with TestClient(app) as c:
        assert c.get("/v1/devices").status_code == 401
        assert c.get("/v1/devices", headers={"Authorization": "Bearer nope"}).status_code == 401
        assert c.get("/v1/devices", headers={"Authorization": "Bearer tok"}).status_code == 200
        assert c.get("/livez").status_code == 200


def test_unreachable_redis_makes_readyz_503_without_crashing(key_prefix: str) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    with TestClient(create_app(settings(dead, key_prefix))) as c:
        r = c.get("/readyz")
        assert r.status_code == 503
        assert r.json()["redis"] is False
        assert c.get("/livez").status_code == 200
        assert c.get("/v1/devices").status_code == 200
        refused = c.post("/v1/samples", json=body(2))
        assert refused.status_code == 503
        assert int(refused.headers["Retry-After"]) > 0  # tells the client when to come back
        assert c.post("/v1/predict", json=body(2)).status_code == 200  # needs no Redis
        assert "oomcast_redis_up 0.0" in c.get("/metrics").text


def test_readyz_and_metrics_when_healthy(client: TestClient) -> None:
    assert wait_until(lambda: client.get("/readyz").status_code == 200)
    client.post("/v1/samples", json=body(4))
    assert wait_until(lambda: "oomcast_samples_ingested_total 4.0" in client.get("/metrics").text)
    text = client.get("/metrics").text
    assert "oomcast_forecast_latency_seconds_bucket" in text
    assert 'oomcast_model_info{kind="baseline"' in text


def test_alerts_endpoint_lists_recorded_alerts(
    redis_url: str, key_prefix: str, webhook_receiver: Any
) -> None:
    s = settings(redis_url, key_prefix, webhook_url=webhook_receiver.url, webhook_secret="k")
    hot = ramp(0.2, 70)
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/samples", json={"samples": hot}).status_code == 202
        assert wait_until(lambda: c.get("/v1/alerts").json()["count"] >= 1)
        alert = c.get("/v1/alerts").json()["alerts"][0]
        assert alert["status"] == "firing"
        assert alert["node"] == "n1"
        assert alert["job"] == "j"
    assert webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing")
