"""What the live state decides each alert and each OOM came to (service/pipeline/outcomes.py)."""

from __future__ import annotations

import itertools
import json

import pytest
from support import sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.schema import Event
from oomcast.service.cluster.snapshot import MAGIC
from oomcast.service.pipeline.outcomes import (
    CHAMPION,
    EXPOSURE_FLUSH_S,
    SETTLE_S,
    SHADOW,
    Outcome,
    Scored,
)
from oomcast.service.pipeline.rules import AlertPolicy, Rule, policy_rule
from oomcast.service.pipeline.state import LiveState

POLICY = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=1)
T0 = 1_800_000_000.0


def live(threshold: float = 0.9) -> LiveState:
    """A live state whose forecaster alerts at ``threshold`` of capacity, scored by the
    policy's rule (no configured rules at all: the score does not depend on them)."""
    return LiveState(
        ThresholdBaseline(threshold),
        [],
        horizon_s=60,
        scored=[Scored(CHAMPION, policy_rule(POLICY, name="scored"))],
    )


def feed(st: LiveState, levels: list[tuple[float, float]], **kw: object) -> None:
    """One sample a second from each (start s, level) until the next start."""
    for (start, level), (end, _) in itertools.pairwise(levels):
        t = start
        while t < end:
            st.apply([sample(T0 + t, level, **kw)], now=T0 + t)
            t += 1.0


def decided(st: LiveState) -> list[Outcome]:
    return [o for o in st.take_outcomes() if o.outcome != "exposure"]


def test_an_oom_warned_40s_ahead_after_growth_is_a_long_oom_warned_30s_ahead() -> None:
    st = live()
    feed(st, [(0, 0.5), (60, 0.7), (90, 0.8), (100, 0.95), (140, 0.0)])
    st.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 140)
    [oom] = decided(st)
    assert (oom.outcome, oom.warned, oom.oom_class) == ("oom", "30s", "long")
    assert oom.lead_s == pytest.approx(40.0)
    assert oom.alert_ts == pytest.approx(T0 + 100.0)


def test_an_oom_with_no_growth_before_it_is_sudden_and_missed() -> None:
    st = live()
    feed(st, [(0, 0.5), (200, 0.0)])
    st.on_event(Event(T0 + 200.0, "n1", "gpu0", "oom"), now=T0 + 200)
    [oom] = decided(st)
    assert (oom.warned, oom.oom_class, oom.lead_s) == ("no", "sudden", None)


def test_an_oom_in_the_jobs_first_minute_is_short_and_a_late_warning_counts_at_10s() -> None:
    st = live()
    feed(st, [(0, 0.5), (20, 0.95), (35, 0.0)])
    st.on_event(Event(T0 + 35.0, "n1", "gpu0", "oom"), now=T0 + 35)
    [oom] = decided(st)
    assert (oom.warned, oom.oom_class) == ("10s", "short")


def test_an_alert_that_ended_counts_for_an_oom_within_the_settling_time() -> None:
    st = live()
    feed(st, [(0, 0.5), (100, 0.95), (110, 0.6), (200, 0.0)])
    assert decided(st) == []  # ended 90 s ago: not yet settled
    st.on_event(Event(T0 + 200.0, "n1", "gpu0", "oom"), now=T0 + 200)
    [oom] = decided(st)
    assert (oom.warned, oom.lead_s) == ("30s", pytest.approx(100.0))


def test_an_alert_with_no_oom_settles_as_a_false_alarm_or_a_near_miss() -> None:
    st = live(threshold=0.8)  # alerts from 80% full
    feed(st, [(0, 0.5), (100, 0.85), (120, 0.5), (120 + SETTLE_S + 5, 0.0)])
    [fa] = decided(st)
    assert fa.outcome == "false_alarm"
    assert fa.alert_ts == pytest.approx(T0 + 100.0)
    assert fa.ts == pytest.approx(T0 + 119.0 + SETTLE_S)  # settled SETTLE_S after its end

    st = live(threshold=0.8)
    feed(st, [(0, 0.5), (100, 0.93), (120, 0.5), (120 + SETTLE_S + 5, 0.0)])
    [near] = decided(st)
    assert (near.outcome, near.max_level) == ("near_miss", pytest.approx(0.93, abs=1e-3))


def test_a_job_that_ends_while_its_alert_stands_leaves_it_censored() -> None:
    st = live()
    feed(st, [(0, 0.5), (100, 0.95), (130, 0.0)], job="a")
    feed(st, [(131, 0.2), (185, 0.0)], job="b")  # another job takes the GPU
    assert decided(st) == []  # a's OOM event may still come
    feed(st, [(185, 0.2), (195, 0.0)], job="b")
    [c] = decided(st)  # a minute after a's last sample: none came
    assert (c.outcome, c.job) == ("censored", "a")


