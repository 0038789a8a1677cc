"""Read memory cgroups of either version: limits, usage, peaks, OOM kills, pressure.

Shared by the node agent's cgroup source (``collectors/sources/cgroup.py``) and the trace
recorder that runs workloads under a limit (``training/cgroup_recorder.py``).

============== =============================== ===========================
field          v1                              v2
============== =============================== ===========================
total_bytes    memory.limit_in_bytes           memory.max
used_bytes     memory.usage_in_bytes           memory.current
allocated      memory.stat total_rss (or rss)  memory.stat anon
peak_bytes     memory.max_usage_in_bytes       memory.peak
alloc_retries  memory.failcnt                  memory.events ``max``
oom kills      memory.oom_control ``oom_kill`` memory.events ``oom_kill``
pressure       (none)                          memory.pressure (PSI)
============== =============================== ===========================

The peak is reset after each read (v1: write 0 to ``memory.max_usage_in_bytes``; v2, kernel
6.12+: write to the same open ``memory.peak`` descriptor), so ``peak_bytes`` is the highest
use since the previous read. Where the kernel cannot reset the v2 peak, or the reader may not
write (a read-only mount, as the node agent has), ``peak_bytes`` is left out rather than
reporting a peak since creation.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from oomcast.collectors.procinfo import own_cgroup_path
from oomcast.model.schema import Sample

V1_MOUNT = Path("/sys/fs/cgroup/memory")
V2_MOUNTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
V1_UNLIMITED = 1 << 62  # v1 reports "no limit" as PAGE_COUNTER_MAX pages, ~9.2e18 bytes
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


class CgroupUnavailable(RuntimeError):
    """No writable memory cgroup here (not mounted, read-only, no permission, no memory
    controller). Tests turn this into ``pytest.skip(str(exc))``."""


class CgroupError(RuntimeError):
    """A cgroup file that exists but does not say what the kernel documents."""


def parse_size(text: str | int) -> int:
    """``800M``, ``1.5G``, ``64MiB``, ``1048576`` -> bytes (binary units)."""
    if isinstance(text, int):
        return text
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"not a size: {text!r} (try 800M, 1.5G or a number of bytes)")
    value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value <= 0:
        raise ValueError(f"size must be positive, got {text!r}")
    return value


def parse_flat_keyed(text: str) -> dict[str, int]:
    """Parse ``key value`` lines (memory.stat, memory.events, memory.oom_control)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) != 2:
            continue
        try:
            out[parts[0]] = int(parts[1])
        except ValueError:
            continue
    return out


def _read_text(path: Path) -> str:
    return path.read_text(encoding="ascii")


def _read_int(path: Path) -> int:
    text = _read_text(path).strip()
    try:
        return int(text)
    except ValueError:
        raise CgroupError(f"{path}: expected a number, got {text[:40]!r}") from None


def detect_version(root: Path | str) -> int:
    """1 or 2 for a memory cgroup directory (a mount or any cgroup below one)."""
    root = Path(root)
    if not root.is_dir():
        raise CgroupUnavailable(f"{root} is not a directory; no cgroup mounted there")
    if (root / "memory.usage_in_bytes").exists():
        return 1
    if (root / "memory.current").exists():  # a v2 cgroup whose parent delegates memory
        return 2
    if (root / "cgroup.controllers").exists():
        controllers = _read_text(root / "cgroup.controllers").split()
        if "memory" not in controllers:
            raise CgroupUnavailable(
                f"{root} is cgroup v2 without the memory controller (controllers:"
                f" {' '.join(controllers) or 'none'}); it is probably bound to a v1 hierarchy"
            )
        return 2
    raise CgroupUnavailable(f"{root} is neither a cgroup v1 memory nor a cgroup v2 directory")


