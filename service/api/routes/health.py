"""Liveness, readiness and Prometheus metrics (unversioned, never behind the token)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from fastapi import APIRouter, Response
from fastapi.responses import PlainTextResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from oomcast.model.wire import answer_async
from oomcast.service.api.deps import Ctx, write_refusal
from oomcast.service.context import ServiceContext
from oomcast.service.metrics import DomainRow

router = APIRouter(tags=["health"])

# How long the write probe's key lives: long enough to be seen, short enough to leave no trace.
PROBE_TTL_MS = 5_000
CHECK_TIMEOUT_S = 1.0


@dataclass(frozen=True, slots=True)
class Check:
    """One readiness check's verdict; ``problem`` says why when it is not ok."""

    name: str
    ok: bool
    problem: str | None = None


async def check_redis(ctx: ServiceContext) -> list[Check]:
    """Redis answers (PING), and takes writes: a SET of a short-lived key of this replica's
    own, since a Redis at maxmemory (noeviction) or a read-only replica still answers PING
    while refusing every sample."""
    try:
        await asyncio.wait_for(answer_async(ctx.redis.ping()), timeout=CHECK_TIMEOUT_S)
    except Exception as exc:  # any failure to answer means not ready
        problem = f"Redis: {type(exc).__name__}: {exc}"
        return [Check("redis", False, problem), Check("redis_writable", False, problem)]
    key = f"{ctx.keys.prefix}:probe:{ctx.settings.consumer_name}"
    try:
        await asyncio.wait_for(ctx.redis.set(key, b"1", px=PROBE_TTL_MS), timeout=CHECK_TIMEOUT_S)
    except Exception as exc:
        reason = write_refusal(exc)
        problem = (
            f"{reason}, so it refuses writes: {exc}"
            if reason
            else f"Redis write probe failed: {type(exc).__name__}: {exc}"
        )
        return [Check("redis", True), Check("redis_writable", False, problem)]
    return [Check("redis", True), Check("redis_writable", True)]


async def check_ingest(ctx: ServiceContext) -> list[Check]:
    if ctx.ingestor.healthy():
        return [Check("ingest", True)]
    problem = (
        "ingest has not talked to Redis for 10 s"
        if ctx.ingestor.ready.is_set()
        else "ingest is still draining its pending entries"
    )
    return [Check("ingest", False, problem)]


# Every check /readyz runs, in order; the service is ready when all pass. Add one here to
# make readiness depend on another part of the service.
READINESS_CHECKS: list[Callable[[ServiceContext], Awaitable[list[Check]]]] = [
    check_redis,
    check_ingest,
]


RISK_BANDS = ("low", "elevated", "high", "critical")


def risk_band(risk: float) -> str:
    """The band of oomcast_domains_by_risk a risk at the alert horizon falls in."""
    return (
        "critical"
        if risk >= 0.8
        else "high"
        if risk >= 0.5
        else ("elevated" if risk >= 0.2 else "low")
    )


@router.get("/livez")
def livez() -> dict[str, str]:
    """The process answers; says nothing of its dependencies."""
    return {"status": "ok"}


@router.get(
    "/readyz",
    responses={503: {"description": "Not ready: the same body, `problem` says why."}},
)
async def readyz(ctx: Ctx, response: Response) -> dict[str, object]:
    """Ready when Redis answers and takes writes and the ingest loop has caught up with its
    own backlog. ``checks`` has every check's verdict; ``problem`` the first failure's cause."""
    checks = [c for run in READINESS_CHECKS for c in await run(ctx)]
    verdict = {c.name: c.ok for c in checks}
    ctx.metrics.redis_up.set(1 if verdict.get("redis") else 0)
    failed = [c for c in checks if not c.ok]
    if failed:
        response.status_code = 503
    return {
        "status": "not ready" if failed else "ready",
        "redis": verdict.get("redis", False),
        "redis_writable": verdict.get("redis_writable", False),
        "ingest": verdict.get("ingest", False),
        "checks": verdict,
        "model_version": ctx.detector.forecaster.version,
        # a challenger scored beside it, acting on nothing (OOMCAST_SHADOW_MODEL_PATH)
        "shadow_model_version": next((s.forecaster.version for s in ctx.live.shadows), None),
        # why this replica did not follow the newest model swap (GET /v1/model), if it did not
        "model_swap_problem": ctx.switch.problem if ctx.switch is not None else None,
        "forecaster": {
            "kind": ctx.forecaster_kind,
            "reason": ctx.forecaster_reason,
            "provider": ctx.provider,
        },
        "partitions": ctx.ingestor.partitions,
        "problem": next((c.problem for c in failed if c.problem), None),
        # reported, never a reason for 503: "degraded" means alerts are late, not lost
        "deliveries": await ctx.deliveries.health(),
    }


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={
        200: {
            "description": "Prometheus text exposition format.",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        },
    },
)
async def metrics(ctx: Ctx) -> Response:
    """The service's Prometheus metrics."""
    live = ctx.live.ranked(time.time(), ctx.settings.live_after_s)
    ctx.metrics.domains.set(len(live))
    ctx.metrics.domains_held.set(len(ctx.live.domains))
    ctx.metrics.domain_forecasts(
        [
            DomainRow(
                st.domain[0], st.domain[1], st.last.kind, st.job, st.forecast, st.last.used_frac
            )
            for st in live
            if st.last is not None and st.forecast is not None
        ],
        ctx.settings.metrics_domains,
    )
    bands = dict.fromkeys(RISK_BANDS, 0)
    firing = 0
    for st in live:
        bands[risk_band(st.forecast.risk_at(ctx.live.horizon_s) if st.forecast else 0.0)] += 1
        firing += any(ep.firing for ep in st.episodes.values())
    for band, n in bands.items():
        ctx.metrics.domains_by_risk.labels(band=band).set(n)
    ctx.metrics.alerts_firing.set(firing)
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
