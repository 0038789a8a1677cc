"""``oomcast bench api``: what the HTTP API costs, measured.

``bench_api`` (``GET /v1/devices`` at fleet size) builds the service's own context
(forecaster, rules, live state) and app without starting its lifespan, so no Redis is
needed: nothing here touches it. Fills the live state with N domains through the real
forecast path (``LiveState.apply``, the call the ingest loop makes, so the service computes
the embeddings), then times requests through the whole ASGI stack (edge middleware, auth,
validation, serialisation) over httpx's in-process transport: what a client on the same
host would see, less the network.

``bench_predict`` (``POST /v1/predict``, ``--predict``) runs the real thing end to end: an
``oomcast serve`` process (uvicorn, the shipped model, a bearer token) against a private
in-memory ``redis-server``, and N httpx clients on real sockets, each posting 600-sample
windows back to back for a fixed time: requests/s and latency as a user would see them.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import random
import secrets
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from oomcast.bench.load import cpu_seconds, rss_mb
from oomcast.bench.procs import FaultBenchError, Procs, RedisServer, start_service
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
    from oomcast.service.pipeline.state import tune_gc

    settings = Settings(redis_url="redis://127.0.0.1:1/0", api_token=None)  # never contacted
    ctx = build_context(settings)
    tune_gc()  # as oomcast serve does at start-up, before any domain reports
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


class ApiBenchError(RuntimeError):
    """The predict bench cannot run (no redis-server, a service that never started, an
    answer other than 200); the message says what."""


PREDICT_HZ = 10.0  # the agent's default rate: a 600-sample window is its last minute
PREDICT_BODIES = 8  # distinct windows (domains) the clients take in turn


def parse_concurrency(text: str) -> list[int]:
    """``"1,16"`` -> ``[1, 16]``; a ValueError naming the part that is not a count >= 1."""
    out: list[int] = []
    for part in text.split(","):
        try:
            n = int(part.strip())
        except ValueError:
            n = 0
        if n < 1:
            raise ValueError(f"--concurrency {text!r}: {part.strip()!r} is not a count >= 1")
        out.append(n)
    return out


def predict_window(index: int, window: int, end_ts: float) -> list[dict[str, Any]]:
    """The last ``window`` samples of one GPU at 10 Hz, as its agent takes them: used memory
    drifting from its own start at its own rate (some towards an OOM), ending at ``end_ts``."""
    rng = random.Random(index)
    total = 80 * GIB
    frac, drift = rng.uniform(0.3, 0.7), rng.choice((0.0, 0.0005, 0.002, 0.006))
    out: list[dict[str, Any]] = []
    for k in range(window):
        frac = min(0.995, max(0.01, frac + drift + rng.gauss(0, 0.0005)))
        used = int(frac * total)
        out.append(
            {
                "ts": round(end_ts - (window - 1 - k) / PREDICT_HZ, 3),
                "node": f"bench-node-{index:03d}",
                "device": f"gpu{index % 8}",
                "kind": "gpu",
                "total_bytes": total,
                "used_bytes": used,
                "allocated_bytes": int(used * 0.9),
                "reserved_bytes": used,
                "peak_bytes": used,
                "alloc_retries": 0,
                "job": f"job-{index:03d}",
            }
        )
    return out


async def _post(http: httpx.AsyncClient, body: bytes) -> float:
    """One ``POST /v1/predict``; its latency in ms. Anything but 200 stops the bench."""
    t0 = time.perf_counter()
    r = await http.post("/v1/predict", content=body)
    ms = (time.perf_counter() - t0) * 1000
    if r.status_code != 200:
        raise ApiBenchError(f"bench api --predict: the service answered {r.status_code}: {r.text}")
    return ms


async def _load(
    base: str, token: str, bodies: list[bytes], concurrency: int, seconds: float
) -> tuple[list[float], float]:
    """``concurrency`` clients, each posting the next body as soon as its last answer came,
    until ``seconds`` have passed; every latency (ms) and the wall time until the last
    answer. Each client holds one keep-alive connection, as a dashboard or a job would."""
    headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=base, headers=headers, limits=limits, timeout=60.0
    ) as http:
        # open every connection (and warm the service) before the clock starts
        await asyncio.gather(*(_post(http, bodies[k % len(bodies)]) for k in range(concurrency)))
        lat: list[float] = []
        deadline = time.perf_counter() + seconds

        async def client(k: int) -> None:
            while time.perf_counter() < deadline:
                lat.append(await _post(http, bodies[k % len(bodies)]))
                k += concurrency

        t0 = time.perf_counter()
        await asyncio.gather(*(client(k) for k in range(concurrency)))
        return lat, time.perf_counter() - t0


def _measure(
    service_pid: int, base: str, token: str, bodies: list[bytes], window: int,
    concurrency: int, seconds: float,
) -> dict[str, Any]:  # fmt: skip
    cpu0, own0 = cpu_seconds(service_pid), time.process_time()
    lat, wall_s = asyncio.run(_load(base, token, bodies, concurrency, seconds))
    cpu1, own1 = cpu_seconds(service_pid), time.process_time()
    p50, p99 = _quantiles(lat)
    return {
        "requests": len(lat),
        "seconds": round(wall_s, 3),
        "requests_per_s": round(len(lat) / wall_s, 1),
        "samples_per_s": round(len(lat) * window / wall_s),
        "p50_ms": p50,
        "p99_ms": p99,
        "max_ms": round(max(lat), 3),
        "service_cpu_pct": round(100 * (cpu1 - cpu0) / wall_s, 1),
        "client_cpu_pct": round(100 * (own1 - own0) / wall_s, 1),
    }


def bench_predict(
    concurrency: list[int], seconds: float = 5.0, window: int = 600, model: str | None = None
) -> dict[str, Any]:
    """Time ``POST /v1/predict`` with ``window``-sample bodies from each of ``concurrency``
    clients in turn, ``seconds`` each, against a real ``oomcast serve``."""
    if not concurrency or min(concurrency) < 1:
        raise ValueError(f"bench api --predict: --concurrency {concurrency} must be counts >= 1")
    if window < 1:
        raise ValueError(f"bench api --predict: --window {window} must be at least 1 sample")
    if not seconds > 0:
        raise ValueError(f"bench api --predict: --seconds {seconds} must be more than 0")
    logs = Path(tempfile.mkdtemp(prefix="oomcast-bench-api-"))
    procs = Procs(logs)
    token = secrets.token_urlsafe(24)
    try:
        server = RedisServer(procs, logs, persist=False)
        server.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
        env.update(
            OOMCAST_REDIS_URL=server.url,
            OOMCAST_KEY_PREFIX=f"bench-{secrets.token_hex(4)}",
            OOMCAST_API_TOKEN=token,
        )
        if model is not None:
            env["OOMCAST_MODEL_PATH"] = str(Path(model).resolve())
        svc = start_service(procs, "predict", env)
        now = time.time()
        windows = [predict_window(i, window, now) for i in range(PREDICT_BODIES)]
        bodies = [json.dumps({"samples": w}).encode() for w in windows]
        first = httpx.post(
            f"{svc.base}/v1/predict",
            content=bodies[0],
            headers={"Authorization": f"Bearer {token}", "Content-Type": "application/json"},
            timeout=60.0,
        )
        if first.status_code != 200:
            raise ApiBenchError(
                f"bench api --predict: the service answered the first request"
                f" {first.status_code}: {first.text}"
            )
        runs = {
            str(c): _measure(svc.pid, svc.base, token, bodies, window, c, seconds)
            for c in concurrency
        }
        result = {
            "route": "POST /v1/predict",
            "window": window,
            "body_bytes": len(bodies[0]),
            "model_version": first.json()["model_version"],
            "seconds_per_run": seconds,
            "service_rss_mb": rss_mb(svc.pid),
            "by_concurrency": runs,
        }
    except (FaultBenchError, ApiBenchError) as exc:
        raise ApiBenchError(f"{exc}; the logs are kept in {logs}") from None
    finally:
        procs.close()
    shutil.rmtree(logs, ignore_errors=True)  # kept when something went wrong
    return result
