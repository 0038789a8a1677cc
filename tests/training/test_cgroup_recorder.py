"""training/cgroup_recorder.py: parsing fixture cgroup trees (v1 and v2), OOM detection, and
two real runs under a real memory cgroup (skipped where no cgroup can be created)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from oomcast.model.schema import Event, Sample
from oomcast.model.trace import load_trace, write_trace
from oomcast.training import cgroup_recorder as cr
from oomcast.training.cgroup_recorder import (
    CgroupError,
    CgroupMonitor,
    CgroupUnavailable,
    MemoryCgroup,
)

MIB = 1 << 20
LIMIT = 512 * MIB


def write_files(path: Path, files: dict[str, str | int]) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    for name, value in files.items():
        (path / name).write_text(f"{value}\n")
    return path


def v1_files(
    *,
    usage: int = 300 * MIB,
    limit: int = LIMIT,
    rss: int = 250 * MIB,
    peak: int = 320 * MIB,
    failcnt: int = 0,
    oom_kill: int = 0,
) -> dict[str, str | int]:
    return {
        "memory.limit_in_bytes": limit,
        "memory.usage_in_bytes": usage,
        "memory.max_usage_in_bytes": peak,
        "memory.failcnt": failcnt,
        "memory.stat": f"cache 4096\nrss {rss // 2}\nmapped_file 0\ntotal_cache 4096\n"
        f"total_rss {rss}\nhierarchical_memory_limit {limit}\n",
        "memory.oom_control": f"oom_kill_disable 0\nunder_oom 0\noom_kill {oom_kill}",
        "cgroup.procs": "",
    }


def v2_files(
    *,
    current: int = 300 * MIB,
    limit: int | str = LIMIT,
    anon: int = 250 * MIB,
    peak: int = 320 * MIB,
    max_events: int = 0,
    oom_kill: int = 0,
) -> dict[str, str | int]:
    return {
        "memory.max": limit,
        "memory.current": current,
        "memory.peak": peak,
        "memory.stat": f"anon {anon}\nfile 4096\nkernel 8192\nsock 0\n",
        "memory.events": f"low 0\nhigh 0\nmax {max_events}\noom {oom_kill}\n"
        f"oom_kill {oom_kill}\noom_group_kill 0",
        "cgroup.procs": "",
    }


@pytest.fixture
def v1(tmp_path: Path) -> MemoryCgroup:
    return MemoryCgroup(write_files(tmp_path / "v1" / "job-a", v1_files()), version=1)


@pytest.fixture
def v2(tmp_path: Path) -> MemoryCgroup:
    return MemoryCgroup(write_files(tmp_path / "v2" / "job-b", v2_files()), version=2)


# --- parsing -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [("800M", 800 * MIB), ("1.5G", 1536 * MIB), ("64MiB", 64 * MIB), ("4096", 4096), (7, 7)],
)
def test_parse_size(text: str | int, expected: int) -> None:
    assert cr.parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "lots", "-5M", "0"])
def test_parse_size_refuses_garbage(text: str) -> None:
    with pytest.raises(ValueError):
        cr.parse_size(text)


def test_parse_flat_keyed_skips_odd_lines() -> None:
    text = "anon 10\nfile 20\n\nweird line here\nnot_a_number x\noom_kill 3\n"
    assert cr.parse_flat_keyed(text) == {"anon": 10, "file": 20, "oom_kill": 3}


def test_detect_version(tmp_path: Path) -> None:
    assert cr.detect_version(write_files(tmp_path / "a", v1_files())) == 1
    root2 = write_files(tmp_path / "b", {"cgroup.controllers": "cpu io memory pids"})
    assert cr.detect_version(root2) == 2
    no_mem = write_files(tmp_path / "c", {"cgroup.controllers": "cpu io"})
    with pytest.raises(CgroupUnavailable, match="without the memory controller"):
        cr.detect_version(no_mem)
    with pytest.raises(CgroupUnavailable, match="neither"):
        cr.detect_version(write_files(tmp_path / "d", {"notes": "x"}))
    with pytest.raises(CgroupUnavailable, match="not a directory"):
        cr.detect_version(tmp_path / "missing")


def test_own_cgroup_path(tmp_path: Path) -> None:
    f = tmp_path / "cgroup"
    f.write_text("9:name=systemd:/\n4:memory:/jobs/abc\n2:cpu,cpuacct:/x\n0::/user.slice\n")
    assert cr.own_cgroup_path(f) == {
        "name=systemd": "/",
        "memory": "/jobs/abc",
        "cpu": "/x",
        "cpuacct": "/x",
        "": "/user.slice",
    }
    assert cr.own_cgroup_path(tmp_path / "nope") == {}


def test_v1_read_and_peak_reset(v1: MemoryCgroup) -> None:
    r = v1.read()
    assert r == cr.Reading(
        limit_bytes=LIMIT,
        usage_bytes=300 * MIB,
        anon_bytes=250 * MIB,  # total_rss (hierarchical) wins over rss
        peak_bytes=320 * MIB,
        retries=0,
        oom_kills=0,
    )
    # the peak is reset after the read, so the next one means "since this sample"
    assert (v1.path / "memory.max_usage_in_bytes").read_text() == "0"
    assert v1.read(reset_peak=False).peak_bytes == 0


def test_v1_rss_without_total_and_unlimited(tmp_path: Path) -> None:
    files = v1_files(limit=9223372036854771712)
    files["memory.stat"] = "cache 0\nrss 12345\n"
    cg = MemoryCgroup(write_files(tmp_path / "cg", files))
    assert cg.version == 1
    r = cg.read()
    assert r.anon_bytes == 12345
    assert r.limit_bytes is None


def test_v1_without_oom_kill_counter_is_an_error(v1: MemoryCgroup) -> None:
    (v1.path / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    with pytest.raises(CgroupError, match="oom_kill"):
        v1.oom_kills()


def test_v2_read(v2: MemoryCgroup) -> None:
    write_files(v2.path, v2_files(max_events=7, oom_kill=1))
    r = v2.read()
    assert r.limit_bytes == LIMIT
    assert r.usage_bytes == 300 * MIB
    assert r.anon_bytes == 250 * MIB
    assert r.peak_bytes == 320 * MIB
    assert r.retries == 7  # memory.events "max": times the limit was hit
    assert r.oom_kills == 1
    # the peak was reset through the same descriptor
    assert (v2.path / "memory.peak").read_text().strip() == "0"
    (v2.path / "memory.max").write_text("max\n")
    assert v2.limit() is None
    v2.close()


def test_v2_bad_number_names_the_file(v2: MemoryCgroup) -> None:
    (v2.path / "memory.current").write_text("lots\n")
    with pytest.raises(CgroupError, match=r"memory\.current"):
        v2.read()


def test_create_on_fixture_root(tmp_path: Path) -> None:
    root = write_files(tmp_path / "root", v1_files())
    cg = MemoryCgroup.create(root, "run-1", 64 * MIB)
    assert cg.version == 1
    assert (root / "run-1" / "memory.limit_in_bytes").read_text() == str(64 * MIB)
    with pytest.raises(CgroupError, match="already exists"):
        MemoryCgroup.create(root, "run-1", 64 * MIB)
    with pytest.raises(ValueError):
        MemoryCgroup.create(root, "a/b", 64 * MIB)


def test_create_v2_enables_memory_for_children(tmp_path: Path) -> None:
    root = write_files(
        tmp_path / "root", {"cgroup.controllers": "cpu memory", "cgroup.subtree_control": "cpu"}
    )
    cg = MemoryCgroup.create(root, "run-2", 64 * MIB)
    assert cg.version == 2
    assert (root / "cgroup.subtree_control").read_text() == "+memory"
    assert (root / "run-2" / "memory.max").read_text() == str(64 * MIB)


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


@pytest.fixture
def real_root() -> Iterator[Path]:
    """A cgroup directory where this test may create children, or a skip saying why not."""
    try:
        root = cr.default_root()
        probe = MemoryCgroup.create(root, f"oomcast-probe-{id(root)}", 64 * MIB)
    except CgroupUnavailable as exc:
        pytest.skip(f"no writable memory cgroup: {exc}")
    probe.remove()
    yield root


def test_real_oom_kill_is_recorded(real_root: Path, tmp_path: Path) -> None:
    out = tmp_path / "oom.jsonl.gz"
    limit = 64 * MIB
    result = cr.record(
        [sys.executable, "-S", "-c", ALLOC_FOREVER],
        limit_bytes=limit,
        out=out,
        job="alloc-loop",
        root=real_root,
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
    assert not (real_root / Path(result["cgroup"]).name).exists()  # cleaned up


def test_real_run_under_the_limit_ends_with_an_exit_event(
    real_root: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ok.jsonl"
    argv = ["--limit", "64M", "--out", str(out), "--job", "small", "--interval", "0.1"]
    argv += ["--root", str(real_root), "--", sys.executable, "-S", "-c", ALLOC_SOME]
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
