from __future__ import annotations

import time
from typing import Any, cast

from fastapi import APIRouter
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from oomcast.model.schema import Sample
from oomcast.model.text import as_str
from oomcast.model.wire import encode_samples, sample_payload
from oomcast.service.api.deps import Authorized, Ctx, unavailable, unprocessable, write_refusal
from oomcast.service.api.responses import WITH_BODY, responses
from oomcast.service.api.samples_in import SamplesBody, parse_samples

router = APIRouter(tags=["ingest"], dependencies=[Authorized])


def check_skew(samples: list[Sample], max_skew_s: float, now: float) -> None:
    """The bound ingest applies (OOMCAST_MAX_TS_SKEW_S), applied before anything is accepted,
    so an HTTP client hears of a wrong clock instead of its samples being dead-lettered."""
    if not max_skew_s:
        return
    for i, sample in enumerate(samples):
        skew = sample.ts - now
        if abs(skew) > max_skew_s:
            where = "ahead of" if skew > 0 else "behind"
            raise unprocessable(
                ["body", "samples", i, "ts"],
                f"{sample.ts!r} is {abs(skew):.0f}s {where} the service's clock; the limit is"
                f" {max_skew_s:g}s (OOMCAST_MAX_TS_SKEW_S)",
            )


@router.post("/samples", status_code=202, responses=responses(*WITH_BODY, 503))
async def ingest_samples(body: SamplesBody, ctx: Ctx) -> dict[str, Any]:
    """Ingest samples over HTTP; they join the same streams the node agents write to.

    All-or-nothing: every sample is validated first and the entries are written in one
    transaction, so a rejected request leaves nothing behind. When Redis cannot take the
    write (unreachable, out of memory, a read-only replica) the answer is 503 with
    Retry-After, and nothing of the request was kept: the client should send it again.

    On a Redis Cluster a transaction cannot span hash slots, so the entries of each
    partition go in a transaction of their own. If one fails after another was written,
    the 503 says so; sending the whole request again is safe: the service recognises the
    samples it already has (same domain, ts and use) and skips them."""
    samples = parse_samples(body.samples, limit=ctx.settings.max_predict_samples, one_domain=False)
    check_skew(samples, ctx.settings.max_ts_skew_s, time.time())
    by_node: dict[str, list[dict[str, Any]]] = {}
    for sample in samples:
        by_node.setdefault(sample.node, []).append(sample_payload(sample, None, None))
    groups: dict[int, list[str]] = {}
    for node in by_node:  # one transaction for all, or one per partition on a cluster
        part = ctx.keys.partition_of(node) if ctx.settings.redis_cluster else 0
        groups.setdefault(part, []).append(node)
    ids: list[Any] = []
    for n_done, nodes in enumerate(groups.values()):
        pipe = ctx.redis.pipeline(transaction=True)
        for node in nodes:
            pipe.xadd(
                ctx.keys.samples_for(node),
                cast(Any, encode_samples(node, by_node[node])),  # redis-py's stub wants more
                maxlen=ctx.settings.stream_maxlen,
                approximate=True,
            )
        kept = (
            "nothing was accepted"
            if not n_done
            else f"{len(ids)} entries were written before it: send the request again (the"
            " samples already taken are skipped as duplicates)"
        )
        try:
            ids.extend(await pipe.execute())
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise unavailable(f"Redis is unreachable, {kept}: {exc}") from None
        except ResponseError as exc:
            reason = write_refusal(exc)
            if reason is None:
                raise
            # Not str(exc): redis-py puts the whole queued command, samples and all, in it.
            raise unavailable(f"{reason}; {kept}, try again later") from None
    return {
        "accepted": len(samples),
        "entries": [as_str(i) for i in ids],
    }
