from __future__ import annotations

import time
from typing import Any

from fastapi import APIRouter, HTTPException, Query

from oomcast.service.api.deps import Authorized, Ctx
from oomcast.service.api.responses import V1, responses

router = APIRouter(tags=["devices"], dependencies=[Authorized])
# These handlers are async on purpose: they then run on the event loop, between ingest
# batches, and never see the live state while the ingest loop is changing it.


@router.get("/devices", responses=responses(*V1, 422))
async def list_devices(ctx: Ctx, limit: int = Query(1000, ge=1, le=100_000)) -> dict[str, Any]:
    """Every live memory domain with its latest forecast, riskiest first."""
    horizon = ctx.live.horizon_s
    states = ctx.live.ranked(time.time(), ctx.settings.live_after_s)
    return {
        "alert_horizon_s": horizon,
        "count": len(states),
        "devices": [st.summary(horizon) for st in states[:limit]],
    }


@router.get("/devices/{node}/{device:path}", responses=responses(*V1, 404, 422))
async def get_device(
    node: str, device: str, ctx: Ctx, history: int = Query(300, ge=0, le=100_000)
) -> dict[str, Any]:
    """One domain with its recent history (``device`` may contain slashes: cgroup paths)."""
    st = ctx.live.domains.get((node, device))
    if st is None or st.forecast is None:
        raise HTTPException(404, f"no live domain {node}/{device}")
    horizon = ctx.live.horizon_s
    points = list(st.history)[-history:] if history else []
    out = st.summary(horizon)
    out["history"] = [
        {
            "ts": p.ts,
            "used_bytes": p.used_bytes,
            "total_bytes": p.total_bytes,
            "alert_risk": round(p.risk, 4),
            "time_to_oom_s": p.time_to_oom_s,
        }
        for p in points
    ]
    return out
