"""GET /v1/devices at fleet size: filters, keyset pages, totals and refusals; first on the
live state directly (service/api/device_query.py), then through the real app and Redis."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from fastapi.testclient import TestClient
from support import GIB, T0, sample, wait_until

from oomcast.bench.api import bench_api
from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.schema import Sample
from oomcast.service.api.device_query import DeviceFilter, decode_cursor, encode_cursor
from oomcast.service.main import create_app
from oomcast.service.pipeline.rules import Rule
from oomcast.service.pipeline.state import DomainState, LiveState
from oomcast.service.settings import Settings

NOW = T0 + 100
LIVE_AFTER = 600.0


def fleet(n: int = 257) -> LiveState:
    """``n`` domains on n//8+1 nodes; every 7th is over the threshold (risk 1, firing after
    one sample); use takes few distinct values, so the name breaks many ties; every 5th
    domain has no job and every 3rd is a host cgroup."""
    rule = Rule("r", ("webhook",), fire_after=1, resolve_after=1, horizon_s=60, fire_risk=0.5)
    live = LiveState(ThresholdBaseline(0.9), [rule], horizon_s=60)
    batch = []
    for i in range(n):
        frac = 0.95 if i % 7 == 0 else 0.1 * (i % 4 + 1)
        batch.append(
            Sample(
                ts=T0,
                node=f"node-{i // 8:03d}",
                device=f"gpu{i % 8}",
                kind="host" if i % 3 == 0 else "gpu",
                total_bytes=80 * GIB,
                used_bytes=int(frac * 80 * GIB),
                job=None if i % 5 == 0 else f"train-{i % 4}",
            )
        )
    live.apply(batch, NOW)
    return live


def walk(live: LiveState, where: DeviceFilter, limit: int) -> list[list[DomainState]]:
    """Every page, following ``next`` from the first."""
    pages, after = [], None
    for _ in range(10_000):
        page = live.query(
            NOW, LIVE_AFTER, DeviceFilter(**{**vars_of(where), "after": after}), limit
        )
        pages.append(page.page)
        if page.next_cursor is None:
            return pages
        after = decode_cursor(page.next_cursor)
    raise AssertionError("the pages never ended")


def vars_of(where: DeviceFilter) -> dict[str, Any]:
    return {k: getattr(where, k) for k in ("node", "job", "kind", "min_risk", "firing")}


def expected_order(states: list[DomainState]) -> list[tuple[str, str]]:
    """ranked()'s order, with ties broken by (node, device)."""

    def key(st: DomainState) -> tuple[float, float, str, str]:
        assert st.forecast is not None and st.last is not None
        return (-st.forecast.risk_at(60), -st.last.used_frac, *st.domain)

    return [st.domain for st in sorted(states, key=key)]


@pytest.mark.parametrize("limit", [1, 7, 50, 257, 1000])
def test_pages_cover_every_domain_exactly_once_in_risk_order(limit: int) -> None:
    live = fleet()
    pages = walk(live, DeviceFilter(), limit)
    seen = [st.domain for page in pages for st in page]
    assert seen == expected_order(list(live.domains.values()))
    assert len(set(seen)) == 257
    assert all(len(p) == limit for p in pages[:-1]) and 0 < len(pages[-1]) <= limit
    # the same order ranked() gives, where the use does not tie
    ranked = [st.domain for st in live.ranked(NOW, LIVE_AFTER)]
    assert seen[:37] == [d for d in ranked if live.domains[d].forecast.risk_at(60) == 1.0]  # type: ignore[union-attr]


