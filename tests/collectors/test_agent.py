from __future__ import annotations

import base64
import json
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from support import leak_trace, sample, write

from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.replay import ReplaySource
from oomcast.model.control import node_key, node_keys
from oomcast.model.embedding import EMBEDDING_VERSION, FEATURES, N_FEATURES
from oomcast.model.schema import Event, Record
from oomcast.model.wire import (
    Keys,
    decode_event,
    decode_samples,
    entry_attested,
    event_attested,
)


class ListSource:
    name = "list"

    def __init__(self, ticks: list[list[Record]]) -> None:
        self.ticks = ticks

    def poll(self, now: float) -> list[Record]:
        return self.ticks.pop(0) if self.ticks else []

    @property
    def exhausted(self) -> bool:
        return not self.ticks


def test_one_entry_per_node_per_tick_with_embeddings(rclient: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix, 4)
    tick1: list[Record] = [
        sample(1.0, 0.5, node="a", device="gpu0"),
        sample(1.0, 0.6, node="a", device="gpu1"),
        sample(1.0, 0.7, node="b", device="gpu0"),
    ]
    tick2: list[Record] = [
        sample(2.0, 0.55, node="a", device="gpu0"),
        Event(2.0, "a", "gpu1", "oom"),
    ]
    agent = NodeAgent([ListSource([tick1, tick2])], StreamPublisher(rclient), keys)
    agent.tick()
    agent.tick()
    a = rclient.xrange(keys.samples_for("a"))
    b = rclient.xrange(keys.samples_for("b"))
    if keys.samples_for("a") == keys.samples_for("b"):
        a = [e for e in a if e[1][b"node"] == b"a"]
        b = [e for e in b if e[1][b"node"] == b"b"]
    assert [len(decode_samples(f)) for _, f in a] == [2, 1]
    assert len(b) == 1
    first = json.loads(a[0][1][b"samples"])[0]
    assert first["emb_v"] == EMBEDDING_VERSION
    assert len(base64.b64decode(first["emb_f32"])) == 4 * N_FEATURES  # float32, binary
    second = decode_samples(a[1][1])[0]
    assert second.emb is not None and second.emb[0] == 0.55  # used_frac
    assert second.emb[8] > 0  # growth since the previous tick of the same GPU
    (ev,) = rclient.xrange(keys.events)
    assert decode_event(ev[1]) == Event(2.0, "a", "gpu1", "oom")
    assert agent.stats.samples == 4 and agent.stats.events == 1


def test_run_replays_a_trace_to_the_end(
    tmp_path: Path, rclient: redis.Redis, key_prefix: str
) -> None:
    keys = Keys(key_prefix, 1)
    trace = write(tmp_path / "t.jsonl.gz", leak_trace(seconds_to_oom=20))
    agent = NodeAgent(
        [ReplaySource(trace, speed=100)], StreamPublisher(rclient), keys, interval_s=0.01
    )
    agent.run(threading.Event())
    total = sum(len(decode_samples(f)) for _, f in rclient.xrange(keys.samples(0)))
    assert total == 20
    assert rclient.xlen(keys.events) == 1


def test_agent_buffers_through_an_outage_and_flushes(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.2, socket_timeout=1)
    keys = Keys("agent-outage", 1)
    now = [0.0]
    ticks: list[list[Record]] = [[sample(float(t + 1), 0.5)] for t in range(6)]
    publisher = StreamPublisher(client, clock=lambda: now[0])
    agent = NodeAgent([ListSource(ticks)], publisher, keys)
    agent.tick()
    private_redis.stop()
    for _ in range(3):
        now[0] += 10.0
        agent.tick()  # keeps running: no exception, samples kept
    assert publisher.buffered_samples == 3
    private_redis.start()
    now[0] += 10.0
    agent.tick()
    agent.tick()
    assert publisher.buffered_samples == 0
    got = [s.sample.ts for _, f in client.xrange(keys.samples(0)) for s in decode_samples(f)]
    # The first tick's entry was written to the server before it stopped (and went with it).
    assert got == [2.0, 3.0, 4.0, 5.0, 6.0]


