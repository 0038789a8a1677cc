"""Input bounds at ingest: a sample far from the clock, an oversized or control-laden name, a
non-finite number, a bogus newest sample, and unsigned samples for a domain whose node signs
its own. Each is refused with a reason code, and none blinds its domain."""

from __future__ import annotations

import json
from typing import Any

import pytest
from support import sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.model.control import node_key, node_keys
from oomcast.model.schema import MAX_NAME_CHARS
from oomcast.model.wire import Keys, encode_samples, sample_payload
from oomcast.service.pipeline.actions import Dispatcher
from oomcast.service.pipeline.decode import decode_sample_entries
from oomcast.service.pipeline.rules import Rule
from oomcast.service.pipeline.state import LiveState

NOW = 1_800_000_000.0
NOW_MS = int(NOW * 1000) + 500  # the service reads half a second after the entries arrive
STREAM = "t:samples:{0}"


def entry(
    samples: list[dict[str, Any]], *, node: str = "n1", key: str | None = None, at: float = NOW
) -> tuple[str, dict[str, str]]:
    """A stream entry as Redis hands it back: an id stamped ``at`` (its arrival), and fields."""
    return f"{int(at * 1000)}-0", encode_samples(node, samples, key)


def raw(ts: float, frac: float = 0.5, **kw: Any) -> dict[str, Any]:
    return sample_payload(sample(ts, frac, **kw), None, None)


def test_a_sample_far_from_its_arrival_is_dead_lettered_with_its_reason() -> None:
    entries = [entry([raw(NOW), raw(1e300), raw(NOW - 3600), raw(NOW + 299)])]
    out = decode_sample_entries(STREAM, entries, None, max_skew_s=300, now_ms=NOW_MS)
    assert [s.ts for s in out.samples] == [NOW, NOW + 299]
    assert [dl["code"] for dl in out.deadletters] == ["ts_skew", "ts_skew"]
    assert "ahead of" in str(out.deadletters[0]["reason"])
    assert "behind" in str(out.deadletters[1]["reason"])
    assert json.loads(out.deadletters[0]["sample"])["ts"] == 1e300  # kept as it came
    # 0 turns the bound off (old traces replayed with their own stamps)
    assert len(decode_sample_entries(STREAM, entries, None, now_ms=NOW_MS).samples) == 4


@pytest.mark.parametrize(
    "field, value",
    [
        ("device", "g" * (MAX_NAME_CHARS + 1)),
        ("node", "n" * (MAX_NAME_CHARS + 1)),
        ("job", "j" * (MAX_NAME_CHARS + 1)),
        ("device", "gpu0\nFAKE LOG LINE"),
    ],
)
def test_names_too_long_or_with_control_characters_are_refused(field: str, value: str) -> None:
    bad = raw(NOW + 1)
    bad[field] = value
    out = decode_sample_entries(
        STREAM, [entry([raw(NOW), bad])], None, max_skew_s=300, now_ms=NOW_MS
    )
    assert len(out.samples) == 1  # its neighbour in the entry is kept
    assert [dl["code"] for dl in out.deadletters] == ["schema"]
    assert field in str(out.deadletters[0]["reason"])


@pytest.mark.parametrize(
    "text", ['"ts": NaN', '"ts": Infinity', '"used_bytes": NaN', '"total_bytes": -Infinity']
)
def test_non_finite_numbers_are_refused(text: str) -> None:
    key = text.split(":")[0].strip('"')
    obj = raw(NOW)
    obj.pop(key)
    body = json.dumps([obj])[:-2] + ", " + text + "}]"
    fields = {"v": "1", "node": "n1", "n": "1", "samples": body}
    out = decode_sample_entries(
        STREAM, [(f"{int(NOW * 1000)}-0", fields)], None, max_skew_s=300, now_ms=NOW_MS
    )
    assert out.samples == []
    assert [dl["code"] for dl in out.deadletters] == ["schema"]
    assert key in str(out.deadletters[0]["reason"])


def live(**kw: Any) -> LiveState:
    rule = Rule(
        "r", ("webhook", "shed"), fire_after=1, resolve_after=1, horizon_s=60, fire_risk=0.5
    )
    return LiveState(ThresholdBaseline(0.9), [rule], horizon_s=60, **kw)


def test_a_bogus_newest_sample_blinds_its_domain_for_at_most_resync_after_samples() -> None:
    state = live(resync_after=3)
    state.apply([sample(NOW, 0.5)], NOW)
    state.apply([sample(NOW + 290, 0.5)], NOW)  # within the skew bound, but bogus
    codes = []
    for i in range(1, 6):
        applied = state.apply([sample(NOW + i, 0.5 + i / 100)], NOW + i)
        codes += [r.code for r in applied.rejected]
        if i == 3:
            assert applied.clock_resets == 1
            assert len(applied.forecasts) == 1  # the third in a row starts a new history
    assert codes == ["out_of_order", "out_of_order"]
    st = state.domains[("n1", "gpu0")]
    assert st.last is not None and st.last.ts == NOW + 5


