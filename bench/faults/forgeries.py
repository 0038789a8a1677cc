"""Scenarios where someone who may write to Redis forges what the service reads back as its
own or as a node's: a domain's state snapshot (restored when the service takes the
partition back after the attacker took its lease), and ``oom`` events naming another
node's domain.

The node is the cgroup node of ``attacks`` (a protected job and a victim in a memory cgroup
laid out as files, watched by a real ``oomcast collect`` with its node key). Each scenario
has its controls: the same forgery done with what the attacker does not have (the
service's sealing key, the node's key) reaches the harm the defence stops, so that nothing
happening means something; and a properly signed shed ends the victim, so that a victim
left alive means something.
"""

from __future__ import annotations

import asyncio
import json
import re
import secrets
import time
from functools import partial
from typing import Any, cast

import redis.asyncio as aioredis

from oomcast.bench.faults import ledger
from oomcast.bench.faults.attacks import DEVICE, LIMIT, NODE, SETTLE_S, control_shed, started
from oomcast.bench.faults.stage import Bench, Scenario
from oomcast.bench.procs import Service, rss_mib, wait_until
from oomcast.model.control import node_key
from oomcast.model.schema import Event
from oomcast.model.text import as_str
from oomcast.model.wire import encode_event
from oomcast.service.cluster.leases import lease_key
from oomcast.service.cluster.snapshot import MAGIC, field_of, seal, snapshot_keys
from oomcast.service.delivery.outbox import Delivery, Outbox, outbox_keys

LEASE_STOLEN_MS = 4000  # as in the report: the attacker holds the lease this long
REFUSED = "oomcast_snapshots_refused_total"
LATE = "oomcast_late_samples_total"


def _device(sc: Scenario, svc: Service) -> dict[str, Any] | None:
    """The cgroup domain as ``GET /v1/devices`` shows it, or None."""
    for d in sc.devices(svc) or []:
        if d.get("node") == NODE and d.get("device") == DEVICE:
            return d
    return None


def _metric(svc: Service, name: str) -> float:
    """One of the service's metrics, summed over its labels (0 when it has none)."""
    got = svc.metrics()
    return sum(v for k, v in got.items() if k == name or k.startswith(name + "{"))


def _grew(svc: Service, name: str, floor: float) -> bool:
    return _metric(svc, name) > floor


def _deadletters(sc: Scenario, code: str) -> list[dict[bytes, bytes]]:
    return [
        f
        for _, f in ledger.xrange_all(sc.client, sc.keys.deadletter)
        if f.get(b"code") == code.encode()
    ]


def _shed_records(sc: Scenario) -> list[Any]:
    """What each alert record of the cgroup domain's shed rule says it did with the shed: a
    dict for a command sent, a string (``refused: ...``) for one not sent."""
    return [
        r["dispatched"]["shed"]
        for r in ledger.audit_records(sc.client, sc.keys)
        if "record" not in r
        and r.get("device") == DEVICE
        and isinstance(r.get("dispatched"), dict)
        and "shed" in r["dispatched"]
    ]


# --- a forged state snapshot -------------------------------------------------------------------


def _forged_blob(real: bytes, now: float, ahead_s: float) -> bytes:
    """The domain's own blob with the shed rule's episode set firing and waiting for the
    domain to cross its shed target (60% used is over the rule's 50%), and the times of its
    last OOM and last sample ``ahead_s`` ahead: every real sample of the domain stamped
    before then is dropped as the dead job's (at 1e12, for ever)."""
    body = json.loads(real[len(MAGIC) :])
    body["episodes"]["bench-shed"] = {
        "firing": True,
        "above": 1,
        "below": 0,
        "episode": f"forged-{secrets.token_hex(4)}",
        "fired_at": now,
        "last_fired_at": now,
        "last_acted_at": None,
        "suppressed": False,
        "shed_waits": True,
    }
    body["scalars"]["last_oom_ts"] = now + ahead_s
    body["scalars"]["last_seen_wall"] = now + ahead_s
    return MAGIC + json.dumps(body).encode()


