"""What the tests share that is not a fixture (fixtures live in ``conftest.py`` and reach
tests by pytest's discovery): builders of samples, labelled traces and cgroup file trees;
free ports, the one wait helper (``wait_until``), a real HTTP receiver for webhooks, a private
redis-server, and ``oomcast serve`` as a real process. Tests ``from support import ...``."""

from __future__ import annotations

import contextlib
import json
import math
import os
import random
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from oomcast.bench.procs import RedisServer, oomcast_argv
from oomcast.bench.procs import free_port as free_port  # re-exported: tests take it from here
from oomcast.bench.procs import wait_until as wait_until
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import write_trace

GIB = 1 << 30
T0 = 1_750_000_000.0


def sample(
    ts: float = T0,
    used_frac: float = 0.5,
    *,
    total: int = 80 * GIB,
    node: str = "n1",
    device: str = "gpu0",
    **extra: object,
) -> Sample:
    return Sample(
        ts=ts,
        node=node,
        device=device,
        kind="gpu",
        total_bytes=total,
        used_bytes=int(used_frac * total),
        **extra,
    )  # type: ignore[arg-type]


def leak_trace(
    *,
    start_frac: float = 0.5,
    seconds_to_oom: float = 300.0,
    interval_s: float = 1.0,
    node: str = "n1",
    device: str = "gpu0",
    total: int = 80 * GIB,
    seed: int = 0,
) -> list[Record]:
    """Use grows linearly (with a little noise) from start_frac until it reaches capacity,
    then an ``oom`` event."""
    rng = random.Random(seed)
    out: list[Record] = []
    steps = int(seconds_to_oom / interval_s)
    for i in range(steps):
        frac = start_frac + (1.0 - start_frac) * i / steps + rng.gauss(0, 0.002)
        out.append(
            sample(
                T0 + i * interval_s,
                min(frac, 0.995),
                total=total,
                node=node,
                device=device,
                job="leaky",
            )
        )
    out.append(
        Event(ts=T0 + steps * interval_s, node=node, device=device, event="oom", job="leaky")
    )
    return out


def steady_trace(
    *,
    level: float = 0.7,
    amplitude: float = 0.05,
    seconds: float = 300.0,
    interval_s: float = 1.0,
    node: str = "n1",
    device: str = "gpu0",
    total: int = 80 * GIB,
) -> list[Record]:
    """A training job's steady sawtooth: never OOMs."""
    out: list[Record] = []
    for i in range(int(seconds / interval_s)):
        t = i * interval_s
        frac = level + amplitude * math.sin(2 * math.pi * t / 10.0)
        out.append(sample(T0 + t, frac, total=total, node=node, device=device, job="steady"))
    return out


def write(path: Path, records: list[Record]) -> Path:
    write_trace(path, records)
    return path


# --- cgroup fixture trees (files as the kernel writes them) ---------------------------------

MIB = 1 << 20
LIMIT = 512 * MIB


def write_files(path: Path, files: dict[str, str | int]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (path / name).write_text(f"{value}\n")
    return path


def v1_files(
    *,
    usage: int = 300 * MIB,
    limit: int = LIMIT,
    rss: int = 250 * MIB,
    peak: int = 320 * MIB,
    failcnt: int = 0,
    oom_kill: int = 0,
) -> dict[str, str | int]:
    return {
        "memory.limit_in_bytes": limit,
        "memory.usage_in_bytes": usage,
        "memory.max_usage_in_bytes": peak,
        "memory.failcnt": failcnt,
        "memory.stat": f"cache 4096\nrss {rss // 2}\nmapped_file 0\ntotal_cache 4096\n"
        f"total_rss {rss}\nhierarchical_memory_limit {limit}\n",
        "memory.oom_control": f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}",
        "cgroup.procs": "",
    }


def v2_files(
    *,
    current: int = 300 * MIB,
    limit: int | str = LIMIT,
    anon: int = 250 * MIB,
    peak: int = 320 * MIB,
    max_events: int = 0,
    oom_kill: int = 0,
) -> dict[str, str | int]:
    return {
        "memory.max": limit,
        "memory.current": current,
        "memory.peak": peak,
        "memory.stat": f"anon {anon}\nfile 4096\nkernel 8192\nsock 0\n",
        "memory.events": f"low 0\nhigh 0\nmax {max_events}\noom {oom_kill}\n"
        f"oom_kill {oom_kill}\noom_group_kill 0",
        "cgroup.procs": "",
    }


