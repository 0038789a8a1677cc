"""service/pipeline/phases.py: the live state's phase forecasts, merged with the forecaster's before
the rules run (the forecaster here is a threshold baseline at 90%: calm at 60% use)."""

from __future__ import annotations

from typing import Any

import pytest
from support import GIB, T0, sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.events import ScheduleEvent
from oomcast.model.phase import MARGIN_FRAC, PHASE_RISK
from oomcast.model.schema import Event, Sample
from oomcast.service.pipeline.rules import AlertPolicy, policy_rule
from oomcast.service.pipeline.state import LiveState

POLICY = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=1)
TOTAL = 80 * GIB
USED_FRAC = 0.6
HEADROOM = TOTAL - int(MARGIN_FRAC * TOTAL) - int(USED_FRAC * TOTAL)
DOMAIN = ("n1", "cuda0")


def live_state() -> LiveState:
    return LiveState(ThresholdBaseline(0.9), [policy_rule(POLICY)], horizon_s=POLICY.horizon_s)


def schedule(extra: int, job: str = "j", **over: Any) -> ScheduleEvent:
    return ScheduleEvent(
        T0,
        "n1",
        "cuda0",
        "schedule",
        job,
        eval_every_steps=100,
        phase_extra_bytes={"eval": extra},
        **over,
    )


def steps(first: int, last: int, job: str = "j", **extra: Any) -> list[Sample]:
    """A flat 60% at 1 step/s, one sample per step."""
    return [
        sample(T0 + i, USED_FRAC, device="cuda0", job=job, step=i, **extra)
        for i in range(first, last + 1)
    ]


def test_a_domain_without_a_schedule_is_left_as_it_was() -> None:
    live = live_state()
    applied = live.apply(steps(0, 40), now=100.0)
    assert applied.alerts == []
    st = live.domains[DOMAIN]
    assert st.phases is None and st.cause is None
    summary = st.summary(60)
    # flat, and no OOM in sight: no cause named at all
    assert summary["cause"] is None and summary["phase"] is None
    assert summary["risk"]["120"] == 0.0


def test_an_eval_that_will_not_fit_fires_the_rules_with_its_cause() -> None:
    live = live_state()
    live.on_event(schedule(HEADROOM + GIB), now=100.0)
    live.apply(steps(0, 30), now=100.0)  # eval 70 s away: past the rule's 60 s horizon
    assert all(not ep.firing for ep in live.domains[DOMAIN].episodes.values())
    applied = live.apply(steps(31, 41), now=101.0)
    [alert] = applied.alerts
    assert alert.status == "firing" and alert.cause == "phase:eval"
    assert alert.time_to_oom_s == 60.0  # fired on the step-40 sample: the eval at step 100
    payload = alert.to_payload()
    assert payload["cause"] == "phase:eval" and payload["risk"]["60"] == PHASE_RISK
    summary = live.domains[DOMAIN].summary(60)
    assert summary["cause"] == "phase:eval" and summary["time_to_oom_s"] == 59.0
    assert summary["phase"]["phase"] == "eval" and summary["phase"]["steps_away"] == 59
    assert summary["phase"]["extra_bytes"] == HEADROOM + GIB


def test_an_eval_that_fits_fires_nothing() -> None:
    live = live_state()
    live.on_event(schedule(HEADROOM - GIB), now=100.0)
    assert live.apply(steps(0, 99), now=100.0).alerts == []
    assert live.domains[DOMAIN].summary(60)["cause"] is None  # no OOM in sight


def test_the_eval_running_well_resolves_the_episode() -> None:
    live = live_state()
    live.on_event(schedule(HEADROOM + GIB), now=100.0)
    assert [a.status for a in live.apply(steps(0, 100), now=100.0).alerts] == ["firing"]
    # the eval ran at step 100 and needed 1 GiB, not what was announced
    ran = sample(T0 + 100.5, USED_FRAC, device="cuda0", job="j", step=100, phase="eval")
    ran = Sample(**{**ran.to_dict(), "peak_bytes": ran.used_bytes + GIB})
    resolved = live.apply([ran, *steps(101, 102)], now=102.0).alerts
    # the episode ends under the cause it fired with (a resolved alert is about its episode)
    assert [(a.status, a.cause) for a in resolved] == [("resolved", "phase:eval")]
    assert live.domains[DOMAIN].phases is not None
    assert live.domains[DOMAIN].phases.extra_bytes["eval"] == GIB  # type: ignore[union-attr]


