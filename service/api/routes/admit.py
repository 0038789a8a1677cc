"""``POST /v1/admit``: a job's preflight profile and a GPU -> whether it fits there now."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, HTTPException
from pydantic import BaseModel, ConfigDict, Field, field_validator

from oomcast.model.events import ARRIVAL, ArrivalEvent
from oomcast.model.schema import MAX_NAME_CHARS
from oomcast.service.api.admission import CONTEXT_BYTES, admit
from oomcast.service.api.deps import Authorized, Ctx
from oomcast.service.api.responses import WITH_BODY, responses
from oomcast.service.pipeline.phases import on_arrival

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
    arrives_in_s: float | None = Field(
        None,
        ge=0.0,
        le=86400.0,
        description="announce the placement: the job will start on this GPU in this many"
        " seconds. If it will not fit, the job running there is warned (cause phase:arrival)"
        " once the landing is within its alert rule's horizon, before the arrival lands."
        " Leave it out to only ask.",
    )
    job: str | None = Field(
        None, min_length=1, max_length=MAX_NAME_CHARS, description="the arriving job's name"
    )

    _no_bools = field_validator("margin_frac", "arrives_in_s", mode="before")(_not_a_bool)


@router.post("/admit", responses=responses(*WITH_BODY, 404))
def post_admit(body: AdmitBody, ctx: Ctx) -> dict[str, Any]:
    """Whether a job with this preflight profile fits on the GPU ``node``/``device`` beside
    what runs there now: compared with the residents' highest use in the history held, plus
    the job's CUDA context and a margin. ``fits`` is false while the GPU's own forecast is
    firing. ``headroom_bytes`` is what would be left (negative: how much is missing).
    With ``arrives_in_s`` the placement is announced: the arrival is kept on the GPU's
    domain until 30 s after it lands, and while it would not fit, the forecast of the job
    running there carries it (risk 0.95 from the landing on, cause ``phase:arrival``), so
    its alert rule fires once the landing is within the rule's horizon."""
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
    out = verdict.to_json()
    if body.arrives_in_s is not None:
        lands_at = st.last.ts + body.arrives_in_s  # on the domain's own clock
        on_arrival(
            st,
            ArrivalEvent(
                ts=st.last.ts,
                node=body.node,
                device=body.device,
                event=ARRIVAL,
                job=body.job,
                need_bytes=verdict.job_needs_bytes,
                lands_at=lands_at,
                resident_peak_bytes=verdict.resident_peak_bytes,
            ),
        )
        out["announced"] = {"job": body.job, "lands_at": lands_at}
    return out