def test_filters_and_totals() -> None:
    live = fleet()
    states = list(live.domains.values())
    cases: list[tuple[DeviceFilter, list[DomainState]]] = [
        (DeviceFilter(node="node-003"), [s for s in states if s.domain[0] == "node-003"]),
        (DeviceFilter(node="node-00[0-2]"), [s for s in states if s.domain[0] < "node-003"]),
        (DeviceFilter(node="node-00"), []),  # exact without a glob character
        (DeviceFilter(job="train-[12]"), [s for s in states if s.job in ("train-1", "train-2")]),
        (DeviceFilter(job="*"), [s for s in states if s.job is not None]),
        (DeviceFilter(kind="host"), [s for s in states if s.last and s.last.kind == "host"]),
        (DeviceFilter(min_risk=0.5), [s for s in states if s.last and s.last.used_frac > 0.9]),
        (DeviceFilter(firing=True), [s for s in states if s.episodes["r"].firing]),
        (DeviceFilter(firing=False), [s for s in states if not s.episodes["r"].firing]),
        (
            DeviceFilter(node="node-0[0-1]*", kind="gpu", firing=False),
            [
                s
                for s in states
                if s.domain[0] < "node-020"
                and s.last
                and s.last.kind == "gpu"
                and not s.episodes["r"].firing
            ],
        ),
    ]
    assert len(cases[7][1]) == 37  # every 7th domain fires
    for where, want in cases:
        page = live.query(NOW, LIVE_AFTER, where, 1000)
        assert page.total == 257, where
        assert page.matched == len(want), where
        assert [s.domain for s in page.page] == expected_order(want), where
        paged = [s.domain for p in walk(live, where, 3) for s in p]
        assert paged == expected_order(want), where


def test_a_new_forecast_moves_the_domain_and_silent_domains_drop_out() -> None:
    live = fleet(16)
    first = live.query(NOW, LIVE_AFTER, DeviceFilter(), 100)  # fills the key cache
    calm = first.page[-1].domain
    assert live.domains[calm].forecast.risk_at(60) == 0.0  # type: ignore[union-attr]
    live.apply([sample(T0 + 1, 0.99, node=calm[0], device=calm[1])], NOW)
    page = live.query(NOW, LIVE_AFTER, DeviceFilter(), 100)
    assert calm in [s.domain for s in page.page[:3]]  # with the other risk-1 domains now
    later = NOW + LIVE_AFTER + 1  # the others last spoke at NOW: silent too long by then
    live.apply([sample(T0 + 2, 0.99, node=calm[0], device=calm[1])], later)
    page = live.query(later, LIVE_AFTER, DeviceFilter(), 100)
    assert (page.total, page.matched, [s.domain for s in page.page]) == (1, 1, [calm])


def test_cursors_round_trip_and_foreign_ones_are_refused() -> None:
    key = (-1.0, -0.5, -0.123456789012345, "node/a", "cgroup:/x y")
    assert decode_cursor(encode_cursor(key)) == key
    assert decode_cursor(encode_cursor((-0.0, 1e300, float("-inf"), "", ""))) == (
        -0.0,
        1e300,
        float("-inf"),
        "",
        "",
    )
    for bad in ("", "x", "!!!!", "A" * 31, "A" * 33, "A" * 32 + "=", "A" * 31 + "+"):
        with pytest.raises(ValueError, match="not a cursor this service gave out"):
            decode_cursor(bad)


def test_any_cursor_of_the_documented_shape_is_a_place_to_start() -> None:
    """Only the shape is checked (the OpenAPI pattern): a cursor from another version or
    made up starts the page somewhere, never a 500."""
    live = fleet(16)
    for odd in ("A" * 32, "_" * 35, "0" * 40 + "Zz", encode_cursor((-1.0, -1, -1, "\udc80", "x"))):
        key = decode_cursor(odd)
        live.query(NOW, LIVE_AFTER, DeviceFilter(after=key), 5)


# -- through the app ---------------------------------------------------------------------


@pytest.fixture
def client(redis_url: str, key_prefix: str) -> Iterator[TestClient]:
    settings = Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        partitions=2,
        consumer_name="devices-test",
        forecaster="predict_linear_w60s_h60s_gate0.80_full",
        max_ts_skew_s=0,
    )
    with TestClient(create_app(settings)) as c:
        yield c


