"""Run a real command in a fresh memory cgroup with a hard limit, sample it, write a trace.

This is how the host-memory OOM traces in ``training/traces/host`` were captured: the kernel,
not a simulator, decides when the job dies. One child cgroup is created per run under a
*root* (a cgroup directory this process may write), the limit is set, the child process
joins the cgroup between ``fork`` and ``exec`` (so even the interpreter start-up of the
workload is charged to it), and the cgroup is sampled every ``interval_s`` until the process
exits. The cgroup is removed afterwards, killing anything the workload left behind in it.

Both cgroup versions are read:

============== =============================== ===========================
field          v1                              v2
============== =============================== ===========================
total_bytes    memory.limit_in_bytes           memory.max
used_bytes     memory.usage_in_bytes           memory.current
allocated      memory.stat total_rss (or rss)  memory.stat anon
peak_bytes     memory.max_usage_in_bytes       memory.peak
alloc_retries  memory.failcnt                  memory.events ``max``
oom kills      memory.oom_control ``oom_kill`` memory.events ``oom_kill``
============== =============================== ===========================

The peak is reset after each read (v1: write 0 to ``memory.max_usage_in_bytes``; v2, kernel
6.12+: write to the same open ``memory.peak`` descriptor), so ``peak_bytes`` is the highest
use since the previous sample as DESIGN.md defines it. Where the kernel cannot reset the v2
peak, ``peak_bytes`` is left out rather than reporting a peak since creation.

An OOM is the cgroup's ``oom_kill`` counter rising above its value at creation. A tick reads
the counter *after* the usage figures, so a sample is only written when it was read entirely
before the kill; the tick that sees the counter rise writes the ``oom`` event (at the time it
was detected) instead, and sampling stops there. Runs without a kill have no event.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import os
import re
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import write_trace

V1_MOUNT = Path("/sys/fs/cgroup/memory")
V2_MOUNTS = (Path("/sys/fs/cgroup"), Path("/sys/fs/cgroup/unified"))
DEFAULT_INTERVAL_S = 0.2
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


def own_cgroup_path(proc_self_cgroup: Path = Path("/proc/self/cgroup")) -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"memory": "/a/b", "": "/c"}`` ("" = v2)."""
    out: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in proc_self_cgroup.read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3:
                for ctrl in parts[1].split(","):
                    out[ctrl] = parts[2]
    return out


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
class Reading:
    """One read of a memory cgroup's files."""

    limit_bytes: int | None  # None: unlimited
    usage_bytes: int
    anon_bytes: int | None
    peak_bytes: int | None
    retries: int | None
    oom_kills: int


class MemoryCgroup:
    """One memory cgroup directory of either version."""

    def __init__(self, path: Path | str, version: int | None = None) -> None:
        self.path = Path(path)
        self.version = version if version is not None else detect_version(self.path)
        if self.version not in (1, 2):
            raise ValueError(f"cgroup version must be 1 or 2, got {self.version}")
        self._peak_fd: int | None = None
        self._peak_resettable = True

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
            peak = _read_int(self.path / "memory.max_usage_in_bytes")
            if reset_peak:
                with contextlib.suppress(OSError):
                    (self.path / "memory.max_usage_in_bytes").write_text("0")
            retries: int | None = _read_int(self.path / "memory.failcnt")
        else:
            limit = self.limit()
            usage = _read_int(self.path / "memory.current")
            stat = parse_flat_keyed(_read_text(self.path / "memory.stat"))
            anon = stat.get("anon")
            peak = self._read_v2_peak(reset_peak)
            events = parse_flat_keyed(_read_text(self.path / "memory.events"))
            retries = events.get("max")
        return Reading(
            limit_bytes=limit,
            usage_bytes=usage,
            anon_bytes=anon,
            peak_bytes=peak,
            retries=retries,
            oom_kills=self.oom_kills(),
        )

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


