"""model/wire.py: Redis key names and the encoding of stream entries."""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
import pytest

from oomcast.model.embedding import EMBEDDING_VERSION, embed
from oomcast.model.schema import Event, Sample, SchemaError
from oomcast.model.wire import (
    ENTRY_VERSION,
    DecodedSample,
    Keys,
    decode_event,
    decode_sample_batch,
    decode_samples,
    encode_event,
    encode_samples,
    sample_payload,
)

T0 = 1_750_000_000.0
GIB = 1 << 30


def smp(ts: float = T0, device: str = "gpu0", used: int = 40 * GIB, **extra: Any) -> Sample:
    return Sample(
        ts=ts,
        node="n1",
        device=device,
        kind="gpu",
        total_bytes=80 * GIB,
        used_bytes=used,
        **extra,
    )


def raw(**over: Any) -> dict[str, Any]:
    obj: dict[str, Any] = smp().to_dict()
    obj.update(over)
    return obj


def entry(objs: Any) -> dict[str, str]:
    return {"v": "1", "node": "n1", "samples": json.dumps(objs)}


# --- Keys ------------------------------------------------------------------------------------


def test_default_key_names_and_hash_tags() -> None:
    keys = Keys()
    assert keys.samples(0) == "oomcast:samples:{0}"
    assert keys.samples(3) == "oomcast:samples:{3}"
    assert keys.all_samples() == [
        "oomcast:samples:{0}",
        "oomcast:samples:{1}",
        "oomcast:samples:{2}",
        "oomcast:samples:{3}",
    ]
    assert keys.events == "oomcast:events"
    assert keys.alerts == "oomcast:alerts"
    assert keys.deadletter == "oomcast:deadletter"
    assert keys.control("node-a") == "oomcast:control:{node-a}"


def test_custom_prefix_and_partitions() -> None:
    keys = Keys("oomcast-test-abc", 2)
    assert keys.all_samples() == ["oomcast-test-abc:samples:{0}", "oomcast-test-abc:samples:{1}"]
    assert keys.events == "oomcast-test-abc:events"
    assert keys.control("n1") == "oomcast-test-abc:control:{n1}"


def test_partition_is_stable_and_pinned() -> None:
    # crc32, not hash(): the same node maps to the same partition in every process and release
    assert Keys().partition_of("node-a") == 3
    assert Keys().partition_of("node-b") == 1
    assert Keys(partitions=16).partition_of("node-a") == 11
    assert Keys().samples_for("node-a") == "oomcast:samples:{3}"
    assert Keys().partition_of("node-a") == Keys().partition_of("node-a")


def test_partition_in_range_and_spread() -> None:
    for parts in (1, 3, 4, 8):
        keys = Keys(partitions=parts)
        seen = {keys.partition_of(f"node-{i}") for i in range(200)}
        assert seen == set(range(parts))
        assert keys.samples_for("x") in keys.all_samples()


@pytest.mark.parametrize("prefix", ["", "a{b", "a}b", "with space", "{0}"])
def test_keys_reject_bad_prefix(prefix: str) -> None:
    with pytest.raises(ValueError, match="prefix"):
        Keys(prefix)


@pytest.mark.parametrize("parts", [0, -1])
def test_keys_reject_bad_partitions(parts: int) -> None:
    with pytest.raises(ValueError, match="partitions"):
        Keys(partitions=parts)


# --- sample entries --------------------------------------------------------------------------


def test_encode_samples_entry_fields() -> None:
    payloads = [sample_payload(smp(), None, None), sample_payload(smp(device="gpu1"), None, None)]
    fields = encode_samples("n1", payloads)
    assert fields["v"] == ENTRY_VERSION
    assert fields["node"] == "n1"
    assert fields["n"] == "2"
    assert all(isinstance(v, str) for v in fields.values())
    assert json.loads(fields["samples"]) == payloads


def test_sample_payload_rounds_emb_and_leaves_it_out_when_none() -> None:
    s = smp(job="j")
    assert sample_payload(s, None, None) == s.to_dict()
    payload = sample_payload(s, [0.1234567891, 1.0], 3, binary=False)
    assert payload["emb"] == [0.123457, 1.0]
    assert payload["emb_v"] == 3
    assert payload["job"] == "j"
    assert "emb_f32" not in payload


def test_sample_payload_sends_the_embedding_as_float32_by_default() -> None:
    emb = [0.1234567891, -1.5, 3e-8]
    payload = sample_payload(smp(), emb, 3)
    assert "emb" not in payload and payload["emb_v"] == 3
    raw_bytes = base64.b64decode(payload["emb_f32"])
    assert np.frombuffer(raw_bytes, "<f4").tolist() == np.asarray(emb, np.float32).tolist()
    (d,) = decode_samples(encode_samples("n1", [payload]))
    assert isinstance(d, DecodedSample) and d.emb_v == 3
    assert d.emb is not None and np.asarray(d.emb).dtype == np.float32
    assert np.asarray(d.emb).tolist() == np.asarray(emb, np.float32).tolist()  # exact


