"""Carry out what a rule says when it fires: notify, and ask the node to act.

``webhook`` and ``alertmanager`` go to their senders (queues, never waited on). ``checkpoint``
and ``shed`` become signed commands (``model/control.py``) on the node's control stream,
written by the ingest loop in the same round trip as the audit record, so a command is never
sent without its record nor recorded without being sent. The node agent verifies each
command and reports the outcome as an event, which lands in the audit stream too.

Every alert records what was done with it under ``dispatched``: per action ``queued``,
``command`` (with its id), ``dry_run``, ``suppressed`` (cooldown), ``not_configured`` or
``dropped``. A rule in dry-run sends nothing to receivers; its node actions are still sent,
flagged dry-run, so the agent can say what it would have done (whom it would have shed).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from oomcast.model.control import new_command, sign_command
from oomcast.model.wire import Keys
from oomcast.service.rules import NODE_ACTIONS, Rule

log = logging.getLogger(__name__)


class Dispatcher:
    def __init__(
        self,
        keys: Keys,
        rules: list[Rule],
        *,
        webhook: Callable[[dict[str, Any]], bool] | None = None,
        alertmanager: Callable[[dict[str, Any]], bool] | None = None,
        control_secret: str | None = None,
        command_ttl_s: float = 30.0,
        stale_after_s: float = 60.0,
        outbox: list[tuple[str, dict[str, str]]] | None = None,
        on_command: Callable[[str, str], None] | None = None,
    ) -> None:
        self.keys = keys
        self.rules = {r.name: r for r in rules}
        self.webhook = webhook
        self.alertmanager = alertmanager
        self.control_secret = control_secret
        self.command_ttl_s = command_ttl_s
        self.stale_after_s = stale_after_s
        self.outbox: list[tuple[str, dict[str, str]]] = outbox if outbox is not None else []
        self._on_command = on_command or (lambda action, dry: None)
        for rule in rules:
            for action in rule.actions:
                if not self.configured(action):
                    log.warning(
                        "rule %s: action %s is not configured (%s); it will be recorded,"
                        " not carried out",
                        rule.name,
                        action,
                        self._what_is_missing(action),
                    )

    def configured(self, action: str) -> bool:
        if action == "webhook":
            return self.webhook is not None
        if action == "alertmanager":
            return self.alertmanager is not None
        return self.control_secret is not None

    @staticmethod
    def _what_is_missing(action: str) -> str:
        return {
            "webhook": "OOMCAST_WEBHOOK_URL",
            "alertmanager": "OOMCAST_ALERTMANAGER_URL",
        }.get(action, "OOMCAST_CONTROL_SECRET")

    def submit(self, payload: dict[str, Any]) -> None:
        """Act on one alert (called by the ingest loop, which then writes the audit record).
        Never raises: a failure is recorded in the alert's ``dispatched``."""
        try:
            self._submit(payload)
        except Exception as exc:  # an alert must reach the audit stream whatever happens
            log.exception("dispatching the alert of rule %s failed", payload.get("rule_name"))
            payload.setdefault("dispatched", {})["error"] = f"{type(exc).__name__}: {exc}"[:300]

    def _submit(self, payload: dict[str, Any]) -> None:
        actions = payload.get("actions")
        if actions is None:  # an alert of the single built-in policy: notify only
            ok = self.webhook(payload) if self.webhook else False
            payload["dispatched"] = {"webhook": "queued" if ok else "not_configured"}
            return
        rule = self.rules.get(str(payload.get("rule_name")))
        done: dict[str, Any] = {}
        for action in actions:
            if payload.get("suppressed"):
                done[action] = "suppressed"
            elif payload.get("repeat") and action not in NODE_ACTIONS:
                done[action] = "n/a"  # receivers heard of the episode when it began
            elif not self.configured(action):
                done[action] = "not_configured"
            elif action in NODE_ACTIONS:
                done[action] = self._command(action, payload, rule)
            elif action in (payload.get("dry_run") or ()):
                done[action] = "dry_run"
            else:
                send = self.webhook if action == "webhook" else self.alertmanager
                assert send is not None
                done[action] = "queued" if send(payload) else "dropped"
        payload["dispatched"] = done

    def _command(self, action: str, payload: dict[str, Any], rule: Rule | None) -> Any:
        if payload["status"] != "firing":
            return "n/a"  # a node action happens when an episode starts, not when it ends
        assert self.control_secret is not None
        age = time.time() - float(payload["observed_at"])
        if age > self.stale_after_s:
            # read late (a backlog, an outage): the node has moved on since this sample
            return f"stale: forecast from a sample {age:.0f}s old, no command"
        params = dict((rule.params.get(action) if rule else None) or {})
        if action == "shed":
            target = float(params.pop("target_frac", 0.85))
            total, used = int(payload["total_bytes"]), int(payload["used_bytes"])
            if payload.get("repeat") and used <= target * total:
                return "n/a: already below target_frac"
            # free enough to bring the domain back under target_frac of its capacity, and
            # at least a twentieth of it: the forecast says use is still rising
            params["need_bytes"] = max(used - int(target * total), total // 20)
            if params.get("priority") is None:
                params.pop("priority", None)
        cmd = new_command(
            node=str(payload["node"]),
            action=action,
            device=str(payload["device"]),
            job=payload.get("job"),
            params=params,
            dry_run=action in (payload.get("dry_run") or ()),
            reason=f"rule {payload.get('rule_name')}: {payload.get('reason', '')}"[:500],
            forecast={
                "risk": payload["risk"],
                "time_to_oom_s": payload["time_to_oom_s"],
                "observed_at": payload["observed_at"],
                "used_bytes": payload["used_bytes"],
                "total_bytes": payload["total_bytes"],
                "model_version": payload["model_version"],
            },
            ttl_s=self.command_ttl_s,
        )
        self.outbox.append(
            (self.keys.control(str(payload["node"])), sign_command(cmd, self.control_secret))
        )
        self._on_command(action, "dry_run" if cmd["dry_run"] else "live")
        return {"command_id": cmd["id"], "dry_run": cmd["dry_run"], "params": params}
