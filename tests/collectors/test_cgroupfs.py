"""collectors/cgroupfs.py: reading memory cgroups of both versions from fixture trees written
as the kernel writes them (the real kernel is exercised in test_cgroup_source.py and
tests/training/test_cgroup_recorder.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import LIMIT, MIB, v1_files, v2_files, write_files

from oomcast.collectors import cgroupfs as cr
from oomcast.collectors.cgroupfs import CgroupError, CgroupUnavailable, MemoryCgroup

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
