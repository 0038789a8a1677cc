"""The rule file (``OOMCAST_RULES``, YAML or JSON), in the manner of oomd's rulesets.

A rule file lists rules. Each rule has one detector, an optional resolve condition
(hysteresis: a lower bar to end the episode than to start it), actions, and its own
cooldown, priority and dry-run switch::

    rules:
      - name: checkpoint-before-oom
        match: {kind: gpu}                    # globs on kind, node, device, job; all optional
        when: {fire_risk: 0.8, horizon_s: 60, for_samples: 3}
        resolve: {resolve_risk: 0.3, for_samples: 3}
        actions: [webhook, alertmanager, checkpoint]
        cooldown_s: 300
        priority: 10
        dry_run: false
        severity: critical
        params: {checkpoint: {ack_timeout_s: 60}}

Detectors: ``fire_risk`` + ``horizon_s`` (the forecast's probability of OOM within that
horizon), or ``time_to_oom_below_s`` (the forecast's median time to OOM), or
``model_rule: true`` (the rule the shipped model was validated with, or the
``OOMCAST_ALERT_*`` settings). Each needs ``for_samples`` consecutive samples. An episode
resolves after ``resolve.for_samples`` calm samples that also span ``resolve.for_s`` seconds
(default: ``OOMCAST_ALERT_RESOLVE_AFTER_S``, 30 s).

Old names, still accepted: ``when.risk_above`` is ``when.fire_risk`` and
``resolve.risk_below`` is ``resolve.resolve_risk``.

The file is checked when the service starts; a bad rule stops the start with a message that
names the rule and the field. What a rule then does is ``service/pipeline/rules.py``'s.
"""

from __future__ import annotations

import difflib
import json
import typing
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    model_validator,
)

from oomcast.model.forecast import HORIZONS_S
from oomcast.service.pipeline.rules import AlertPolicy, DomainMatch, Rule

DEFAULT_RULES = Path(__file__).with_name("default_rules.yaml")


class RulesError(ValueError):
    """A rule file the service refuses to start with; the message names what is wrong."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class MatchSpec(_Strict):
    kind: str = "*"
    node: str = "*"
    device: str = "*"
    job: str = "*"


class WhenSpec(_Strict):
    fire_risk: float | None = Field(
        default=None, gt=0, le=1, validation_alias=AliasChoices("fire_risk", "risk_above")
    )
    horizon_s: int | None = None
    time_to_oom_below_s: float | None = Field(default=None, gt=0)
    model_rule: bool = False
    for_samples: int | None = Field(default=None, ge=1, le=1000)

    @model_validator(mode="after")
    def _one_detector(self) -> WhenSpec:
        chosen = [
            name
            for name, on in (
                ("fire_risk", self.fire_risk is not None),
                ("time_to_oom_below_s", self.time_to_oom_below_s is not None),
                ("model_rule", self.model_rule),
            )
            if on
        ]
        if len(chosen) != 1:
            raise ValueError(
                "give exactly one detector: fire_risk (with horizon_s), time_to_oom_below_s,"
                f" or model_rule: true (got {', '.join(chosen) or 'none'})"
            )
        if self.fire_risk is not None and self.horizon_s is None:
            raise ValueError(f"fire_risk needs horizon_s, one of {list(HORIZONS_S)}")
        if self.fire_risk is not None and self.horizon_s not in HORIZONS_S:
            raise ValueError(
                f"horizon_s {self.horizon_s} is not a horizon the model forecasts; choose one of"
                f" {list(HORIZONS_S)} (the nearest is {_nearest(self.horizon_s)})"
            )
        if self.fire_risk is None and self.horizon_s is not None and not self.model_rule:
            raise ValueError("horizon_s goes with fire_risk")
        return self


class ResolveSpec(_Strict):
    resolve_risk: float | None = Field(
        default=None, ge=0, lt=1, validation_alias=AliasChoices("resolve_risk", "risk_below")
    )
    time_to_oom_above_s: float | None = Field(default=None, gt=0)
    for_samples: int = Field(default=3, ge=1, le=1000)
    # and for at least this many seconds of sample time; default the service's
    # OOMCAST_ALERT_RESOLVE_AFTER_S (30 s)
    for_s: float | None = Field(default=None, ge=0, le=86400)


class ShedParams(_Strict):
    target_frac: float = Field(default=0.85, gt=0, le=1)  # shed down to this share of capacity
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
    """One rule as the file writes it."""

    name: str = Field(min_length=1, max_length=100, pattern=r"^[A-Za-z0-9_.:-]+$")
    when: WhenSpec
    resolve: ResolveSpec = ResolveSpec()
    actions: list[Literal["webhook", "alertmanager", "checkpoint", "shed"]] = Field(min_length=1)
    match: MatchSpec = MatchSpec()
    cooldown_s: float = Field(default=300.0, ge=0)
    # while an episode goes on, repeat its node actions this often (a checkpoint taken when
    # the episode began grows stale as the job keeps training); None: once per episode
    repeat_s: float | None = Field(default=None, gt=0)
    priority: int = 0
    # true: every action is only recorded (node actions are sent flagged dry-run); false:
    # all are live; unset: shedding is dry-run (it stops processes) and the rest are live
    dry_run: bool | None = None
    severity: Literal["info", "warning", "critical"] = "warning"
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _consistent(self) -> RuleSpec:
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
        _check_bars(self.when, self.resolve)
        return self


def _check_bars(w: WhenSpec, r: ResolveSpec) -> None:
    if w.model_rule and w.horizon_s is not None:
        raise ValueError("model_rule takes the model's own horizon: drop horizon_s")
    if w.fire_risk is not None and r.time_to_oom_above_s is not None:
        raise ValueError("a risk rule resolves on resolve.resolve_risk, not time_to_oom_above_s")
    if r.resolve_risk is not None and r.resolve_risk <= 0:
        raise ValueError("resolve.resolve_risk must be above 0, or the rule never resolves")
    if w.fire_risk is not None and r.resolve_risk is not None and r.resolve_risk >= w.fire_risk:
        raise ValueError(
            f"resolve.resolve_risk ({r.resolve_risk}) must be below"
            f" when.fire_risk ({w.fire_risk}), or the rule would flap"
        )
    if (
        w.time_to_oom_below_s is not None
        and r.time_to_oom_above_s is not None
        and r.time_to_oom_above_s <= w.time_to_oom_below_s
    ):
        raise ValueError("resolve.time_to_oom_above_s must exceed when.time_to_oom_below_s")


class RuleFile(_Strict):
    rules: list[RuleSpec] = Field(min_length=1)

    @model_validator(mode="after")
    def _unique(self) -> RuleFile:
        names = [r.name for r in self.rules]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"rule names must be unique: {', '.join(dup)} repeated")
        return self


def _dry_run(spec: RuleSpec) -> frozenset[str]:
    if spec.dry_run:
        return frozenset(spec.actions)
    if spec.dry_run is False:
        return frozenset()
    return frozenset(a for a in spec.actions if a == "shed")


def build_rule(spec: RuleSpec, policy: AlertPolicy) -> Rule:
    """The rule a spec describes; ``model_rule: true`` takes ``policy``'s bars."""
    w, r = spec.when, spec.resolve
    m = spec.match
    common: dict[str, Any] = dict(
        name=spec.name,
        actions=tuple(spec.actions),
        match=DomainMatch(m.kind, m.node, m.device, m.job),
        cooldown_s=spec.cooldown_s,
        repeat_s=spec.repeat_s,
        priority=spec.priority,
        dry_run=_dry_run(spec),
        severity=spec.severity,
        params=spec.params,
        resolve_after=r.for_samples,
    )
    calm_s = r.for_s if r.for_s is not None else policy.resolve_after_s
    if w.model_rule:
        return Rule(
            **common,
            resolve_after_s=calm_s,
            fire_after=w.for_samples or policy.fire_after,
            horizon_s=policy.horizon_s,
            fire_risk=policy.fire_risk,
            resolve_risk=r.resolve_risk if r.resolve_risk is not None else policy.resolve_risk,
        )
    if w.time_to_oom_below_s is not None:
        return Rule(
            **common,
            fire_after=w.for_samples or 2,
            resolve_after_s=calm_s,
            fire_tto_s=w.time_to_oom_below_s,
            resolve_tto_s=r.time_to_oom_above_s,
            resolve_risk=r.resolve_risk,
            horizon_s=w.horizon_s,
        )
    return Rule(
        **common,
        resolve_after_s=calm_s,
        fire_after=w.for_samples or 2,
        horizon_s=w.horizon_s,
        fire_risk=w.fire_risk,
        resolve_risk=r.resolve_risk,
    )


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
    """``rules[2] 'shed-batch': when.fire_risk`` from a pydantic error location."""
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


