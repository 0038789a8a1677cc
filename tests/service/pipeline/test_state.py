from __future__ import annotations

import random
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from support import sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.forecast import Forecast, Forecaster
from oomcast.model.schema import Event
from oomcast.service.pipeline.rules import (
    AlertPolicy,
    DomainMatch,
    Episode,
    Rule,
    advance,
    policy_rule,
)
from oomcast.service.pipeline.state import LiveState

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


def test_an_expired_domain_is_held_nowhere_not_even_by_the_devices_rank_cache() -> None:
    """A flood of domains that expired kept ~90 MB in `oomcast serve`: /v1/devices' rank
    cache still referenced their states until the next unfiltered query, so neither the
    expiry's collection nor a second flood got the memory back."""
    import gc

    from oomcast.service.api.device_query import DeviceFilter

    st = live_state()
    st.apply([sample(1.0, 0.3, device=f"gpu{i}") for i in range(50)], now=100.0)
    assert st.query(100.0, 60.0, DeviceFilter(), limit=10).total == 50
    cache = st.__dict__["_rank_cache"]
    assert len(cache.entries) == 50
    held = [id(d) for d in st.domains.values()]
    st.expire(now=200.0, live_after_s=60.0)
    assert st.domains == {} and cache.entries == {}
    gc.collect()
    alive = {id(o) for o in gc.get_objects() if type(o).__name__ == "DomainState"}
    assert not alive & set(held)


def test_a_new_job_on_the_device_starts_from_a_clean_forecaster_state() -> None:
    from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster

    fc = OnnxForecaster(DEFAULT_MODEL)

    def state_of(live: LiveState) -> dict[str, Any]:
        """The LSTM's state and the embedding's memory of the one domain."""
        (dom,) = live.domains.values()
        return fc.export_state(dom.forecaster_state)

    st = live_state(fc)
    # job A climbs hard to 97%, then job B starts on the same GPU at 30%
    st.apply([sample(float(t), 0.5 + 0.02 * t, job="a") for t in range(24)], now=100.0)
    b = [sample(30.0 + t, 0.3, job="b") for t in range(5)]
    got = st.apply(b, now=101.0).forecasts
    fresh_state = live_state(fc)
    fresh = fresh_state.apply(b, now=101.0).forecasts
    for (_, g), (_, f) in zip(got, fresh, strict=True):
        assert dict(g.risk) == dict(f.risk)
    assert state_of(st) == state_of(fresh_state)  # nothing of job A is left
    # the same samples without a job change carry job A's history
    st2 = live_state(fc)
    st2.apply([sample(float(t), 0.5 + 0.02 * t, job="a") for t in range(24)], now=100.0)
    st2.apply([sample(30.0 + t, 0.3, job="a") for t in range(5)], now=101.0)
    assert state_of(st2)["h"] != state_of(fresh_state)["h"]


class RiskIsUse:
    """A forecaster whose risk within h seconds is the sample's used fraction times h/120
    (so every horizon differs), and whose time to OOM is 10 s on a sample with
    ``alloc_retries`` set (independent of the risk): alerts come and go where a test puts
    them. ``RiskIsUseArrays`` adds ``step_arrays`` (the batch as arrays, as OnnxForecaster
    has)."""

    version = "test/risk-is-use"
    horizons_s = (5, 15, 30, 60, 120, 300)

    def init_state(self) -> None:
        return None

    def step(self, states: list[None], samples: list[Any], embeddings: object = None) -> list[Any]:
        return [
            Forecast(
                risk={h: min(1.0, s.used_frac * h / 120) for h in self.horizons_s},
                time_to_oom_s=10.0 if s.alloc_retries else None,
                observed_at=s.ts,
                model_version=self.version,
            )
            for s in samples
        ]


class RiskIsUseArrays(RiskIsUse):
    def step_arrays(
        self, states: list[None], samples: list[Any], embeddings: object = None
    ) -> tuple[list[Any], np.ndarray, list[float | None]]:
        fcs = self.step(states, samples)
        risk = np.array([[fc.risk[h] for h in self.horizons_s] for fc in fcs], np.float32)
        return fcs, risk, [fc.time_to_oom_s for fc in fcs]


def _rules() -> list[Rule]:
    base = policy_rule(AlertPolicy(120, 0.5, resolve_risk=0.2, fire_after=2, resolve_after=3))
    return [
        base,
        replace(
            base,
            name="soon",
            horizon_s=None,
            fire_risk=None,
            resolve_risk=None,
            fire_tto_s=30.0,
            fire_after=1,
            resolve_after=2,
        ),
        replace(
            base,
            name="gpu1-only",
            match=DomainMatch(device="gpu1"),
            horizon_s=300,
            fire_risk=0.9,
            fire_after=1,
            cooldown_s=20.0,
            repeat_s=5.0,
            priority=-1,
        ),
    ]


