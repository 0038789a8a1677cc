"""``oomcast bench api``: what ``GET /v1/devices`` costs at fleet size, measured.

Builds the service's own context (forecaster, rules, live state) and app without starting
its lifespan, so no Redis is needed: nothing here touches it. Fills the live state with N
domains through the real forecast path (``LiveState.apply``, the call the ingest loop
makes, so the service computes the embeddings), then times requests through the whole ASGI
stack (edge middleware, auth, validation, serialisation) over httpx's in-process transport:
what a client on the same host would see, less the network.
"""

from __future__ import annotations

import asyncio
import math
import random
import statistics
import time
from typing import Any

import httpx

from oomcast.model.schema import Sample
from oomcast.service.main import build_context, create_app
from oomcast.service.settings import Settings

GIB = 1 << 30
_ROUNDS = 5  # samples per domain: enough history for the forecasts to differ


def _fill(live: Any, n: int, now: float) -> None:
    rng = random.Random(0)
    start = [rng.uniform(0.2, 0.95) for _ in range(n)]
    slope = [rng.choice((0.0, 0.0, 0.002, 0.01, 0.03)) for _ in range(n)]
    for k in range(_ROUNDS):
        batch = [
            Sample(
                ts=now - _ROUNDS + k,
                node=f"node-{i // 8:05d}",
                device=f"gpu{i % 8}",
                kind="gpu",
                total_bytes=80 * GIB,
                used_bytes=int(min(1.0, start[i] + slope[i] * k) * 80 * GIB),
                job=f"job-{i // 64:04d}",
            )
            for i in range(n)
        ]
        live.apply(batch, now)


def _quantiles(lat: list[float]) -> tuple[float, float]:
    """Median and nearest-rank p99 (the slowest request when fewer than 100 were timed)."""
    lat = sorted(lat)
    return round(statistics.median(lat), 3), round(lat[math.ceil(0.99 * len(lat)) - 1], 3)


async def _time_queries(app: Any, queries: dict[str, dict[str, Any]], requests: int) -> Any:
    out: dict[str, Any] = {}
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://bench") as http:
        first = (await http.get("/v1/devices")).json()
        if first["next"] is not None:  # more than one page
            queries = {**queries, "second_page": {"cursor": first["next"]}}
        for name, params in queries.items():
            lat, size, matched = [], 0, 0
            for _ in range(requests):
                t0 = time.perf_counter()
                r = await http.get("/v1/devices", params=params)
                lat.append((time.perf_counter() - t0) * 1000)
                if r.status_code != 200:
                    raise RuntimeError(f"bench api: {name} answered {r.status_code}: {r.text}")
                size, matched = len(r.content), r.json()["matched"]
            p50, p99 = _quantiles(lat)
            out[name] = {"params": params, "matched": matched, "bytes": size}
            out[name] |= {"p50_ms": p50, "p99_ms": p99}
    return out


def bench_api(domains: int = 10_000, requests: int = 50) -> dict[str, Any]:
    """Time ``GET /v1/devices`` over ``domains`` live domains, ``requests`` times per query;
    ``p50_ms``/``p99_ms`` at the top are the default page's, the worst query's beside them."""
    settings = Settings(redis_url="redis://127.0.0.1:1/0", api_token=None)  # never contacted
    ctx = build_context(settings)
    app = create_app(settings)
    app.state.ctx = ctx  # what the lifespan would do; the ingest loop is not started
    now = time.time()
    t0 = time.perf_counter()
    _fill(ctx.live, domains, now)
    fill_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ctx.live.ranked(now, settings.live_after_s)
    sort_ms = (time.perf_counter() - t0) * 1000
    queries: dict[str, dict[str, Any]] = {
        "default": {},
        "limit_1000": {"limit": 1000},
        "node_glob": {"node": "node-000*"},
        "job_glob_min_risk": {"job": "job-01*", "min_risk": 0.1},
        "min_risk": {"min_risk": 0.5},
        "firing": {"firing": "true"},
    }
    timed = asyncio.run(_time_queries(app, queries, requests))
    default = timed["default"]
    return {
        "domains": domains,
        "live": len(ctx.live.live(time.time(), settings.live_after_s)),
        "forecaster": ctx.detector.forecaster.version,
        "requests_per_query": requests,
        "fill_s": round(fill_s, 2),
        "full_sort_ms": round(sort_ms, 3),  # LiveState.ranked: what a request used to cost
        "p50_ms": default["p50_ms"],
        "p99_ms": default["p99_ms"],
        "worst_p99_ms": max(q["p99_ms"] for q in timed.values()),
        "queries": timed,
    }
