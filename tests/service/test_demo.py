"""`oomcast demo` as a user runs it, bounded by --duration."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import redis
from conftest import oomcast_cmd

from oomcast.service import demo


def test_demo_runs_and_cleans_up(redis_url: str, rclient: redis.Redis) -> None:
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url}
    done = subprocess.run(
        oomcast_cmd("demo", "--plain", "--duration", "12"),
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    assert "service: http://127.0.0.1:" in done.stdout
    assert "demo-node-a/gpu" in done.stdout  # the service's view, read over its REST API
    assert "demo over:" in done.stdout
    assert "demo-node-b/gpu" in done.stdout  # both nodes' partitions are read
    assert ", 0 with a bad signature" in done.stdout
    assert list(rclient.scan_iter(match=f"{demo.PREFIX}:*")) == []
    assert "Traceback" not in done.stderr


def test_demo_starts_a_private_redis_when_none_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("OOMCAST_REDIS_URL", raising=False)
    real = demo._answers
    monkeypatch.setattr(demo, "_answers", lambda url: ":6379/" not in url and real(url))
    said: list[str] = []
    with demo.redis_for_demo(said.append) as url:
        assert ":6379/" not in url
        assert redis.Redis.from_url(url).ping()
    assert "private redis-server" in said[0]
    assert not real(url)  # stopped on the way out


def test_ctrl_c_stops_everything_it_started(tmp_path: Path) -> None:
    # Like a terminal: SIGINT to the whole foreground process group.
    proc = subprocess.Popen(
        oomcast_cmd("demo", "--plain", "--private-redis"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "started a private redis-server at" in first
    url = first.split(" at ")[1].split()[0]
    assert redis.Redis.from_url(url).ping()
    for line in proc.stdout:
        if line.startswith("webhooks:"):
            break
    time.sleep(3)
    os.killpg(proc.pid, signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert "demo over:" in out
    assert "Traceback" not in err
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()
