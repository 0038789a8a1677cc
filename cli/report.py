"""``oomcast report --since 7d``: how the forecaster did on this fleet, for a weekly review,
read from a running service's ``GET /v1/scorecard``.

It prints, per scored model (the champion, and a shadow when one runs beside it), the OOMs
and how many were warned 30 s and 10 s ahead (per class: long, short, sudden), the alerts
and what they came to (an OOM, a false alarm, a near miss, censored by the job's end), the
median lead and time-to-OOM error, and false alarms per 1,000 job-hours; with ``--by`` the
same per kind, node, job, cause or model version. ``--json`` prints the scorecard as the
API gives it. The rendering (``report_lines``) is a pure function of that scorecard."""

from __future__ import annotations

import json
import time
from typing import Any

from oomcast.cli.common import UsageError, api_headers

BY = ("kind", "node", "job", "cause", "model_version")


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:.0%}"


def _num(v: float | None, unit: str = "") -> str:
    return "-" if v is None else f"{v:g}{unit}"


def figure_lines(f: dict[str, Any], indent: str = "  ") -> list[str]:
    lines = [
        f"{indent}OOMs {f['ooms']}: warned 30 s ahead {f['warned_30s']} ({_pct(f['recall_30s'])}),"
        f" 10 s ahead {f['warned_10s']} ({_pct(f['recall_10s'])}), missed at 30 s"
        f" {f['missed_30s']}",
    ]
    classes = []
    for cls in ("long", "short", "sudden"):
        c = f["by_class"][cls]
        if c["n"]:
            classes.append(f"{cls} {c['warned_30s']}/{c['n']} at 30 s, {c['warned_10s']}/{c['n']}"
                           " at 10 s")  # fmt: skip
    if classes:
        lines.append(f"{indent}  by class: " + "; ".join(classes))
    lines.append(
        f"{indent}alerts {f['alerts']}: precision {_pct(f['precision'])}, false alarms"
        f" {f['false_alarms']} ({_num(f['false_alarms_per_1000_job_hours'])} per 1,000"
        f" job-hours over {f['job_hours']:g} h), near misses {f['near_misses_alerted']},"
        f" censored {f['censored']}"
    )
    lines.append(
        f"{indent}median lead {_num(f['median_lead_s'], ' s')}, median time-to-OOM error 30 s"
        f" before the OOM {_pct(f['median_tto_error'])}"
    )
    return lines


def report_lines(card: dict[str, Any]) -> list[str]:
    start = time.strftime("%Y-%m-%d %H:%M", time.gmtime(card["since"]))
    end = time.strftime("%Y-%m-%d %H:%M", time.gmtime(card["until"]))
    out = [f"oomcast scorecard, {start} to {end} UTC: {card['outcomes']} outcomes"]
    left = card.get("left_out") or {}
    if left.get("forged") or left.get("malformed"):
        out.append(
            f"  left out: {left.get('forged', 0)} entries not sealed by the service,"
            f" {left.get('malformed', 0)} unreadable"
        )
    if card.get("note"):
        out.append(f"  note: {card['note']}")
    if not card["models"]:
        out.append("  no outcome in this window: no alert ended and no OOM was seen")
    for m in card["models"]:
        out.append(f"{m['role']} {m['model_version']}")
        out += figure_lines(m)
        for key, f in (m.get("by") or {}).items():
            out.append(f"  {card['by']} {key}")
            out += figure_lines(f, indent="    ")
    return out


def _problems(body: Any) -> str:
    """FastAPI's 422 detail as one line: ``--since 1 week: ...``."""
    detail = body.get("detail") if isinstance(body, dict) else body
    if not isinstance(detail, list):
        return str(detail)
    out = []
    for d in detail:
        loc = d.get("loc", []) if isinstance(d, dict) else []
        name = str(loc[-1]) if loc else "request"
        hint = " (7d, 24h, 90m, 3600s, 2w, or unix seconds)" if name == "since" else ""
        out.append(f"--{name}: {d.get('msg') if isinstance(d, dict) else d}{hint}")
    return "; ".join(out)


def run(args: Any) -> int:
    import httpx

    if args.by is not None and args.by not in BY:
        raise UsageError(f"--by {args.by}: one of {', '.join(BY)}")
    headers = api_headers(args.token)
    params: dict[str, Any] = {"since": args.since}
    if args.by:
        params["by"] = args.by
    try:
        with httpx.Client(base_url=args.url, timeout=30.0, headers=headers) as client:
            r = client.get("/v1/scorecard", params=params)
    except httpx.HTTPError as exc:
        raise UsageError(f"cannot reach the service at {args.url}: {exc}") from None
    if r.status_code == 401:
        raise UsageError(
            f"{args.url}: 401: the service wants a token (--token or OOMCAST_API_TOKEN)"
        )
    if r.status_code == 422:
        raise UsageError(f"{args.url} refused the request: {_problems(r.json())}")
    if r.status_code != 200:
        raise UsageError(f"{args.url}/v1/scorecard: HTTP {r.status_code}: {r.text[:300]}")
    card = r.json()
    if args.json:
        print(json.dumps(card))
    else:
        print("\n".join(report_lines(card)))
    return 0


def add_parser(sub: Any, env: Any) -> None:
    p = sub.add_parser(
        "report",
        help="how the forecaster did on this fleet's own jobs, over a window (weekly review)",
        description="Read a running service's scorecard (GET /v1/scorecard): per scored"
        " model, the OOMs warned 30 s and 10 s ahead, what the alerts came to, false alarms"
        " per 1,000 job-hours, the median lead and time-to-OOM error.",
    )
    p.add_argument("--since", default="7d", help="a span back from now (7d, 24h) or unix seconds")
    p.add_argument("--by", help=f"split the figures by one of: {', '.join(BY)}")
    p.add_argument("--url", default=env.url, help="where the service's API answers (OOMCAST_URL)")
    p.add_argument("--token", default=None, help="API token (default: OOMCAST_API_TOKEN)")
    p.add_argument("--json", action="store_true", help="print the scorecard as JSON")
    p.set_defaults(func=run)
