"""Rules: from forecasts to actions, in the manner of oomd's rulesets.

A rule file (YAML or JSON, ``OOMCAST_RULES``) lists rules. Each rule has one detector, an
optional resolve condition (hysteresis: a lower bar to end the episode than to start it),
actions, and its own cooldown, priority and dry-run switch::

    rules:
      - name: checkpoint-before-oom
        match: {kind: gpu}                    # globs on kind, node, device, job; all optional
        when: {risk_above: 0.8, horizon_s: 60, for_samples: 3}
        resolve: {risk_below: 0.3, for_samples: 3}
        actions: [webhook, alertmanager, checkpoint]
        cooldown_s: 300
        priority: 10
        dry_run: false
        severity: critical
        params: {checkpoint: {ack_timeout_s: 60}}

Detectors: ``risk_above`` + ``horizon_s`` (the forecast's probability of OOM within that
horizon), or ``time_to_oom_below_s`` (the forecast's median time to OOM), or
``model_rule: true`` (the rule the shipped model was validated with, or the
``OOMCAST_ALERT_*`` settings). Each needs ``for_samples`` consecutive samples.

The file is checked when the service starts; a bad rule stops the start with a message that
names the rule and the field. Every episode of every rule is tracked per memory domain: one
``firing`` when it starts, one ``resolved`` when it ends (or the domain OOMs, or goes
silent). A rule that fires again within ``cooldown_s`` of its last firing on that domain is
recorded as suppressed and runs no action.
"""

from __future__ import annotations

import fnmatch
import json
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from oomcast.model.forecast import HORIZONS_S, AlertRule, Forecast
from oomcast.model.schema import Sample
from oomcast.service.alerts import forecast_fields

ACTIONS = ("webhook", "alertmanager", "checkpoint", "shed")
NODE_ACTIONS = ("checkpoint", "shed")  # carried out by the node agent, through control
DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")


