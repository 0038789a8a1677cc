"""``/metrics``: the fleet gauges set at each scrape from the live state."""

from __future__ import annotations

import re
from typing import Any

import pytest
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
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


def settings(redis_url: str, key_prefix: str, **kw: Any) -> Settings:
    """A service on the test's Redis prefix, forecasting with a baseline."""
    return Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        forecaster=BASELINE,
        max_ts_skew_s=0,
        consumer_name="health-test",
        **kw,
    )


def gauge(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)} ([0-9.e+]+)$", text, re.M)
    assert match, f"{name} not in /metrics"
    return float(match.group(1))


def test_the_fleet_gauges_count_domains_by_risk_and_firing(redis_url: str, key_prefix: str) -> None:
    s = settings(redis_url, key_prefix)
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


def series(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """Every sample of metric ``name`` in an exposition, by its sorted labels."""
    return {
        tuple(sorted(smp.labels.items())): smp.value
        for fam in text_string_to_metric_families(text)
        for smp in fam.samples
        if smp.name == name
    }


def test_per_domain_gauges_show_the_forecast_of_the_riskiest_domains_only(
    redis_url: str, key_prefix: str
) -> None:
    s = settings(redis_url, key_prefix, metrics_domains=1)
    hot = domain("gpu0", [0.2 + 0.01 * i for i in range(70)])
    calm = domain("gpu1", [0.2] * 70)
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/samples", json={"samples": calm + hot}).status_code == 202
        assert wait_until(lambda: c.get("/v1/devices").json()["count"] == 2)
        assert wait_until(lambda: c.get("/v1/devices").json()["devices"][0]["alert"]["firing"])
        shown = c.get("/v1/devices").json()["devices"][0]
        text = c.get("/metrics").text
    assert shown["device"] == "gpu0"
    base = (("device", "gpu0"), ("job_name", "j"), ("kind", "gpu"), ("node", "n1"))
    risk = series(text, "oomcast_domain_oom_risk")
    # one series per horizon of the riskiest domain, the same figures /v1/devices gives
    assert risk == {
        tuple(sorted((*base, ("horizon", h)))): pytest.approx(p, abs=1e-4)
        for h, p in shown["risk"].items()
    }
    assert shown["time_to_oom_s"] is not None
    tto = series(text, "oomcast_domain_time_to_oom_seconds")
    assert tto == {base: pytest.approx(shown["time_to_oom_s"], abs=0.1)}
    assert series(text, "oomcast_domain_memory_used_ratio") == {
        base: pytest.approx(shown["used_frac"], abs=1e-4)
    }
    # the calm domain is past the cap of one: counted, not exported
    assert gauge(text, "oomcast_domain_series_left_out") == 1


def test_per_domain_series_go_when_their_domain_goes(redis_url: str, key_prefix: str) -> None:
    s = settings(redis_url, key_prefix, live_after_s=1.0)
    with TestClient(create_app(s)) as c:
        assert c.post("/v1/samples", json={"samples": domain("gpu0", [0.3] * 5)}).status_code == 202
        assert wait_until(lambda: series(c.get("/metrics").text, "oomcast_domain_oom_risk"))
        # silent past live_after_s: no longer live, and its series leave with it
        assert wait_until(lambda: not series(c.get("/metrics").text, "oomcast_domain_oom_risk"), 10)
        assert gauge(c.get("/metrics").text, "oomcast_domains_live") == 0


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
