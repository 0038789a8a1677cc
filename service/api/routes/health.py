from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from oomcast.service.api.deps import Ctx

router = APIRouter(tags=["health"])


@router.get("/livez")
def livez() -> dict[str, str]:
    """The process answers; says nothing of its dependencies."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(ctx: Ctx, response: Response) -> dict[str, object]:
    """Ready when Redis answers and the ingest loop has caught up with its own backlog."""
    redis_ok = False
    problem = None
    try:
        redis_ok = bool(await asyncio.wait_for(ctx.redis.ping(), timeout=1.0))
    except Exception as exc:  # any failure to answer means not ready
        problem = f"Redis: {type(exc).__name__}: {exc}"
    ctx.metrics.redis_up.set(1 if redis_ok else 0)
    ingest_ok = ctx.ingestor.healthy()
    ready = redis_ok and ingest_ok
    if not ready:
        response.status_code = 503
        if problem is None:
            problem = (
                "ingest has not talked to Redis for 10 s"
                if ctx.ingestor.ready.is_set()
                else "ingest is still draining its pending entries"
            )
    return {
        "status": "ready" if ready else "not ready",
        "redis": redis_ok,
        "ingest": ingest_ok,
        "model_version": ctx.detector.forecaster.version,
        "forecaster": {
            "kind": ctx.forecaster_kind,
            "reason": ctx.forecaster_reason,
            "provider": ctx.provider,
        },
        "partitions": ctx.ingestor.partitions,
        "problem": problem,
    }


@router.get("/metrics")
async def metrics(ctx: Ctx) -> Response:
    ctx.metrics.domains.set(len(ctx.live.live(time.time(), ctx.settings.live_after_s)))
    return Response(generate_latest(ctx.metrics.registry), media_type=CONTENT_TYPE_LATEST)
