"""``GET /v1/scorecard``: how the forecaster did on this fleet's own jobs (service/scorecard.py)."""

from __future__ import annotations

import time
from typing import Any, Literal

from fastapi import APIRouter, Query
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.service.api.deps import Authorized, Ctx, unavailable, unprocessable
from oomcast.service.api.responses import V1, responses
from oomcast.service.scorecard import SINCE_PATTERN, parse_since, scorecard

router = APIRouter(tags=["scorecard"], dependencies=[Authorized])


@router.get("/scorecard", responses=responses(*V1, 422, 503))
async def get_scorecard(
    ctx: Ctx,
    since: str = Query(
        "7d",
        pattern=SINCE_PATTERN,
        description="a span back from now (7d, 24h, 90m, 3600s, 2w) or unix seconds",
    ),
    until: float | None = Query(
        None, ge=0, le=1e11, allow_inf_nan=False, description="unix seconds (default: now)"
    ),
    by: Literal["kind", "node", "job", "cause", "model_version"] | None = Query(
        None, description="split each model's figures by one of these"
    ),
) -> dict[str, Any]:
    """Per scored model (the champion, and a shadow when one runs): OOMs warned 30 s and
    10 s ahead (recall, per class), precision, median lead, false alarms per 1,000
    job-hours, time-to-OOM error, near misses and censored alerts, over the window."""
    now = time.time()
    try:
        start = parse_since(since, now)
    except ValueError as exc:
        raise unprocessable(["query", "since"], str(exc)) from None
    end = now if until is None else until  # before ``since``: an empty window
    store = ctx.outcomes
    if store is None:
        raise unavailable("outcomes are not kept (OOMCAST_OUTCOMES=false)")
    try:
        read = await store.read(start, end)
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise unavailable(f"Redis is unreachable: {exc}") from None
    return scorecard(read, start, end, by)