def test_samples_out_of_order_among_themselves_do_not_reset_the_domain() -> None:
    state = live(resync_after=3)
    state.apply([sample(NOW + 100, 0.5)], NOW)
    resets = 0
    for ts in (NOW + 5, NOW + 3, NOW + 4, NOW + 2, NOW + 1):  # behind, but not a timeline
        resets += state.apply([sample(ts, 0.5)], NOW).clock_resets
    assert resets == 0


def test_unsigned_samples_are_refused_for_a_domain_whose_node_signs_its_own() -> None:
    state = live()
    assert not state.apply([sample(NOW, 0.5)], NOW, attested=[True]).rejected
    forged = state.apply([sample(NOW + 1, 0.99)], NOW + 1, attested=[False])
    assert [r.code for r in forged.rejected] == ["unattested"]
    assert not state.apply([sample(NOW + 2, 0.5)], NOW + 2, attested=[True]).rejected
    # a domain nobody signs for (HTTP clients only) takes unsigned samples
    assert not state.apply([sample(NOW, 0.5, device="gpu1")], NOW).rejected


def test_the_signature_must_be_the_samples_own_node() -> None:
    master = "m" * 32
    good = entry([raw(NOW)], key=node_key(master, "n1"))
    forged = entry([raw(NOW)], key="not-the-key")
    other = entry([raw(NOW, node="n2")], node="n1", key=node_key(master, "n1"))  # n1 signs n2's
    unsigned = entry([raw(NOW)])
    keys = node_keys(master)
    flags = [
        decode_sample_entries(STREAM, [e], None, key_for_node=keys, now_ms=NOW_MS).attested
        for e in (good, forged, other, unsigned)
    ]
    assert flags == [[True], [False], [False], [False]]


def test_node_actions_need_every_recent_sample_signed() -> None:
    """A forecast fed by unsigned samples (HTTP, forged) alerts, but sends no node command."""
    dispatcher = Dispatcher(Keys("t"), live().rules, control_secret="s" * 32)
    state = live(attest_window_s=600)

    def shed_outcome(attested: bool, ts: float, device: str = "gpu0") -> Any:
        applied = state.apply([sample(ts, 0.95, device=device)], ts, attested=[attested])
        (alert,) = [a for a in applied.alerts if a.status == "firing"]
        done = dispatcher.dispatch(alert, ts)
        return done.record["dispatched"]["shed"], done.commands, done.record["attested"]

    outcome, commands, attested = shed_outcome(False, NOW, "http-gpu")
    assert str(outcome).startswith("refused") and commands == () and attested is False
    outcome, commands, attested = shed_outcome(True, NOW, "signed-gpu")
    assert isinstance(outcome, dict) and len(commands) == 1 and attested is True
    assert outcome["command_id"]


def test_http_samples_far_from_the_clock_are_refused_whole(redis_url: str, key_prefix: str) -> None:
    """Over HTTP the same bound is a 422 naming the sample, before anything is accepted."""
    import time

    from fastapi.testclient import TestClient

    from oomcast.service.main import create_app
    from oomcast.service.settings import Settings

    s = Settings(redis_url=redis_url, key_prefix=key_prefix, forecaster="threshold_0.90")
    now = time.time()
    with TestClient(create_app(s)) as c:
        body = {"samples": [raw(now), raw(now + 1), raw(1e300)]}
        resp = c.post("/v1/samples", json=body)
        assert resp.status_code == 422
        detail = resp.json()["detail"][0]
        assert detail["loc"] == ["body", "samples", 2, "ts"]
        assert "OOMCAST_MAX_TS_SKEW_S" in detail["msg"]
        assert c.post("/v1/samples", json={"samples": [raw(now)]}).status_code == 202


def test_an_entry_id_in_the_future_does_not_make_later_entries_look_skewed() -> None:
    """A writer may choose an entry id; Redis then stamps every later entry after it. The
    arrival of an entry is never later than the service's own clock."""
    future_id = f"{int((NOW + 10**6) * 1000)}-0"
    entries = [
        (future_id, encode_samples("n1", [raw(NOW)])),
        (f"{int((NOW + 10**6) * 1000)}-1", encode_samples("n1", [raw(NOW + 1)])),
    ]
    out = decode_sample_entries(STREAM, entries, None, max_skew_s=300, now_ms=NOW_MS)
    assert [s.ts for s in out.samples] == [NOW, NOW + 1]
    assert out.arrived_ms == [NOW_MS, NOW_MS]


