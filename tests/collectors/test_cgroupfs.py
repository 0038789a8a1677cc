"""collectors/cgroupfs.py: reading memory cgroups of both versions from fixture trees written
as the kernel writes them (the real kernel is exercised in test_cgroup_source.py and
tests/training/test_cgroup_recorder.py)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from support import LIMIT, MIB, open_fds, v1_files, v2_files, write_files

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


def test_a_cgroupfs_peak_is_reset_by_a_write_alone(
    v2: MemoryCgroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A cgroupfs file reports no size: its peak is reset by writing, with no truncate. A
    plain file (a fixture) has a size, and is emptied first (test_v2_read)."""
    truncated: list[int] = []
    real_fstat = os.fstat

    class NoSize:  # what fstat says of a kernfs file
        st_size = 0

    def fstat(fd: int) -> object:
        return NoSize() if fd == v2._peak_fd else real_fstat(fd)

    monkeypatch.setattr(cr.os, "fstat", fstat)
    monkeypatch.setattr(cr.os, "ftruncate", lambda fd, n: truncated.append(fd))
    assert v2.read().peak_bytes == 320 * MIB
    assert truncated == []
    # the write went through the same descriptor, over the start of the text
    assert (v2.path / "memory.peak").read_text().startswith("0\n")
    v2.close()
    monkeypatch.undo()
    fixture = MemoryCgroup(v2.path, version=2)
    (v2.path / "memory.peak").write_text(f"{320 * MIB}\n")
    assert fixture.read().peak_bytes == 320 * MIB
    assert (v2.path / "memory.peak").read_text() == "0\n"  # emptied, then written
    fixture.close()


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


# --- kept-open files -----------------------------------------------------------------------


def test_flat_value_finds_one_line() -> None:
    text = "anon 10\nanon_thp 5\ntotal_rss 7\nrss 3\noom_kill_disable 0\noom_kill 2\nodd x y"
    assert cr.flat_value(text, "anon") == 10
    assert cr.flat_value(text, "rss") == 3  # not total_rss
    assert cr.flat_value(text, "oom_kill") == 2  # not oom_kill_disable
    assert cr.flat_value(text, "odd") is None
    assert cr.flat_value(text, "missing") is None
    assert cr.flat_value("max 4", "max") == 4  # last line without a newline


def test_reads_keep_descriptors_open_and_see_new_values(v2: MemoryCgroup) -> None:
    v2.read(with_pressure=True)
    held = v2.open_files
    assert held >= 4  # memory.max, .current, .stat, .events (and the peak)
    before = open_fds(v2.path)
    for i in range(200):
        (v2.path / "memory.current").write_text(f"{(400 + i) * MIB}\n")  # in place, as the kernel
        assert v2.read().usage_bytes == (400 + i) * MIB
    assert open_fds(v2.path) == before  # nothing opened twice, nothing leaked
    assert v2.open_files == held


def test_close_closes_every_descriptor(tmp_path: Path) -> None:
    before = open_fds(tmp_path)
    cg = MemoryCgroup(write_files(tmp_path / "cg", v2_files()), version=2)
    cg.read()
    assert cg.pressure() is None  # no memory.pressure in this tree
    assert open_fds(tmp_path) > before
    cg.close()
    assert cg.open_files == 0 and open_fds(tmp_path) == before
    assert cg.read().usage_bytes == 300 * MIB  # and a later read opens them again
    cg.close()
    assert open_fds(tmp_path) == before


def test_cgroup_removed_and_created_again_is_read_afresh(tmp_path: Path) -> None:
    """The kernel gives a re-created cgroup new files; old descriptors would show the removed
    ones (or fail), so the next read must open the new files."""
    path = write_files(tmp_path / "cg", v2_files(current=300 * MIB, limit=LIMIT))
    cg = MemoryCgroup(path, version=2)
    assert cg.read().usage_bytes == 300 * MIB
    before = open_fds(tmp_path)
    shutil.rmtree(path)
    with pytest.raises(FileNotFoundError):  # gone: the source counts it as vanished
        cg.read()
    write_files(path, v2_files(current=123 * MIB, limit=2 * LIMIT, oom_kill=1))
    r = cg.read()
    assert (r.usage_bytes, r.limit_bytes, r.oom_kills) == (123 * MIB, 2 * LIMIT, 1)
    assert open_fds(tmp_path) <= before  # the old descriptors were closed, not kept beside the new
    cg.close()


def test_stale_descriptor_is_opened_again(v1: MemoryCgroup) -> None:
    v1.read()
    fd = v1._fds["memory.usage_in_bytes"]
    os.close(fd)  # what a removed cgroup's descriptor answers: an error on read
    (v1.path / "memory.usage_in_bytes").write_text(f"{77 * MIB}\n")
    assert v1.read(reset_peak=False).usage_bytes == 77 * MIB
    v1.close()
