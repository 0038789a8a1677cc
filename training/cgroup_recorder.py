"""Run a real command in a fresh memory cgroup with a hard limit, sample it, write a trace.

This is how the host-memory OOM traces in ``training/traces/host`` were captured: the kernel,
not a simulator, decides when the job dies. One child cgroup is created per run under a
*root* (a cgroup directory this process may write), the limit is set, the child process
joins the cgroup between ``fork`` and ``exec`` (so even the interpreter start-up of the
workload is charged to it), and the cgroup is sampled every ``interval_s`` until the process
exits. The cgroup is removed afterwards, killing anything the workload left behind in it.

Both cgroup versions are read, through ``collectors/cgroupfs.py`` (its docstring maps each
trace field to the v1 and v2 files). Each read resets the peak, so ``peak_bytes`` is the
highest use since the previous sample as DESIGN.md defines it; where the kernel cannot reset
it, ``peak_bytes`` is left out rather than reporting a peak since creation.

An OOM is the cgroup's ``oom_kill`` counter rising above its value at creation. A tick reads
the counter *after* the usage figures, so a sample is only written when it was read entirely
before the kill; the tick that sees the counter rise writes the ``oom`` event (at the time it
was detected) instead, and sampling stops there. Runs without a kill have no event.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from oomcast.collectors.cgroupfs import (  # noqa: F401  (re-exported)
    V1_MOUNT,
    CgroupError,
    CgroupUnavailable,
    MemoryCgroup,
    Reading,
    default_root,
    detect_version,
    parse_flat_keyed,
    parse_size,
)
from oomcast.model.schema import Event, Record
from oomcast.model.trace import write_trace

DEFAULT_INTERVAL_S = 0.2


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
        kills = reading.oom_kills or 0  # never None here: __init__ read the counter
        if kills > self.base_oom_kills:
            self._mark_oom(kills, now)
            return True
        if reading.limit_bytes is None:
            raise CgroupError(f"{self.cgroup.path} has no memory limit; nothing to forecast")
        self.records.append(reading.sample(self._ts(now), self.node, self.device, self.job))
        self.samples += 1
        return False

    def finish(self, now: float | None = None) -> bool:
        """After the process exited: one last look at the OOM counter. True if it OOMed."""
        if not self.oom:
            with contextlib.suppress(FileNotFoundError):
                reading = self.cgroup.read()
                self.max_peak_bytes = max(self.max_peak_bytes, reading.peak_bytes or 0)
                if (reading.oom_kills or 0) > self.base_oom_kills:
                    self._mark_oom(reading.oom_kills or 0, now)
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


def _watch(
    proc: subprocess.Popen[Any],
    pidfd: int | None,
    monitor: CgroupMonitor,
    interval_s: float,
    timeout_s: float | None,
) -> bool:
    """Tick ``monitor`` every ``interval_s`` until the command exits, the cgroup OOMs or
    ``timeout_s`` passes; True when it timed out."""
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    next_tick = time.monotonic()
    while True:
        now_m = time.monotonic()
        if now_m >= next_tick:
            if monitor.tick():
                return False
            next_tick += interval_s
            if next_tick <= now_m:  # fell behind (a stalled machine): skip, don't burst
                next_tick = now_m + interval_s
        if proc.poll() is not None:
            return False
        if deadline is not None and now_m >= deadline:
            return True
        wait = next_tick - time.monotonic()
        if deadline is not None:
            wait = min(wait, deadline - time.monotonic())
        _wait_exit(proc, pidfd, wait)


def _reap(
    proc: subprocess.Popen[Any], pidfd: int | None, monitor: CgroupMonitor, timed_out: bool
) -> None:
    """Stop the command if it still runs, wait for it, and end the monitor's trace."""
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
    cpus: Sequence[int] | None = None,
) -> dict[str, Any]:
    """Run ``cmd`` in a new memory cgroup limited to ``limit_bytes`` and record it
    (``cpus``: pin the command, and every process it starts, to those processors).

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
        if cpus is not None:
            os.sched_setaffinity(0, cpus)

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
        timed_out = _watch(proc, pidfd, monitor, interval_s, timeout_s)
        _reap(proc, pidfd, monitor, timed_out)
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
