"""``oomcast top``: what it prints of a real service's API (the app on the real Redis)."""

from __future__ import annotations

import argparse
import socket
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import GIB, T0, wait_until

from oomcast.cli.top import ReadError, alert_line, fetch, is_alert, render_lines, run
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

BASELINE = "predict_linear_w60s_h60s_gate0.80_full"


def gpu(
    device: str, fracs: list[float], processes: list[dict[str, Any]] | None = None
) -> list[dict[str, Any]]:
    out = []
    for i, f in enumerate(fracs):
        s: dict[str, Any] = {
            "ts": T0 + i,
            "node": "node-with-a-long-name-a",
            "device": device,
            "kind": "gpu",
            "total_bytes": 80 * GIB,
            "used_bytes": int(f * 80 * GIB),
            "job": f"job-{device}",
        }
        if processes is not None:
            s["processes"] = processes
        out.append(s)
    return out


def settings(redis_url: str, key_prefix: str, **kw: Any) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        forecaster=BASELINE,
        max_ts_skew_s=0,
        consumer_name="top-test",
        **kw,
    )


def test_the_riskiest_domain_comes_first_with_its_processes_and_its_alert(
    redis_url: str, key_prefix: str
) -> None:
    procs = [
        {"pid": 11, "used_bytes": 2 * GIB, "job": "small"},
        {"pid": 42, "used_bytes": 60 * GIB, "job": "job-gpu0"},
    ]
    hot = gpu("gpu0", [0.2 + 0.01 * i for i in range(70)], procs)
    calm = gpu("gpu1", [0.3] * 70)
    with TestClient(create_app(settings(redis_url, key_prefix))) as c:
        assert c.post("/v1/samples", json={"samples": calm + hot}).status_code == 202
        assert wait_until(lambda: c.get("/v1/devices").json()["count"] == 2)
        assert wait_until(lambda: c.get("/v1/alerts").json()["count"] >= 1)
        data = fetch(c, 10, None, None)
    lines = render_lines(data, now=0.0)
    assert "2 live, 1 firing;" in lines[0]
    assert f"P(OOM within {data['page']['alert_horizon_s']} s)" in lines[0]
    # the hot GPU first, its full name (never cut short), its use and its alert
    assert lines[1].startswith("  node-with-a-long-name-a/gpu0 job=job-gpu0 used 89%")
    assert "FIRING" in lines[1]
    # its processes under it, the largest first
    assert lines[2] == "      processes: pid 42 job=job-gpu0 60.0 GiB, pid 11 job=small 2.0 GiB"
    assert lines[3].startswith("  node-with-a-long-name-a/gpu1 job=job-gpu1 used 30%")
    assert lines[3].endswith(" ok") and len(lines) == 4  # no processes named: no line
    firing = [a for a in data["alerts"] if a["status"] == "firing"]
    assert firing and "FIRING   node-with-a-long-name-a/gpu0 job=job-gpu0 OOM in ~" in (
        alert_line(firing[0])
    )


def test_filters_reach_the_api(redis_url: str, key_prefix: str) -> None:
    with TestClient(create_app(settings(redis_url, key_prefix))) as c:
        body = {"samples": gpu("gpu0", [0.3] * 5) + gpu("gpu1", [0.3] * 5)}
        assert c.post("/v1/samples", json=body).status_code == 202
        assert wait_until(lambda: c.get("/v1/devices").json()["count"] == 2)
        lines = render_lines(fetch(c, 10, None, "job-gpu1"))
    assert [ln.split()[0] for ln in lines[1:]] == ["node-with-a-long-name-a/gpu1"]


def test_a_service_that_wants_a_token_is_named_as_the_reason(
    redis_url: str, key_prefix: str
) -> None:
    app = create_app(settings(redis_url, key_prefix, api_token="s3cret"))
    with TestClient(app) as c, pytest.raises(ReadError, match="wants a token"):
        fetch(c, 10, None, None)
    with TestClient(app, headers={"Authorization": "Bearer s3cret"}) as c:
        assert fetch(c, 10, None, None)["page"]["total"] == 0


def test_once_against_nothing_exits_1_and_says_where_it_looked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with socket.socket() as s:  # a port that was free a moment ago: nothing listens there
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    args = argparse.Namespace(
        url=f"http://127.0.0.1:{port}", token=None, interval=0.1, limit=0, node=None,
        job=None, plain=False, once=True,
    )  # fmt: skip
    assert run(args) == 1
    err = capsys.readouterr().err
    assert f"cannot reach http://127.0.0.1:{port}" in err


def test_only_first_sendings_of_alerts_are_listed() -> None:
    fired = {"status": "firing", "node": "n", "device": "g", "rule_name": "oom-forecast"}
    assert is_alert(fired) and is_alert({**fired, "status": "resolved"})
    assert not is_alert({**fired, "repeat": True})  # a reminder of one still firing
    assert not is_alert({**fired, "record": "delivery"})  # the webhook's delivery, audited
    assert not is_alert({"event": "action_result", "record": "event", "status": "done"})
