"""``POST /v1/admit`` through the real app and Redis: a job's preflight profile against
what a live GPU's residents have used at their highest."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import GIB, T0, wait_until

from oomcast.service.api.admission import CONTEXT_BYTES
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

BASELINE = "predict_linear_w60s_h60s_gate0.80_full"


def gpu(node: str, uses_gib: list[float], kind: str = "gpu") -> list[dict[str, Any]]:
    device = "gpu0" if kind == "gpu" else "cgroup:/job"
    return [
        {
            "ts": T0 + i,
            "node": node,
            "device": device,
            "kind": kind,
            "total_bytes": 80 * GIB,
            "used_bytes": int(u * GIB),
        }
        for i, u in enumerate(uses_gib)
    ]


@pytest.fixture
def client(redis_url: str, key_prefix: str) -> Iterator[TestClient]:
    s = Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        forecaster=BASELINE,
        max_ts_skew_s=0,
        consumer_name="admit-test",
    )
    with TestClient(create_app(s)) as c:
        # a neighbour that peaked at 50 GiB (its eval) and sits at 30 GiB now; a cgroup
        samples = gpu("n1", [30, 30, 50, 50, 30, 30]) + gpu("n2", [10] * 3, kind="host")
        assert c.post("/v1/samples", json={"samples": samples}).status_code == 202
        assert wait_until(lambda: c.get("/v1/devices").json()["count"] == 2)
        yield c


def ask(c: TestClient, peak_gib: float, **extra: Any) -> Any:
    body = {"node": "n1", "device": "gpu0", "profile": {"peak_reserved_bytes": int(peak_gib * GIB)}}
    body.update(extra)
    return c.post("/v1/admit", json=body)


def test_a_job_is_measured_against_the_residents_peak_not_their_use_now(
    client: TestClient,
) -> None:
    ok = ask(client, 20).json()
    assert ok["fits"] is True and ok["resident_peak_bytes"] == 50 * GIB
    assert ok["resident_now_bytes"] == 30 * GIB
    margin = int(0.02 * 80 * GIB)
    assert ok["headroom_bytes"] == 80 * GIB - margin - 50 * GIB - 20 * GIB - CONTEXT_BYTES
    # 45 GiB would fit beside the 30 GiB of this instant, but not beside the 50 GiB peak
    no = ask(client, 45).json()
    assert no["fits"] is False and no["headroom_bytes"] < 0 and "does not fit" in no["reason"]
    # the whole preflight report may be posted; its context figure is used
    report = {"peak_reserved_bytes": 28 * GIB, "context_bytes": 0, "verdict": {"fits": True}}
    assert (
        client.post("/v1/admit", json={"node": "n1", "device": "gpu0", "profile": report}).json()[
            "fits"
        ]
        is True
    )


def test_bad_requests_name_what_is_wrong(client: TestClient) -> None:
    r = client.post("/v1/admit", json={"node": "n1", "device": "gpu0", "profile": {}})
    assert r.status_code == 422
    assert ["body", "profile", "peak_reserved_bytes"] in [e["loc"] for e in r.json()["detail"]]
    r = ask(client, -1)
    assert r.status_code == 422
    assert ask(client, 1, margin_frac=0.9).status_code == 422
    assert ask(client, 1, margin_frac=True).status_code == 422  # true is not a number here
    boolish = {"node": "n1", "device": "gpu0", "profile": {"peak_reserved_bytes": True}}
    assert client.post("/v1/admit", json=boolish).status_code == 422
    missing = client.post(
        "/v1/admit", json={"node": "nx", "device": "gpu0", "profile": {"peak_reserved_bytes": 1}}
    )
    assert missing.status_code == 404 and "no live domain nx/gpu0" in missing.json()["detail"]
    host = client.post(
        "/v1/admit",
        json={"node": "n2", "device": "cgroup:/job", "profile": {"peak_reserved_bytes": 1}},
    )
    assert host.status_code == 404 and "not a GPU" in host.json()["detail"]
