"""Who is using a GPU: map a pid to its job and its priority, from ``/proc``.

NVML names the processes on a GPU by pid only. A forecast is about a *job* (a Kubernetes pod,
a container, a Slurm job), and shedding load needs to know which process matters least, so
each pid is resolved here:

* **job**: ``OOMCAST_JOB`` in the process's environment if set; else the pod UID found in its
  cgroup path (``pod:<uid>``; cgroup v1 and v2, cgroupfs and systemd drivers, whose slice
  names spell the UID with ``_``); else a Slurm job id (``slurm:<id>``); else a docker /
  containerd / CRI-O / podman container id (``container:<first 12 hex>``); else
  ``pid:<pid>``.
* **priority**: ``OOMCAST_PRIORITY=<int>`` in the environment; else the first glob of the
  configured mapping that matches the job name or the process name (``comm``); else the
  default. Higher means more important.

Processes come and go all the time, so a pid that vanished or cannot be read never raises:
it resolves to ``pid:<pid>`` with what could be read. The agent polls at up to 10 Hz, so
answers are cached per pid, keyed on the pid's start time (``/proc/<pid>/stat`` field 22)
because pids are reused: within ``recheck_s`` an answer is reused as is, after that one
``stat`` read confirms it is still the same process, and after ``max_age_s`` it is read
afresh.

NVML reports pids of the host's pid namespace, so in a container the agent needs the host's
``/proc`` (``hostPID: true`` on Kubernetes) for these lookups to find anything.
"""

from __future__ import annotations

import fnmatch
import logging
import re
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

PRIORITY_ENV = "OOMCAST_PRIORITY"
JOB_ENV = "OOMCAST_JOB"

# A pod UID is a UUID (systemd slice names write its dashes as underscores), or 32 hex digits
# for a static pod, whose UID is a hash of its manifest.
_POD_RE = re.compile(
    r"(?<![A-Za-z0-9])pod("
    r"[0-9a-f]{8}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{4}[-_][0-9a-f]{12}"
    r"|[0-9a-f]{32}"
    r")(?=$|[/.])"  # ends a path component or a slice name
)
# docker-<id>.scope, cri-containerd-<id>.scope, crio-<id>.scope, libpod-<id>.scope, /docker/<id>
_CONTAINER_RE = re.compile(r"(?<![0-9a-f])([0-9a-f]{64})(?![0-9a-f])")
_SLURM_JOB_RE = re.compile(r"(?<![A-Za-z0-9])job_(\d+)(?![0-9])")


@dataclass(frozen=True, slots=True)
class CgroupIdentity:
    """What a cgroup path says about the workload in it."""

    pod_uid: str | None = None
    container_id: str | None = None
    slurm_job: str | None = None

    @property
    def known(self) -> bool:
        return any((self.pod_uid, self.container_id, self.slurm_job))


@dataclass(frozen=True, slots=True)
class ProcInfo:
    """One process as far as the agent cares. ``start_time`` (clock ticks after boot) tells
    a pid's processes apart; it is ``None`` when the process had already gone."""

    pid: int
    job: str
    priority: int
    pod_uid: str | None = None
    container_id: str | None = None
    slurm_job: str | None = None
    cgroup: str | None = None
    comm: str | None = None
    start_time: int | None = None

    @property
    def found(self) -> bool:
        return self.start_time is not None


def parse_cgroup_path(path: str) -> CgroupIdentity:
    """Pod UID (with dashes), container id and Slurm job id named in one cgroup path."""
    pod = _POD_RE.search(path)
    containers = _CONTAINER_RE.findall(path)
    slurm = _SLURM_JOB_RE.search(path) if "slurm" in path else None
    return CgroupIdentity(
        pod_uid=pod.group(1).replace("_", "-") if pod else None,
        container_id=containers[-1] if containers else None,
        slurm_job=slurm.group(1) if slurm else None,
    )


def parse_proc_cgroup(text: str) -> tuple[str | None, CgroupIdentity]:
    """The cgroup path that best identifies the process, from ``/proc/<pid>/cgroup``.

    Lines are ``hierarchy:controllers:path``. On a hybrid host the v2 line (``0::``) may be
    just ``/`` while a v1 hierarchy holds the pod, so the first path that identifies
    something wins, looking at the v2 line, then the v1 memory line, then the others; with
    nothing identified, the v2 (else memory, else first) path is returned on its own.
    """
    ranked: list[tuple[int, str]] = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3 or not parts[2]:
            continue
        hierarchy, controllers, path = parts
        if hierarchy == "0" and controllers == "":
            rank = 0
        elif "memory" in controllers.split(","):
            rank = 1
        else:
            rank = 2
        ranked.append((rank, path))
    ranked.sort(key=lambda item: item[0])  # stable: file order within a rank
    for _, path in ranked:
        ident = parse_cgroup_path(path)
        if ident.known:
            return path, ident
    return (ranked[0][1] if ranked else None), CgroupIdentity()


def parse_environ(raw: bytes) -> dict[str, str]:
    """``/proc/<pid>/environ`` (NUL-separated ``KEY=value``) as a dict; junk entries skipped."""
    out: dict[str, str] = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key:
            out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
    return out


