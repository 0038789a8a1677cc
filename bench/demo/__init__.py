"""``oomcast demo``: the whole system on one machine, with a live view in the terminal.

It finds a Redis (``OOMCAST_REDIS_URL``, else one on localhost:6379, else a private
``redis-server`` it starts), runs the service in this process, two simulated nodes as real
``oomcast collect`` processes, and a local webhook receiver that checks every alert's
signature; then it shows the service's view of the GPUs through its own REST API.
Everything it started is stopped on Ctrl-C (or after ``--duration``), and the keys it wrote
(prefix ``oomcast-demo``) are removed.

Keys are handed out as on a real cluster (docs/security.md): the service holds a fresh
master control secret, each node's agent only its own node key (``collector_env``), with
which it attests its samples and verifies the service's commands.

The simulated GPUs (``NODES``) mix jobs that run out of memory with jobs that only look
busy; ``demo-node-a/gpu0`` runs a ``fast_leak`` that climbs from its start-up level to an
OOM 62-80 s after its collector starts, so every demo shows an OOM, and whether it was
forecast, within its first minute and a half. The closing summary (``summarize``) scores
the alerts the webhook receiver got against the OOMs the service saw.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import httpx
import redis
import uvicorn
from pydantic import SecretStr

from oomcast.bench.demo.inbox import WebhookInbox
from oomcast.bench.demo.summary import summarize
from oomcast.bench.demo.view import emit, watch
from oomcast.bench.procs import FaultBenchError, RedisServer, free_port, redis_answers
from oomcast.model.control import node_key
from oomcast.model.wire import DEFAULT_REDIS_URL, redact_url
from oomcast.service.main import create_app
from oomcast.service.settings import Settings, child_env

PREFIX = "oomcast-demo"
PARTITIONS = 2
GIB = 1 << 30
# (node, patterns cycled over its GPUs, seed): what the demo's ``oomcast collect`` processes
# simulate. demo-node-a/gpu0 is the fast leak that OOMs 62-80 s in (tests pin it); the
# others OOM later (step_growth; fragmenting, which the alert diagnoses as fragmentation)
# or never (sawtooth, spiky, plateau).
NODES: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("demo-node-a", ("fast_leak", "sawtooth", "step_growth", "spiky"), 1),
    ("demo-node-b", ("plateau", "fragmenting", "sawtooth", "spiky"), 2),
)
GPUS_PER_NODE = 4
SAMPLE_INTERVAL_S = 0.5
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class DemoError(RuntimeError):
    pass


def _answers(url: str) -> bool:
    return redis_answers(url, 0.5)


@contextlib.contextmanager
def redis_for_demo(
    say: Callable[[str], object], private: bool = False, configured: str | None = None
) -> Iterator[str]:
    """The configured Redis (``OOMCAST_REDIS_URL``), else one on localhost:6379, else a
    private ``redis-server`` (always, with ``private``), stopped on the way out."""
    url = None if private else configured
    if url:
        if not _answers(url):
            raise DemoError(f"OOMCAST_REDIS_URL={redact_url(url)} does not answer")
        say(f"Redis: {redact_url(url)} (from OOMCAST_REDIS_URL)")
        yield url
        return
    url = DEFAULT_REDIS_URL
    if not private and _answers(url):
        say(f"Redis: {redact_url(url)} (found running)")
        yield url
        return
    if shutil.which("redis-server") is None:
        raise DemoError(
            "no Redis: set OOMCAST_REDIS_URL, start one on localhost:6379, or install"
            " redis-server (Debian/Ubuntu: apt-get install redis-server)"
        )
    with tempfile.TemporaryDirectory(prefix="oomcast-redis-") as tmp:
        server = RedisServer(None, Path(tmp), persist=False)
        try:
            server.start(timeout_s=10)
        except FaultBenchError as exc:
            raise DemoError(f"could not start a private Redis: {exc}") from exc
        with server:  # stopped on the way out
            say(f"Redis: started a private redis-server at {server.url}")
            yield server.url


def _delete_demo_keys(url: str) -> None:
    client = redis.Redis.from_url(url, socket_connect_timeout=1)
    keys = list(client.scan_iter(match=f"{PREFIX}:*", count=1000))
    if keys:
        client.delete(*keys)


@contextlib.contextmanager
def service_in_thread(settings: Settings, port: int) -> Iterator[str]:
    config = uvicorn.Config(
        create_app(settings), host="127.0.0.1", port=port, log_level="error", lifespan="on"
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{base}/readyz", timeout=1).status_code == 200:
                break
        if not thread.is_alive() or time.monotonic() > deadline:
            raise DemoError(f"the service did not become ready on port {port}")
        time.sleep(0.1)
    try:
        yield base
    finally:
        server.should_exit = True
        thread.join(10)


def collector_argv(node: str, patterns: Sequence[str], seed: int, speed: float) -> list[str]:
    """The ``oomcast`` command line of one of the demo's simulated nodes."""
    return [
        "--log-level",
        "warning",
        "collect",
        "--metrics-port",
        "0",
        "--source",
        "sim",
        "--node",
        node,
        "--patterns",
        ",".join(patterns),
        "--gpus",
        str(GPUS_PER_NODE),
        "--seed",
        str(seed),
        "--speed",
        str(speed),
        "--interval",
        str(SAMPLE_INTERVAL_S),
    ]


