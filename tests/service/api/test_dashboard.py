"""The dashboard's routes without a browser (routes/dashboard.py): the page and its assets
are served from the package with no token and nothing from outside, and the allocator
route reads one domain's samples back from its node's stream. The page itself is tested in
Chromium by tests/service/test_dashboard.py."""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from support import GIB, sample

from oomcast.model.wire import Keys, encode_samples, sample_payload
from oomcast.service.api.routes import dashboard
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

TOKEN = "dash-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
SVG_NS = "http://www.w3.org/2000/svg"  # a name, not a fetch


@pytest.fixture
def client(redis_url: str, key_prefix: str) -> Iterator[TestClient]:
    settings = Settings(redis_url=redis_url, key_prefix=key_prefix, partitions=1, api_token=TOKEN)  # type: ignore[call-arg]
    with TestClient(create_app(settings)) as c:
        yield c


def test_the_page_and_every_asset_it_loads_are_served_without_a_token(
    client: TestClient,
) -> None:
    page = client.get("/")
    assert page.status_code == 200
    assert page.headers["content-type"] == "text/html; charset=utf-8"
    assert "script-src 'self'" in page.headers["content-security-policy"]
    assert client.get("/v1/devices").status_code == 401  # the data is still guarded
    wanted = set(re.findall(r'(?:href|src)="(static/[^"]+)"', page.text))
    assert wanted == {"static/style.css", "static/app.js"}
    seen: set[str] = set()
    while wanted - seen:  # follow the modules' own imports too
        path = sorted(wanted - seen)[0]
        seen.add(path)
        r = client.get(f"/{path}")
        assert r.status_code == 200, path
        kind = {"css": "text/css", "js": "text/javascript"}[path.rsplit(".", 1)[-1]]
        assert r.headers["content-type"] == f"{kind}; charset=utf-8"
        assert r.headers["cache-control"] == "no-cache"
        wanted |= {f"static/{m}" for m in re.findall(r'from "\./([\w.-]+\.js)"', r.text)}
        # nothing from a CDN or any other host
        assert not re.search(r"https?://", r.text.replace(SVG_NS, "")), path
    assert seen == {"static/style.css", "static/app.js", "static/charts.js"}
    assert set(dashboard.STATIC) == {"index.html", "style.css", "app.js", "charts.js"}


@pytest.mark.parametrize("path", ["/static/nope.js", "/static/..%2Fmain.py", "/static/"])
def test_anything_but_a_shipped_asset_is_a_404(client: TestClient, path: str) -> None:
    r = client.get(path)
    assert r.status_code == 404
    if path == "/static/nope.js":
        assert r.json() == {"detail": "no dashboard file 'nope.js'"}


def _put(client: redis.Redis, keys: Keys, node: str, samples: list[dict[str, Any]]) -> None:
    client.xadd(keys.samples_for(node), encode_samples(node, samples))  # type: ignore[arg-type]


def _raw(ts: float, frac: float, node: str = "n1", device: str = "gpu0", **kw: Any) -> Any:
    return sample_payload(sample(ts, frac, node=node, device=device, **kw), None, None)


def test_memory_gives_one_domains_allocator_figures_oldest_first(
    client: TestClient, rclient: redis.Redis, key_prefix: str
) -> None:
    keys = Keys(key_prefix, 1)  # one partition: every node's entries share the stream
    now = time.time()
    hooked = [
        _raw(now - 10 + i, 0.5, allocated_bytes=(30 + i) * GIB, reserved_bytes=36 * GIB)
        for i in range(5)
    ]
    _put(rclient, keys, "n1", hooked[:3])
    _put(rclient, keys, "n2", [_raw(now - 9, 0.4, node="n2")])  # another node
    _put(rclient, keys, "n1", [_raw(now - 8, 0.2, device="gpu1"), *hooked[3:]])
    path = "/v1/dashboard/memory/n1/gpu0"
    assert client.get(path).status_code == 401
    body = client.get(path, headers=AUTH).json()
    assert body["has_allocator"] is True and body["complete"] is True
    assert [p["ts"] for p in body["points"]] == [s["ts"] for s in hooked]
    assert [p["allocated_bytes"] for p in body["points"]] == [(30 + i) * GIB for i in range(5)]
    assert {p["reserved_bytes"] for p in body["points"]} == {36 * GIB}
    # the newest entries only, when capped: the answer says the window was cut short
    capped = client.get(path, params={"entries": 1}, headers=AUTH).json()
    assert [p["ts"] for p in capped["points"]] == [s["ts"] for s in hooked[3:]]
    assert capped["complete"] is False
    # a domain without the hook: points, no allocator figures
    plain = client.get("/v1/dashboard/memory/n2/gpu0", headers=AUTH).json()
    assert len(plain["points"]) == 1 and plain["has_allocator"] is False
    assert plain["points"][0]["allocated_bytes"] is None


def test_memory_looks_back_only_as_far_as_asked(
    client: TestClient, rclient: redis.Redis, key_prefix: str
) -> None:
    keys = Keys(key_prefix, 1)
    now = time.time()
    _put(rclient, keys, "n1", [_raw(now - 100, 0.5), _raw(now - 1, 0.6)])
    body = client.get("/v1/dashboard/memory/n1/gpu0", params={"seconds": 30}, headers=AUTH).json()
    assert [p["ts"] for p in body["points"]] == [now - 1]
    empty = client.get("/v1/dashboard/memory/nobody/gpu0", headers=AUTH).json()
    assert empty["points"] == [] and empty["has_allocator"] is False


@pytest.mark.parametrize(
    ("params", "field"),
    [({"seconds": 0}, "seconds"), ({"seconds": 86_401}, "seconds"), ({"entries": 0}, "entries")],
)
def test_memory_names_a_bad_parameter(
    client: TestClient, params: dict[str, Any], field: str
) -> None:
    r = client.get("/v1/dashboard/memory/n1/gpu0", params=params, headers=AUTH)
    assert r.status_code == 422
    assert r.json()["detail"][0]["loc"] == ["query", field]


def test_a_long_window_is_thinned_evenly_keeping_the_newest_point() -> None:
    now = time.time()
    n = dashboard.MAX_POINTS * 3 + 7
    samples = [_raw(now - n + i, 0.5) for i in range(n)]
    entries = []
    for start in range(0, n, 100):  # newest entry first, as XREVRANGE gives them
        fields = encode_samples("n1", samples[start : start + 100])
        entries.insert(0, (b"0-0", {k.encode(): v.encode() for k, v in fields.items()}))
    points = dashboard._points(entries, "n1", "gpu0", since=0.0)
    assert len(points) == dashboard.MAX_POINTS
    ts = [p["ts"] for p in points]
    assert ts == sorted(ts) and ts[0] == samples[0]["ts"] and ts[-1] == samples[-1]["ts"]
    gaps = {round(b - a) for a, b in itertools.pairwise(ts[:-1])}
    assert gaps <= {3, 4}  # even steps through the window
