"""The publisher against real Redis servers, including one the test stops and restarts."""

from __future__ import annotations

from typing import Any

import redis
from support import wait_until

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


def test_full_redis_takes_part_of_a_batch_and_each_sample_arrives_once(
    private_redis: Any,
) -> None:
    """Redis at ``maxmemory`` (noeviction) takes the first entries of a pipelined batch and
    refuses the rest; the agent must send again only what was refused: once Redis has room,
    every entry is there exactly once, in order (the old publisher re-sent the whole batch)."""
    client = redis.Redis.from_url(private_redis.url)
    now = [0.0]
    pub = StreamPublisher(client, clock=lambda: now[0])
    client.config_set("maxmemory-policy", "noeviction")
    used = int(client.info("memory")["used_memory"])
    client.config_set("maxmemory", used + 200_000)  # room for some of the 800 KB below
    batch = [Entry("s", {"i": str(i), "pad": "x" * 2000}, 1) for i in range(400)]
    assert not pub.publish(batch)
    taken = client.xlen("s")
    assert 0 < taken < 400, taken  # a partial batch: some in, the rest refused
    assert pub.stats.entries_sent == taken and pub.stats.samples_sent == taken
    assert pub.stats.entries_refused == 400 - taken and pub.stats.partial_flushes == 1
    assert pub.buffered_samples == 400 - taken
    now[0] += 10.0
    assert not pub.publish([Entry("s", {"i": "400", "pad": ""}, 1)])  # still full: nothing new
    assert client.xlen("s") == taken
    client.config_set("maxmemory", 0)  # room again
    now[0] += 10.0
    assert pub.publish([])
    assert [int(f[b"i"]) for _, f in client.xrange("s")] == list(range(401))
    assert pub.stats.samples_sent == 401 and pub.buffered_samples == 0


def test_read_only_redis_is_ridden_out_without_duplicates(private_redis: Any) -> None:
    """A replica after a failover answers READONLY to every write: nothing is lost or sent
    twice once it takes writes again."""
    client = redis.Redis.from_url(private_redis.url)
    now = [0.0]
    pub = StreamPublisher(client, clock=lambda: now[0])
    assert pub.publish([entry(0)])
    client.execute_command("REPLICAOF", "127.0.0.1", "1")  # a primary that is not there
    try:
        assert wait_until(lambda: client.info("replication")["role"] == "slave", 5)
        assert not pub.publish([entry(1), entry(2)])
        assert pub.stats.entries_refused == 2 and pub.buffered_samples == 2
    finally:
        client.execute_command("REPLICAOF", "NO", "ONE")
    now[0] += 10.0
    assert pub.publish([entry(3)])
    assert [int(f[b"i"]) for _, f in client.xrange("s")] == [0, 1, 2, 3]
