"""training/from_redis.py and ``oomcast dump``: a node's streams in the real Redis back into a
labelled trace, with duplicates (at-least-once delivery) and broken entries handled."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import redis
from support import oomcast_cmd, sample

from oomcast.model.schema import Event
from oomcast.model.trace import load_trace
from oomcast.model.wire import Keys, encode_event, encode_samples, sample_payload
from oomcast.training.from_redis import dump_trace


def publish(client: redis.Redis, keys: Keys, node: str, ts: list[float], device: str) -> None:
    for t in ts:
        s = sample(t, node=node, device=device)
        client.xadd(keys.samples_for(node), encode_samples(node, [sample_payload(s, None, None)]))


def test_dump_keeps_one_node_dedups_and_labels(
    rclient: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    keys = Keys(key_prefix)
    publish(rclient, keys, "n1", [1.0, 2.0, 3.0], "gpu0")
    publish(rclient, keys, "n1", [2.0, 3.0, 4.0], "gpu0")  # re-sent after a reconnect
    publish(rclient, keys, "n1", [1.5, 2.5], "cgroup:/a")
    publish(rclient, keys, "other", [1.0, 2.0], "gpu0")
    rclient.xadd(keys.samples_for("n1"), {"samples": "{not json"})
    rclient.xadd(keys.events, encode_event(Event(ts=4.5, node="n1", device="gpu0", event="oom")))
    rclient.xadd(keys.events, encode_event(Event(ts=4.5, node="n1", device="gpu0", event="oom")))
    rclient.xadd(keys.events, encode_event(Event(ts=3.0, node="other", device="gpu0", event="oom")))
    out = tmp_path / "n1.jsonl.gz"
    result = dump_trace(rclient, keys, "n1", out)
    assert (result.samples, result.ooms, result.duplicates) == (6, 1, 3)
    assert result.domains == ["cgroup:/a", "gpu0"] and result.skipped_entries == 1
    trace = load_trace(out)
    assert [s.ts for s in trace.samples[("n1", "gpu0")]] == [1.0, 2.0, 3.0, 4.0]
    assert trace.oom_ts(("n1", "gpu0")) == 4.5 and trace.oom_ts(("n1", "cgroup:/a")) is None
    only = dump_trace(rclient, keys, "n1", tmp_path / "a.jsonl", devices={"cgroup:/a"})
    assert only.domains == ["cgroup:/a"] and only.ooms == 0
    with pytest.raises(ValueError, match="no samples of node 'nobody'") as err:
        dump_trace(rclient, keys, "nobody", tmp_path / "x.jsonl")
    # the docs' `--node n1` found nothing where agents name nodes by hostname: say which exist
    assert "nodes with recent samples: n1, other" in str(err.value)
    assert "hostname" in str(err.value)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_dump_time_range_and_cli(
    rclient: redis.Redis, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    import os
    import time

    keys = Keys(key_prefix)
    now = time.time()
    publish(rclient, keys, "n2", [now - 2, now - 1], "gpu1")
    env = {**os.environ, "OOMCAST_KEY_PREFIX": key_prefix}
    out = tmp_path / "n2.jsonl"
    done = subprocess.run(
        oomcast_cmd("dump", "--node", "n2", "--out", str(out), "--redis-url", redis_url),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert "2 samples of 1 domains (gpu1), 0 events (0 oom)" in done.stdout
    future = subprocess.run(
        oomcast_cmd(
            "dump",
            "--node",
            "n2",
            "--out",
            str(out),
            "--redis-url",
            redis_url,
            "--since",
            str(now + 3600),
        ),
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    # stream ids are the time Redis received the entry: none after an hour from now
    assert future.returncode == 2 and "no samples of node 'n2'" in future.stderr


def test_cli_dump_into_a_folder_that_does_not_exist_is_refused(tmp_path: Path) -> None:
    """A typo in --out names the missing folder and creates nothing (it used to create the
    folders silently)."""
    out = tmp_path / "no" / "such" / "n2.jsonl.gz"
    done = subprocess.run(
        oomcast_cmd(
            "dump", "--node", "n2", "--out", str(out), "--redis-url", "redis://127.0.0.1:1"
        ),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"the folder {tmp_path / 'no' / 'such'} does not exist" in done.stderr
    assert not (tmp_path / "no").exists()
