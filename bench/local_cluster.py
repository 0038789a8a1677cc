"""A Redis Cluster on this machine, from the ``redis-server`` binary: ``masters`` primaries
(no replicas), each on a free port with its cluster bus on another, joined and given their
hash slots by ``redis-cli --cluster create``. For ``oomcast bench cluster`` and the tests;
nothing is written to disk but each node's ``nodes.conf`` and log, in the given folder.

``start()`` returns once every node says ``cluster_state:ok`` and knows every other, so a
client connecting then sees the whole cluster; ``stop()`` ends every node it started.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import redis

from oomcast.bench.procs import free_ports

HOST = "127.0.0.1"


class LocalClusterError(RuntimeError):
    """The cluster cannot be started here; the message says what is missing or failed."""


def binaries() -> tuple[str, str]:
    """The paths of ``redis-server`` and ``redis-cli``; LocalClusterError naming what is
    missing."""
    server, cli = shutil.which("redis-server"), shutil.which("redis-cli")
    missing = [name for name, path in (("redis-server", server), ("redis-cli", cli)) if not path]
    if server is None or cli is None:
        raise LocalClusterError(
            f"{' and '.join(missing)} not on PATH: a local Redis Cluster is started from them"
            " (Debian/Ubuntu: apt-get install redis-server redis-tools)"
        )
    return server, cli


@dataclass
class LocalCluster:
    dir: Path
    masters: int = 3
    ports: list[int] = field(default_factory=list)
    _procs: list[subprocess.Popen[bytes]] = field(default_factory=list, repr=False)
    _logs: list[IO[bytes]] = field(default_factory=list, repr=False)
    _argv: list[list[str]] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if self.masters < 3:
            raise ValueError(f"masters={self.masters}: a Redis Cluster needs at least 3")

    @property
    def url(self) -> str:
        """A URL of one node: what ``OOMCAST_REDIS_URL`` names with ``OOMCAST_REDIS_CLUSTER``."""
        return f"redis://{HOST}:{self.ports[0]}/0"

    @property
    def pids(self) -> list[int]:
        return [proc.pid for proc in self._procs]

    def client(self) -> redis.RedisCluster:
        return redis.RedisCluster(HOST, self.ports[0], socket_connect_timeout=2, socket_timeout=10)

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(HOST, port, socket_connect_timeout=0.5, socket_timeout=5)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        """Start the nodes and join them; on a failure, every node started is stopped."""
        server, cli = binaries()
        try:
            self._start(server, cli, timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def _start(self, server: str, cli: str, timeout_s: float) -> None:
        ports = free_ports(2 * self.masters)
        self.ports, buses = ports[: self.masters], ports[self.masters :]
        for port, bus in zip(self.ports, buses, strict=True):
            where = self.dir / str(port)
            where.mkdir(parents=True, exist_ok=True)
            self._argv.append([
                server, "--port", str(port), "--bind", HOST, "--cluster-enabled", "yes",
                "--cluster-port", str(bus), "--cluster-config-file", "nodes.conf",
                "--cluster-node-timeout", "5000", "--save", "", "--appendonly", "no",
                "--maxmemory-policy", "noeviction", "--dir", str(where),
            ])  # fmt: skip
            log = (where / "redis.log").open("ab")
            self._logs.append(log)
            self._procs.append(self._spawn(len(self._procs)))
        deadline = time.monotonic() + timeout_s
        self._wait(self._answers, deadline, "answer PING")
        addrs = [f"{HOST}:{p}" for p in self.ports]
        done = subprocess.run(
            [cli, "--cluster", "create", *addrs, "--cluster-replicas", "0", "--cluster-yes"],
            capture_output=True,
            timeout=max(1.0, deadline - time.monotonic()),
            check=False,
        )
        if done.returncode != 0:
            tail = (done.stdout + done.stderr).decode(errors="replace")[-800:]
            raise LocalClusterError(f"redis-cli --cluster create failed: {tail}")
        self._wait(self._joined, deadline, "agree that the cluster is ok")

    def _spawn(self, index: int) -> subprocess.Popen[bytes]:
        log = self._logs[index]
        return subprocess.Popen(self._argv[index], stdin=subprocess.DEVNULL, stdout=log, stderr=log)

    def kill(self, index: int) -> None:
        """SIGKILL node ``index`` (a crash); ``restart(index)`` brings it back."""
        self._procs[index].kill()
        self._procs[index].wait(10)

    def restart(self, index: int, timeout_s: float = 30.0) -> None:
        """Start node ``index`` again, on its ports, from its ``nodes.conf``: it keeps its
        slots but none of its data (nothing is persisted), as a node whose disk was lost.
        Returns once every node says the cluster is ok again."""
        self._procs[index] = self._spawn(index)
        self._wait(self._joined, time.monotonic() + timeout_s, "agree that the cluster is ok")

    def _answers(self, port: int) -> bool:
        with self.node(port) as node:
            return bool(node.ping())

    def _joined(self, port: int) -> bool:
        with self.node(port) as node:
            fields: dict[str, Any] = node.cluster("info")  # redis-py parses it into a dict
        return (
            fields.get("cluster_state") == "ok"
            and fields.get("cluster_known_nodes") == str(self.masters)
            and fields.get("cluster_slots_ok") == "16384"
        )

    def _wait(self, ready: Callable[[int], bool], deadline: float, what: str) -> None:
        for port in self.ports:
            while True:
                try:
                    if ready(port):
                        break
                except (redis.RedisError, OSError):
                    pass
                if time.monotonic() > deadline:
                    logs = self.dir / str(port) / "redis.log"
                    raise LocalClusterError(f"node {HOST}:{port} did not {what} (see {logs})")
                time.sleep(0.05)

    def stop(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)
        for log in self._logs:
            log.close()
        self._procs.clear()
        self._logs.clear()
        self._argv.clear()

    def __enter__(self) -> LocalCluster:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