def test_an_oom_event_read_after_the_next_jobs_first_sample_is_the_ended_jobs() -> None:
    """The sample streams are read before the events: job b's first sample can come first."""
    st = live()
    feed(st, [(0, 0.5), (100, 0.95), (140, 0.0)], job="a")
    st.apply([sample(T0 + 141.0, 0.2, job="b")], now=T0 + 141)
    st.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 141)
    [oom] = decided(st)
    assert (oom.job, oom.warned, oom.oom_class) == ("a", "30s", "long")
    assert oom.lead_s == pytest.approx(40.0)
    feed(st, [(142, 0.2), (300, 0.0)], job="b")
    assert decided(st) == []  # b's watch went on untouched; a is not decided again


def test_a_repeated_oom_event_of_one_job_is_not_a_second_oom() -> None:
    """The cgroup source sends an event per kill it reads: several ranks, several events."""
    st = live()
    feed(st, [(0, 0.5), (100, 0.95), (140, 0.0)])
    st.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 140)
    st.on_event(Event(T0 + 142.0, "n1", "gpu0", "oom"), now=T0 + 142)
    assert [o.warned for o in decided(st)] == ["30s"]


def test_a_silent_domain_settles_its_alert_when_it_expires() -> None:
    st = live(threshold=0.8)
    feed(st, [(0, 0.5), (100, 0.85), (110, 0.5), (300, 0.0)])
    st.expire(now=T0 + 1000, live_after_s=60)
    [fa] = decided(st)
    assert fa.outcome == "false_alarm"  # ended 190 s before the job fell silent


def test_exposure_adds_up_to_the_jobs_watched_seconds() -> None:
    st = live()
    end = EXPOSURE_FLUSH_S + 500
    feed(st, [(0, 0.5), (end, 0.0)])
    st.expire(now=T0 + end + 1000, live_after_s=60)
    exposure = [o for o in st.take_outcomes() if o.outcome == "exposure"]
    assert len(exposure) == 2  # flushed once EXPOSURE_FLUSH_S in, and at the end
    assert sum(o.seconds for o in exposure) == pytest.approx(end - 1)
    assert len({o.id for o in exposure}) == 2


def test_an_outcome_decided_again_from_a_snapshot_has_the_same_id() -> None:
    """A replica that takes the partition over restores the domain and reads the OOM again:
    the outcome it decides must be the one on record (same id), so it is counted once."""
    first = live()
    feed(first, [(0, 0.5), (60, 0.95), (100, 0.0)])
    blob = first.snapshot(("n1", "gpu0"))
    first.on_event(Event(T0 + 100.0, "n1", "gpu0", "oom"), now=T0 + 100)
    [a] = decided(first)

    second = live()
    second.restore(blob, now=T0 + 100)
    second.on_event(Event(T0 + 100.0, "n1", "gpu0", "oom"), now=T0 + 100)
    [b] = decided(second)
    assert a == b
    # and the same OOM event read twice by one replica decides nothing more
    second.on_event(Event(T0 + 100.0, "n1", "gpu0", "oom"), now=T0 + 101)
    assert decided(second) == []


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"outcome": "great"}, "is not one of"),
        ({"lead_s": "soon"}, "lead_s"),
        ({"warned": "yes"}, "warned"),
        ({"extra": 1}, "unknown fields"),
        ({"ts": float("nan")}, "ts"),
    ],
)
def test_an_outcome_read_back_is_checked_field_by_field(change: dict, message: str) -> None:
    good = Outcome("x", "oom", T0, "n1", "gpu0", "gpu", None, CHAMPION, "m1", warned="no")
    assert Outcome.from_dict(good.to_dict()) == good
    with pytest.raises(ValueError, match=message):
        Outcome.from_dict(good.to_dict() | change)


def with_shadow(
    shadow: object, champion: float = 0.95, rules: list[Rule] | None = None
) -> LiveState:
    """A champion alerting at ``champion`` of capacity, and a shadow model scored beside it
    by a rule of its own."""
    return LiveState(
        ThresholdBaseline(champion),
        rules or [],
        horizon_s=60,
        scored=[
            Scored(CHAMPION, policy_rule(POLICY, name="scored")),
            Scored(SHADOW, policy_rule(POLICY, name="scored-shadow"), shadow),
        ],
    )


