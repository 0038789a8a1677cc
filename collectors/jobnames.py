"""What a cgroup path says about the workload in it: a Kubernetes pod, a container, a Slurm
job; and the job name the agent gives it (``pod:<uid>``, ``slurm:<id>``,
``container:<first 12 hex>``, else ``pid:<pid>``).

Pure string work on paths that :mod:`oomcast.collectors.procinfo` reads from
``/proc/<pid>/cgroup`` or that a cgroup source walks; nothing here touches a file.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

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


def job_name(ident: CgroupIdentity, pid: int) -> str:
    if ident.pod_uid:
        return f"pod:{ident.pod_uid}"
    if ident.slurm_job:
        return f"slurm:{ident.slurm_job}"
    if ident.container_id:
        return f"container:{ident.container_id[:12]}"
    return f"pid:{pid}"
