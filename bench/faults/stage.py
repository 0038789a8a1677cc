"""What every fault scenario stands on: one private Redis, one webhook receiver and one set
of keys per bench run (``Bench``), and per scenario its own key prefix, services, agents and
the accounting at its end (``Scenario.conclude``).

Keys are handed out as on a real cluster: the services hold the master control secret, each
agent only its own node key. The forecaster is the ``threshold_0.90`` baseline: what is
measured here is what survives faults, not how good forecasts are, and a threshold fires
and resolves on the simulated leaks at predictable moments (the LSTM, at the compressed
time the bench needs, mostly does not fire at all).
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import httpx

from oomcast.bench.faults import ledger
from oomcast.bench.procs import (
    Agent,
    Procs,
    RedisServer,
    Service,
    start_agent,
    start_service,
    wait_until,
)
from oomcast.bench.receiver import CountingReceiver
from oomcast.model.control import node_key
from oomcast.model.wire import Keys

Check = Callable[[], bool]
FORECASTER = "threshold_0.90"
NOTIFY_RULE = """
  - name: bench-notify
    when: {fire_risk: 0.5, horizon_s: 5, for_samples: 1}
    resolve: {resolve_risk: 0.25, for_samples: 1}
    actions: [webhook]
"""
# A live shed on the cgroup domains: what a forged sample would like to trigger.
SHED_RULE = """
  - name: bench-shed
    match: {device: "cgroup:*"}
    when: {fire_risk: 0.5, horizon_s: 5, for_samples: 1}
    actions: [shed]
    dry_run: false
    params: {shed: {target_frac: 0.5}}
