"""model/trace.py: JSON Lines traces (plain and gzip'ed), TraceError, Trace, find_traces."""

from __future__ import annotations

import gzip
import json
from pathlib import Path
from typing import Any

import pytest
import support

from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import (
    Trace,
    TraceError,
    downsample,
    downsample_trace,
    find_traces,
    iter_trace,
    load_trace,
    write_trace,
)

T0 = support.T0
GIB = support.GIB


def records() -> list[Record]:
    return [
        support.sample(T0, 0.5, allocated_bytes=10 * GIB, alloc_retries=0, job="j"),
        support.sample(T0, 0.2, device="gpu1"),
        support.sample(T0 + 1, 0.6, reserved_bytes=50 * GIB, peak_bytes=49 * GIB),
        support.sample(T0 + 1.5, 0.3, device="gpu1"),
        Event(ts=T0 + 2, node="n1", device="gpu0", event="oom", job="j"),
    ]


def raw(ts: float, **over: Any) -> str:
    obj: dict[str, Any] = {
        "ts": ts,
        "node": "n1",
        "device": "gpu0",
        "kind": "gpu",
        "total_bytes": 100,
        "used_bytes": 50,
    }
    obj.update(over)
    return json.dumps(obj)


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    recs = records()
    path = tmp_path / "sub" / name  # parent folders are created
    assert write_trace(path, recs) == len(recs)
    assert list(iter_trace(path)) == recs


def test_gz_trace_is_really_gzip(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, records())
    assert path.read_bytes()[:2] == b"\x1f\x8b"
    with gzip.open(path, "rt", encoding="utf-8") as fh:
        lines = fh.read().splitlines()
    assert len(lines) == 5
    assert json.loads(lines[0])["used_bytes"] == 40 * GIB
    assert json.loads(lines[4])["event"] == "oom"


def test_plain_trace_is_one_json_object_per_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, records())
    lines = path.read_text(encoding="utf-8").splitlines()
    assert len(lines) == 5
    assert [json.loads(line)["ts"] for line in lines] == [T0, T0, T0 + 1, T0 + 1.5, T0 + 2]


def test_corrupt_json_line_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "bad.jsonl", [raw(T0), raw(T0 + 1), '{"ts": 17500', raw(T0 + 3)])
    with pytest.raises(TraceError) as info:
        list(iter_trace(path))
    assert f"{path}:3:" in str(info.value)
    assert "bad.jsonl" in str(info.value)
    assert info.value.line == 3
    assert info.value.path == str(path)
    assert "JSON" in info.value.message


def test_schema_invalid_line_names_file_line_and_field(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "bad.jsonl", [raw(T0), raw(T0 + 1), raw(T0 + 2), raw(T0 + 3, total_bytes=-1)]
    )
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert f"{path}:4:" in str(info.value)
    assert info.value.line == 4
    assert "total_bytes" in info.value.message


def test_non_monotonic_ts_names_file_and_line(tmp_path: Path) -> None:
    path = write_lines(
        tmp_path / "order.jsonl",
        [raw(T0), raw(T0 + 5, device="gpu1"), raw(T0 + 2), raw(T0 + 2)],  # gpu0 repeats T0+2
    )
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == 4
    assert f"{path}:4:" in str(info.value)
    assert "ts" in info.value.message


def test_line_numbers_count_blank_lines(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [raw(T0), "", "   ", raw(T0 + 1), "", "nope"])
    with pytest.raises(TraceError) as info:
        list(iter_trace(path))
    assert info.value.line == 6


def test_errors_are_raised_only_when_the_bad_line_is_reached(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [raw(T0), raw(T0 + 1), "{"])
    it = iter_trace(path)
    assert next(it).ts == T0
    assert next(it).ts == T0 + 1
    with pytest.raises(TraceError):
        next(it)


def test_corrupt_line_in_gz_trace_names_file_and_line(tmp_path: Path) -> None:
    path = tmp_path / "bad.jsonl.gz"
    with gzip.open(path, "wt", encoding="utf-8") as fh:
        fh.write(raw(T0) + "\n" + "[1, 2]\n")
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert f"{path}:2:" in str(info.value)


def test_gz_name_with_plain_content_is_a_trace_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "fake.jsonl.gz", [raw(T0)])
    with pytest.raises(TraceError) as info:
        load_trace(path)
    assert info.value.line == 1
    assert "fake.jsonl.gz" in str(info.value)


