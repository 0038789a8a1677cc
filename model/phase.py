"""Phase-aware forecasts: an OOM that the job's schedule announces and its memory stream does
not (docs/phases.md).

The first eval, the first on-device checkpoint and the first optimizer step each need memory
the steps before them never used, so the memory stream shows nothing until the step that
dies. But the job knows when they come (eval every N steps, checkpoint every M) and, once
it has seen one or been told, how much each needs. :class:`PhaseState` keeps, per memory
domain, the job's schedule (from ``schedule`` events), its step rate (from the ``step`` of
its samples) and the extra bytes of each phase (announced, then measured from the samples'
``phase`` and ``peak_bytes``); :meth:`PhaseState.forecast` says which scheduled phase,
coming in T seconds, will not fit beside what the domain uses now; :func:`merge` folds that
into the LSTM's forecast.

Pure and clock-free: every time is a sample's or event's ``ts``. The service and the
evaluator use this same code.
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.events import SCHEDULED_PHASES, ScheduleEvent, parse_schedule
from oomcast.model.forecast import Forecast
from oomcast.model.schema import Sample

# Risk given at every horizon at or past the phase's time T (and 0 before it). The phase is
# known to need more than the headroom, so the OOM is near certain if it comes; the doubt
# left is in its timing (the step rate can change) and in the figure (an announced extra is
# an estimate). 0.95 is above every firing bar the shipped rules use (the model's rule,
# about 0.8 at 120 s; the shed rule, 0.9 at 30 s), so the same rules fire on it.
PHASE_RISK = 0.95
# A phase counts as not fitting when the use it would reach is above total less this share
# of it: allocator rounding, fragmentation and the CUDA context leave the last 2% of a
# device unusable in practice, and a cgroup reclaims page cache before it kills.
MARGIN_FRAC = 0.02
STEP_WINDOW = 33  # step changes kept for the step rate (32 intervals)
MIN_RATE_STEPS = 2  # steps the window must span before the measured rate is used


@dataclass(frozen=True, slots=True)
class PhaseForecast:
    """The earliest scheduled phase that will not fit: it comes in ``time_to_oom_s``
    seconds (``steps_away`` steps) and needs ``extra_bytes`` above the current use, more
    than the ``headroom_bytes`` left (total less use, less the margin)."""

    phase: str
    time_to_oom_s: float
    steps_away: int
    extra_bytes: int
    headroom_bytes: int
    measured: bool  # the extra was measured on a real occurrence, not announced

    @property
    def cause(self) -> str:
        return f"phase:{self.phase}"

    def risk(self, horizons_s: list[int]) -> dict[int, float]:
        return {h: PHASE_RISK if self.time_to_oom_s <= h else 0.0 for h in horizons_s}

    def to_dict(self) -> dict[str, object]:
        return {
            "phase": self.phase,
            "in_s": round(self.time_to_oom_s, 1),
            "steps_away": self.steps_away,
            "extra_bytes": self.extra_bytes,
            "headroom_bytes": self.headroom_bytes,
            "measured": self.measured,
        }


@dataclass(slots=True)
class PhaseState:
    """One domain's schedule, step rate and phase figures (see the module docstring)."""

    schedule: ScheduleEvent | None = None
    extra_bytes: dict[str, int] = field(default_factory=dict)  # phase -> best figure
    measured: set[str] = field(default_factory=set)
    steps: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=STEP_WINDOW))
    last_ran: dict[str, int] = field(default_factory=dict)  # phase -> step it last ran at
    level_bytes: int | None = None  # use of the newest sample outside the scheduled phases
    # use of the first sample of the current step: the first optimizer step's state comes
    # on top of the weights and gradients, after the step's activations are gone, so it is
    # judged from here, not from a sample taken mid-forward (which counted them twice)
    step_start_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-able, for the snapshot a replica taking the domain over restores."""
        return {
            "schedule": None if self.schedule is None else self.schedule.to_dict(),
            "extra_bytes": dict(self.extra_bytes),
            "measured": sorted(self.measured),
            "steps": [[ts, step] for ts, step in self.steps],
            "last_ran": dict(self.last_ran),
            "level_bytes": self.level_bytes,
            "step_start_bytes": self.step_start_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> PhaseState:
        """The inverse of :meth:`to_dict`; ValueError (a SchemaError) naming what is wrong."""
        if not isinstance(data, Mapping):
            raise ValueError("phases must be an object")
        raw = data.get("schedule")
        state = cls(schedule=None if raw is None else parse_schedule(raw))
        # the figures and the phases they name are checked as a schedule's are (and last_ran,
        # phase -> step, as figures are: phase -> count)
        check = {"ts": 1.0, "node": "n", "device": "d", "event": "schedule"}
        measured = list(data.get("measured", []))
        extra = parse_schedule(
            {**check, "phase_extra_bytes": data.get("extra_bytes", {}), "measured": measured}
        )
        state.extra_bytes = dict(extra.phase_extra_bytes)
        state.measured = set(extra.measured)
        last_ran = parse_schedule({**check, "phase_extra_bytes": data.get("last_ran", {})})
        state.last_ran = dict(last_ran.phase_extra_bytes)
        for pair in data.get("steps", []):
            ts, step = pair
            if not isinstance(ts, int | float) or type(step) is not int or step < 0:
                raise ValueError(f"phases steps: {pair!r} is not a (ts, step) pair")
            state.steps.append((float(ts), step))
        level = data.get("level_bytes")
        if level is not None and (type(level) is not int or level < 0):
            raise ValueError(f"phases level_bytes: {level!r} is not a byte count")
        state.level_bytes = level
        start = data.get("step_start_bytes")
        if start is not None and (type(start) is not int or start < 0):
            raise ValueError(f"phases step_start_bytes: {start!r} is not a byte count")
        state.step_start_bytes = start
        return state

    def on_schedule(self, event: ScheduleEvent) -> None:
        """A (new or repeated) schedule: its periods replace the old ones; its figure for a
        phase replaces the current one, except that an announced figure never replaces a
        measured one."""
        self.schedule = event
        for phase, extra in event.phase_extra_bytes.items():
            is_measured = phase in event.measured
            if is_measured or phase not in self.measured:
                self.extra_bytes[phase] = extra
            if is_measured:
                self.measured.add(phase)
                if phase == "optimizer":
                    self.last_ran.setdefault("optimizer", 0)

    def observe(self, sample: Sample) -> None:
        """Take a sample's step, phase and use into account (before :meth:`forecast`)."""
        step = sample.step
        if step is not None:
            steps = self.steps
            if steps and step < steps[-1][1]:  # the job started over: a new step count
                steps.clear()
                self.last_ran.clear()
            if not steps or step != steps[-1][1]:
                steps.append((sample.ts, step))
                self.step_start_bytes = sample.used_bytes
        phase = sample.phase
        if phase in SCHEDULED_PHASES:
            assert phase is not None
            self._ran(phase, sample)
        else:
            self.level_bytes = sample.used_bytes

    def _ran(self, phase: str, sample: Sample) -> None:
        """The phase ran (the sample was taken in it): note the step, and measure what it
        needed above the level before it (its peak, or its use when it reports none, less
        the higher of that level and the use after it). The first measurement replaces the
        announced figure; later ones keep the largest seen (evals vary with their data)."""
        if sample.step is not None:
            self.last_ran[phase] = sample.step
        else:
            self.last_ran.setdefault(phase, 0)
        if self.level_bytes is None:
            return
        high = sample.used_bytes if sample.peak_bytes is None else sample.peak_bytes
        extra = max(0, high - max(self.level_bytes, sample.used_bytes))
        if phase in self.measured:
            extra = max(extra, self.extra_bytes.get(phase, 0))
        self.extra_bytes[phase] = extra
        self.measured.add(phase)

    def step_s(self) -> float | None:
        """Seconds per step: the median of the recent steps' intervals once they span
        ``MIN_RATE_STEPS`` steps (robust to a step stretched by an eval), else the
        schedule's ``step_s``, else None."""
        steps = self.steps
        if len(steps) >= 2 and steps[-1][1] - steps[0][1] >= MIN_RATE_STEPS:
            pairs = zip(steps, list(steps)[1:], strict=False)
            per_step = [(t1 - t0) / (s1 - s0) for (t0, s0), (t1, s1) in pairs]
            return statistics.median(per_step)
        return None if self.schedule is None else self.schedule.step_s

    def steps_to(self, phase: str, step: int) -> int | None:
        """Steps from ``step`` (completed steps) until ``phase`` next runs; None when the
        schedule does not say. A periodic phase runs once step reaches a multiple of its
        period (0 steps away until a sample shows it ran at that step); the optimizer's
        first step (its state appears) is 1 step away at step 0 and never again after."""
        if phase == "optimizer":
            return 1 if step == 0 and "optimizer" not in self.last_ran else None
        sched = self.schedule
        if sched is None:
            return None
        period = sched.eval_every_steps if phase == "eval" else sched.checkpoint_every_steps
        if period is None:
            return None
        if step > 0 and step % period == 0 and self.last_ran.get(phase) != step:
            return 0
        return period - step % period

    def forecast(self, sample: Sample) -> PhaseForecast | None:
        """The earliest scheduled phase whose extra bytes do not fit beside ``sample``'s
        use, or None (no schedule, no step seen, no step rate, or every phase fits)."""
        if self.schedule is None or not self.steps:
            return None
        step_s = self.step_s()
        if step_s is None:
            return None
        at_ts, step = self.steps[-1]
        since_s = max(0.0, sample.ts - at_ts)
        usable = sample.total_bytes - int(MARGIN_FRAC * sample.total_bytes)
        best: PhaseForecast | None = None
        for phase, extra in self.extra_bytes.items():
            base = sample.used_bytes
            if phase == "optimizer" and self.step_start_bytes is not None:
                base = min(base, self.step_start_bytes)
            headroom = usable - base
            if extra <= headroom or phase == sample.phase:
                continue  # it fits, or it is running now
            k = self.steps_to(phase, step)
            if k is None:
                continue
            t = max(0.0, k * step_s - since_s)
            if best is None or t < best.time_to_oom_s:
                measured = phase in self.measured
                best = PhaseForecast(phase, t, k, extra, max(0, headroom), measured)
        return best


def merge(fc: Forecast, phase: PhaseForecast | None) -> tuple[Forecast, str | None]:
    """The LSTM's forecast with the phase forecast folded in: per horizon the higher risk,
    and the earlier time to OOM. The cause is the phase's (``phase:eval``) when it raised a
    risk or brought the time to OOM forward, else None (the forecast is the stream's)."""
    if phase is None:
        return fc, None
    own = phase.risk(list(fc.risk))
    risk = {h: max(p, own[h]) for h, p in fc.risk.items()}
    t = phase.time_to_oom_s
    earlier = fc.time_to_oom_s is None or t < fc.time_to_oom_s
    raised = any(risk[h] > p for h, p in fc.risk.items())
    if not (earlier or raised):
        return fc, None
    tto = t if earlier else fc.time_to_oom_s
    return Forecast(risk, tto, fc.observed_at, fc.model_version), phase.cause
