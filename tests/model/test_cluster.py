"""What a Redis Cluster URL must look like: said before anything connects, by the service's
settings and the agent alike, in a sentence that names the variable."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from oomcast.cli.env import CommandEnv
from oomcast.model.cluster import cluster_url_problem
from oomcast.service.settings import Settings


@pytest.mark.parametrize(
    "url", ["redis://10.0.0.5:7000", "redis://h:6379/0", "rediss://:pw@h:6380/", "redis://h"]
)
def test_a_node_url_seeds_a_cluster(url: str) -> None:
    assert cluster_url_problem(url) is None


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("redis://h:6379/13", "database '13'"),
        ("unix:///run/redis.sock", "TCP only"),
        ("redis:///0", "names no host"),
    ],
)
def test_what_cannot_seed_a_cluster_is_named(url: str, words: str) -> None:
    problem = cluster_url_problem(url)
    assert problem is not None and words in problem and "OOMCAST_REDIS_URL" in problem


def test_the_service_refuses_a_cluster_url_it_cannot_use_at_start() -> None:
    with pytest.raises(ValidationError, match="database '13'"):
        Settings(redis_url="redis://h:6379/13", redis_cluster=True)
    assert Settings(redis_url="redis://h:6379/13").redis_cluster is False  # one server: fine
    assert Settings(redis_url="redis://h:7000", redis_cluster=True).redis_cluster


def test_the_cluster_switch_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMCAST_REDIS_CLUSTER", "1")
    assert Settings().redis_cluster and CommandEnv().redis_cluster
    monkeypatch.setenv("OOMCAST_REDIS_CLUSTER", "0")
    assert not Settings().redis_cluster and not CommandEnv().redis_cluster
