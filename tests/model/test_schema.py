"""model/schema.py: parsing samples and events, the errors that name the field, OrderChecker."""

from __future__ import annotations

import math
from typing import Any

import pytest

from oomcast.model.processes import ProcessUse
from oomcast.model.schema import (
    SANITY_FACTOR,
    Event,
    OrderChecker,
    Sample,
    SchemaError,
    parse_event,
    parse_record,
    parse_sample,
)

T0 = 1_750_000_000.0
GIB = 1 << 30


def raw_sample(**over: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {
        "ts": T0,
        "node": "n1",
        "device": "gpu0",
        "kind": "gpu",
        "total_bytes": 80 * GIB,
        "used_bytes": 40 * GIB,
    }
    obj.update(over)
    return obj


def without(obj: dict[str, Any], key: str) -> dict[str, Any]:
    return {k: v for k, v in obj.items() if k != key}


def field_of(obj: Any) -> str:
    with pytest.raises(SchemaError) as info:
        parse_record(obj)
    return info.value.field


# --- valid records ---------------------------------------------------------------------------


def test_valid_sample_parses_every_field() -> None:
    obj = raw_sample(
        allocated_bytes=30 * GIB,
        reserved_bytes=35 * GIB,
        peak_bytes=41 * GIB,
        alloc_retries=3,
        job="train-1",
    )
    rec = parse_record(obj)
    assert isinstance(rec, Sample)
    assert rec == Sample(
        ts=T0,
        node="n1",
        device="gpu0",
        kind="gpu",
        total_bytes=80 * GIB,
        used_bytes=40 * GIB,
        allocated_bytes=30 * GIB,
        reserved_bytes=35 * GIB,
        peak_bytes=41 * GIB,
        alloc_retries=3,
        job="train-1",
    )
    assert rec.domain == ("n1", "gpu0")
    assert rec.used_frac == 0.5
    assert rec.to_dict() == obj


def test_sample_optional_fields_default_to_none_and_are_left_out_of_to_dict() -> None:
    rec = parse_sample(raw_sample(kind="host", device="cgroup:/kubepods/pod1"))
    assert rec.kind == "host"
    assert rec.allocated_bytes is None
    assert rec.reserved_bytes is None
    assert rec.peak_bytes is None
    assert rec.alloc_retries is None
    assert rec.job is None
    assert set(rec.to_dict()) == {"ts", "node", "device", "kind", "total_bytes", "used_bytes"}


def test_a_sample_is_a_value_equal_and_hashed_by_its_fields() -> None:
    """Samples are values (``record``): equal by field, hashable (they key sets), slotted,
    and ``dataclasses.replace`` makes a new one; not frozen at run time, for speed, but
    mypy refuses assignments to their fields."""
    import dataclasses

    a = parse_sample(raw_sample(job="j1", step=3))
    b = parse_sample(raw_sample(job="j1", step=3))
    assert a == b and hash(a) == hash(b) and len({a, b}) == 1
    c = dataclasses.replace(a, ts=T0 + 1)
    assert c != a and c.ts == T0 + 1 and a.ts == T0 and len({a, b, c}) == 2
    assert not hasattr(a, "__dict__")  # slotted: no per-sample dict
    assert [f.name for f in dataclasses.fields(Sample)][:6] == [
        "ts",
        "node",
        "device",
        "kind",
        "total_bytes",
        "used_bytes",
    ]


def test_integer_ts_is_accepted_as_float() -> None:
    rec = parse_sample(raw_sample(ts=1_750_000_000))
    assert isinstance(rec.ts, float)
    assert rec.ts == 1_750_000_000.0


def test_valid_event_parses() -> None:
    rec = parse_record({"ts": T0, "node": "n1", "device": "gpu0", "event": "oom", "job": "j"})
    assert rec == Event(ts=T0, node="n1", device="gpu0", event="oom", job="j")
    assert rec.domain == ("n1", "gpu0")
    assert rec.to_dict() == {"ts": T0, "node": "n1", "device": "gpu0", "event": "oom", "job": "j"}


def test_other_event_names_are_accepted() -> None:
    rec = parse_event({"ts": T0, "node": "n1", "device": "gpu0", "event": "checkpoint_done"})
    assert rec.event == "checkpoint_done"
    assert rec.job is None


def test_unknown_keys_are_ignored() -> None:
    rec = parse_record(raw_sample(temperature_c=71, emb=[0.1, 0.2], emb_v=1, extra={"a": 1}))
    assert isinstance(rec, Sample)
    assert "temperature_c" not in rec.to_dict()
    assert rec.used_bytes == 40 * GIB
    ev = parse_record({"ts": T0, "node": "n", "device": "d", "event": "oom", "why": "fragmented"})
    assert isinstance(ev, Event)
    assert "why" not in ev.to_dict()


def test_whole_floats_are_accepted_as_ints() -> None:
    rec = parse_sample(raw_sample(total_bytes=8.0e10, used_bytes=1.6e10, alloc_retries=2.0))
    assert rec.total_bytes == 80_000_000_000
    assert isinstance(rec.total_bytes, int)
    assert rec.used_bytes == 16_000_000_000
    assert isinstance(rec.used_bytes, int)
    assert rec.alloc_retries == 2
    assert isinstance(rec.alloc_retries, int)


def test_null_optional_fields_read_as_missing() -> None:
    rec = parse_sample(raw_sample(allocated_bytes=None, alloc_retries=None, job=None))
    assert rec.allocated_bytes is None
    assert rec.alloc_retries is None
    assert rec.job is None


# --- errors naming the field -----------------------------------------------------------------


def test_missing_total_bytes_names_the_field() -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(without(raw_sample(), "total_bytes"))
    assert info.value.field == "total_bytes"
    assert str(info.value).startswith("total_bytes:")
    assert "required" in str(info.value)


def test_missing_used_bytes_names_the_field() -> None:
    assert field_of(without(raw_sample(), "used_bytes")) == "used_bytes"


def test_negative_total_bytes_names_the_field() -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(total_bytes=-1))
    assert info.value.field == "total_bytes"
    assert "negative" in info.value.message


