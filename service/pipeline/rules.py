"""The alert engine: the one place that decides when an alert fires, resolves, or acts.

A rule (``Rule``, built from the rule file by ``service/pipeline/rulefile.py``) watches every memory
domain it matches. Per rule and domain an ``Episode`` counts consecutive forecasts:

- ``fire_after`` forecasts in a row over the rule's bar (risk at ``horizon_s`` at or above
  ``fire_risk``, or time to OOM at or below ``fire_tto_s``) start an episode: one
  ``firing`` alert.
- ``resolve_after`` forecasts in a row under the lower resolve bar (hysteresis), spanning at
  least ``resolve_after_s`` seconds of sample time, end it: one ``resolved`` alert. The
  seconds keep a forecast that dips for a few fast samples from closing an episode that
  fires again at once (the cooldown would then swallow the second firing). An OOM, a new
  job on the domain, or silence end it too (``end_episode``).
- An episode that starts within ``cooldown_s`` of the rule's last firing on that domain is
  *suppressed*: it is recorded, no action runs. If it is still firing when the cooldown
  ends, it fires again and acts. While an episode goes on, ``repeat_s`` re-sends its node
  actions (a ``repeat`` firing).

Every decision is an ``Alert``, a frozen record whose ``to_payload()`` is the JSON the
service emits (DESIGN.md, "Alerts"). What is done with an alert, per action of its rule
(owed to a receiver, a node command with its parameters, or why not: suppressed, n/a,
not configured, dry run, refused on unattested evidence, stale), is decided here too
(``acts``); ``service/pipeline/actions.py`` only carries that out (signs the commands, owes
the deliveries). The engine reads no clock: ``now`` (unix seconds) is an argument of every
function that needs the time.
"""

from __future__ import annotations

import fnmatch
import hashlib
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from oomcast.model.control import DESTRUCTIVE_ACTIONS
from oomcast.model.forecast import HORIZONS_S, Forecast
from oomcast.model.schema import Sample

ACTIONS = ("webhook", "alertmanager", "checkpoint", "shed")
# How long an episode's calm must last before it resolves, by default (the service's
# OOMCAST_ALERT_RESOLVE_AFTER_S; a rule's resolve.for_s)
RESOLVE_AFTER_S = 30.0
NODE_ACTIONS = ("checkpoint", "shed")  # carried out by the node agent, through control

Status = Literal["firing", "resolved"]


@dataclass(frozen=True)
class AlertPolicy:
    """The alert rule the forecaster was validated with, or the one ``OOMCAST_ALERT_*``
    sets: what a rule with ``model_rule: true`` runs, and the horizon the service ranks
    domains by."""

    horizon_s: int = 60
    fire_risk: float = 0.5
    resolve_risk: float = 0.2
    fire_after: int = 2
    resolve_after: int = 3
    # and the calm lasting at least this long, by the samples' clock (the service passes
    # OOMCAST_ALERT_RESOLVE_AFTER_S, RESOLVE_AFTER_S by default; 0 here: the bare engine)
    resolve_after_s: float = 0.0

    def __post_init__(self) -> None:
        if self.horizon_s not in HORIZONS_S:
            raise ValueError(f"horizon_s={self.horizon_s} is not one of {HORIZONS_S}")
        if not 0 < self.fire_risk <= 1:
            raise ValueError(f"fire_risk={self.fire_risk} must be in (0, 1]")
        if not 0 <= self.resolve_risk < self.fire_risk:
            raise ValueError("resolve_risk must be below fire_risk")
        if self.fire_after < 1 or self.resolve_after < 1:
            raise ValueError("fire_after and resolve_after must be at least 1")
        if not 0 <= self.resolve_after_s <= 86400:
            raise ValueError(f"resolve_after_s={self.resolve_after_s} must be in [0, 86400]")


@dataclass(frozen=True)
class DomainMatch:
    """Globs on a domain's kind, node, device and job (``match:`` of a rule)."""

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