class RulesError(ValueError):
    """A rule file the service refuses to start with; the message names what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Match(_Strict):
    kind: str = "*"
    node: str = "*"
    device: str = "*"
    job: str = "*"

    def matches(self, sample: Sample, job: str | None) -> bool:
        return (
            fnmatch.fnmatchcase(sample.kind, self.kind)
            and fnmatch.fnmatchcase(sample.node, self.node)
            and fnmatch.fnmatchcase(sample.device, self.device)
            and fnmatch.fnmatchcase(job or "", self.job)
        )


class When(_Strict):
    risk_above: float | None = Field(None, gt=0, le=1)
    horizon_s: int | None = None
    time_to_oom_below_s: float | None = Field(None, gt=0)
    model_rule: bool = False
    for_samples: int | None = Field(None, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_detector(self) -> When:
        chosen = [
            name
            for name, on in (
                ("risk_above", self.risk_above is not None),
                ("time_to_oom_below_s", self.time_to_oom_below_s is not None),
                ("model_rule", self.model_rule),
            )
            if on
        ]
        if len(chosen) != 1:
            raise ValueError(
                "give exactly one detector: risk_above (with horizon_s), time_to_oom_below_s,"
                f" or model_rule: true (got {', '.join(chosen) or 'none'})"
            )
        if self.risk_above is not None and self.horizon_s not in HORIZONS_S:
            raise ValueError(f"risk_above needs horizon_s, one of {list(HORIZONS_S)}")
        if self.risk_above is None and self.horizon_s is not None and not self.model_rule:
            raise ValueError("horizon_s goes with risk_above")
        return self


class Resolve(_Strict):
    risk_below: float | None = Field(None, ge=0, lt=1)
    time_to_oom_above_s: float | None = Field(None, gt=0)
    for_samples: int = Field(3, ge=1, le=1000)


class ShedParams(_Strict):
    target_frac: float = Field(0.85, gt=0, le=1)  # shed down to this share of capacity
    allow_partial: bool = False  # shed what is allowed even when it cannot free enough
    priority: int | None = None  # protect at most this priority (never above the job's own)


class CheckpointParams(_Strict):
    pass  # the agent's --checkpoint-timeout says how long a job has to save


class NotifyParams(_Strict):
    pass


PARAMS_MODELS: dict[str, type[_Strict]] = {
    "shed": ShedParams,
    "checkpoint": CheckpointParams,
    "webhook": NotifyParams,
    "alertmanager": NotifyParams,
}


class RuleSpec(_Strict):
    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:-]+$")
    when: When
    resolve: Resolve = Resolve()
    actions: list[Literal["webhook", "alertmanager", "checkpoint", "shed"]] = Field(min_length=1)
    match: Match = Match()
    cooldown_s: float = Field(300.0, ge=0)
    # while an episode goes on, repeat its node actions this often (a checkpoint taken when
    # the episode began grows stale as the job keeps training); None: once per episode
    repeat_s: float | None = Field(None, gt=0)
    priority: int = 0
    # true: every action is only recorded (node actions are sent flagged dry-run); false:
    # all are live; unset: shedding is dry-run (it stops processes) and the rest are live
    dry_run: bool | None = None
    severity: Literal["info", "warning", "critical"] = "warning"
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RuleSpec:
        w, r = self.when, self.resolve
        if len(set(self.actions)) != len(self.actions):
            raise ValueError("an action is listed twice")
        unknown = set(self.params) - set(self.actions)
        if unknown:
            raise ValueError(f"params for actions the rule does not take: {sorted(unknown)}")
        for action, given in self.params.items():
            try:
                PARAMS_MODELS[action].model_validate(given)
            except ValidationError as exc:
                e = exc.errors()[0]
                where = ".".join(str(x) for x in e["loc"])
                raise ValueError(f"params.{action}.{where}: {e['msg']}") from None
        if w.model_rule and w.horizon_s is not None:
            raise ValueError("model_rule takes the model's own horizon: drop horizon_s")
        if w.risk_above is not None and r.time_to_oom_above_s is not None:
            raise ValueError("a risk rule resolves on resolve.risk_below, not time_to_oom_above_s")
        if r.risk_below is not None and r.risk_below <= 0:
            raise ValueError("resolve.risk_below must be above 0, or the rule never resolves")
        if w.risk_above is not None and r.risk_below is not None and r.risk_below >= w.risk_above:
            raise ValueError(
                f"resolve.risk_below ({self.resolve.risk_below}) must be below"
                f" when.risk_above ({self.when.risk_above}), or the rule would flap"
            )
        if (
            w.time_to_oom_below_s is not None
            and r.time_to_oom_above_s is not None
            and r.time_to_oom_above_s <= w.time_to_oom_below_s
        ):
            raise ValueError("resolve.time_to_oom_above_s must exceed when.time_to_oom_below_s")
        return self


class RuleFile(_Strict):
    rules: list[RuleSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> RuleFile:
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rule names must be unique: {', '.join(dup)} repeated")
        return self


@dataclass(slots=True)
class Tracker:
    """One rule's episode on one domain."""

    firing: bool = False
    above: int = 0
    below: int = 0
    episode: str | None = None
    fired_at: float | None = None
    last_fired_at: float | None = None  # for the cooldown; survives the episode's end
    last_acted_at: float | None = None  # for repeat_s
    suppressed: bool = False  # this episode started inside the cooldown: no actions


@dataclass(frozen=True)
class Rule:
    """A validated rule, ready to judge forecasts."""

    name: str
    actions: tuple[str, ...]
    match: Match
    fire_after: int
    resolve_after: int
    cooldown_s: float
    priority: int
    dry_run: frozenset[str]  # the actions of this rule that only say what they would do
    severity: str
    repeat_s: float | None = None
    params: dict[str, dict[str, Any]] = field(default_factory=dict)
    horizon_s: int | None = None  # the risk detector (risk_above at horizon_s)
    risk_above: float | None = None
    risk_below: float | None = None
    tto_below_s: float | None = None  # the time-to-OOM detector
    tto_above_s: float | None = None

    def fires(self, fc: Forecast) -> bool:
        if self.tto_below_s is not None:
            return fc.time_to_oom_s is not None and fc.time_to_oom_s <= self.tto_below_s
        assert self.horizon_s is not None and self.risk_above is not None
        return fc.risk_at(self.horizon_s) >= self.risk_above

    def calm(self, fc: Forecast) -> bool:
        """Below the resolve bar (lower than the firing bar: hysteresis)."""
        if self.tto_below_s is not None:
            bar = self.tto_above_s if self.tto_above_s is not None else 1.5 * self.tto_below_s
            ok_tto = fc.time_to_oom_s is None or fc.time_to_oom_s > bar
            if self.risk_below is not None and self.horizon_s is not None:
                return ok_tto and fc.risk_at(self.horizon_s) < self.risk_below
            return ok_tto
        assert self.horizon_s is not None
        below = self.risk_below if self.risk_below is not None else 0.5 * (self.risk_above or 0)
        return fc.risk_at(self.horizon_s) < below

    def describe(self) -> str:
        if self.tto_below_s is not None:
            cond = f"time to OOM <= {self.tto_below_s:g}s"
        else:
            cond = f"risk within {self.horizon_s}s >= {self.risk_above:g}"
        return f"{self.name}: {cond} for {self.fire_after} samples"

    def alert_rule(self) -> AlertRule | None:
        if self.horizon_s is None or self.risk_above is None:
            return None
        return AlertRule(self.horizon_s, self.risk_above, self.fire_after)