def _steal_and_plant(
    sc: Scenario, svc: Service, stored: bytes, field: str, key: str, lease: str
) -> float | None:
    """Take the partition's lease from the service (SET ... PX), write ``stored`` as the
    domain's snapshot while the service may not write it, and wait until the service holds
    the lease again; the seconds that took, or None."""
    t0 = time.time()
    sc.client.set(lease, f"attacker-{secrets.token_hex(3)}", px=LEASE_STOLEN_MS)
    sc.client.hset(key, field, cast(Any, stored))

    def retaken() -> bool:
        holder = cast(bytes | None, sc.client.get(lease))
        return not as_str(holder or b"attacker").startswith("attacker")

    back = wait_until(retaken, 40, 0.1)
    return round(time.time() - t0, 1) if back else None


def forged_snapshot(b: Bench, sc: Scenario) -> dict[str, Any]:
    """The report's attack on a live shed rule: the attacker takes the partition's lease
    and writes the domain's snapshot (its shed episode firing, its last OOM at 1e12); the
    service takes the lease back and restores what it finds. Tried unsealed and sealed with
    a key of the attacker's own: both must be refused and counted, the domain's samples
    must go on being forecast (not dropped as a dead job's), and no shed go. The control:
    the same forgery sealed with the service's own key, its last OOM 30 s ahead (within
    the bound on restored times), is restored, and the bench sees its harm: the domain's
    samples dropped as late. Then a signed shed ends the victim."""
    node, svc = started(b, sc, 0.6)  # over the shed rule's 50% target, under its 90% bar
    p = sc.keys.partition_of(NODE)
    key, lease, field = (
        f"{sc.keys.prefix}:snapshot:{{{p}}}",
        lease_key(sc.keys.prefix, p),
        (field_of((NODE, DEVICE))),
    )
    if not wait_until(lambda: bool(sc.client.hexists(key, field)), 30, 0.2):
        sc.problems.append("the service never wrote the domain's snapshot")
        return sc.conclude()
    stored = cast(bytes, sc.client.hget(key, field))
    real = stored.partition(b"\n")[2] if stored.startswith(b"sha256=") else stored
    sc.figures["real_snapshot_sealed"] = stored.startswith(b"sha256=")

    forged = {
        "unsealed": _forged_blob(real, time.time(), 1e12),
        "sealed_with_attackers_key": seal(
            _forged_blob(real, time.time(), 1e12), [secrets.token_hex(32)], p, field
        ),
    }
    retaken: dict[str, float | None] = {}
    for kind, blob in forged.items():
        before = _metric(svc, REFUSED)
        retaken[kind] = _steal_and_plant(sc, svc, blob, field, key, lease)
        counted = wait_until(partial(_grew, svc, REFUSED, before), 15, 0.2)
        if not counted:
            sc.problems.append(f"the {kind} snapshot was not refused (or not counted)")
    fault_end = time.time()
    sc.figures["lease_retaken_after_s"] = retaken
    sc.figures["snapshots_refused"] = _metric(svc, REFUSED)
    recovery = sc.recovered_after(svc, [NODE], fault_end)
    time.sleep(SETTLE_S)  # a shed restored from a forgery would have gone by now
    late = _metric(svc, LATE)
    sc.figures["samples_dropped_as_late_after_forgeries"] = late
    if late:
        sc.problems.append(f"{late:g} samples were dropped as late: a forged time was restored")
    sc.figures["sheds_sent"] = sum(isinstance(s, dict) for s in _shed_records(sc))
    if sc.figures["sheds_sent"]:
        sc.problems.append("a shed was sent on a forged snapshot")
    sc.victims_killed = 0 if node.victim_alive() else 1
    # the control: sealed with the service's own key (what the attacker lacks), it is restored
    # and does its harm, which the bench sees
    own = snapshot_keys(b.master_secret, b.webhook_secret)
    sealed = seal(_forged_blob(real, time.time(), 30.0), own, p, field)
    _steal_and_plant(sc, svc, sealed, field, key, lease)
    harm = wait_until(partial(_grew, svc, LATE, late), 20, 0.2)
    sc.figures["control_sealed_forgery_restored_and_seen"] = harm
    if not harm:
        sc.problems.append(
            "the control (the forgery sealed with the service's key) did no harm the bench"
            " could see: it cannot tell a refused snapshot from one that would do nothing"
        )
    wait_until(lambda: (sc.newest_forecast(svc, NODE) or 0) > time.time() - 1, 60, 0.5)
    if any(isinstance(s, dict) for s in _shed_records(sc)):
        sc.problems.append("a shed was sent on a forged snapshot")
        sc.victims_killed = 1
    if not node.victim_alive():
        sc.victims_killed = 1
    control_shed(b, sc, node, int(0.6 * LIMIT), "a stopped attack")
    time.sleep(SETTLE_S)
    out = sc.conclude()
    out["recovery_s"] = recovery
    return out


