"""Everything the collectors read from ``/proc``: the one module that opens and parses it.

* **Other processes** (``/proc/<pid>/...`` under ``proc_root``): state and start time
  (``stat`` field 22, which tells a pid's processes apart, since pids are reused), the
  signals a process catches and its uids (``status``), its memory cgroup (``cgroup``), its
  resident memory (``statm``) and its environment (``environ``).
* **Who is using a GPU**: NVML names the processes on a GPU by pid only, and a forecast is
  about a *job* (a Kubernetes pod, a container, a Slurm job), so :class:`ProcResolver` maps
  a pid to its job and priority:

  - *job*: ``OOMCAST_JOB`` in the process's environment if set; else what its cgroup path
    names (:mod:`oomcast.collectors.jobnames`: ``pod:<uid>``, ``slurm:<id>``,
    ``container:<id>``); else ``pid:<pid>``.
  - *priority*: the first glob of the configured mapping that matches the job name or the
    process name (``comm``); else ``OOMCAST_PRIORITY=<int>`` in the environment; else the
    default. Higher means more important.

  A pid that vanished or cannot be read never raises: it resolves to ``pid:<pid>`` with
  what could be read. Answers are cached per pid, keyed on its start time: within
  ``recheck_s`` an answer is reused as is, after that one ``stat`` read confirms it is
  still the same process, and after ``max_age_s`` it is read afresh.
* **This process** (``/proc/self``, for the in-process hook): its cgroups, MemTotal, and its
  RSS and peak RSS through descriptors kept open (:class:`SelfMemory`).

NVML reports pids of the host's pid namespace, so in a container the agent needs the host's
``/proc`` (``hostPID: true`` on Kubernetes) for these lookups to find anything.
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
import os
import resource
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from oomcast.collectors.jobnames import CgroupIdentity, job_name, parse_cgroup_path

log = logging.getLogger(__name__)

PROC = Path("/proc")
PRIORITY_ENV = "OOMCAST_PRIORITY"
JOB_ENV = "OOMCAST_JOB"
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


# --- parsing (text in, values out) --------------------------------------------------------


def parse_cgroup_lines(text: str) -> list[tuple[str, list[str], str]]:
    """``/proc/<pid>/cgroup`` as (hierarchy, controllers, path) per line (v2: ``0``, [])."""
    out = []
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3:
            hierarchy, controllers, path = parts
            out.append((hierarchy, controllers.split(",") if controllers else [], path))
    return out


def parse_proc_cgroup(text: str) -> tuple[str | None, CgroupIdentity]:
    """The cgroup path that best identifies the process, from ``/proc/<pid>/cgroup``.

    On a hybrid host the v2 line (``0::``) may be just ``/`` while a v1 hierarchy holds the
    pod, so the first path that identifies something wins, looking at the v2 line, then the
    v1 memory line, then the others; with nothing identified, the v2 (else memory, else
    first) path is returned on its own.
    """
    ranked: list[tuple[int, str]] = []
    for hierarchy, controllers, path in parse_cgroup_lines(text):
        if not path:
            continue
        if hierarchy == "0" and not controllers:
            rank = 0
        elif "memory" in controllers:
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


def _stat_fields(text: str) -> list[str]:
    # The comm is in parentheses and may hold spaces and parentheses itself, so fields are
    # counted after the last ")": fields[0] is field 3 (state), fields[19] field 22.
    return text[text.rindex(")") + 2 :].split()


def parse_stat(text: str) -> tuple[str, int]:
    """(comm, start time in clock ticks after boot) from ``/proc/<pid>/stat``."""
    comm = text[text.index("(") + 1 : text.rindex(")")]
    return comm, int(_stat_fields(text)[19])


def parse_status(text: str) -> dict[str, str]:
    """``/proc/<pid>/status`` as ``{key: value}``."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key] = value.strip()
    return out


def _status_bytes(data: bytes, key: bytes) -> int:
    i = data.index(key) + len(key)
    return int(data[i : data.index(b"\n", i)].split()[0]) * 1024  # "VmRSS:  1234 kB"


