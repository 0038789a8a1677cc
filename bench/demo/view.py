"""The demo's live view: the service's table of domains, read over its REST API, and the
webhooks as the receiver got them (a ``rich`` table, or plain lines with ``--plain``)."""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any

import httpx

from oomcast.bench.demo.inbox import WebhookInbox
from oomcast.bench.demo.summary import Oom
from oomcast.cli.top import alert_status


def emit(text: str) -> None:
    """Print a line; when the reader has gone (``oomcast demo | tee log`` stopped by the same
    Ctrl-C), go on on stderr, so the summary is still seen and the clean-up still runs."""
    try:
        print(text, flush=True)
    except BrokenPipeError:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # the interpreter's last flush must not fail
        os.close(devnull)
        sys.stdout = sys.stderr
        print(text, flush=True)


def _alert_line(alert: dict[str, Any], signed: bool) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(alert.get("sent_at") or time.time()))
    sig = "signature ok" if signed else "BAD SIGNATURE"
    firing = alert.get("status") == "firing"
    tto = alert.get("time_to_oom_s") if firing else None  # an ended episode forecasts nothing
    tto_s = "" if tto is None else f", OOM in ~{tto:.0f}s"
    status = alert_status(alert)
    line = (
        f"{when} {status:8} {alert['node']}/{alert['device']}"
        f" job={alert.get('job')}{tto_s} ({alert.get('reason')}; {sig})"
    )
    remedies = alert.get("remedies") or []
    if alert.get("status") == "firing" and alert.get("cause"):
        line += f"\n         cause: {alert['cause']}"
        line += f"; fix: {remedies[0]}" if remedies else ""
    return line


def watch(
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

    from oomcast.cli.top import fleet_table as table
    from oomcast.cli.top import render_lines

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
                    data = {"devices": [], "alert_horizon_s": 60, "total": 0}
                for d in data["devices"]:
                    key = (d["node"], d["device"], d.get("last_oom_ts"))
                    if key[2] is not None and key not in seen:
                        seen.add(key)
                        ooms.append(Oom(d["node"], d["device"], float(key[2]), d.get("job")))
                received = inbox.snapshot()
                page = {"page": data, "alerts": []}
                if view is not None:
                    # `oomcast top`'s table, sized to the window, then the webhooks that fit
                    width, height = console.size
                    rows = max(3, min(len(data["devices"]), height // 2))
                    lines = [_alert_line(a, ok) for a, ok in received[-max(2, height - rows - 8) :]]
                    body = Text("\n".join(lines) or "no alerts yet", style="dim")
                    view.update(Group(table(page, width, rows), Text("webhooks received:"), body))
                else:
                    for alert, ok in received[shown:]:
                        emit(_alert_line(alert, ok))
                    shown = len(received)
                    if time.monotonic() - last_plain > 5:
                        last_plain = time.monotonic()
                        for line in render_lines(page):  # `oomcast top --plain`'s block
                            emit(line)
                stop.wait(0.5)
    except KeyboardInterrupt:
        pass
    finally:
        client.close()
    return ooms
