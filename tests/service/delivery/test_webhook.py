"""Webhooks as receivers see them (service/delivery/webhook.py), delivered through the outbox
and its worker against the real Redis and a real HTTP receiver: the signed body, the delivery id,
which answers are retried."""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import time
from typing import Any

import redis.asyncio as aioredis
from support import WebhookReceiver, wait_until

from oomcast.model.wire import Keys
from oomcast.service.delivery.outbox import Outbox
from oomcast.service.delivery.webhook import (
    SIGNATURE_HEADER,
    WebhookTarget,
    sign_body,
    verify_signature,
)
from oomcast.service.delivery.worker import DELIVERY_HEADER, DeliveryWorker, new_delivery

SECRET = "s3cret"


def _valid(req: dict[str, Any]) -> bool:
    expected = "sha256=" + hmac.new(SECRET.encode(), req["body"], hashlib.sha256).hexdigest()
    return req["headers"].get(SIGNATURE_HEADER) == expected


def _send(
    redis_url: str, prefix: str, receiver: WebhookReceiver, payloads: list[dict[str, Any]]
) -> list[str]:
    """Owe ``payloads`` and run a worker until each has ended; the outcomes, in order."""
    results: list[str] = []
    ended = ("delivered", "refused", "expired")

    async def go() -> None:
        client = aioredis.from_url(redis_url)
        outbox = Outbox(client, Keys(prefix))
        target = WebhookTarget(receiver.url, SECRET)
        worker = DeliveryWorker(
            outbox,
            {"webhook": target},
            audit_stream=Keys(prefix).alerts,
            timeout_s=0.5,
            backoff_s=0.02,
            backoff_max_s=0.1,
            claim_s=1.0,
            poll_s=0.02,
            on_outcome=lambda t, r: results.append(r),
        )
        await worker.start()
        now = time.time()
        await outbox.put([new_delivery(target, p, now) for p in payloads], now)
        done = lambda: sum(r in ended for r in results) == len(payloads)  # noqa: E731
        assert await asyncio.to_thread(wait_until, done, 20)
        await worker.stop()
        await client.aclose()

    asyncio.run(go())
    return results


def alert(device: str = "gpu0", status: str = "firing") -> dict[str, Any]:
    return {
        "status": status,
        "node": "n",
        "device": device,
        "episode": f"ep-{device}",
        "sent_at": time.time(),
    }