def build_rule(spec: RuleSpec, default: AlertPolicyLike) -> Rule:
    w, r = spec.when, spec.resolve
    common: dict[str, Any] = dict(
        name=spec.name,
        actions=tuple(spec.actions),
        match=spec.match,
        cooldown_s=spec.cooldown_s,
        repeat_s=spec.repeat_s,
        priority=spec.priority,
        dry_run=frozenset(
            spec.actions
            if spec.dry_run
            else ()
            if spec.dry_run is False
            else [a for a in spec.actions if a == "shed"]
        ),
        severity=spec.severity,
        params=spec.params,
        resolve_after=r.for_samples,
    )
    if w.model_rule:
        return Rule(
            **common,
            fire_after=w.for_samples or default.fire_after,
            horizon_s=default.rule.horizon_s,
            risk_above=default.rule.fire_risk,
            risk_below=r.risk_below if r.risk_below is not None else default.resolve_risk,
        )
    if w.time_to_oom_below_s is not None:
        return Rule(
            **common,
            fire_after=w.for_samples or 2,
            tto_below_s=w.time_to_oom_below_s,
            tto_above_s=r.time_to_oom_above_s,
            risk_below=r.risk_below,
            horizon_s=w.horizon_s,
        )
    return Rule(
        **common,
        fire_after=w.for_samples or 2,
        horizon_s=w.horizon_s,
        risk_above=w.risk_above,
        risk_below=r.risk_below,
    )


class AlertPolicyLike(Protocol):  # what build_rule reads of service.alerts.AlertPolicy
    rule: AlertRule
    resolve_risk: float
    fire_after: int