def test_an_oom_or_another_job_ends_the_schedule() -> None:
    live = live_state()
    live.on_event(schedule(HEADROOM + GIB), now=100.0)
    live.apply(steps(0, 41), now=100.0)
    [resolved] = live.on_event(Event(T0 + 42, "n1", "cuda0", "oom", "j"), now=101.0)
    assert resolved.cause == "phase:eval"  # the last forecast's
    assert live.domains[DOMAIN].phases is None
    live.on_event(schedule(HEADROOM + GIB, job="a"), now=102.0)
    live.apply(steps(50, 60, job="a"), now=103.0)
    assert live.domains[DOMAIN].phases is not None
    alerts = live.apply(steps(61, 62, job="b"), now=104.0).alerts  # job b replaces a
    assert [a.status for a in alerts] == ["resolved"]
    assert live.domains[DOMAIN].phases is None
    assert live.apply(steps(63, 99, job="b"), now=105.0).alerts == []


def test_a_schedule_sent_before_the_new_jobs_first_sample_is_kept() -> None:
    live = live_state()
    live.apply(steps(0, 5, job="a"), now=100.0)
    live.on_event(schedule(HEADROOM + GIB, job="b"), now=100.0)
    alerts = live.apply(steps(0, 41, job="b")[-3:], now=101.0).alerts
    assert [(a.status, a.cause) for a in alerts] == [("firing", "phase:eval")]


def test_a_domain_known_by_its_schedule_alone_waits_for_its_samples() -> None:
    live = live_state()
    live.on_event(schedule(HEADROOM + GIB), now=1000.0)
    assert live.expire(now=1030.0, live_after_s=60.0) == []
    assert DOMAIN in live.domains and live.live(now=1030.0, live_after_s=60.0) == []


def test_a_snapshot_carries_the_schedule_to_the_replica_that_takes_the_domain_over() -> None:
    live = live_state()
    live.on_event(schedule(HEADROOM + GIB), now=100.0)
    live.apply(steps(0, 41), now=100.0)
    taker = live_state()
    restored = taker.restore(live.snapshot(DOMAIN))
    assert restored is not None and restored.cause == "phase:eval"
    assert [a.cause for a in taker.firing([DOMAIN], now=101.0)] == ["phase:eval"]
    assert restored.phases is not None
    assert restored.phases.to_dict() == live.domains[DOMAIN].phases.to_dict()  # type: ignore[union-attr]
    # it goes on forecasting where the other left off: no resolve, no second firing
    assert taker.apply(steps(42, 45), now=102.0).alerts == []
    assert restored.summary(60)["phase"]["steps_away"] == 55
    # a damaged schedule in a blob: the domain starts cold rather than wrong
    from oomcast.model.phase import PhaseState

    bad = live.domains[DOMAIN].phases.to_dict() | {"steps": [[1.0, -3]]}  # type: ignore[union-attr]
    with pytest.raises(ValueError, match="steps"):
        PhaseState.from_dict(bad)


def test_a_bad_schedule_event_is_dead_lettered_naming_the_field() -> None:
    import json

    from oomcast.model.wire import Keys
    from oomcast.service.pipeline.decode import decode_event_entries

    keys = Keys("t", 1)
    good = {"event": json.dumps(schedule(GIB).to_dict())}
    bad = {"event": json.dumps(schedule(GIB).to_dict() | {"step_s": -1})}
    out = decode_event_entries(keys.events, [("1-0", good), ("2-0", bad)], keys, [0])
    assert [type(e).__name__ for e, _ in out.events] == ["ScheduleEvent"]
    [dead] = out.deadletters
    assert str(dead["reason"]).startswith("step_s: must be a positive")