def test_delivers_signed_json_with_its_delivery_id(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    payload = alert()
    assert _send(redis_url, key_prefix, webhook_receiver, [payload]) == ["delivered"]
    (req,) = webhook_receiver.requests
    delivery = req["headers"][DELIVERY_HEADER]
    assert req["json"] == {**payload, "delivery_id": delivery}  # the id is signed too
    assert delivery.startswith("ep-gpu0.firing.") and delivery.endswith(".webhook")
    assert req["headers"]["Content-Type"] == "application/json"
    assert _valid(req)


def test_retries_server_errors_408_and_429_then_succeeds(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [500, 503, 408, 429]
    results = _send(redis_url, key_prefix, webhook_receiver, [alert()])
    assert results == ["retry", "retry", "retry", "retry", "delivered"]
    assert len(webhook_receiver.requests) == 5
    assert all(_valid(r) for r in webhook_receiver.requests)
    assert len({r["headers"][DELIVERY_HEADER] for r in webhook_receiver.requests}) == 1


def test_a_body_the_receiver_calls_wrong_is_refused_not_retried(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [422]
    assert _send(redis_url, key_prefix, webhook_receiver, [alert()]) == ["refused"]
    assert len(webhook_receiver.requests) == 1


def test_other_client_errors_and_redirects_are_retried_until_delivered(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    """A 404 from an ingress mid-deploy, a 401 while a credential rotates, a redirect: the
    alert stays owed and is tried again."""
    webhook_receiver.statuses = [404, 401, 301]
    results = _send(redis_url, key_prefix, webhook_receiver, [alert()])
    assert results.count("retry") == 3 and results[-1] == "delivered"
    assert [r["status"] for r in webhook_receiver.requests] == [404, 401, 301, 200]


def test_a_domains_alerts_arrive_in_order_despite_retries(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [503, 503]  # the first tried needs two retries
    resolved = {**alert("gpu0", "resolved"), "sent_at": time.time() + 1}
    alerts = [alert("gpu0"), resolved, alert("gpu1")]
    results = _send(redis_url, key_prefix, webhook_receiver, alerts)
    assert results.count("delivered") == 3
    delivered = [
        (r["json"]["device"], r["json"]["status"])
        for r in webhook_receiver.requests
        if r["status"] == 200
    ]
    assert [s for d, s in delivered if d == "gpu0"] == ["firing", "resolved"]


def test_backoff_is_capped_jittered_and_honours_retry_after() -> None:
    worker = DeliveryWorker(
        Outbox(aioredis.Redis(), Keys("unused")),
        {},
        audit_stream="unused",
        backoff_s=1.0,
        backoff_max_s=8.0,
    )
    for attempts, full in [(1, 1.0), (2, 2.0), (3, 4.0), (4, 8.0), (10, 8.0), (500, 8.0)]:
        delays = [worker._backoff(attempts, None) for _ in range(50)]
        assert all(full / 2 <= d <= full for d in delays), (attempts, delays)
        assert len(set(delays)) > 1  # jittered: a receiver back up is not hit all at once
    assert worker._backoff(1, 5.0) == 5.0  # Retry-After, within the cap
    assert worker._backoff(1, 600.0) == 8.0  # ... but never past it


def test_signature_helpers_agree() -> None:
    body = json.dumps({"a": 1}).encode()
    sig = sign_body(body, SECRET)
    assert verify_signature(body, sig, SECRET)
    assert not verify_signature(body + b" ", sig, SECRET)
    assert not verify_signature(body, sig, "other")
    assert not verify_signature(body, None, SECRET)


def test_a_receiver_that_drips_its_answer_is_cut_at_the_attempts_deadline(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    """Its status line a byte every 0.2 s never trips a per-read timeout of 0.5 s: the
    attempt held for 85 s (and its claim ran out under it). The whole attempt is bounded."""
    webhook_receiver.drip_answers = 1
    started = time.monotonic()
    results = _send(redis_url, key_prefix, webhook_receiver, [alert()])
    assert results == ["retry", "delivered"]
    assert time.monotonic() - started < 10


def test_only_the_start_of_an_answer_is_read(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    """A receiver that answers with 256 MiB: the service read it all into memory (a 1 GiB
    answer took it from 2.5 to 4.1 GB). Now it reads the status and hangs up."""
    webhook_receiver.body_bytes = 256 << 20
    webhook_receiver.statuses = [500]
    assert _send(redis_url, key_prefix, webhook_receiver, [alert()]) == ["retry", "delivered"]
    assert wait_until(lambda: len(webhook_receiver.body_sent) == 2, 10)
    assert max(webhook_receiver.body_sent) < 64 << 20, webhook_receiver.body_sent


def test_a_stalled_target_does_not_hold_another_targets_slots(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    """Slots are per target: with every one of the webhook's held by a receiver that drips,
    the other target's delivery goes at once (an Alertmanager push once waited 59 s)."""
    other = WebhookReceiver()
    webhook_receiver.drip_answers = 100
    webhook_receiver.drip_s = 0.1

    class Second(WebhookTarget):
        name = "alertmanager"

    took: dict[str, float] = {}

    async def go() -> None:
        client = aioredis.from_url(redis_url)
        outbox = Outbox(client, Keys(key_prefix))
        stalled, fine = WebhookTarget(webhook_receiver.url, SECRET), Second(other.url, SECRET)
        worker = DeliveryWorker(
            outbox,
            {"webhook": stalled, "alertmanager": fine},
            audit_stream=Keys(key_prefix).alerts,
            timeout_s=5.0,
            claim_s=10.0,
            poll_s=0.02,
            concurrency=2,
        )
        await worker.start()
        now = time.time()
        await outbox.put([new_delivery(stalled, alert(f"gpu{i}"), now) for i in range(4)], now)
        await asyncio.sleep(0.3)  # both of the webhook's slots are taken by now
        started = time.monotonic()
        await outbox.put([new_delivery(fine, alert("gpu9"), time.time())], time.time())
        assert await asyncio.to_thread(wait_until, lambda: len(other.requests) == 1, 10)
        took["other"] = time.monotonic() - started
        await worker.stop(grace_s=0.1)
        await client.aclose()

    try:
        asyncio.run(go())
    finally:
        other.close()
    assert took["other"] < 2.0, took