"""
# Simulated GPUs that fill up in about 7 s and restart 2 s after their OOM: each one fires an
# alert and resolves it (on the OOM) every 9 s or so.
SIM_ARGS = ("--source", "sim", "--gpus", "4", "--patterns", "fast_leak", "--speed", "10")
SIM_INTERVAL = ("--interval", "0.2")


class Bench:
    """One run: Redis, the receiver, the secrets, the processes; ``close()`` ends them all."""

    def __init__(self, root: Path, receiver_down_s: float) -> None:
        self.root = root
        self.receiver_down_s = receiver_down_s
        self.procs = Procs(root)
        self.master_secret = secrets.token_hex(32)
        self.webhook_secret = secrets.token_hex(16)
        self.api_token = secrets.token_hex(16)
        data = root / "redis"
        data.mkdir()
        self.redis = RedisServer(self.procs, data)
        self.receiver = CountingReceiver(self.webhook_secret)

    def start(self) -> None:
        self.redis.start()
        self.receiver.up()

    def close(self) -> None:
        self.receiver.down()
        self.procs.close()

    def http(self) -> httpx.Client:
        return httpx.Client(timeout=10, headers={"Authorization": f"Bearer {self.api_token}"})


class Scenario:
    """One scenario's own world: a key prefix, its rule file, its processes and what they
    produced, and the figures at its end."""

    def __init__(self, bench: Bench, name: str, partitions: int = 4, shed: bool = False) -> None:
        self.bench = bench
        self.name = name
        self.keys = Keys(f"bf-{name}-{secrets.token_hex(3)}", partitions)
        self.rules = bench.root / f"rules-{name}.yaml"
        self.rules.write_text("rules:\n" + NOTIFY_RULE + (SHED_RULE if shed else ""))
        self.client = bench.redis.client()
        self.services: list[Service] = []
        self.agents: list[Agent] = []
        self.producers: list[ledger.Producer] = []
        self.forged_entries: set[str] = set()
        self.forged_samples: set[ledger.SampleId] = set()
        self.allowed_commands: set[str] = set()
        self.victims_killed = 0
        self.problems: list[str] = []
        self.figures: dict[str, Any] = {}

    # --- processes ------------------------------------------------------------------------

    def service_env(self, consumer: str) -> dict[str, str]:
        b = self.bench
        env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
        env.update(
            {
                "OOMCAST_REDIS_URL": b.redis.url,
                "OOMCAST_KEY_PREFIX": self.keys.prefix,
                "OOMCAST_PARTITIONS": str(self.keys.partitions),
                "OOMCAST_CONSUMER_NAME": consumer,
                "OOMCAST_FORECASTER": FORECASTER,
                "OOMCAST_RULES": str(self.rules),
                "OOMCAST_WEBHOOK_URL": b.receiver.url,
                "OOMCAST_WEBHOOK_SECRET": b.webhook_secret,
                "OOMCAST_CONTROL_SECRET": b.master_secret,
                "OOMCAST_API_TOKEN": b.api_token,
            }
        )
        return env

    def service(self, replica: str = "a", extra_env: Mapping[str, str] | None = None) -> Service:
        env = {**self.service_env(f"replica-{replica}"), **(extra_env or {})}
        svc = start_service(self.bench.procs, f"{self.name}-{replica}", env)
        self.services.append(svc)
        return svc

    def agent(self, node: str, args: Sequence[str] = (*SIM_ARGS, *SIM_INTERVAL)) -> Agent:
        b = self.bench
        env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
        env.update(
            {
                "OOMCAST_REDIS_URL": b.redis.url,
                "OOMCAST_KEY_PREFIX": self.keys.prefix,
                "OOMCAST_PARTITIONS": str(self.keys.partitions),
                "OOMCAST_NODE_KEY": node_key(b.master_secret, node),
            }
        )
        agent = start_agent(b.procs, node, env, args, self.name)
        self.agents.append(agent)
        return agent

    # --- observing ------------------------------------------------------------------------

    def devices(self, svc: Service) -> list[dict[str, Any]] | None:
        """``svc``'s ``GET /v1/devices`` (its first page); None when it did not answer."""
        try:
            with self.bench.http() as http:
                got = http.get(f"{svc.base}/v1/devices", timeout=3).json()["devices"]
        except (httpx.HTTPError, ValueError, KeyError):
            return None
        return cast(list[dict[str, Any]], got)

    def newest_forecast(self, svc: Service, node: str) -> float | None:
        """The ts of the newest sample of ``node`` that ``svc`` has forecast."""
        seen = [float(d["observed_at"]) for d in self.devices(svc) or [] if d.get("node") == node]
        return max(seen) if seen else None

    def caught_up(self, svc: Service, nodes: Sequence[str], since: float) -> Check:
        """Whether ``svc`` is ready and has forecast a sample of each of ``nodes`` taken at
        or after ``since`` (unix time)."""

        def check() -> bool:
            if not svc.ready():
                return False
            return all((self.newest_forecast(svc, n) or 0.0) >= since for n in nodes)

        return check

    def alerts_caught_up(self, until: float) -> Check:
        """Whether every alert owed that was decided up to ``until`` (unix time) has reached
        the receiver."""

        def check() -> bool:
            received, _ = self.bench.receiver.snapshot()
            owed = ledger.owed_webhooks(ledger.audit_records(self.client, self.keys))
            return all(
                received.get(i, 0) for i, r in owed.items() if float(r.get("sent_at") or 0) <= until
            )

        return check

    def first_held(
        self, since: float, checks: Mapping[str, Check], timeout_s: float = 60.0
    ) -> dict[str, float | None]:
        """Poll every check together until all have held once; per check, the seconds from
        ``since`` (unix time, the fault's end) to the first time it held, or None (and a
        problem) for one that never did within ``timeout_s``."""
        found: dict[str, float | None] = dict.fromkeys(checks)

        def all_held() -> bool:
            for name, check in checks.items():
                if found[name] is None and check():
                    found[name] = round(time.time() - since, 2)
            return all(v is not None for v in found.values())

        wait_until(all_held, max(0.0, timeout_s - (time.time() - since)), 0.1)
        for name, value in found.items():
            if value is None:
                self.problems.append(f"{name}: not reached {timeout_s:.0f}s after the fault")
        return found

    def recovered_after(
        self, svc: Service, nodes: Sequence[str], since: float, timeout_s: float = 60.0
    ) -> float | None:
        """Seconds from ``since`` until ``svc`` is ready with fresh forecasts of ``nodes``."""
        got = self.first_held(since, {"recovery_s": self.caught_up(svc, nodes, since)}, timeout_s)
        return got["recovery_s"]

    def alerts(self) -> dict[str, Any]:
        received, first_at = self.bench.receiver.snapshot()
        records = ledger.audit_records(self.client, self.keys)
        return ledger.alert_figures(records, received, first_at)

    def wait_events(
        self, predicate: Callable[[list[dict[str, Any]]], bool], timeout_s: float
    ) -> bool:
        return wait_until(lambda: predicate(ledger.events(self.client, self.keys)), timeout_s, 0.2)

    # --- the end ----------------------------------------------------------------------------

    def conclude(
        self, drain_timeout_s: float = 60.0, alert_timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """Stop the agents, let the services catch up, and count (``ledger``)."""
        t0 = time.monotonic()
        pushed_back: dict[str, dict[str, float | None]] = {}
        for agent in self.agents:
            m = agent.metrics()
            pushed_back[agent.node] = {
                "publish_errors": m.get("oomcast_agent_publish_errors_total"),
                "entries_refused": m.get("oomcast_agent_publish_refused_total"),
            }
            summary = agent.stop()
            gone = summary["dropped"] + summary["undelivered"]
            note = None
            if gone:
                note = (
                    f"the agent dropped {summary['dropped']} and left {summary['undelivered']}"
                    " undelivered (samples and events); not counted as accepted"
                )
                self.problems.append(f"agent {agent.node}: {note}")
            self.producers.append(
                ledger.Producer(
                    f"agent:{agent.node}", agent.node, summary["samples"] - gone, note=note
                )
            )
        self.figures["agents_pushed_back"] = pushed_back  # how the fault reached the nodes
        t1 = time.monotonic()
        if not wait_until(lambda: ledger.drained(self.client, self.keys), drain_timeout_s, 0.25):
            self.problems.append(
                "sample entries still unread or unacknowledged"
                f" {drain_timeout_s:.0f}s after the end"
            )
        t2 = time.monotonic()
        if not wait_until(self.alerts_caught_up(until=time.time()), alert_timeout_s, 0.25):
            self.problems.append(f"alerts still owed {alert_timeout_s:.0f}s after the end")
        self.figures["end_waits_s"] = {
            "agents_stopped": round(t1 - t0, 1),
            "samples_drained": round(t2 - t1, 1),
            "alerts_delivered": round(time.monotonic() - t2, 1),
        }
        copies = ledger.copies(self.client, self.keys, self.forged_entries)
        out: dict[str, Any] = {}
        out.update(ledger.sample_figures(copies, self.producers))
        out.update(self.alerts())
        evs = ledger.events(self.client, self.keys)
        out.update(ledger.action_figures(evs, self.allowed_commands, self.victims_killed))
        if self.forged_samples:
            out.update(ledger.forged_figures(copies, self.forged_samples))
        out["service_counts"] = self._ingested()
        out.update(self.figures)
        return out

    def _ingested(self) -> dict[str, dict[str, float | None] | None]:
        """Each live replica's own counts of samples forecast, skipped as repeats and skipped
        as late (a killed replica's counts died with it: None)."""
        names = {
            "forecast": "oomcast_samples_ingested_total",
            "repeats": "oomcast_duplicate_samples_total",
            "late": "oomcast_late_samples_total",
        }
        out: dict[str, dict[str, float | None] | None] = {}
        for s in self.services:
            got = s.metrics() if s.alive() else {}
            out[s.name] = {k: got.get(v) for k, v in names.items()} if got else None
        return out


def http_batch(node: str, n: int, start: float) -> list[dict[str, Any]]:
    """``n`` quiet samples (25 % used) of ``node``/gpu0 for ``POST /v1/samples``, 10 ms apart."""
    gib = 1 << 30
    return [
        {
            "ts": round(start + i * 0.01, 3),
            "node": node,
            "device": "gpu0",
            "kind": "gpu",
            "total_bytes": 80 * gib,
            "used_bytes": 20 * gib,
        }
        for i in range(n)
    ]


def batch_ids(batch: list[dict[str, Any]]) -> set[ledger.SampleId]:
    return {(str(s["node"]), str(s["device"]), float(s["ts"])) for s in batch}