@dataclass(frozen=True)
class Rule:
    """A validated rule, ready to judge forecasts: one detector (risk at ``horizon_s`` at
    least ``fire_risk``, or time to OOM at most ``fire_tto_s``), its resolve bar, and what
    to do."""

    name: str
    actions: tuple[str, ...]
    fire_after: int
    resolve_after: int
    match: DomainMatch = DomainMatch()
    cooldown_s: float = 0.0
    priority: int = 0
    dry_run: frozenset[str] = frozenset()  # the actions that only say what they would do
    severity: str = "warning"
    repeat_s: float | None = None
    params: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    horizon_s: int | None = None  # the risk detector: risk at horizon_s >= fire_risk
    fire_risk: float | None = None
    resolve_risk: float | None = None
    fire_tto_s: float | None = None  # the time-to-OOM detector: time_to_oom_s <= fire_tto_s
    resolve_tto_s: float | None = None
    resolve_after_s: float = 0.0  # the calm must also last this long (sample time)

    def fires(self, fc: Forecast) -> bool:
        if self.fire_tto_s is not None:
            return fc.time_to_oom_s is not None and fc.time_to_oom_s <= self.fire_tto_s
        assert self.horizon_s is not None and self.fire_risk is not None
        return fc.risk_at(self.horizon_s) >= self.fire_risk

    def calm(self, fc: Forecast) -> bool:
        """Below the resolve bar (lower than the firing bar: hysteresis)."""
        if self.fire_tto_s is not None:
            bar = self.resolve_tto_s if self.resolve_tto_s is not None else 1.5 * self.fire_tto_s
            ok_tto = fc.time_to_oom_s is None or fc.time_to_oom_s > bar
            if self.resolve_risk is not None and self.horizon_s is not None:
                return ok_tto and fc.risk_at(self.horizon_s) < self.resolve_risk
            return ok_tto
        assert self.horizon_s is not None
        below = self.resolve_risk if self.resolve_risk is not None else 0.5 * (self.fire_risk or 0)
        return fc.risk_at(self.horizon_s) < below

    def describe(self) -> str:
        if self.fire_tto_s is not None:
            cond = f"time to OOM <= {self.fire_tto_s:g}s"
        else:
            cond = f"risk within {self.horizon_s}s >= {self.fire_risk:g}"
        return f"{self.name}: {cond} for {self.fire_after} samples"


def fires_any(
    rules: Sequence[Rule],
    forecasts: Sequence[Forecast],
    risk: npt.NDArray[np.float32] | None = None,
    horizons_s: Sequence[int] = (),
    ttos: Sequence[float | None] | None = None,
) -> list[bool]:
    """Per forecast, whether any rule's firing bar is crossed by it (``Rule.fires``, over a
    batch). Given the batch as arrays (``risk`` with one column per ``horizons_s``, and the
    times to OOM), the thousands of forecasts of one round are judged with one comparison
    per rule; a rule whose horizon has no column is judged forecast by forecast. Only a
    forecast for which this is true needs its episodes advanced one by one: the rest are
    quiet for every rule."""
    n = len(forecasts)
    if risk is None or ttos is None:
        return [any(r.fires(fc) for r in rules) for fc in forecasts]
    columns = {h: i for i, h in enumerate(horizons_s)}
    hot = np.zeros(n, dtype=bool)
    tto: npt.NDArray[np.float64] | None = None
    for rule in rules:
        if rule.fire_tto_s is not None:
            if tto is None:
                tto = np.array([math.inf if t is None else t for t in ttos], np.float64)
            hot |= tto <= rule.fire_tto_s
        elif rule.horizon_s in columns and rule.fire_risk is not None:
            hot |= risk[:, columns[rule.horizon_s]] >= rule.fire_risk
        else:
            hot |= np.fromiter((rule.fires(fc) for fc in forecasts), bool, n)
    out: list[bool] = hot.tolist()
    return out


