"""Carry out what an alert's rule says: notify, and ask the node to act.

``Dispatcher.dispatch(alert, now)`` carries out what ``rules.acts`` decided for each of
the rule's actions, and returns a ``Dispatched``: the audit record (the alert's payload with
``dispatched``, what was done, per action) and the signed node commands to write. It
changes nothing it was given and holds no queue of its own: the ingest loop writes the
commands in the same round trip as the records, so a command is never sent without its
record nor recorded without being sent. The node agent verifies each command and reports
the outcome as an event, which lands in the audit stream too.

``webhook`` and ``alertmanager`` become deliveries of the finished record (never touched
again), which the ingest loop writes to the durable outbox in the same round trip as the
record (``service/delivery/outbox.py``): an alert on record is owed to its receivers, and
the outbox's worker delivers it, or records why it could not. ``checkpoint`` and ``shed``
become signed commands (``model/control.py``) on the node's control stream.

Per action, ``dispatched`` says ``owed`` (a delivery is in the outbox; its end appears in
the audit stream as a ``delivery`` record), ``command`` (with its id), ``dry_run``,
``suppressed`` (cooldown), ``not_configured``, ``n/a``, ``refused`` (a destructive action
on unattested evidence) or ``stale``. A rule in dry-run
sends nothing to receivers; its node actions are still sent, flagged dry-run, so the agent
can say what it would have done (whom it would have shed).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from oomcast.model.control import new_command, node_key, sign_command
from oomcast.model.wire import Keys
from oomcast.service.delivery.outbox import Delivery, Outbox
from oomcast.service.delivery.worker import Target, new_delivery
from oomcast.service.pipeline.rules import NODE_ACTIONS, Act, Alert, Rule, acts

log = logging.getLogger(__name__)

MISSING_SETTING = {
    "webhook": "OOMCAST_WEBHOOK_URL",
    "alertmanager": "OOMCAST_ALERTMANAGER_URL",
    "checkpoint": "OOMCAST_CONTROL_SECRET",
    "shed": "OOMCAST_CONTROL_SECRET",
}


@dataclass(frozen=True)
class NodeCommand:
    """A signed command and the control stream it goes to."""

    stream: str
    fields: Mapping[str, str]
    action: str
    dry_run: bool


@dataclass(frozen=True)
class Dispatched:
    """What was done with one alert: its audit record, the node commands to write and the
    deliveries to owe."""

    record: Mapping[str, Any]
    commands: tuple[NodeCommand, ...] = ()
    deliveries: tuple[Delivery, ...] = ()


class Dispatcher:
    def __init__(
        self,
        keys: Keys,
        rules: list[Rule],
        *,
        webhook: Target | None = None,
        alertmanager: Target | None = None,
        outbox: Outbox | None = None,
        control_secret: str | None = None,
        command_ttl_s: float = 30.0,
        stale_after_s: float = 60.0,
        on_command: Callable[[str, str], None] | None = None,
    ) -> None:
        self.keys = keys
        self.targets: dict[str, Target | None] = {
            "webhook": webhook,
            "alertmanager": alertmanager,
        }
        if outbox is None and (webhook is not None or alertmanager is not None):
            raise ValueError("webhook and Alertmanager deliveries need an outbox to be owed in")
        self.outbox = outbox  # where the ingest loop stages the deliveries (Ingestor.commit)
        self.control_secret = control_secret
        self.command_ttl_s = command_ttl_s
        self.stale_after_s = stale_after_s
        self._on_command = on_command or (lambda action, mode: None)
        for rule in rules:
            for action in rule.actions:
                if not self.configured(action):
                    log.warning(
                        "rule %s: action %s is not configured (%s); it will be recorded,"
                        " not carried out",
                        rule.name,
                        action,
                        MISSING_SETTING[action],
                    )

    def configured(self, action: str) -> bool:
        if action in NODE_ACTIONS:
            return self.control_secret is not None
        return self.targets.get(action) is not None

    def dispatch(self, alert: Alert, now: float) -> Dispatched:
        """Act on one alert. Never raises: a failure is recorded in ``dispatched``, and
        then nothing is sent."""
        payload = alert.to_payload()
        try:
            done, commands, notify = self._decide(alert, now)
            record = {**payload, "dispatched": done}
            deliveries = [self._owe(action, record, now) for action in notify]
        except Exception as exc:  # an alert must reach the audit stream whatever happens
            log.exception("dispatching the alert of rule %s failed", alert.rule.name)
            error = {"error": f"{type(exc).__name__}: {exc}"[:300]}
            return Dispatched({**payload, "dispatched": error})
        for command in commands:
            self._on_command(command.action, "dry_run" if command.dry_run else "live")
        return Dispatched(record, commands, tuple(deliveries))

    def _owe(self, action: str, record: Mapping[str, Any], now: float) -> Delivery:
        target = self.targets[action]
        assert target is not None
        delivery = new_delivery(target, record, now)
        target.owed(delivery)
        return delivery

    def _decide(
        self, alert: Alert, now: float
    ) -> tuple[dict[str, Any], tuple[NodeCommand, ...], list[str]]:
        """Per action what is done (``rules.acts`` decides); the commands to write; the
        targets it is owed to."""
        done: dict[str, Any] = {}
        commands: list[NodeCommand] = []
        notify: list[str] = []
        for act in acts(alert, now, self.configured, self.stale_after_s):
            if act.command:
                done[act.action], command = self._command(act, alert, now)
                commands.append(command)
            else:
                done[act.action] = act.outcome
                if act.owed:
                    notify.append(act.action)
        return done, tuple(commands), notify

    def _command(self, act: Act, alert: Alert, now: float) -> tuple[Any, NodeCommand]:
        """What the record says of a node action, and the signed command that carries it."""
        assert self.control_secret is not None and act.params is not None
        params = dict(act.params)
        payload = alert.to_payload()
        dry_run = act.action in alert.rule.dry_run
        cmd = new_command(
            node=alert.node,
            action=act.action,
            device=alert.device,
            job=alert.job,
            params=params,
            dry_run=dry_run,
            reason=f"rule {alert.rule.name}: {alert.reason}"[:500],
            forecast={
                "risk": payload["risk"],
                "time_to_oom_s": alert.time_to_oom_s,
                "observed_at": alert.observed_at,
                "used_bytes": alert.used_bytes,
                "total_bytes": alert.total_bytes,
                "model_version": alert.model_version,
            },
            ttl_s=self.command_ttl_s,
            now=now,
        )
        signed = NodeCommand(
            self.keys.control(alert.node),
            # each node's commands under its own key: a node's stolen key acts on it alone
            sign_command(cmd, node_key(self.control_secret, alert.node)),
            act.action,
            bool(cmd["dry_run"]),
        )
        return {"command_id": cmd["id"], "dry_run": cmd["dry_run"], "params": params}, signed
