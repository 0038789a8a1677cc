from __future__ import annotations

from support import sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.forecast import Forecaster
from oomcast.model.schema import Event
from oomcast.service.rules import AlertPolicy, policy_rule
from oomcast.service.state import LiveState

POLICY = AlertPolicy(60, 0.5, resolve_risk=0.2, fire_after=1, resolve_after=1)


def live_state(forecaster: Forecaster | None = None) -> LiveState:
    """Live state with the one rule the policy makes (the service loads a rule file)."""
    return LiveState(
        forecaster or ThresholdBaseline(0.9), [policy_rule(POLICY)], horizon_s=POLICY.horizon_s
    )


def test_rounds_keep_each_domains_order_within_one_batch() -> None:
    st = live_state()
    batch = [sample(1.0, 0.5), sample(1.0, 0.5, device="gpu1"), sample(2.0, 0.95), sample(3.0, 0.5)]
    applied = st.apply(batch, now=100.0)
    assert len(applied.forecasts) == 4
    assert [a.status for a in applied.alerts] == ["firing", "resolved"]
    assert st.domains[("n1", "gpu0")].samples_seen == 3


def test_out_of_order_is_rejected_and_redelivery_is_a_duplicate() -> None:
    st = live_state()
    st.apply([sample(1.0, 0.5), sample(2.0, 0.6)], now=100.0)
    again = st.apply([sample(2.0, 0.6), sample(1.5, 0.7)], now=100.0)
    assert again.duplicates == 1
    assert [(s.ts, e.field) for s, e, _ in again.rejected] == [(1.5, "ts")]


def test_oom_resolves_resets_and_skips_samples_read_late() -> None:
    st = live_state()
    st.apply([sample(1.0, 0.95)], now=100.0)
    [alert] = st.on_event(Event(5.0, "n1", "gpu0", "oom"), now=100.0)
    assert alert.status == "resolved"
    assert "out of memory" in alert.reason
    # Samples of the dead job arriving after its OOM event neither fire nor forecast.
    late = st.apply([sample(3.0, 0.97), sample(4.0, 0.98)], now=101.0)
    assert late.late == 2 and late.alerts == [] and late.forecasts == []
    after = st.apply([sample(6.0, 0.3)], now=102.0)
    assert len(after.forecasts) == 1
    assert st.domains[("n1", "gpu0")].ooms_seen == 1


def test_silent_domains_expire_and_a_firing_one_is_resolved() -> None:
    st = live_state()
    st.apply([sample(1.0, 0.95), sample(1.0, 0.3, device="calm")], now=100.0)
    st.on_event(Event(1.0, "n9", "gpu0", "oom"), now=100.0)  # a domain known by event only
    assert st.expire(now=150.0, live_after_s=60.0) == []
    assert len(st.live(now=150.0, live_after_s=60.0)) == 2
    resolved = st.expire(now=200.0, live_after_s=60.0)
    assert [(a.device, a.status) for a in resolved] == [("gpu0", "resolved")]
    assert "no samples for 100s" in resolved[0].reason
    assert st.domains == {}


def test_a_new_job_on_the_device_starts_from_a_clean_forecaster_state() -> None:
    from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster

    fc = OnnxForecaster(DEFAULT_MODEL)
    st = live_state(fc)
    # job A climbs hard to 97%, then job B starts on the same GPU at 30%
    st.apply([sample(float(t), 0.5 + 0.02 * t, job="a") for t in range(24)], now=100.0)
    b = [sample(30.0 + t, 0.3, job="b") for t in range(5)]
    got = st.apply(b, now=101.0).forecasts
    fresh = live_state(fc).apply(b, now=101.0).forecasts
    for (_, g), (_, f) in zip(got, fresh, strict=True):
        assert dict(g.risk) == dict(f.risk)
    # the same samples without a job change carry job A's history
    st2 = live_state(fc)
    st2.apply([sample(float(t), 0.5 + 0.02 * t, job="a") for t in range(24)], now=100.0)
    same_job = st2.apply([sample(30.0 + t, 0.3, job="a") for t in range(5)], now=101.0)
    assert dict(same_job.forecasts[0][1].risk) != dict(fresh[0][1].risk)