def policy_rule(policy: AlertPolicy, name: str = "oom-forecast") -> Rule:
    """The policy as a rule of its own: a webhook on every episode, no cooldown."""
    return Rule(
        name=name,
        actions=("webhook",),
        fire_after=policy.fire_after,
        resolve_after=policy.resolve_after,
        resolve_after_s=policy.resolve_after_s,
        horizon_s=policy.horizon_s,
        fire_risk=policy.fire_risk,
        resolve_risk=policy.resolve_risk,
    )


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
            "resolve_after_s": r.resolve_after_s,
        }
        for r in rules
    ]


@dataclass(frozen=True)
class Alert:
    """One decision of one rule on one domain, with the forecast and sample that caused it."""

    status: Status
    rule: Rule
    node: str
    device: str
    kind: str
    job: str | None
    risk: tuple[tuple[int, float], ...]  # (horizon_s, probability of OOM within it)
    time_to_oom_s: float | None
    observed_at: float  # ts of the sample the forecast was made from
    used_bytes: int
    total_bytes: int
    model_version: str
    episode: str | None
    fired_at: float | None
    sent_at: float
    reason: str
    suppressed: bool = False  # the episode began inside the cooldown: no actions
    repeat: bool = False  # node actions again, while the episode goes on
    # Why the evidence behind this alert is not attested (its domain's samples were not
    # all signed by its own node); None when it is. No destructive action (shed) may rest
    # on unattested evidence; notifications and checkpoints may.
    unattested: str | None = None
    # Why the OOM is coming (model/causes.py: leak, fragmentation, phase:eval, ...), what
    # would fix it, what it was read from, and what evidence was missing
    # (service/pipeline/explainer.py).
    cause: str = "unknown"
    remedies: tuple[str, ...] = ()
    evidence: str | None = None
    cause_thin: tuple[str, ...] = ()

    def to_payload(self) -> dict[str, Any]:
        """The alert as the service emits it (webhook body and audit record)."""
        rule = self.rule
        out: dict[str, Any] = {
            "status": self.status,
            "node": self.node,
            "device": self.device,
            "job": self.job,
            "risk": {str(h): round(p, 6) for h, p in self.risk},
            "time_to_oom_s": self.time_to_oom_s,
            "observed_at": self.observed_at,
            "fired_at": self.fired_at,
            "sent_at": self.sent_at,
            "model_version": self.model_version,
            "cause": self.cause,
            "remedies": list(self.remedies),
            "evidence": self.evidence,
            "cause_thin": list(self.cause_thin),
            "episode": self.episode,
            "reason": self.reason,
            "used_bytes": self.used_bytes,
            "total_bytes": self.total_bytes,
            "action": ",".join(rule.actions),
            "actions": list(rule.actions),
            "rule": rule.describe(),
            "rule_name": rule.name,
            "severity": rule.severity,
            "priority": rule.priority,
            "dry_run": sorted(rule.dry_run),
            "suppressed": self.suppressed,
            "horizon_s": rule.horizon_s,
            "kind": self.kind,
        }
        if self.repeat:
            out["repeat"] = True
        out["attested"] = self.unattested is None
        return out


