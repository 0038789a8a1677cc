"""Every alert, and every domain in ``/v1/devices``, says why its OOM is coming and what
would fix it: :func:`oomcast.model.causes.diagnose` on the evidence the live state holds
(the domain's recent history, its newest sample, the phase forecaster's cause, and the
first sample of its job as the baseline of the allocator's retry counter and of a
container's anonymous memory). Computed when an alert is made or a summary is read, never
per sample: the ingest hot path only keeps the first sample of each job."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from oomcast.model.causes import Diagnosis, diagnose
from oomcast.model.processes import neighbour_growth
from oomcast.service.pipeline.rules import Alert

if TYPE_CHECKING:
    from oomcast.service.pipeline.state import DomainState

HISTORY_POINTS = 600  # the history a cause is read from (a minute at 10 Hz, 10 at 1 Hz)


def diagnosis_of(st: DomainState) -> Diagnosis | None:
    last = st.last
    if last is None:
        return None
    cols = st.history.columns(HISTORY_POINTS)
    first = st.first
    return diagnose(
        last,
        cols["ts"],
        cols["used"],
        phase_cause=st.cause,
        retries_before=first.alloc_retries if first is not None else None,
        anon_before=first.allocated_bytes if first is not None else None,
        phase_extra_bytes=st.phase_forecast.extra_bytes if st.phase_forecast else None,
        neighbour_bytes=neighbour_growth(
            first.processes if first is not None else None, last.processes, st.job
        ),
    )


def explained(alert: Alert, st: DomainState) -> Alert:
    """``alert`` with the domain's cause, remedies, evidence and what evidence was thin. An
    episode keeps what its first firing alert said: its resolved alert (after an OOM, say,
    when the cache left behind would read as fragmentation) says the same."""
    episode = alert.episode or ""
    said = st.told.get(episode)
    if said is None:
        d = diagnosis_of(st)
        if d is None:
            return alert
        said = (d.cause, d.remedies, d.evidence, d.thin)
        if alert.status == "firing" and episode:
            if len(st.told) >= MAX_TOLD:  # episodes whose end was never explained
                st.told.clear()
            st.told[episode] = said
    elif alert.status != "firing":
        del st.told[episode]
    cause, remedies, evidence, thin = said
    return replace(alert, cause=cause, remedies=remedies, evidence=evidence, cause_thin=thin)


MAX_TOLD = 64  # episodes remembered per domain
