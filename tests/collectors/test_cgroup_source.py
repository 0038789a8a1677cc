"""collectors/sources/cgroup.py: discovery and sampling on fixture trees of both cgroup
versions, and on a real memory cgroup with a real OOM kill (skipped where none can be made)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from support import LIMIT, MIB, open_fds, v1_files, v2_files, wait_until, write_files

from oomcast.collectors.cgroupfs import (
    CgroupUnavailable,
    MemoryCgroup,
    parse_pressure,
)
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.model.schema import Event, Sample

POD = "pod0d5c7f5e-1111-2222-3333-444455556666"
CID = "a" * 64
PSI = (
    "some avg10=1.50 avg60=0.25 avg300=0.00 total=12345\n"
    "full avg10=0.50 avg60=0.10 avg300=0.00 total=678\n"
)


def v1_tree(root: Path) -> Path:
    """A v1 node: a limited pod whose container has no limit of its own, a container with a
    limit, an unlimited system service, and an empty limited cgroup (no processes)."""
    write_files(root, v1_files(limit=1 << 63) | {"memory.usage_in_bytes": 0})
    write_files(root / "kubepods", v1_files(limit=1 << 63))
    write_files(root / "kubepods" / POD, v1_files(limit=LIMIT))
    write_files(
        root / "kubepods" / POD / CID, v1_files(limit=1 << 63) | {"cgroup.procs": "101\n102"}
    )
    write_files(root / "docker" / ("b" * 64), v1_files(limit=256 * MIB) | {"cgroup.procs": "7"})
    write_files(
        root / "system.slice" / "sshd.service", v1_files(limit=1 << 63) | {"cgroup.procs": "9"}
    )
    write_files(root / "idle", v1_files(limit=64 * MIB))
    return root


def v2_tree(root: Path) -> Path:
    (root).mkdir(parents=True, exist_ok=True)
    (root / "cgroup.controllers").write_text("cpu io memory pids\n")
    (root / "cgroup.procs").write_text("1\n")
    leaf = (
        root
        / "kubepods.slice"
        / "kubepods-burstable.slice"
        / f"kubepods-burstable-{POD.replace('-', '_')}.slice"
        / f"cri-containerd-{CID}.scope"
    )
    for parent in list(reversed(leaf.relative_to(root).parents))[1:]:
        write_files(root / parent, v2_files(limit="max"))
    write_files(leaf, v2_files(limit=LIMIT) | {"cgroup.procs": "4242", "memory.pressure": PSI})
    return root


def samples(records: list[object]) -> list[Sample]:
    return [r for r in records if isinstance(r, Sample)]


def test_v1_discovery_maps_processes_to_the_nearest_limit(tmp_path: Path) -> None:
    src = CgroupSource("n1", v1_tree(tmp_path / "memory"))
    devices = src.scan()
    # the container without a limit is watched at its pod; the unlimited service and the
    # cgroup without processes are not domains
    assert devices == [f"cgroup:/docker/{'b' * 64}", f"cgroup:/kubepods/{POD}"]
    out = samples(src.poll(1000.0))
    by_device = {s.device: s for s in out}
    pod = by_device[f"cgroup:/kubepods/{POD}"]
    assert pod.kind == "host" and pod.total_bytes == LIMIT and pod.used_bytes == 300 * MIB
    assert pod.allocated_bytes == 250 * MIB
    # a v1 peak reset would reset it for every other reader too: no peak, nothing written
    assert pod.peak_bytes is None
    assert (tmp_path / "memory" / "kubepods" / POD / "memory.max_usage_in_bytes").read_text() == (
        f"{320 * MIB}\n"
    )
    assert pod.alloc_retries == 0 and pod.node == "n1"
    assert pod.job == f"pod:{POD.removeprefix('pod')}"  # the pod's UID names the job
    assert by_device[f"cgroup:/docker/{'b' * 64}"].total_bytes == 256 * MIB


def test_v2_discovery_psi_and_systemd_pod_names(tmp_path: Path) -> None:
    src = CgroupSource("n2", v2_tree(tmp_path / "cg"))
    [sample] = samples(src.poll(5.0))
    assert sample.device.startswith("cgroup:/kubepods.slice/") and sample.device.endswith(".scope")
    assert sample.total_bytes == LIMIT and sample.allocated_bytes == 250 * MIB
    assert sample.job == f"pod:{POD.removeprefix('pod')}"  # systemd's _ back to -
    [pressure] = src.pressure().values()
    assert pressure.some_avg10 == 1.5 and pressure.full_avg60 == 0.1
    assert pressure.some_total_us == 12345


def test_psi_is_read_once_a_second_however_fast_the_source_samples(tmp_path: Path) -> None:
    """The kernel renews PSI every 2 s and only /metrics shows it: at 10 Hz the source reads
    memory.pressure on every tenth poll; at 1 Hz (the default) on every one."""
    root = v2_tree(tmp_path / "cg")
    [leaf] = [p.parent for p in root.rglob("memory.pressure")]
    changed = PSI.replace("avg10=1.50", "avg10=7.00")
    for interval_s, polls_until_seen in ((0.1, 10), (1.0, 1)):
        (leaf / "memory.pressure").write_text(PSI)
        src = CgroupSource("n", root, interval_s=interval_s)
        now = 100.0
        assert samples(src.poll(now))  # the first poll reads it
        [first] = src.pressure().values()
        assert first.some_avg10 == 1.5
        (leaf / "memory.pressure").write_text(changed)
        seen_at = None
        for k in range(1, 21):
            now += interval_s
            assert samples(src.poll(now))  # every poll still samples the cgroup
            if seen_at is None and src.pressure()[next(iter(src.pressure()))].some_avg10 == 7.0:
                seen_at = k
        assert seen_at == polls_until_seen, interval_s
        src.close()


def test_interval_include_exclude(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "memory")
    src = CgroupSource("n", root, interval_s=1.0, exclude=("/docker/*",))
    assert [s.device for s in samples(src.poll(100.0))] == [f"cgroup:/kubepods/{POD}"]
    assert src.poll(100.5) == []  # not due yet
    assert len(samples(src.poll(101.0))) == 1
    only = CgroupSource("n", root, include=("/docker/*",))
    assert only.scan() == [f"cgroup:/docker/{'b' * 64}"]


def test_oom_kill_becomes_one_event_and_sampling_goes_on(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "memory")
    src = CgroupSource("n", root, interval_s=0.5, include=("/kubepods/*",))
    assert all(isinstance(r, Sample) for r in src.poll(10.0))
    oom_file = root / "kubepods" / POD / "memory.oom_control"
    oom_file.write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    records = src.poll(10.5)
    assert isinstance(records[0], Sample)
    [event] = [r for r in records if isinstance(r, Event)]
    assert (event.event, event.device, event.job) == (
        "oom",
        f"cgroup:/kubepods/{POD}",
        f"pod:{POD[3:]}",
    )
    assert event.ts >= records[0].ts
    assert not any(isinstance(r, Event) for r in src.poll(11.0))  # counted once
    assert src.stats.oom_kills == 1


def test_vanished_and_new_cgroups(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "memory")
    src = CgroupSource("n", root, rescan_s=5.0)
    assert len(samples(src.poll(0.0))) == 2
    docker = root / "docker" / ("b" * 64)
    for f in docker.iterdir():
        f.unlink()
    docker.rmdir()
    assert [s.device for s in samples(src.poll(1.0))] == [f"cgroup:/kubepods/{POD}"]
    assert src.stats.vanished == 1
    write_files(root / "docker" / ("c" * 64), v1_files(limit=128 * MIB) | {"cgroup.procs": "8"})
    assert len(samples(src.poll(2.0))) == 1  # found only at the next rescan
    assert len(samples(src.poll(6.0))) == 2


def test_unreadable_file_skips_that_domain_only(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "memory")
    src = CgroupSource("n", root)
    src.scan()
    (root / "kubepods" / POD / "memory.usage_in_bytes").write_text("garbage\n")
    assert [s.device for s in samples(src.poll(1.0))] == [f"cgroup:/docker/{'b' * 64}"]
    assert src.stats.read_errors == 1


def test_v1_kill_in_an_unlimited_container_counts_for_its_pod(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "memory")
    src = CgroupSource("n", root, include=("/kubepods/*",))
    src.poll(0.0)
    # v1 counts the kill on the victim's own cgroup (the container), not on the pod
    (root / "kubepods" / POD / CID / "memory.oom_control").write_text(
        "oom_kill_disable 0\nunder_oom 0\noom_kill 1\n"
    )
    [event] = [r for r in src.poll(1.0) if isinstance(r, Event)]
    assert event.device == f"cgroup:/kubepods/{POD}"


def v2_node(root: Path) -> Path:
    """A v2 node: kubepods.slice limited (node allocatable) with an unlimited container in
    it, and a pod whose limited container sits below it."""
    root.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("memory\n")
    write_files(root / "kubepods.slice", v2_files(limit=8 * LIMIT))
    write_files(
        root / "kubepods.slice" / "besteffort.scope", v2_files(limit="max") | {"cgroup.procs": "5"}
    )
    write_files(root / "kubepods.slice" / "pod-a.slice", v2_files(limit="max"))
    write_files(
        root / "kubepods.slice" / "pod-a.slice" / "c1.scope",
        v2_files(limit=LIMIT) | {"cgroup.procs": "6"},
    )
    return root


def set_v2_kills(path: Path, n: int) -> None:
    (path / "memory.events").write_text(f"low 0\nhigh 0\nmax 0\noom {n}\noom_kill {n}\n")


def test_v2_one_kill_is_one_event_on_the_domain_it_belongs_to(tmp_path: Path) -> None:
    root = v2_node(tmp_path / "cg")
    src = CgroupSource("n", root)
    assert src.scan() == ["cgroup:/kubepods.slice", "cgroup:/kubepods.slice/pod-a.slice/c1.scope"]
    src.poll(0.0)
    # the container's kill shows in every ancestor's hierarchical counter
    for p in (
        root / "kubepods.slice",
        root / "kubepods.slice" / "pod-a.slice",
        root / "kubepods.slice" / "pod-a.slice" / "c1.scope",
    ):
        set_v2_kills(p, 1)
    events = [r for r in src.poll(1.0) if isinstance(r, Event)]
    assert [e.device for e in events] == ["cgroup:/kubepods.slice/pod-a.slice/c1.scope"]


def test_v2_kill_of_a_container_removed_before_the_read_is_not_lost(tmp_path: Path) -> None:
    root = v2_node(tmp_path / "cg")
    src = CgroupSource("n", root, include=("/kubepods.slice/*",))
    src.poll(0.0)
    pod = root / "kubepods.slice" / "pod-a.slice"
    set_v2_kills(pod, 1)  # killed, and the runtime removed the container's cgroup at once
    for f in (pod / "c1.scope").iterdir():
        f.unlink()
    (pod / "c1.scope").rmdir()
    [event] = [r for r in src.poll(1.0) if isinstance(r, Event)]
    assert event.device == "cgroup:/kubepods.slice/pod-a.slice/c1.scope"
    assert src.stats.vanished_oom_kills == 1
    # a container that just ends, with no kill, vanishes quietly
    write_files(pod / "c2.scope", v2_files(limit=LIMIT) | {"cgroup.procs": "7"})
    src.poll(20.0)
    for f in (pod / "c2.scope").iterdir():
        f.unlink()
    (pod / "c2.scope").rmdir()
    assert not [r for r in src.poll(21.0) if isinstance(r, Event)]


def test_zero_limit_and_missing_kill_counter(tmp_path: Path) -> None:
    root = v1_tree(tmp_path / "memory")
    (root / "docker" / ("b" * 64) / "memory.limit_in_bytes").write_text("0\n")
    old = root / "kubepods" / POD
    (old / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")  # kernel < 4.13
    (old / CID / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\n")
    src = CgroupSource("n", root)
    # the zero-limit cgroup is no domain; the one without a counter is still sampled
    assert [s.device for s in samples(src.poll(1.0))] == [f"cgroup:/kubepods/{POD}"]


def test_root_that_is_not_a_cgroup_is_refused(tmp_path: Path) -> None:
    with pytest.raises(CgroupUnavailable, match="neither a cgroup v1 memory nor"):
        CgroupSource("n", tmp_path)


def test_parse_pressure() -> None:
    p = parse_pressure(PSI)
    assert (p.some_avg10, p.some_avg60, p.full_avg10, p.full_total_us) == (1.5, 0.25, 0.5, 678)


# --- a real cgroup and the real OOM killer -------------------------------------------------

GROW = """
import time
chunks = []
while True:
    chunks.append(b"\\x01" * (4 << 20))
    time.sleep(0.02)
