"""service/cluster/snapshot.py: a domain's state handed from one replica to another through Redis.

The new owner is a fresh LiveState with a forecaster of its own (another process, as a
replica that takes a partition over), restoring what the old owner staged in real Redis.
It must continue exactly where the old owner stopped: the same forecasts as a run that was
never interrupted, no second firing of an episode already open, and the episode's own id
on the alert that resolves it. A blob it cannot trust is a cold start, never a crash."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence

import numpy as np
import pytest
import redis.asyncio as aioredis
from support import leak_trace, sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.forecast import Forecast, Forecaster
from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster
from oomcast.model.schema import Event, Sample
from oomcast.service.cluster.leases import PartitionLeases
from oomcast.service.cluster.snapshot import (
    MAGIC,
    ForgedSnapshot,
    Restored,
    SnapshotSchedule,
    SnapshotStore,
    field_of,
    seal,
    snapshot_keys,
    unseal,
)
from oomcast.service.pipeline.rulefile import DEFAULT_RULES, load_rules
from oomcast.service.pipeline.rules import Alert, AlertPolicy, policy_rule
from oomcast.service.pipeline.state import RESTORED_PROBATION_S, LiveState

DOMAIN = ("n1", "gpu0")
PARTITION = 1


def model_live(fc: OnnxForecaster | None = None) -> LiveState:
    """The service's live state: the shipped model and the shipped rule file."""
    fc = fc or OnnxForecaster(DEFAULT_MODEL)
    rule = fc.rule
    policy = AlertPolicy(rule.horizon_s, rule.fire_risk, rule.fire_risk / 2, rule.fire_after, 3)
    return LiveState(fc, load_rules(DEFAULT_RULES, policy), horizon_s=policy.horizon_s)


def threshold_live() -> LiveState:
    policy = AlertPolicy(5, 0.5, 0.2, fire_after=1, resolve_after=2)
    return LiveState(ThresholdBaseline(0.9), [policy_rule(policy)], horizon_s=5)


def leak() -> list[Sample]:
    return [r for r in leak_trace(seconds_to_oom=300, interval_s=1.0) if isinstance(r, Sample)]


def run(live: LiveState, samples: Sequence[Sample]) -> tuple[list[Forecast], list[Alert]]:
    """One sample per batch, as a quiet node's entries arrive; the node sends no embedding,
    so the forecaster's own embedding state is exercised too."""
    forecasts, alerts = [], []
    for s in samples:
        applied = live.apply([s], now=s.ts)
        forecasts.extend(fc for _, fc in applied.forecasts)
        alerts.extend(applied.alerts)
    return forecasts, alerts


def outputs(forecasts: Sequence[Forecast]) -> np.ndarray:
    return np.asarray(
        [
            [*f.risk.values(), -1.0 if f.time_to_oom_s is None else f.time_to_oom_s]
            for f in forecasts
        ]
    )


async def hand_over(redis_url: str, prefix: str, old: LiveState, new: LiveState) -> int:
    """The old owner stages the domain's snapshot under its lease, as the ingest loop does
    with a batch's records; the new owner restores the partition. How many it restored."""
    client = aioredis.from_url(redis_url)
    leases = PartitionLeases(client, prefix, 4, "old")
    assert PARTITION in (await leases.tick()).acquired
    store = SnapshotStore(client, prefix)
    pipe = client.pipeline(transaction=False)
    store.stage(pipe, PARTITION, {DOMAIN: old.snapshot(DOMAIN)}, lease_token=leases.token)
    assert await pipe.execute() == [1]
    await leases.release_all()
    restored = await SnapshotStore(aioredis.from_url(redis_url), prefix).restore(new, PARTITION)
    assert restored.ignored == 0
    await client.aclose()
    return len(restored.states)


