"""The durable outbox and its worker (service/delivery/outbox.py, service/delivery/worker.py)
against the real Redis and a real HTTP receiver: nothing owed is lost to a receiver that is
down, to a worker that dies mid-retry, or to a second worker; every end is on record; health
says when deliveries fall behind. The last tests go through the whole app."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from fastapi.testclient import TestClient
from support import GIB, WebhookReceiver, free_port, wait_until

from oomcast.model.wire import Keys
from oomcast.service.delivery.outbox import (
    Delivery,
    ForgedItem,
    Outbox,
    delivery_id,
    outbox_keys,
    seal,
    unseal,
)
from oomcast.service.delivery.webhook import SIGNATURE_HEADER, WebhookTarget, sign_body
from oomcast.service.delivery.worker import DELIVERY_HEADER, DeliveryWorker, new_delivery
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

SECRET = "outbox-secret"
FAST = {"timeout_s": 0.5, "backoff_s": 0.02, "backoff_max_s": 0.1, "claim_s": 1.0, "poll_s": 0.02}


def alert(device: str = "gpu0", status: str = "firing", **kw: Any) -> dict[str, Any]:
    return {
        "status": status,
        "node": "n1",
        "device": device,
        "job": "j",
        "episode": f"ep-{device}",  # one episode per domain, as the rules engine makes them
        "sent_at": time.time(),
        **kw,
    }


async def owe(outbox: Outbox, target: WebhookTarget, *records: dict[str, Any]) -> list[Delivery]:
    deliveries = [new_delivery(target, r, time.time()) for r in records]
    await outbox.put(deliveries, time.time())
    return deliveries


@contextlib.asynccontextmanager
async def worker(
    redis_url: str, prefix: str, url: str, **kw: Any
) -> AsyncIterator[tuple[Outbox, WebhookTarget, DeliveryWorker, list[tuple[str, str]]]]:
    client = aioredis.from_url(redis_url)
    outbox = Outbox(
        client,
        Keys(prefix),
        degraded_after_s=kw.pop("degraded_after_s", 60.0),
        seal_keys=kw.pop("keys", ()),
    )
    target = WebhookTarget(url, SECRET)
    outcomes: list[tuple[str, str]] = []
    w = DeliveryWorker(
        outbox,
        {"webhook": target},
        audit_stream=Keys(prefix).alerts,
        on_outcome=lambda t, r: outcomes.append((t, r)),
        **{**FAST, **kw},
    )
    await w.start()
    try:
        yield outbox, target, w, outcomes
    finally:
        await w.stop(grace_s=1.0)
        await client.aclose()


async def until(predicate: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """support.wait_until off the event loop, so the worker runs while the test waits."""
    return await asyncio.to_thread(wait_until, predicate, timeout_s)


def delivery_records(client: redis.Redis, prefix: str) -> list[dict[str, Any]]:
    out = []
    for _, fields in client.xrange(Keys(prefix).alerts):
        record = json.loads(fields[b"alert"])
        if record.get("record") == "delivery":
            out.append(record)
    return out


def taken(receiver: WebhookReceiver) -> Counter[str]:
    """Delivery ids the receiver answered 2xx, with how often."""
    return Counter(r["headers"][DELIVERY_HEADER] for r in receiver.requests if r["status"] < 300)


def owed(client: redis.Redis, prefix: str) -> int:
    return int(client.hlen(f"{prefix}:outbox:{{o}}:webhook:items"))


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_receiver_down_for_longer_than_the_old_retry_budget_gets_every_alert_once(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """The reported loss: 10 alerts, receiver down well past 6 tries each, then back."""
    port = free_port()  # nothing listens there yet
    back: list[WebhookReceiver] = []

    async def go() -> list[Delivery]:
        async with worker(redis_url, key_prefix, f"http://127.0.0.1:{port}/hook") as (
            outbox,
            target,
            _,
            outcomes,
        ):
            ds = await owe(outbox, target, *(alert(f"gpu{i}") for i in range(10)))
            # every delivery tried and failed more than the 6 times that used to be all
            assert await until(lambda: outcomes.count(("webhook", "retry")) >= 10 * 8)
            assert owed(rclient, key_prefix) == 10
            back.append(WebhookReceiver(port))
            assert await until(lambda: len(taken(back[0])) == 10)
            assert await until(lambda: owed(rclient, key_prefix) == 0)
            return ds

    try:
        ds = asyncio.run(go())
        assert taken(back[0]) == Counter({d.id: 1 for d in ds})  # each exactly once
        records = delivery_records(rclient, key_prefix)
        assert sorted(r["delivery_id"] for r in records) == sorted(d.id for d in ds)
        assert {r["outcome"] for r in records} == {"delivered"}
        assert all(r["attempts"] > 6 for r in records)
        for req in back[0].requests:  # signed, with the id inside the signed body too
            assert req["headers"][SIGNATURE_HEADER] == sign_body(req["body"], SECRET)
            assert req["json"]["delivery_id"] == req["headers"][DELIVERY_HEADER]
    finally:
        for r in back:
            r.close()


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_503s_for_longer_than_the_old_budget_then_delivered(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [503] * 12

    async def go() -> Delivery:
        async with worker(redis_url, key_prefix, webhook_receiver.url) as (outbox, target, _, _o):
            (d,) = await owe(outbox, target, alert())
            assert await until(lambda: bool(taken(webhook_receiver)))
            return d

    d = asyncio.run(go())
    assert len(webhook_receiver.requests) == 13
    assert taken(webhook_receiver) == Counter({d.id: 1})
    # every attempt sent the same bytes: a receiver can compare bodies as well as ids
    assert len({r["body"] for r in webhook_receiver.requests}) == 1
    (record,) = delivery_records(rclient, key_prefix)
    assert (record["outcome"], record["attempts"]) == ("delivered", 13)


def test_a_worker_killed_mid_retry_leaves_it_owed_and_the_next_worker_delivers_it(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [503] * 1000

    async def first() -> Delivery:
        client = aioredis.from_url(redis_url)
        outbox = Outbox(client, Keys(key_prefix))
        target = WebhookTarget(webhook_receiver.url, SECRET)
        w = DeliveryWorker(
            outbox, {"webhook": target}, audit_stream=Keys(key_prefix).alerts, **FAST
        )
        await w.start()
        (d,) = await owe(outbox, target, alert())
        assert await until(lambda: len(webhook_receiver.requests) >= 3)
        # killed: its tasks end where they are, nothing is handed back or cleaned up
        assert w._task is not None
        for task in [w._task, *w._inflight]:
            task.cancel()
        await asyncio.gather(w._task, *w._inflight, return_exceptions=True)
        await client.aclose()
        return d

    d = asyncio.run(first())
    assert owed(rclient, key_prefix) == 1
    assert delivery_records(rclient, key_prefix) == []  # not given up, not lost
    with webhook_receiver._lock:
        webhook_receiver.statuses = []  # the receiver is well again

    async def second() -> None:
        async with worker(redis_url, key_prefix, webhook_receiver.url):
            assert await until(lambda: owed(rclient, key_prefix) == 0)

    asyncio.run(second())
    assert taken(webhook_receiver) == Counter({d.id: 1})
    (record,) = delivery_records(rclient, key_prefix)
    # The third request was seen, so the first worker had saved two attempts (a request goes
    # out only after the last one's reschedule); its third may have died unsaved. The second
    # worker's one makes at least 3, counted across both.
    assert record["outcome"] == "delivered" and record["attempts"] >= 3


def test_a_task_cancelled_mid_command_ends(redis_url: str, key_prefix: str) -> None:
    """Every loop here (deliveries, ingest, leases) is stopped by cancelling it, at worst. Some
    redis-py releases (8.0, 8.1) swallow a cancel that lands while a command connects or sends,
    and the loop then runs on for good: a worker "killed" in the test above kept posting. So
    cancel a task that claims in a loop, at random moments, many times: each must end."""

    async def go() -> int:
        client = aioredis.from_url(redis_url)
        outbox = Outbox(client, Keys(key_prefix))
        survived = 0
        stop = False

        async def claims() -> None:
            while not stop:  # the flag only ends a task that ran on past its cancel
                await outbox.claim("webhook", time.time(), claim_s=1.0, limit=1, worker="w")

        rng = random.Random(7)
        for _ in range(400):
            task = asyncio.create_task(claims())
            await asyncio.sleep(rng.uniform(0, 0.003))
            task.cancel()
            done, _ = await asyncio.wait([task], timeout=2.0)
            if not done:
                survived += 1
                stop = True
                await asyncio.wait([task], timeout=2.0)
                break
        await client.aclose()
        return survived

    assert asyncio.run(go()) == 0, "cancelled tasks ran on: is redis-py 8.0/8.1 installed?"


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_two_workers_on_one_outbox_never_post_the_same_delivery_twice(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [503, 200] * 20  # failures too, so both retry and interleave

    async def go() -> tuple[list[Delivery], list[tuple[str, str]], list[tuple[str, str]]]:
        # roomy deadlines: a claim that ran out because the machine was busy, not because
        # a worker died, would let the other worker post it again (at least once, by design)
        roomy = {"timeout_s": 5.0, "claim_s": 30.0}
        async with (
            worker(redis_url, key_prefix, webhook_receiver.url, **roomy) as (o, t, _, one),
            worker(redis_url, key_prefix, webhook_receiver.url, **roomy) as (_, _t, _w, two),
        ):
            outbox, target = o, t
            ds = await owe(outbox, target, *(alert(f"gpu{i}") for i in range(60)))
            assert await until(lambda: len(taken(webhook_receiver)) == 60)
            assert await until(lambda: owed(rclient, key_prefix) == 0)
            return ds, one, two

    ds, one, two = asyncio.run(go())
    assert taken(webhook_receiver) == Counter({d.id: 1 for d in ds})
    assert one.count(("webhook", "delivered")) + two.count(("webhook", "delivered")) == 60
    assert one and two  # both took part
    assert len(delivery_records(rclient, key_prefix)) == 60


def test_a_4xx_is_refused_once_and_the_audit_says_so(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [400]

    async def go() -> list[tuple[str, str]]:
        async with worker(redis_url, key_prefix, webhook_receiver.url) as (outbox, target, _, o):
            await owe(outbox, target, alert())
            assert await until(lambda: bool(delivery_records(rclient, key_prefix)))
            return o

    assert asyncio.run(go()) == [("webhook", "refused")]
    assert len(webhook_receiver.requests) == 1
    (record,) = delivery_records(rclient, key_prefix)
    assert record["outcome"] == "refused" and record["last_error"].startswith("HTTP 400")
    assert (record["status"], record["node"], record["episode"]) == ("firing", "n1", "ep-gpu0")
    assert owed(rclient, key_prefix) == 0


def test_past_its_max_age_a_delivery_expires_and_the_audit_says_so(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    dead = f"http://127.0.0.1:{free_port()}/hook"

    async def go() -> list[tuple[str, str]]:
        async with worker(redis_url, key_prefix, dead, max_age_s=0.5) as (outbox, target, _, o):
            await owe(outbox, target, alert())
            assert await until(lambda: bool(delivery_records(rclient, key_prefix)))
            return o

    outcomes = asyncio.run(go())
    assert outcomes[-1] == ("webhook", "expired") and ("webhook", "retry") in outcomes
    (record,) = delivery_records(rclient, key_prefix)
    assert record["outcome"] == "expired" and record["attempts"] >= 2
    assert "ConnectError" in record["last_error"]
    assert owed(rclient, key_prefix) == 0


def test_a_domains_resolve_never_goes_before_its_firing(
    redis_url: str, key_prefix: str, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [503, 503, 503]

    async def go() -> None:
        async with worker(redis_url, key_prefix, webhook_receiver.url) as (outbox, target, _, _o):
            await owe(
                outbox,
                target,
                alert("gpu0"),
                alert("gpu0", "resolved", sent_at=time.time() + 1),
                alert("gpu1"),
            )
            assert await until(lambda: len(taken(webhook_receiver)) == 3)

    asyncio.run(go())
    gpu0 = [r for r in webhook_receiver.requests if r["json"]["device"] == "gpu0"]
    firing_ok = next(
        i for i, r in enumerate(gpu0) if r["json"]["status"] == "firing" and r["status"] == 200
    )
    # the resolve is not even tried until its firing has been taken
    assert all(r["json"]["status"] == "firing" for r in gpu0[: firing_ok + 1])
    assert [r["json"]["status"] for r in gpu0[firing_ok + 1 :]] == ["resolved"]


def test_owing_one_delivery_twice_owes_it_once(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: WebhookReceiver
) -> None:
    record = alert()

    async def go() -> None:
        async with worker(redis_url, key_prefix, webhook_receiver.url) as (outbox, target, _, _o):
            d = new_delivery(target, record, time.time())
            assert d.id == delivery_id(record, "webhook")
            assert await outbox.put([d, d], time.time()) == 1
            assert await until(lambda: bool(taken(webhook_receiver)))
            assert await until(lambda: owed(rclient, key_prefix) == 0)
            # a batch written again after a crash: the id has ended, it is not owed again
            again = new_delivery(target, record, time.time())
            assert await outbox.put([again], time.time()) == 0

    asyncio.run(go())
    assert len(webhook_receiver.requests) == 1


def test_health_turns_degraded_once_a_delivery_is_owed_past_the_threshold(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: WebhookReceiver
) -> None:
    webhook_receiver.statuses = [503] * 1000

    async def go() -> None:
        async with worker(redis_url, key_prefix, webhook_receiver.url, degraded_after_s=0.5) as (
            outbox,
            target,
            _,
            _o,
        ):
            await owe(outbox, target, alert())
            first = await outbox.health(time.time())
            assert not first.degraded and first.targets["webhook"].owed == 1
            assert await until(lambda: len(webhook_receiver.requests) >= 2)
            t0 = time.time()
            while not (h := await outbox.health(time.time())).degraded:
                assert time.time() - t0 < 10, h
                await asyncio.sleep(0.05)
            assert h.to_dict()["status"] == "degraded"
            th = h.targets["webhook"]
            assert th.failing == 1 and (th.last_error or "").startswith("HTTP 503")
            with webhook_receiver._lock:
                webhook_receiver.statuses = []
            assert await until(lambda: owed(rclient, key_prefix) == 0)
            done = await outbox.health(time.time())
            assert not done.degraded and done.targets["webhook"].owed == 0

    asyncio.run(go())


# --- through the app ------------------------------------------------------------------------


def app_settings(redis_url: str, prefix: str, url: str, **kw: Any) -> Settings:
    return Settings(
        redis_url=redis_url,
        key_prefix=prefix,
        partitions=2,
        consumer_name="outbox-app",
        forecaster="threshold_0.90",
        alert_fire_after=1,
        webhook_url=url,
        webhook_secret=SECRET,
        delivery_timeout_s=0.5,
        delivery_backoff_s=0.05,
        delivery_backoff_max_s=0.2,
        delivery_claim_s=2.0,
        delivery_poll_s=0.05,
        **kw,
    )


def hot_sample() -> dict[str, Any]:
    return {
        "ts": time.time(),
        "node": "n1",
        "device": "gpu0",
        "kind": "gpu",
        "total_bytes": 80 * GIB,
        "used_bytes": int(0.95 * 80 * GIB),
        "job": "j",
    }


def audit(c: TestClient) -> list[dict[str, Any]]:
    return list(c.get("/v1/alerts").json()["alerts"])


@pytest.mark.slow
def test_an_alert_owed_while_the_receiver_is_down_survives_a_restart_of_the_service(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    port = free_port()
    s = app_settings(
        redis_url, key_prefix, f"http://127.0.0.1:{port}/hook", delivery_degraded_after_s=0.5
    )
    with TestClient(create_app(s)) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        assert c.post("/v1/samples", json={"samples": [hot_sample()]}).status_code == 202
        assert wait_until(lambda: any(a.get("status") == "firing" for a in audit(c)))
        firing = next(a for a in audit(c) if a.get("status") == "firing" and "record" not in a)
        assert firing["dispatched"]["webhook"] == "owed"  # not "queued": it is in the outbox
        # sealed from the moment it is staged, with the key the webhook secret gives
        [stored] = rclient.hvals(f"{key_prefix}:outbox:{{o}}:webhook:items")
        assert json.loads(unseal(stored, outbox_keys(None, SECRET)))["id"]
        # owed, failing, and said so, while the service stays ready (it still ingests)
        assert wait_until(lambda: c.get("/readyz").json()["deliveries"]["status"] == "degraded")
        ready = c.get("/readyz")
        assert ready.status_code == 200
        deliveries = ready.json()["deliveries"]
        assert deliveries["owed"] == 1 and deliveries["affects_readiness"] is False
        assert "ConnectError" in deliveries["targets"]["webhook"]["last_error"]
        gauge = 'oomcast_deliveries_owed{target="webhook"} 1.0'
        assert wait_until(lambda: gauge in c.get("/metrics").text)  # refreshed every second
        metrics = c.get("/metrics").text
        assert "oomcast_deliveries_degraded 1.0" in metrics
        assert 'oomcast_deliveries_total{result="retry",target="webhook"}' in metrics
    # the service is gone; the receiver comes up; a new service delivers what was owed
    receiver = WebhookReceiver(port)
    try:
        with TestClient(create_app(s)) as c:
            got = receiver.wait_for(lambda r: r["status"] == 200)
            assert len(got) == 1 and got[0]["json"]["episode"] == firing["episode"]
            assert got[0]["headers"][SIGNATURE_HEADER] == sign_body(got[0]["body"], SECRET)

            def delivered() -> list[dict[str, Any]]:
                return [a for a in audit(c) if a.get("record") == "delivery"]

            assert wait_until(lambda: bool(delivered()))
            (record,) = delivered()
            assert record["outcome"] == "delivered"
            assert record["delivery_id"] == got[0]["headers"][DELIVERY_HEADER]
            assert record["episode"] == firing["episode"] and record["attempts"] >= 2
            assert wait_until(lambda: c.get("/readyz").json()["deliveries"]["status"] == "ok")
            assert c.get("/readyz").json()["deliveries"]["owed"] == 0
    finally:
        receiver.close()
    assert len(receiver.requests) == 1


ITEM_KEYS = outbox_keys("control-secret", SECRET)


def stage_raw(
    client: redis.Redis, prefix: str, did: bytes | str, stored: bytes | str, order: str
) -> None:
    """Stage an item as someone with write access to Redis could: past the service."""
    base = f"{prefix}:outbox:{{o}}:webhook"
    client.hset(f"{base}:items", did, stored)
    client.zadd(f"{base}:created", {did: time.time()})
    client.zadd(f"{base}:q:{order}", {did: 0})
    client.zadd(f"{base}:due", {did: 0})


def test_a_seal_is_checked_and_names_what_is_wrong() -> None:
    item = '{"id":"x"}'
    assert unseal(seal(item, ITEM_KEYS), ITEM_KEYS) == item
    assert unseal(seal(item, ()), ()) == item
    assert unseal(seal(item, ITEM_KEYS), ()) == item  # no key here: nothing to check
    # sealed with the key the webhook secret gives, it still verifies once a control secret
    # is added (the control secret's key seals from then on)
    webhook_only = outbox_keys(None, SECRET)
    assert unseal(seal(item, webhook_only), ITEM_KEYS) == item
    with pytest.raises(ForgedItem, match="not text"):
        unseal(b"\xff\xfe", ITEM_KEYS)
    with pytest.raises(ForgedItem, match="no seal"):
        unseal(item, ITEM_KEYS)
    with pytest.raises(ForgedItem, match="does not verify"):
        unseal(seal(item, outbox_keys("another", None)), ITEM_KEYS)
    with pytest.raises(ForgedItem, match="does not verify"):
        unseal(seal(item, ITEM_KEYS).replace('"x"', '"y"'), ITEM_KEYS)
    assert outbox_keys(None, None) == ()
    assert outbox_keys("c", "w")[0] == outbox_keys("c", None)[0] != outbox_keys(None, "w")[0]
    assert outbox_keys("c", "w")[1] == outbox_keys(None, "w")[0]


@pytest.mark.slow  # about 1 s
def test_items_staged_past_the_service_are_never_signed_or_sent_and_are_counted(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """The reported attack: items written straight into the outbox (a made-up alert, a
    resolve for a real episode, a real item with its severity changed, one sealed with
    another key) were delivered with a valid signature. Now each is removed unsent, counted
    and audited by id; so are a genuine sealed item copied under another id and bytes that
    are not text; a real item whose tries-so-far were overwritten with junk is still sent;
    the real alerts queued behind the forged ones on the same domain still go."""
    receiver = WebhookReceiver()

    async def go() -> tuple[list[Delivery], list[tuple[str, str]]]:
        async with worker(redis_url, key_prefix, receiver.url, keys=ITEM_KEYS) as (
            outbox,
            target,
            w,
            outcomes,
        ):
            await w.stop(grace_s=0.1)  # stage everything first, then let one worker run
            t0 = time.time()
            real = new_delivery(target, alert("gpu0", observed_at=t0), t0)
            fake = new_delivery(target, alert("gpu9", observed_at=t0, severity="critical"), t0)
            resolve = new_delivery(target, alert("gpu0", status="resolved", observed_at=t0), t0)
            tampered = json.loads(real.to_json())
            tampered["payload"]["severity"] = "critical"
            stage_raw(rclient, key_prefix, fake.id, fake.to_json(), fake.order)
            stage_raw(rclient, key_prefix, resolve.id, resolve.to_json(), resolve.order)
            stage_raw(rclient, key_prefix, "tampered", seal(json.dumps(tampered), ("k",)),
                      real.order)  # fmt: skip
            copy = seal(real.to_json(), ITEM_KEYS)  # genuine, under another id
            stage_raw(rclient, key_prefix, "copy", copy, real.order)
            # bytes that are not text name no queue: put in a queue of their own (one in a
            # real domain's queue would hold it up, as any id a Redis writer puts there can)
            stage_raw(rclient, key_prefix, b"\xff", b"\xff\xfe", "elsewhere")
            other = Delivery(**{**real.__dict__, "id": "other-key"})
            stage_raw(rclient, key_prefix, other.id, seal(other.to_json(), outbox_keys("x", None)),
                      other.order)  # fmt: skip
            later = new_delivery(target, alert("gpu0", observed_at=t0 + 1), t0 + 1)
            await outbox.put([real, later], time.time())  # queued behind the forged ones
            rclient.hset(f"{key_prefix}:outbox:{{o}}:webhook:meta", real.id, "junk")
            await w.start()
            assert await until(lambda: outcomes.count(("webhook", "forged")) == 6)
            assert await until(lambda: len(taken(receiver)) == 2)
            assert await until(lambda: owed(rclient, key_prefix) == 0)
            return [real, later], outcomes

    try:
        sent, outcomes = asyncio.run(go())
        assert taken(receiver) == Counter({d.id: 1 for d in sent})  # only the real ones
        for req in receiver.requests:
            assert req["headers"][SIGNATURE_HEADER] == sign_body(req["body"], SECRET)
            assert json.loads(req["body"])["device"] == "gpu0"
            assert "severity" not in json.loads(req["body"])
        forged = [r for r in delivery_records(rclient, key_prefix) if r["outcome"] == "forged"]
        assert len(forged) == 6 and all("node" not in r for r in forged)
        assert {r["delivery_id"] for r in forged} >= {"copy", "tampered", "\ufffd"}
        assert all(r["outcome"] == "delivered" for r in delivery_records(rclient, key_prefix)
                   if r not in forged)  # fmt: skip
        assert outcomes.count(("webhook", "delivered")) == 2
    finally:
        receiver.close()
