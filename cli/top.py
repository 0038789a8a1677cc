"""``oomcast top``: a running service's fleet in the terminal, riskiest first, read over its
REST API (``GET /v1/devices`` and ``GET /v1/alerts``), the way nvitop shows one node.

On a terminal it redraws one screen every ``--interval`` seconds: a table of the riskiest
domains that fits the window (names wrap rather than being cut), each GPU's processes under
it, and the newest alerts below. Piped to a file, or with ``--plain``, it prints a block per
refresh instead, each headed by the time, and each alert once, as it appears. ``--once``
prints one block and exits (1 when the service cannot be read), for scripts.

The rendering is a pure function of what the API returned (``render_lines``, ``alert_line``),
so what it prints is tested without a terminal.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from oomcast.cli.common import api_headers

GIB = 1 << 30


class ReadError(RuntimeError):
    """The service could not be read (down, refused, or answered with an error)."""


def fetch(client: Any, limit: int, node: str | None, job: str | None) -> dict[str, Any]:
    """One page of the riskiest live domains and the newest alerts, as the API gives them."""
    import httpx

    params: dict[str, Any] = {"limit": limit}
    if node:
        params["node"] = node
    if job:
        params["job"] = job
    try:
        devices = client.get("/v1/devices", params=params)
        alerts = client.get("/v1/alerts", params={"limit": 50})
    except httpx.HTTPError as exc:
        raise ReadError(f"cannot reach {client.base_url}: {exc}") from None
    for r in (devices, alerts):
        if r.status_code == 401:
            raise ReadError(
                f"{r.request.url}: 401: the service wants a token (--token or OOMCAST_API_TOKEN)"
            )
        if r.status_code != 200:
            raise ReadError(f"{r.request.url}: HTTP {r.status_code}: {r.text[:200]}")
    return {
        "page": devices.json(),
        "alerts": [a for a in alerts.json().get("alerts", []) if is_alert(a)],
    }


def is_alert(entry: dict[str, Any]) -> bool:
    """An alert of a rule, as first sent: ``/v1/alerts`` also holds delivery and command
    records (``record``) and the reminders of an alert still firing (``repeat``)."""
    return (
        "record" not in entry
        and entry.get("status") in ("firing", "resolved")
        and not entry.get("repeat")
    )


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / GIB:.1f}"


def _tto(t: float | None) -> str:
    return "-" if t is None else f"~{t:.0f}s"


def process_line(d: dict[str, Any], top_n: int = 3) -> str | None:
    """The GPU's largest processes, one line: ``pid 4242 job=a 30.1 GiB, ...``."""
    procs = d.get("processes")
    if not procs:
        return None
    parts = []
    for p in procs[:top_n]:
        job = f" job={p['job']}" if p.get("job") else ""
        parts.append(f"pid {p['pid']}{job} {_gib(p.get('used_bytes'))} GiB")
    more = len(procs) - top_n
    return ", ".join(parts) + (f", {more} more" if more > 0 else "")


def alert_status(alert: dict[str, Any]) -> str:
    """FIRING or RESOLVED; OOM for an episode that ended because the job died, not because
    its forecast calmed down."""
    status = str(alert.get("status", "?")).upper()
    if status == "RESOLVED" and "ran out of memory" in str(alert.get("reason") or ""):
        return "OOM"
    return status


def alert_line(alert: dict[str, Any]) -> str:
    """One alert of ``GET /v1/alerts``: when, what, where, and for a firing one its cause."""
    when = time.strftime("%H:%M:%S", time.localtime(alert.get("sent_at") or time.time()))
    status = alert_status(alert)
    line = f"{when} {status:8} {alert.get('node')}/{alert.get('device')} job={alert.get('job')}"
    if alert.get("status") == "firing":
        line += f" OOM in {_tto(alert.get('time_to_oom_s'))}"
        if alert.get("cause"):
            line += f" cause {alert['cause']}"
    elif alert.get("reason"):
        line += f" ({alert['reason']})"
    return line


def header(page: dict[str, Any], now: float | None = None) -> str:
    when = time.strftime("%H:%M:%S", time.localtime(now or time.time()))
    firing = sum(1 for d in page["devices"] if d["alert"]["firing"])
    shown = len(page["devices"])
    of = "" if shown >= page["total"] else f" of the {shown} shown"
    return (
        f"{when} {page['total']} live, {firing} firing{of};"
        f" risk = P(OOM within {page['alert_horizon_s']} s), riskiest first"
    )


def render_lines(data: dict[str, Any], now: float | None = None) -> list[str]:
    """The plain view: a header, then a line per domain (and one of processes under a GPU
    that names them). The alerts are the caller's to print, each once."""
    page = data["page"]
    out = [header(page, now)]
    for d in page["devices"]:
        flag = "FIRING" if d["alert"]["firing"] else "ok"
        out.append(
            f"  {d['node']}/{d['device']} job={d.get('job') or '-'}"
            f" used {d['used_frac']:.0%} ({_gib(d['used_bytes'])}/{_gib(d['total_bytes'])} GiB)"
            f" risk {d['alert_risk']:.2f} OOM in {_tto(d['time_to_oom_s'])} {flag}"
            + (f" cause {d['cause']}" if d["alert"]["firing"] and d.get("cause") else "")
        )
        procs = process_line(d)
        if procs:
            out.append(f"      processes: {procs}")
    if not page["devices"]:
        out.append("  (no live domains)")
    return out