def _reference(
    rules: list[Rule], samples: list[tuple[Any, float]], forecaster: RiskIsUse
) -> list[tuple[Any, ...]]:
    """The rules' decisions with every matching rule run on every forecast, no skipping: what
    the live state's batch judgement (quiet domains skipped) must equal."""
    episodes: dict[tuple[Any, str], Episode] = {}
    out = []
    for s, now in samples:
        [fc] = forecaster.step([None], [s])
        for rule in rules:
            ep = episodes.setdefault((s.domain, rule.name), Episode())
            if rule.match.matches(s, s.job):
                a = advance(ep, rule, s, fc, s.job, now=now)
                if a is not None:
                    out.append((a.status, a.rule, a.device, a.observed_at))
    return out


@pytest.mark.parametrize("arrays", [True, False], ids=["batch-arrays", "per-forecast"])
@pytest.mark.parametrize("seed", range(6))
def test_skipping_quiet_domains_decides_what_running_every_rule_decides(
    arrays: bool, seed: int
) -> None:
    """Random walks of use in and out of the rules' bars, over three domains, in batches of
    mixed sizes: the same alerts, in the same order, as running each rule on each forecast
    (fire_after 2 and resolve_after 3 catch an episode whose counts were skipped)."""
    rng = random.Random(seed)
    rules = _rules()
    live = LiveState(RiskIsUseArrays() if arrays else RiskIsUse(), rules, horizon_s=120)
    streams = {d: [] for d in ("gpu0", "gpu1", "gpu2")}
    for d, out in streams.items():
        u = rng.uniform(0.1, 0.6)
        for t in range(300):
            u = min(0.99, max(0.01, u + rng.gauss(0, 0.08)))
            retries = 1 if rng.random() < 0.03 else None
            out.append(sample(1000.0 + t, u, device=d, alloc_retries=retries))
    ordered = [s for t in range(300) for s in (streams[d][t] for d in streams)]
    got, applied, i = [], [], 0
    while i < len(ordered):
        batch, now = ordered[i : i + rng.randint(1, 12)], ordered[i].ts
        for a in live.apply(batch, now=now).alerts:
            got.append((a.status, a.rule, a.device, a.observed_at))
        applied.extend((s, now) for s in batch)
        i += len(batch)
    ref = _reference(rules, applied, RiskIsUse())
    assert len(ref) > 20, "the walk must cross the bars often enough to mean something"
    assert got == ref


def test_new_domains_past_the_caps_are_refused_and_held_ones_go_on() -> None:
    """Anyone who can write a stream could make domains without end (10 x 10,000 took the
    service from 114 MB to 2.5 GB). Past the cap per node or in all, a new domain's samples
    are refused with the code domain_cap, its events dropped; the held domains go on, and a
    domain that expires makes room."""
    st = LiveState(ThresholdBaseline(0.9), [policy_rule(POLICY)], horizon_s=POLICY.horizon_s,
                   max_domains=3, max_domains_per_node=2)  # fmt: skip
    first = st.apply([sample(1.0, device="g0"), sample(1.0, device="g1"),
                      sample(1.0, device="g2")], now=100.0)  # fmt: skip
    assert [(s.device, code) for s, _, code in first.rejected] == [("g2", "domain_cap")]
    assert "cap per node (OOMCAST_MAX_DOMAINS_PER_NODE)" in str(first.rejected[0].problem)
    second = st.apply([sample(1.0, node="n2"), sample(1.0, node="n3")], now=100.0)
    assert [(s.node, code) for s, _, code in second.rejected] == [("n3", "domain_cap")]
    assert "(OOMCAST_MAX_DOMAINS)" in str(second.rejected[0].problem)
    assert st.on_event(Event(1.0, "n4", "gpu0", "oom"), now=100.0) == []
    assert st.events_over_cap == 1 and ("n4", "gpu0") not in st.domains
    held = st.apply([sample(2.0, device="g0"), sample(2.0, node="n2")], now=110.0)
    assert held.rejected == [] and len(held.forecasts) == 2
    assert st.per_node == {"n1": 2, "n2": 1}
    st.apply([sample(50.0, device="g0"), sample(50.0, node="n2")], now=150.0)
    st.expire(now=200.0, live_after_s=60.0)  # n1/g1 has been silent since 100
    assert st.per_node == {"n1": 1, "n2": 1}
    assert st.apply([sample(60.0, device="g2")], now=200.0).rejected == []