# --- forged oom events -------------------------------------------------------------------------


def _ooms_seen(sc: Scenario, svc: Service) -> int | None:
    d = _device(sc, svc)
    return None if d is None else int(d.get("ooms_seen", 0))


def _resolved_by_oom(sc: Scenario) -> int:
    return sum(
        1
        for r in ledger.audit_records(sc.client, sc.keys)
        if "record" not in r
        and r.get("device") == DEVICE
        and r.get("status") == "resolved"
        and "out of memory" in str(r.get("reason"))
    )


def forged_oom(b: Bench, sc: Scenario) -> dict[str, Any]:
    """The cgroup domain climbs to 95% and its alert fires; then ``oom`` events naming it
    are XADDed by someone without its node's key: unsigned, unsigned and stamped 295 s
    ahead, signed with another node's key, and signed properly but for another device of
    the node carried over to this one. None may count: the domain's episode stays open, its
    samples keep being forecast, each forgery is dead-lettered (``unattested``). The
    control: the node's own signed ``oom`` counts and ends the episode."""
    node, svc = started(b, sc, 0.4)
    node.set_used(0.95)
    fired = wait_until(
        lambda: bool((_device(sc, svc) or {}).get("alert", {}).get("firing")), 30, 0.2
    )
    if not fired:
        sc.problems.append("the domain at 95% never fired: nothing for a forged oom to end")
    now = time.time()
    other = node_key(b.master_secret, "bf-other-node")
    good = encode_event(
        Event(ts=now, node=NODE, device="cgroup:/other", event="oom"),
        node_key(b.master_secret, NODE),
    )
    carried = {
        **encode_event(Event(ts=now, node=NODE, device=DEVICE, event="oom")),
        "sig": good["sig"],
    }
    forged = {
        "unsigned": encode_event(Event(ts=now, node=NODE, device=DEVICE, event="oom")),
        "unsigned_ahead_295s": encode_event(
            Event(ts=now + 295, node=NODE, device=DEVICE, event="oom")
        ),
        "other_nodes_key": encode_event(
            Event(ts=now, node=NODE, device=DEVICE, event="oom"), other
        ),
        "signature_carried_over": carried,
    }
    for fields in forged.values():
        sc.client.xadd(sc.keys.events, cast(Any, fields))
    fault_end = time.time()
    refused = wait_until(lambda: len(_deadletters(sc, "unattested")) >= len(forged), 15, 0.2)
    if not refused:
        sc.problems.append("not every forged oom was dead-lettered as unattested")
    sc.figures["forged_ooms"] = sorted(forged)
    sc.figures["forged_ooms_dead_lettered"] = len(_deadletters(sc, "unattested"))
    recovery = sc.recovered_after(svc, [NODE], fault_end)
    time.sleep(SETTLE_S)
    counted, ended = _ooms_seen(sc, svc), _resolved_by_oom(sc)
    sc.figures["forged_ooms_counted"] = counted
    sc.figures["episodes_ended_by_forged_ooms"] = ended
    still = bool((_device(sc, svc) or {}).get("alert", {}).get("firing"))
    sc.figures["alert_still_firing_after_forgeries"] = still
    if counted != 0 or ended or not still:
        sc.problems.append(
            f"forged ooms counted {counted}, ended {ended} episodes, alert firing: {still}"
        )
    # the control: the node's own signed oom ends the episode
    sc.client.xadd(
        sc.keys.events,
        cast(
            Any,
            encode_event(
                Event(ts=time.time(), node=NODE, device=DEVICE, event="oom"),
                node_key(b.master_secret, NODE),
            ),
        ),
    )
    control = wait_until(lambda: _ooms_seen(sc, svc) == 1 and _resolved_by_oom(sc) == 1, 15, 0.2)
    sc.figures["control_signed_oom_ended_the_episode"] = control
    if not control:
        sc.problems.append(
            "the control (the node's own signed oom) did not end the episode: the bench"
            " cannot tell a refused oom from one that would have done nothing"
        )
    node.set_used(0.4)
    time.sleep(SETTLE_S)
    out = sc.conclude()
    out["recovery_s"] = recovery
    return out