def test_an_entry_may_mix_binary_json_and_missing_embeddings() -> None:
    payloads = [
        sample_payload(smp(), [0.5, 0.25], 1),
        sample_payload(smp(device="gpu1"), [0.75], 1, binary=False),
        sample_payload(smp(device="gpu2"), None, None),
        sample_payload(smp(device="gpu3"), [1.0, 2.0, 3.0], 1),  # another width
    ]
    out = decode_samples(encode_samples("n1", payloads))
    assert [np.asarray(d.emb).tolist() if isinstance(d, DecodedSample) and d.emb is not None
            else None for d in out] == [[0.5, 0.25], [0.75], None, [1.0, 2.0, 3.0]]  # fmt: skip


def f32(*values: float) -> str:
    return base64.b64encode(np.asarray(values, "<f4").tobytes()).decode()


@pytest.mark.parametrize(
    ("emb_f32", "why"),
    [
        (f32(0.5, float("nan")), "finite"),
        (f32(float("inf")), "finite"),
        ("not base64!", "base64"),
        (base64.b64encode(b"abc").decode(), "float32"),
        ("", "float32"),
        (12, "base64 string"),
    ],
)
def test_a_bad_binary_embedding_costs_only_its_own_sample(emb_f32: Any, why: str) -> None:
    good = sample_payload(smp(device="gpu1"), [0.5, 0.5], 1)
    out = decode_samples(entry([good, raw(emb_f32=emb_f32, emb_v=1), good]))
    assert isinstance(out[0], DecodedSample) and isinstance(out[2], DecodedSample)
    assert isinstance(out[1], SchemaError) and out[1].field == "samples[1].emb_f32"
    assert why in out[1].message


def _as_compared(got: Any) -> Any:
    """A decoded entry in plain values, embeddings as lists, errors as their text."""
    if isinstance(got, Exception):
        return ("error", type(got).__name__, str(got))
    return [
        ("error", str(d))
        if isinstance(d, SchemaError)
        else (d.sample, None if d.emb is None else np.asarray(d.emb).tolist(), d.emb_v)
        for d in got
    ]


def _one_by_one(fields: dict[str, str]) -> Any:
    try:
        return decode_samples(fields)
    except Exception as exc:
        return exc


def test_a_batch_decodes_as_its_entries_one_by_one() -> None:
    """The service decodes a whole read at once, with one array for every binary embedding
    in it: each entry must come out as it would alone, a bad embedding or a broken entry
    costing only itself, and embeddings of another width (another schema) among them."""
    wide = sample_payload(smp(device="gpu2"), [0.25, 0.5, 0.75], 1)
    entries = [
        entry([sample_payload(smp(), [0.5, 0.5], 1), raw(emb_f32=f32(float("nan")), emb_v=1)]),
        {"v": "1", "node": "n1", "samples": "not json"},
        entry([sample_payload(smp(device="gpu1"), [1.0, 2.0], 1), raw(emb=[0.1, 0.2], emb_v=1)]),
        entry({"not": "a list"}),
        entry([]),
        entry([wide, raw(emb_f32="not base64!", emb_v=1), "no object"]),
        {"v": "1", "node": "n1"},
    ]
    batch = decode_sample_batch(entries)
    assert [_as_compared(b) for b in batch] == [_as_compared(_one_by_one(e)) for e in entries]
    assert [isinstance(b, Exception) for b in batch] == [
        False,
        True,
        False,
        True,
        False,
        False,
        True,
    ]
    first, third = batch[0], batch[2]
    assert not isinstance(first, Exception) and not isinstance(third, Exception)
    assert isinstance(first[0], DecodedSample) and np.asarray(first[0].emb).tolist() == [0.5, 0.5]
    assert isinstance(first[1], SchemaError) and first[1].field == "samples[1].emb_f32"
    assert isinstance(third[0], DecodedSample) and np.asarray(third[0].emb).tolist() == [1.0, 2.0]
    sixth = batch[5]
    assert not isinstance(sixth, Exception) and isinstance(sixth[0], DecodedSample)
    assert np.asarray(sixth[0].emb).tolist() == [0.25, 0.5, 0.75]
    assert decode_sample_batch([]) == []