def default_root() -> Path:
    """Where to create run cgroups when no root is given.

    v1: below this process's own memory cgroup, so the runs stay inside whatever contains
    us (a container, a CI job) and are charged to it too; the v1 mount if that is not
    writable. v2: the mount that has the memory controller.
    """
    own = own_cgroup_path()
    if V1_MOUNT.is_dir() and (V1_MOUNT / "memory.usage_in_bytes").exists():
        mine = V1_MOUNT / own.get("memory", "/").lstrip("/")
        for cand in (mine, V1_MOUNT):
            if cand.is_dir() and os.access(cand, os.W_OK):
                return cand
        return V1_MOUNT
    for mount in V2_MOUNTS:
        if (mount / "cgroup.controllers").exists():
            with contextlib.suppress(OSError):
                if "memory" in _read_text(mount / "cgroup.controllers").split():
                    return mount
    raise CgroupUnavailable(
        f"no memory cgroup found: neither {V1_MOUNT} (v1) nor a cgroup v2 mount"
        f" ({', '.join(map(str, V2_MOUNTS))}) with the memory controller"
    )


@dataclass(frozen=True, slots=True)
class Pressure:
    """Memory pressure stall information: the share of wall time (0-100) in which some, or
    all, runnable tasks of the cgroup waited for memory, averaged over 10 s and 60 s, and the
    total stall time in microseconds."""

    some_avg10: float
    some_avg60: float
    full_avg10: float
    full_avg60: float
    some_total_us: int
    full_total_us: int


def parse_pressure(text: str) -> Pressure:
    """``some avg10=0.12 avg60=0.05 avg300=0.00 total=1234`` and a ``full`` line."""
    lines: dict[str, dict[str, str]] = {}
    for line in text.splitlines():
        parts = line.split()
        if parts and parts[0] in ("some", "full"):
            lines[parts[0]] = dict(kv.split("=", 1) for kv in parts[1:] if "=" in kv)
    if "some" not in lines:
        raise CgroupError(f"not a PSI file: {text[:60]!r}")
    some, full = lines["some"], lines.get("full", {})
    try:
        return Pressure(
            some_avg10=float(some.get("avg10", 0)),
            some_avg60=float(some.get("avg60", 0)),
            full_avg10=float(full.get("avg10", 0)),
            full_avg60=float(full.get("avg60", 0)),
            some_total_us=int(some.get("total", 0)),
            full_total_us=int(full.get("total", 0)),
        )
    except ValueError:
        raise CgroupError(f"not a PSI file: {text[:60]!r}") from None


@dataclass(frozen=True, slots=True)
class Reading:
    """One read of a memory cgroup's files."""

    limit_bytes: int | None  # None: unlimited
    usage_bytes: int
    anon_bytes: int | None
    peak_bytes: int | None
    retries: int | None
    oom_kills: int | None  # None: this kernel keeps no OOM-kill counter (v1 before 4.13)

    def sample(self, ts: float, node: str, device: str, job: str | None) -> Sample:
        """This read as a trace sample: the limit is the capacity (it must have one)."""
        if self.limit_bytes is None:
            raise CgroupError(f"{device} has no memory limit; nothing to forecast")
        return Sample(
            ts=ts,
            node=node,
            device=device,
            kind="host",
            total_bytes=self.limit_bytes,
            used_bytes=self.usage_bytes,
            allocated_bytes=self.anon_bytes,
            peak_bytes=self.peak_bytes,
            alloc_retries=self.retries,
            job=job,
        )