def test_a_new_owner_continues_the_forecasts_of_an_uninterrupted_run(
    redis_url: str, key_prefix: str
) -> None:
    samples, cut = leak(), 200
    ref, _ = run(model_live(), samples)
    old = model_live()
    run(old, samples[:cut])
    fc = OnnxForecaster(DEFAULT_MODEL)
    taken = [fc.init_state() for _ in range(5)]  # the new owner's slots are not the old one's
    new = model_live(fc)
    assert asyncio.run(hand_over(redis_url, key_prefix, old, new)) == 1
    assert new.domains[DOMAIN].forecaster_state.index not in {s.index for s in taken}
    got, _ = run(new, samples[cut:])
    np.testing.assert_allclose(outputs(got), outputs(ref[cut:]), rtol=1e-5, atol=1e-6)
    st = new.domains[DOMAIN]
    assert st.samples_seen == len(samples) and st.job == "leaky"
    # the test can tell: a new owner that starts cold forecasts otherwise
    cold, _ = run(model_live(), samples[cut:])
    assert not np.allclose(outputs(cold), outputs(ref[cut:]), atol=1e-3)


def test_a_firing_episode_restored_does_not_fire_again_and_resolves_under_its_id(
    redis_url: str, key_prefix: str
) -> None:
    samples = leak()
    _, ref_alerts = run(model_live(), samples)
    assert any(a.status == "firing" for a in ref_alerts), "the model must fire on a leak"
    old = model_live()
    alerts: list[Alert] = []
    cut = 0
    while not alerts:  # up to the first firing: its snapshot goes with it
        alerts.extend(old.apply([samples[cut]], now=samples[cut].ts).alerts)
        cut += 1
    [firing] = alerts
    assert firing.status == "firing"
    new = model_live()
    asyncio.run(hand_over(redis_url, key_prefix, old, new))
    _, after = run(new, samples[cut:])
    again = [a for a in after if a.rule.name == firing.rule.name and not a.repeat]
    assert again == [], "the new owner paged again for an episode already open"
    end = samples[-1].ts + 1
    resolved = new.on_event(Event(end, *DOMAIN, "oom"), now=end)
    assert [(a.rule.name, a.status, a.episode) for a in resolved if a.rule == firing.rule] == [
        (firing.rule.name, "resolved", firing.episode)
    ]
    # and the two halves together sent what the uninterrupted run sent
    names = [(a.rule.name, a.status, a.repeat) for a in ref_alerts]
    assert [(a.rule.name, a.status, a.repeat) for a in alerts + after] == names


def test_restored_episodes_and_counters_are_the_old_owners(redis_url: str, key_prefix: str) -> None:
    old, new = threshold_live(), threshold_live()
    _, fired = run(old, [sample(1.0, 0.95), sample(2.0, 0.96)])
    assert [a.status for a in fired] == ["firing"]
    asyncio.run(hand_over(redis_url, key_prefix, old, new))
    a, b = old.domains[DOMAIN], new.domains[DOMAIN]
    assert b.episodes["oom-forecast"] == a.episodes["oom-forecast"]
    assert (b.samples_seen, b.last, b.forecast, b.job) == (
        a.samples_seen,
        a.last,
        a.forecast,
        a.job,
    )
    assert list(b.history) == list(a.history)
    # still over the bar on the new owner: no second page; a cold owner would page again
    assert run(new, [sample(3.0, 0.97)])[1] == []
    assert [x.status for x in run(threshold_live(), [sample(3.0, 0.97)])[1]] == ["firing"]
    # and a redelivered sample of the old owner's is known as one
    assert new.apply([sample(2.0, 0.96)], now=4.0).duplicates == 1


def _body(blob: bytes) -> dict:  # type: ignore[type-arg]
    body: dict = json.loads(blob[len(MAGIC) :])  # type: ignore[type-arg]
    return body


def _blob(body: dict) -> bytes:  # type: ignore[type-arg]
    return MAGIC + json.dumps(body).encode()


