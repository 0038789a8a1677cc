"""bench/agent.py and ``oomcast bench hook|agent``: the benchmarks run and report figures
that add up (timings themselves are not judged by tests)."""

from __future__ import annotations

import json
import subprocess

import pytest
from support import oomcast_cmd

from oomcast.bench.agent import bench_agent


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_bench_agent_samples_every_domain_each_tick(redis_url: str) -> None:
    result = bench_agent(redis_url, seconds=1.0, hz=20, domains=3)
    assert result["domains"] == 3 and result["gpus"] == 8 and result["ticks"] >= 10
    assert result["samples_sent"] == (3 + 8) * result["ticks"]  # every cgroup and GPU, each tick
    assert 0 < result["cpu_pct"] <= 100 * result["cpus"]
    assert result["cpu_percent_of_one_core"] == result["cpu_pct"]
    assert result["bench_cpu_pct"] >= 0
    assert result["us_per_tick_p50"] <= result["us_per_tick_p99"]


def test_bench_agent_gpus_only_and_nothing(redis_url: str) -> None:
    result = bench_agent(redis_url, seconds=0.5, hz=20, domains=0, gpus=2)
    assert result["samples_sent"] == 2 * result["ticks"] > 0
    with pytest.raises(ValueError, match="at least one"):
        bench_agent(redis_url, seconds=0.5, domains=0, gpus=0)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_bench_cli_hook_and_agent(redis_url: str) -> None:
    env_url = ["--redis-url", redis_url]
    hook = subprocess.run(
        oomcast_cmd("bench", "hook", "--steps", "300", "--json", *env_url),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert hook.returncode == 0, hook.stderr
    figures = json.loads(hook.stdout)
    assert figures["steps"] == 300
    assert 0 < figures["us_per_step_p50"] <= figures["us_per_step_p99"]
    agent = subprocess.run(
        oomcast_cmd(
            "bench", "agent", "--seconds", "1", "--domains", "2", "--gpus", "3", "--json", *env_url
        ),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert agent.returncode == 0, agent.stderr
    figures = json.loads(agent.stdout)
    assert (figures["domains"], figures["gpus"]) == (2, 3)
    assert figures["samples_sent"] == 5 * figures["ticks"] > 0 and figures["cpu_pct"] > 0
    down = subprocess.run(
        oomcast_cmd("bench", "agent", "--seconds", "1", "--redis-url", "redis://127.0.0.1:1/0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert down.returncode == 2 and "needs a Redis" in down.stderr
