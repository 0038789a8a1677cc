"""Scenarios where a part of the system fails: Redis, a service replica, the receiver, memory.

Each takes the bench and its own ``Scenario``, runs the system, injects the fault, measures
how long the system takes to recover from the moment the fault ended, and returns the
figures of ``Scenario.conclude`` with its own added. Fault durations are scripted sleeps:
they are the fault, not a wait for something.
"""

from __future__ import annotations

import time
from typing import Any, cast

import redis

from oomcast.bench.faults import ledger
from oomcast.bench.faults.stage import Bench, Scenario, batch_ids, http_batch
from oomcast.bench.procs import Procs, wait_until
from oomcast.model.text import as_str
from oomcast.model.wire import Keys

WARM_S = 6.0  # the system runs this long before a fault: alerts owed, some delivered
AFTER_S = 4.0  # and this long after recovery, before the end is counted
REDIS_DOWN_S = 3.0
MAXMEMORY_S = 5.0
NODE = "bf-node-1"


def _warm(sc: Scenario) -> None:
    """Run until some alert has been delivered (the path is exercised), or WARM_S * 3."""
    t0 = time.monotonic()
    wait_until(lambda: sc.alerts()["alerts_delivered"] > 0, WARM_S * 3, 0.25)
    time.sleep(max(0.0, WARM_S - (time.monotonic() - t0)))


def redis_restart(b: Bench, sc: Scenario) -> dict[str, Any]:
    """SIGKILL the Redis server, keep it down, start it again on its append-only file."""
    svc = sc.service()
    sc.agent(NODE)
    _warm(sc)
    b.redis.kill()
    time.sleep(REDIS_DOWN_S)
    b.redis.start()
    fault_end = time.time()
    recovery = sc.recovered_after(svc, [NODE], fault_end)
    sc.figures["redis_down_s"] = REDIS_DOWN_S
    time.sleep(AFTER_S)
    return {**sc.conclude(), "recovery_s": recovery}


def service_sigkill(b: Bench, sc: Scenario) -> dict[str, Any]:
    """SIGKILL the service while the receiver holds one of its deliveries, then start a new
    one with the same consumer name (as a restarted pod would be)."""
    svc = sc.service()
    sc.agent(NODE)
    _warm(sc)
    b.receiver.hold_s = 2.0
    mid = wait_until(lambda: b.receiver.in_flight > 0, 30, 0.02)
    Procs.kill(svc.proc)
    b.receiver.hold_s = 0.0
    if not mid:
        sc.problems.append("no delivery was in flight when the service was killed")
    sc.figures["killed_mid_delivery"] = mid
    fault_end = time.time()  # its replacement starts now, as a restarted pod would
    new = sc.service()
    recovery = sc.recovered_after(new, [NODE], fault_end)
    time.sleep(AFTER_S)
    return {**sc.conclude(), "recovery_s": recovery}


def receiver_down(b: Bench, sc: Scenario) -> dict[str, Any]:
    """The webhook receiver refuses connections for ``receiver_down_s``; alerts go on."""
    svc = sc.service()
    sc.agent(NODE)
    _warm(sc)
    b.receiver.down()
    down_at = time.time()
    time.sleep(b.receiver_down_s)
    b.receiver.up()
    fault_end = time.time()
    owed_during = ledger.owed_webhooks(ledger.audit_records(sc.client, sc.keys))
    sc.figures["alerts_owed_during_outage"] = sum(
        1 for r in owed_during.values() if down_at <= float(r.get("sent_at") or 0) <= fault_end
    )
    if not sc.figures["alerts_owed_during_outage"]:
        sc.problems.append("no alert was decided while the receiver was down")
    # recovery: every alert owed by the time the receiver came back has reached it
    waited = sc.first_held(fault_end, {"recovery_s": sc.alerts_caught_up(until=fault_end)}, 90)
    sc.figures["receiver_down_s"] = b.receiver_down_s
    sc.recovered_after(svc, [NODE], time.time(), timeout_s=30)  # ingest went on throughout
    time.sleep(AFTER_S)
    return {**sc.conclude(), **waited}