# --- other processes: /proc/<pid>/... ------------------------------------------------------


def read_proc(pid: int | str, name: str, proc_root: Path | str = PROC) -> bytes | None:
    """``proc_root/<pid>/<name>``, or None when the process is gone or not ours to read."""
    try:
        return (Path(proc_root) / str(pid) / name).read_bytes()
    except OSError:  # ENOENT, ESRCH, EACCES
        return None


def _read_text(pid: int, name: str, proc_root: Path | str) -> str | None:
    raw = read_proc(pid, name, proc_root)
    return None if raw is None else raw.decode("utf-8", "replace")


def pid_exists(pid: int, proc_root: Path | str = PROC) -> bool:
    return (Path(proc_root) / str(pid)).exists()


def proc_state(pid: int, proc_root: Path | str = PROC) -> tuple[str, int] | None:
    """(state letter, start time in clock ticks after boot) of ``pid``, or None if gone."""
    text = _read_text(pid, "stat", proc_root)
    if text is None:
        return None
    try:
        fields = _stat_fields(text)
        return fields[0], int(fields[19])
    except (ValueError, IndexError):
        return None


def live_start_time(pid: int, proc_root: Path | str = PROC) -> int | None:
    """The start time of ``pid`` if it is alive (a zombie has exited: None)."""
    st = proc_state(pid, proc_root)
    if st is None or st[0] in ("Z", "X", "x"):
        return None
    return st[1]


def proc_status(pid: int, proc_root: Path | str = PROC) -> dict[str, str] | None:
    text = _read_text(pid, "status", proc_root)
    return None if text is None else parse_status(text)


def catches_signal(pid: int, signum: int, proc_root: Path | str = PROC) -> bool | None:
    """Whether ``pid`` has a handler installed for ``signum`` (``SigCgt``, a hex mask whose
    bit ``signum - 1`` is set when it does); None when its status cannot be read."""
    status = proc_status(pid, proc_root)
    if status is None or "SigCgt" not in status:
        return None
    try:
        mask = int(status["SigCgt"], 16)
    except ValueError:
        return None
    return bool(mask >> (signum - 1) & 1)


def proc_uids(pid: int, proc_root: Path | str = PROC) -> tuple[int, ...] | None:
    """(real, effective, saved, filesystem) uids of ``pid``, or None."""
    status = proc_status(pid, proc_root)
    if status is None or "Uid" not in status:
        return None
    try:
        return tuple(int(x) for x in status["Uid"].split())
    except ValueError:
        return None


def proc_memory_cgroup(pid: int, proc_root: Path | str = PROC) -> str | None:
    """The cgroup path that holds ``pid``'s memory: the v1 memory controller's line where
    there is one (on a hybrid host the v2 line names a hierarchy without that controller),
    else the v2 (``0::``) line."""
    text = _read_text(pid, "cgroup", proc_root)
    if text is None:
        return None
    v2 = None
    for hierarchy, controllers, path in parse_cgroup_lines(text):
        if "memory" in controllers:
            return path
        if hierarchy == "0" and not controllers:
            v2 = path
    return v2


def rss_bytes(pid: int, proc_root: Path | str = PROC) -> int | None:
    """Resident memory of ``pid`` (``statm`` field 2 × page size), or None if gone."""
    text = _read_text(pid, "statm", proc_root)
    if text is None:
        return None
    try:
        return int(text.split()[1]) * PAGE_BYTES
    except (ValueError, IndexError):
        return None


# --- this process: /proc/self and /proc/meminfo --------------------------------------------


def own_cgroup_path(proc_self_cgroup: Path = PROC / "self" / "cgroup") -> dict[str, str]:
    """This process's cgroup per controller: ``{"memory": "/a/b", "": "/c"}`` ("" = v2)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for _, controllers, path in parse_cgroup_lines(proc_self_cgroup.read_text()):
            for ctrl in controllers or [""]:
                out[ctrl] = path
    return out


def own_cgroup_lines(
    proc_self_cgroup: Path = PROC / "self" / "cgroup",
) -> list[tuple[str, list[str], str]]:
    """This process's ``/proc/self/cgroup``, parsed; [] when it cannot be read."""
    try:
        return parse_cgroup_lines(proc_self_cgroup.read_text())
    except OSError:
        return []


