"""The delivery worker: it takes what the outbox (``service/delivery/outbox.py``) owes and posts it.

One worker runs in each service replica (started in the app's lifespan); several share one
outbox safely, since each delivery is claimed by one worker at a time. A delivery is an HTTP
POST built by its target (``WebhookTarget``, ``AlertmanagerTarget``), carrying
``X-Oomcast-Delivery: <id>`` so receivers can drop repeats: delivery is at least once (a
worker that dies between a receiver's 2xx and the outbox hearing of it leaves the delivery
owed, and it is posted again).

Outcomes: a 2xx ends it (``delivered``); a 400, 413, 415 or 422 ends it too (``refused``:
the receiver says the body itself is wrong, and no retry would mend it). Anything else
(connection errors, timeouts, 5xx, 408, 429, but also a redirect, a 401 or 403 while a
credential is rotated, a 404 from an ingress mid-deploy) is tried again later (``retry``)
with capped exponential backoff and jitter (a ``Retry-After`` is honoured up to the cap),
across restarts, until the delivery is older than its maximum age (``expired``, 24 h by
default): an alert leaves the outbox on a 2xx, or when it is certain no retry helps. Each
end is written to the audit stream as a ``"record": "delivery"`` entry, so ``/v1/alerts``
says what became of every alert; keep-alives (Alertmanager re-sends) are not."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import socket
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import httpx
from redis.exceptions import RedisError

from oomcast.model.text import compact_json
from oomcast.service.delivery.outbox import (
    Claimed,
    Delivery,
    Forged,
    Health,
    Outbox,
    delivery_id,
)

log = logging.getLogger(__name__)

DELIVERY_HEADER = "X-Oomcast-Delivery"
# What a receiver answers when the body itself is wrong: retrying the same body cannot help.
REFUSED = frozenset({400, 413, 415, 422})
HEALTH_EVERY_S = 1.0
ERROR_BODY_BYTES = 4096  # of an error answer, for the audit; the rest is never read


class Target(Protocol):
    """A kind of receiver: what the dispatcher and the worker need of it."""

    name: str

    def order_key(self, payload: Mapping[str, Any]) -> str:
        """Deliveries with the same key go one at a time, in order (a domain's alerts)."""
        ...

    def owed(self, delivery: Delivery) -> None:
        """Told of each delivery decided for this target, before it is staged."""
        ...

    def request(self, delivery: Delivery, now: float) -> tuple[str, bytes, dict[str, str]]:
        """The URL, body and headers of one attempt."""
        ...


def new_delivery(target: Target, record: Mapping[str, Any], now: float) -> Delivery:
    """The delivery of one alert record to one target, decided at ``now``; its id is the
    same however often it is made from the same record."""
    return Delivery(
        id=delivery_id(record, target.name),
        target=target.name,
        order=target.order_key(record),
        payload=record,
        created_at=now,
    )


@dataclass(frozen=True)
class Tried:
    """What one attempt met: ``status`` None for a connection error or timeout."""

    status: int | None
    error: str
    retry_after_s: float | None = None

    @property
    def delivered(self) -> bool:
        return self.status is not None and 200 <= self.status < 300

    @property
    def retryable(self) -> bool:
        return self.status is None or self.status not in REFUSED


def _retry_after(resp: httpx.Response) -> float | None:
    value = resp.headers.get("Retry-After")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date: rare from receivers; the backoff decides


class DeliveryWorker:
    def __init__(
        self,
        outbox: Outbox,
        targets: Mapping[str, Target],
        *,
        audit_stream: str,
        audit_maxlen: int = 10_000,
        timeout_s: float = 5.0,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        max_age_s: float = 86_400.0,
        claim_s: float = 30.0,
        poll_s: float = 0.5,
        concurrency: int = 32,
        on_outcome: Callable[[str, str], None] | None = None,
        on_health: Callable[[Health], None] | None = None,
        worker: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if claim_s <= timeout_s:
            raise ValueError(
                f"the claim timeout ({claim_s} s) must exceed the request timeout"
                f" ({timeout_s} s), or a slow receiver would see one delivery from two workers"
            )
        self.outbox = outbox
        self.targets = dict(targets)
        outbox.targets = sorted(self.targets)
        self.audit_stream = audit_stream
        self.audit_maxlen = audit_maxlen
        self.timeout_s = timeout_s
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self.max_age_s = max_age_s
        self.claim_s = claim_s
        self.poll_s = poll_s
        self.concurrency = concurrency
        self.worker = worker or f"{socket.gethostname()}:{uuid.uuid4().hex[:8]}"
        self._on_outcome = on_outcome or (lambda target, result: None)
        self._on_health = on_health or (lambda health: None)
        self._clock = clock
        self._client: httpx.AsyncClient | None = None
        self._task: asyncio.Task[None] | None = None
        self._inflight: dict[asyncio.Task[None], Claimed] = {}
        self._stopping = False

    async def start(self) -> None:
        with contextlib.suppress(RedisError, OSError):  # Redis down: the loop says so
            for target, n in (await self.outbox.owed_elsewhere()).items():
                log.warning(
                    "%d deliveries are owed to %s, which is not configured here: they wait"
                    " for a replica that delivers to it (or until it is configured again)",
                    n,
                    target,
                )
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self._stopping = False
        self._task = asyncio.create_task(self._run(), name="deliveries")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Stop taking deliveries; give those in flight ``grace_s`` to end, then hand the
        rest back to the outbox, due now, for any worker to take (they stay owed)."""
        self._stopping = True
        self.outbox.wake()
        if self._task is not None:
            await asyncio.wait([self._task], timeout=self.poll_s + 5.0)
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._inflight:
            await asyncio.wait(list(self._inflight), timeout=grace_s)
        left = dict(self._inflight)
        for task in left:
            task.cancel()
        await asyncio.gather(*left, return_exceptions=True)
        for claimed in left.values():
            with contextlib.suppress(RedisError, OSError):
                await self.outbox.reschedule(claimed, self._clock())
        if self._client is not None:
            await self._client.aclose()

    async def _run(self) -> None:
        backoff = 0.2
        last_health = 0.0
        while not self._stopping:
            try:
                now = self._clock()
                took = 0
                for name in self.targets:
                    # each target has its own slots: a receiver that hangs holds its own
                    # attempts, never another target's (Alertmanager beside a stalled webhook)
                    free = self.concurrency - self._busy(name)
                    if free <= 0:
                        continue
                    forged: list[Forged] = []
                    got = await self.outbox.claim(
                        name,
                        now,
                        claim_s=self.claim_s,
                        limit=free,
                        worker=self.worker,
                        forged=forged,
                    )
                    for item in forged:
                        await self._refuse_forged(item, now)
                    for claimed in got:
                        task = asyncio.create_task(self._attempt(claimed))
                        self._inflight[task] = claimed
                        task.add_done_callback(self._inflight.pop)
                    took += len(got)
                if time.monotonic() - last_health >= HEALTH_EVERY_S:
                    last_health = time.monotonic()
                    self._on_health(await self.outbox.health(now))
                backoff = 0.2
                if took == 0 or all(self._busy(n) >= self.concurrency for n in self.targets):
                    await self._idle()
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as exc:
                log.warning("deliveries: Redis unavailable (%s); retrying in %.1fs", exc, backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)
            except Exception:  # a bug must not end deliveries for good
                log.exception("delivery loop failed; going on in %.1fs", backoff)
                await asyncio.sleep(backoff)
                backoff = min(5.0, backoff * 2)

    async def _refuse_forged(self, item: Forged, now: float) -> None:
        """An item in the outbox the service did not stage (its seal fails): removed unsent,
        counted, logged and audited by id alone (nothing it claims is repeated)."""
        if not await self.outbox.discard(item, now):
            return
        log.error(
            "%s outbox item %r was not staged by this service (%s): removed, not sent",
            item.target,
            item.label(),
            item.why,
        )
        self._on_outcome(item.target, "forged")
        record = {
            "record": "delivery",
            "delivery_id": item.label(),
            "target": item.target,
            "outcome": "forged",
            "why": item.why,
            "ended_at": now,
        }
        await self.outbox.client.xadd(
            self.audit_stream,
            {"alert": compact_json(record)},
            maxlen=self.audit_maxlen,
            approximate=True,
        )

    def _busy(self, target: str) -> int:
        return sum(1 for c in self._inflight.values() if c.delivery.target == target)

    async def _idle(self) -> None:
        """Until something is staged here, an attempt ends, or the poll interval passes (a
        retry falls due, another replica staged something)."""
        waits: list[asyncio.Future[Any]] = [asyncio.ensure_future(self.outbox.wait(self.poll_s))]
        waits += list(self._inflight)
        done, _ = await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
        if waits[0] not in done:
            waits[0].cancel()

    # -- one attempt -----------------------------------------------------------------------
    async def _attempt(self, claimed: Claimed) -> None:
        d, progress = claimed.delivery, claimed.progress
        max_age = d.max_age_s if d.max_age_s is not None else self.max_age_s
        try:
            if self._clock() - d.created_at > max_age:
                await self._end(claimed, "expired")
                return
            tried = await self._post(d)
            now = self._clock()
            progress.attempts += 1
            if tried.delivered:
                progress.last_error = None
                await self._end(claimed, "delivered")
                return
            progress.last_error = tried.error
            if not tried.retryable:
                log.error("%s refused delivery %s: %s", d.target, d.id, tried.error)
                await self._end(claimed, "refused")
                return
            self._outcome(d, "retry")
            delay = self._backoff(progress.attempts, tried.retry_after_s)
            if now + delay - d.created_at > max_age:
                await self._end(claimed, "expired")
                return
            if progress.first_failed_at is None:
                progress.first_failed_at = now
            # attempts 1, 2, 4, 8, ...: a long outage is visible without flooding the log
            # (the metrics and /readyz say how it stands meanwhile)
            loud = progress.attempts & (progress.attempts - 1) == 0
            log.log(
                logging.WARNING if loud else logging.DEBUG,
                "%s delivery %s: attempt %d failed (%s); next in %.1fs",
                d.target,
                d.id,
                progress.attempts,
                tried.error,
                delay,
            )
            await self.outbox.reschedule(claimed, now + delay, failed_at=progress.first_failed_at)
        except (RedisError, OSError) as exc:
            # the claim runs out and another attempt follows: at least once, never lost
            log.warning("%s delivery %s: Redis failed (%s); it stays owed", d.target, d.id, exc)

    async def _post(self, d: Delivery) -> Tried:
        assert self._client is not None
        try:
            url, body, headers = self.targets[d.target].request(d, self._clock())
        except Exception as exc:  # a bug: retried (a fixed release may take it) until it expires
            log.exception("%s delivery %s: building the request failed", d.target, d.id)
            return Tried(None, f"could not build the request: {type(exc).__name__}: {exc}"[:300])
        headers = {**headers, DELIVERY_HEADER: d.id}
        try:
            # The whole attempt, not each read, is bounded: a receiver that drips its answer
            # a byte at a time would otherwise hold it (and its claim) for minutes. Only
            # the status and at most ERROR_BODY_BYTES of an error's body are read.
            async with asyncio.timeout(self.timeout_s):
                async with self._client.stream("POST", url, content=body, headers=headers) as resp:
                    said = b""
                    if resp.status_code >= 300:
                        async for chunk in resp.aiter_raw():
                            said += chunk
                            if len(said) >= ERROR_BODY_BYTES:
                                break
        except TimeoutError:
            return Tried(None, f"no answer within {self.timeout_s:g} s (the attempt's deadline)")
        except httpx.HTTPError as exc:
            return Tried(None, f"{type(exc).__name__}: {exc}"[:300])
        error = f"HTTP {resp.status_code}"
        text = said[:200].decode("utf-8", "replace")
        if text:
            error += f": {text}"
        return Tried(resp.status_code, error, _retry_after(resp))

    def _backoff(self, attempts: int, retry_after_s: float | None) -> float:
        """Capped exponential, with jitter so a receiver back from an outage is not hit by
        every delivery at once."""
        delay: float = min(self.backoff_max_s, self.backoff_s * 2.0 ** min(attempts - 1, 30))
        delay = delay / 2 + random.uniform(0, delay / 2)
        if retry_after_s is not None:
            delay = max(delay, min(retry_after_s, self.backoff_max_s))
        return delay

    async def _end(self, claimed: Claimed, outcome: str) -> None:
        d, progress = claimed.delivery, claimed.progress
        now = self._clock()
        if not await self.outbox.finish(d, now):
            return  # ended already, by another worker whose claim this one outlived
        self._outcome(d, outcome)
        if outcome == "expired":
            log.error(
                "%s delivery %s expired after %d attempts over %.0fs: %s",
                d.target,
                d.id,
                progress.attempts,
                now - d.created_at,
                progress.last_error,
            )
        if d.quiet:
            return
        record = audit_record(d, outcome, progress.attempts, progress.last_error, now)
        await self.outbox.client.xadd(
            self.audit_stream,
            {"alert": compact_json(record)},
            maxlen=self.audit_maxlen,
            approximate=True,
        )

    def _outcome(self, d: Delivery, result: str) -> None:
        if d.quiet:
            result = {"delivered": "resent", "expired": "resend_expired"}.get(result, result)
        self._on_outcome(d.target, result)


def audit_record(
    d: Delivery, outcome: str, attempts: int, last_error: str | None, now: float
) -> dict[str, Any]:
    """What the audit stream says of a delivery's end: which alert, to whom, how it ended."""
    p = d.payload
    return {
        "record": "delivery",
        "delivery_id": d.id,
        "target": d.target,
        "outcome": outcome,
        "attempts": attempts,
        "last_error": last_error,
        "status": p.get("status"),
        "node": p.get("node"),
        "device": p.get("device"),
        "job": p.get("job"),
        "episode": p.get("episode"),
        "decided_at": d.created_at,
        "ended_at": now,
    }