# --- processes, ports and waiting ---------------------------------------------------------


def open_fds(under: Path) -> int:
    """Descriptors of this process open on files under ``under`` (counting all of the
    process's would also count what other tests' threads open and close meanwhile)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # closed meanwhile (the listing's own descriptor, say)
        n += target.startswith(str(under))
    return n


def oomcast_cmd(*args: str) -> list[str]:
    """How a test runs an ``oomcast`` subcommand: as the benches do (``oomcast_argv``)."""
    return oomcast_argv(*args)


# ``python -c PEAK_RSS_OF TIMEOUT_S CMD...`` runs CMD (killed after TIMEOUT_S: give the
# outer run a longer timeout, so CMD never outlives the test) and prints ``MAXRSS_KB <n>``
# on stderr: the child's own peak RSS. Measured from a fresh small interpreter because Linux carries
# ``ru_maxrss`` across fork and exec: a child of pytest itself would report at least the RSS
# pytest had reached when it forked (over 1 GB late in a full run), and RUSAGE_CHILDREN in pytest is
# the largest of every child any earlier test waited for.
PEAK_RSS_OF = (
    "import resource, subprocess, sys\n"
    "r = subprocess.run(sys.argv[2:], capture_output=True, text=True, timeout=float(sys.argv[1]))\n"
    "print(r.stdout, end='')\n"
    "print(r.stderr, end='', file=sys.stderr)\n"
    "print('MAXRSS_KB', resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr)\n"
    "sys.exit(r.returncode)\n"
)


def peak_rss_bytes(stderr: str) -> int:
    """The child's peak RSS that ``PEAK_RSS_OF`` printed last on stderr."""
    return int(stderr.rsplit("MAXRSS_KB", 1)[1].split()[0]) * 1024


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


class PrivateRedis(RedisServer):
    """A redis-server of the test's own, on a free port, in memory only, that the test can
    stop and restart (``bench/procs.py``'s, the one every part starts)."""

    def __init__(self, tmp: Path) -> None:
        super().__init__(None, tmp, persist=False, own_session=False)


class WebhookReceiver:
    """A real HTTP server that records every POST; ``statuses`` scripts its answers."""

    def __init__(self, port: int = 0) -> None:
        self.requests: list[dict[str, Any]] = []
        self.statuses: list[int] = []  # answered in order; 200 once exhausted
        # a misbehaving receiver: its next ``drip_answers`` answers come a byte every
        # ``drip_s``; ``body_bytes`` of body follow each answer, as fast as they are taken
        self.drip_answers = 0
        self.drip_s = 0.2
        self.body_bytes = 0
        self.body_sent: list[int] = []  # bytes of body each answer got out before a hang-up
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
                with receiver._lock:
                    drip = receiver.drip_answers > 0
                    receiver.drip_answers -= drip
                if drip:  # the status line and a long header, one byte at a time
                    head = f"HTTP/1.1 {status} OK\r\nX-Pad: {'p' * 400}\r\n\r\n".encode()
                    with contextlib.suppress(OSError):
                        for i in range(len(head)):
                            self.wfile.write(head[i : i + 1])
                            self.wfile.flush()
                            time.sleep(receiver.drip_s)
                    self.close_connection = True
                    return
                self.send_response(status)
                if receiver.body_bytes:
                    self.send_header("Content-Length", str(receiver.body_bytes))
                self.end_headers()
                sent, chunk = 0, b"x" * (1 << 20)
                with contextlib.suppress(OSError):
                    while sent < receiver.body_bytes:
                        self.wfile.write(chunk[: receiver.body_bytes - sent])
                        sent += min(len(chunk), receiver.body_bytes - sent)
                if receiver.body_bytes:
                    receiver.body_sent.append(sent)
                    self.close_connection = True

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Any, timeout_s: float = 20.0) -> list[dict[str, Any]]:
        """The requests that satisfy ``predicate``, once there is one (empty on timeout)."""
        got: list[dict[str, Any]] = []

        def some() -> bool:
            nonlocal got
            with self._lock:
                got = [r for r in self.requests if predicate(r)]
            return bool(got)

        wait_until(some, timeout_s)
        return got

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