@dataclass(slots=True)
class Episode:
    """One rule's episode state on one domain (the only mutable part of the engine)."""

    firing: bool = False
    above: int = 0
    below: int = 0
    calm_since: float | None = None  # observed_at of the first of the ``below`` calm forecasts
    episode: str | None = None
    fired_at: float | None = None
    last_fired_at: float | None = None  # for the cooldown; survives the episode's end
    last_acted_at: float | None = None  # for repeat_s
    suppressed: bool = False  # this episode started inside the cooldown: no actions
    # the rule sheds, and the domain was under its shed target when the episode fired: the
    # shed waits until the domain crosses the target while the episode goes on
    shed_waits: bool = False

    def reset(self, *, forget_cooldown: bool = False) -> None:
        self.firing = False
        self.above = self.below = 0
        self.episode = self.fired_at = self.calm_since = None
        self.suppressed = self.shed_waits = False
        if forget_cooldown:  # a new job: the last one's alerts say nothing about it
            self.last_fired_at = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for the snapshot a replica taking the domain over restores: an episode
        that fired here must not fire again there."""
        return {
            "firing": self.firing,
            "above": self.above,
            "below": self.below,
            "calm_since": self.calm_since,
            "episode": self.episode,
            "fired_at": self.fired_at,
            "last_fired_at": self.last_fired_at,
            "last_acted_at": self.last_acted_at,
            "suppressed": self.suppressed,
            "shed_waits": self.shed_waits,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Episode:
        """The inverse of ``to_dict``; ValueError, naming the key, on anything malformed."""
        if not isinstance(data, Mapping):
            raise ValueError("episode must be an object")
        flags = {k: data.get(k, False) for k in ("firing", "suppressed", "shed_waits")}
        counts = {k: data.get(k, 0) for k in ("above", "below")}
        times = {
            k: data.get(k) for k in ("fired_at", "last_fired_at", "last_acted_at", "calm_since")
        }
        episode = data.get("episode")
        for k, v in flags.items():
            if not isinstance(v, bool):
                raise ValueError(f"episode {k}: must be true or false, got {v!r}")
        for k, v in counts.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"episode {k}: must be a count, got {v!r}")
        for k, v in times.items():
            if v is not None and (
                isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v)
            ):
                raise ValueError(f"episode {k}: must be unix seconds or null, got {v!r}")
        if episode is not None and not isinstance(episode, str):
            raise ValueError(f"episode episode: must be an id or null, got {episode!r}")
        return cls(
            firing=flags["firing"],
            above=counts["above"],
            below=counts["below"],
            calm_since=None if times["calm_since"] is None else float(times["calm_since"]),
            episode=episode,
            fired_at=None if times["fired_at"] is None else float(times["fired_at"]),
            last_fired_at=None if times["last_fired_at"] is None else float(times["last_fired_at"]),
            last_acted_at=None if times["last_acted_at"] is None else float(times["last_acted_at"]),
            suppressed=flags["suppressed"],
            shed_waits=flags["shed_waits"],
        )


def _alert(
    status: Status,
    rule: Rule,
    ep: Episode,
    sample: Sample,
    fc: Forecast,
    *,
    job: str | None,
    reason: str,
    now: float,
    repeat: bool = False,
) -> Alert:
    return Alert(
        status=status,
        rule=rule,
        node=sample.node,
        device=sample.device,
        kind=sample.kind,
        job=job if job is not None else sample.job,
        risk=tuple(fc.risk.items()),
        time_to_oom_s=fc.time_to_oom_s,
        observed_at=fc.observed_at,
        used_bytes=sample.used_bytes,
        total_bytes=sample.total_bytes,
        model_version=fc.model_version,
        episode=ep.episode,
        fired_at=ep.fired_at,
        sent_at=now,
        reason=reason,
        suppressed=ep.suppressed,
        repeat=repeat,
    )


def evaluate(
    ep: Episode, rule: Rule, sample: Sample, fc: Forecast, job: str | None, now: float
) -> Alert | None:
    """Advance one rule's episode on one domain by one forecast; an alert on a transition."""
    if not rule.match.matches(sample, job):
        return None
    return advance(ep, rule, sample, fc, job, now)


