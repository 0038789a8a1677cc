"""Signalling a process chosen earlier, without ever hitting another one that took its pid.

Pids are reused, so every signal goes through the same guard: the process's start time
(``/proc/<pid>/stat`` field 22) must still be the one recorded when the process was chosen.
Where the kernel has pidfds (Linux 5.3+) the pidfd is opened *before* that check and the
signal sent through it, so a pid that is recycled between the check and the signal cannot
be hit; elsewhere ``kill(2)`` follows the check.

Signals are sent in the agent's pid namespace and ``/proc`` is read at ``proc_root``: the
two must be the same view of the pids (on Kubernetes, ``hostPID: true`` with the host's
``/proc``), or no process is touched (every start-time check fails).
"""

from __future__ import annotations

import os
import signal as signal_mod
from pathlib import Path

from oomcast.collectors.procinfo import PROC, live_start_time


def send_signal(pid: int, start_time: int | None, signum: int, proc_root: Path | str = PROC) -> str:
    """Signal ``pid`` if it is still the process that started at ``start_time`` (None: any
    live process at that pid). Returns "sent", "gone", "reused" or "error: ...".
    Never pid 1 or below, never this process."""
    if pid <= 1 or pid == os.getpid():
        return "error: refusing to signal pid 1 or the agent itself"
    fd: int | None = None
    pidfd_open = getattr(os, "pidfd_open", None)
    pidfd_send = getattr(signal_mod, "pidfd_send_signal", None)
    if pidfd_open is not None and pidfd_send is not None:
        try:
            fd = pidfd_open(pid)
        except ProcessLookupError:
            return "gone"
        except OSError:  # ENOSYS on old kernels: fall back to kill(2)
            fd = None
    try:
        current = live_start_time(pid, proc_root)
        if current is None:
            return "gone"
        if start_time is not None and current != start_time:
            return "reused"
        if fd is not None:
            assert pidfd_send is not None
            pidfd_send(fd, signum)
        else:
            os.kill(pid, signum)
        return "sent"
    except ProcessLookupError:
        return "gone"
    except OSError as exc:
        return f"error: {exc.strerror or exc}"
    finally:
        if fd is not None:
            os.close(fd)


def protected_pids() -> set[int]:
    return {1, os.getpid(), os.getppid()}


def signal_name(signum: int) -> str:
    try:
        return signal_mod.Signals(signum).name
    except ValueError:
        return f"signal {signum}"
