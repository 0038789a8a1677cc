"""``/metrics``: the fleet gauges set at each scrape from the live state."""

from __future__ import annotations

import re
from typing import Any

from fastapi.testclient import TestClient
from support import GIB, T0, wait_until

from oomcast.service.api.routes.health import risk_band
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

BASELINE = "predict_linear_w60s_h60s_gate0.80_full"


def domain(device: str, fracs: list[float]) -> list[dict[str, Any]]:
    return [
        {
            "ts": T0 + i,
            "node": "n1",
            "device": device,
            "kind": "gpu",
            "total_bytes": 100 * GIB,
            "used_bytes": int(f * 100 * GIB),
            "job": "j",  # the default rules match domains that run a job
        }
        for i, f in enumerate(fracs)
    ]


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_the_fleet_gauges_count_domains_by_risk_and_firing(redis_url: str, key_prefix: str) -> None:
    s = Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        forecaster=BASELINE,
        max_ts_skew_s=0,
        consumer_name="health-test",
    )
    hot = domain("gpu0", [0.2 + 0.01 * i for i in range(70)])  # 89% full, 1%/s: OOM in 11 s
    calm = domain("gpu1", [0.2] * 70)
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/samples", json={"samples": hot + calm}).status_code == 202
        assert wait_until(lambda: c.get("/v1/devices").json()["count"] == 2)
        assert wait_until(lambda: c.get("/v1/devices").json()["devices"][0]["alert"]["firing"])
        text = c.get("/metrics").text
    assert gauge(text, 'oomcast_domains_by_risk{band="critical"}') == 1
    assert gauge(text, 'oomcast_domains_by_risk{band="low"}') == 1
    assert gauge(text, 'oomcast_domains_by_risk{band="high"}') == 0
    assert gauge(text, "oomcast_alerts_firing") == 1
    assert gauge(text, "oomcast_domains_live") == 2


def test_risk_bands_have_closed_lower_edges() -> None:
    assert [risk_band(r) for r in (0.0, 0.19, 0.2, 0.5, 0.79, 0.8, 1.0)] == [
        "low",
        "low",
        "elevated",
        "high",
        "high",
        "critical",
        "critical",
    ]