def nodes_per_partition(keys: Keys) -> list[str]:
    """One node name for each partition, so that every partition has traffic."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < keys.partitions:
        node = f"bf-node-{i}"
        found.setdefault(keys.partition_of(node), node)
        i += 1
    return [found[p] for p in sorted(found)]


def _held_by(client: redis.Redis, keys: Keys, consumer: str) -> int:
    """Sample entries pending with ``consumer`` (read by it, never acknowledged)."""
    held = 0
    for stream in keys.all_samples():
        try:
            summary = cast(Any, client.xpending(stream, ledger.GROUP))
        except redis.ResponseError:
            continue
        for row in summary.get("consumers") or []:
            if as_str(row["name"]) == consumer:
                held += int(row["pending"])
    return held


def replica_loss(b: Bench, sc: Scenario) -> dict[str, Any]:
    """Two replicas share the partitions; one is SIGKILLed for good. Recovery: the survivor
    reads every partition the dead one read, has forecast a post-kill sample of every node,
    and nothing is left pending with the dead one."""
    nodes = nodes_per_partition(sc.keys)
    dead, survivor = sc.service("a"), sc.service("b")
    for node in nodes:
        sc.agent(node)
    _warm(sc)
    before = {s.name: (s.readyz() or {}).get("partitions") for s in (dead, survivor)}
    sc.figures["partitions_before"] = before
    Procs.kill(dead.proc)
    killed_at = time.time()
    dead_parts = set(before.get(dead.name) or range(sc.keys.partitions))

    def reads_them() -> bool:
        got = (survivor.readyz() or {}).get("partitions") or []
        return dead_parts <= set(got)

    timings = sc.first_held(
        killed_at,
        {
            "partitions_taken_s": reads_them,
            "fresh_forecasts_s": lambda: all(
                (sc.newest_forecast(survivor, n) or 0) >= killed_at for n in nodes
            ),
            "pending_claimed_s": lambda: _held_by(sc.client, sc.keys, "replica-a") == 0,
        },
        90,
    )
    sc.figures.update(timings)
    sc.figures["partitions_after"] = (survivor.readyz() or {}).get("partitions")
    time.sleep(AFTER_S)
    out = sc.conclude()
    values = [v for v in timings.values() if v is not None]
    out["recovery_s"] = max(values) if len(values) == len(timings) else None
    return out


def maxmemory(b: Bench, sc: Scenario) -> dict[str, Any]:
    """Redis at maxmemory (noeviction) refuses every write for a while; then it is given
    its memory back. HTTP clients are told 503 + Retry-After and send again."""
    svc = sc.service()
    sc.agent(NODE)
    _warm(sc)
    client = b.redis.client()
    used = int(cast(Any, client.info("memory"))["used_memory"])
    client.config_set("maxmemory", max(1, used // 2))
    t0 = time.time()
    readyz_503 = wait_until(lambda: not svc.ready(), MAXMEMORY_S, 0.1)
    sc.figures["readyz_503_after_s"] = round(time.time() - t0, 2) if readyz_503 else None
    batch = http_batch("bf-http", 50, time.time())
    with b.http() as http:
        refused = http.post(f"{svc.base}/v1/samples", json={"samples": batch})
        time.sleep(max(0.0, MAXMEMORY_S - (time.time() - t0)))
        client.config_set("maxmemory", 0)
        fault_end = time.time()
        sc.figures["http_during"] = {
            "status": refused.status_code,
            "retry_after": refused.headers.get("Retry-After"),
        }
        if refused.status_code != 503 or not refused.headers.get("Retry-After"):
            sc.problems.append(f"POST /v1/samples at maxmemory answered {refused.status_code}")
        if not readyz_503:
            sc.problems.append("/readyz stayed 200 while Redis refused writes")
        accepted = None
        for _ in range(50):  # the client sends again, as told
            again = http.post(f"{svc.base}/v1/samples", json={"samples": batch})
            if again.status_code == 202:
                accepted = batch
                break
            time.sleep(float(again.headers.get("Retry-After") or 1))
    if accepted is None:
        sc.problems.append("POST /v1/samples was not accepted after Redis had memory again")
    ids = batch_ids(accepted or [])
    sc.producers.append(ledger.Producer("http:bf-http", "bf-http", len(ids), ids))
    sc.figures["maxmemory_s"] = MAXMEMORY_S
    recovery = sc.recovered_after(svc, [NODE], fault_end)
    time.sleep(AFTER_S)
    out = sc.conclude()
    out["recovery_s"] = recovery
    return out
