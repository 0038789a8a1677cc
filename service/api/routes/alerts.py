from __future__ import annotations

import json
from typing import Any, cast

from fastapi import APIRouter, Query
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.service.api.deps import Authorized, Ctx, unavailable
from oomcast.service.api.responses import V1, responses

router = APIRouter(tags=["alerts"], dependencies=[Authorized])


@router.get("/alerts", responses=responses(*V1, 422, 503))
async def list_alerts(ctx: Ctx, limit: int = Query(100, ge=1, le=10_000)) -> dict[str, Any]:
    """Recent alerts, newest first, from the ``oomcast:alerts`` audit stream."""
    try:
        entries: list[tuple[bytes, dict[bytes, bytes]]] = cast(
            Any, await ctx.redis.xrevrange(ctx.keys.alerts, count=limit)
        )
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise unavailable(f"Redis is unreachable: {exc}") from None
    out = []
    for entry_id, fields in entries:
        raw = fields.get(b"alert")
        if raw is None:
            continue
        item = json.loads(raw)
        item["id"] = entry_id.decode()
        out.append(item)
    return {"count": len(out), "alerts": out}
