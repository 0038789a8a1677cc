"""Shared fixtures, found by pytest's discovery (helpers that are not fixtures live in
``support.py``). Redis tests use the real server on 127.0.0.1:6379 (``.ci/run`` starts one),
database 13 and a key prefix of their own, so they never touch anyone's data. Real memory
cgroups come from one factory, ``make_cgroup``, which skips with the reason where this
machine has no writable memory controller.

Every test is marked by what it does (``pytest_collection_modifyitems``, from the fixtures
it takes and what its module runs; pyproject.toml lists the markers): ``-m "not slow"`` is
the fast tier, ``-m "not processes and not browser"`` keeps to this process, ``-m redis``
selects what needs the Redis server."""

from __future__ import annotations

import os
import sys
import types
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import PrivateRedis, WebhookReceiver, v1_files, v2_files, write_files

from oomcast.collectors.cgroupfs import CgroupUnavailable, MemoryCgroup, default_root

TEST_REDIS_URL = os.environ.get("OOMCAST_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
# In-job hooks write no diagnosis bundles unless a test asks for them (bundle_dir=...): the
# default folder is shared by every process, and each bundle adds an event to the stream.
os.environ.setdefault("OOMCAST_BUNDLE_DIR", "off")
MIB = 1 << 20


@pytest.fixture(scope="session")
def redis_url() -> str:
    try:
        redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=1).ping()
    except redis.RedisError as exc:
        pytest.fail(
            f"Redis at {TEST_REDIS_URL} does not answer ({exc}); start one with"
            " `redis-server --daemonize yes --port 6379 --save '' --appendonly no` or run .ci/run"
        )
    return TEST_REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    prefix = f"oomcast-test-{uuid.uuid4().hex[:10]}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)


@pytest.fixture
def rclient(redis_url: str) -> redis.Redis:
    return redis.Redis.from_url(redis_url)


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


# --- memory cgroups: real ones, and fixture trees of either version ------------------------

MakeCgroup = Callable[[str, int], MemoryCgroup]


@pytest.fixture
def make_cgroup() -> Iterator[MakeCgroup]:
    """``make(name, limit_bytes)``: a real memory cgroup under the machine's writable root,
    removed after the test; skips the test, saying why, where none can be made."""
    made: list[MemoryCgroup] = []

    def make(name: str, limit_bytes: int) -> MemoryCgroup:
        try:
            cg = MemoryCgroup.create(
                default_root(), f"{name}-{os.getpid()}-{uuid.uuid4().hex[:8]}", limit_bytes
            )
        except CgroupUnavailable as exc:
            pytest.skip(f"no writable memory cgroup here: {exc}")
        made.append(cg)
        return cg

    yield make
    for cg in reversed(made):
        cg.remove()


@pytest.fixture
def cgroup_root(make_cgroup: MakeCgroup) -> Path:
    """The directory real cgroups are made under, once a probe there has worked (or a skip)."""
    return make_cgroup("oomcast-probe", 64 * MIB).path.parent


@pytest.fixture
def v1(tmp_path: Path) -> Any:
    """A cgroup v1 memory directory as the kernel lays it out (tests/support.py)."""
    return MemoryCgroup(write_files(tmp_path / "v1" / "job-a", v1_files()), version=1)


@pytest.fixture
def v2(tmp_path: Path) -> Any:
    """A cgroup v2 memory directory as the kernel lays it out (tests/support.py)."""
    return MemoryCgroup(write_files(tmp_path / "v2" / "job-b", v2_files()), version=2)


# --- markers: what a test does -------------------------------------------------------------

# fixture -> the markers a test taking it gets
_BY_FIXTURE = {
    "redis_url": ("redis",),
    "private_redis": ("redis", "processes"),
    "cluster": ("redis", "processes"),  # a local Redis Cluster (tests/cluster_support.py)
    "make_cgroup": ("cgroup",),
    "cgroup_root": ("cgroup",),
    "page": ("browser",),
    "browser": ("browser",),
    "webhook_receiver": ("http",),
}
# a global name a test uses, itself or through the module's helpers -> its markers
_BY_NAME = {
    "subprocess": ("processes",),
    "start_serve": ("processes",),
    "start_serve_logged": ("processes",),
    "oomcast_cmd": ("processes",),
    "RedisServer": ("redis", "processes"),
    "LocalCluster": ("redis", "processes"),
    "torch": ("torch",),
    "OnnxForecaster": ("model",),
    "DEFAULT_MODEL": ("model",),
    "SHIPPED_MODEL": ("model",),
    "create_app": ("model",),  # the app loads the shipped model unless told otherwise
}


def _names_used(fn: Any, space: dict[str, Any], depth: int = 3) -> set[str]:
    """The global names ``fn`` uses, with those of the module's own functions it calls (to
    ``depth`` levels) and of the functions and classes nested in it."""
    code = getattr(fn, "__code__", None)
    if code is None:
        return set()
    seen: set[str] = set()
    todo = [code]
    while todo:
        c = todo.pop()
        seen.update(c.co_names)
        todo.extend(k for k in c.co_consts if isinstance(k, type(code)))
    if depth > 0:
        for name in list(seen):
            helper = space.get(name)
            if callable(helper) and getattr(helper, "__module__", None) == space.get("__name__"):
                seen |= _names_used(helper, space, depth - 1)
    return seen


def _markers_of(item: pytest.Item) -> set[str]:
    names: set[str] = set()
    for fixture in getattr(item, "fixturenames", ()):
        names.update(_BY_FIXTURE.get(fixture, ()))
    functions = [getattr(item, "function", None)]
    info = getattr(item, "_fixtureinfo", None)  # the fixtures' own code says what they start
    for defs in info.name2fixturedefs.values() if info is not None else ():
        functions += [d.func for d in defs]
    for fn in functions:
        module = sys.modules.get(getattr(fn, "__module__", "") or "")
        if fn is not None and isinstance(module, types.ModuleType):
            for name in _names_used(fn, vars(module)):
                names.update(_BY_NAME.get(name, ()))
    return names


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        for name in sorted(_markers_of(item)):
            item.add_marker(name)