# --- forged outbox items -----------------------------------------------------------------------


def _stage(sc: Scenario, deliveries: list[Delivery], seal_keys: tuple[str, ...]) -> None:
    """Stage ``deliveries`` in the scenario's outbox as a Redis writer would, with the
    service's own staging script (sealed under ``seal_keys``: none, or a key of one's own)."""

    async def go() -> None:
        client = aioredis.Redis.from_url(sc.bench.redis.url)
        try:
            await Outbox(client, sc.keys, seal_keys=seal_keys).put(deliveries, time.time())
        finally:
            await client.aclose()

    asyncio.run(go())


def _forged_delivery(payload: dict[str, Any], tag: str) -> Delivery:
    return Delivery(
        id=f"forged-{tag}-{secrets.token_hex(4)}.webhook",
        target="webhook",
        order=f"forged-{tag}",
        payload=payload,
        created_at=time.time(),
    )


def forged_outbox(b: Bench, sc: Scenario) -> dict[str, Any]:
    """Items staged straight in the webhook outbox: a made-up critical alert for a node that
    does not exist, and a ``resolved`` for an episode that is really firing; unsealed and
    sealed with a key of the attacker's own. None may reach the receiver (which checks
    the signature: the worker would sign whatever it sent); each is removed and audited as
    ``forged``. Controls: the service's real alerts are delivered meanwhile, and the same
    made-up alert sealed with the service's own key is delivered, signed, and seen."""
    svc = sc.service()
    sc.agent("bf-node-1")  # simulated GPUs that fire and resolve every 9 s or so
    real = wait_until(
        lambda: bool(ledger.owed_webhooks(ledger.audit_records(sc.client, sc.keys))), 30, 0.2
    )
    if not real:
        sc.problems.append("no real alert was owed: nothing for a forged resolve to name")
    records = ledger.audit_records(sc.client, sc.keys)
    episode = next((r for r in records if "record" not in r and r.get("status") == "firing"), {})
    made_up = {
        "status": "firing",
        "node": "bf-ghost",
        "device": "gpu0",
        "severity": "critical",
        "reason": "forged: shed everything",
        "remedies": ["kill -9 the job"],
    }
    resolve = {**episode, "status": "resolved", "reason": "forged: all clear"}
    forged = [_forged_delivery(made_up, "made-up"), _forged_delivery(resolve, "resolve")]
    forged += [
        _forged_delivery(made_up, "made-up-own-key"),
        _forged_delivery(resolve, "resolve-own-key"),
    ]
    _stage(sc, forged[:2], ())
    _stage(sc, forged[2:], (secrets.token_hex(32),))
    fault_end = time.time()
    ids = {d.id for d in forged}

    def refused() -> int:
        return sum(
            1
            for r in ledger.audit_records(sc.client, sc.keys)
            if r.get("outcome") == "forged" and r.get("delivery_id") in ids
        )

    if not wait_until(lambda: refused() == len(forged), 20, 0.2):
        sc.problems.append(f"{len(forged) - refused()} forged items were not refused and audited")
    sc.figures["forged_items"] = len(forged)
    sc.figures["forged_items_refused"] = refused()
    received, _ = b.receiver.snapshot()
    sent = sorted(i for i in ids if received.get(i))
    sc.figures["forged_items_signed_and_sent"] = len(sent)
    if sent:
        sc.problems.append(f"forged items reached the receiver signed: {sent}")
    recovery = sc.recovered_after(svc, ["bf-node-1"], fault_end)
    # the control: sealed with the service's own key, a made-up item is sent and seen
    control = _forged_delivery(made_up, "control")
    _stage(sc, [control], outbox_keys(b.master_secret, b.webhook_secret))
    seen = wait_until(lambda: bool(b.receiver.snapshot()[0].get(control.id)), 20, 0.2)
    sc.figures["control_sealed_item_delivered"] = seen
    if not seen:
        sc.problems.append(
            "the control (an item sealed with the service's key) was not delivered: the bench"
            " cannot tell a refused item from one that would not have been sent anyway"
        )
    time.sleep(SETTLE_S)
    out = sc.conclude()
    # the control's delivery is the one the receiver got with no alert record behind it
    out["deliveries_received_not_on_record"] -= 1 if seen else 0
    out["recovery_s"] = recovery
    if out.get("alerts_delivered", 0) == 0:
        sc.problems.append("no real alert was delivered while the forgeries were refused")
        out["problems"] = sc.problems
    return out