"""


@pytest.fixture
def real_cgroup(make_cgroup: Any) -> MemoryCgroup:
    return make_cgroup("oomcast-src", 96 * MIB)


def test_real_oom_kill_is_seen_by_the_source(real_cgroup: MemoryCgroup) -> None:
    root = real_cgroup.path.parent
    src = CgroupSource("host", root, interval_s=0.05, include=(f"/{real_cgroup.name}",))

    def join() -> None:
        real_cgroup.add_pid(os.getpid())

    proc = subprocess.Popen([sys.executable, "-S", "-c", GROW], preexec_fn=join)
    try:
        seen: list[Sample] = []
        events: list[Event] = []

        def killed() -> bool:
            for r in src.poll(time.time()):
                (events if isinstance(r, Event) else seen).append(r)  # type: ignore[arg-type]
            return bool(events)

        assert wait_until(killed, timeout_s=30), "the kernel did not OOM-kill it within 30 s"
        assert proc.wait(timeout=10) == -9
    finally:
        if proc.poll() is None:
            proc.kill()
    [oom] = events
    assert oom.event == "oom" and oom.device == f"cgroup:/{real_cgroup.name}"
    assert seen and all(s.total_bytes == 96 * MIB for s in seen)
    assert max(s.used_bytes for s in seen) >= 0.7 * 96 * MIB


# --- kept-open files -----------------------------------------------------------------------


@pytest.mark.parametrize("version", [1, 2])
def test_no_descriptor_leak_over_many_ticks_and_rescans(tmp_path: Path, version: int) -> None:
    root = v1_tree(tmp_path / "memory") if version == 1 else v2_node(tmp_path / "cg")
    before = open_fds(tmp_path)
    src = CgroupSource("n", root, interval_s=0.25, rescan_s=0.5)  # a rescan every other tick
    src.poll(0.0)
    held = open_fds(tmp_path)
    assert held > before  # the files are kept open between ticks
    for i in range(1, 300):
        assert samples(src.poll(i * 0.25))
    assert open_fds(tmp_path) == held
    src.close()
    assert open_fds(tmp_path) == before


def test_container_removed_and_created_again_between_ticks_is_read_afresh(tmp_path: Path) -> None:
    root = v2_node(tmp_path / "cg")
    src = CgroupSource("n", root, include=("/kubepods.slice/*",), rescan_s=1000.0)
    c1 = root / "kubepods.slice" / "pod-a.slice" / "c1.scope"
    [s0] = samples(src.poll(0.0))
    assert s0.used_bytes == 300 * MIB
    shutil.rmtree(c1)  # the runtime restarts the container under the same cgroup name
    write_files(c1, v2_files(current=500 * MIB, limit=2 * LIMIT) | {"cgroup.procs": "9"})
    [s1] = samples(src.poll(1.0))
    assert (s1.device, s1.used_bytes, s1.total_bytes) == (s0.device, 500 * MIB, 2 * LIMIT)
    (c1 / "memory.current").write_text(f"{600 * MIB}\n")
    assert [s.used_bytes for s in samples(src.poll(2.0))] == [600 * MIB]
    src.close()


def test_a_kill_that_empties_its_cgroup_before_a_rescan_is_still_an_event(
    tmp_path: Path,
) -> None:
    """The OOM killer takes a container's only process: the cgroup is left empty, and the
    rescan due on the next tick no longer finds it (no processes). The kill must still be
    an event: the tick reads the counters of the domains it had before the rescan drops
    them. (A CI run lost an OOM this way, when the agent's loop had been held 3 s by a
    checkpoint request and the rescan came due on the same tick.)"""
    root = v1_tree(tmp_path / "memory")
    src = CgroupSource("n", root, interval_s=0.5, rescan_s=5.0, include=("/docker/*",))
    assert samples(src.poll(10.0))
    docker = root / "docker" / ("b" * 64)
    (docker / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 1\n")
    (docker / "cgroup.procs").write_text("")  # the victim was its only process
    records = src.poll(15.5)  # a rescan is due on this tick
    events = [r for r in records if isinstance(r, Event)]
    assert [(e.event, e.device) for e in events] == [("oom", f"cgroup:/docker/{'b' * 64}")]
    assert src.stats.oom_kills == 1
    assert src.poll(16.0) == []  # the empty cgroup is gone from the domains now
    src.close()
