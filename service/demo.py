"""``oomcast demo``: the whole system on one machine, with a live view in the terminal.

It finds a Redis (``OOMCAST_REDIS_URL``, else one on localhost:6379, else a private
``redis-server`` it starts), runs the service in this process, two simulated nodes as real
``oomcast collect`` processes, and a local webhook receiver that checks every alert's
signature; then it shows the service's view of the GPUs through its own REST API.
Everything it started is stopped on Ctrl-C (or after ``--duration``), and the keys it wrote
(prefix ``oomcast-demo``) are removed.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import redis
import uvicorn

from oomcast.service.main import create_app
from oomcast.service.settings import Settings
from oomcast.service.webhook import SIGNATURE_HEADER, verify_signature

PREFIX = "oomcast-demo"
PARTITIONS = 2
GIB = 1 << 30


class DemoError(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _answers(url: str) -> bool:
    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=0.5).ping())
    except (redis.RedisError, OSError):
        return False


@contextlib.contextmanager
def redis_for_demo(say: Any, private: bool = False) -> Iterator[str]:
    url = None if private else os.environ.get("OOMCAST_REDIS_URL")
    if url:
        if not _answers(url):
            raise DemoError(f"OOMCAST_REDIS_URL={url} does not answer")
        say(f"Redis: {url} (from OOMCAST_REDIS_URL)")
        yield url
        return
    url = "redis://127.0.0.1:6379/0"
    if not private and _answers(url):
        say(f"Redis: {url} (found running)")
        yield url
        return
    exe = shutil.which("redis-server")
    if exe is None:
        raise DemoError(
            "no Redis: set OOMCAST_REDIS_URL, start one on localhost:6379, or install"
            " redis-server (Debian/Ubuntu: apt-get install redis-server)"
        )
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="oomcast-redis-") as tmp:
        proc = subprocess.Popen(
            [
                exe,
                "--port",
                str(port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                tmp,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,  # Ctrl-C is for the demo, which stops this server last
        )
        url = f"redis://127.0.0.1:{port}/0"
        try:
            deadline = time.monotonic() + 10
            while not _answers(url):
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise DemoError(f"could not start {exe} on port {port}")
                time.sleep(0.1)
            say(f"Redis: started a private redis-server at {url}")
            yield url
        finally:
            proc.terminate()
            proc.wait(5)


class WebhookInbox:
    """A real HTTP receiver that keeps every alert and whether its signature was valid."""

    def __init__(self, secret: str) -> None:
        inbox = self
        self.secret = secret
        self.received: list[tuple[dict[str, Any], bool]] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = verify_signature(body, self.headers.get(SIGNATURE_HEADER), inbox.secret)
                with inbox._lock:
                    inbox.received.append((json.loads(body), ok))
                self.send_response(200 if ok else 401)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookInbox:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[tuple[dict[str, Any], bool]]:
        with self._lock:
            return list(self.received)


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


@contextlib.contextmanager
def collectors(url: str, speed: float) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": url,
        "OOMCAST_KEY_PREFIX": PREFIX,
        "OOMCAST_PARTITIONS": str(PARTITIONS),
        "OOMCAST_LOG_LEVEL": "warning",
    }
    nodes = [
        ("demo-node-a", "leak,sawtooth,step_growth,spiky", 1),
        ("demo-node-b", "plateau,leak,sawtooth,spiky", 2),
    ]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "oomcast.service.cli",
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
                patterns,
                "--gpus",
                "4",
                "--seed",
                str(seed),
                "--speed",
                str(speed),
                "--interval",
                "0.5",
            ],
            env=env,
            stdout=subprocess.DEVNULL,
            start_new_session=True,  # stopped by the demo with SIGTERM, not by the terminal
        )
        for node, patterns, seed in nodes
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


def _fmt_tto(t: float | None) -> str:
    return "-" if t is None else f"{t:5.0f}s"


def _alert_line(alert: dict[str, Any], signed: bool) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(alert.get("sent_at") or time.time()))
    sig = "signature ok" if signed else "BAD SIGNATURE"
    tto = alert.get("time_to_oom_s")
    tto_s = "" if tto is None else f", OOM in ~{tto:.0f}s"
    return (
        f"{when} {alert['status'].upper():8} {alert['node']}/{alert['device']}"
        f" job={alert.get('job')}{tto_s} ({alert.get('reason')}; {sig})"
    )


def _table(devices: list[dict[str, Any]], horizon: int) -> Any:
    from rich.table import Table

    table = Table(title=f"oomcast demo: GPUs, riskiest first (risk = P(OOM within {horizon}s))")
    for col in ("node/device", "job", "used", "used %", "risk", "time to OOM", "OOMs", "alert"):
        table.add_column(col, justify="left" if col in ("node/device", "job", "alert") else "right")
    for d in devices:
        risk = d["alert_risk"]
        style = "bold red" if d["alert"]["firing"] else ("yellow" if risk > 0 else "")
        table.add_row(
            f"{d['node']}/{d['device']}",
            str(d.get("job") or "(restarting)"),
            f"{d['used_bytes'] / GIB:.1f}/{d['total_bytes'] / GIB:.0f} GiB",
            f"{d['used_frac']:.0%}",
            f"{risk:.2f}",
            _fmt_tto(d["time_to_oom_s"]),
            str(d["ooms_seen"]),
            "FIRING" if d["alert"]["firing"] else "ok",
            style=style,
        )
    return table


def run_demo(
    duration_s: float | None = None,
    live: bool = True,
    port: int = 0,
    speed: float = 1.0,
    private_redis: bool = False,
) -> int:
    stop = threading.Event()
    previous = signal.signal(signal.SIGTERM, lambda *a: stop.set())
    say = print
    secret = secrets.token_hex(16)
    try:
        with redis_for_demo(say, private_redis) as url, WebhookInbox(secret) as inbox:
            _delete_demo_keys(url)
            settings = Settings(
                redis_url=url,
                key_prefix=PREFIX,
                partitions=PARTITIONS,
                consumer_name="demo",
                webhook_url=inbox.url,
                webhook_secret=secret,
            )
            with service_in_thread(settings, port or free_port()) as base, collectors(url, speed):
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
                ooms = _watch(base, inbox, stop, duration_s, live)
            _report(inbox, ooms)
            try:
                _delete_demo_keys(url)
            except redis.RedisError as exc:
                print(f"oomcast demo: could not remove the demo's keys: {exc}", file=sys.stderr)
    except DemoError as exc:
        print(f"oomcast demo: error: {exc}", file=sys.stderr)
        return 2
    finally:
        signal.signal(signal.SIGTERM, previous)
    return 0


def _watch(
    base: str, inbox: WebhookInbox, stop: threading.Event, duration_s: float | None, live: bool
) -> int:
    """Show the service's view until stopped; returns how many OOMs the service saw."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    end = None if duration_s is None else time.monotonic() + duration_s
    shown = 0
    client = httpx.Client(base_url=base, timeout=2)
    ctx = Live(console=console, refresh_per_second=4) if live else contextlib.nullcontext()
    ooms = 0
    try:
        with ctx as view:
            last_plain = 0.0
            while not stop.is_set() and (end is None or time.monotonic() < end):
                try:
                    data = client.get("/v1/devices").json()
                except httpx.HTTPError:
                    data = {"devices": [], "alert_horizon_s": 60}
                ooms = max(ooms, sum(d["ooms_seen"] for d in data["devices"]))
                received = inbox.snapshot()
                if view is not None:
                    lines = [_alert_line(a, ok) for a, ok in received[-8:]]
                    body = Text("\n".join(lines) or "no alerts yet", style="dim")
                    view.update(
                        Group(
                            _table(data["devices"], data["alert_horizon_s"]),
                            Text("webhooks received:"),
                            body,
                        )
                    )
                else:
                    for alert, ok in received[shown:]:
                        print(_alert_line(alert, ok), flush=True)
                    shown = len(received)
                    if time.monotonic() - last_plain > 5:
                        last_plain = time.monotonic()
                        for d in data["devices"]:
                            print(
                                f"  {d['node']}/{d['device']}: {d['used_frac']:.0%} used,"
                                f" risk {d['alert_risk']:.2f}, OOMs {d['ooms_seen']}",
                                flush=True,
                            )
                stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return ooms


def _report(inbox: WebhookInbox, ooms: int) -> None:
    received = inbox.snapshot()
    firing = sum(1 for a, _ in received if a["status"] == "firing")
    by_oom = sum(
        1
        for a, _ in received
        if a["status"] == "resolved" and "out of memory" in str(a.get("reason"))
    )
    bad = sum(1 for _, ok in received if not ok)
    print(
        f"demo over: {ooms} OOMs, {by_oom} of them warned of in advance; {firing} alerts"
        f" fired in all; {len(received)} webhooks received, {bad} with a bad signature."
    )
