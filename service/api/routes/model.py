"""``GET /v1/model`` and ``POST /v1/model``: which model acts, and swapping it without a
restart (service/model_swap.py)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field

from oomcast.service.api.deps import Authorized, Ctx, unavailable, write_refusal
from oomcast.service.api.responses import V1, WITH_BODY, Problem, responses
from oomcast.service.model_swap import SwapError, SwapNotRecorded

router = APIRouter(tags=["model"], dependencies=[Authorized])


SHA256_FIELD = Field(
    None,
    pattern=r"^[0-9a-f]{64}$",
    description="the model file's SHA-256: the swap is refused if the file differs",
)
REASON_FIELD = Field("", max_length=500, description="why, for the audit log")


class LoadModel(BaseModel):
    """Swap in a model from a path (or a baseline, by name)."""

    model_config = ConfigDict(extra="forbid")

    model: str = Field(
        min_length=1,
        max_length=4096,
        description="an ONNX model's path on the service's machines, or a baseline's name",
    )
    sha256: str | None = SHA256_FIELD
    reason: str = REASON_FIELD


class PromoteShadow(BaseModel):
    """Make the shadow model the champion, with its per-domain states."""

    model_config = ConfigDict(extra="forbid")

    promote: Literal["shadow"]
    reason: str = REASON_FIELD


@router.get("/model", responses=responses(*V1))
async def get_model(ctx: Ctx) -> dict[str, Any]:
    """The model that acts, the shadow beside it, and the swaps this replica made or
    followed (newest first)."""
    assert ctx.switch is not None
    return ctx.switch.describe()


SWAP_ANSWERS = {
    **responses(*WITH_BODY, 403, 409, 503),
    404: {
        "model": Problem,
        "description": "No model file at that path, nor a baseline of that name.",
    },
    409: {
        "model": Problem,
        "description": "The swap cannot be made: no shadow to promote, a file that is not a model"
        " this service can run, or not the file the SHA-256 names.",
    },
}


@router.post("/model", responses=SWAP_ANSWERS)
async def swap_model(ctx: Ctx, body: LoadModel | PromoteShadow) -> dict[str, Any]:
    """Swap the model that acts, between two ingest rounds, and record it in the audit
    stream; replicas sharing the service's secret follow within seconds. Promoting the
    shadow keeps every domain's state warm; a model loaded from a path starts cold."""
    if ctx.settings.api_token is None:
        raise HTTPException(
            403,
            "model swaps need OOMCAST_API_TOKEN set on the service: a swap decides what pages"
            " people, and without a token anyone who reaches the API could make it",
        )
    assert ctx.switch is not None
    try:
        if isinstance(body, PromoteShadow):
            return await ctx.switch.request(promote=True, reason=body.reason)
        return await ctx.switch.request(source=body.model, sha256=body.sha256, reason=body.reason)
    except SwapError as exc:
        raise HTTPException(exc.status, str(exc)) from None
    except SwapNotRecorded as exc:
        cause = exc.__cause__ if exc.__cause__ is not None else exc
        why = write_refusal(cause) or "Redis failed"
        raise unavailable(f"{why}: {exc}") from None
