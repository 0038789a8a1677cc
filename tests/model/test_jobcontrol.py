"""model/jobcontrol.py and model/events.py: the job-control protocol, defined once for the
node agent (which asks) and the in-process hook (which answers)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from oomcast.model.events import DetailedEvent, jsonable
from oomcast.model.jobcontrol import (
    CHECKPOINT_DONE,
    ack_extra,
    answers_request,
    encode_jobctl,
    event_object,
    jobctl_key,
    parse_jobctl,
)
from oomcast.model.schema import SchemaError
from oomcast.model.wire import decode_event, encode_event

T0 = 1_750_000_000.0


def test_the_key_keeps_a_job_in_one_cluster_slot() -> None:
    assert jobctl_key("oomcast", "bert-42") == "oomcast:jobctl:{bert-42}"


def test_a_request_round_trips() -> None:
    cmd = parse_jobctl(encode_jobctl("checkpoint", "r1", "forecast"))
    assert (cmd.action, cmd.id, cmd.reason) == ("checkpoint", "r1", "forecast")
    assert parse_jobctl({b"cmd": encode_jobctl(id="r2")["cmd"].encode()}).id == "r2"
    assert len(parse_jobctl(encode_jobctl()).id) == 16  # a fresh id when none is given


def test_a_malformed_request_names_its_field() -> None:
    with pytest.raises(SchemaError) as info:
        parse_jobctl({"cmd": '{"action": ""}'})
    assert info.value.field == "cmd.action"


def test_an_ack_names_every_request_it_answers() -> None:
    assert ack_extra([], None) == {"request_id": None, "path": None}
    one = ack_extra(["a"], Path("/ckpt/1"))
    assert one == {"request_id": "a", "path": "/ckpt/1"}
    both = ack_extra(["a", "b"], "/ckpt/2")
    assert both["request_id"] == "a" and both["request_ids"] == ["a", "b"]
    assert answers_request(both, "b") and answers_request(one, "a")
    assert not answers_request(one, "b") and not answers_request({"request_ids": "b"}, "b")


def test_an_ack_travels_as_an_event_with_extra_keys() -> None:
    ev = DetailedEvent(
        ts=T0,
        node="n1",
        device="proc:7",
        event=CHECKPOINT_DONE,
        job="j",
        extra=ack_extra(["a"], "/p"),
    )
    fields = encode_event(ev)  # the one encoding of the events stream
    obj = event_object(fields)
    assert obj is not None and obj["request_id"] == "a" and obj["path"] == "/p"
    standard = decode_event(fields)  # readers that know only the standard keys
    assert (standard.event, standard.job, standard.device) == (CHECKPOINT_DONE, "j", "proc:7")
    assert event_object({"event": "{"}) is None and event_object({"x": "1"}) is None
    assert event_object({b"event": json.dumps([1]).encode()}) is None


def test_a_detailed_event_keeps_its_key_order_and_refuses_to_shadow_standard_keys() -> None:
    obj = {"ts": T0, "node": "n1", "device": "control", "event": "command_refused", "id": None}
    ev = DetailedEvent.from_dict({**obj, "data": {"pids": (1, 2), "path": Path("/x")}})
    assert list(ev.to_dict()) == ["ts", "node", "device", "event", "id", "data"]
    assert ev.to_dict()["data"] == {"pids": [1, 2], "path": "/x"}  # as json default=str
    assert jsonable({1: {2}}) == {1: "{2}"}
    with pytest.raises(ValueError, match="standard keys"):
        DetailedEvent(ts=T0, node="n", device="d", event="e", extra={"node": "other"})