def parse_stat(text: str) -> tuple[str, int]:
    """(comm, start time) from ``/proc/<pid>/stat``. The comm is in parentheses and may hold
    spaces and parentheses itself, so fields are counted after the last ``)``."""
    open_paren = text.index("(")
    close_paren = text.rindex(")")
    comm = text[open_paren + 1 : close_paren]
    fields = text[close_paren + 2 :].split()
    return comm, int(fields[19])  # field 22 overall; fields[0] is field 3 (state)


def job_name(ident: CgroupIdentity, pid: int) -> str:
    if ident.pod_uid:
        return f"pod:{ident.pod_uid}"
    if ident.slurm_job:
        return f"slurm:{ident.slurm_job}"
    if ident.container_id:
        return f"container:{ident.container_id[:12]}"
    return f"pid:{pid}"


@dataclass(slots=True)
class _Entry:
    info: ProcInfo
    checked_at: float
    read_at: float
    used_at: float


class ProcResolver:
    """Resolves pids to :class:`ProcInfo` from ``proc_root``, with a cache that survives
    10 Hz polling and notices pid reuse."""

    def __init__(
        self,
        proc_root: Path | str = "/proc",
        *,
        priorities: Mapping[str, int] | None = None,
        default_priority: int = 0,
        recheck_s: float = 1.0,
        max_age_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if recheck_s < 0 or max_age_s < recheck_s:
            raise ValueError(
                f"need 0 <= recheck_s <= max_age_s, got recheck_s={recheck_s} max_age_s={max_age_s}"
            )
        self.proc_root = Path(proc_root)
        self.priorities = dict(priorities or {})
        for glob, value in self.priorities.items():
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(f"priority of {glob!r} must be an integer, got {value!r}")
        self.default_priority = default_priority
        self.recheck_s = recheck_s
        self.max_age_s = max_age_s
        self._clock = clock
        self._cache: dict[int, _Entry] = {}
        self._last_sweep = clock()
        self.reads = 0  # full resolutions (cgroup + environ reads), for tests and /metrics

    def __len__(self) -> int:
        return len(self._cache)

    def lookup(self, pid: int) -> ProcInfo:
        now = self._clock()
        entry = self._cache.get(pid)
        if entry is not None and now - entry.checked_at < self.recheck_s:
            entry.used_at = now
            return entry.info
        comm, start = self._stat(pid)
        if (
            entry is not None
            and start is not None
            and start == entry.info.start_time
            and now - entry.read_at < self.max_age_s
        ):
            entry.checked_at = entry.used_at = now
            return entry.info
        info = self._resolve(pid, comm, start)
        self._cache[pid] = _Entry(info, now, now, now)
        self._sweep(now)
        return info

    def forget(self, pid: int) -> None:
        self._cache.pop(pid, None)

    def _sweep(self, now: float) -> None:
        if now - self._last_sweep < self.max_age_s:
            return
        self._last_sweep = now
        stale = [pid for pid, e in self._cache.items() if now - e.used_at >= self.max_age_s]
        for pid in stale:
            del self._cache[pid]

    def _read(self, pid: int, name: str) -> bytes | None:
        try:
            return (self.proc_root / str(pid) / name).read_bytes()
        except OSError:  # gone (ENOENT, ESRCH) or not ours to read (EACCES)
            return None

    def _stat(self, pid: int) -> tuple[str | None, int | None]:
        raw = self._read(pid, "stat")
        if raw is None:
            return None, None
        try:
            comm, start = parse_stat(raw.decode("utf-8", "replace"))
        except (ValueError, IndexError):
            log.debug("unparsable %s/%d/stat: %r", self.proc_root, pid, raw[:200])
            return None, None
        return comm, start

    def _resolve(self, pid: int, comm: str | None, start: int | None) -> ProcInfo:
        self.reads += 1
        path: str | None = None
        ident = CgroupIdentity()
        env: dict[str, str] = {}
        if start is not None:
            raw_cgroup = self._read(pid, "cgroup")
            if raw_cgroup is not None:
                path, ident = parse_proc_cgroup(raw_cgroup.decode("utf-8", "replace"))
            raw_env = self._read(pid, "environ")
            if raw_env is not None:
                env = parse_environ(raw_env)
        job = env.get(JOB_ENV, "").strip() or job_name(ident, pid)
        return ProcInfo(
            pid=pid,
            job=job,
            priority=self._priority(pid, env, job, comm),
            pod_uid=ident.pod_uid,
            container_id=ident.container_id,
            slurm_job=ident.slurm_job,
            cgroup=path,
            comm=comm,
            start_time=start,
        )

    def _priority(self, pid: int, env: Mapping[str, str], job: str, comm: str | None) -> int:
        # The operator's configuration wins: a tenant must not be able to make its own job
        # unsheddable by setting a variable. The job's own OOMCAST_PRIORITY counts only
        # where no configured glob names it.
        for glob, value in self.priorities.items():
            if fnmatch.fnmatchcase(job, glob) or (
                comm is not None and fnmatch.fnmatchcase(comm, glob)
            ):
                return value
        raw = env.get(PRIORITY_ENV)
        if raw is not None:
            try:
                return int(raw.strip())
            except ValueError:
                log.warning(
                    "pid %d has %s=%r, not an integer; using the default priority",
                    pid,
                    PRIORITY_ENV,
                    raw,
                )
        return self.default_priority