def test_a_binary_embedding_needs_its_schema_version() -> None:
    (err,) = decode_samples(entry([raw(emb_f32=f32(0.5), emb_v="4")]))
    assert isinstance(err, SchemaError) and err.field == "samples[0].emb_v"


def test_round_trip_with_embeddings() -> None:
    prev = smp(T0, used=30 * GIB, alloc_retries=1)
    cur = smp(T0 + 1, used=40 * GIB, allocated_bytes=20 * GIB, alloc_retries=4, job="train")
    other = smp(T0 + 1, device="gpu1")
    emb = embed(cur, prev)
    payloads = [
        sample_payload(cur, emb, EMBEDDING_VERSION, binary=False),
        sample_payload(other, None, None),
    ]
    decoded = decode_samples(encode_samples("n1", payloads))
    assert len(decoded) == 2
    first, second = decoded
    assert isinstance(first, DecodedSample)
    assert first.sample == cur
    assert first.emb_v == EMBEDDING_VERSION
    assert first.emb is not None
    assert len(first.emb) == len(emb)
    assert first.emb == pytest.approx(emb, abs=1e-6)
    assert all(isinstance(x, float) for x in first.emb)
    assert isinstance(second, DecodedSample)
    assert second.sample == other
    assert second.emb is None
    assert second.emb_v is None


def test_integer_emb_values_come_back_as_floats() -> None:
    (d,) = decode_samples(entry([raw(emb=[0, 1, 2], emb_v=1)]))
    assert isinstance(d, DecodedSample)
    assert d.emb == [0.0, 1.0, 2.0]
    assert all(type(x) is float for x in d.emb)


def test_bytes_field_names_and_values_are_accepted() -> None:
    payload = sample_payload(smp(), [0.5], 1, binary=False)
    text = encode_samples("n1", [payload])
    as_bytes = {k.encode(): v.encode() for k, v in text.items()}
    (d,) = decode_samples(as_bytes)
    assert isinstance(d, DecodedSample)
    assert d.sample == smp()
    assert d.emb == [0.5]
    ev = Event(ts=T0, node="n1", device="gpu0", event="oom")
    assert decode_event({k.encode(): v.encode() for k, v in encode_event(ev).items()}) == ev


def test_bad_sample_comes_back_as_schema_error_in_place() -> None:
    good0 = raw()
    bad = raw(ts=T0 + 1, total_bytes=-1)
    good2 = raw(ts=T0 + 2, device="gpu1")
    out = decode_samples(entry([good0, bad, good2]))
    assert len(out) == 3
    assert isinstance(out[0], DecodedSample)
    assert out[0].sample.ts == T0
    assert isinstance(out[1], SchemaError)
    assert out[1].field == "samples[1].total_bytes"
    assert str(out[1]).startswith("samples[1].total_bytes: ")
    assert isinstance(out[2], DecodedSample)
    assert out[2].sample.device == "gpu1"


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        (raw(kind="tpu"), "samples[0].kind"),
        ({k: v for k, v in raw().items() if k != "node"}, "samples[0].node"),
        (raw(used_bytes=1.5), "samples[0].used_bytes"),
        (raw(emb="0.1,0.2", emb_v=1), "samples[0].emb"),
        (raw(emb=[0.1, True], emb_v=1), "samples[0].emb"),
        (raw(emb=[0.1], emb_v=None), "samples[0].emb_v"),
        (raw(emb=[0.1], emb_v="1"), "samples[0].emb_v"),
        (raw(emb=[0.1], emb_v=True), "samples[0].emb_v"),
        (["not", "an", "object"], "samples[0]"),
        (7, "samples[0]"),
    ],
)
def test_bad_sample_field_is_named(obj: Any, field: str) -> None:
    (err,) = decode_samples(entry([obj]))
    assert isinstance(err, SchemaError)
    assert err.field == field


def test_emb_v_without_emb_is_ignored() -> None:
    (d,) = decode_samples(entry([raw(emb_v=1)]))
    assert isinstance(d, DecodedSample)
    assert d.emb is None
    assert d.emb_v is None


def test_events_are_not_samples() -> None:
    (err,) = decode_samples(entry([{"ts": T0, "node": "n1", "device": "gpu0", "event": "oom"}]))
    assert isinstance(err, SchemaError)
    assert err.field.startswith("samples[0].")


def test_empty_list_decodes_to_nothing() -> None:
    assert decode_samples(entry([])) == []


@pytest.mark.parametrize(
    "fields",
    [
        {"v": "1", "node": "n1"},
        {"v": "1", "node": "n1", "samples": "[{"},
        {"v": "1", "node": "n1", "samples": '{"ts": 1}'},
        {"v": "1", "node": "n1", "samples": '"samples"'},
        {"v": "1", "node": "n1", "samples": "null"},
        {b"samples": b"\xff\xfe"},
    ],
)
def test_broken_entry_raises(fields: dict[Any, Any]) -> None:
    with pytest.raises(SchemaError) as info:
        decode_samples(fields)
    assert info.value.field == "samples"


