"""collectors/metrics.py: the agent's /metrics, /livez and /readyz over real HTTP, with the
agent publishing to the real Redis (and to one that is down)."""

from __future__ import annotations

import re
import time
from pathlib import Path

import httpx
import pytest
import redis
from support import LIMIT, v2_files, write_files

from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.metrics import AgentHTTP, render
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.model.schema import Record, Sample
from oomcast.model.wire import Keys

PSI = "some avg10=2.25 avg60=0.00 avg300=0.00 total=10\nfull avg10=1.00 avg60=0 avg300=0 total=5\n"


def metric(text: str, name: str, **labels: str) -> float:
    label = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    pattern = rf"^{re.escape(name)}{re.escape('{' + label + '}') if label else ''} (\S+)$"
    m = re.search(pattern, text, re.MULTILINE)
    assert m, f"{name} {labels} not in /metrics:\n{text}"
    return float(m.group(1))


class Broken:
    name = "broken"
    interval_s = 1.0
    exhausted = False

    def poll(self, now: float) -> list[Record]:
        raise OSError("device vanished")


def cgroup_root(tmp_path: Path) -> Path:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    write_files(root / "job", v2_files(limit=LIMIT) | {"cgroup.procs": "1", "memory.pressure": PSI})
    return root


def test_render_text_format() -> None:
    text = render(
        [
            ("a_total", "counter", "A.", {}, 3),
            ("b", "gauge", "B.", {"device": 'x"y'}, 0.5),
            ("b", "gauge", "B.", {"device": "z"}, float("inf")),
        ]
    )
    assert text.splitlines() == [
        "# HELP a_total A.",
        "# TYPE a_total counter",
        "a_total 3.0",
        "# HELP b B.",
        "# TYPE b gauge",
        'b{device="x\\"y"} 0.5',
        'b{device="z"} +Inf',
    ]


def test_endpoints_with_real_redis(tmp_path: Path, redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url)
    src = CgroupSource("n1", cgroup_root(tmp_path), interval_s=0.1)
    agent = NodeAgent([src, Broken()], StreamPublisher(client), Keys(key_prefix), interval_s=0.1)
    http = AgentHTTP(agent, "127.0.0.1", 0).start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        assert httpx.get(f"{base}/readyz").status_code == 503  # nothing sampled yet
        agent.tick()
        agent.tick()
        text = httpx.get(f"{base}/metrics").text
        assert metric(text, "oomcast_agent_ticks_total") == 2
        assert metric(text, "oomcast_agent_samples_total") == 1  # the cgroup is due once
        assert metric(text, "oomcast_agent_samples_sent_total") == 1
        assert metric(text, "oomcast_agent_source_errors_total", source="broken") == 2
        assert metric(text, "oomcast_agent_source_errors_total", source="cgroup") == 0
        assert (
            metric(text, "oomcast_agent_memory_pressure_avg10", device="cgroup:/job", kind="some")
            == 2.25
        )
        assert metric(text, "oomcast_agent_cgroup_domains") == 1
        assert httpx.get(f"{base}/livez").status_code == 200
        assert httpx.get(f"{base}/readyz").status_code == 200
        assert httpx.get(f"{base}/nope").status_code == 404
        # a broken source costs nothing to the others: the sample reached Redis
        assert client.xlen(Keys(key_prefix).samples_for("n1")) == 1
    finally:
        http.close()


@pytest.mark.slow  # rides out a Redis outage and a stall: about 4 s
def test_not_ready_while_redis_is_down_and_not_live_when_stalled(tmp_path: Path) -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.2)  # nothing listens on port 1
    src = CgroupSource("n1", cgroup_root(tmp_path), interval_s=0.1)
    agent = NodeAgent([src], StreamPublisher(dead), Keys("t"), interval_s=0.1)
    http = AgentHTTP(agent, "127.0.0.1", 0).start()
    try:
        base = f"http://127.0.0.1:{http.port}"
        agent.tick()
        r = httpx.get(f"{base}/readyz")
        assert r.status_code == 503 and "1 buffered" in r.text
        assert metric(httpx.get(f"{base}/metrics").text, "oomcast_agent_buffered_samples") == 1
        agent.stats.last_tick_at = time.monotonic() - 60  # the loop stopped a minute ago
        r = httpx.get(f"{base}/livez")
        assert r.status_code == 503 and "no tick for" in r.text
    finally:
        http.close()


def test_samples_of_the_other_sources_still_flow(redis_url: str, key_prefix: str) -> None:
    class One:
        name = "one"
        interval_s = 1.0
        exhausted = False

        def poll(self, now: float) -> list[Record]:
            return [
                Sample(ts=now, node="n", device="gpu0", kind="gpu", total_bytes=10, used_bytes=5)
            ]

    client = redis.Redis.from_url(redis_url)
    agent = NodeAgent([Broken(), One()], StreamPublisher(client), Keys(key_prefix))
    agent.tick()
    assert agent.stats.samples == 1 and agent.stats.source_errors == {"broken": 1}


def test_an_odd_record_is_counted_and_the_rest_still_flow(redis_url: str, key_prefix: str) -> None:
    class Odd:
        name = "odd"
        interval_s = 1.0
        exhausted = False

        def poll(self, now: float) -> list[Record]:
            bad = Sample(ts=now, node="n", device="cg0", kind="host", total_bytes=0, used_bytes=0)
            ok = Sample(ts=now, node="n", device="gpu0", kind="gpu", total_bytes=10, used_bytes=5)
            return [bad, ok]

    client = redis.Redis.from_url(redis_url)
    agent = NodeAgent([Odd()], StreamPublisher(client), Keys(key_prefix))
    agent.tick()
    assert agent.stats.samples == 1 and agent.stats.source_errors == {"odd": 1}


def test_domains_not_seen_for_a_while_are_forgotten(redis_url: str, key_prefix: str) -> None:
    class Churn:
        name = "churn"
        interval_s = 1.0
        exhausted = False

        def poll(self, now: float) -> list[Record]:  # a new container every tick
            dev = f"cgroup:/c{int(now)}"
            return [Sample(ts=now, node="n", device=dev, kind="host", total_bytes=10, used_bytes=5)]

    t = [0.0]
    client = redis.Redis.from_url(redis_url)
    agent = NodeAgent(
        [Churn()], StreamPublisher(client), Keys(key_prefix), clock=lambda: t[0], forget_after_s=30
    )
    for _ in range(200):
        agent.tick()
        t[0] += 1.0
    assert agent.stats.samples == 200
    assert agent.stats.domains <= 31 + 60  # swept at least once a minute
    assert len(agent._embedders) <= 91