def test_a_shadow_is_scored_on_the_same_oom_by_its_own_forecasts() -> None:
    """The champion (95%) never alerts on a climb that stops at 92%; the shadow (90%) does:
    one OOM, two outcomes, each of its own model; the shadow acts on nothing."""
    st = with_shadow(ThresholdBaseline(0.9), rules=[policy_rule(POLICY)])
    alerts = []
    for t in range(160):
        level = 0.5 if t < 60 else 0.8 if t < 100 else 0.92
        alerts += st.apply([sample(T0 + t, level)], now=T0 + t).alerts
    assert alerts == []  # the rule runs on the champion's forecasts only: it never fired
    st.on_event(Event(T0 + 160.0, "n1", "gpu0", "oom"), now=T0 + 160)
    by_role = {o.role: o for o in decided(st)}
    assert by_role[CHAMPION].warned == "no"
    assert by_role[CHAMPION].model_version == ThresholdBaseline(0.95).version
    assert (by_role[SHADOW].warned, by_role[SHADOW].lead_s) == ("30s", pytest.approx(60.0))
    assert by_role[SHADOW].model_version == ThresholdBaseline(0.9).version
    assert by_role[SHADOW].id != by_role[CHAMPION].id


def test_a_shadows_forecaster_state_travels_in_the_snapshot() -> None:
    """The shadow's LSTM state is carried to the replica that takes the domain over: its
    next forecasts are those of the replica that never stopped. One restored from a blob
    without it starts cold, and forecasts otherwise (so the check can fail)."""
    from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster

    model = OnnxForecaster(str(DEFAULT_MODEL))
    first = with_shadow(model)
    ramp = [(t, 0.5 + 0.003 * max(0, t - 60)) for t in range(0, 150)]  # a leak from 60 s
    feed(first, [*ramp, (150, 0.0)])
    blob = first.snapshot(("n1", "gpu0"))
    cold_blob = with_shadow(ThresholdBaseline(0.9))
    cold_blob.restore(blob, now=T0 + 150)  # its shadow is another model: no state kept
    cold = with_shadow(model)
    cold.restore(cold_blob.snapshot(("n1", "gpu0")), now=T0 + 150)
    second = with_shadow(model)
    second.restore(blob, now=T0 + 150)

    def shadow_risks(st: LiveState) -> list[float]:
        dom = st.domains[("n1", "gpu0")]
        out = []
        for t in (150, 151, 152):
            level = 0.5 + 0.003 * (t - 60)
            [found] = st._step_shadows([dom], [sample(T0 + t, level)], [None])
            out += [found[SHADOW].risk_at(h) for h in model.horizons_s]
        return out

    ahead = shadow_risks(first)
    assert max(ahead) > 0.01  # the gate is open: the risks say something
    assert shadow_risks(second) == pytest.approx(ahead, abs=1e-6)
    assert shadow_risks(cold) != pytest.approx(ahead, abs=1e-6)


def test_an_alert_settled_by_an_oom_long_after_it_ended_says_so() -> None:
    """An alert that ended, then silence, then an OOM 400 s later: the alert is settled as
    it stood (a near miss here) and marked as ended by the OOM, whose samples its window
    would run into (service/kept.py keeps the OOM's trace, not the alert's)."""
    st = live()
    feed(st, [(0, 0.5), (100, 0.95), (110, 0.6), (120, 0.0)])
    st.on_event(Event(T0 + 520.0, "n1", "gpu0", "oom"), now=T0 + 520)
    settled, oom = decided(st)
    assert (settled.outcome, settled.ended_by) == ("near_miss", "oom")
    assert (oom.outcome, oom.warned) == ("oom", "no")


class Failing(ThresholdBaseline):
    """A shadow whose runtime fails on every step."""

    def step(self, *a: object, **kw: object) -> list:  # type: ignore[override]
        raise RuntimeError("the shadow's runtime failed")

    def step_arrays(self, *a: object, **kw: object) -> tuple:  # type: ignore[override]
        raise RuntimeError("the shadow's runtime failed")


def test_a_failing_shadow_never_stops_the_champion() -> None:
    st = with_shadow(Failing(0.9), champion=0.9)
    feed(st, [(0, 0.5), (60, 0.8), (100, 0.95), (160, 0.0)])
    st.on_event(Event(T0 + 160.0, "n1", "gpu0", "oom"), now=T0 + 160)
    found = decided(st)
    assert [(o.role, o.warned) for o in found] == [(CHAMPION, "30s")]  # no shadow outcome
    assert st.shadow_failures == 160
    assert st.domains[("n1", "gpu0")].forecast is not None


