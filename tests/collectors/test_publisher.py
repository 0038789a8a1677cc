"""The publisher against real Redis servers, including one the test stops and restarts."""

from __future__ import annotations

from typing import Any

import redis

from oomcast.collectors.publisher import Entry, StreamPublisher


def entry(i: int, n: int = 1, stream: str = "s") -> Entry:
    return Entry(stream, {"i": str(i)}, n)


def test_publishes_with_approximate_maxlen(rclient: redis.Redis, key_prefix: str) -> None:
    stream = f"{key_prefix}:samples:{{0}}"
    pub = StreamPublisher(rclient, maxlen=1000)
    for i in range(30):
        assert pub.publish([entry(i, stream=stream) for _ in range(100)])
    assert pub.stats.entries_sent == 3000
    # MAXLEN ~ trims whole macro-nodes: the stream stays near the bound, not at 3000.
    assert 1000 <= rclient.xlen(stream) < 3000


def test_outage_buffers_keeps_newest_and_flushes_on_reconnect(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.2, socket_timeout=1)
    now = [0.0]
    pub = StreamPublisher(client, buffer_samples=10, clock=lambda: now[0])
    assert pub.publish([entry(0, 2)])
    private_redis.stop()
    sent_before = pub.stats.samples_sent
    for i in range(1, 9):  # 8 entries of 2 samples: 16 samples against a buffer of 10
        now[0] += 10.0  # past any backoff, so every tick really tries Redis
        assert not pub.publish([entry(i, 2)])
    assert pub.stats.publish_errors >= 1
    assert pub.buffered_samples == 10
    assert pub.stats.samples_dropped == 6
    private_redis.start()  # same port: the client reconnects by itself
    now[0] += 10.0
    assert pub.publish([])
    assert pub.buffered_samples == 0
    assert pub.stats.samples_sent == sent_before + 10
    kept = [int(f[b"i"]) for _, f in client.xrange("s")]
    assert kept == [
        4,
        5,
        6,
        7,
        8,
    ]  # the newest survived, in order (entry 0 went with the old server)


def test_backoff_skips_attempts_until_due(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url, socket_connect_timeout=0.2)
    now = [100.0]
    pub = StreamPublisher(client, clock=lambda: now[0])
    private_redis.stop()
    pub.publish([entry(1)])
    errors = pub.stats.publish_errors
    pub.publish([entry(2)])  # within the backoff: no new attempt
    assert pub.stats.publish_errors == errors
    assert pub.buffered_samples == 2


def test_redis_refusing_writes_is_ridden_out(private_redis: Any) -> None:
    client = redis.Redis.from_url(private_redis.url)
    now = [0.0]
    pub = StreamPublisher(client, clock=lambda: now[0])
    client.config_set("maxmemory-policy", "noeviction")
    client.config_set("maxmemory", 1)  # every write is refused with an OOM error
    assert not pub.publish([entry(1)])
    assert pub.stats.publish_errors == 1
    assert pub.buffered_samples == 1
    client.config_set("maxmemory", 0)
    now[0] += 10.0
    assert pub.publish([entry(2)])
    assert [int(f[b"i"]) for _, f in client.xrange("s")] == [1, 2]