def test_a_corrupt_or_foreign_blob_is_a_cold_start(caplog: pytest.LogCaptureFixture) -> None:
    old = model_live()
    run(old, leak()[:50])
    good = old.snapshot(DOMAIN)
    body = _body(good)
    bad_h = {**body, "forecaster": {**body["forecaster"], "h": body["forecaster"]["h"][:-8]}}
    bad_episode = {**body, "episodes": {"oom-forecast": {"firing": "yes"}}}
    bad_scalar = {**body, "scalars": {**body["scalars"], "samples_seen": "many"}}
    blobs = {
        "not a snapshot": b"\x00garbage",
        "truncated": good[: len(good) // 2],
        "another format": good.replace(MAGIC, b"oomcast-snapshot/99\n"),
        "another body format": _blob({**body, "v": 99}),
        "h of the wrong size": _blob(bad_h),
        "a malformed episode": _blob(bad_episode),
        "a malformed counter": _blob(bad_scalar),
        "no domain": _blob({k: v for k, v in body.items() if k != "domain"}),
    }
    new = model_live()
    fc = new.forecaster
    assert isinstance(fc, OnnxForecaster)
    free = len(fc._free)
    for what, blob in blobs.items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="oomcast.service.cluster.snapshot"):
            assert new.restore(blob) is None, what
        assert "starts cold" in caplog.text, what
        assert new.domains == {} and len(fc._free) == free, f"{what} left state behind"
    # the domain starts cold: the same forecasts as on a replica that never had a snapshot
    rest = leak()[50:60]
    np.testing.assert_array_equal(outputs(run(new, rest)[0]), outputs(run(model_live(), rest)[0]))


def test_a_blob_of_another_model_keeps_episodes_but_not_the_forecaster_state(
    caplog: pytest.LogCaptureFixture,
) -> None:
    old = model_live()
    samples = leak()
    run(old, samples[:100])
    body = _body(old.snapshot(DOMAIN))
    body["model"] = "lstm-1999.01.01"
    with caplog.at_level(logging.WARNING, logger="oomcast.service.cluster.snapshot"):
        st = model_live().restore(_blob(body))
    assert st is not None and "forecaster state starts cold" in caplog.text
    assert st.samples_seen == 100 and st.episodes == old.domains[DOMAIN].episodes
    new = model_live()
    new.restore(_blob(body))
    got = outputs(run(new, samples[100:110])[0])
    np.testing.assert_array_equal(got, outputs(run(model_live(), samples[100:110])[0]))


def test_a_fenced_write_needs_the_lease(redis_url: str, key_prefix: str) -> None:
    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        store = SnapshotStore(client, key_prefix)
        holder = PartitionLeases(client, key_prefix, 4, "holder")
        await holder.tick()
        live = threshold_live()
        run(live, [sample(1.0, 0.5)])
        items = {DOMAIN: live.snapshot(DOMAIN)}
        pipe = client.pipeline(transaction=False)
        store.stage(pipe, PARTITION, items, lease_token="someone-else/0")
        store.stage(pipe, PARTITION, items, lease_token=holder.token)
        assert await pipe.execute() == [0, 1]
        assert len(await store.load(PARTITION)) == 1
        assert 0 < await client.pttl(store.key(PARTITION)) <= store.ttl_s * 1000
        pipe = client.pipeline(transaction=False)
        store.drop(pipe, PARTITION, [DOMAIN], lease_token="someone-else/0")
        store.drop(pipe, PARTITION, [DOMAIN], lease_token=holder.token)
        assert await pipe.execute() == [0, 1]
        assert await store.load(PARTITION) == []
        # fixed partitions write without a token
        pipe = client.pipeline(transaction=False)
        queued = store.stage(pipe, PARTITION, items)
        assert len(await pipe.execute()) == queued
        new = threshold_live()
        restored = await store.restore(new, PARTITION)
        assert [s.domain for s in restored.states] == [DOMAIN]
        await holder.release_all()
        await client.aclose()

    asyncio.run(scenario())


def test_a_bad_blob_among_good_ones_costs_only_its_own_domain(
    redis_url: str, key_prefix: str
) -> None:
    async def scenario() -> None:
        client = aioredis.from_url(redis_url)
        store = SnapshotStore(client, key_prefix)
        live = threshold_live()
        run(live, [sample(1.0, 0.5), sample(1.0, 0.5, device="gpu1")])
        await client.hset(store.key(PARTITION), "x", b"\xffjunk")  # type: ignore[misc]
        pipe = client.pipeline(transaction=False)
        store.stage(pipe, PARTITION, {d: live.snapshot(d) for d in live.domains})
        await pipe.execute()
        restored = await store.restore(threshold_live(), PARTITION)
        assert restored.ignored == 1 and len(restored.states) == 2
        await client.aclose()

    asyncio.run(scenario())