class CgroupMonitor:
    """Turns reads of one cgroup into trace records: samples, then an ``oom`` event if the
    cgroup's OOM-kill counter rises above its value when the monitor started."""

    def __init__(
        self,
        cgroup: MemoryCgroup,
        *,
        node: str,
        job: str | None = None,
        device: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.cgroup = cgroup
        self.node = node
        self.job = job
        self.device = device or f"cgroup:/{cgroup.name}"
        self.clock = clock
        self.base_oom_kills = cgroup.oom_kills()
        self.records: list[Record] = []
        self.samples = 0
        self.oom_ts: float | None = None
        self.oom_kills = 0
        self.max_peak_bytes = 0
        self._last_ts = 0.0

    @property
    def oom(self) -> bool:
        return self.oom_ts is not None

    def _ts(self, now: float | None) -> float:
        ts = self.clock() if now is None else now
        ts = max(ts, self._last_ts + 1e-6)  # samples of a domain must be strictly ordered
        self._last_ts = ts
        return ts

    def tick(self, now: float | None = None) -> bool:
        """Sample once; True once an OOM kill has been seen (then nothing more is sampled)."""
        if self.oom:
            return True
        try:
            reading = self.cgroup.read()
        except FileNotFoundError:
            return False  # the cgroup is being torn down under us
        self.max_peak_bytes = max(self.max_peak_bytes, reading.peak_bytes or 0, reading.usage_bytes)
        if reading.oom_kills > self.base_oom_kills:
            self._mark_oom(reading.oom_kills, now)
            return True
        limit = reading.limit_bytes
        if limit is None:
            raise CgroupError(f"{self.cgroup.path} has no memory limit; nothing to forecast")
        self.records.append(
            Sample(
                ts=self._ts(now),
                node=self.node,
                device=self.device,
                kind="host",
                total_bytes=limit,
                used_bytes=reading.usage_bytes,
                allocated_bytes=reading.anon_bytes,
                peak_bytes=reading.peak_bytes,
                alloc_retries=reading.retries,
                job=self.job,
            )
        )
        self.samples += 1
        return False

    def finish(self, now: float | None = None) -> bool:
        """After the process exited: one last look at the OOM counter. True if it OOMed."""
        if not self.oom:
            with contextlib.suppress(FileNotFoundError):
                reading = self.cgroup.read()
                self.max_peak_bytes = max(self.max_peak_bytes, reading.peak_bytes or 0)
                if reading.oom_kills > self.base_oom_kills:
                    self._mark_oom(reading.oom_kills, now)
        return self.oom

    def mark_exit(self, now: float | None = None) -> None:
        """The job ended by itself, without an OOM: an ``exit`` event, so training knows that
        nothing followed (a trace that merely stops says nothing about what came after)."""
        self.records.append(
            Event(ts=self._ts(now), node=self.node, device=self.device, event="exit", job=self.job)
        )

    def _mark_oom(self, kills: int, now: float | None) -> None:
        ts = self._ts(now)
        self.oom_ts = ts
        self.oom_kills = kills - self.base_oom_kills
        self.records.append(
            Event(ts=ts, node=self.node, device=self.device, event="oom", job=self.job)
        )


def _wait_exit(proc: subprocess.Popen[Any], pidfd: int | None, timeout_s: float) -> bool:
    """Wait up to timeout_s for proc to exit, waking at once when it does. True if exited."""
    if proc.poll() is not None:
        return True
    if timeout_s <= 0:
        return False
    if pidfd is not None:
        select.select([pidfd], [], [], timeout_s)
    else:
        time.sleep(min(timeout_s, 0.02))
    return proc.poll() is not None


def record(
    cmd: Sequence[str],
    *,
    limit_bytes: int | str,
    out: Path | str | None = None,
    job: str | None = None,
    root: Path | str | None = None,
    name: str | None = None,
    interval_s: float = DEFAULT_INTERVAL_S,
    timeout_s: float | None = None,
    node: str | None = None,
    env: dict[str, str] | None = None,
    cwd: Path | str | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` in a new memory cgroup limited to ``limit_bytes`` and record it.

    Writes the trace to ``out`` (when given) and returns a summary: ``exit_code`` (negative:
    killed by that signal), ``oom``, ``oom_ts``, ``duration_s``, ``peak_bytes``, ``samples``,
    ``limit_bytes``, ``timed_out``, ``records`` (the trace records themselves).
    Raises CgroupUnavailable when no cgroup can be made here.
    """
    if not cmd:
        raise ValueError("no command to run")
    if interval_s <= 0:
        raise ValueError(f"interval_s must be positive, got {interval_s}")
    limit = parse_size(limit_bytes)
    root_path = Path(root) if root is not None else default_root()
    name = name or f"oomcast-{os.getpid()}-{time.time_ns() % 10**9}"
    cg = MemoryCgroup.create(root_path, name, limit)
    procs_file = str(cg.path / "cgroup.procs")

    def join_cgroup() -> None:  # runs in the child between fork and exec
        with open(procs_file, "w") as fh:
            fh.write(str(os.getpid()))

    proc: subprocess.Popen[Any] | None = None
    pidfd: int | None = None
    timed_out = False
    try:
        monitor = CgroupMonitor(cg, node=node or socket.gethostname(), job=job)
        try:
            proc = subprocess.Popen(
                list(cmd),
                preexec_fn=join_cgroup,  # joins before exec
                env=env,
                cwd=cwd,
                stdout=stdout,
                stderr=stderr,
            )
        except subprocess.SubprocessError as exc:
            raise CgroupUnavailable(f"cannot put the command in {cg.path}: {exc}") from exc
        started = time.time()
        with contextlib.suppress(OSError, AttributeError):
            pidfd = os.pidfd_open(proc.pid)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        next_tick = time.monotonic()
        while True:
            now_m = time.monotonic()
            if now_m >= next_tick:
                if monitor.tick():
                    break
                next_tick += interval_s
                if next_tick <= now_m:  # fell behind (a stalled machine): skip, don't burst
                    next_tick = now_m + interval_s
            if proc.poll() is not None:
                break
            if deadline is not None and now_m >= deadline:
                timed_out = True
                break
            wait = next_tick - time.monotonic()
            if deadline is not None:
                wait = min(wait, deadline - time.monotonic())
            _wait_exit(proc, pidfd, wait)
        if not _wait_exit(proc, pidfd, 0.0) and not monitor.oom:
            # timed out: stop it; whatever it did is not an OOM unless the kernel says so
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if not monitor.finish() and not timed_out and proc.returncode == 0:
            monitor.mark_exit()
        duration = time.time() - started
    finally:
        if pidfd is not None:
            os.close(pidfd)
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()
        cg.remove()
    if out is not None:
        write_trace(out, monitor.records)
    return {
        "exit_code": proc.returncode,
        "oom": monitor.oom,
        "oom_ts": monitor.oom_ts,
        "oom_kills": monitor.oom_kills,
        "started_ts": started,
        "duration_s": round(duration, 3),
        "peak_bytes": monitor.max_peak_bytes,
        "samples": monitor.samples,
        "limit_bytes": limit,
        "timed_out": timed_out,
        "cgroup": str(cg.path),
        "cgroup_version": cg.version,
        "records": monitor.records,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oomcast.training.cgroup_recorder",
        description="Run a command in a fresh memory cgroup with a hard limit and record"
        " its memory as an oomcast trace (an oom event if the kernel kills it).",
    )
    parser.add_argument("--limit", required=True, help="hard limit: 800M, 1.5G, bytes")
    parser.add_argument("--out", required=True, help="trace file (.jsonl or .jsonl.gz)")
    parser.add_argument("--job", default=None, help="job name written into every sample")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S, help="seconds")
    parser.add_argument("--timeout", type=float, default=None, help="kill after this long")
    parser.add_argument("--root", default=None, help="parent cgroup directory")
    parser.add_argument("--name", default=None, help="child cgroup name")
    parser.add_argument("cmd", nargs=argparse.REMAINDER, help="-- COMMAND ARGS...")
    args = parser.parse_args(argv)
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        parser.error("give the command to run after --")

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through record()'s cleanup

    signal.signal(signal.SIGTERM, on_term)
    try:
        result = record(
            cmd,
            limit_bytes=args.limit,
            out=args.out,
            job=args.job,
            root=args.root,
            name=args.name,
            interval_s=args.interval,
            timeout_s=args.timeout,
        )
    except CgroupUnavailable as exc:
        print(f"cgroup_recorder: {exc}", file=sys.stderr)
        return 2
    result.pop("records")
    print(
        f"cgroup_recorder: exit={result['exit_code']} oom={result['oom']}"
        f" duration={result['duration_s']:.1f}s peak={result['peak_bytes'] / 2**20:.0f}MiB"
        f" limit={result['limit_bytes'] / 2**20:.0f}MiB samples={result['samples']}"
        f" -> {args.out}",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
