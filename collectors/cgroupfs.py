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

A :class:`MemoryCgroup` keeps each file it reads open and reads it again from offset 0
(``pread``) at the next read: the kernel renders a cgroup file afresh for each read from the
start, and an open, read and close per file per tick was most of what the node agent spent.
A cgroup removed and created again under the same name is a different directory: its old
descriptors fail (``ENODEV`` on a real cgroupfs) or, in a fixture tree of plain files, keep
showing the removed files, so each read first checks that the directory is still the one the
descriptors came from (one ``stat``) and opens the files again when it is not, or when a
read fails as a stale descriptor does. :meth:`MemoryCgroup.close` closes them all.
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
# a v2 memory.stat is 1-3 KB; a read that fills this is followed by more reads
_READ_SIZE = 16384
# what a descriptor of a removed (or replaced) cgroup file answers
_STALE_ERRNOS = frozenset({errno.ENODEV, errno.ENOENT, errno.EBADF, errno.ESTALE})


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


def flat_value(text: str, key: str) -> int | None:
    """The value of the ``key value`` line for ``key`` in a flat-keyed file, or None; finds
    the one line it needs instead of parsing all (a v2 memory.stat has some 60)."""
    if text.startswith(key + " "):
        start = len(key) + 1
    else:
        at = text.find("\n" + key + " ")
        if at < 0:
            return None
        start = at + len(key) + 2
    end = text.find("\n", start)
    try:
        return int(text[start:end] if end >= 0 else text[start:])
    except ValueError:
        return None