def advance(
    ep: Episode, rule: Rule, sample: Sample, fc: Forecast, job: str | None, now: float
) -> Alert | None:
    """``evaluate`` for a rule known to match the domain (the live state caches matches)."""
    if not ep.firing:
        return _maybe_fire(ep, rule, sample, fc, job, now)
    if rule.calm(fc):
        ep.below += 1
        if ep.calm_since is None:
            ep.calm_since = fc.observed_at
    else:
        ep.below, ep.calm_since = 0, None
    calm_for = fc.observed_at - (fc.observed_at if ep.calm_since is None else ep.calm_since)
    if ep.below >= rule.resolve_after and calm_for >= rule.resolve_after_s:
        alert = _alert(
            "resolved", rule, ep, sample, fc, job=job, reason="the forecast calmed down", now=now
        )
        ep.reset()
        return alert
    if ep.below > 0:
        return None
    if ep.shed_waits and not ep.suppressed and not under_shed_target(rule, sample):
        # the shed its firing could not send (the domain was under its target) goes now
        ep.shed_waits = False
        ep.last_acted_at = now
        why = "the domain crossed its shed target while the episode went on: node actions now"
        return _alert("firing", rule, ep, sample, fc, job=job, reason=why, now=now, repeat=True)
    last = ep.last_fired_at
    if ep.suppressed and (last is None or now - last >= rule.cooldown_s):
        # the episode outlasted the cooldown it started in: act now, as a new firing
        ep.suppressed = False
        ep.last_fired_at = ep.last_acted_at = now
        why = f"still firing when the {rule.cooldown_s:g}s cooldown ended: acting now"
        return _alert("firing", rule, ep, sample, fc, job=job, reason=why, now=now)
    if (
        rule.repeat_s is not None
        and not ep.suppressed
        and now - (ep.last_acted_at or 0.0) >= rule.repeat_s
    ):
        ep.last_acted_at = now
        why = f"still firing after {now - (ep.fired_at or now):.0f}s: node actions again"
        return _alert("firing", rule, ep, sample, fc, job=job, reason=why, now=now, repeat=True)
    return None


def episode_id(rule: Rule, sample: Sample) -> str:
    """An episode's id, from what started it: the rule, the domain and the ts of the sample
    that fired it. A batch forecast again after a crash (read again before it was
    acknowledged, or by the replica that took the partition over) starts the same episode
    under the same id, so its deliveries, keyed by it, are owed once, not twice."""
    key = f"{rule.name}\0{sample.node}\0{sample.device}\0{sample.ts!r}".encode()
    return hashlib.sha256(key).hexdigest()[:16]


def _maybe_fire(
    ep: Episode, rule: Rule, sample: Sample, fc: Forecast, job: str | None, now: float
) -> Alert | None:
    ep.above = ep.above + 1 if rule.fires(fc) else 0
    if ep.above < rule.fire_after:
        return None
    ep.firing, ep.below, ep.calm_since = True, 0, None
    ep.episode, ep.fired_at = episode_id(rule, sample), now
    last = ep.last_fired_at
    ep.suppressed = last is not None and now - last < rule.cooldown_s
    if not ep.suppressed:
        ep.last_fired_at = ep.last_acted_at = now
    ep.shed_waits = under_shed_target(rule, sample)
    why = f"{rule.describe()} (risk {fc.risk_at(rule.horizon_s or 60):.2f}"
    why += f", time to OOM {fc.time_to_oom_s:.0f}s)" if fc.time_to_oom_s else ")"
    if ep.suppressed:
        why += f"; within the {rule.cooldown_s:g}s cooldown of the last firing: no actions"
    return _alert("firing", rule, ep, sample, fc, job=job, reason=why, now=now)


def still_firing(
    ep: Episode, rule: Rule, sample: Sample, fc: Forecast, job: str | None, now: float
) -> Alert:
    """A firing episode as an alert again (not a new decision: nothing is sent for it), for
    the receivers that must hear it while it goes on, after another replica fired it."""
    return _alert("firing", rule, ep, sample, fc, job=job, reason="taken over", now=now)


