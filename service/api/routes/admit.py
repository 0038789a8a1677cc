"""``POST /v1/admit``: a job's preflight profile and a GPU -> whether it fits there now."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from oomcast.model.schema import MAX_NAME_CHARS
from oomcast.service.api.admission import CONTEXT_BYTES, admit
from oomcast.service.api.deps import Authorized, Ctx
from oomcast.service.api.responses import WITH_BODY, responses

router = APIRouter(tags=["admission"], dependencies=[Authorized])
MAX_BYTES = 1 << 50  # 1 PiB: far above any GPU; a larger figure is a unit mistake


def _not_a_bool(v: Any) -> Any:
    """JSON true is not a number here (pydantic's lax mode would read it as 1)."""
    if isinstance(v, bool):
        raise ValueError("must be a number, not true or false")
    return v


class Profile(BaseModel):
    """What ``oomcast preflight --json`` prints (other keys are accepted and ignored)."""

    model_config = ConfigDict(extra="allow")
    peak_reserved_bytes: int = Field(
        ..., gt=0, le=MAX_BYTES, description="the job's peak reserved by the caching allocator"
    )
    context_bytes: int = Field(
        CONTEXT_BYTES,
        ge=0,
        le=MAX_BYTES,
        description="device memory the job's process takes outside the allocator (its CUDA"
        " context); default 768 MiB, as preflight's",
    )

    _no_bools = field_validator("peak_reserved_bytes", "context_bytes", mode="before")(_not_a_bool)


class AdmitBody(BaseModel):
    node: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    device: str = Field(..., min_length=1, max_length=MAX_NAME_CHARS)
    profile: Profile
    margin_frac: float = Field(
        0.02, ge=0.0, le=0.5, description="share of the GPU kept free on top (default 2%)"
    )

    _no_bools = field_validator("margin_frac", mode="before")(_not_a_bool)


@router.post("/admit", responses=responses(*WITH_BODY, 404))
def post_admit(body: AdmitBody, ctx: Ctx) -> dict[str, Any]:
    """Whether a job with this preflight profile fits on the GPU ``node``/``device`` beside
    what runs there now: compared with the residents' highest use in the history held, plus
    the job's CUDA context and a margin. ``fits`` is false while the GPU's own forecast is
    firing. ``headroom_bytes`` is what would be left (negative: how much is missing)."""
    st = ctx.live.domains.get((body.node, body.device))
    if st is None or st.last is None:
        raise HTTPException(404, f"no live domain {body.node}/{body.device}")
    if st.last.kind != "gpu":
        raise HTTPException(404, f"{body.node}/{body.device} is a {st.last.kind} domain, not a GPU")
    verdict = admit(
        st,
        body.profile.peak_reserved_bytes,
        context_bytes=body.profile.context_bytes,
        margin_frac=body.margin_frac,
    )
    return verdict.to_json()