@pytest.mark.parametrize("key", ["used_bytes", "allocated_bytes", "peak_bytes", "alloc_retries"])
def test_negative_counts_name_the_field(key: str) -> None:
    assert field_of(raw_sample(**{key: -5})) == key


def test_zero_total_bytes_names_the_field() -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(total_bytes=0, used_bytes=0))
    assert info.value.field == "total_bytes"
    assert "positive" in info.value.message


def test_used_bytes_above_the_sanity_bound_names_the_field() -> None:
    total = 1000
    bound = int(SANITY_FACTOR * total)
    ok = parse_sample(raw_sample(total_bytes=total, used_bytes=bound))  # at the bound: allowed
    assert ok.used_bytes == 2000
    with pytest.raises(SchemaError) as info:
        parse_sample(raw_sample(total_bytes=total, used_bytes=bound + 1))
    assert info.value.field == "used_bytes"
    assert "total_bytes" in info.value.message


def test_used_bytes_a_little_above_total_is_allowed() -> None:
    # a cgroup overshoots its limit before reclaim
    rec = parse_sample(raw_sample(total_bytes=1000, used_bytes=1100))
    assert rec.used_frac == pytest.approx(1.1)


@pytest.mark.parametrize("key", ["allocated_bytes", "reserved_bytes", "peak_bytes"])
def test_optional_byte_fields_above_the_sanity_bound_name_the_field(key: str) -> None:
    assert field_of(raw_sample(total_bytes=1000, used_bytes=10, **{key: 2001})) == key
    ok = parse_sample(raw_sample(total_bytes=1000, used_bytes=10, **{key: 2000}))
    assert getattr(ok, key) == 2000


@pytest.mark.parametrize(
    "key", ["ts", "total_bytes", "used_bytes", "allocated_bytes", "reserved_bytes", "alloc_retries"]
)
@pytest.mark.parametrize("value", [True, False])
def test_bool_values_name_the_field(key: str, value: bool) -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(**{key: value}))
    assert info.value.field == key