def test_a_shadows_watch_is_dropped_where_another_shadow_model_runs() -> None:
    """Replica A's shadow (90%) is alerting when replica B, whose shadow is another model
    (80%), takes the domain over: that alert is not B's shadow's to claim. A replica with
    the same shadow carries it on; a blob from before shadows, or with garbage in their
    place, restores the champion all the same."""
    first = with_shadow(ThresholdBaseline(0.9))
    feed(first, [(0, 0.5), (100, 0.92), (130, 0.0)])
    blob = first.snapshot(("n1", "gpu0"))
    same, other = with_shadow(ThresholdBaseline(0.9)), with_shadow(ThresholdBaseline(0.8))
    for st in (same, other):
        st.restore(blob, now=T0 + 130)
        st.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 140)
    assert {o.role: o.warned for o in decided(same)} == {CHAMPION: "no", SHADOW: "30s"}
    # other's shadow had no watch: nothing to claim (no outcome, as for a job it never saw)
    assert {o.role: o.warned for o in decided(other)} == {CHAMPION: "no"}
    body = json.loads(blob[len(MAGIC) :])
    for shadows in (None, "garbage", {SHADOW: {"model": 7, "state": "x"}}):
        changed = dict(body, shadows=shadows) if shadows is not None else dict(body)
        if shadows is None:
            del changed["shadows"]
        third = with_shadow(ThresholdBaseline(0.9))
        st = third.restore(MAGIC + json.dumps(changed).encode(), now=T0 + 130)
        assert st is not None and CHAMPION in st.watches and SHADOW not in st.watches


def test_a_snapshot_from_the_future_gives_back_every_slot() -> None:
    from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster

    champion, shadow = OnnxForecaster(str(DEFAULT_MODEL)), OnnxForecaster(str(DEFAULT_MODEL))

    def live_onnx() -> LiveState:
        return LiveState(
            champion,
            [],
            horizon_s=60,
            scored=[
                Scored(CHAMPION, policy_rule(POLICY, name="scored")),
                Scored(SHADOW, policy_rule(POLICY, name="scored-shadow"), shadow),
            ],
        )

    first = live_onnx()
    feed(first, [(0, 0.5), (10, 0.0)])
    blob = first.snapshot(("n1", "gpu0"))
    free = (len(champion._free), len(shadow._free))
    second = live_onnx()
    assert second.restore(blob, now=T0 - 3600) is None  # its samples lie an hour ahead
    assert (len(champion._free), len(shadow._free)) == free


def test_a_replica_that_has_not_followed_a_promotion_credits_each_model_its_own_alert() -> None:
    """Replica A promoted its shadow (90%, alerting) and its blob says so; replica B, still
    running the 95% model as champion and the 90% one as shadow, takes the domain over
    before it follows the swap: each model gets back its own watch, whatever role the blob
    gave it, so the 90% model's warning is not credited to the 95% one."""
    first = with_shadow(ThresholdBaseline(0.9))
    feed(first, [(0, 0.5), (100, 0.92), (130, 0.0)])
    [champion, shadow] = first.scored
    old = first.forecaster
    promoted = shadow.forecaster
    first.swap_champion(
        promoted,
        [],
        horizon_s=60,
        scored=[Scored(CHAMPION, champion.rule), Scored(SHADOW, shadow.rule, old)],
        promoted=SHADOW,
    )
    blob = first.snapshot(("n1", "gpu0"))
    lagging = with_shadow(ThresholdBaseline(0.9))
    lagging.restore(blob, now=T0 + 130)
    lagging.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 140)
    found = {o.role: o for o in decided(lagging)}
    assert (found[CHAMPION].model_version, found[CHAMPION].warned) == (old.version, "no")
    assert (found[SHADOW].model_version, found[SHADOW].warned) == (promoted.version, "30s")
    # on the replica that promoted, the same OOM is credited the same way, roles swapped
    first.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 140)
    here = {o.role: o for o in decided(first)}
    assert (here[CHAMPION].model_version, here[CHAMPION].warned) == (promoted.version, "30s")
    assert (here[SHADOW].model_version, here[SHADOW].warned) == (old.version, "no")


def test_a_cold_swap_ends_the_old_models_watch_and_judges_the_new_one_from_its_start() -> None:
    """The 90% champion is alerting at 92% when the 95% model is swapped in cold: the OOM
    that comes after the new model's first samples is the new model's (it missed it), and
    the old model's standing alert is censored, not credited to the new one."""
    st = with_shadow(ThresholdBaseline(0.8), champion=0.9)
    feed(st, [(0, 0.5), (100, 0.92), (130, 0.0)])
    decided(st)
    new = ThresholdBaseline(0.95)
    [champion, shadow] = st.scored
    st.swap_champion(new, [], horizon_s=60, scored=[champion, shadow])
    feed(st, [(130, 0.92), (140, 0.0)])
    st.on_event(Event(T0 + 140.0, "n1", "gpu0", "oom"), now=T0 + 140)
    [oom] = [o for o in decided(st) if o.role == CHAMPION]
    assert (oom.model_version, oom.warned) == (new.version, "no")
    feed(st, [(141, 0.5), (300, 0.0)])  # the old job's watch is decided once no OOM can come
    [old] = [o for o in decided(st) if o.role == CHAMPION]
    assert (old.outcome, old.model_version, old.alert_ts) == (
        "censored",
        ThresholdBaseline(0.9).version,
        T0 + 100,
    )
