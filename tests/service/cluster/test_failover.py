"""Two `oomcast serve` replicas with default settings, on one Redis: they split the
partitions by lease, page once per episode between them, and when one is killed (SIGKILL)
the other takes its partitions over within the stated time, continuing its episodes from
their snapshots instead of paging again."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis
from support import free_port, start_serve, wait_until

from oomcast.model.schema import Sample
from oomcast.model.wire import Keys, encode_samples, sample_payload

pytestmark = pytest.mark.slow

PARTITIONS = 4
TTL_S = 2.0
GIB = 1 << 30


def nodes_one_per_partition(keys: Keys) -> dict[int, str]:
    out: dict[int, str] = {}
    i = 0
    while len(out) < keys.partitions:
        name = f"node-{i}"
        out.setdefault(keys.partition_of(name), name)
        i += 1
    return out


def write(client: redis.Redis, keys: Keys, node: str, frac: float, ts: float) -> None:
    s = Sample(ts, node, "gpu0", "gpu", 80 * GIB, int(frac * 80 * GIB), job=f"job-{node}")
    fields = encode_samples(node, [sample_payload(s, None, None)])
    client.xadd(keys.samples_for(node), fields)  # type: ignore[arg-type]


@pytest.fixture
def replicas(
    redis_url: str, key_prefix: str, webhook_receiver: Any
) -> Iterator[dict[str, tuple[subprocess.Popen[bytes], int]]]:
    procs: dict[str, tuple[subprocess.Popen[bytes], int]] = {}
    for name in ("replica-a", "replica-b"):
        port = free_port()
        env = {
            **os.environ,
            "OOMCAST_REDIS_URL": redis_url,
            "OOMCAST_KEY_PREFIX": key_prefix,
            "OOMCAST_PARTITIONS": str(PARTITIONS),
            "OOMCAST_CONSUMER_NAME": name,
            "OOMCAST_LEASE_TTL_S": str(TTL_S),
            "OOMCAST_SNAPSHOT_EVERY_S": "0.5",
            "OOMCAST_FORECASTER": "threshold_0.90",
            "OOMCAST_ALERT_FIRE_AFTER": "1",
            "OOMCAST_ALERT_RESOLVE_AFTER": "1",
            "OOMCAST_ALERT_RESOLVE_AFTER_S": "0",  # resolve on calm samples, not seconds
            "OOMCAST_WEBHOOK_URL": webhook_receiver.url,
            "OOMCAST_WEBHOOK_SECRET": "k",
            "OOMCAST_DELIVERY_BACKOFF_S": "0.2",
        }
        procs[name] = (start_serve(env, port), port)
    yield procs
    for proc, _ in procs.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait(10)


def owned(port: int) -> list[int]:
    try:
        parts: list[int] = httpx.get(f"http://127.0.0.1:{port}/readyz").json()["partitions"]
    except httpx.HTTPError:
        return []
    return parts


def firing_by_domain(receiver: Any) -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for r in receiver.requests:
        body = r["json"]
        if body.get("status") == "firing":
            out.setdefault(body["node"], set()).add(body["episode"])
    return out


def test_replicas_split_page_once_and_take_over_a_killed_one(
    replicas: dict[str, tuple[subprocess.Popen[bytes], int]],
    rclient: redis.Redis,
    key_prefix: str,
    webhook_receiver: Any,
) -> None:
    keys = Keys(key_prefix, PARTITIONS)
    nodes = nodes_one_per_partition(keys)
    (proc_a, port_a), (_, port_b) = replicas["replica-a"], replicas["replica-b"]

    # the two split the partitions, never both holding one
    assert wait_until(lambda: len(owned(port_a)) == 2 and len(owned(port_b)) == 2, 30)
    assert not set(owned(port_a)) & set(owned(port_b))

    t = time.time()
    for node in nodes.values():
        write(rclient, keys, node, 0.95, t)
    assert wait_until(lambda: len(firing_by_domain(webhook_receiver)) == PARTITIONS, 30)
    for i in range(1, 4):  # still firing: no new episode, on either replica
        for node in nodes.values():
            write(rclient, keys, node, 0.95, t + i)
    assert wait_until(lambda: seen_everywhere(port_a, port_b) == dict.fromkeys(nodes.values(), 4))
    # those samples are acknowledged, so any alert they raised is on record by now
    assert audited_firings(rclient, keys) == dict.fromkeys(nodes.values(), 1)

    # kill A without a chance to hand over: B takes A's partitions within ttl + renew
    a_parts = owned(port_a)
    proc_a.send_signal(signal.SIGKILL)
    proc_a.wait(10)
    killed = time.monotonic()
    assert wait_until(lambda: len(owned(port_b)) == PARTITIONS, 30)
    takeover_s = time.monotonic() - killed
    assert takeover_s <= TTL_S + TTL_S / 3 + 3.0, takeover_s  # ttl + renew + B's tick

    # B continues A's domains: still firing, the same episodes, then resolved by B
    for i in range(4, 7):
        for node in nodes.values():
            write(rclient, keys, node, 0.95, t + i)
    for i in range(7, 10):  # the rule resolves after three calm forecasts
        for node in nodes.values():
            write(rclient, keys, node, 0.30, t + i)

    def resolved() -> dict[str, set[str]]:
        out: dict[str, set[str]] = {}
        for r in webhook_receiver.requests:
            if r["json"].get("status") == "resolved":
                out.setdefault(r["json"]["node"], set()).add(r["json"]["episode"])
        return out

    assert wait_until(lambda: len(resolved()) == PARTITIONS, 30)
    fired = firing_by_domain(webhook_receiver)
    assert {n: len(e) for n, e in fired.items()} == dict.fromkeys(nodes.values(), 1)
    assert resolved() == fired  # each episode resolved under its own id, A's ones by B
    a_nodes = {nodes[p] for p in a_parts}
    b_view = httpx.get(f"http://127.0.0.1:{port_b}/v1/devices").json()["devices"]
    seen = {d["node"]: d["samples_seen"] for d in b_view}
    # A's domains came with their history: B counts the samples A forecast too
    # (B itself forecast 6 samples of each; a cold start would count no more than that)
    assert all(seen[n] > 6 for n in a_nodes), seen
    assert audited_firings(rclient, keys) == dict.fromkeys(nodes.values(), 1)


def seen_everywhere(*ports: int) -> dict[str, int]:
    out: dict[str, int] = {}
    for port in ports:
        try:
            devices = httpx.get(f"http://127.0.0.1:{port}/v1/devices").json()["devices"]
        except httpx.HTTPError:
            continue
        for d in devices:
            out[d["node"]] = out.get(d["node"], 0) + d["samples_seen"]
    return out


def audited_firings(client: redis.Redis, keys: Keys) -> dict[str, int]:
    """Per node, the most firing records any one rule has on record for it."""
    per_rule: dict[tuple[str, str], int] = {}
    for _, fields in client.xrange(keys.alerts):
        record = json.loads(fields[b"alert"])
        if record.get("status") == "firing" and "rule_name" in record:  # not delivery records
            key = (record["node"], record["rule_name"])
            per_rule[key] = per_rule.get(key, 0) + 1
    out: dict[str, int] = {}
    for (node, _), n in per_rule.items():
        out[node] = max(out.get(node, 0), n)
    return out


def test_a_killed_service_restarted_resolves_what_it_fired_and_does_not_page_again(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: Any
) -> None:
    keys = Keys(key_prefix, PARTITIONS)
    port = free_port()
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_PARTITIONS": str(PARTITIONS),
        "OOMCAST_CONSUMER_NAME": "only-replica",
        "OOMCAST_LEASE_TTL_S": str(TTL_S),
        "OOMCAST_FORECASTER": "threshold_0.90",
        "OOMCAST_ALERT_FIRE_AFTER": "1",
        "OOMCAST_ALERT_RESOLVE_AFTER_S": "0",  # three calm samples, a second apart, resolve
        "OOMCAST_WEBHOOK_URL": webhook_receiver.url,
        "OOMCAST_WEBHOOK_SECRET": "k",
    }
    proc = start_serve(env, port)
    try:
        t = time.time()
        for i in range(3):
            write(rclient, keys, "node-0", 0.95, t + i)
        assert wait_until(lambda: seen_everywhere(port) == {"node-0": 3})
        assert audited_firings(rclient, keys) == {"node-0": 1}
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for i in range(3, 5):  # still firing while it is down
            write(rclient, keys, "node-0", 0.95, t + i)
        proc = start_serve(env, port)
        for i in range(5, 8):  # calm: the rule resolves after three
            write(rclient, keys, "node-0", 0.30, t + i)

        def statuses() -> list[tuple[str, str]]:
            return [
                (r["json"]["status"], r["json"]["episode"])
                for r in webhook_receiver.requests
                if r["json"].get("rule_name") == "oom-forecast"
            ]

        assert wait_until(lambda: any(s == "resolved" for s, _ in statuses()), 30)
        (fired,) = [e for s, e in statuses() if s == "firing"]
        assert [e for s, e in statuses() if s == "resolved"] == [fired]
        assert audited_firings(rclient, keys) == {"node-0": 1}
    finally:
        proc.kill()
        proc.wait(10)


def test_a_partition_given_up_to_a_new_replica_is_handed_over_at_its_last_sample(
    redis_url: str, rclient: redis.Redis, key_prefix: str
) -> None:
    """A joins alone and forecasts every partition; B joins and A gives half of them up.
    Periodic snapshots are an hour apart here, so B can only continue A's domains where A
    left them from the snapshots A writes as it gives the partitions up."""
    keys = Keys(key_prefix, PARTITIONS)
    nodes = nodes_one_per_partition(keys)
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_PARTITIONS": str(PARTITIONS),
        "OOMCAST_LEASE_TTL_S": str(TTL_S),
        "OOMCAST_SNAPSHOT_EVERY_S": "3600",
        "OOMCAST_FORECASTER": "threshold_0.90",
    }
    port_a, port_b = free_port(), free_port()
    procs = [start_serve({**env, "OOMCAST_CONSUMER_NAME": "alone"}, port_a)]
    try:
        assert wait_until(lambda: len(owned(port_a)) == PARTITIONS, 30)
        t = time.time()
        for i in range(3):  # a tick at a time: A snapshots each domain at its first
            for node in nodes.values():
                write(rclient, keys, node, 0.3, t + i)
            want = dict.fromkeys(nodes.values(), i + 1)
            assert wait_until(lambda want=want: seen_everywhere(port_a) == want)  # type: ignore[misc]

        procs.append(start_serve({**env, "OOMCAST_CONSUMER_NAME": "joiner"}, port_b))
        assert wait_until(lambda: len(owned(port_a)) == 2 and len(owned(port_b)) == 2, 30)
        # no sample since: what B holds came from A's hand-over, at A's last sample
        b_nodes = {nodes[p] for p in owned(port_b)}
        assert wait_until(lambda: set(seen_everywhere(port_b)) == b_nodes, 10)
        assert seen_everywhere(port_b) == dict.fromkeys(b_nodes, 3)
        assert seen_everywhere(port_a) == {n: 3 for n in nodes.values() if n not in b_nodes}
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(30)
