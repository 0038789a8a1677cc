"""The web dashboard: ``GET /`` and ``/static/...`` serve the page (files shipped in the
package under ``service/static``, no CDN, no build step), and one small API route gives what
``/v1/devices`` does not keep: a domain's allocator figures over time (``allocated_bytes``,
``reserved_bytes``, read back from its node's sample stream). docs/dashboard.md says what the
pages show.

The page itself needs no token (it holds no data); everything it shows comes from ``/v1``,
which the edge middleware guards as always. The files are read once, at import: they are a
few kilobytes, and a request then never touches the disk.
"""

from __future__ import annotations

import time
from importlib import resources
from typing import Annotated, Any, cast

from fastapi import APIRouter, HTTPException, Path, Query
from fastapi.responses import Response
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.model.schema import MAX_NAME_CHARS, SchemaError
from oomcast.model.wire import decode_samples
from oomcast.service.api.deps import Authorized, Ctx, unavailable
from oomcast.service.api.responses import V1, responses

router = APIRouter()

MEDIA_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Revalidate on every load: an upgraded service must never run yesterday's script.
NO_CACHE = {"Cache-Control": "no-cache", "X-Content-Type-Options": "nosniff"}
# The page's one policy: its own scripts and styles, fetches to its own origin, nothing else.
CSP = (
    "default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; "
    "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)


def _load_static() -> dict[str, bytes]:
    """Every shipped asset by file name (the folder is flat)."""
    folder = resources.files("oomcast.service.api").joinpath("static")
    out: dict[str, bytes] = {}
    for entry in folder.iterdir():
        name = entry.name
        if entry.is_file() and any(name.endswith(ext) for ext in MEDIA_TYPES):
            out[name] = entry.read_bytes()
    if "index.html" not in out:
        raise RuntimeError(f"the dashboard's index.html is missing from {folder}")
    return out


STATIC = _load_static()


def _asset(name: str) -> Response:
    body = STATIC.get(name)
    if body is None:
        raise HTTPException(404, f"no dashboard file {name!r}")
    media = MEDIA_TYPES["." + name.rsplit(".", 1)[-1]]
    return Response(body, media_type=media, headers={**NO_CACHE, "Content-Security-Policy": CSP})


@router.get("/", include_in_schema=False)
async def index() -> Response:
    """The dashboard's page (no token needed: it holds no data, /v1 does)."""
    return _asset("index.html")


@router.get("/static/{name}", include_in_schema=False)
async def static_file(name: str) -> Response:
    """One shipped asset by its file name; 404 for anything else (no paths, no listing)."""
    return _asset(name)


# --- allocator figures over time --------------------------------------------------------

MAX_POINTS = 2000  # the most points one answer carries (evenly thinned beyond)


def _points(
    entries: list[tuple[bytes, dict[bytes, bytes]]], node: str, device: str, since: float
) -> list[dict[str, Any]]:
    """The samples of (node, device) at or after ``since`` in ``entries`` (newest first, as
    XREVRANGE gives them), oldest first, with the allocator fields they carry."""
    want = node.encode()
    out: dict[float, dict[str, Any]] = {}
    for _entry_id, fields in entries:
        if fields.get(b"node") != want:  # one entry is one node's: skip the others unparsed
            continue
        try:
            decoded = decode_samples(fields)
        except SchemaError:
            continue
        for d in decoded:
            if isinstance(d, SchemaError):
                continue
            s = d.sample
            if s.device != device or s.ts < since or s.ts in out:
                continue
            out[s.ts] = {
                "ts": s.ts,
                "used_bytes": s.used_bytes,
                "total_bytes": s.total_bytes,
                "allocated_bytes": s.allocated_bytes,
                "reserved_bytes": s.reserved_bytes,
                "alloc_retries": s.alloc_retries,
            }
    points = [out[ts] for ts in sorted(out)]
    if len(points) > MAX_POINTS:
        step = len(points) / MAX_POINTS
        points = [points[int(i * step)] for i in range(MAX_POINTS - 1)] + [points[-1]]
    return points


@router.get(
    "/v1/dashboard/memory/{node}/{device:path}",
    tags=["dashboard"],
    dependencies=[Authorized],
    responses=responses(*V1, 404, 422, 503),
)
async def domain_memory(
    ctx: Ctx,
    node: Annotated[str, Path(max_length=MAX_NAME_CHARS)],
    device: Annotated[str, Path(max_length=MAX_NAME_CHARS)],
    seconds: Annotated[
        float, Query(gt=0, le=86_400, description="how far back to look, in seconds")
    ] = 600.0,
    entries: Annotated[
        int,
        Query(
            ge=1,
            le=20_000,
            description="the most stream entries to read (the node's partition carries"
            " other nodes' entries too); the answer says when the look-back was cut short",
        ),
    ] = 5000,
) -> dict[str, Any]:
    """A domain's samples over the last ``seconds`` as its node streamed them, with
    ``allocated_bytes`` / ``reserved_bytes`` / ``alloc_retries`` where the in-job hook
    reports them (null where not): what ``/v1/devices/{node}/{device}?history=`` does not
    keep. Read from the node's sample stream, newest first, at most ``entries`` entries;
    ``complete`` is false when that cap (or the stream's trimming) cut the window short."""
    since = time.time() - seconds
    try:
        raw = cast(
            list[tuple[bytes, dict[bytes, bytes]]],
            await ctx.redis.xrevrange(
                ctx.keys.samples_for(node), min=str(int(since * 1000)), count=entries
            ),
        )
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise unavailable(f"Redis is unreachable: {exc}") from None
    points = _points(raw, node, device, since)
    return {
        "node": node,
        "device": device,
        "since": since,
        "complete": len(raw) < entries,
        "has_allocator": any(
            p["allocated_bytes"] is not None or p["reserved_bytes"] is not None for p in points
        ),
        "points": points,
    }