@pytest.mark.parametrize("key", ["total_bytes", "used_bytes", "peak_bytes", "alloc_retries"])
def test_non_integral_floats_name_the_field(key: str) -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(**{key: 1234.5}))
    assert info.value.field == key
    assert "whole number" in info.value.message


@pytest.mark.parametrize("key", ["total_bytes", "used_bytes"])
@pytest.mark.parametrize("value", ["100", [100], None])
def test_non_numbers_name_the_field(key: str, value: Any) -> None:
    assert field_of(raw_sample(**{key: value})) == key


@pytest.mark.parametrize("value", [math.inf, math.nan])
def test_non_finite_counts_name_the_field(value: float) -> None:
    assert field_of(raw_sample(used_bytes=value)) == "used_bytes"


@pytest.mark.parametrize("kind", ["cpu", "GPU", "", None, 1])
def test_bad_kind_names_the_field(kind: Any) -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(kind=kind))
    assert info.value.field == "kind"
    assert "gpu" in info.value.message
    assert "host" in info.value.message


def test_missing_kind_names_the_field() -> None:
    assert field_of(without(raw_sample(), "kind")) == "kind"


@pytest.mark.parametrize("key", ["node", "device"])
def test_missing_node_or_device_names_the_field(key: str) -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(without(raw_sample(), key))
    assert info.value.field == key
    assert "required" in info.value.message


@pytest.mark.parametrize("value", ["", "   ", 7, None])
def test_empty_or_non_string_node_names_the_field(value: Any) -> None:
    assert field_of(raw_sample(node=value)) == "node"


@pytest.mark.parametrize("ts", [math.inf, -math.inf, math.nan, 0, -1.0, "1750000000"])
def test_bad_ts_names_the_field(ts: Any) -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(ts=ts))
    assert info.value.field == "ts"


def test_missing_ts_names_the_field() -> None:
    assert field_of(without(raw_sample(), "ts")) == "ts"


def test_non_string_job_names_the_field() -> None:
    assert field_of(raw_sample(job=5)) == "job"


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ({"node": "n", "device": "d", "event": "oom"}, "ts"),
        ({"ts": math.nan, "node": "n", "device": "d", "event": "oom"}, "ts"),
        ({"ts": T0, "device": "d", "event": "oom"}, "node"),
        ({"ts": T0, "node": "n", "event": "oom"}, "device"),
        ({"ts": T0, "node": "n", "device": "d", "event": ""}, "event"),
        ({"ts": T0, "node": "n", "device": "d", "event": 3}, "event"),
        ({"ts": T0, "node": "n", "device": "d", "event": "oom", "job": 1}, "job"),
    ],
)
def test_event_errors_name_the_field(obj: dict[str, Any], field: str) -> None:
    assert field_of(obj) == field


@pytest.mark.parametrize("obj", [[1, 2], "sample", 3, None])
def test_non_object_record_is_refused(obj: Any) -> None:
    with pytest.raises(SchemaError) as info:
        parse_record(obj)
    assert info.value.field == ""
    assert "JSON object" in str(info.value)


def test_schema_error_is_a_value_error() -> None:
    with pytest.raises(ValueError, match=r"^total_bytes: "):
        parse_record(raw_sample(total_bytes=-3))


@pytest.mark.parametrize("key", ["ts", "total_bytes"])
def test_huge_integer_is_a_schema_error(key: str) -> None:
    # json.loads('{"total_bytes": 1000...0}') with 400 digits gives exactly this int
    with pytest.raises(SchemaError) as info:
        parse_record(raw_sample(**{key: 10**400}))
    assert info.value.field == key


# --- OrderChecker ----------------------------------------------------------------------------


def s(ts: float, node: str = "n1", device: str = "gpu0") -> Sample:
    return parse_sample(raw_sample(ts=ts, node=node, device=device))


def test_order_checker_accepts_increasing_ts() -> None:
    order = OrderChecker()
    for ts in (T0, T0 + 0.001, T0 + 1, T0 + 100):
        order.accept(s(ts))


