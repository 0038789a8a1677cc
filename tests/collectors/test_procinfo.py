"""collectors/procinfo.py: pid -> job and priority from a /proc tree."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from oomcast.collectors.procinfo import (
    CgroupIdentity,
    ProcResolver,
    parse_cgroup_path,
    parse_environ,
    parse_proc_cgroup,
    parse_stat,
)

UID = "0d5c7b9e-1a2b-4c3d-8e9f-0123456789ab"
UID_ = UID.replace("-", "_")
STATIC_UID = "6c3f1e2d4b5a69788796a5b4c3d2e1f0"
CID = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
CID2 = "b" * 64


def write_proc(
    root: Path,
    pid: int,
    *,
    comm: str = "python3",
    start: int = 1000,
    cgroup: str | None = "0::/user.slice/user-1000.slice/session-3.scope\n",
    environ: dict[str, str] | None = None,
) -> Path:
    """A /proc/<pid> with the three files ProcResolver reads (None leaves a file out)."""
    d = root / str(pid)
    d.mkdir(parents=True, exist_ok=True)
    # fields 3..52 after the comm; field 22 (starttime) is the 20th of them
    rest = ["S", "1", str(pid), str(pid), "0", "-1", "4194560"] + ["0"] * 12 + [str(start)]
    rest += ["0"] * 30
    (d / "stat").write_text(f"{pid} ({comm}) {' '.join(rest)}\n")
    if cgroup is not None:
        (d / "cgroup").write_text(cgroup)
    env = {"PATH": "/usr/bin", **(environ or {})}
    (d / "environ").write_bytes(b"".join(f"{k}={v}".encode() + b"\0" for k, v in env.items()))
    return d


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


# -- cgroup paths ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "pod", "container"),
    [
        # cgroup v1, cgroupfs driver, each QoS class
        (f"/kubepods/burstable/pod{UID}/{CID}", UID, CID),
        (f"/kubepods/besteffort/pod{UID}/{CID}", UID, CID),
        (f"/kubepods/pod{UID}/{CID}", UID, CID),  # guaranteed
        # systemd driver (v1 or v2): the UID's dashes are underscores in slice names
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
            f"/cri-containerd-{CID}.scope",
            UID,
            CID,
        ),
        (f"/kubepods.slice/kubepods-pod{UID_}.slice/crio-{CID}.scope", UID, CID),
        (
            f"/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{UID_}.slice"
            f"/docker-{CID}.scope",
            UID,
            CID,
        ),
        # cgroup v2, cgroupfs driver
        (f"/kubepods/burstable/pod{UID}/{CID}", UID, CID),
        # seen from the agent's own cgroup namespace
        (f"/../../kubepods-besteffort-pod{UID_}.slice/cri-containerd-{CID}.scope", UID, CID),
        # a static pod: its UID is a 32-hex hash
        (
            f"/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{STATIC_UID}.slice",
            STATIC_UID,
            None,
        ),
        # the pod's own cgroup, no container level
        (f"/kubepods/burstable/pod{UID}", UID, None),
        # plain docker, v1 and v2
        (f"/docker/{CID}", None, CID),
        (f"/system.slice/docker-{CID}.scope", None, CID),
        (f"/machine.slice/libpod-{CID}.scope/container", None, CID),
        # nothing to find
        ("/user.slice/user-1000.slice/session-3.scope", None, None),
        ("/", None, None),
        ("/kubepods.slice/kubepods-burstable.slice", None, None),
    ],
)
def test_parse_cgroup_path(path: str, pod: str | None, container: str | None) -> None:
    ident = parse_cgroup_path(path)
    assert ident.pod_uid == pod
    assert ident.container_id == container
    assert ident.slurm_job is None


def test_parse_cgroup_path_takes_the_innermost_container_id() -> None:
    ident = parse_cgroup_path(f"/docker/{CID}/docker/{CID2}")
    assert ident.container_id == CID2


def test_parse_cgroup_path_ignores_hex_runs_that_are_not_ids() -> None:
    assert parse_cgroup_path("/system.slice/x-" + "a" * 65 + ".scope") == CgroupIdentity()
    assert parse_cgroup_path(f"/kubepods/burstable/pod{UID}x") == CgroupIdentity()
    assert parse_cgroup_path(f"/kubepods/burstable/xpod{UID}") == CgroupIdentity()


@pytest.mark.parametrize(
    "path",
    [
        "/slurm/uid_1000/job_4242/step_0/task_1",  # v1
        "/system.slice/slurmstepd.scope/job_4242/step_batch/user/task_0",  # v2
    ],
)
def test_parse_cgroup_path_finds_slurm_jobs(path: str) -> None:
    assert parse_cgroup_path(path).slurm_job == "4242"
    assert parse_cgroup_path(path.replace("slurm", "other")).slurm_job is None


def test_parse_proc_cgroup_v1_prefers_the_identifying_memory_hierarchy() -> None:
    text = (
        "12:pids:/kubepods/burstable/podX\n"
        f"11:memory:/kubepods/burstable/pod{UID}/{CID}\n"
        f"4:cpu,cpuacct:/kubepods/burstable/pod{UID}/{CID}\n"
        "1:name=systemd:/system.slice/containerd.service\n"
    )
    path, ident = parse_proc_cgroup(text)
    assert path == f"/kubepods/burstable/pod{UID}/{CID}"
    assert ident == CgroupIdentity(pod_uid=UID, container_id=CID)


def test_parse_proc_cgroup_hybrid_falls_back_from_an_empty_unified_line() -> None:
    text = f"0::/\n9:memory:/kubepods/pod{UID}/{CID}\n"
    path, ident = parse_proc_cgroup(text)
    assert path == f"/kubepods/pod{UID}/{CID}"
    assert ident.pod_uid == UID


def test_parse_proc_cgroup_without_identity_returns_the_unified_path() -> None:
    path, ident = parse_proc_cgroup("5:memory:/user.slice\n0::/user.slice/session-3.scope\n")
    assert path == "/user.slice/session-3.scope"
    assert not ident.known
    assert parse_proc_cgroup("") == (None, CgroupIdentity())
    assert parse_proc_cgroup("garbage\n") == (None, CgroupIdentity())


def test_parse_stat_counts_fields_after_the_last_parenthesis() -> None:
    rest = " ".join(["S"] + [str(i) for i in range(4, 22)] + ["987654"] + ["0"] * 30)
    assert parse_stat(f"77 (my (odd) name) {rest}") == ("my (odd) name", 987654)
    with pytest.raises(ValueError):
        parse_stat("77 no parens here")


def test_parse_environ() -> None:
    raw = b"A=1\0B=x=y\0junk\0=novalue\0C=\0"
    assert parse_environ(raw) == {"A": "1", "B": "x=y", "C": ""}


def test_parse_stat_reads_this_process_from_the_real_proc() -> None:
    if not Path("/proc/self/stat").exists():
        pytest.skip("no /proc on this system")
    info = ProcResolver().lookup(os.getpid())
    assert info.found and info.start_time is not None and info.start_time > 0
    assert info.comm  # python, pytest...
    assert info.pid == os.getpid()


# -- resolving pids --------------------------------------------------------------------------


def test_kubernetes_pod_process(tmp_path: Path) -> None:
    cgroup = (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
        f"/cri-containerd-{CID}.scope\n"
    )
    write_proc(tmp_path, 4242, comm="torchrun", start=5555, cgroup=cgroup)
    info = ProcResolver(tmp_path).lookup(4242)
    assert info.job == f"pod:{UID}"
    assert info.pod_uid == UID
    assert info.container_id == CID
    assert info.cgroup == cgroup.strip().removeprefix("0::")
    assert info.comm == "torchrun"
    assert info.start_time == 5555
    assert info.priority == 0
    assert info.found


def test_container_and_slurm_and_bare_process_jobs(tmp_path: Path) -> None:
    write_proc(tmp_path, 10, cgroup=f"0::/system.slice/docker-{CID}.scope\n")
    write_proc(tmp_path, 11, cgroup="0::/system.slice/slurmstepd.scope/job_77/step_0/user/task_0\n")
    write_proc(tmp_path, 12)
    resolver = ProcResolver(tmp_path)
    assert resolver.lookup(10).job == f"container:{CID[:12]}"
    assert resolver.lookup(11).job == "slurm:77"
    assert resolver.lookup(12).job == "pid:12"


def test_oomcast_job_in_the_environment_names_the_job(tmp_path: Path) -> None:
    write_proc(
        tmp_path, 10, cgroup=f"0::/kubepods/pod{UID}/{CID}\n", environ={"OOMCAST_JOB": "llama-ft"}
    )
    info = ProcResolver(tmp_path).lookup(10)
    assert info.job == "llama-ft"
    assert info.pod_uid == UID  # still recorded


def test_priority_from_globs_then_environment_then_default(tmp_path: Path) -> None:
    pod = f"0::/kubepods/burstable/pod{UID}/{CID}\n"
    write_proc(tmp_path, 1, cgroup=pod, environ={"OOMCAST_PRIORITY": "7"})
    write_proc(tmp_path, 2, cgroup=pod)
    write_proc(tmp_path, 3, comm="jupyter-lab")
    write_proc(tmp_path, 4, comm="python3")
    write_proc(tmp_path, 5, environ={"OOMCAST_PRIORITY": " -3 "})
    write_proc(tmp_path, 6, comm="jupyter-lab", environ={"OOMCAST_PRIORITY": "high"})
    write_proc(tmp_path, 7, comm="train", environ={"OOMCAST_PRIORITY": "7"})
    resolver = ProcResolver(
        tmp_path,
        priorities={"pod:0d5c*": 5, "jupyter*": -10, "pod:*": 1},
        default_priority=2,
    )
    # the operator's globs win: a job cannot make itself unsheddable from its environment
    assert resolver.lookup(1).priority == 5
    assert resolver.lookup(2).priority == 5  # first matching glob, not the later pod:*
    assert resolver.lookup(3).priority == -10  # a glob matches the comm too
    assert resolver.lookup(4).priority == 2  # nothing matches
    assert resolver.lookup(5).priority == -3  # no glob: the job's own variable counts
    assert resolver.lookup(6).priority == -10
    assert resolver.lookup(7).priority == 7


def test_priorities_must_be_integers(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'train-\\*' must be an integer"):
        ProcResolver(tmp_path, priorities={"train-*": "high"})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="recheck_s"):
        ProcResolver(tmp_path, recheck_s=10, max_age_s=1)


def test_vanished_pid_resolves_without_raising(tmp_path: Path) -> None:
    resolver = ProcResolver(tmp_path, priorities={"pid:*": 3})
    info = resolver.lookup(31337)
    assert info.job == "pid:31337"
    assert not info.found
    assert info.cgroup is None and info.comm is None and info.pod_uid is None
    assert info.priority == 3


def test_unreadable_files_are_skipped(tmp_path: Path) -> None:
    d = write_proc(tmp_path, 9, comm="worker", cgroup=None, environ=None)
    (d / "environ").unlink()
    (d / "environ").mkdir()  # reading it fails with an OSError, as EACCES would
    (d / "cgroup").mkdir()
    info = ProcResolver(tmp_path, priorities={"worker": 4}).lookup(9)
    assert info.found
    assert info.job == "pid:9"
    assert info.priority == 4
    assert info.cgroup is None


def test_garbled_stat_counts_as_vanished(tmp_path: Path) -> None:
    d = write_proc(tmp_path, 9)
    (d / "stat").write_text("9 (trunc")
    info = ProcResolver(tmp_path).lookup(9)
    assert not info.found and info.job == "pid:9"


# -- the cache -------------------------------------------------------------------------------


def test_cache_avoids_rereading_and_notices_pid_reuse(tmp_path: Path) -> None:
    clock = Clock()
    write_proc(tmp_path, 50, start=1000, cgroup=f"0::/kubepods/pod{UID}/{CID}\n")
    resolver = ProcResolver(tmp_path, recheck_s=1.0, max_age_s=60.0, clock=clock)
    first = resolver.lookup(50)
    assert first.job == f"pod:{UID}" and resolver.reads == 1

    # Within recheck_s nothing is read: not even a deleted directory is noticed.
    (tmp_path / "50" / "stat").unlink()
    clock.t += 0.5
    assert resolver.lookup(50) is first
    assert resolver.reads == 1

    # After recheck_s, the same start time confirms the entry without a full read.
    write_proc(tmp_path, 50, start=1000, cgroup="0::/elsewhere\n")
    clock.t += 1.0
    assert resolver.lookup(50) is first
    assert resolver.reads == 1

    # The pid now names another process (different start time): resolved afresh.
    write_proc(tmp_path, 50, start=2000, cgroup=f"0::/system.slice/docker-{CID2}.scope\n")
    clock.t += 1.0
    reused = resolver.lookup(50)
    assert reused.job == f"container:{CID2[:12]}"
    assert reused.start_time == 2000
    assert resolver.reads == 2


def test_cache_rereads_after_max_age_and_when_the_process_exits(tmp_path: Path) -> None:
    clock = Clock()
    write_proc(tmp_path, 60, start=1, environ={"OOMCAST_PRIORITY": "1"})
    resolver = ProcResolver(tmp_path, recheck_s=1.0, max_age_s=10.0, clock=clock)
    assert resolver.lookup(60).priority == 1
    write_proc(tmp_path, 60, start=1, environ={"OOMCAST_PRIORITY": "9"})  # same process
    clock.t += 5
    assert resolver.lookup(60).priority == 1
    clock.t += 6
    assert resolver.lookup(60).priority == 9
    assert resolver.reads == 2

    for f in (tmp_path / "60").iterdir():
        f.unlink()
    (tmp_path / "60").rmdir()
    clock.t += 2
    gone = resolver.lookup(60)
    assert not gone.found and gone.priority == 0
    # a vanished pid is cached too, so 10 Hz polling does not keep hitting /proc
    clock.t += 0.1
    assert resolver.lookup(60) is gone


def test_cache_forgets_pids_not_asked_about(tmp_path: Path) -> None:
    clock = Clock()
    for pid in (1, 2, 3):
        write_proc(tmp_path, pid)
    resolver = ProcResolver(tmp_path, recheck_s=1.0, max_age_s=10.0, clock=clock)
    for pid in (1, 2, 3):
        resolver.lookup(pid)
    assert len(resolver) == 3
    for _ in range(6):
        clock.t += 2
        resolver.lookup(1)
    assert len(resolver) == 1
    resolver.forget(1)
    assert len(resolver) == 0
