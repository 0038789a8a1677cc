from __future__ import annotations

from typing import Any, cast

from fastapi import APIRouter, HTTPException
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.model.wire import encode_samples, sample_payload
from oomcast.service.api.deps import Authorized, Ctx
from oomcast.service.api.samples_in import SamplesBody, parse_samples

router = APIRouter(tags=["ingest"], dependencies=[Authorized])


@router.post("/samples", status_code=202)
async def ingest_samples(body: SamplesBody, ctx: Ctx) -> dict[str, Any]:
    """Ingest samples over HTTP; they join the same streams the node agents write to.

    All-or-nothing: every sample is validated first and the entries are written in one
    transaction, so a rejected request leaves nothing behind."""
    samples = parse_samples(body.samples, limit=ctx.settings.max_predict_samples, one_domain=False)
    by_node: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        by_node.setdefault(sample.node, []).append(sample_payload(sample, None, None))
    pipe = ctx.redis.pipeline(transaction=True)
    for node, payloads in by_node.items():
        pipe.xadd(
            ctx.keys.samples_for(node),
            cast(Any, encode_samples(node, payloads)),  # redis-py's stub wants a wider dict
            maxlen=ctx.settings.stream_maxlen,
            approximate=True,
        )
    try:
        ids = await pipe.execute()
    except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
        raise HTTPException(503, f"Redis is unreachable, nothing was accepted: {exc}") from None
    return {
        "accepted": len(samples),
        "entries": [i.decode() if isinstance(i, bytes) else i for i in ids],
    }