@pytest.mark.parametrize("later", [T0, T0 - 0.5])
def test_order_checker_refuses_equal_or_older_ts_in_a_domain(later: float) -> None:
    order = OrderChecker()
    order.accept(s(T0))
    with pytest.raises(SchemaError) as info:
        order.accept(s(later))
    assert info.value.field == "ts"
    assert "n1/gpu0" in info.value.message


def test_order_checker_allows_other_domains_at_any_ts() -> None:
    order = OrderChecker()
    order.accept(s(T0 + 10, device="gpu0"))
    order.accept(s(T0 + 10, device="gpu1"))  # same ts, other device
    order.accept(s(T0 + 5, device="gpu2"))  # older ts, other device
    order.accept(s(T0 + 5, node="n2", device="gpu0"))  # same device name on another node
    with pytest.raises(SchemaError):
        order.accept(s(T0 + 9, device="gpu1"))


def test_order_checker_check_does_not_record() -> None:
    order = OrderChecker()
    order.accept(s(T0 + 10))
    order.check(s(T0 + 20))  # only checks
    order.accept(s(T0 + 15))  # still after T0 + 10, so accepted
    with pytest.raises(SchemaError):
        order.check(s(T0 + 15))


def test_rejected_sample_does_not_move_the_domain_clock() -> None:
    order = OrderChecker()
    order.accept(s(T0 + 10))
    with pytest.raises(SchemaError):
        order.accept(s(T0 + 1))
    order.accept(s(T0 + 11))


def test_to_dict_writes_every_field_of_a_sample_in_declaration_order() -> None:
    """to_dict is written out by hand (the agent calls it per sample): a field added to
    Sample must not be left out of traces and streams."""
    import dataclasses

    full = Sample(
        1.0, "n", "d", "gpu", 10, 5,
        allocated_bytes=1, reserved_bytes=2, peak_bytes=3, alloc_retries=4, job="j",
        step=6, phase="eval", processes=(ProcessUse(7, 3, "j"),),
    )  # fmt: skip
    assert list(full.to_dict()) == [f.name for f in dataclasses.fields(Sample)]
    as_data = dataclasses.asdict(full)
    as_data["processes"] = list(as_data["processes"])  # a list of objects in JSON
    assert full.to_dict() == as_data


# --- the fast path of parse_sample takes exactly what the field-by-field checks take --------

from hypothesis import given  # noqa: E402
from hypothesis import settings as hsettings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from oomcast.model.schema import (  # noqa: E402
    MAX_COUNT,
    _checked_sample,
    _fast_sample,
)

_NAMES = st.one_of(
    st.sampled_from(["n1", "gpu0", "cgroup:/kubepods/x", "", " ", "\t", "a\nb", "\x85", "é"]),
    st.text(max_size=8),
    st.text(min_size=510, max_size=514, alphabet="ab"),  # around the length limit
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=1),
)
_COUNTS = st.one_of(
    st.integers(min_value=-2, max_value=3),
    st.sampled_from([0, 10, 2**40, MAX_COUNT, MAX_COUNT + 1, 2**70]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.booleans(),
    st.none(),
    st.text(max_size=2),
)
_TS = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True),
    st.integers(min_value=-1, max_value=2),
    st.sampled_from([1.7e9, 1e308, -0.0, 0.0]),
    st.booleans(),
    st.none(),
)


@st.composite
def _objects(draw: st.DrawFn) -> dict[str, object]:
    fields = {
        "ts": _TS,
        "node": _NAMES,
        "device": _NAMES,
        "kind": st.sampled_from(["gpu", "host", "tpu", 1, None]),
        "total_bytes": _COUNTS,
        "used_bytes": _COUNTS,
        "allocated_bytes": _COUNTS,
        "reserved_bytes": _COUNTS,
        "peak_bytes": _COUNTS,
        "alloc_retries": _COUNTS,
        "job": _NAMES,
        "step": _COUNTS,
        "phase": st.sampled_from(["eval", "optimizer", "other", "train", "", 1, None, ["eval"]]),
    }
    # a sample as an agent writes it, with one to three fields drawn from the odd values
    # above or left out: near misses, which is where a fast path goes wrong
    obj = {"ts": 1.7e9, "node": "n1", "device": "gpu0", "kind": "gpu", "total_bytes": 100}
    obj |= {"used_bytes": 50, "allocated_bytes": 40, "reserved_bytes": 45, "peak_bytes": 60}
    obj |= {"alloc_retries": 0, "job": "j", "step": 7, "phase": "forward"}
    for key in draw(st.lists(st.sampled_from(sorted(fields)), min_size=1, max_size=3)):
        if draw(st.integers(0, 5)) == 0:
            obj.pop(key, None)
        else:
            obj[key] = draw(fields[key])
    return obj


