from __future__ import annotations

import time
from typing import Annotated, Any, Literal

import orjson
from fastapi import APIRouter, HTTPException, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field

from oomcast.model.schema import MAX_NAME_CHARS
from oomcast.service.api.deps import Authorized, Ctx, unprocessable
from oomcast.service.api.device_query import (
    CURSOR_PATTERN,
    CURSORS_HEADER,
    BadCursor,
    DeviceFilter,
    decode_cursor,
    encode_cursor,
    sort_key,
)
from oomcast.service.api.responses import V1, Responses, responses

router = APIRouter(tags=["devices"], dependencies=[Authorized])
# These handlers are async on purpose: they then run on the event loop, between ingest
# batches, and never see the live state while the ingest loop is changing it.


class RuleState(BaseModel):
    firing: bool
    episode: str | None
    suppressed: bool


class AlertState(BaseModel):
    firing: bool = Field(..., description="any rule's episode is firing on the domain")
    episode: str | None = Field(..., description="the earliest firing episode's id")
    fired_at: float | None
    rules: dict[str, RuleState] = Field(..., description="per rule name")


class PhaseOutlook(BaseModel):
    """The earliest scheduled phase that will not fit (docs/phases.md)."""

    phase: Literal["eval", "checkpoint", "optimizer"]
    in_s: float = Field(..., description="seconds until it runs, at the job's step rate")
    steps_away: int
    extra_bytes: int = Field(..., description="what the phase needs above the current use")
    headroom_bytes: int = Field(
        ...,
        description=(
            "room for the phase when it comes, less the 2% margin: total less use, or, where"
            " the hook reports the allocator's figures, total less use plus its cached free"
            " bytes; less what a level that creeps up between steps takes until then"
        ),
    )
    measured: bool = Field(..., description="extra_bytes was measured, not announced")


class ProcessShare(BaseModel):
    """One process on a GPU, as NVML reported it in the latest sample."""

    pid: int
    used_bytes: int | None = Field(..., description="null where NVML gives no figure (vGPU, MIG)")
    job: str | None = Field(None, description="the job the agent matched the process to")


class DeviceSummary(BaseModel):
    node: str
    device: str
    kind: str
    job: str | None
    used_bytes: int
    total_bytes: int
    used_frac: float
    observed_at: float = Field(..., description="ts of the latest sample")
    risk: dict[str, float] = Field(..., description="horizon in seconds -> risk of OOM")
    alert_risk: float = Field(..., description="risk at alert_horizon_s: the sort key")
    time_to_oom_s: float | None
    model_version: str
    allocated_bytes: int | None = Field(..., description="live tensor bytes (from the hook)")
    reserved_bytes: int | None = Field(..., description="caching-allocator reserved (hook)")
    cause: str | None = Field(
        ...,
        description="why the OOM is coming (docs/diagnosis.md): leak, growing_cache,"
        " fragmentation, batch_growth, phase:eval (and other phases), neighbour or unknown;"
        " null while no OOM is in sight (no alert firing, no time to OOM, no phase that will"
        " not fit), when `evidence` says so and `remedies` is empty",
    )
    remedies: list[str] = Field(..., description="what would fix it, as actions")
    evidence: str | None = Field(..., description="what the cause was read from")
    cause_thin: list[str] = Field(..., description="evidence that was missing")
    phase: PhaseOutlook | None = Field(..., description="a scheduled phase that will not fit")
    alert: AlertState
    samples_seen: int
    ooms_seen: int
    last_oom_ts: float | None
    processes: list[ProcessShare] | None = Field(
        ...,
        description="who uses the GPU, largest first, in the latest sample (GPUs sampled"
        " through NVML; null where the sample names no processes)",
    )


class DevicesPage(BaseModel):
    """One page of live domains, riskiest first."""

    alert_horizon_s: int
    total: int = Field(..., description="every live domain, before filters")
    matched: int = Field(..., description="live domains that pass the filters")
    count: int = Field(..., description="the same as matched (kept for older clients)")
    next: str | None = Field(
        ..., description="pass as `cursor` for the next page; null on the last one"
    )
    devices: list[DeviceSummary]


_PAGE: Responses = {200: {"model": DevicesPage, "description": "One page, riskiest first."}}


@router.get("/devices", response_class=JSONResponse, responses={**_PAGE, **responses(*V1, 422)})
async def list_devices(
    request: Request,
    ctx: Ctx,
    limit: Annotated[int, Query(ge=1, le=1000, description="domains per page")] = 100,
    cursor: Annotated[
        str | None,
        Query(
            max_length=8192,
            pattern=CURSOR_PATTERN,
            description="the `next` of the previous page, to read the page after it",
        ),
    ] = None,
    node: Annotated[
        str | None, Query(max_length=MAX_NAME_CHARS, description="node name, or a glob: `gpu-a*`")
    ] = None,
    job: Annotated[
        str | None,
        Query(
            max_length=MAX_NAME_CHARS,
            description="glob on the job (domains without one never match)",
        ),
    ] = None,
    kind: Annotated[Literal["gpu", "host"] | None, Query()] = None,
    min_risk: Annotated[
        float | None,
        Query(ge=0.0, le=1.0, description="at least this risk at the alert horizon"),
    ] = None,
    firing: Annotated[bool | None, Query(description="only domains firing (or not)")] = None,
) -> Response:
    """Live memory domains with their latest forecast, riskiest first, a page at a time.

    Sorted by risk at the alert horizon, then risk at any horizon, then use, then name.
    Follow ``next`` (as ``cursor``) with the same filters to walk every match once."""
    try:
        after = None if cursor is None else decode_cursor(cursor)
    except BadCursor as exc:
        raise unprocessable(["query", "cursor"], str(exc)) from None
    where = DeviceFilter(
        node=node, job=job, kind=kind, min_risk=min_risk, firing=firing, after=after
    )
    horizon = ctx.live.horizon_s
    page = ctx.live.query(time.time(), ctx.settings.live_after_s, where, limit)
    body: dict[str, Any] = {
        "alert_horizon_s": horizon,
        "total": page.total,
        "matched": page.matched,
        "count": page.matched,
        "next": page.next_cursor,
        "devices": [st.summary(horizon) for st in page.page],
    }
    if request.headers.get(CURSORS_HEADER):  # asked by the front of `serve --workers`
        body["cursors"] = [encode_cursor(sort_key(st, horizon)) for st in page.page]
    # Serialised here, not by FastAPI's encoder, which walks every value of every summary;
    # with orjson, not the json module, a 1,000-row page took 25 ms instead of 35 in process
    return Response(
        orjson.dumps(body, option=orjson.OPT_SERIALIZE_NUMPY), media_type="application/json"
    )


@router.get("/devices/{node}/{device:path}", responses=responses(*V1, 404, 422))
async def get_device(
    node: str, device: str, ctx: Ctx, history: int = Query(300, ge=0, le=100_000)
) -> dict[str, Any]:
    """One domain with its recent history (``device`` may contain slashes: cgroup paths)."""
    st = ctx.live.domains.get((node, device))
    if st is None or st.forecast is None:
        raise HTTPException(404, f"no live domain {node}/{device}")
    horizon = ctx.live.horizon_s
    points = st.history.points(history) if history else []
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