def test_forget_drops_domains_without_alerts_and_frees_their_slots() -> None:
    live = model_live()
    fc = live.forecaster
    assert isinstance(fc, OnnxForecaster)
    free = len(fc._free)
    run(live, [sample(1.0, 0.97), sample(1.0, 0.5, device="gpu1")])
    assert live.forget([DOMAIN, ("n1", "gpu1"), ("nx", "gone")]) == 2
    assert live.domains == {} and len(fc._free) == free


def test_restore_replaces_the_replicas_own_stale_copy() -> None:
    fresh = threshold_live()
    run(fresh, [sample(float(t), 0.5) for t in range(1, 11)])
    stale = threshold_live()
    run(stale, [sample(1.0, 0.5)])
    st = stale.restore(fresh.snapshot(DOMAIN))
    assert st is stale.domains[DOMAIN] and st.samples_seen == 10


def test_the_schedule_snapshots_alerted_domains_always_and_others_now_and_then() -> None:
    sched = SnapshotSchedule(every_s=5.0)
    a, b = ("n", "a"), ("n", "b")
    assert sched.pick([a, b], [], now=0.0) == [a, b]
    assert sched.pick([a, b], [b], now=1.0) == [b]
    assert sched.pick([a, b], [], now=5.0) == [a]
    sched.forget([b])
    assert sched.pick([b], [], now=5.5) == [b]


def test_every_forecaster_of_the_service_can_be_handed_over() -> None:
    from oomcast.model.baselines import baseline_detectors

    samples = leak()[:40]
    forecasters: list[Forecaster] = [d.forecaster for d in baseline_detectors()]
    for fc in forecasters:
        policy = AlertPolicy(60, 0.5, 0.2, 1, 1)
        old = LiveState(fc, [policy_rule(policy)], horizon_s=60)
        ref = LiveState(fc, [policy_rule(policy)], horizon_s=60)
        run(old, samples[:20])
        new = LiveState(fc, [policy_rule(policy)], horizon_s=60)
        assert new.restore(old.snapshot(DOMAIN)) is not None, fc.version
        expected = outputs(run(ref, samples)[0][20:])
        np.testing.assert_array_equal(outputs(run(new, samples[20:])[0]), expected, fc.version)


def test_a_damaged_baseline_state_is_a_cold_start_too(caplog: pytest.LogCaptureFixture) -> None:
    from oomcast.model.baselines import PredictLinearBaseline

    policy = AlertPolicy(60, 0.5, 0.2, 1, 1)
    old = LiveState(PredictLinearBaseline(60, 60), [policy_rule(policy)], horizon_s=60)
    run(old, leak()[:10])
    body = _body(old.snapshot(DOMAIN))
    new = LiveState(PredictLinearBaseline(60, 60), [policy_rule(policy)], horizon_s=60)
    for damaged in ([1, 2], {"points": "many", "sums": [], "t0": 1.0}):
        with caplog.at_level(logging.WARNING, logger="oomcast.service.cluster.snapshot"):
            assert new.restore(_blob({**body, "forecaster": damaged})) is None
        assert "starts cold" in caplog.text


def test_domains_that_fall_due_together_are_spread_over_batches() -> None:
    from oomcast.service.cluster.snapshot import MIN_PER_BATCH

    sched = SnapshotSchedule(every_s=5.0, share=0.25)
    domains = [("n", f"gpu{i}") for i in range(1000)]
    first = sched.pick(domains, [], now=0.0)
    assert len(first) == 250  # a quarter of the batch, not all 1,000 at once
    urgent = domains[900]  # an alert's domain is never held back
    second = sched.pick(domains, [urgent], now=0.1)
    assert second[0] == urgent and len(second) == 251
    taken = set(first) | set(second)
    for k in range(2, 6):
        taken |= set(sched.pick(domains, [], now=0.1 * k))
    assert taken == set(domains)  # every domain had its turn within a few batches
    assert len(sched.pick(domains[:10], [], now=0.7)) == 0  # none due again yet
    few = [("m", f"gpu{i}") for i in range(MIN_PER_BATCH)]
    assert len(sched.pick(few[:3], [], now=1.0)) == 3  # small batches are not held back


