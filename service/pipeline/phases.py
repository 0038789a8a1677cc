"""The live state's side of phase-aware forecasts (docs/phases.md): a domain whose job
announced a schedule (a ``schedule`` event) has a :class:`~oomcast.model.phase.PhaseState`,
and each of its forecasts is the LSTM's merged with the phase forecast
(:func:`oomcast.model.phase.merge`) before the rules see it. Domains without a schedule
never reach this module: the live state checks ``st.phases is None`` and goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oomcast.model.events import ScheduleEvent
from oomcast.model.forecast import Forecast
from oomcast.model.phase import PhaseState, merge
from oomcast.model.schema import Sample

if TYPE_CHECKING:
    from oomcast.service.pipeline.state import DomainState


def on_schedule(st: DomainState, event: ScheduleEvent) -> None:
    """Keep the job's schedule on its domain (a repeated one refreshes it)."""
    if st.phases is None or (
        st.phases.schedule is not None and st.phases.schedule.job != event.job
    ):
        st.phases = PhaseState()  # first schedule of the domain, or another job's
    st.phases.on_schedule(event)


def phase_step(st: DomainState, sample: Sample, fc: Forecast) -> Forecast:
    """The domain's forecast for ``sample`` with its phase forecast folded in; notes the
    cause and the phase forecast on the domain."""
    phases = st.phases
    assert phases is not None
    phases.observe(sample)
    pf = phases.forecast(sample)
    merged, cause = merge(fc, pf)
    st.cause = cause
    st.phase_forecast = pf
    return merged


def forget_job(st: DomainState, job: str | None) -> None:
    """The domain's job changed or ended: its schedule goes with it, unless the schedule
    already is the new job's (it may come before the new job's first sample)."""
    phases = st.phases
    if phases is not None and (phases.schedule is None or phases.schedule.job != job):
        st.phases = None
    st.cause = None
    st.phase_forecast = None
    st.first = None  # the next sample is the new job's first


def phase_summary(st: DomainState) -> dict[str, Any] | None:
    """What ``/v1/devices`` shows of the domain's phase forecast; None without one."""
    pf = st.phase_forecast
    return None if pf is None else pf.to_dict()
