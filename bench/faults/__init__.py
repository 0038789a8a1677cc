"""``oomcast bench faults``: the fault scenarios, run for real, and what each lost.

Each scenario runs on a private ``redis-server``, real ``oomcast serve`` and ``oomcast
collect`` processes, a real webhook receiver and real victim processes, injects one fault
(or attack), and counts from the durable record what was accepted and what became of it
(``ledger``): samples accepted and lost, alerts owed, delivered and duplicated, actions
wrongly taken, and the seconds from the fault's end to recovery. A scenario passes when it
lost no sample and no alert, took no wrong action, recovered, and met its own checks; the
bench exits 1 when any did not. Nothing is assumed: a figure the bench could not measure is
``null`` and the scenario fails, saying why in ``problems``.
"""

from __future__ import annotations

import shutil
import signal
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomcast.bench.faults import attacks, forgeries, infra, receivers
from oomcast.bench.faults.stage import Bench, Scenario
from oomcast.bench.procs import FaultBenchError
from oomcast.bench.receiver import DELIVERY_HEADER

ScenarioFn = Callable[[Bench, Scenario], dict[str, Any]]

# name -> (function, partitions, whether its rules shed live), in the order they run
SCENARIOS: dict[str, tuple[ScenarioFn, int, bool]] = {
    "redis_restart": (infra.redis_restart, 4, False),
    "service_sigkill": (infra.service_sigkill, 4, False),
    "receiver_down": (infra.receiver_down, 4, False),
    "replica_loss": (infra.replica_loss, 2, False),
    "forged_command": (attacks.forged_command, 4, False),
    "forged_sample": (attacks.forged_sample, 4, True),
    "maxmemory": (infra.maxmemory, 4, False),
    "oversized_body": (attacks.oversized_body, 4, False),
    "forged_snapshot": (forgeries.forged_snapshot, 4, True),
    "forged_oom": (forgeries.forged_oom, 4, False),
    "forged_outbox": (forgeries.forged_outbox, 4, False),
    "domain_flood": (forgeries.domain_flood, 4, False),
    "stalled_receiver": (receivers.stalled_receiver, 4, False),
}
BAR = ("samples_lost", "alerts_lost", "actions_wrongly_taken")

__all__ = ["SCENARIOS", "FaultBenchError", "parse_only", "run_faults"]


def parse_only(text: str | None) -> list[str]:
    """``--only a,b`` -> the scenario names, in the bench's order; ValueError naming an
    unknown one."""
    if not text:
        return list(SCENARIOS)
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ValueError(
            f"--only {text!r}: unknown scenario {', '.join(unknown) or '(none given)'};"
            f" choose from {', '.join(SCENARIOS)}"
        )
    return [n for n in SCENARIOS if n in names]


def verdict(figures: dict[str, Any], problems: list[str]) -> bool:
    """The issue's bar: nothing lost, nothing wrongly done, recovered; and no problem."""
    for key in BAR:
        if figures.get(key) != 0:
            problems.append(f"{key} = {figures.get(key)}")
    if figures.get("recovery_s") is None:
        problems.append("no recovery was measured")
    return not problems


def run_one(bench: Bench, name: str) -> dict[str, Any]:
    fn, partitions, shed = SCENARIOS[name]
    sc = Scenario(bench, name, partitions=partitions, shed=shed)
    bench.receiver.reset()
    t0 = time.monotonic()
    try:
        figures = fn(bench, sc)
    except Exception as exc:  # a scenario that breaks is reported, and the others still run
        figures = {}
        sc.problems.append(f"the scenario failed: {type(exc).__name__}: {exc}")
        (bench.root / f"{name}.traceback").write_text(traceback.format_exc())
    finally:
        for proc in [*(s.proc for s in sc.services), *(a.proc for a in sc.agents)]:
            bench.procs.kill(proc)
        bench.receiver.hold_s = 0.0
        if bench.receiver.port and not bench.receiver.listening:
            bench.receiver.up()
        if not bench.redis.answers():
            bench.redis.start()
    if bench.receiver.bad_signatures or bench.receiver.without_id:
        sc.problems.append(
            f"the receiver got {bench.receiver.bad_signatures} badly signed deliveries and"
            f" {bench.receiver.without_id} without an {DELIVERY_HEADER} id"
        )
    problems = list(dict.fromkeys(sc.problems))
    figures["ok"] = verdict(figures, problems)
    figures["problems"] = problems
    figures["seconds"] = round(time.monotonic() - t0, 1)
    figures["key_prefix"] = sc.keys.prefix
    return figures


def run_faults(
    only: Sequence[str] | None = None,
    receiver_down_s: float = 60.0,
    progress: Callable[[str], object] | None = None,
) -> dict[str, Any]:
    """Run the scenarios (all, or ``only``), one after another, each with its own key prefix
    in one private Redis; every process is ended however a scenario ends. The logs stay in a
    temporary folder when a scenario failed (``logs`` in the result) and are removed otherwise."""
    names = list(only) if only else list(SCENARIOS)
    root = Path(tempfile.mkdtemp(prefix="oomcast-faults-"))
    bench = Bench(root, receiver_down_s)
    result: dict[str, Any] = {"scenarios": {}}
    t0 = time.monotonic()
    previous = _exit_on_sigterm()
    try:
        bench.start()
        for name in names:
            if progress is not None:
                progress(f"running {name} ...")
            result["scenarios"][name] = run_one(bench, name)
    finally:
        bench.close()
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
    result["ok"] = all(s["ok"] for s in result["scenarios"].values())
    result["seconds"] = round(time.monotonic() - t0, 1)
    result["setup"] = {
        "redis": f"private redis-server: {bench.redis.config}",
        "forecaster": "baseline threshold_0.90 (fires at 90% used)",
        "receiver_down_s": receiver_down_s,
    }
    if result["ok"]:
        shutil.rmtree(root, ignore_errors=True)
    else:
        result["logs"] = str(root)
    return result


def _exit_on_sigterm() -> Any:
    """SIGTERM (a ``timeout``, a CI runner) ends the bench through its ``finally`` clauses,
    so the processes it started, each in a session of its own, are ended too."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    return signal.signal(signal.SIGTERM, stop)


def format_text(result: dict[str, Any]) -> list[str]:
    """The result as lines for a terminal: the bar's figures first, then the rest."""
    lines = []
    first = (
        "samples_accepted",
        "samples_lost",
        "alerts_owed",
        "alerts_delivered",
        "alerts_duplicated",
        "actions_wrongly_taken",
        "recovery_s",
    )
    for name, figs in result["scenarios"].items():
        lines.append(f"{name}: {'ok' if figs['ok'] else 'FAILED'} ({figs['seconds']}s)")
        for key in first:
            lines.append(f"  {key:32} {figs.get(key)}")
        for key, value in figs.items():
            if key not in first and key not in ("ok", "seconds", "producers"):
                lines.append(f"  {key:32} {value}")
    lines.append(f"all scenarios: {'ok' if result['ok'] else 'FAILED'} ({result['seconds']}s)")
    if "logs" in result:
        lines.append(f"logs: {result['logs']}")
    return lines
