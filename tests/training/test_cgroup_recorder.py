"""training/cgroup_recorder.py: parsing fixture cgroup trees (v1 and v2), OOM detection, and
two real runs under a real memory cgroup (skipped where no cgroup can be created)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from support import LIMIT, MIB, v1_files, v2_files, write_files

from oomcast.model.schema import Event, Sample
from oomcast.model.trace import load_trace, write_trace
from oomcast.training import cgroup_recorder as cr
from oomcast.training.cgroup_recorder import (
    CgroupError,
    CgroupMonitor,
    MemoryCgroup,
)

# --- turning reads into a trace ------------------------------------------------------------


def test_monitor_samples_then_oom_event(tmp_path: Path, v1: MemoryCgroup) -> None:
    # the counter was already 2 when the run started (an earlier run in a reused cgroup)
    write_files(v1.path, v1_files(oom_kill=2))
    mon = CgroupMonitor(v1, node="n1", job="j1")
    for i, used in enumerate((200, 350, 480)):
        write_files(v1.path, v1_files(usage=used * MIB, peak=(used + 10) * MIB, oom_kill=2))
        assert mon.tick(now=1000.0 + i) is False
    # the kernel kills the job: the counter rises; this tick yields the event, no sample
    write_files(v1.path, v1_files(usage=5 * MIB, peak=LIMIT, failcnt=9, oom_kill=3))
    assert mon.tick(now=1003.0) is True
    assert mon.tick(now=1004.0) is True  # nothing more after the OOM
    assert mon.finish(now=1005.0) is True
    samples = [r for r in mon.records if isinstance(r, Sample)]
    events = [r for r in mon.records if isinstance(r, Event)]
    assert [s.used_bytes for s in samples] == [200 * MIB, 350 * MIB, 480 * MIB]
    assert [s.peak_bytes for s in samples] == [210 * MIB, 360 * MIB, 490 * MIB]
    s = samples[-1]
    assert (s.kind, s.device, s.node, s.job, s.total_bytes) == (
        "host",
        "cgroup:/job-a",
        "n1",
        "j1",
        LIMIT,
    )
    assert s.allocated_bytes == 250 * MIB and s.alloc_retries == 0
    assert len(events) == 1 and events[0].event == "oom" and events[0].ts == 1003.0
    assert mon.oom_ts == 1003.0 and mon.oom_kills == 1
    assert mon.max_peak_bytes == LIMIT  # the peak read in the OOM tick still counts

    out = tmp_path / "t.jsonl.gz"
    write_trace(out, mon.records)
    trace = load_trace(out)
    assert trace.ooms and trace.oom_ts(("n1", "cgroup:/job-a")) == 1003.0


def test_monitor_oom_seen_only_after_exit(v2: MemoryCgroup) -> None:
    mon = CgroupMonitor(v2, node="n", job=None, device="cgroup:/custom")
    assert mon.tick(now=10.0) is False
    write_files(v2.path, v2_files(oom_kill=1))  # killed between ticks, then exited
    assert mon.finish(now=10.1) is True
    assert isinstance(mon.records[-1], Event)
    assert mon.records[-1].device == "cgroup:/custom" and mon.records[-1].ts == 10.1


def test_monitor_without_oom_has_no_event(v2: MemoryCgroup) -> None:
    mon = CgroupMonitor(v2, node="n", job="j")
    for i in range(3):
        assert mon.tick(now=float(100 + i)) is False
    assert mon.finish() is False
    assert all(isinstance(r, Sample) for r in mon.records) and mon.samples == 3


def test_monitor_orders_equal_timestamps(v1: MemoryCgroup) -> None:
    mon = CgroupMonitor(v1, node="n", clock=lambda: 50.0)
    mon.tick()
    mon.tick()
    assert mon.records[1].ts > mon.records[0].ts


def test_monitor_refuses_unlimited_cgroup(tmp_path: Path) -> None:
    cg = MemoryCgroup(write_files(tmp_path / "cg", v2_files(limit="max")))
    with pytest.raises(CgroupError, match="no memory limit"):
        CgroupMonitor(cg, node="n").tick()


# --- real cgroups --------------------------------------------------------------------------

ALLOC_FOREVER = """
import time
chunks = []
while True:
    chunks.append(b"\\x01" * (1 << 20))  # touched, so charged to the cgroup
    time.sleep(0.004)
"""

ALLOC_SOME = """
import time
chunks = [b"\\x01" * (1 << 20) for _ in range(16)]
time.sleep(0.6)
"""


def test_real_oom_kill_is_recorded(cgroup_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "oom.jsonl.gz"
    limit = 64 * MIB
    result = cr.record(
        [sys.executable, "-S", "-c", ALLOC_FOREVER],
        limit_bytes=limit,
        out=out,
        job="alloc-loop",
        root=cgroup_root,
        interval_s=0.05,
        timeout_s=20,
    )
    assert result["oom"] is True, result
    assert result["exit_code"] == -9 and not result["timed_out"]
    assert result["peak_bytes"] >= 0.9 * limit
    trace = load_trace(out)
    [(domain, samples)] = trace.samples.items()
    assert [e.event for e in trace.events] == ["oom"]
    oom_ts = trace.oom_ts(domain)
    assert oom_ts is not None and oom_ts > samples[-1].ts
    assert all(s.total_bytes == limit and s.job == "alloc-loop" for s in samples)
    assert max(s.used_bytes for s in samples) >= 0.8 * limit
    assert samples[-1].used_bytes >= 0.6 * limit  # still near the wall just before the kill
    assert not (cgroup_root / Path(result["cgroup"]).name).exists()  # cleaned up


def test_real_run_under_the_limit_ends_with_an_exit_event(
    cgroup_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ok.jsonl"
    argv = ["--limit", "64M", "--out", str(out), "--job", "small", "--interval", "0.1"]
    argv += ["--root", str(cgroup_root), "--", sys.executable, "-S", "-c", ALLOC_SOME]
    assert cr.main(argv) == 0
    assert "oom=False" in capsys.readouterr().err
    trace = load_trace(out)
    assert not trace.ooms
    # the job ended by itself: one `exit` event, no OOM, after every sample
    [exit_event] = trace.events
    [samples] = trace.samples.values()
    assert exit_event.event == "exit" and exit_event.job == "small"
    assert exit_event.ts >= samples[-1].ts
    assert trace.exit_ts(exit_event.domain) == exit_event.ts
    assert len(samples) >= 3
    assert max(s.used_bytes for s in samples) >= 16 * MIB
    assert max(s.used_bytes for s in samples) < 64 * MIB