def end_episode(
    ep: Episode,
    rule: Rule,
    last: tuple[Sample, Forecast] | None,
    *,
    job: str | None,
    reason: str,
    now: float,
    new_job: bool,
) -> Alert | None:
    """End the episode for a reason other than the forecast (an OOM, a new job, silence):
    a resolved alert, saying why, if it was firing and the domain has a forecast."""
    alert = None
    if ep.firing and last is not None:
        sample, fc = last
        alert = _alert("resolved", rule, ep, sample, fc, job=job, reason=reason, now=now)
    ep.reset(forget_cooldown=new_job)
    return alert


# --- what is done with an alert ------------------------------------------------------------

SHED_TARGET_FRAC = 0.85  # shed down to this share of the capacity unless the rule says


@dataclass(frozen=True)
class Act:
    """What is done with one action of an alert's rule: ``outcome`` is what the audit
    record's ``dispatched`` says of it (``owed``, ``dry_run``, ``suppressed``,
    ``not_configured``, ``n/a...``, ``refused: ...``, ``stale: ...``), or ``command``: a
    node command is sent with ``params``, and the record then holds its id, dry-run flag
    and parameters."""

    action: str
    outcome: str
    params: Mapping[str, Any] | None = None

    @property
    def owed(self) -> bool:
        return self.outcome == "owed"

    @property
    def command(self) -> bool:
        return self.outcome == "command"


def acts(
    alert: Alert, now: float, configured: Callable[[str], bool], stale_after_s: float
) -> list[Act]:
    """Per action of the alert's rule, in the rule's order, what is done with the alert.
    ``configured(action)`` says whether the service can carry the action out (a receiver
    URL, the control secret); ``stale_after_s`` bounds the age of the sample a node command
    may act on."""
    out: list[Act] = []
    for action in alert.rule.actions:
        if alert.suppressed:
            out.append(Act(action, "suppressed"))
        elif alert.repeat and action not in NODE_ACTIONS:
            out.append(Act(action, "n/a"))  # receivers heard of the episode when it began
        elif not configured(action):
            out.append(Act(action, "not_configured"))
        elif action in NODE_ACTIONS:
            out.append(_node_act(action, alert, now, stale_after_s))
        elif action in alert.rule.dry_run:
            out.append(Act(action, "dry_run"))
        else:
            out.append(Act(action, "owed"))
    return out


def _node_act(action: str, alert: Alert, now: float, stale_after_s: float) -> Act:
    if alert.status != "firing":
        return Act(action, "n/a")  # a node action happens when an episode starts, not ends
    if action in DESTRUCTIVE_ACTIONS and alert.unattested is not None:
        return Act(action, f"refused: {alert.unattested}")
    age = now - alert.observed_at
    if age > stale_after_s:
        # read late (a backlog, an outage): the node has moved on since this sample
        return Act(action, f"stale: forecast from a sample {age:.0f}s old, no command")
    params = dict(alert.rule.params.get(action) or {})
    if action == "shed":
        target = float(params.pop("target_frac", SHED_TARGET_FRAC))
        total, used = int(alert.total_bytes), int(alert.used_bytes)
        if used <= target * total:
            # A domain under its target is shed nothing, first time or not: a forecast alone
            # (forged state once made a flat 40% line read as an OOM) never frees memory
            # the domain does not hold above its target.
            return Act(action, "n/a: below target_frac")
        # free what brings the domain back under target_frac of its capacity, no more
        params["need_bytes"] = used - int(target * total)
        if params.get("priority") is None:
            params.pop("priority", None)
    return Act(action, "command", params)


def under_shed_target(rule: Rule, sample: Sample) -> bool:
    """Whether ``rule`` sheds and ``sample``'s domain is at or under its shed target: then a
    shed frees nothing (``_node_act``) and waits for the domain to cross it."""
    if "shed" not in rule.actions:
        return False
    target = float((rule.params.get("shed") or {}).get("target_frac", SHED_TARGET_FRAC))
    return sample.used_bytes <= target * sample.total_bytes