class MemoryCgroup:
    """One memory cgroup directory of either version."""

    def __init__(
        self, path: Path | str, version: int | None = None, *, shared_reset: bool = True
    ) -> None:
        self.path = Path(path)
        self.version = version if version is not None else detect_version(self.path)
        if self.version not in (1, 2):
            raise ValueError(f"cgroup version must be 1 or 2, got {self.version}")
        self._peak_fd: int | None = None
        # v1 resets the peak for every reader of the cgroup (cAdvisor's max_usage too); a
        # reader that must not disturb others (the node agent) passes shared_reset=False and
        # gets no v1 peak. The v2 reset is private to the descriptor, so it is always fine.
        self._peak_resettable = shared_reset or self.version == 2

    @property
    def name(self) -> str:
        return self.path.name

    def __repr__(self) -> str:
        return f"MemoryCgroup({str(self.path)!r}, v{self.version})"

    # --- creation and membership ---------------------------------------------------------

    @classmethod
    def create(cls, root: Path | str, name: str, limit_bytes: int) -> MemoryCgroup:
        """Make ``root/name`` with a hard memory limit; CgroupUnavailable when we may not."""
        root = Path(root)
        version = detect_version(root)
        if "/" in name or name in ("", ".", ".."):
            raise ValueError(f"cgroup name must be one path component, got {name!r}")
        path = root / name
        if version == 2:
            _enable_v2_memory(root)
        try:
            path.mkdir()
        except FileExistsError:
            raise CgroupError(f"{path} already exists; pick another name or remove it") from None
        except OSError as exc:
            raise CgroupUnavailable(f"cannot create cgroup {path}: {exc.strerror}") from exc
        cg = cls(path, version)
        try:
            cg.set_limit(limit_bytes)
        except BaseException:
            cg.remove()
            raise
        return cg

    def set_limit(self, limit_bytes: int) -> None:
        fname = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        try:
            (self.path / fname).write_text(str(int(limit_bytes)), encoding="ascii")
        except OSError as exc:
            raise CgroupUnavailable(f"cannot set {self.path / fname}: {exc.strerror}") from exc
        # without swap the v1 memsw limit does not matter; with swap, cap it too so the
        # limit is a real wall and not a slow descent into swapping
        if self.version == 1 and (self.path / "memory.memsw.limit_in_bytes").exists():
            with contextlib.suppress(OSError):
                (self.path / "memory.memsw.limit_in_bytes").write_text(str(int(limit_bytes)))
        if self.version == 2 and (self.path / "memory.swap.max").exists():
            with contextlib.suppress(OSError):
                (self.path / "memory.swap.max").write_text("0")

    def add_pid(self, pid: int) -> None:
        with open(self.path / "cgroup.procs", "w", encoding="ascii") as fh:
            fh.write(str(pid))

    def pids(self) -> list[int]:
        try:
            text = _read_text(self.path / "cgroup.procs")
        except FileNotFoundError:
            return []
        return [int(x) for x in text.split()]

    def kill_all(self, timeout_s: float = 5.0) -> None:
        """SIGKILL whatever is left in the cgroup (what the run started) and wait for it."""
        deadline = time.monotonic() + timeout_s
        while True:
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            if time.monotonic() > deadline:
                return
            time.sleep(0.02)

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left, then remove the directory (retrying while tasks exit)."""
        self.close()
        if not self.path.exists():
            return
        self.kill_all(timeout_s)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self.path.rmdir()
                return
            except FileNotFoundError:
                return
            except OSError as exc:
                if exc.errno not in (errno.EBUSY, errno.EAGAIN) or time.monotonic() > deadline:
                    raise CgroupError(f"cannot remove {self.path}: {exc.strerror}") from exc
                time.sleep(0.05)

    def close(self) -> None:
        if self._peak_fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._peak_fd)
            self._peak_fd = None

    # --- reading ---------------------------------------------------------------------------

    def limit(self) -> int | None:
        if self.version == 1:
            value = _read_int(self.path / "memory.limit_in_bytes")
            return None if value >= V1_UNLIMITED else value
        text = _read_text(self.path / "memory.max").strip()
        if text == "max":
            return None
        try:
            return int(text)
        except ValueError:
            raise CgroupError(f"{self.path / 'memory.max'}: unexpected {text[:40]!r}") from None

    def oom_kills(self) -> int:
        if self.version == 1:
            fields = parse_flat_keyed(_read_text(self.path / "memory.oom_control"))
            if "oom_kill" not in fields:
                raise CgroupError(
                    f"{self.path / 'memory.oom_control'} has no oom_kill counter (kernel < 4.13?)"
                )
        else:
            fields = parse_flat_keyed(_read_text(self.path / "memory.events"))
        return fields.get("oom_kill", 0)

    def read(self, reset_peak: bool = True) -> Reading:
        """Read everything once; the OOM counter is read last (see the module docstring)."""
        if self.version == 1:
            limit = self.limit()
            usage = _read_int(self.path / "memory.usage_in_bytes")
            stat = parse_flat_keyed(_read_text(self.path / "memory.stat"))
            anon = stat.get("total_rss", stat.get("rss"))
            peak = self._read_v1_peak(reset_peak)
            retries: int | None = _read_int(self.path / "memory.failcnt")
        else:
            limit = self.limit()
            usage = _read_int(self.path / "memory.current")
            stat = parse_flat_keyed(_read_text(self.path / "memory.stat"))
            anon = stat.get("anon")
            peak = self._read_v2_peak(reset_peak)
            events = parse_flat_keyed(_read_text(self.path / "memory.events"))
            retries = events.get("max")
        try:
            kills: int | None = self.oom_kills()
        except CgroupError:  # v1 without the counter: sample anyway, no OOM events
            kills = None
        return Reading(
            limit_bytes=limit,
            usage_bytes=usage,
            anon_bytes=anon,
            peak_bytes=peak,
            retries=retries,
            oom_kills=kills,
        )

    def pressure(self) -> Pressure | None:
        """Memory PSI of this cgroup (v2 ``memory.pressure``); None where there is none (v1,
        or a kernel built without PSI)."""
        if self.version != 2:
            return None
        try:
            return parse_pressure(_read_text(self.path / "memory.pressure"))
        except (FileNotFoundError, OSError):  # no PSI (psi=0 on the kernel command line)
            return None

    def _read_v1_peak(self, reset: bool) -> int | None:
        path = self.path / "memory.max_usage_in_bytes"
        if not reset:
            return _read_int(path)
        if not self._peak_resettable:
            return None
        value = _read_int(path)
        try:
            path.write_text("0")
        except OSError:
            # a read-only mount (the node agent's): the figure would be the peak since the
            # cgroup was created, which is not what peak_bytes means
            self._peak_resettable = False
            return None
        return value

    def _read_v2_peak(self, reset: bool) -> int | None:
        path = self.path / "memory.peak"
        if not path.exists():
            return None
        if not reset:
            return _read_int(path)
        if not self._peak_resettable:
            return None
        # The v2 reset is per open file: reads through the descriptor that wrote see the
        # peak since that write, so keep one descriptor for the whole run.
        if self._peak_fd is None:
            try:
                self._peak_fd = os.open(path, os.O_RDWR)
            except OSError:
                self._peak_resettable = False
                return None
        raw = os.pread(self._peak_fd, 64, 0).decode("ascii").strip()
        try:
            value = int(raw)
        except ValueError:
            raise CgroupError(f"{path}: expected a number, got {raw[:40]!r}") from None
        try:
            with contextlib.suppress(OSError):
                os.ftruncate(self._peak_fd, 0)  # a plain file (fixtures); harmless on kernfs
            os.pwrite(self._peak_fd, b"0\n", 0)
        except OSError:
            # kernels before 6.12: memory.peak is read-only and means "since creation"
            self._peak_resettable = False
            return None
        return value


def _enable_v2_memory(root: Path) -> None:
    """Children of a v2 cgroup only get memory.* files if the parent delegates memory."""
    ctl = root / "cgroup.subtree_control"
    if not ctl.exists():
        return
    if "memory" in _read_text(ctl).split():
        return
    try:
        ctl.write_text("+memory", encoding="ascii")
    except OSError as exc:
        raise CgroupUnavailable(
            f"cannot enable the memory controller in {ctl}: {exc.strerror} (a v2 cgroup with"
            " processes of its own cannot delegate controllers; use a leaf-free root)"
        ) from exc
