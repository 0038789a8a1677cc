"""model/events.py: events with keys of their own, and the ``schedule`` event."""

from __future__ import annotations

from typing import Any

import pytest

from oomcast.model.events import DetailedEvent, ScheduleEvent, parse_schedule
from oomcast.model.schema import SchemaError

T0 = 1_750_000_000.0


def schedule(**over: Any) -> dict[str, Any]:
    obj: dict[str, Any] = {"ts": T0, "node": "n1", "device": "cuda0", "event": "schedule"}
    obj |= {"job": "j", "eval_every_steps": 100, "checkpoint_every_steps": 1000}
    obj |= {"step_s": 1.5, "phase_extra_bytes": {"eval": 10, "checkpoint": 20, "optimizer": 0}}
    return obj | over


def test_a_full_schedule_is_read_and_written_back_as_it_came() -> None:
    ev = parse_schedule(schedule(measured=["eval"]))
    assert (ev.eval_every_steps, ev.checkpoint_every_steps, ev.step_s) == (100, 1000, 1.5)
    assert dict(ev.phase_extra_bytes) == {"eval": 10, "checkpoint": 20, "optimizer": 0}
    assert ev.measured == ("eval",) and ev.domain == ("n1", "cuda0") and ev.job == "j"
    assert ev.to_dict() == schedule(measured=["eval"])


def test_optional_keys_may_be_left_out_and_unknown_ones_are_ignored() -> None:
    obj = {"ts": T0, "node": "n1", "device": "d", "event": "schedule"}
    ev = parse_schedule(obj | {"phase_extra_bytes": {}, "future_key": [1, 2]})
    assert ev.eval_every_steps is None and ev.step_s is None and ev.job is None
    assert ev.to_dict() == obj | {"phase_extra_bytes": {}}
    assert parse_schedule(schedule(step_s=2)).step_s == 2.0
    assert parse_schedule(schedule(eval_every_steps=50.0)).eval_every_steps == 50


@pytest.mark.parametrize(
    ("over", "field"),
    [
        ({"eval_every_steps": 0}, "eval_every_steps"),
        ({"eval_every_steps": -5}, "eval_every_steps"),
        ({"checkpoint_every_steps": "100"}, "checkpoint_every_steps"),
        ({"checkpoint_every_steps": 2.5}, "checkpoint_every_steps"),
        ({"step_s": 0}, "step_s"),
        ({"step_s": float("inf")}, "step_s"),
        ({"step_s": "1s"}, "step_s"),
        ({"step_s": True}, "step_s"),
        ({"phase_extra_bytes": None}, "phase_extra_bytes"),
        ({"phase_extra_bytes": [1]}, "phase_extra_bytes"),
        ({"phase_extra_bytes": {"forward": 1}}, "phase_extra_bytes.forward"),
        ({"phase_extra_bytes": {"eval": -1}}, "phase_extra_bytes.eval"),
        ({"phase_extra_bytes": {"eval": 1.5}}, "phase_extra_bytes.eval"),
        ({"phase_extra_bytes": {"eval": 1 << 64}}, "phase_extra_bytes.eval"),
        ({"phase_peak_bytes": [1]}, "phase_peak_bytes"),
        ({"phase_peak_bytes": {"forward": 1}}, "phase_peak_bytes.forward"),
        ({"phase_peak_bytes": {"optimizer": -1}}, "phase_peak_bytes.optimizer"),
        ({"phase_peak_bytes": {"optimizer": 2.5}}, "phase_peak_bytes.optimizer"),
        ({"measured": "eval"}, "measured"),
        ({"measured": ["eval", "forward"]}, "measured"),
        ({"ts": -1}, "ts"),
        ({"node": ""}, "node"),
        ({"job": 3}, "job"),
    ],
)
def test_a_bad_schedule_is_refused_naming_the_field(over: dict[str, Any], field: str) -> None:
    with pytest.raises(SchemaError) as err:
        parse_schedule(schedule(**over))
    assert err.value.field == field


def test_an_announced_absolute_peak_is_read_and_written_back_and_may_be_left_out() -> None:
    ev = parse_schedule(schedule(phase_peak_bytes={"optimizer": 90 << 30}))
    assert dict(ev.phase_peak_bytes) == {"optimizer": 90 << 30}
    assert ev.to_dict() == schedule(phase_peak_bytes={"optimizer": 90 << 30})
    assert ev.to_detailed().to_dict() == ev.to_dict()
    plain = parse_schedule(schedule())  # absent (or null): none, and none written
    assert plain.phase_peak_bytes == {} and "phase_peak_bytes" not in plain.to_dict()
    assert parse_schedule(schedule(phase_peak_bytes=None)).phase_peak_bytes == {}


def test_the_extra_bytes_are_required() -> None:
    obj = schedule()
    del obj["phase_extra_bytes"]
    with pytest.raises(SchemaError, match="phase_extra_bytes: is required"):
        parse_schedule(obj)


def test_as_a_detailed_event_it_keeps_every_key() -> None:
    ev = parse_schedule(schedule())
    detailed = ev.to_detailed()
    assert isinstance(detailed, DetailedEvent) and detailed.to_dict() == ev.to_dict()
    assert isinstance(ev, ScheduleEvent) and ev.event == "schedule"


def test_detailed_events_may_not_redefine_standard_keys() -> None:
    with pytest.raises(ValueError, match="standard keys"):
        DetailedEvent(T0, "n", "d", "x", extra={"ts": 1})


def test_an_arrival_is_read_written_back_and_refused_naming_the_field() -> None:
    from oomcast.model.events import ArrivalEvent, parse_arrival
    from oomcast.model.schema import parse_event

    raw: dict[str, Any] = {"ts": 1.5e9, "node": "n", "device": "gpu0", "event": "arrival"}
    raw |= {"job": "b", "need_bytes": 10 << 30, "lands_at": 1.5e9 + 60}
    raw["resident_peak_bytes"] = 5 << 30
    ev = parse_event(raw)
    assert isinstance(ev, ArrivalEvent) and ev.to_dict() == raw
    assert ev.need_bytes == 10 << 30 and ev.lands_at == 1.5e9 + 60
    bare = {k: v for k, v in raw.items() if k not in ("job", "resident_peak_bytes")}
    assert parse_arrival(bare).resident_peak_bytes is None and parse_arrival(bare).job is None
    for key, value in (("need_bytes", 0), ("need_bytes", True), ("lands_at", "soon"),
                       ("lands_at", float("nan")), ("resident_peak_bytes", -1)):  # fmt: skip
        with pytest.raises(SchemaError, match=key):
            parse_arrival({**raw, key: value})
    with pytest.raises(SchemaError, match="need_bytes"):
        parse_arrival({k: v for k, v in raw.items() if k != "need_bytes"})