def check_rules_file(path: str | Path, source: str = "OOMCAST_RULES") -> RuleFile:
    """Read and validate a rule file; RulesError names the rule and field that are wrong.
    ``source`` names where the path came from (the setting, or a command's option)."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise RulesError(f"{source}={path}: cannot read it ({exc.strerror})") from None
    raw = _parse(text, str(p))
    try:
        spec = RuleFile.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = _where(raw, tuple(first["loc"])) or "the file"
        msg = first["msg"].removeprefix("Value error, ") + _did_you_mean(first)
        raise RulesError(f"{p}: {where}: {msg}") from None
    return spec


def _did_you_mean(error: Any) -> str:
    """For a key the schema does not have, the nearest one it does (``horizon`` ->
    ``horizon_s``), from the model the key was found in."""
    loc = tuple(error.get("loc", ()))
    if error.get("type") != "extra_forbidden" or not loc:
        return ""
    model: Any = RuleFile
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return ""
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if isinstance(a, type)] or [ann]
        model = next((a for a in args if hasattr(a, "model_fields")), None)
        if model is None:
            return ""
    names = list(model.model_fields)
    near = difflib.get_close_matches(str(loc[-1]), names, n=1, cutoff=0.6)
    if not near:  # a prefix (horizon / horizon_s) is a likelier slip than a distant spelling
        near = [n for n in names if n.startswith(str(loc[-1])) or str(loc[-1]).startswith(n)]
    return f" (did you mean {near[0]!r}?)" if near else f" (the keys here: {', '.join(names)})"


def load_rules(path: str | Path, policy: AlertPolicy) -> list[Rule]:
    """The rules of a file, built (``model_rule`` takes ``policy``), highest priority first."""
    return rules_from(check_rules_file(path).rules, policy)


def rules_from(specs: Iterable[RuleSpec], policy: AlertPolicy) -> list[Rule]:
    """The rules ``specs`` describe, built with ``policy``, highest priority first."""
    rules = [build_rule(s, policy) for s in specs]
    return sorted(rules, key=lambda r: -r.priority)


def _nearest(horizon: float | None) -> int:
    return min(HORIZONS_S, key=lambda h: abs(h - (horizon or 0)))