def collector_env(url: str, node: str, master_secret: str) -> dict[str, str]:
    """The environment of one simulated node's agent: its own node key, never the master
    secret (which the demo's service alone holds), as on a real cluster."""
    env = child_env(
        {
            "OOMCAST_REDIS_URL": url,
            "OOMCAST_KEY_PREFIX": PREFIX,
            "OOMCAST_PARTITIONS": str(PARTITIONS),
            "OOMCAST_LOG_LEVEL": "warning",
            "OOMCAST_NODE_KEY": node_key(master_secret, node),
        }
    )
    env.pop("OOMCAST_CONTROL_SECRET", None)
    return env


@contextlib.contextmanager
def collectors(
    url: str, speed: float, master_secret: str
) -> Iterator[list[subprocess.Popen[bytes]]]:
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "oomcast.cli.main", *collector_argv(*node, speed)],
            env=collector_env(url, node[0], master_secret),
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # stopped by the demo with SIGTERM, not by the terminal
        )
        for node in NODES
    ]
    try:
        yield procs
    finally:
        for p in procs:
            p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def demo_patterns() -> dict[tuple[str, str], str]:
    """The pattern of each simulated GPU, as ``oomcast collect --patterns`` assigns them."""
    return {
        (node, f"gpu{i}"): patterns[i % len(patterns)]
        for node, patterns, _ in NODES
        for i in range(GPUS_PER_NODE)
    }


@contextlib.contextmanager
def held_logs(hold: bool) -> Iterator[list[str]]:
    """While ``hold``: warnings and errors logged go to the list, not to the terminal, where
    they would tear the live table; the rest of the log is dropped. The caller prints the
    list afterwards."""
    held: list[str] = []
    if not hold:
        yield held
        return
    root = logging.getLogger()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.levelno >= logging.WARNING:
                held.append(f"{record.levelname} {record.name}: {record.getMessage()}")

    saved = root.handlers[:]
    root.handlers = [Keep()]
    try:
        yield held
    finally:
        root.handlers = saved


def run_demo(
    redis_url: str | None = None,
    duration_s: float | None = None,
    live: bool = True,
    port: int = 0,
    speed: float = 1.0,
    private_redis: bool = False,
) -> int:
    started_at = time.time()  # "t+" in the summary counts from here
    stop = threading.Event()
    # Ctrl-C and SIGTERM both set ``stop``: the view loop ends at its next turn and everything
    # is stopped in order. A KeyboardInterrupt raised at whatever line the main thread was on
    # could leave a lock or a half-closed client behind and hang the way out.
    previous = {sig: signal.signal(sig, lambda *a: stop.set()) for sig in STOP_SIGNALS}
    # `kill -USR1 <pid>` prints every thread's stack to stderr: how to see a stuck demo.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    say: Callable[[str], object] = print
    secret = secrets.token_hex(16)  # signs the webhooks
    control_secret = secrets.token_hex(32)  # the master key: node keys derive from it
    try:
        with redis_for_demo(say, private_redis, redis_url) as url, WebhookInbox(secret) as inbox:
            _delete_demo_keys(url)
            try:
                _run(url, inbox, stop, duration_s, live, port, speed, control_secret, secret,
                     started_at)  # fmt: skip
            finally:  # whatever stopped it: no demo key outlives the demo
                try:
                    _delete_demo_keys(url)
                except redis.RedisError as exc:
                    print(f"oomcast demo: could not remove the demo's keys: {exc}", file=sys.stderr)
    except DemoError as exc:
        print(f"oomcast demo: error: {exc}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        faulthandler.unregister(signal.SIGUSR1)
    return 0


def _run(
    url: str,
    inbox: WebhookInbox,
    stop: threading.Event,
    duration_s: float | None,
    live: bool,
    port: int,
    speed: float,
    control_secret: str,
    secret: str,
    started_at: float,
) -> None:
    """The service, the agents and the view, until ``stop`` or ``duration_s``; then the
    summary."""
    say: Callable[[str], object] = emit
    settings = Settings(
        redis_url=url,
        key_prefix=PREFIX,
        partitions=PARTITIONS,
        consumer_name="demo",
        webhook_url=inbox.url,
        webhook_secret=SecretStr(secret),
        control_secret=SecretStr(control_secret),
    )
    with (
        held_logs(live) as held,
        service_in_thread(settings, port or free_port()) as base,
        collectors(url, speed, control_secret),
    ):
        say(f"service: {base}  (try {base}/v1/devices or {base}/docs)")
        ready = httpx.get(f"{base}/readyz", timeout=5).json()
        kind = ready["forecaster"]["kind"]
        note = {
            "model": "the trained model",
            "baseline": "a baseline, as configured",
            "fallback": "a BASELINE: " + ready["forecaster"]["reason"],
        }[kind]
        say(f"forecaster: {ready['model_version']} ({note})")
        say(f"webhooks: {inbox.url}, HMAC-signed; Ctrl-C stops the demo")
        ooms = watch(base, inbox, stop, duration_s, live)
    if held:  # held back while the live table was up
        emit(f"the service logged {len(held)} warnings:")
        for line in held:
            emit(f"  {line}")
    for line in summarize(inbox.snapshot(), ooms, demo_patterns(), started_at):
        emit(line)