def test_a_sample_in_another_partitions_stream_is_dead_lettered() -> None:
    keys = Keys("t", 4)
    home = keys.partition_of("n1")
    wrong = keys.samples((home + 1) % 4)
    out = decode_sample_entries(wrong, [entry([raw(NOW)])], None, keys=keys, now_ms=NOW_MS)
    assert out.samples == [] and [dl["code"] for dl in out.deadletters] == ["wrong_partition"]
    right = decode_sample_entries(keys.samples(home), [entry([raw(NOW)])], None, keys=keys)
    assert len(right.samples) == 1


def test_an_oversized_entry_is_dead_lettered_unparsed_and_kept_truncated() -> None:
    from oomcast.service.pipeline.decode import MAX_ENTRY_BYTES, MAX_KEPT_BYTES

    fields = {"v": "1", "node": "n1", "n": "1", "samples": "[" + " " * MAX_ENTRY_BYTES + "]"}
    out = decode_sample_entries(STREAM, [(f"{int(NOW * 1000)}-0", fields)], None, now_ms=NOW_MS)
    (dl,) = out.deadletters
    assert dl["code"] == "undecodable" and "limit" in str(dl["reason"])
    assert len(dl["orig.samples"]) == MAX_KEPT_BYTES
    assert dl["orig.samples.truncated_from"] == str(MAX_ENTRY_BYTES + 2)


def test_an_event_far_from_its_arrival_is_dead_lettered() -> None:
    from oomcast.model.schema import Event
    from oomcast.model.wire import encode_event
    from oomcast.service.pipeline.decode import decode_event_entries

    keys = Keys("t", 1)
    forged = encode_event(Event(ts=1e300, node="n1", device="gpu0", event="oom"))
    real = encode_event(Event(ts=NOW, node="n1", device="gpu0", event="oom"))
    eid = f"{int(NOW * 1000)}-0"
    out = decode_event_entries(
        keys.events, [(eid, forged), (eid, real)], keys, [0], max_skew_s=300, now_ms=NOW_MS
    )
    assert [e.ts for e, _ in out.events] == [NOW]
    assert [dl["code"] for dl in out.deadletters] == ["ts_skew"]


def test_an_oom_stamped_after_its_arrival_blinds_its_domain_to_nothing_after_it() -> None:
    """The reported attack: one XADD of an ``oom`` for another node's domain, stamped
    now + 295 s (inside the skew allowed), made the domain drop its real samples as the dead
    job's for 295 s. The event is taken as of its arrival; the samples after it count."""
    from oomcast.model.schema import Event
    from oomcast.model.wire import encode_event
    from oomcast.service.pipeline.decode import decode_event_entries

    keys = Keys("t", 1)
    forged = encode_event(Event(ts=NOW + 295, node="n1", device="gpu0", event="oom"))
    eid = f"{int(NOW * 1000)}-0"
    out = decode_event_entries(keys.events, [(eid, forged)], keys, [0], max_skew_s=300,
                               now_ms=NOW_MS)  # fmt: skip
    [(event, _)] = out.events
    assert event.ts == NOW and not out.deadletters
    state = live()
    state.apply([sample(NOW - 1, 0.5)], NOW)
    state.on_event(event, NOW + 0.5)
    late = sum(state.apply([sample(NOW + i, 0.5)], NOW + i).late for i in range(1, 11))
    assert late == 0 and state.domains[("n1", "gpu0")].samples_seen == 11
    # an OOM stamped before its arrival keeps its time: the dead job's samples read after
    # the event are still dropped
    real = encode_event(Event(ts=NOW + 20, node="n1", device="gpu0", event="oom"))
    [(event, _)] = decode_event_entries(
        keys.events,
        [(f"{int((NOW + 21) * 1000)}-0", real)],
        keys,
        [0],
        max_skew_s=300,
        now_ms=NOW_MS + 21_000,
    ).events
    assert event.ts == NOW + 20  # fmt: skip
    state.on_event(event, NOW + 21)
    assert state.apply([sample(NOW + 19, 0.5)], NOW + 21.5).late == 1


def test_old_samples_read_again_never_reset_a_domain() -> None:
    """After a takeover the new owner re-reads a batch older than the history its snapshot
    kept: those samples are refused as out of order, and the domain keeps its state."""
    state = live(resync_after=3)
    for i in range(5):
        state.apply([sample(NOW + i, 0.5)], NOW + 5)
    resets = 0
    for i in range(5):  # the same five again, as if the snapshot kept none of them
        st = state.domains[("n1", "gpu0")]
        st.history.clear()
        resets += state.apply([sample(NOW + i, 0.5)], NOW + 6).clock_resets
    assert resets == 0
    assert state.domains[("n1", "gpu0")].samples_seen == 5