def meminfo_total_bytes(meminfo: Path = PROC / "meminfo") -> int | None:
    with contextlib.suppress(OSError, ValueError, IndexError):
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    return None


class SelfMemory:
    """This process's RSS, and its peak, through descriptors kept open (a pread costs
    microseconds; opening the file each time costs more). With the peak:
    ``/proc/self/status`` (VmRSS and VmHWM), then VmHWM is reset through
    ``/proc/self/clear_refs`` when ``peak_reset_s`` has passed since the previous reset (the
    reset takes the mmap lock: see :mod:`oomcast.collectors.hook`); without: the cheaper
    ``/proc/self/statm``; without /proc at all: ``ru_maxrss``."""

    def __init__(
        self,
        track_peak: bool,
        peak_reset_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.peak_reset_s = peak_reset_s
        self.clock = clock
        self.resets = 0  # writes to clear_refs (each takes the mmap lock)
        self._next_reset = 0.0
        self.statm_fd = self._open("/proc/self/statm", os.O_RDONLY)
        self.status_fd: int | None = None
        self.clear_fd: int | None = None
        if track_peak:
            self.status_fd = self._open("/proc/self/status", os.O_RDONLY)
            self.clear_fd = self._open("/proc/self/clear_refs", os.O_WRONLY)
            try:
                if self.status_fd is None or self.clear_fd is None:
                    raise OSError("not available")
                _status_bytes(os.pread(self.status_fd, 8192, 0), b"VmHWM:")
                self._reset_peak()  # fails here, once, where the kernel refuses it
            except (OSError, ValueError) as exc:
                log.info("oomcast hook: peak RSS cannot be reset here (%s); no peak sent", exc)
                self._close("status_fd")
                self._close("clear_fd")
        if self.statm_fd is None and self.clear_fd is None:
            log.warning("oomcast hook: no /proc/self; reporting ru_maxrss as used memory")

    @staticmethod
    def _open(path: str, flags: int) -> int | None:
        try:
            return os.open(path, flags)
        except OSError:
            return None

    def _reset_peak(self) -> None:
        assert self.clear_fd is not None
        os.write(self.clear_fd, b"5")  # 5: reset the peak RSS (Linux 4.0+)
        self.resets += 1
        self._next_reset = self.clock() + self.peak_reset_s

    def read(self) -> tuple[int, int | None]:
        """(rss, peak or None). The peak is the highest RSS since the last reset, which is at
        or before the previous read: the reset comes after VmHWM is read, so what a read
        returns covers everything up to it, and the next read starts where it ended."""
        if self.clear_fd is not None and self.status_fd is not None:
            data = os.pread(self.status_fd, 8192, 0)
            rss = _status_bytes(data, b"VmRSS:")
            peak = max(rss, _status_bytes(data, b"VmHWM:"))
            if self.clock() >= self._next_reset:
                try:
                    self._reset_peak()
                except OSError:  # the peak then covers more than it should, no harm done
                    self._next_reset = self.clock() + self.peak_reset_s
            return rss, peak
        if self.statm_fd is not None:
            return int(os.pread(self.statm_fd, 256, 0).split()[1]) * PAGE_BYTES, None
        scale = 1 if sys.platform == "darwin" else 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, None

    def _close(self, name: str) -> None:
        fd = getattr(self, name)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
            setattr(self, name, None)

    def close(self) -> None:
        for name in ("statm_fd", "status_fd", "clear_fd"):
            self._close(name)


# --- pid -> job and priority ----------------------------------------------------------------


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
        proc_root: Path | str = PROC,
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
        return read_proc(pid, name, self.proc_root)

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