# --- a flood of new domains --------------------------------------------------------------------

FLOOD_CAP = 4000  # the service's OOMCAST_MAX_DOMAINS here (the default, 50,000, is ~1.4 GB)
FLOOD_POSTS = 10
FLOOD_PER_POST = 2000  # new domains per POST: 20 nodes of 100 GPUs (under the per-node cap)
FLOOD_LIVE_AFTER_S = 20.0  # how long a silent domain stays live here (so expiry is seen)
HELD = re.compile(r"(\d+) domains are held")


def _flood_batch(post: int, ts: float) -> list[dict[str, Any]]:
    gib = 1 << 30
    return [
        {
            "ts": ts,
            "node": f"flood-{post}-{i // 100}",
            "device": f"gpu{i % 100}",
            "kind": "gpu",
            "total_bytes": 80 * gib,
            "used_bytes": 20 * gib,
        }
        for i in range(FLOOD_PER_POST)
    ]


def _devices_p50_ms(b: Bench, svc: Service, n: int = 15) -> float | None:
    times = []
    with b.http() as http:
        for _ in range(n):
            t0 = time.perf_counter()
            r = http.get(f"{svc.base}/v1/devices", params={"limit": 100})
            if r.status_code != 200:
                return None
            times.append(time.perf_counter() - t0)
    return round(sorted(times)[len(times) // 2] * 1000, 1)


def _post_flood(b: Bench, sc: Scenario, svc: Service, wave: int) -> int:
    """One flood: FLOOD_POSTS requests of FLOOD_PER_POST new domains; how many were taken."""
    posted = 0
    with b.http() as http:
        for post in range(FLOOD_POSTS):
            batch = _flood_batch(wave * FLOOD_POSTS + post, time.time())
            r = http.post(f"{svc.base}/v1/samples", json={"samples": batch}, timeout=60)
            if r.status_code != 202:
                sc.problems.append(f"flood POST {post} answered {r.status_code}: {r.text[:200]}")
            else:
                posted += FLOOD_PER_POST
    return posted


def domain_flood(b: Bench, sc: Scenario) -> dict[str, Any]:
    """The report's flood: POSTs of thousands of new domains each (20,000 here, on a
    service capped at 4,000 live domains), twice, the second once the first's domains have
    expired. The domains past the cap must be dead-lettered (``domain_cap``) and counted,
    the real node's samples go on being forecast, the service's RSS stay within what the
    cap allows and come back (within 40 MB) once the flood's domains expire, and
    ``/v1/devices?limit=100`` stay quick; the second flood must take no more memory than
    the first. The control: the flood filled the
    cap (every refusal says the cap was held)."""
    env = {"OOMCAST_MAX_DOMAINS": str(FLOOD_CAP), "OOMCAST_LIVE_AFTER_S": str(FLOOD_LIVE_AFTER_S)}
    svc = sc.service(extra_env=env)
    sc.agent("bf-node-1")
    if not wait_until(lambda: (sc.newest_forecast(svc, "bf-node-1") or 0) > 0, 30):
        sc.problems.append("the real node was never forecast")
    time.sleep(2.0)

    def refused() -> float:
        return _metric(svc, 'oomcast_samples_rejected_total{reason="domain_cap"}')

    def held() -> float:
        return _metric(svc, "oomcast_domains_held")

    rss: dict[str, float | None] = {"before": rss_mib(svc.pid)}
    p50 = {"before": _devices_p50_ms(b, svc)}
    posted = _post_flood(b, sc, svc, 0)
    fault_end = time.time()
    wait_until(lambda: ledger.drained(sc.client, sc.keys), 90, 0.5)
    reasons = [as_str(f.get(b"reason", b"")) for f in _deadletters(sc, "domain_cap")]
    most = max((int(m.group(1)) for m in (HELD.search(r) for r in reasons) if m), default=None)
    rss["at_cap"] = rss_mib(svc.pid)
    p50["at_cap"] = _devices_p50_ms(b, svc)
    sc.figures["flood"] = {
        "domains_posted": posted,
        "cap": FLOOD_CAP,
        "refused_domain_cap": refused(),  # the service's count (the stream keeps fewer)
        "most_held_at_a_refusal": most,
        "held_after_flood": held(),
    }
    capped = most == FLOOD_CAP
    sc.figures["control_cap_reached"] = capped
    if not capped:
        sc.problems.append("the flood never filled the cap: the bench did not see a flood")
    if most is not None and most > FLOOD_CAP:
        sc.problems.append(f"more domains than the cap were held: {most}")
    if refused() < posted - FLOOD_CAP:
        sc.problems.append(f"{refused():g} refusals for {posted - FLOOD_CAP} domains over the cap")
    recovery = sc.recovered_after(svc, ["bf-node-1"], fault_end)
    # the flood's domains fall silent and expire; a second flood comes
    gone = wait_until(lambda: held() < 100, FLOOD_LIVE_AFTER_S + 60.0, 1.0)
    rss["after_expiry"] = rss_mib(svc.pid)
    sc.figures["domains_held_after_expiry"] = held()
    if not gone:
        sc.problems.append("the flood's domains never expired")
    elif (rss["after_expiry"] or 0.0) - (rss["before"] or 0.0) > 40.0:
        sc.problems.append(
            f"RSS stayed at {rss['after_expiry']} MB after the flood's domains expired"
            f" (before the flood: {rss['before']} MB): their memory did not come back"
        )
    _post_flood(b, sc, svc, 1)
    wait_until(lambda: ledger.drained(sc.client, sc.keys), 90, 0.5)
    rss["at_cap_again"] = rss_mib(svc.pid)
    sc.figures["service_rss_mb"] = rss
    sc.figures["devices_limit100_p50_ms"] = p50
    before, at_cap = rss["before"] or 0.0, rss["at_cap"] or 0.0
    budget_mb = FLOOD_CAP * 40 / 1024  # 40 KB a domain: the ~28 KB measured, and headroom
    if at_cap - before > budget_mb + 100:
        sc.problems.append(
            f"RSS rose {at_cap - before:.0f} MB under the flood, over the"
            f" {budget_mb:.0f} MB its cap allows"
        )
    if (rss["at_cap_again"] or 0.0) - at_cap > 30.0:
        sc.problems.append(
            f"the second flood took the RSS from {at_cap} to {rss['at_cap_again']} MB: what"
            " expired was not reused"
        )
    out = sc.conclude()
    out["recovery_s"] = recovery
    return out
