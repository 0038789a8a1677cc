from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from oomcast.service.api.deps import Authorized, Ctx
from oomcast.service.api.responses import V1, responses
from oomcast.service.pipeline.rules import describe_rules

router = APIRouter(tags=["rules"], dependencies=[Authorized])


@router.get("/rules", responses=responses(*V1))
async def list_rules(ctx: Ctx) -> dict[str, Any]:
    """The rules in force, highest priority first, and which actions are configured."""
    dispatcher = ctx.dispatcher
    return {
        "source": ctx.settings.rules_path(),
        "rules": describe_rules(ctx.rules),
        "configured": {
            a: dispatcher.configured(a) if dispatcher else False
            for a in ("webhook", "alertmanager", "checkpoint", "shed")
        },
    }
