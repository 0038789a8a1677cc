"""``oomcast demo``: the whole system on one machine, with a live view in the terminal.

It finds a Redis (``OOMCAST_REDIS_URL``, else one on localhost:6379, else a private
``redis-server`` it starts), runs the service in this process, two simulated nodes as real
``oomcast collect`` processes, and a local webhook receiver that checks every alert's
signature; then it shows the service's view of the GPUs through its own REST API.
Everything it started is stopped on Ctrl-C (or after ``--duration``), and the keys it wrote
(prefix ``oomcast-demo``) are removed.

The simulated GPUs (``NODES``) mix jobs that run out of memory with jobs that only look
busy; ``demo-node-a/gpu0`` runs a ``fast_leak`` that climbs from its start-up level to an
OOM 62-80 s after its collector starts, so every demo shows an OOM, and whether it was
forecast, within its first minute and a half. The closing summary (``summarize``) scores
the alerts the webhook receiver got against the OOMs the service saw.
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx
import redis
import uvicorn

from oomcast.collectors.sources.sim import OOM_PATTERNS
from oomcast.model.wire import DEFAULT_REDIS_URL
from oomcast.service.main import create_app
from oomcast.service.settings import Settings
from oomcast.service.webhook import SIGNATURE_HEADER, verify_signature

PREFIX = "oomcast-demo"
PARTITIONS = 2
GIB = 1 << 30
# (node, patterns cycled over its GPUs, seed): what the demo's ``oomcast collect`` processes
# simulate. demo-node-a/gpu0 is the fast leak that OOMs 62-80 s in (tests pin it); the
# others OOM later (leak, step_growth) or never (sawtooth, spiky, plateau).
NODES: tuple[tuple[str, tuple[str, ...], int], ...] = (
    ("demo-node-a", ("fast_leak", "sawtooth", "step_growth", "spiky"), 1),
    ("demo-node-b", ("plateau", "leak", "sawtooth", "spiky"), 2),
)
GPUS_PER_NODE = 4
SAMPLE_INTERVAL_S = 0.5


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
    url = DEFAULT_REDIS_URL
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


@contextlib.contextmanager
def collectors(url: str, speed: float) -> Iterator[list[subprocess.Popen[bytes]]]:
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": url,
        "OOMCAST_KEY_PREFIX": PREFIX,
        "OOMCAST_PARTITIONS": str(PARTITIONS),
        "OOMCAST_LOG_LEVEL": "warning",
    }
    procs = [
        subprocess.Popen(
            [sys.executable, "-m", "oomcast.service.cli", *collector_argv(*node, speed)],
            env=env,
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
    started_at = time.time()  # "t+" in the summary counts from here
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
            for line in summarize(inbox.snapshot(), ooms, demo_patterns(), started_at):
                print(line)
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
) -> list[Oom]:
    """Show the service's view until stopped; returns the OOMs the service saw.

    Each OOM's time is the ``ts`` of the collector's ``oom`` event, which the service keeps
    as the domain's ``last_oom_ts`` (``GET /v1/devices``), polled every half second; a
    simulated job takes 20 s (over ``--speed``) to restart, so at any sensible speed no OOM
    goes by between two polls. OOMs after the last poll are known from their alerts only."""
    from rich.console import Console, Group
    from rich.live import Live
    from rich.text import Text

    console = Console()
    end = None if duration_s is None else time.monotonic() + duration_s
    shown = 0
    client = httpx.Client(base_url=base, timeout=2)
    ctx = Live(console=console, refresh_per_second=4) if live else contextlib.nullcontext()
    ooms: list[Oom] = []
    seen: set[tuple[str, str, float]] = set()
    try:
        with ctx as view:
            last_plain = 0.0
            while not stop.is_set() and (end is None or time.monotonic() < end):
                try:
                    data = client.get("/v1/devices").json()
                except httpx.HTTPError:
                    data = {"devices": [], "alert_horizon_s": 60}
                for d in data["devices"]:
                    key = (d["node"], d["device"], d.get("last_oom_ts"))
                    if key[2] is not None and key not in seen:
                        seen.add(key)
                        ooms.append(Oom(d["node"], d["device"], float(key[2]), d.get("job")))
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


@dataclass(frozen=True)
class Oom:
    """An OOM the service saw: the domain, the ``ts`` of its ``oom`` event, the job."""

    node: str
    device: str
    ts: float
    job: str | None = None
    from_alert: bool = False  # no event seen: the time is its resolved alert's observed_at


@dataclass
class _Episode:
    node: str
    device: str
    first: dict[str, Any]  # the earliest firing webhook of the episode
    resolved: dict[str, Any] | None
    oom: Oom | None = None


def _oom_resolution(alert: dict[str, Any]) -> bool:
    return "out of memory" in str(alert.get("reason"))


def _hms(ts: float) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts))


def _plural(n: int, what: str) -> str:
    return f"{n} {what}" if n == 1 else f"{n} {what}s"


def summarize(
    received: Sequence[tuple[dict[str, Any], bool]],
    ooms: Sequence[Oom],
    patterns: Mapping[tuple[str, str], str] | None = None,
    started_at: float | None = None,
    clock: Callable[[float], str] = _hms,
) -> list[str]:
    """The demo's closing summary, from the webhooks received (payload, signature valid) and
    the OOMs the service saw; a pure function of them.

    Webhooks with a bad signature are counted and otherwise ignored, and repeated deliveries
    of the same body count once. An *alert* is an episode, the webhooks sharing ``node``,
    ``device``, ``rule_name`` and ``episode``, of which at least one is ``firing``; it opens
    at the ``observed_at`` of its first firing and closes at the ``observed_at`` of its
    ``resolved`` webhook, if one came. An alert *warned of* an OOM on its domain if it was
    open at the OOM (at or after it opened and, unless it resolved because the job ran out
    of memory, no later than it closed) and its first firing's ``observed_at`` is before
    the OOM; a ``resolved`` "ran out of memory" with no OOM seen after the alert opened is
    taken as an OOM at that alert's ``observed_at``. A *false alarm* is an alert that no
    OOM of its domain fell in: it resolved without an OOM, or was still open at the end on
    a domain whose pattern (``patterns``) never OOMs. One still open on a domain that may
    yet OOM is neither, and is counted as still open.

    The first line is the totals; then, per OOM in time order, one line: warned (when the
    first firing alert fired, its predicted ``time_to_oom_s``, the actual time from its
    ``observed_at`` to the OOM, and the lead: from its firing to the OOM) or missed; then
    a line per false alarm. ``t+`` times count from ``started_at``.
    """
    patterns = dict(patterns or {})

    def at(ts: float) -> str:
        return clock(ts) if started_at is None else f"{clock(ts)} (t+{ts - started_at:.1f}s)"

    bad = sum(1 for _, ok in received if not ok)
    unique: dict[str, dict[str, Any]] = {}
    for alert, ok in received:
        if ok:
            unique.setdefault(json.dumps(alert, sort_keys=True, default=str), alert)
    groups: dict[tuple[Any, ...], list[dict[str, Any]]] = {}
    for alert in unique.values():
        key = (
            alert.get("node"),
            alert.get("device"),
            alert.get("rule_name"),
            alert.get("episode") or alert.get("fired_at"),
        )
        groups.setdefault(key, []).append(alert)
    episodes = []
    for (node, device, _, _), alerts in groups.items():
        firing = [a for a in alerts if a.get("status") == "firing"]
        if not firing:
            continue  # the receiver never heard this one fire
        first = min(firing, key=lambda a: (float(a["observed_at"]), a.get("sent_at") or 0.0))
        ends = [a for a in alerts if a.get("status") == "resolved"]
        resolved = min(ends, key=lambda a: a.get("sent_at") or 0.0) if ends else None
        episodes.append(_Episode(str(node), str(device), first, resolved))
    episodes.sort(key=lambda e: (float(e.first["observed_at"]), e.node, e.device))

    all_ooms = sorted(ooms, key=lambda o: (o.ts, o.node, o.device))
    for e in episodes:
        opened = float(e.first["observed_at"])
        closed = None if e.resolved is None else float(e.resolved["observed_at"])
        by_oom = e.resolved is not None and _oom_resolution(e.resolved)
        e.oom = next(
            (
                o
                for o in all_ooms
                if (o.node, o.device) == (e.node, e.device)
                and o.ts >= opened
                and (closed is None or by_oom or o.ts <= closed)
            ),
            None,
        )
        if e.oom is None and by_oom:
            assert e.resolved is not None and closed is not None
            e.oom = Oom(e.node, e.device, closed, e.resolved.get("job"), from_alert=True)
            all_ooms = sorted([*all_ooms, e.oom], key=lambda o: (o.ts, o.node, o.device))

    def never_ooms(e: _Episode) -> bool:
        pattern = patterns.get((e.node, e.device))
        return pattern is not None and pattern not in OOM_PATTERNS

    unmatched = [e for e in episodes if e.oom is None]
    false_alarms = [e for e in unmatched if e.resolved is not None or never_ooms(e)]
    still_open = len(unmatched) - len(false_alarms)
    lines = []
    warned = 0
    for o in all_ooms:
        before = [e for e in episodes if e.oom is o and float(e.first["observed_at"]) < o.ts]
        where = f"{o.node}/{o.device}"
        if not before:
            lines.append(f"  missed OOM {where} job={o.job}: OOM at {at(o.ts)}, no alert before it")
            continue
        warned += 1
        e = min(before, key=lambda e: float(e.first.get("fired_at") or e.first["observed_at"]))
        fired = float(e.first.get("fired_at") or e.first.get("sent_at") or e.first["observed_at"])
        tto = e.first.get("time_to_oom_s")
        predicted = "none" if tto is None else f"{float(tto):.0f}s"
        actual = o.ts - float(e.first["observed_at"])
        source = "; OOM time from the resolved alert" if o.from_alert else ""
        lines.append(
            f"  warned OOM {where} job={e.first.get('job')}: first firing {at(fired)},"
            f" predicted time_to_oom_s {predicted}, actual {actual:.1f}s from its observed_at"
            f" to the OOM at {at(o.ts)}; lead {o.ts - fired:.1f}s{source}"
        )
    for e in false_alarms:
        fired = float(e.first.get("fired_at") or e.first.get("sent_at") or e.first["observed_at"])
        if e.resolved is not None:
            ended = float(e.resolved.get("sent_at") or e.resolved["observed_at"])
            how = f"resolved {at(ended)} without an OOM ({e.resolved.get('reason')})"
        else:
            how = f"still open at the end; a {patterns[(e.node, e.device)]} job never OOMs"
        lines.append(
            f"  false alarm {e.node}/{e.device} job={e.first.get('job')}: fired {at(fired)}, {how}"
        )
    alarms = _plural(len(false_alarms), "false alarm")
    head = (
        f"demo over: {_plural(len(all_ooms), 'OOM')}, {warned} of them warned of in advance;"
        f" {_plural(len(episodes), 'alert')} fired in all, {alarms}"
        + (f", {still_open} still open" if still_open else "")
        + f"; {_plural(len(received), 'webhook')} received, {bad} with a bad signature."
    )
    return [head, *lines]