def _checked(obj: dict[str, object]) -> object:
    try:
        return _checked_sample(obj)
    except SchemaError:
        return "refused"


@hsettings(max_examples=3000, deadline=None)
@given(_objects())
@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_the_fast_path_takes_only_what_the_checks_take_and_builds_the_same_sample(
    obj: dict[str, object],
) -> None:
    fast = _fast_sample(obj)
    if fast is not None:
        assert _checked(obj) == fast


def test_the_fast_path_takes_what_agents_write() -> None:
    obj = {"ts": 1.7e9, "node": "n1", "device": "gpu0", "kind": "gpu", "total_bytes": 80}
    obj |= {"used_bytes": 40, "allocated_bytes": 30, "peak_bytes": 41, "job": "j"}
    assert _fast_sample(obj) == _checked_sample(obj)
    hooked = obj | {"step": 12, "phase": "eval"}
    assert _fast_sample(hooked) == _checked_sample(hooked) != _checked_sample(obj)


# --- step and phase: optional fields of the in-process hook --------------------------------


def _hooked(**extra: object) -> dict[str, object]:
    obj: dict[str, object] = {"ts": T0, "node": "n", "device": "cuda0", "kind": "gpu"}
    return obj | {"total_bytes": 100, "used_bytes": 50} | extra


def test_step_and_phase_are_read_and_written_back() -> None:
    sample = parse_sample(_hooked(step=40, phase="eval"))
    assert (sample.step, sample.phase) == (40, "eval")
    assert sample.to_dict()["step"] == 40 and sample.to_dict()["phase"] == "eval"
    plain = parse_sample(_hooked())
    assert (plain.step, plain.phase) == (None, None)
    assert "step" not in plain.to_dict() and "phase" not in plain.to_dict()
    assert parse_sample(_hooked(step=3.0)).step == 3  # a whole float, as other JSON writers do


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"step": -1}, "step"),
        ({"step": 1.5}, "step"),
        ({"step": "7"}, "step"),
        ({"step": True}, "step"),
        ({"phase": "training"}, "phase"),
        ({"phase": ""}, "phase"),
        ({"phase": 3}, "phase"),
        ({"phase": ["eval"]}, "phase"),
    ],
)
def test_a_bad_step_or_phase_is_refused_naming_the_field(
    extra: dict[str, object], field: str
) -> None:
    with pytest.raises(SchemaError) as err:
        parse_sample(_hooked(**extra))
    assert err.value.field == field


def test_a_schedule_event_is_parsed_beside_the_other_events() -> None:
    from oomcast.model.events import ScheduleEvent

    obj = {"ts": T0, "node": "n", "device": "cuda0", "event": "schedule", "job": "j"}
    obj |= {"eval_every_steps": 100, "step_s": 0.5, "phase_extra_bytes": {"eval": 9}}
    record = parse_record(obj)
    assert isinstance(record, ScheduleEvent)
    assert (record.eval_every_steps, record.checkpoint_every_steps) == (100, None)
    assert record.step_s == 0.5 and dict(record.phase_extra_bytes) == {"eval": 9}
    assert record.to_dict() == obj
    other = parse_record({"ts": T0, "node": "n", "device": "d", "event": "oom"})
    assert type(other) is Event


def test_every_missing_required_field_is_named_at_once() -> None:
    """A client that left out several fields learned of them one 422 at a time."""
    with pytest.raises(SchemaError) as got:
        parse_sample({"ts": 1.0, "node": "n1"})
    assert got.value.field == "device"
    assert str(got.value) == "device: is required, and so are kind, total_bytes, used_bytes"