def _read_text(path: Path) -> str:
    return path.read_text(encoding="ascii")


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
    pressure: Pressure | None = None  # read(with_pressure=True) on v2 with PSI only

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
        self._peak_path = str(self.path / "memory.peak")  # built once, not at every read
        self._peak_plain = False  # the peak's descriptor is a plain file (see _read_v2_peak)
        self._dir = str(self.path)  # what each read stats, converted once
        self._fds: dict[str, int] = {}  # file name -> descriptor kept open between reads
        self._dir_id: tuple[int, int] | None = None  # (st_dev, st_ino) they were opened in
        self._has_peak: bool | None = None  # v2 memory.peak exists (kernel 5.19+)
        # PSI averages move every 2 s: the same text as last time is the same Pressure
        self._psi: tuple[str, Pressure] | None = None
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
        """Close every descriptor this cgroup holds; a later read opens them again."""
        fds = list(self._fds.values())
        self._fds.clear()
        if self._peak_fd is not None:
            fds.append(self._peak_fd)
            self._peak_fd = None
        self._dir_id = None
        for fd in fds:
            with contextlib.suppress(OSError):
                os.close(fd)

    def __del__(self) -> None:
        # a safety net for a cgroup dropped without close() (a one-off read); the owners
        # that keep one for a while (the cgroup source, the recorder) close it themselves
        with contextlib.suppress(Exception):
            self.close()

    @property
    def open_files(self) -> int:
        """How many descriptors this cgroup holds open now (for tests and /metrics)."""
        return len(self._fds) + (self._peak_fd is not None)

    # --- kept-open files -------------------------------------------------------------------

    def _revalidate(self) -> None:
        """Forget the descriptors if the directory is not the one they were opened in (the
        cgroup was removed and created again); FileNotFoundError when it is gone."""
        st = os.stat(self._dir)
        ident = (st.st_dev, st.st_ino)
        if self._dir_id != ident:
            if self._dir_id is not None:
                self.close()
            self._dir_id = ident

    def _open(self, name: str) -> int:
        fd = os.open(self.path / name, os.O_RDONLY)
        self._fds[name] = fd
        return fd

    def _drop(self, name: str) -> None:
        fd = self._fds.pop(name, None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)

    def _text(self, name: str) -> str:
        """The whole of ``name``, read from its kept-open descriptor (opened on first use,
        and once more when the descriptor has gone stale)."""
        fd = self._fds.get(name)
        if fd is None:
            fd = self._open(name)
        try:
            data = os.pread(fd, _READ_SIZE, 0)  # the whole file, but for a huge one
            if len(data) == _READ_SIZE:
                data = _pread_all(fd)
        except OSError as exc:
            self._drop(name)
            if exc.errno not in _STALE_ERRNOS:
                raise OSError(exc.errno, f"cannot read {self.path / name}: {exc.strerror}") from exc
            data = _pread_all(self._open(name))
        try:
            return data.decode("ascii")
        except UnicodeDecodeError:
            raise CgroupError(f"{self.path / name}: not ASCII: {data[:40]!r}") from None

    def _int(self, name: str) -> int:
        text = self._text(name).strip()
        try:
            return int(text)
        except ValueError:
            raise CgroupError(f"{self.path / name}: expected a number, got {text[:40]!r}") from None

    # --- reading ---------------------------------------------------------------------------

    def limit(self) -> int | None:
        self._revalidate()
        return self._limit()

    def _limit(self) -> int | None:
        if self.version == 1:
            value = self._int("memory.limit_in_bytes")
            return None if value >= V1_UNLIMITED else value
        text = self._text("memory.max").strip()
        if text == "max":
            return None
        try:
            return int(text)
        except ValueError:
            raise CgroupError(f"{self.path / 'memory.max'}: unexpected {text[:40]!r}") from None

    def oom_kills(self) -> int:
        self._revalidate()
        return self._oom_kills()

    def _oom_kills(self) -> int:
        if self.version == 1:
            kills = flat_value(self._text("memory.oom_control"), "oom_kill")
            if kills is None:
                raise CgroupError(
                    f"{self.path / 'memory.oom_control'} has no oom_kill counter (kernel < 4.13?)"
                )
            return kills
        return flat_value(self._text("memory.events"), "oom_kill") or 0

    def read(self, reset_peak: bool = True, *, with_pressure: bool = False) -> Reading:
        """Read everything once, the OOM counter last; ``with_pressure`` adds the PSI (v2)
        as :meth:`pressure` reads it, without a second check of the directory."""
        self._revalidate()
        limit = self._limit()
        kills: int | None
        if self.version == 1:
            usage = self._int("memory.usage_in_bytes")
            stat = self._text("memory.stat")
            anon = flat_value(stat, "total_rss")
            if anon is None:
                anon = flat_value(stat, "rss")
            peak = self._read_v1_peak(reset_peak)
            retries: int | None = self._int("memory.failcnt")
            try:
                kills = self._oom_kills()
            except CgroupError:  # v1 without the counter: sample anyway, no OOM events
                kills = None
        else:
            usage = self._int("memory.current")
            anon = flat_value(self._text("memory.stat"), "anon")
            peak = self._read_v2_peak(reset_peak)
            events = self._text("memory.events")  # last: it holds the kills
            retries = flat_value(events, "max")
            kills = flat_value(events, "oom_kill") or 0
        return Reading(
            limit_bytes=limit,
            usage_bytes=usage,
            anon_bytes=anon,
            peak_bytes=peak,
            retries=retries,
            oom_kills=kills,
            pressure=self._pressure() if with_pressure else None,
        )

    def pressure(self) -> Pressure | None:
        """Memory PSI of this cgroup (v2 ``memory.pressure``); None where there is none (v1,
        or a kernel built without PSI)."""
        try:
            self._revalidate()
        except OSError:  # the cgroup is gone
            return None
        return self._pressure()

    def _pressure(self) -> Pressure | None:
        if self.version != 2:
            return None
        try:
            text = self._text("memory.pressure")
        except OSError:  # no PSI (psi=0 on the kernel command line)
            return None
        if self._psi is not None and self._psi[0] == text:
            return self._psi[1]
        pressure = parse_pressure(text)
        self._psi = (text, pressure)
        return pressure

    def _read_v1_peak(self, reset: bool) -> int | None:
        name = "memory.max_usage_in_bytes"
        if not reset:
            return self._int(name)
        if not self._peak_resettable:
            return None
        value = self._int(name)
        try:
            (self.path / name).write_text("0")
        except OSError:
            # a read-only mount (the node agent's): the figure would be the peak since the
            # cgroup was created, which is not what peak_bytes means
            self._peak_resettable = False
            return None
        return value

    def _read_v2_peak(self, reset: bool) -> int | None:
        if self._has_peak is None:
            self._has_peak = os.path.exists(self._peak_path)
        if not self._has_peak or (reset and not self._peak_resettable):
            return None
        if not reset:
            return self._int("memory.peak")
        # The v2 reset is per open file: reads through the descriptor that wrote see the
        # peak since that write, so keep one descriptor for the whole run.
        fd = self._peak_fd
        if fd is None:
            try:
                fd = self._peak_fd = os.open(self._peak_path, os.O_RDWR)
            except OSError:
                self._peak_resettable = False
                return None
            # A cgroupfs file has no size; a plain file (a fixture tree) has its text's,
            # and must be emptied before the reset is written over it. Asked once, here.
            self._peak_plain = os.fstat(fd).st_size > 0
        raw = os.pread(fd, 64, 0).decode("ascii").strip()
        try:
            value = int(raw)
        except ValueError:
            raise CgroupError(f"{self._peak_path}: expected a number, got {raw[:40]!r}") from None
        try:
            if self._peak_plain:
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, 0)
            os.pwrite(fd, b"0\n", 0)
        except OSError:
            # kernels before 6.12: memory.peak is read-only and means "since creation"
            self._peak_resettable = False
            return None
        return value


def _pread_all(fd: int) -> bytes:
    """The whole file behind ``fd`` from offset 0. A read shorter than asked for is the end
    (cgroupfs renders a file in one piece, and a regular file returns what it has)."""
    data = os.pread(fd, _READ_SIZE, 0)
    if len(data) < _READ_SIZE:
        return data
    chunks = [data]
    offset = len(data)
    while True:
        more = os.pread(fd, _READ_SIZE, offset)
        if not more:
            return b"".join(chunks)
        chunks.append(more)
        offset += len(more)


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
