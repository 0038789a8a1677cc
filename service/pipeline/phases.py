"""The live state's side of phase-aware forecasts (docs/phases.md): a domain whose job
announced a schedule (a ``schedule`` event), or on which a scheduler announced an arriving
job (``POST /v1/admit`` with ``arrives_in_s``), has a :class:`~oomcast.model.phase.PhaseState`,
and each of its forecasts is the LSTM's merged with the phase forecast
(:func:`oomcast.model.phase.merge`) before the rules see it. Other domains never reach this
module: the live state checks ``st.phases is None`` and goes on.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from oomcast.model.events import ArrivalEvent, ScheduleEvent
from oomcast.model.forecast import Forecast
from oomcast.model.phase import PhaseState, merge
from oomcast.model.schema import Sample

if TYPE_CHECKING:
    from oomcast.service.pipeline.state import DomainState


def on_schedule(st: DomainState, event: ScheduleEvent) -> None:
    """Keep the job's schedule on its domain (a repeated one refreshes it)."""
    if st.phases is None:
        st.phases = PhaseState()  # the domain's first schedule
    elif st.phases.schedule is not None and st.phases.schedule.job != event.job:
        st.phases = st.phases.carried() or PhaseState()  # another job's: arrivals stay
    st.phases.on_schedule(event)


def on_arrival(st: DomainState, event: ArrivalEvent) -> None:
    """Keep an announced arrival on its GPU's domain (``POST /v1/admit``): from the next
    sample on, the domain's forecast says whether it will fit."""
    if st.phases is None:
        st.phases = PhaseState()
    st.phases.on_arrival(event)


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
        st.phases = phases.carried()  # announced arrivals are the GPU's: they stay
    st.cause = None
    st.phase_forecast = None
    st.first = None  # the next sample is the new job's first


def phase_summary(st: DomainState) -> dict[str, Any] | None:
    """What ``/v1/devices`` shows of the domain's phase forecast; None without one."""
    pf = st.phase_forecast
    return None if pf is None else pf.to_dict()