def test_a_blob_the_service_did_not_seal_is_not_restored_and_is_counted(
    redis_url: str, key_prefix: str
) -> None:
    """The reported attack: an attacker with only Redis write access put a chosen LSTM
    state into a healthy domain's snapshot, took the lease, and the service restored it and
    shed a process. With a seal key, the service restores only blobs it sealed: one written
    past it, one sealed under another key, or a sealed one moved to another domain's field
    starts its domain cold, and is counted; the genuine ones restore as before."""
    key = snapshot_keys("control-secret", "webhook-secret")

    async def scenario() -> Restored:
        client = aioredis.from_url(redis_url)
        store = SnapshotStore(client, key_prefix, seal_keys=key)
        live = threshold_live()
        run(live, [sample(1.0, 0.5, device=f"gpu{i}") for i in range(4)])
        blobs = {d: live.snapshot(d) for d in live.domains}
        pipe = client.pipeline(transaction=False)
        store.stage(pipe, PARTITION, {("n1", "gpu0"): blobs[("n1", "gpu0")]})
        await pipe.execute()
        h = store.key(PARTITION)
        await client.hset(h, field_of(("n1", "gpu1")), blobs[("n1", "gpu1")])  # type: ignore[misc]
        other = seal(blobs[("n1", "gpu2")], snapshot_keys("guess", None), PARTITION,
                     field_of(("n1", "gpu2")))  # fmt: skip
        await client.hset(h, field_of(("n1", "gpu2")), other)  # type: ignore[misc]
        moved = seal(blobs[("n1", "gpu0")], key, PARTITION, field_of(("n1", "gpu0")))
        await client.hset(h, field_of(("n1", "gpu3")), moved)  # type: ignore[misc]
        restored = await store.restore(threshold_live(), PARTITION)
        await client.aclose()
        return restored

    restored = asyncio.run(scenario())
    assert [s.domain for s in restored.states] == [("n1", "gpu0")]
    assert restored.forged == 3 and restored.ignored == 3
    with pytest.raises(ForgedSnapshot, match="no seal"):
        unseal(b"oomcast-snapshot/1\n{}", key, PARTITION, "x")
    assert unseal(seal(b"blob", key, 1, "x"), (), 1, "x") == b"blob"  # no key: no check
    # sealed under the webhook secret's key alone (before a control secret was added)
    assert unseal(seal(b"blob", key[1:], 1, "x"), key, 1, "x") == b"blob"


def test_a_restored_time_ahead_of_the_clock_starts_the_domain_cold() -> None:
    """``last_oom_ts`` or ``last_seen_wall`` of 1e12 in a snapshot made the service drop
    every real sample of the domain as late, for ever."""
    live = threshold_live()
    run(live, [sample(1.0, 0.5)])
    body = json.loads(live.snapshot(DOMAIN)[len(MAGIC) :])
    for name in ("last_oom_ts", "last_seen_wall", "attested_at"):
        bad = {**body, "scalars": {**body["scalars"], name: 1e12}}
        assert threshold_live().restore(_blob(bad), now=2e9) is None, name
    assert threshold_live().restore(_blob(body), now=2e9) is not None


def test_a_restored_state_is_a_warm_start_not_evidence_for_node_actions() -> None:
    live = threshold_live()
    run(live, [sample(1.0, 0.5)])
    new = threshold_live()
    st = new.restore(live.snapshot(DOMAIN), now=1000.0)
    assert st is not None and st.restored_at == 1000.0
    # the clock starts at this replica's first signed sample, not at the restore
    assert "restored from a snapshot" in (new.why_unattested(st, True, 5000.0) or "")
    new.apply([sample(2.0, 0.5)], 1010.0, None, [True])
    assert st.own_since == 1010.0
    why = new.why_unattested(st, True, 1010.0 + RESTORED_PROBATION_S - 1)
    assert why is not None and "restored from a snapshot" in why
    assert new.why_unattested(st, True, 1010.0 + RESTORED_PROBATION_S) is None
    # what only this replica knows never travels in a blob (None would mean no probation)
    body = json.loads(new.snapshot(DOMAIN)[len(MAGIC) :])
    assert "restored_at" not in body["scalars"] and "own_since" not in body["scalars"]