def test_embedding_history_restarts_with_a_new_job_or_after_an_oom(
    rclient: redis.Redis, key_prefix: str
) -> None:
    keys = Keys(key_prefix, 1)
    ticks: list[list[Record]] = [
        [sample(1.0, 0.5, job="a")],
        [sample(100.0, 0.9, job="a"), Event(100.5, "n1", "gpu0", "oom")],
        [sample(200.0, 0.3, job="a")],
        [sample(300.0, 0.4, job="b")],
    ]
    agent = NodeAgent([ListSource(ticks)], StreamPublisher(rclient), keys)
    for _ in range(len(ticks)):  # the source pops the list as it goes
        agent.tick()
    embs = [s.emb for _, f in rclient.xrange(keys.samples(0)) for s in decode_samples(f)]
    age = FEATURES.index("log1p_age_s")
    peak = FEATURES.index("recent_peak_frac")
    assert embs[1] is not None and embs[1][age] > 4  # 99 s into job a
    assert embs[2] is not None and embs[2][age] == 0.0  # after the OOM: a fresh history
    assert embs[2][peak] < 0.5  # the dead job's high-water mark is not carried over
    assert embs[3] is not None and embs[3][age] == 0.0  # job b


def test_agent_attests_its_own_nodes_samples_only(
    rclient: redis.Redis, key_prefix: str, caplog: pytest.LogCaptureFixture
) -> None:
    """With its node key the agent signs every entry of its node; a trace replaying other
    nodes goes out unsigned (it cannot vouch for them), with one warning per node."""
    keys = Keys(key_prefix, 1)
    ticks: list[list[Record]] = [
        [sample(1.0, 0.5, node="a", device="gpu0"), sample(1.0, 0.7, node="b", device="gpu0")],
        [
            sample(2.0, 0.5, node="a", device="gpu0"),
            sample(2.0, 0.7, node="b", device="gpu0"),
            Event(2.5, "a", "gpu0", "oom"),
            Event(2.5, "b", "gpu0", "oom"),
        ],
    ]
    agent = NodeAgent(
        [ListSource(ticks)],
        StreamPublisher(rclient),
        keys,
        node="a",
        node_key=node_key("m", "a"),
    )
    agent.tick()
    agent.tick()
    entries = [f for _, f in rclient.xrange(keys.samples(0))]
    attested = {(f[b"node"], entry_attested(f, node_keys("m"))) for f in entries}
    assert attested == {(b"a", True), (b"b", False)}
    # its events too: the service counts an oom of a signed domain only when signed
    events = [decode_event(f) for _, f in rclient.xrange(keys.events)]
    signed = [
        event_attested(f, e.node, node_keys("m"))
        for (_, f), e in zip(rclient.xrange(keys.events), events, strict=True)
    ]
    assert [(e.node, ok) for e, ok in zip(events, signed, strict=True)] == [
        ("a", True),
        ("b", False),
    ]
    assert sum("samples of node b are sent unsigned" in r.message for r in caplog.records) == 1
    assert node_key("m", "a") not in repr(agent)


def test_agent_without_a_key_sends_unsigned_entries(rclient: redis.Redis, key_prefix: str) -> None:
    keys = Keys(key_prefix, 1)
    agent = NodeAgent([ListSource([[sample(1.0, 0.5, node="a")]])], StreamPublisher(rclient), keys)
    agent.tick()
    ((_, fields),) = rclient.xrange(keys.samples(0))
    assert b"sig" not in fields


def test_agent_refuses_a_key_without_its_node(rclient: redis.Redis) -> None:
    with pytest.raises(ValueError, match="node"):
        NodeAgent([ListSource([])], StreamPublisher(rclient), Keys("x"), node_key="k")