def test_trace_error_is_a_value_error() -> None:
    err = TraceError("x.jsonl", 7, "boom")
    assert isinstance(err, ValueError)
    assert str(err) == "x.jsonl:7: boom"


def test_blank_lines_are_skipped(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", ["", raw(T0), "", "  \t", raw(T0 + 1), ""])
    recs = list(iter_trace(path))
    assert [r.ts for r in recs] == [T0, T0 + 1]


def test_unknown_keys_in_a_trace_are_ignored(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [raw(T0, emb=[1.0], emb_v=1, gpu_temp=60)])
    (rec,) = list(iter_trace(path))
    assert isinstance(rec, Sample)
    assert rec.used_bytes == 50


def test_empty_trace(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [])
    trace = load_trace(path)
    assert trace.samples == {}
    assert trace.events == []
    assert not trace.ooms
    assert trace.records() == []


def test_load_trace_splits_by_domain(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(path, records())
    trace = load_trace(path)
    assert trace.path == str(path)
    assert set(trace.samples) == {("n1", "gpu0"), ("n1", "gpu1")}
    assert [s.ts for s in trace.samples[("n1", "gpu0")]] == [T0, T0 + 1]
    assert [s.ts for s in trace.samples[("n1", "gpu1")]] == [T0, T0 + 1.5]
    assert [e.event for e in trace.events] == ["oom"]
    assert trace.ooms


def test_oom_ts_is_the_first_oom_of_that_domain() -> None:
    trace = Trace(
        path="mem",
        events=[
            Event(ts=T0 + 9, node="n1", device="gpu0", event="oom"),
            Event(ts=T0 + 3, node="n1", device="gpu0", event="checkpoint_done"),
            Event(ts=T0 + 5, node="n1", device="gpu0", event="oom"),
            Event(ts=T0 + 1, node="n1", device="gpu1", event="oom"),
        ],
    )
    assert trace.oom_ts(("n1", "gpu0")) == T0 + 5
    assert trace.oom_ts(("n1", "gpu1")) == T0 + 1
    assert trace.oom_ts(("n2", "gpu0")) is None
    assert trace.ooms


def test_trace_without_oom_event() -> None:
    trace = Trace(
        path="mem", events=[Event(ts=T0, node="n1", device="gpu0", event="checkpoint_done")]
    )
    assert not trace.ooms
    assert trace.oom_ts(("n1", "gpu0")) is None


def test_records_merge_domains_in_time_order_samples_before_events() -> None:
    a0 = support.sample(T0, 0.5, device="gpu0")
    a1 = support.sample(T0 + 2, 0.6, device="gpu0")
    b0 = support.sample(T0 + 1, 0.5, device="gpu1")
    b1 = support.sample(T0 + 3, 0.5, device="gpu1")
    oom = Event(ts=T0 + 2, node="n1", device="gpu0", event="oom")
    trace = Trace(
        path="mem",
        samples={("n1", "gpu0"): [a0, a1], ("n1", "gpu1"): [b0, b1]},
        events=[oom],
    )
    assert trace.records() == [a0, b0, a1, oom, b1]


def test_records_of_a_loaded_trace_match_the_written_order(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl.gz"
    recs = records()
    write_trace(path, recs)
    assert load_trace(path).records() == recs


def test_find_traces_finds_both_suffixes_recursively_sorted(tmp_path: Path) -> None:
    write_trace(tmp_path / "b.jsonl", records())
    write_trace(tmp_path / "a.jsonl.gz", records())
    write_trace(tmp_path / "deep" / "er" / "c.jsonl", records())
    (tmp_path / "notes.txt").write_text("x")
    (tmp_path / "d.json").write_text("{}")
    (tmp_path / "e.jsonl.bak").write_text("")
    (tmp_path / "dir.jsonl").mkdir()  # a folder, not a trace
    found = find_traces(tmp_path)
    assert found == sorted(found)
    assert {p.relative_to(tmp_path).as_posix() for p in found} == {
        "a.jsonl.gz",
        "b.jsonl",
        "deep/er/c.jsonl",
    }


def test_find_traces_of_an_empty_folder(tmp_path: Path) -> None:
    assert find_traces(tmp_path) == []


def test_find_traces_of_a_missing_folder_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nowhere"):
        find_traces(tmp_path / "nowhere")
    file = tmp_path / "x.jsonl"
    file.write_text("")
    with pytest.raises(FileNotFoundError):
        find_traces(file)


def test_bad_utf8_is_blamed_on_its_own_line(tmp_path: Path) -> None:
    path = tmp_path / "t.jsonl"
    good = [raw(1.0), raw(2.0)]
    path.write_bytes((good[0] + "\n").encode() + b'{"node": "\xff"}\n' + (good[1] + "\n").encode())
    with pytest.raises(TraceError) as err:
        list(iter_trace(path))
    assert err.value.line == 2
    assert f"{path}:2:" in str(err.value)


def test_json_past_python_limits_is_a_trace_error(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "t.jsonl", [raw(1.0), "[" * 100_000 + "]" * 100_000])
    with pytest.raises(TraceError, match=r":2: not valid JSON: RecursionError"):
        list(iter_trace(path))
    path = write_lines(tmp_path / "u.jsonl", ['{"ts": ' + "1" * 5000 + "}"])
    with pytest.raises(TraceError, match=r":1: not valid JSON"):
        list(iter_trace(path))


def test_nvml_view_keeps_what_nvml_reports_and_leaves_host_samples_alone() -> None:
    from oomcast.model.trace import as_nvml_sees_it, nvml_view

    gpu = support.sample(
        1.0, 0.9, allocated_bytes=10, reserved_bytes=20, peak_bytes=30, alloc_retries=2, job="j"
    )
    seen = nvml_view(gpu)
    assert (seen.allocated_bytes, seen.reserved_bytes, seen.peak_bytes, seen.alloc_retries) == (
        None,
        None,
        None,
        None,
    )
    assert (seen.used_bytes, seen.total_bytes, seen.job, seen.ts) == (
        gpu.used_bytes,
        gpu.total_bytes,
        "j",
        1.0,
    )
    host = Sample(2.0, "n1", "cgroup:/a", "host", 100, 50, allocated_bytes=40, peak_bytes=60)
    assert nvml_view(host) is host
    trace = Trace(path="x", samples={gpu.domain: [gpu], host.domain: [host]})
    trace.events.append(Event(3.0, "n1", "gpu0", "oom"))
    view = as_nvml_sees_it(trace)
    assert view.samples[gpu.domain] == [seen] and view.samples[host.domain] == [host]
    assert view.events == trace.events and trace.samples[gpu.domain] == [gpu]  # a copy


# --- downsampling ---------------------------------------------------------------------------


def ramp_10hz(seconds: int = 60, spike_at: int | None = None) -> list[Sample]:
    """used climbs 0.3 -> 0.9 at 10 Hz; one sample (index ``spike_at``) jumps to 0.99."""
    n = seconds * 10
    return [
        support.sample(T0 + i / 10, 0.99 if i == spike_at else 0.3 + 0.6 * i / n) for i in range(n)
    ]


def test_downsample_a_10hz_ramp_to_1hz_keeps_one_sample_a_second() -> None:
    ss = ramp_10hz()
    kept = downsample(ss, 1.0)
    assert len(kept) == 60  # 600 samples at 10 Hz over 60 s
    assert kept[0] == ss[0]  # the first sample, unchanged
    assert kept == ss[::10]  # t = 0, 1, ..., 59: each the first sample a second on
    # a rising ramp's kept sample is its group's highest: nothing to add, no peak invented
    assert all(s.peak_bytes is None for s in kept)


def test_downsample_keeps_the_peak_of_a_spike_between_kept_samples() -> None:
    ss = ramp_10hz(spike_at=23)  # t = 2.3 s: dropped, between the kept t = 2 and t = 3
    kept = downsample(ss, 1.0)
    assert [round(s.ts - T0, 6) for s in kept[:4]] == [0, 1, 2, 3]
    assert kept[3].used_bytes == ss[30].used_bytes
    assert kept[3].peak_bytes == ss[23].used_bytes == int(0.99 * 80 * GIB)
    assert kept[2] == ss[20] and kept[4] == ss[40]  # the groups around it are untouched


def test_downsample_peak_is_the_max_of_reported_peaks_and_uses() -> None:
    ss = [
        support.sample(T0, 0.5, peak_bytes=60 * GIB),
        support.sample(T0 + 0.4, 0.5, peak_bytes=70 * GIB),  # dropped: its peak moves on
        support.sample(T0 + 0.7, 0.6),  # dropped, no peak: its use counts (48 GiB)
        support.sample(T0 + 1.0, 0.5, peak_bytes=41 * GIB),  # kept, peak 70 GiB
        support.sample(T0 + 1.5, 0.5),  # dropped
        support.sample(T0 + 2.2, 0.55, peak_bytes=45 * GIB),  # kept, own peak highest
    ]
    kept = downsample(ss, 1.0)
    assert [s.ts for s in kept] == [T0, T0 + 1.0, T0 + 2.2]
    assert [s.peak_bytes for s in kept] == [60 * GIB, 70 * GIB, 45 * GIB]
    assert kept[1].used_bytes == ss[3].used_bytes  # only the peak changes


def test_downsample_is_not_thrown_by_float_noise_in_timestamps() -> None:
    ts = [T0]
    for _ in range(599):
        ts.append(ts[-1] + 0.1)  # as a 10 Hz recorder adds them up: 1 s is 0.999999046 s
    ss = [support.sample(t, 0.5) for t in ts]
    assert len(downsample(ss, 1.0)) == 60


def test_downsample_measures_from_the_last_kept_sample() -> None:
    # every 0.6 s with a 1 s interval: 0 kept, 0.6 too soon, 1.2 kept, 1.8 too soon, 2.4 kept
    ss = [support.sample(T0 + 0.6 * i, 0.5) for i in range(5)]
    assert [round(s.ts - T0, 6) for s in downsample(ss, 1.0)] == [0, 1.2, 2.4]


def test_downsample_is_per_domain() -> None:
    ss: list[Sample] = []
    for i in range(20):
        ss.append(support.sample(T0 + i / 10, 0.5, device="gpu0"))
        ss.append(support.sample(T0 + 0.05 + i / 10, 0.4, device="gpu1"))
    kept = downsample(ss, 1.0)
    assert [(s.device, round(s.ts - T0, 6)) for s in kept] == [
        ("gpu0", 0),
        ("gpu1", 0.05),
        ("gpu0", 1),
        ("gpu1", 1.05),
    ]


def test_downsample_trace_keeps_events_and_the_oom() -> None:
    ss = ramp_10hz(seconds=30, spike_at=295)  # t = 29.5: after the last kept sample
    oom = Event(ts=T0 + 30, node="n1", device="gpu0", event="oom", job="j")
    other = support.sample(T0, 0.2, device="gpu1")
    trace = Trace(path="t.jsonl", samples={("n1", "gpu0"): ss, ("n1", "gpu1"): [other]})
    trace.events = [Event(ts=T0 + 5, node="n1", device="gpu0", event="checkpoint_done"), oom]
    out = downsample_trace(trace, 1.0)
    assert out.path == "t.jsonl"
    assert out.events == trace.events and out.events is not trace.events
    assert out.ooms and out.oom_ts(("n1", "gpu0")) == T0 + 30
    kept = out.samples[("n1", "gpu0")]
    assert len(kept) == 30
    # samples after the last kept one (t = 29) stand for nothing kept: a 1 Hz poller would
    # not have seen them either
    assert kept[-1] == ss[290] and kept[-1].peak_bytes is None
    assert out.samples[("n1", "gpu1")] == [other]
    assert len(trace.samples[("n1", "gpu0")]) == 300  # the input is left as it was


@pytest.mark.parametrize("interval", [0.0, -1.0, float("nan"), float("inf")])
def test_downsample_refuses_a_bad_interval(interval: float) -> None:
    with pytest.raises(ValueError, match="interval_s="):
        downsample(ramp_10hz(seconds=1), interval)
    with pytest.raises(ValueError, match="interval_s="):
        downsample_trace(Trace(path="empty.jsonl"), interval)


@pytest.mark.parametrize("name", ["p.jsonl", "p.jsonl.gz"])
def test_step_phase_and_schedule_events_survive_a_round_trip(tmp_path: Path, name: str) -> None:
    from oomcast.model.events import ScheduleEvent

    schedule = ScheduleEvent(
        T0, "n1", "gpu0", "schedule", "j", eval_every_steps=100, phase_extra_bytes={"eval": 5}
    )
    recs: list[Record] = [
        schedule,
        support.sample(T0 + 1, 0.5, job="j", step=40),
        support.sample(T0 + 2, 0.5, job="j", step=41, phase="eval", peak_bytes=60 * GIB),
    ]
    path = tmp_path / name
    write_trace(path, recs)
    back = list(iter_trace(path))
    assert back == recs and isinstance(back[0], ScheduleEvent)


def test_nvml_view_drops_the_hooks_step_and_phase() -> None:
    from oomcast.model.trace import nvml_view

    seen = nvml_view(support.sample(1.0, 0.5, step=3, phase="eval"))
    assert (seen.step, seen.phase) == (None, None)
