"""What the node agent does on a verified command: ask a job to checkpoint, or shed load.

This module is the index; each idea lives in a module of its own:

* :mod:`~oomcast.collectors.actiontypes`: what every action shares (:class:`Candidate`, the
  processes of a domain as the agent saw them; :class:`ActionResult`; :class:`Executor`).
  Every executor is called as ``executor(command, candidates)``.
* :mod:`~oomcast.collectors.checkpoint`: :class:`CheckpointAction`, through the job's hook
  (:mod:`oomcast.model.jobcontrol`), else by signal to the processes that catch it.
* :mod:`~oomcast.collectors.victims` (who may be ended) and :mod:`~oomcast.collectors.shed`
  (:class:`ShedAction`: SIGTERM, a grace period, then SIGKILL).
* :mod:`~oomcast.collectors.signals`: :func:`send_signal`, the pidfd and start-time guards
  every signal goes through, since pids are reused.
* :mod:`~oomcast.collectors.domain`: the candidate processes of a command's domain.
* :mod:`~oomcast.collectors.procinfo`: everything read from ``/proc``.
"""

from __future__ import annotations

from oomcast.collectors.actiontypes import (
    MAX_LISTED,
    OUTCOMES,
    ActionResult,
    Candidate,
    Executor,
    as_candidate,
)
from oomcast.collectors.checkpoint import JOBCTL_MAXLEN, CheckpointAction
from oomcast.collectors.domain import cgroup_candidates, processes_in_cgroup
from oomcast.collectors.procinfo import (
    catches_signal,
    live_start_time,
    proc_memory_cgroup,
    proc_state,
    proc_status,
    proc_uids,
    rss_bytes,
)
from oomcast.collectors.shed import ShedAction
from oomcast.collectors.signals import send_signal
from oomcast.collectors.victims import ShedPlan, in_scope

__all__ = [
    "JOBCTL_MAXLEN",
    "MAX_LISTED",
    "OUTCOMES",
    "ActionResult",
    "Candidate",
    "CheckpointAction",
    "Executor",
    "ShedAction",
    "ShedPlan",
    "as_candidate",
    "catches_signal",
    "cgroup_candidates",
    "in_scope",
    "live_start_time",
    "proc_memory_cgroup",
    "proc_state",
    "proc_status",
    "proc_uids",
    "processes_in_cgroup",
    "rss_bytes",
    "send_signal",
]
