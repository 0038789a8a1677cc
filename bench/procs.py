"""The real processes a fault scenario runs: a private ``redis-server`` (with an append-only
file, so that killing it is a crash it recovers from, as a production Redis would), ``oomcast
serve`` replicas and ``oomcast collect`` agents, each in a process group of its own so that
a kill reaches everything it started, and every one of them torn down on the way out.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx
import redis

POLL_S = 0.1


class FaultBenchError(RuntimeError):
    """The bench cannot run here (no redis-server, a process that never started); the message
    says what is missing."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = POLL_S) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout_s`` passes (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def oomcast_argv(*args: str) -> list[str]:
    """How the bench starts an ``oomcast`` subcommand: this interpreter, this package."""
    return [sys.executable, "-m", "oomcast.cli.main", *args]


class Procs:
    """Every process the bench started, so that all of them die with it, however it ends."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self._procs: list[subprocess.Popen[bytes]] = []
        self._files: list[IO[bytes]] = []

    def spawn(
        self, argv: Sequence[str], env: Mapping[str, str], log_name: str
    ) -> subprocess.Popen[bytes]:
        out = (self.logs / log_name).open("ab")
        self._files.append(out)
        proc = subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: killpg reaches its children
        )
        self._procs.append(proc)
        return proc

    @staticmethod
    def kill(proc: subprocess.Popen[bytes], sig: int = signal.SIGKILL) -> None:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, sig)
        if sig == signal.SIGKILL:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)

    def close(self) -> None:
        for proc in self._procs:
            self.kill(proc)
        for f in self._files:
            f.close()


def read_status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM (peak) of a process, in bytes, from ``/proc/<pid>/status``."""
    out: dict[str, int] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return out
    for line in text.splitlines():
        name, _, value = line.partition(":")
        if name in ("VmRSS", "VmHWM"):
            out[name] = int(value.split()[0]) * 1024
    return out


class RedisServer:
    """A private ``redis-server`` on a free port, with an append-only file (``appendfsync
    everysec``: what it has answered is written out before the answer, so a crash of the
    process loses nothing it took). ``kill()`` is a SIGKILL; ``start()`` again reloads it."""

    def __init__(self, procs: Procs, data_dir: Path) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FaultBenchError(
                "redis-server is not on PATH: the fault bench runs a private one"
                " (Debian/Ubuntu: apt-get install redis-server)"
            )
        self.exe = exe
        self.procs = procs
        self.dir = data_dir
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = "appendonly yes, appendfsync everysec, no RDB snapshots, noeviction"

    def argv(self) -> list[str]:
        return [
            self.exe,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "yes",
            "--appendfsync",
            "everysec",
            "--maxmemory-policy",
            "noeviction",
            "--dir",
            str(self.dir),
        ]

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=10)

    def answers(self) -> bool:
        try:
            return bool(redis.Redis.from_url(self.url, socket_connect_timeout=0.3).ping())
        except (redis.RedisError, OSError):
            return False  # down, or still loading its append-only file

    def start(self) -> None:
        self.proc = self.procs.spawn(self.argv(), os.environ, "redis.log")
        if not wait_for(self.answers, 20):
            raise FaultBenchError(f"{self.exe} did not answer on port {self.port} (redis.log)")

    def kill(self) -> None:
        if self.proc is not None:
            Procs.kill(self.proc)
            self.proc = None


@dataclass
class Service:
    """One ``oomcast serve`` replica."""

    name: str
    proc: subprocess.Popen[bytes]
    base: str
    env: dict[str, str]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc.poll() is None

    def ready(self) -> bool:
        try:
            return httpx.get(f"{self.base}/readyz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def readyz(self) -> dict[str, Any] | None:
        try:
            body: dict[str, Any] = httpx.get(f"{self.base}/readyz", timeout=2).json()
            return body
        except (httpx.HTTPError, ValueError):
            return None

    def metrics(self) -> dict[str, float]:
        """The service's Prometheus counters and gauges, by name with labels; {} when it is down."""
        try:
            text = httpx.get(f"{self.base}/metrics", timeout=3).text
        except httpx.HTTPError:
            return {}
        return parse_prometheus(text)


def parse_prometheus(text: str) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        with contextlib.suppress(ValueError):
            out[name] = float(value)
    return out


def start_service(
    procs: Procs, name: str, env: Mapping[str, str], args: Sequence[str] = ()
) -> Service:
    """``oomcast serve`` (with ``args`` added) on a free port, once it is ready."""
    port = free_port()
    proc = procs.spawn(
        oomcast_argv("--log-level", "warning", "serve", "--port", str(port), *args),
        env,
        f"serve-{name}.log",
    )
    svc = Service(name, proc, f"http://127.0.0.1:{port}", dict(env))
    if not wait_for(lambda: svc.ready() or not svc.alive(), 60) or not svc.alive():
        raise FaultBenchError(f"oomcast serve ({name}) did not become ready (serve-{name}.log)")
    return svc


SUMMARY = re.compile(r"(\d+) samples, (\d+) events; sent (\d+), dropped (\d+), undelivered (\d+)")


@dataclass
class Agent:
    """One ``oomcast collect`` process; ``stop()`` ends it and reads its own account of what
    Redis took."""

    node: str
    proc: subprocess.Popen[bytes]
    log: Path
    metrics_url: str

    def ready(self) -> bool:
        try:
            return httpx.get(self.metrics_url.replace("/metrics", "/readyz"), timeout=1).is_success
        except httpx.HTTPError:
            return False

    def metrics(self) -> dict[str, float]:
        try:
            return parse_prometheus(httpx.get(self.metrics_url, timeout=2).text)
        except httpx.HTTPError:
            return {}

    def stop(self) -> dict[str, int]:
        """SIGTERM, wait for its drain, and its summary: samples made, events, entries sent,
        dropped, undelivered. Raises FaultBenchError when it printed none (it crashed)."""
        Procs.kill(self.proc, signal.SIGTERM)
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            Procs.kill(self.proc)
        found = SUMMARY.findall(self.log.read_text(errors="replace"))
        if not found:
            raise FaultBenchError(f"agent {self.node} printed no summary ({self.log.name})")
        samples, events, sent, dropped, undelivered = map(int, found[-1])
        return {
            "samples": samples,
            "events": events,
            "sent": sent,
            "dropped": dropped,
            "undelivered": undelivered,
        }


def start_agent(
    procs: Procs, node: str, env: Mapping[str, str], args: Sequence[str], tag: str
) -> Agent:
    port = free_port()
    argv = oomcast_argv(
        "--log-level", "info", "collect", "--node", node, "--metrics-port", str(port), *args
    )
    name = f"collect-{tag}-{node}.log"
    proc = procs.spawn(argv, env, name)
    agent = Agent(node, proc, procs.logs / name, f"http://127.0.0.1:{port}/metrics")
    if not wait_for(lambda: agent.ready() or proc.poll() is not None, 30) or proc.poll():
        raise FaultBenchError(f"oomcast collect --node {node} did not start ({name})")
    return agent
