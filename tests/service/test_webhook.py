from __future__ import annotations

import asyncio
import hashlib
import hmac
import json

from oomcast.service.webhook import SIGNATURE_HEADER, WebhookSender, sign_body, verify_signature

SECRET = "s3cret"


def _valid(req: dict) -> bool:
    expected = "sha256=" + hmac.new(SECRET.encode(), req["body"], hashlib.sha256).hexdigest()
    return req["headers"].get(SIGNATURE_HEADER) == expected


async def _send(receiver, payloads, **kw) -> list[str]:  # type: ignore[no-untyped-def]
    results: list[str] = []
    sender = WebhookSender(
        receiver.url, SECRET, backoff_s=0.05, backoff_max_s=0.2, on_result=results.append, **kw
    )
    await sender.start()
    for p in payloads:
        assert sender.submit(p)
    await sender.stop(grace_s=5.0)
    return results


def test_delivers_signed_json(webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    results = asyncio.run(_send(webhook_receiver, [{"status": "firing", "node": "n"}]))
    assert results == ["delivered"]
    (req,) = webhook_receiver.requests
    assert req["json"] == {"status": "firing", "node": "n"}
    assert req["headers"]["Content-Type"] == "application/json"
    assert _valid(req)


def test_retries_server_errors_then_succeeds(webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    webhook_receiver.statuses = [500, 503]
    results = asyncio.run(_send(webhook_receiver, [{"status": "firing"}]))
    assert results == ["retry", "retry", "delivered"]
    assert len(webhook_receiver.requests) == 3
    assert all(_valid(r) for r in webhook_receiver.requests)


def test_gives_up_after_max_attempts(webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    webhook_receiver.statuses = [500] * 10
    results = asyncio.run(_send(webhook_receiver, [{"status": "firing"}], max_attempts=3))
    assert results == ["retry", "retry", "retry", "failed"]
    assert len(webhook_receiver.requests) == 3


def test_client_errors_are_not_retried(webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    webhook_receiver.statuses = [400]
    results = asyncio.run(_send(webhook_receiver, [{"status": "firing"}]))
    assert results == ["refused"]
    assert len(webhook_receiver.requests) == 1


def test_full_queue_drops_without_blocking() -> None:
    results: list[str] = []

    async def go() -> list[bool]:
        sender = WebhookSender(
            "http://127.0.0.1:9/none", SECRET, queue_size=2, on_result=results.append
        )
        return [sender.submit({"i": i}) for i in range(4)]

    assert asyncio.run(go()) == [True, True, False, False]
    assert results == ["dropped", "dropped"]


def test_signature_helpers_agree() -> None:
    body = json.dumps({"a": 1}).encode()
    sig = sign_body(body, SECRET)
    assert verify_signature(body, sig, SECRET)
    assert not verify_signature(body + b" ", sig, SECRET)
    assert not verify_signature(body, sig, "other")
    assert not verify_signature(body, None, SECRET)


def test_a_domains_alerts_arrive_in_order_despite_retries(webhook_receiver) -> None:  # type: ignore[no-untyped-def]
    webhook_receiver.statuses = [503, 503]  # the firing alert needs two retries
    alerts = [
        {"status": "firing", "node": "n", "device": "gpu0"},
        {"status": "resolved", "node": "n", "device": "gpu0"},
        {"status": "firing", "node": "n", "device": "gpu1"},
    ]
    results = asyncio.run(_send(webhook_receiver, alerts))
    assert results.count("delivered") == 3
    delivered = [
        (r["json"]["device"], r["json"]["status"])
        for r in webhook_receiver.requests
        if r["status"] == 200
    ]
    gpu0 = [s for d, s in delivered if d == "gpu0"]
    assert gpu0 == ["firing", "resolved"]


def test_a_receiver_that_is_down_delays_nothing_and_gets_the_alerts_when_back() -> None:
    import time

    from support import WebhookReceiver, free_port, wait_until

    port = free_port()  # nothing listens there yet
    results: list[str] = []
    receiver: list[WebhookReceiver] = []

    async def scenario() -> float:
        sender = WebhookSender(
            f"http://127.0.0.1:{port}/hook",
            SECRET,
            backoff_s=0.1,
            backoff_max_s=0.5,
            max_attempts=8,
            on_result=results.append,
        )
        await sender.start()
        t0 = time.perf_counter()
        for i in range(50):  # alerts of 50 domains while the receiver is down
            assert sender.submit({"status": "firing", "node": "n", "device": f"gpu{i}"})
        took = time.perf_counter() - t0
        assert await asyncio.to_thread(wait_until, lambda: "retry" in results, 10)  # it is down
        receiver.append(WebhookReceiver(port))  # it comes back
        await sender.stop(grace_s=10.0)
        return took

    took = asyncio.run(scenario())
    try:
        assert took < 0.05, f"submitting while the receiver is down took {took:.3f}s"
        assert "retry" in results  # it really was down at first
        assert results.count("delivered") == 50
        assert {r["json"]["device"] for r in receiver[0].requests} == {f"gpu{i}" for i in range(50)}
    finally:
        receiver[0].close()
