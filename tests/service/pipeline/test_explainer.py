"""Alerts carry their cause and remedies. The demo's GPUs, through the shipped model and the
default rules: the one whose allocator fragments is diagnosed as fragmentation with the
expandable-segments remedy when its alert fires; the steady leak as a leak."""

from __future__ import annotations

import pytest

from oomcast.collectors.sources.sim import simulate_trace
from oomcast.model.causes import EXPANDABLE
from oomcast.model.runtime import OnnxForecaster
from oomcast.model.schema import Sample
from oomcast.service.pipeline.rulefile import DEFAULT_RULES, load_rules
from oomcast.service.pipeline.rules import Alert, AlertPolicy
from oomcast.service.pipeline.state import LiveState


def first_alert(pattern: str, seed: int) -> tuple[Alert, LiveState]:
    fc = OnnxForecaster()
    rule = fc.rule
    policy = AlertPolicy(
        rule.horizon_s, rule.fire_risk, round(rule.fire_risk / 2, 4), rule.fire_after, 3
    )
    live = LiveState(fc, load_rules(DEFAULT_RULES, policy), horizon_s=policy.horizon_s)
    for r in simulate_trace(pattern, seed=seed, duration_s=600, interval_s=0.5):
        if isinstance(r, Sample):
            alerts = live.apply([Sample(**{**r.to_dict(), "job": "demo-job"})], r.ts).alerts
            if alerts:
                return alerts[0], live
    raise AssertionError(f"{pattern} seed {seed}: no alert")


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_fragmenting_demo_gpu_is_diagnosed_as_fragmentation(seed: int) -> None:
    alert, live = first_alert("fragmenting", seed)
    assert alert.status == "firing" and alert.cause == "fragmentation"
    assert "cached but not in use" in (alert.evidence or "")
    assert EXPANDABLE in alert.remedies[0]
    payload = alert.to_payload()
    assert payload["cause"] == "fragmentation" and payload["remedies"] == list(alert.remedies)
    [st] = live.domains.values()
    assert st.summary(60)["cause"] == "fragmentation"  # /v1/devices says the same


def test_the_leaking_demo_gpu_is_a_leak() -> None:
    alert, _ = first_alert("fast_leak", 1)
    assert alert.cause == "leak" and not any(EXPANDABLE in r for r in alert.remedies)


def test_a_neighbour_growing_on_the_gpu_is_named() -> None:
    """Per-process use (NVML) in the samples: another job's process arrives and grows until
    the GPU is nearly full; the alert names the neighbour, not a leak of this job."""
    from oomcast.model.baselines import ThresholdBaseline
    from oomcast.model.processes import ProcessUse
    from oomcast.service.pipeline.rules import Rule

    gib = 1 << 30
    rule = Rule("r", ("webhook",), fire_after=1, resolve_after=1, horizon_s=60, fire_risk=0.5)
    live = LiveState(ThresholdBaseline(0.9), [rule], horizon_s=60)
    alerts = []
    for i in range(40):
        theirs = min(i, 35) * gib
        procs = (ProcessUse(11, 40 * gib, "mine"),) + (
            (ProcessUse(22, theirs, "other"),) if i else ()
        )
        s = Sample(
            1000.0 + i,
            "n",
            "gpu0",
            "gpu",
            80 * gib,
            40 * gib + theirs + gib,
            job="mine",
            processes=procs,
        )
        alerts += live.apply([s], 1000.0 + i).alerts
    [alert] = alerts
    assert alert.cause == "neighbour" and "other processes on the GPU grew" in (
        alert.evidence or ""
    )
    assert any("set_per_process_memory_fraction" in r for r in alert.remedies)


def test_an_episode_ends_saying_the_cause_it_fired_with() -> None:
    """The leak fires as a leak; when the job then runs out of memory, the episode's
    resolved alert said fragmentation (the cache the dying job left behind). It says what
    the episode was told, and the reason says how it ended."""
    from oomcast.model.schema import Event

    alert, live = first_alert("fast_leak", 1)
    assert alert.status == "firing" and alert.cause == "leak"
    [st] = live.domains.values()
    assert st.last is not None
    # the memory after the fire reads otherwise: most of it cached, little in use
    cached = Sample(**{**st.last.to_dict(), "ts": st.last.ts + 1,
                       "allocated_bytes": st.last.used_bytes // 10})  # fmt: skip
    live.apply([cached], cached.ts)
    ended = live.on_event(Event(cached.ts + 1, cached.node, cached.device, "oom"), cached.ts + 1)
    resolved = [a for a in ended if a.episode == alert.episode]
    assert resolved and resolved[0].status == "resolved"
    assert resolved[0].cause == "leak" and resolved[0].remedies == alert.remedies
    assert "ran out of memory" in (resolved[0].reason or "")
    assert st.told == {}  # forgotten once the episode ended


def test_a_domain_with_no_oom_in_sight_names_no_cause() -> None:
    """A container job's hook sends a slow, steady rise far below a roomy limit: the shipped
    model sees no OOM coming, so /v1/devices names no cause and no remedy (a "leak" at 0.2%
    risk would read as a diagnosis); the evidence says so and keeps the shape it read."""
    fc = OnnxForecaster()
    live = LiveState(fc, load_rules(DEFAULT_RULES, AlertPolicy(fc.rule.horizon_s, fc.rule.fire_risk,
                     round(fc.rule.fire_risk / 2, 4), fc.rule.fire_after, 3)),
                     horizon_s=fc.rule.horizon_s)  # fmt: skip
    gib, mib = 1 << 30, 1 << 20
    for i in range(180):
        used = 2 * gib + i * 4 * mib
        s = Sample(1000.0 + i, "n", "cg", "host", 24 * gib, used, allocated_bytes=used,
                   job="cpu-job", step=i)  # fmt: skip
        assert not live.apply([s], 1000.0 + i).alerts
    [st] = live.domains.values()
    summary = st.summary(fc.rule.horizon_s)
    assert summary["alert_risk"] < fc.rule.fire_risk and summary["time_to_oom_s"] is None
    assert summary["cause"] is None and summary["remedies"] == [] and summary["cause_thin"] == []
    assert summary["evidence"].startswith("no OOM in sight: risk ")
    assert "use rose steadily" in summary["evidence"]  # the shape, read as before