def fleet_table(data: dict[str, Any], width: int, rows: int) -> Any:
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    page = data["page"]
    table = Table(expand=True, box=None, pad_edge=False, show_edge=False)
    table.add_column("node/device", overflow="fold", ratio=3, no_wrap=False)
    table.add_column("job", overflow="fold", ratio=2)
    table.add_column("used", justify="right", no_wrap=True)
    if width >= 90:
        table.add_column("GiB", justify="right", no_wrap=True)
    table.add_column("risk", justify="right", no_wrap=True)
    table.add_column("OOM in", justify="right", no_wrap=True)
    table.add_column("alert", no_wrap=True)
    for d in page["devices"][:rows]:
        firing = d["alert"]["firing"]
        style = "bold red" if firing else ("yellow" if d["alert_risk"] >= 0.2 else "")
        cells = [f"{d['node']}/{d['device']}", d.get("job") or "-", f"{d['used_frac']:.0%}"]
        if width >= 90:
            cells.append(f"{_gib(d['used_bytes'])}/{_gib(d['total_bytes'])}")
        cells += [f"{d['alert_risk']:.2f}", _tto(d["time_to_oom_s"]),
                  (d.get("cause") or "FIRING") if firing else "ok"]  # fmt: skip
        table.add_row(*cells, style=style)
        procs = process_line(d, top_n=2)
        if procs:
            table.add_row(Text(f"  {procs}", style="dim"), *[""] * (len(cells) - 1))
    firing_alerts = [a for a in data["alerts"] if a.get("status") == "firing"][:3]
    parts: list[Any] = [Text(header(page), style="bold"), table]
    if firing_alerts:
        parts.append(Text("newest alerts:", style="bold"))
        parts += [Text(alert_line(a), style="red") for a in firing_alerts]
    return Group(*parts)


def run(args: Any) -> int:
    import httpx

    headers = api_headers(args.token)
    client = httpx.Client(base_url=args.url, timeout=5.0, headers=headers)
    plain = args.plain or args.once or not sys.stdout.isatty()
    try:
        if plain:
            return _plain(client, args, args.limit or 1000)
        return _live(client, args)
    except KeyboardInterrupt:
        return 0
    finally:
        client.close()


def _plain(client: Any, args: Any, limit: int) -> int:
    shown: set[str] = set()
    first = True
    while True:
        try:
            data = fetch(client, limit, args.node, args.job)
        except ReadError as exc:
            print(f"{time.strftime('%H:%M:%S')} {exc}", file=sys.stderr, flush=True)
            if args.once:
                return 1
            time.sleep(args.interval)
            continue
        for line in render_lines(data):
            print(line, flush=True)
        fresh = [a for a in reversed(data["alerts"]) if a.get("id") not in shown]
        if first:  # the backlog: only the last few, the rest is in GET /v1/alerts
            fresh = fresh[-5:]
            first = False
        for a in fresh:
            print(f"  alert {alert_line(a)}", flush=True)
        shown.update(str(a.get("id")) for a in data["alerts"])
        if args.once:
            return 0
        time.sleep(args.interval)


def _live(client: Any, args: Any) -> int:
    from rich.console import Console
    from rich.live import Live
    from rich.text import Text

    console = Console()
    with Live(console=console, screen=True, auto_refresh=False) as view:
        while True:
            width, height = console.size
            rows = args.limit or max(3, height - 7)
            try:
                body = fleet_table(fetch(client, max(rows, 1), args.node, args.job), width, rows)
            except ReadError as exc:
                body = Text(f"{time.strftime('%H:%M:%S')} {exc}; retrying", style="red")
            view.update(body, refresh=True)
            time.sleep(args.interval)
    return 0


def add_parser(sub: Any, env: Any) -> None:
    t = sub.add_parser(
        "top",
        help="a running service's fleet in the terminal, riskiest first",
        description="Show a running oomcast service's live domains, riskiest first, with each"
        " GPU's processes and the newest alerts, refreshed in place on a terminal; piped or"
        " with --plain, a time-stamped block per refresh and each alert once.",
    )
    t.add_argument("--url", default=env.url, help="where the service's API answers (OOMCAST_URL)")
    t.add_argument("--token", default=None, help="API token (default: OOMCAST_API_TOKEN)")
    t.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    t.add_argument(
        "--limit", type=int, default=0, help="domains shown (0: what fits; all when piped)"
    )
    t.add_argument("--node", help="only these nodes (a glob: gpu-a*)")
    t.add_argument("--job", help="only these jobs (a glob)")
    t.add_argument("--plain", action="store_true", help="print blocks, never redraw")
    t.add_argument("--once", action="store_true", help="print one block and exit")
    t.set_defaults(func=run)