def test_broken_entry_messages() -> None:
    with pytest.raises(SchemaError, match="no 'samples' field"):
        decode_samples({})
    with pytest.raises(SchemaError, match="not valid JSON"):
        decode_samples({"samples": "nope"})
    with pytest.raises(SchemaError, match="list"):
        decode_samples({"samples": "{}"})


def test_huge_integer_in_one_sample_does_not_sink_the_entry() -> None:
    good = json.dumps(raw())
    bad = json.dumps(raw()).replace(f'"total_bytes": {80 * GIB}', '"total_bytes": 1' + "0" * 400)
    assert bad != json.dumps(raw())
    out = decode_samples({"samples": f"[{good},{bad}]"})
    assert isinstance(out[0], DecodedSample)
    assert isinstance(out[1], SchemaError)


# --- events ----------------------------------------------------------------------------------


def test_event_round_trip() -> None:
    ev = Event(ts=T0, node="n1", device="gpu0", event="oom", job="train")
    fields = encode_event(ev)
    assert fields["v"] == ENTRY_VERSION
    assert json.loads(fields["event"]) == ev.to_dict()
    assert decode_event(fields) == ev


@pytest.mark.parametrize(
    ("fields", "field", "match"),
    [
        ({"v": "1"}, "event", "no 'event' field"),
        ({"event": "{"}, "event", "not valid JSON"),
        ({"event": "[1]"}, "event", "JSON object"),
        ({"event": '"oom"'}, "event", "JSON object"),
        ({"event": json.dumps({"ts": T0, "node": "n", "device": "d"})}, "event", "non-empty"),
        ({"event": json.dumps({"node": "n", "device": "d", "event": "oom"})}, "ts", "required"),
        ({"event": json.dumps({"ts": T0, "device": "d", "event": "oom"})}, "node", "required"),
        ({b"event": b"\xff"}, "event", "UTF-8"),
    ],
)
def test_decode_event_errors(fields: dict[Any, Any], field: str, match: str) -> None:
    with pytest.raises(SchemaError, match=match) as info:
        decode_event(fields)
    assert info.value.field == field


def test_a_sample_stream_names_its_partition_and_nothing_else_does() -> None:
    keys = Keys("t", 4)
    assert [keys.partition_of_stream(keys.samples(p)) for p in range(4)] == [0, 1, 2, 3]
    for other in ("t:samples:{4}", "t:samples:{x}", "t:samples:{1", "u:samples:{1}", keys.events):
        assert keys.partition_of_stream(other) is None


# --- step, phase and the schedule event -------------------------------------------------------


def test_step_and_phase_travel_in_a_sample_entry() -> None:
    sample = smp(step=40, phase="eval")
    got = decode_samples(encode_samples("n1", [sample_payload(sample, None, None)]))
    assert isinstance(got[0], DecodedSample) and got[0].sample == sample
    assert (got[0].sample.step, got[0].sample.phase) == (40, "eval")


def test_a_bad_phase_in_an_entry_costs_only_its_sample_and_names_the_field() -> None:
    got = decode_samples(entry([raw(phase="training"), raw(ts=T0 + 1, step=2)]))
    assert isinstance(got[0], SchemaError) and got[0].field == "samples[0].phase"
    assert isinstance(got[1], DecodedSample) and got[1].sample.step == 2


def test_a_schedule_event_travels_with_its_fields() -> None:
    from oomcast.model.events import ScheduleEvent

    ev = ScheduleEvent(
        T0,
        "n1",
        "cuda0",
        "schedule",
        "j",
        eval_every_steps=500,
        checkpoint_every_steps=1000,
        step_s=0.8,
        phase_extra_bytes={"eval": 3 * GIB, "checkpoint": GIB},
        measured=("eval",),
    )
    back = decode_event(encode_event(ev))
    assert back == ev and isinstance(back, ScheduleEvent)
    # the hook queues it as a DetailedEvent: the same bytes on the wire
    assert encode_event(ev.to_detailed()) == encode_event(ev)


def test_a_bad_schedule_event_names_the_field() -> None:
    fields = {"v": "1", "event": json.dumps({"ts": T0, "node": "n1", "device": "d"} | {
        "event": "schedule", "eval_every_steps": 0, "phase_extra_bytes": {}})}  # fmt: skip
    with pytest.raises(SchemaError) as err:
        decode_event(fields)
    assert err.value.field == "eval_every_steps"
