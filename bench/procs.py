"""The real processes the benches, the demo and the tests start: a private ``redis-server``
(``RedisServer``: every single server; ``local_cluster.py`` starts the nodes of a Redis
Cluster), ``oomcast serve`` replicas and ``oomcast
collect`` agents, each in a process group of its own so that a kill reaches everything it
started, and every one of them torn down on the way out; and the two helpers everything
that waits on a process uses (``free_port``, ``wait_until``).
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

POLL_S = 0.05


class FaultBenchError(RuntimeError):
    """The bench cannot run here (no redis-server, a process that never started); the message
    says what is missing."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    return free_ports(1)[0]


def free_ports(n: int) -> list[int]:
    """``n`` distinct ports free now (held open together, so none is handed out twice)."""
    socks: list[socket.socket] = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(
    predicate: Callable[[], bool], timeout_s: float = 20.0, interval_s: float = POLL_S
) -> bool:
    """Poll ``predicate`` until it is true (True) or ``timeout_s`` passes (False): the one
    wait the tests and the benches use (no test sleeps for a fixed time)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)


def redis_answers(url: str, timeout_s: float = 0.3) -> bool:
    """Whether a Redis at ``url`` answers PING (False: down, or still loading its data)."""
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout_s).ping())
    except (redis.RedisError, OSError):
        return False


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


def rss_mib(pid: int) -> float | None:
    """A process's resident memory in MiB (one decimal), None when it cannot be read."""
    rss = read_status(pid).get("VmRSS")
    return None if rss is None else round(rss / (1 << 20), 1)


class RedisServer:
    """A private ``redis-server`` on a free port: the one way the tests, the benches and the
    demo start one. ``persist=True`` gives it an append-only file (``appendfsync everysec``:
    what it has answered is written out before the answer, so a SIGKILL of the process, as
    ``kill()`` sends, loses nothing it took, as with a production Redis; ``start()`` again
    reloads it); without, it keeps everything in memory, so that what a bench times is
    oomcast, not this machine's disk. Started through ``procs`` (logged, and killed with
    everything else the bench started) or on its own, in a session of its own (Ctrl-C is
    for the caller, which stops this server last; ``own_session=False`` lets a terminal's
    Ctrl-C reach it too, as the tests want, so an interrupted run leaves none behind)."""

    def __init__(
        self,
        procs: Procs | None,
        data_dir: Path,
        persist: bool = True,
        port: int | None = None,
        own_session: bool = True,
    ) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FaultBenchError(
                "redis-server is not on PATH: a private one is started from it"
                " (Debian/Ubuntu: apt-get install redis-server)"
            )
        self.exe = exe
        self.procs = procs
        self.dir = data_dir
        self.persist = persist
        self.own_session = own_session
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen[bytes] | None = None
        self.config = (
            "appendonly yes, appendfsync everysec, no RDB snapshots, noeviction"
            if persist
            else "in memory only (no append-only file, no RDB snapshots), noeviction"
        )

    def argv(self) -> list[str]:
        durable = ["--appendonly", "yes", "--appendfsync", "everysec"]
        return [
            self.exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
            *(durable if self.persist else ["--appendonly", "no"]),
            "--maxmemory-policy", "noeviction", "--dir", str(self.dir),
        ]  # fmt: skip

    def client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=10)

    def answers(self) -> bool:
        return redis_answers(self.url)

    def start(self, timeout_s: float = 20.0) -> RedisServer:
        if self.procs is not None:
            self.proc = self.procs.spawn(self.argv(), os.environ, "redis.log")
        else:
            self.proc = subprocess.Popen(
                self.argv(),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
                start_new_session=self.own_session,
            )
        proc = self.proc
        if not wait_until(lambda: self.answers() or proc.poll() is not None, timeout_s) or (
            proc.poll() is not None
        ):
            self.kill()
            where = f" (see {self.dir / 'redis.log'})" if self.procs is not None else ""
            raise FaultBenchError(f"{self.exe} did not answer on port {self.port}{where}")
        return self

    def _signal(self, sig: int) -> None:
        assert self.proc is not None
        if self.procs is not None or self.own_session:
            Procs.kill(self.proc, sig)  # its process group: what it started goes too
        elif self.proc.poll() is None:
            self.proc.send_signal(sig)  # it shares the caller's group: signal it alone
            if sig == signal.SIGKILL:
                self.proc.wait(10)

    def kill(self) -> None:
        """SIGKILL: a crash."""
        if self.proc is not None:
            self._signal(signal.SIGKILL)
            self.proc = None

    def stop(self) -> None:
        """SIGTERM, as an operator stops it (a SIGKILL if it does not end in 10 s)."""
        if self.proc is not None:
            self._signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
            self.proc = None

    def __enter__(self) -> RedisServer:
        return self if self.proc is not None else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


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
    if not wait_until(lambda: svc.ready() or not svc.alive(), 60) or not svc.alive():
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
    if not wait_until(lambda: agent.ready() or proc.poll() is not None, 30) or proc.poll():
        raise FaultBenchError(f"oomcast collect --node {node} did not start ({name})")
    return agent
