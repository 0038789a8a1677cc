"""collectors/sources/replay.py: replaying a trace with its own spacing, driven by `now`."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import support

from oomcast.collectors.sources.replay import ReplaySource
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import TraceError

T0 = support.T0
WALL = 5000.0  # an arbitrary wall clock, far from the trace's own ts


def trace_records() -> list[Record]:
    # gpu0 at 0, 1, 2, 4 s; gpu1 at 0.5 and 3 s; gpu0 OOMs at 4 s
    return [
        support.sample(T0, 0.5),
        support.sample(T0 + 0.5, 0.4, device="gpu1"),
        support.sample(T0 + 1, 0.6),
        support.sample(T0 + 2, 0.7),
        support.sample(T0 + 3, 0.4, device="gpu1"),
        support.sample(T0 + 4, 0.99),
        Event(ts=T0 + 4, node="n1", device="gpu0", event="oom"),
    ]


@pytest.fixture
def trace_file(tmp_path: Path) -> Path:
    return support.write(tmp_path / "run.jsonl.gz", trace_records())


def ts_of(recs: list[Record]) -> list[float]:
    return [r.ts - T0 for r in recs]


def test_with_keep_ts_records_keep_their_original_ts_and_spacing(trace_file: Path) -> None:
    src = ReplaySource(trace_file, keep_ts=True)
    assert len(src) == 7
    assert src.name == "replay:run.jsonl.gz"
    assert not src.exhausted
    first = src.poll(WALL)
    assert ts_of(first) == [0.0]
    assert first[0] == trace_records()[0]  # the original ts, not the wall clock
    assert src.poll(WALL + 0.25) == []
    assert ts_of(src.poll(WALL + 0.5)) == [0.5]
    assert src.poll(WALL + 0.75) == []
    assert ts_of(src.poll(WALL + 1.0)) == [1.0]
    assert ts_of(src.poll(WALL + 2.5)) == [2.0]
    assert not src.exhausted
    assert ts_of(src.poll(WALL + 3.0)) == [3.0]
    last = src.poll(WALL + 4.0)
    assert ts_of(last) == [4.0, 4.0]
    assert isinstance(last[0], Sample)
    assert isinstance(last[1], Event)  # samples before events at equal ts
    assert src.exhausted
    assert src.poll(WALL + 100) == []


def test_by_default_records_are_restamped_from_the_wall_clock_keeping_their_spacing(
    trace_file: Path,
) -> None:
    """A live service refuses samples stamped far from their arrival, so a trace recorded
    long ago is re-stamped: the first record at the wall time the replay started."""
    src = ReplaySource(trace_file)
    out: list[Record] = []
    now = WALL
    while not src.exhausted:
        out.extend(src.poll(now))
        now += 0.125
    assert [r.ts - WALL for r in out] == [r.ts - T0 for r in trace_records()]
    assert [dataclasses.replace(r, ts=r.ts - WALL + T0) for r in out] == trace_records()


def test_late_poll_catches_up_in_order(trace_file: Path) -> None:
    src = ReplaySource(trace_file, keep_ts=True)
    src.poll(WALL)
    caught_up = src.poll(WALL + 2.0)
    assert ts_of(caught_up) == [0.5, 1.0, 2.0]
    assert [getattr(r, "device", None) for r in caught_up] == ["gpu1", "gpu0", "gpu0"]


def test_every_record_is_emitted_once(trace_file: Path) -> None:
    src = ReplaySource(trace_file, keep_ts=True)
    out: list[Record] = []
    now = WALL
    while not src.exhausted:
        out.extend(src.poll(now))
        now += 0.125
    assert out == trace_records()
    assert now - WALL == pytest.approx(4.125)


def test_speed_makes_replay_faster(trace_file: Path) -> None:
    src = ReplaySource(trace_file, speed=4.0, keep_ts=True)
    assert ts_of(src.poll(WALL)) == [0.0]
    assert src.poll(WALL + 0.0625) == []
    assert ts_of(src.poll(WALL + 0.125)) == [0.5]  # 0.5 s of trace in 0.125 s
    assert ts_of(src.poll(WALL + 0.25)) == [1.0]
    assert ts_of(src.poll(WALL + 0.5)) == [2.0]
    assert not src.exhausted
    assert ts_of(src.poll(WALL + 1.0)) == [3.0, 4.0, 4.0]  # all of the 4 s trace in 1 s
    assert src.exhausted


def test_slow_speed(trace_file: Path) -> None:
    src = ReplaySource(trace_file, speed=0.5, keep_ts=True)
    src.poll(WALL)
    assert src.poll(WALL + 0.5) == []
    assert ts_of(src.poll(WALL + 1.0)) == [0.5]
    assert ts_of(src.poll(WALL + 2.0)) == [1.0]


def test_clock_starts_at_the_first_poll(trace_file: Path) -> None:
    src = ReplaySource(trace_file, keep_ts=True)
    assert ts_of(src.poll(WALL + 60)) == [0.0]  # started late: nothing is skipped
    assert src.poll(WALL + 60.25) == []
    assert ts_of(src.poll(WALL + 60.75)) == [0.5]
    assert ts_of(src.poll(WALL + 62)) == [1.0, 2.0]


@pytest.mark.parametrize("speed", [0.0, -1.0])
def test_bad_speed_is_refused(trace_file: Path, speed: float) -> None:
    with pytest.raises(ValueError, match="speed"):
        ReplaySource(trace_file, speed=speed)


def test_empty_trace_is_exhausted_at_once(tmp_path: Path) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text("\n")
    src = ReplaySource(path)
    assert len(src) == 0
    assert src.poll(WALL) == []
    assert src.exhausted


def test_corrupt_line_raises_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    good = [json.dumps(r.to_dict()) for r in trace_records()[:3]]
    path.write_text("\n".join([*good, '{"ts": oops', good[0]]) + "\n", encoding="utf-8")
    with pytest.raises(TraceError) as info:
        ReplaySource(path)
    assert info.value.line == 4
    assert f"{path}:4:" in str(info.value)


def test_schema_invalid_line_raises_at_construction(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl"
    lines = [json.dumps(r.to_dict()) for r in trace_records()]
    broken = json.loads(lines[5])
    broken["kind"] = "tpu"
    lines[5] = json.dumps(broken)
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    with pytest.raises(TraceError) as info:
        ReplaySource(path)
    assert info.value.line == 6
    assert "kind" in str(info.value)
    assert "bad.jsonl:6:" in str(info.value)
