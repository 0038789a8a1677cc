"""service/pipeline/rulefile.py, rules.py and actions.py: rule files are validated with
errors that name the rule and field (old field names still accepted); episodes with
hysteresis, cooldown, repeats and matching; the dispatcher's record of what it did; the
default rule set; and `oomcast serve` refusing a bad file."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from support import oomcast_cmd

from oomcast.model.control import NonceCache, node_key, verify_command
from oomcast.model.forecast import Forecast, RiskRow
from oomcast.model.schema import Sample
from oomcast.model.wire import Keys
from oomcast.service.delivery.outbox import Delivery, Outbox, delivery_id
from oomcast.service.pipeline.actions import Dispatcher
from oomcast.service.pipeline.rulefile import DEFAULT_RULES, RulesError, load_rules
from oomcast.service.pipeline.rules import Alert, AlertPolicy, Episode, Rule, acts, evaluate

POLICY = AlertPolicy(120, 0.6, resolve_risk=0.3, fire_after=1)
NOW = 1000.0
H = (5, 15, 30, 60, 120, 300)


def rules_file(tmp_path: Path, rules: list[dict[str, Any]], suffix: str = ".json") -> Path:
    path = tmp_path / f"rules{suffix}"
    path.write_text(json.dumps({"rules": rules}))
    return path


def fc(risk: float, tto: float | None = None, ts: float = 1.0) -> Forecast:
    return Forecast(RiskRow({h: i for i, h in enumerate(H)}, [risk] * len(H)), tto, ts, "m1")


def sample(ts: float = 1.0, device: str = "gpu0", kind: str = "gpu") -> Sample:
    return Sample(ts, "n1", device, kind, 100, 90, job="train")


def step(ep: Episode, rule: Rule, s: Sample, f: Forecast, now: float = NOW) -> Alert | None:
    return evaluate(ep, rule, s, f, "train", now)


def payload_of(alert: Alert | None) -> dict[str, Any]:
    assert alert is not None
    return alert.to_payload()


RISK_RULE = {
    "name": "r",
    "when": {"fire_risk": 0.8, "horizon_s": 60, "for_samples": 2},
    "resolve": {"resolve_risk": 0.3, "for_samples": 2},
    "actions": ["webhook"],
    "cooldown_s": 0,
}


@pytest.mark.parametrize(
    ("rule", "message"),
    [
        ({**RISK_RULE, "when": {"fire_risk": 0.8}}, "'r': when: fire_risk needs horizon_s"),
        ({**RISK_RULE, "when": {"risk_above": 0.8}}, "'r': when: fire_risk needs horizon_s"),
        ({**RISK_RULE, "when": {"horizon_s": 60}}, "give exactly one detector"),
        # a horizon given but not forecast used to read as a missing one ("needs horizon_s")
        (
            {**RISK_RULE, "when": {"fire_risk": 0.8, "horizon_s": 50}},
            "'r': when: horizon_s 50 is not a horizon the model forecasts; choose one of",
        ),
        ({**RISK_RULE, "actions": ["page"]}, "'r': actions[0]: Input should be"),
        ({**RISK_RULE, "resolve": {"resolve_risk": 0.9}}, "must be below when.fire_risk"),
        ({**RISK_RULE, "resolve": {"risk_below": 0.9}}, "must be below when.fire_risk"),
        ({**RISK_RULE, "cooldown": 5}, "'r': cooldown: Extra inputs are not permitted"),
        ({**RISK_RULE, "name": "bad name"}, "'bad name': name: String should match"),
        ({**RISK_RULE, "when": {"fire_risk": 1.5, "horizon_s": 60}}, ": when.fire_risk"),
        ({**RISK_RULE, "actions": []}, ": actions: List should have at least 1 item"),
        (
            {**RISK_RULE, "actions": ["shed"], "params": {"shed": {"target_frac": "85%"}}},
            "params.shed.target_frac",
        ),
        (
            {**RISK_RULE, "actions": ["shed"], "params": {"shed": {"grace_s": 5}}},
            "params.shed.grace_s: Extra inputs are not permitted",
        ),
        ({**RISK_RULE, "params": {"shed": {}}}, "params for actions the rule does not take"),
        ({**RISK_RULE, "when": {"model_rule": True, "horizon_s": 60}}, "drop horizon_s"),
    ],
)
def test_a_bad_rule_is_refused_naming_rule_and_field(
    tmp_path: Path, rule: dict[str, Any], message: str
) -> None:
    with pytest.raises(RulesError) as err:
        load_rules(rules_file(tmp_path, [rule]), POLICY)
    assert message in str(err.value)
    assert "rules[0]" in str(err.value)


def test_file_level_errors(tmp_path: Path) -> None:
    with pytest.raises(RulesError, match="repeated"):
        load_rules(rules_file(tmp_path, [RISK_RULE, RISK_RULE]), POLICY)
    bad = tmp_path / "r.yaml"
    bad.write_text("rules: [\n")
    with pytest.raises(RulesError, match="not valid YAML"):
        load_rules(bad, POLICY)
    with pytest.raises(RulesError, match="cannot read it"):
        load_rules(tmp_path / "missing.yaml", POLICY)


def test_old_field_names_are_aliases_of_the_new() -> None:
    old = {
        **RISK_RULE,
        "when": {"risk_above": 0.8, "horizon_s": 60, "for_samples": 2},
        "resolve": {"risk_below": 0.3, "for_samples": 2},
    }
    assert load_rules_from(old) == load_rules_from(RISK_RULE)
    [rule] = load_rules_from(old)
    assert (rule.fire_risk, rule.resolve_risk) == (0.8, 0.3)


def test_hysteresis_and_for_samples() -> None:
    [rule] = load_rules_from(RISK_RULE)
    t = Episode()
    assert step(t, rule, sample(), fc(0.9)) is None  # 1 of 2
    fired = payload_of(step(t, rule, sample(), fc(0.9)))
    assert fired["status"] == "firing" and fired["rule_name"] == "r"
    assert fired["risk"]["60"] == 0.9 and fired["observed_at"] == 1.0  # what caused it
    # between the two bars: still firing; below the lower one twice: resolved
    assert step(t, rule, sample(), fc(0.5)) is None
    assert step(t, rule, sample(), fc(0.2)) is None
    resolved = payload_of(step(t, rule, sample(), fc(0.2)))
    assert resolved["status"] == "resolved"


def test_the_calm_time_of_a_rule() -> None:
    # every rule takes the policy's (OOMCAST_ALERT_RESOLVE_AFTER_S) unless resolve.for_s
    # gives its own
    held = dataclasses.replace(POLICY, resolve_after_s=30.0)
    model = {"name": "m", "when": {"model_rule": True}, "actions": ["webhook"]}
    tto = {"name": "t", "when": {"time_to_oom_below_s": 45}, "actions": ["webhook"]}
    with tempfile.TemporaryDirectory() as tmp:
        [m] = load_rules(rules_file(Path(tmp), [model]), held)
        [own] = load_rules(rules_file(Path(tmp), [{**model, "resolve": {"for_s": 5}}]), held)
        [r] = load_rules(rules_file(Path(tmp), [RISK_RULE]), held)
        [t] = load_rules(rules_file(Path(tmp), [tto]), held)
        [now] = load_rules(rules_file(Path(tmp), [{**tto, "resolve": {"for_s": 0}}]), held)
    calm = [x.resolve_after_s for x in (m, own, r, t, now)]
    assert calm == [30.0, 5.0, 30.0, 30.0, 0.0]
    [timed] = load_rules_from({**RISK_RULE, "resolve": {"resolve_risk": 0.3, "for_s": 10}})
    assert timed.resolve_after_s == 10.0 and timed.resolve_after == 3
    with pytest.raises(RulesError, match="for_s"):
        load_rules_from({**RISK_RULE, "resolve": {"for_s": -1}})
    t = Episode()
    step(t, timed, sample(0.0), fc(0.9, ts=0.0))
    assert payload_of(step(t, timed, sample(1.0), fc(0.9, ts=1.0)))["status"] == "firing"
    for ts in (2.0, 3.0, 4.0, 11.0, 12.0):  # three calm by 4 s; 10 s of calm at 12 s
        alert = step(t, timed, sample(ts), fc(0.1, ts=ts))
        assert (alert is None) == (ts < 12.0)
    assert payload_of(alert)["status"] == "resolved"


def test_cooldown_suppresses_actions_and_repeat_renews_them() -> None:
    now = 1000.0
    [rule] = load_rules_from({**RISK_RULE, "cooldown_s": 60, "repeat_s": 10})
    t = Episode()
    step(t, rule, sample(), fc(0.9), now)
    first = payload_of(step(t, rule, sample(), fc(0.9), now))
    assert not first["suppressed"]
    now += 5
    assert step(t, rule, sample(), fc(0.9), now) is None  # too soon to repeat
    now += 6
    again = payload_of(step(t, rule, sample(), fc(0.9), now))
    assert again.get("repeat") is True and again["status"] == "firing"
    for _ in range(2):
        step(t, rule, sample(), fc(0.1), now)  # resolved
    now += 5
    for _ in range(2):
        out = step(t, rule, sample(), fc(0.9), now)
    p = payload_of(out)
    assert p["suppressed"] is True  # within 60 s of the last firing
    assert "cooldown" in p["reason"]


def test_an_episode_that_outlasts_its_cooldown_acts_when_it_ends() -> None:
    now = 1000.0
    [rule] = load_rules_from({**RISK_RULE, "cooldown_s": 60})
    t = Episode()
    for _ in range(2):
        step(t, rule, sample(), fc(0.9), now)
    for _ in range(2):
        step(t, rule, sample(), fc(0.1), now)  # resolved at t=1000
    now += 10
    for _ in range(2):
        out = step(t, rule, sample(), fc(0.9), now)
    assert payload_of(out)["suppressed"] is True
    now += 30
    assert step(t, rule, sample(), fc(0.9), now) is None  # still in the cooldown
    now += 30
    acted = payload_of(step(t, rule, sample(), fc(0.9), now))
    assert acted["suppressed"] is False and acted["status"] == "firing"
    assert "cooldown ended" in acted["reason"]


def test_time_to_oom_detector_and_match() -> None:
    [rule] = load_rules_from(
        {
            "name": "tto",
            "when": {"time_to_oom_below_s": 45, "for_samples": 1},
            "actions": ["checkpoint"],
            "match": {"kind": "host", "device": "cgroup:/kubepods*"},
        }
    )
    t = Episode()
    assert step(t, rule, sample(kind="gpu"), fc(0.9, tto=10)) is None  # no match
    host = sample(device="cgroup:/kubepods/pod1", kind="host")
    assert step(t, rule, host, fc(0.1, tto=None)) is None
    fired = payload_of(step(t, rule, host, fc(0.1, tto=30)))
    assert fired["time_to_oom_s"] == 30


def test_default_rules_load_and_explain_themselves() -> None:
    rules = load_rules(DEFAULT_RULES, POLICY)
    names = [r.name for r in rules]
    assert names == ["shed-lower-priority", "oom-forecast"]  # highest priority first
    forecast = next(r for r in rules if r.name == "oom-forecast")
    assert (forecast.horizon_s, forecast.fire_risk) == (120, 0.6)  # the model's rule
    held = load_rules(DEFAULT_RULES, dataclasses.replace(POLICY, resolve_after_s=30.0))
    assert [r.resolve_after_s for r in held] == [30.0, 30.0]  # the shed rule cannot flap
    assert "checkpoint" in forecast.actions
    shed = next(r for r in rules if r.name == "shed-lower-priority")
    assert shed.dry_run == {"shed"}  # shedding is off until someone turns it on


class FakeTarget:
    """A receiver that keeps the deliveries it is told are owed (never posted here)."""

    name = "webhook"

    def __init__(self) -> None:
        self.sent: list[Delivery] = []

    def order_key(self, payload: Mapping[str, Any]) -> str:
        return f"{payload['node']}/{payload['device']}"

    def owed(self, delivery: Delivery) -> None:
        self.sent.append(delivery)

    def request(self, delivery: Delivery, now: float) -> tuple[str, bytes, dict[str, str]]:
        raise AssertionError("nothing is posted in these tests")


def test_dispatcher_records_what_it_did_and_signs_node_commands() -> None:
    rules = load_rules_from(
        {**RISK_RULE, "actions": ["webhook", "alertmanager", "checkpoint", "shed"]},
    )
    webhook = FakeTarget()
    outbox = Outbox(aioredis.Redis(), Keys("t"))  # never reached: the ingest loop stages
    d = Dispatcher(
        Keys("t"), rules, webhook=webhook, alertmanager=None, outbox=outbox, control_secret="k"
    )
    t = Episode()
    now = time.time()
    step(t, rules[0], sample(now), fc(0.9, ts=now), now)
    alert = step(t, rules[0], sample(now), fc(0.9, ts=now), now)
    assert alert is not None
    out = d.dispatch(alert, now)
    # owed: the finished record, with what was done, under an id made from the record
    assert [x.payload for x in webhook.sent] == [out.record]
    assert out.deliveries == tuple(webhook.sent)
    assert out.deliveries[0].id == delivery_id(out.record, "webhook")
    done = out.record["dispatched"]
    assert done["webhook"] == "owed" and done["alertmanager"] == "not_configured"
    assert {k: v for k, v in out.record.items() if k != "dispatched"} == alert.to_payload()
    assert [c.stream for c in out.commands] == ["t:control:{n1}", "t:control:{n1}"]
    cmds = [
        verify_command(
            dict(c.fields), node_key("k", "n1"), now=time.time(), node="n1", nonces=NonceCache()
        )
        for c in out.commands
    ]
    assert [c.action for c in cmds] == ["checkpoint", "shed"]
    shed = cmds[1]
    assert shed.params["need_bytes"] == 90 - 85  # down to 85% of 100 bytes
    assert shed.forecast["risk"] == out.record["risk"]
    assert done["shed"]["command_id"] == shed.id
    # a dry-run rule sends nothing to receivers, and flags its node commands
    dry_rule = dataclasses.replace(
        rules[0], dry_run=frozenset({"webhook", "checkpoint", "shed", "alertmanager"})
    )
    dry = d.dispatch(dataclasses.replace(alert, rule=dry_rule), now)
    assert dry.record["dispatched"]["webhook"] == "dry_run" and len(webhook.sent) == 1
    assert dry.record["dispatched"]["checkpoint"]["dry_run"] is True
    # a forecast read long after its sample (a backlog) sends no command
    old = d.dispatch(dataclasses.replace(alert, observed_at=now - 3600), now)
    assert str(old.record["dispatched"]["checkpoint"]).startswith("stale") and not old.commands
    # a repeated shed once the domain is back under target_frac stops nobody else
    calm = d.dispatch(dataclasses.replace(alert, repeat=True, used_bytes=50), now)
    assert calm.record["dispatched"]["shed"].startswith("n/a")
    assert [c.action for c in calm.commands] == ["checkpoint"]
    # nor a first one: a domain at 40% was once shed 5% of its capacity on a (forged)
    # forecast, because the first shed always asked for at least a twentieth
    flat = d.dispatch(dataclasses.replace(alert, repeat=False, used_bytes=40), now)
    assert flat.record["dispatched"]["shed"].startswith("n/a: below target_frac")
    assert [c.action for c in flat.commands] == ["checkpoint"]
    # just above the target, it asks for what brings the domain back to it, no more
    edge = d.dispatch(dataclasses.replace(alert, used_bytes=86), now)
    [shed_edge] = [c for c in edge.commands if c.fields and "shed" in str(c.fields)]
    got = verify_command(dict(shed_edge.fields), node_key("k", "n1"), now=time.time(),
                         node="n1", nonces=NonceCache())  # fmt: skip
    assert got.params["need_bytes"] == 86 - 85
    # a broken dispatch is recorded on the alert, never raised into the ingest loop, and
    # then nothing is sent
    broken = d.dispatch(dataclasses.replace(alert, total_bytes="lots"), now)
    assert "error" in broken.record["dispatched"] and broken.commands == ()
    # nothing given to the dispatcher was changed
    assert "dispatched" not in alert.to_payload()


def test_shedding_is_dry_run_unless_a_rule_says_otherwise() -> None:
    base = {**RISK_RULE, "actions": ["webhook", "shed"]}
    [unset] = load_rules_from(base)
    [live] = load_rules_from({**base, "dry_run": False})
    [dry] = load_rules_from({**base, "dry_run": True})
    assert (
        unset.dry_run == {"shed"} and live.dry_run == set() and dry.dry_run == {"webhook", "shed"}
    )


def load_rules_from(*rules: dict[str, Any]) -> list[Any]:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        return load_rules(rules_file(Path(tmp), list(rules)), POLICY)


def test_serve_refuses_to_start_on_a_bad_rule(tmp_path: Path) -> None:
    path = rules_file(tmp_path, [{**RISK_RULE, "actions": ["page"]}])
    env = {**os.environ, "OOMCAST_RULES": str(path)}
    done = subprocess.run(
        oomcast_cmd("serve", "--port", "1"), env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "rules[0] 'r': actions[0]" in done.stderr


def test_a_shed_that_fired_under_its_target_goes_when_the_domain_crosses_it() -> None:
    """A forecast can fire while the domain is still under its shed target (a neighbour
    climbing fast): the shed then frees nothing yet, and goes on the first sample of the
    same episode that is over the target; once, and not for an episode that stays under."""
    [rule] = load_rules_from(
        {**RISK_RULE, "actions": ["shed"], "params": {"shed": {"target_frac": 0.7}}}
    )

    def at(ts: float, used: int) -> Sample:
        return Sample(ts, "n1", "gpu0", "gpu", 100, used, job="train")

    ep = Episode()
    assert step(ep, rule, at(1.0, 50), fc(0.9)) is None
    fired = step(ep, rule, at(2.0, 55), fc(0.9))
    assert fired is not None and not fired.repeat and ep.shed_waits
    [act] = acts(fired, fired.observed_at, lambda a: True, 60.0)
    assert act.outcome == "n/a: below target_frac"
    assert step(ep, rule, at(3.0, 65), fc(0.9)) is None  # still under: still waiting
    crossed = step(ep, rule, at(4.0, 80), fc(0.9))
    assert crossed is not None and crossed.repeat and not ep.shed_waits
    [act] = acts(crossed, crossed.observed_at, lambda a: True, 60.0)
    assert act.outcome == "command" and act.params["need_bytes"] == 80 - 70
    assert step(ep, rule, at(5.0, 90), fc(0.9)) is None  # once
    # the flag travels with the episode to a replica that takes the domain over
    assert Episode.from_dict(Episode(firing=True, shed_waits=True).to_dict()).shed_waits
