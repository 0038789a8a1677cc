"""Shared fixtures. Redis tests use the real server on 127.0.0.1:6379 (``.ci/run`` starts
one), database 13 and a key prefix of their own, so they never touch anyone's data."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import redis

TEST_REDIS_URL = os.environ.get("OOMCAST_TEST_REDIS_URL", "redis://127.0.0.1:6379/13")
GIB = 1 << 30


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


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


class PrivateRedis:
    """A redis-server of the test's own, on a free port, that the test can stop and restart."""

    def __init__(self, tmp: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            pytest.fail("redis-server is not on PATH; .ci/run installs it")
        self.exe = exe
        self.tmp = tmp
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                self.exe,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.tmp),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis.from_url(self.url, socket_connect_timeout=0.2).ping()
                return
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise RuntimeError("private redis-server did not start") from None
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[PrivateRedis]:
    server = PrivateRedis(tmp_path)
    server.start()
    yield server
    server.stop()


class WebhookReceiver:
    """A real HTTP server that records every POST; ``statuses`` scripts its answers."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.statuses: list[int] = []  # answered in order; 200 once exhausted
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with receiver._lock:
                    status = receiver.statuses.pop(0) if receiver.statuses else 200
                    receiver.requests.append(
                        {
                            "path": self.path,
                            "headers": dict(self.headers),
                            "body": body,
                            "json": json.loads(body),
                            "status": status,
                            "at": time.time(),
                        }
                    )
                self.send_response(status)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Any, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with self._lock:
                got = [r for r in self.requests if predicate(r)]
            if got:
                return got
            time.sleep(0.05)
        return []

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def webhook_receiver() -> Iterator[WebhookReceiver]:
    receiver = WebhookReceiver()
    yield receiver
    receiver.close()


def wait_until(predicate: Any, timeout_s: float = 20.0, interval_s: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval_s)
    return False


def oomcast_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "oomcast.service.cli", *args]


def start_serve(env: dict[str, str], port: int) -> subprocess.Popen[bytes]:
    """`oomcast serve` as a real process on ``port``, returned once ``/readyz`` says 200."""
    import httpx

    proc = subprocess.Popen(
        oomcast_cmd("serve", "--port", str(port)),
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )

    def ready() -> bool:
        try:
            return httpx.get(f"http://127.0.0.1:{port}/readyz").status_code == 200
        except httpx.HTTPError:
            return False

    if not wait_until(ready, 30):
        proc.kill()
        proc.wait()
        raise AssertionError("oomcast serve did not become ready")
    return proc


# --- memory cgroups of either version, as fixture trees ------------------------------------


@pytest.fixture
def v1(tmp_path: Path) -> Any:
    """A cgroup v1 memory directory as the kernel lays it out (tests/support.py)."""
    from support import v1_files, write_files

    from oomcast.collectors.cgroupfs import MemoryCgroup

    return MemoryCgroup(write_files(tmp_path / "v1" / "job-a", v1_files()), version=1)


@pytest.fixture
def v2(tmp_path: Path) -> Any:
    """A cgroup v2 memory directory as the kernel lays it out (tests/support.py)."""
    from support import v2_files, write_files

    from oomcast.collectors.cgroupfs import MemoryCgroup

    return MemoryCgroup(write_files(tmp_path / "v2" / "job-b", v2_files()), version=2)