def _parse(text: str, path: str) -> Any:
    if path.endswith(".json"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise RulesError(f"{path}: not valid JSON: {exc.msg} (line {exc.lineno})") from None
    try:
        import yaml
    except ImportError:  # pragma: no cover - the service extra installs it
        raise RulesError(f"{path}: YAML rules need PyYAML (pip install pyyaml)") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise RulesError(f"{path}: not valid YAML: {exc}") from None


def _where(raw: Any, loc: tuple[Any, ...]) -> str:
    """``rules[2] 'shed-batch': when.risk_above`` from a pydantic error location."""
    if len(loc) >= 2 and loc[0] == "rules" and isinstance(loc[1], int):
        rules = raw.get("rules") if isinstance(raw, dict) else None
        item = rules[loc[1]] if isinstance(rules, list) and loc[1] < len(rules) else None
        name = item.get("name") if isinstance(item, dict) else None
        head = f"rules[{loc[1]}]" + (f" {name!r}" if name else "")
        rest = loc[2:]
    else:
        head, rest = "", loc
    tail = ""
    for part in rest:
        tail += f"[{part}]" if isinstance(part, int) else (f".{part}" if tail else str(part))
    return f"{head}: {tail}" if head and tail else head or tail


def check_rules_file(path: str | Path) -> RuleFile:
    """Read and validate a rule file; RulesError names the rule and field that are wrong."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise RulesError(f"OOMCAST_RULES={path}: cannot read it ({exc.strerror})") from None
    raw = _parse(text, str(p))
    try:
        spec = RuleFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _where(raw, tuple(first["loc"])) or "the file"
        msg = first["msg"].removeprefix("Value error, ")
        raise RulesError(f"{p}: {where}: {msg}") from None
    return spec


def load_rules(path: str | Path, default: AlertPolicyLike) -> list[Rule]:
    """The rules of a file, built (``model_rule`` takes ``default``), highest priority first."""
    rules = [build_rule(s, default) for s in check_rules_file(path).rules]
    return sorted(rules, key=lambda r: -r.priority)


def describe_rules(rules: list[Rule]) -> list[dict[str, Any]]:
    return [
        {
            "name": r.name,
            "detector": r.describe(),
            "actions": list(r.actions),
            "priority": r.priority,
            "cooldown_s": r.cooldown_s,
            "dry_run": sorted(r.dry_run),
            "repeat_s": r.repeat_s,
        }
        for r in rules
    ]


def new_episode() -> str:
    return uuid.uuid4().hex[:16]


def rule_payload(
    status: str,
    rule: Rule,
    tracker: Tracker,
    sample: Sample,
    forecast: Forecast,
    reason: str,
    job: str | None,
) -> dict[str, Any]:
    """An alert of one rule: the fields every alert carries plus what the rule says to do."""
    out = forecast_fields(
        status,
        sample,
        forecast,
        job=job,
        fired_at=tracker.fired_at,
        episode=tracker.episode,
        reason=reason,
    )
    out.update(
        {
            "action": ",".join(rule.actions),
            "actions": list(rule.actions),
            "rule": rule.describe(),
            "rule_name": rule.name,
            "severity": rule.severity,
            "priority": rule.priority,
            "dry_run": sorted(rule.dry_run),  # the actions that only say what they would do
            "suppressed": tracker.suppressed,
            "horizon_s": rule.horizon_s,
            "kind": sample.kind,
        }
    )
    return out


def step_rule(
    tracker: Tracker, rule: Rule, sample: Sample, fc: Forecast, job: str | None
) -> dict[str, Any] | None:
    """Advance one rule's episode on one domain by one forecast; a payload on a transition."""
    if not rule.match.matches(sample, job):
        return None
    if not tracker.firing:
        tracker.above = tracker.above + 1 if rule.fires(fc) else 0
        if tracker.above < rule.fire_after:
            return None
        now = time.time()
        tracker.firing, tracker.below = True, 0
        tracker.episode, tracker.fired_at = new_episode(), now
        last = tracker.last_fired_at
        tracker.suppressed = last is not None and now - last < rule.cooldown_s
        if not tracker.suppressed:
            tracker.last_fired_at = tracker.last_acted_at = now
        why = f"{rule.describe()} (risk {fc.risk_at(rule.horizon_s or 60):.2f}"
        why += f", time to OOM {fc.time_to_oom_s:.0f}s)" if fc.time_to_oom_s else ")"
        if tracker.suppressed:
            assert last is not None
            why += f"; within the {rule.cooldown_s:g}s cooldown of the last firing: no actions"
        return rule_payload("firing", rule, tracker, sample, fc, why, job)
    tracker.below = tracker.below + 1 if rule.calm(fc) else 0
    if tracker.below < rule.resolve_after:
        now = time.time()
        last = tracker.last_fired_at
        if (
            tracker.suppressed
            and tracker.below == 0
            and (last is None or now - last >= rule.cooldown_s)
        ):
            # the episode outlasted the cooldown it started in: act now, as a new firing
            tracker.suppressed = False
            tracker.last_fired_at = tracker.last_acted_at = now
            why = f"still firing when the {rule.cooldown_s:g}s cooldown ended: acting now"
            return rule_payload("firing", rule, tracker, sample, fc, why, job)
        if (
            rule.repeat_s is not None
            and not tracker.suppressed
            and tracker.below == 0
            and now - (tracker.last_acted_at or 0.0) >= rule.repeat_s
        ):
            tracker.last_acted_at = now
            why = f"still firing after {now - (tracker.fired_at or now):.0f}s: node actions again"
            payload = rule_payload("firing", rule, tracker, sample, fc, why, job)
            payload["repeat"] = True
            return payload
        return None
    payload = rule_payload("resolved", rule, tracker, sample, fc, "the forecast calmed down", job)
    end_episode(tracker)
    return payload


def end_episode(tracker: Tracker, *, forget_cooldown: bool = False) -> None:
    tracker.firing = False
    tracker.above = tracker.below = 0
    tracker.episode = tracker.fired_at = None
    tracker.suppressed = False
    if forget_cooldown:  # a new job: the last one's alerts say nothing about it
        tracker.last_fired_at = None