def test_the_route_pages_filters_and_counts(client: TestClient) -> None:
    samples = [
        {
            "ts": T0 + k,
            "node": f"rack{i // 4}-n{i % 4}",
            "device": f"gpu{i % 2}",
            "kind": "gpu" if i % 3 else "host",
            "total_bytes": 80 * GIB,
            "used_bytes": (10 + 3 * i + k) * GIB,
            **({"job": f"llm-{i % 3}"} if i % 2 else {}),
        }
        for i in range(20)
        for k in range(3)
    ]
    assert client.post("/v1/samples", json={"samples": samples}).status_code == 202
    assert wait_until(lambda: client.get("/v1/devices").json()["total"] == 20)
    everything = client.get("/v1/devices", params={"limit": 1000}).json()
    assert (everything["total"], everything["matched"], everything["count"]) == (20, 20, 20)
    assert everything["next"] is None and len(everything["devices"]) == 20
    order = [(d["node"], d["device"]) for d in everything["devices"]]
    assert [d["used_bytes"] for d in everything["devices"]] == sorted(
        (d["used_bytes"] for d in everything["devices"]), reverse=True
    )  # the rule's risks are all 0 this far from full: ranked by use
    seen: list[tuple[str, str]] = []
    params: dict[str, Any] = {"limit": 6}
    while True:
        page = client.get("/v1/devices", params=params).json()
        assert page["total"] == 20 and len(page["devices"]) <= 6
        seen += [(d["node"], d["device"]) for d in page["devices"]]
        if page["next"] is None:
            break
        params["cursor"] = page["next"]
    assert seen == order

    def nodes(**params: Any) -> list[str]:
        out = client.get("/v1/devices", params=params).json()
        return sorted(f"{d['node']}/{d['device']}" for d in out["devices"])

    assert nodes(node="rack1-n2") == ["rack1-n2/gpu0"]
    assert nodes(node="rack4-*") == [f"rack4-n{k}/gpu{k % 2}" for k in range(4)]
    assert len(nodes(job="llm-*")) == 10 and len(nodes(job="llm-1")) == 4
    assert len(nodes(kind="host")) == 7
    assert nodes(min_risk=0.5) == [] and nodes(firing=True) == []
    assert len(nodes(firing=False)) == 20
    filtered = client.get("/v1/devices", params={"kind": "host", "limit": 2}).json()
    assert (filtered["total"], filtered["matched"], len(filtered["devices"])) == (20, 7, 2)


@pytest.mark.parametrize(
    ("param", "value"),
    [
        ("limit", "0"),
        ("limit", "1001"),
        ("limit", "ten"),
        ("min_risk", "1.5"),
        ("min_risk", "-0.1"),
        ("kind", "tpu"),
        ("firing", "maybe"),
        ("cursor", "not-a-cursor"),
        ("cursor", "A" * 31),
        ("node", "x" * 513),
    ],
)
def test_a_bad_parameter_is_a_422_that_names_it(client: TestClient, param: str, value: str) -> None:
    r = client.get("/v1/devices", params={param: value})
    assert r.status_code == 422, r.text
    assert [e["loc"] for e in r.json()["detail"]] == [["query", param]]


def test_the_document_describes_the_parameters_and_the_page(client: TestClient) -> None:
    doc = client.get("/openapi.json").json()
    op = doc["paths"]["/v1/devices"]["get"]
    names = {p["name"] for p in op["parameters"]}
    assert names == {"limit", "cursor", "node", "job", "kind", "min_risk", "firing"}
    assert set(op["responses"]) == {"200", "401", "422"}
    page = op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    fields = doc["components"]["schemas"][page.rsplit("/", 1)[1]]["properties"]
    assert {"total", "matched", "count", "next", "devices", "alert_horizon_s"} <= set(fields)


def test_bench_api_reports_what_it_measured() -> None:
    """The benchmark's figures are printed, never asserted; it must run and fill them in."""
    out = bench_api(domains=40, requests=2)
    assert (out["domains"], out["live"]) == (40, 40)
    assert out["p99_ms"] >= out["p50_ms"] > 0
    assert out["queries"]["default"]["matched"] == 40
    assert out["queries"]["node_glob"]["matched"] == 40  # node-00000 .. node-00004
    assert set(out["queries"]) >= {"default", "limit_1000", "min_risk"}
    assert "second_page" not in out["queries"]  # 40 domains fit on one page
