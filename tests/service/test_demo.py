"""`oomcast demo` as a user runs it, bounded by --duration."""

from __future__ import annotations

import os
import subprocess
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
    assert "with a bad signature" in done.stdout
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
