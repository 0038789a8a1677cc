"""A receiver that misbehaves: a webhook endpoint that drips its answer a byte at a time,
then one that answers 500 with a 1 GiB body, while Alertmanager, beside it, must still get
every alert on time.

The service bounds each attempt as a whole (``OOMCAST_DELIVERY_TIMEOUT_S``, 5 s), reads at
most a few KB of an error's body, keeps each target's attempts in slots of its own, and
holds a claim longer than an attempt; the scenario counts what each of those is for: how
long each bad attempt held the connection, whether two attempts of one delivery ever
overlapped (a claim that ran out mid-attempt posts an alert twice), the service's memory
while the 1 GiB bodies came, and the delay from each alert's decision to its push to
Alertmanager. Its control: the stall was felt (attempts held until the deadline cut them).
"""

from __future__ import annotations

import time
from itertools import pairwise
from typing import Any

from oomcast.bench.faults import ledger
from oomcast.bench.faults.stage import Bench, Scenario
from oomcast.bench.procs import rss_mib, wait_until
from oomcast.bench.receiver import AlertmanagerStandIn

NODE = "bf-node-1"
STALL_S = 30.0  # how long the webhook receiver drips
HUGE_S = 12.0  # then how long it answers 500 with 1 GiB bodies
TIMEOUT_S = 5.0  # the service's default OOMCAST_DELIVERY_TIMEOUT_S, stated for the checks
RULE = """rules:
  - name: bench-notify
    when: {fire_risk: 0.5, horizon_s: 5, for_samples: 1}
    resolve: {resolve_risk: 0.25, for_samples: 1}
    actions: [webhook, alertmanager]
"""


def _overlaps(attempts: list[tuple[str | None, str, float, float, int]]) -> int:
    """Pairs of attempts of one delivery that were open at the same time."""
    by_id: dict[str, list[tuple[float, float]]] = {}
    for did, _, t0, t1, _ in attempts:
        if did is not None:
            by_id.setdefault(did, []).append((t0, t1))
    n = 0
    for spans in by_id.values():
        spans.sort()
        n += sum(1 for a, b in pairwise(spans) if b[0] < a[1])
    return n


def stalled_receiver(b: Bench, sc: Scenario) -> dict[str, Any]:
    am = AlertmanagerStandIn()
    try:
        return _stalled(b, sc, am)
    finally:
        am.close()


def _stalled(b: Bench, sc: Scenario, am: AlertmanagerStandIn) -> dict[str, Any]:
    sc.rules.write_text(RULE)
    svc = sc.service(extra_env={"OOMCAST_ALERTMANAGER_URL": am.url})
    sc.agent(NODE)  # simulated GPUs that fire and resolve every 9 s or so
    if not wait_until(lambda: (sc.newest_forecast(svc, NODE) or 0) > 0, 30):
        sc.problems.append("the node was never forecast")
    b.receiver.mode = "drip"
    stall_start = time.time()
    time.sleep(STALL_S)
    rss_before = rss_mib(svc.pid)
    b.receiver.mode = "huge_error"
    time.sleep(HUGE_S)
    rss_after = rss_mib(svc.pid)
    b.receiver.mode = "ok"
    fault_end = time.time()
    attempts = list(b.receiver.attempts)
    drips = [a for a in attempts if a[1] == "drip"]
    huge = [a for a in attempts if a[1] == "huge_error"]
    held = sorted(t1 - t0 for _, _, t0, t1, _ in drips)
    # Alertmanager: each firing that owed it a push during the faults, from the decision to
    # the push
    records = [
        r
        for r in ledger.audit_records(sc.client, sc.keys)
        if "record" not in r
        and r.get("status") == "firing"
        and (r.get("dispatched") or {}).get("alertmanager") == "owed"
        and stall_start <= float(r.get("sent_at") or 0) <= fault_end
    ]
    lags = []
    for r in records:
        sent = float(r["sent_at"])
        at = am.first_push_of(str(r.get("node")), str(r.get("device")), sent - 0.01)
        lags.append(None if at is None else round(at - sent, 2))
    got = sorted(x for x in lags if x is not None)
    sc.figures["webhook"] = {
        "drip_attempts": len(drips),
        "drip_attempt_held_s_min": round(held[0], 2) if held else None,
        "drip_attempt_held_s_max": round(held[-1], 2) if held else None,
        "huge_error_attempts": len(huge),
        "huge_error_mb_sent_max": max((a[4] for a in huge), default=0) // (1 << 20),
        "attempts_of_one_delivery_overlapping": _overlaps(attempts),
    }
    sc.figures["service_rss_mb"] = {"before_huge_bodies": rss_before, "after": rss_after}
    sc.figures["alertmanager"] = {
        "firings_during_faults": len(records),
        "pushed": len(got),
        "push_lag_s_p50": got[len(got) // 2] if got else None,
        "push_lag_s_max": got[-1] if got else None,
    }
    # the control: the stall was felt, each attempt held until the deadline cut it
    felt = bool(held) and held[0] >= TIMEOUT_S - 0.5
    sc.figures["control_stall_held_attempts_to_the_deadline"] = felt
    if not felt:
        sc.problems.append("the drip did not hold an attempt to the deadline: no stall was seen")
    if held and held[-1] > TIMEOUT_S + 2.0:
        sc.problems.append(f"a dripping answer held an attempt {held[-1]:.1f}s (deadline 5s)")
    if sc.figures["webhook"]["attempts_of_one_delivery_overlapping"]:
        sc.problems.append("two attempts of one delivery overlapped (posted twice at once)")
    if not records or len(got) < len(records):
        sc.problems.append(
            f"{len(records) - len(got)} of {len(records)} firings never reached"
            " Alertmanager during the faults"
        )
    elif got[-1] > 2.0:
        sc.problems.append(f"an Alertmanager push came {got[-1]:.1f}s after its alert")
    if not huge:
        sc.problems.append("no attempt met the 1 GiB error body")
    if rss_before and rss_after and rss_after - rss_before > 64:
        sc.problems.append(f"the service grew {rss_after - rss_before:.0f} MB on 1 GiB bodies")
    recovery = sc.first_held(fault_end, {"recovery_s": sc.alerts_caught_up(until=fault_end)}, 90)
    out = sc.conclude(alert_timeout_s=90)
    return {**out, **recovery}
