"""What a command's domain holds: the candidate processes an action may act on.

A GPU domain's processes come from the NVML source's latest poll (for a checkpoint, the
job's processes on every GPU of the node, since all its ranks must save); a
``cgroup:<path>`` domain's from ``cgroup.procs`` of that cgroup and every cgroup below it,
with their resident memory as ``used_bytes``.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomcast.collectors.actiontypes import Candidate, as_candidate
from oomcast.collectors.procinfo import PROC, ProcResolver, pid_exists, rss_bytes
from oomcast.model.control import Command

Resolve = Callable[[Command], Sequence[Any]]


def processes_in_cgroup(cgroup_dir: Path | str, proc_root: Path | str = PROC) -> list[int]:
    """The pids in ``cgroup_dir`` and every cgroup below it (``cgroup.procs``), that exist in
    ``proc_root``; pids of another pid namespace read as 0 there and are left out."""
    pids: set[int] = set()
    stack = [Path(cgroup_dir)]
    while stack:
        path = stack.pop()
        try:
            text = (path / "cgroup.procs").read_text()
        except OSError:
            text = ""
        for word in text.split():
            with contextlib.suppress(ValueError):
                pid = int(word)
                if pid > 0:
                    pids.add(pid)
        try:
            with os.scandir(path) as it:
                stack.extend(Path(e.path) for e in it if e.is_dir(follow_symlinks=False))
        except OSError:
            continue
    return sorted(p for p in pids if pid_exists(p, proc_root))


def cgroup_candidates(
    cgroup_dir: Path | str, resolver: ProcResolver, proc_root: Path | str = PROC
) -> list[Candidate]:
    """The processes of a cgroup domain, with their resident memory as ``used_bytes``."""
    out = []
    for pid in processes_in_cgroup(cgroup_dir, proc_root):
        info = resolver.lookup(pid)
        if not info.found:
            continue
        out.append(
            Candidate(pid, rss_bytes(pid, proc_root), info.job, info.priority, info.start_time)
        )
    out.sort(key=lambda c: -(c.used_bytes or 0))
    return out


def make_resolve(
    *,
    nvml: Any | None = None,
    cgroup_root: Path | str | None = None,
    procs: ProcResolver | None = None,
    proc_root: Path | str = PROC,
) -> Resolve:
    """The ``resolve`` of a node agent: a GPU domain's processes from the NVML source's
    latest poll (for a checkpoint, the job's processes on every GPU of the node, since all
    its ranks must save); a ``cgroup:<path>`` domain's processes from ``cgroup.procs`` under
    ``cgroup_root``, with their resident memory."""
    resolver = procs if procs is not None else ProcResolver(proc_root)

    def resolve(cmd: Command) -> list[Candidate]:
        if cmd.device.startswith("cgroup:"):
            if cgroup_root is None:
                return []
            rel = cmd.device[len("cgroup:") :].strip("/")
            if ".." in Path(rel).parts:
                return []
            return cgroup_candidates(Path(cgroup_root) / rel, resolver, proc_root)
        if nvml is None:
            return []
        out = [as_candidate(p) for p in nvml.processes(cmd.device)]
        if cmd.action == "checkpoint" and cmd.job is not None:
            seen = {c.pid for c in out}
            for device in nvml.devices():
                for p in nvml.processes(device):
                    if p.job == cmd.job and p.pid not in seen:
                        seen.add(p.pid)
                        out.append(as_candidate(p))
        return out

    return resolve
