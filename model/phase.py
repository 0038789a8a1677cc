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

Units: where a sample carries the caching allocator's ``allocated_bytes`` and
``reserved_bytes`` (the CUDA hook), a phase is judged in allocation terms: its figure is
allocated bytes (the hook's measure, or an announced one) and its headroom is the device's
free memory plus the allocator's cached free blocks (``usable - used + reserved -
allocated``), so blocks a previous eval or checkpoint left cached count as room until a
creep fills them. Elsewhere (host mode, NVML) both are in used bytes, as before. An
announced absolute peak (``phase_peak_bytes``, allocated bytes) is judged against the
device less what is held outside the allocator.

Another job announced on the GPU (``POST /v1/admit`` with ``arrives_in_s``, or an ``arrival``
event in a trace) is forecast the same way: :meth:`PhaseState.on_arrival` keeps it, and while
what it needs is more than the device has left beside its residents' peak, the forecast is
an ``arrival`` phase that comes when it lands. Arrivals are the GPU's, not the job's: they
outlive a change of job (:meth:`PhaseState.carried`).

Pure and clock-free: every time is a sample's or event's ``ts``. The service and the
evaluator use this same code.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.events import (
    SCHEDULED_PHASES,
    ArrivalEvent,
    ScheduleEvent,
    parse_arrival,
    parse_schedule,
)
from oomcast.model.forecast import Forecast
from oomcast.model.schema import MAX_COUNT, Sample

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
# An announced arrival is judged until it lands; one that did not fit then is forecast for
# this long after (its process ramps its memory up over the first seconds, and once it has,
# the level shows it). After the landing it is not judged again: its memory is in the level
# by then, and counting the announcement on top of it would count the arrival twice.
ARRIVAL_GRACE_S = 30.0
MAX_ARRIVALS = 8  # announced arrivals kept per domain (the latest)
MIN_RATE_STEPS = 2  # steps the window must span before the measured rate is used
# A periodic phase (eval, checkpoint) whose measured figure grew at each of its last two
# measurements by more than this share is taken to grow again by as much at its next
# occurrence (an eval that keeps more outputs each time, a checkpoint of a growing state):
# linear, the gentler guess when the growth may be geometric.
GROWTH_MIN_FRAC = 0.05
FIGURES_KEPT = 3  # measured figures kept per phase for that
# The level between steps that creeps up (a slow leak, a growing cache) is projected to the
# time a phase comes, at its slope over the last CREEP_WINDOW_S seconds of step starts, when
# they span at least CREEP_MIN_SPAN_S and the slope is at least CREEP_MIN_T standard errors
# above zero (a level that only wanders projects nothing).
CREEP_WINDOW_S = 120.0
CREEP_MIN_SPAN_S = 30.0
CREEP_MIN_POINTS = 6
CREEP_MIN_T = 3.0
# at least CREEP_PARTS_RISING of the window's four quarters must rise at CREEP_PART_SHARE of
# the slope or more
CREEP_PART_SHARE = 0.5
CREEP_PARTS_RISING = 3
# step-start levels are kept at most one per LEVEL_SPACING_S, LEVELS_KEPT of them: the
# window at any step rate, and a bounded snapshot
LEVEL_SPACING_S = 1.0
LEVELS_KEPT = 128


def committed_bytes(sample: Sample) -> int | None:
    """What of the domain a phase cannot draw on, in allocation terms: the memory held
    outside the caching allocator (``used - reserved``: the CUDA context, libraries, other
    processes) plus what the allocator has allocated; its cached free blocks are not in it.
    None when the sample does not carry the allocator's figures."""
    allocated, reserved = sample.allocated_bytes, sample.reserved_bytes
    if allocated is None or reserved is None:
        return None
    return max(0, sample.used_bytes - reserved + allocated)


def level_of(sample: Sample) -> int:
    """The level a phase is judged from: :func:`committed_bytes` where known, else the use."""
    committed = committed_bytes(sample)
    return sample.used_bytes if committed is None else committed


@dataclass(frozen=True, slots=True)
class PhaseForecast:
    """The earliest scheduled phase that will not fit: it comes in ``time_to_oom_s``
    seconds (``steps_away`` steps) and needs ``extra_bytes`` above the current level, more
    than the ``headroom_bytes`` left when it comes (total less the level, less the margin,
    less what a level that creeps up between steps takes until then; the level is the use,
    or in allocation terms what is held outside the allocator plus what it has allocated:
    :func:`committed_bytes`)."""

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
    # level (level_of) of the first sample of the current step: the first optimizer step's
    # state comes on top of the weights and gradients, after the step's activations are
    # gone, so it is judged from here, not from a sample taken mid-forward (which counted
    # them twice); in allocation terms evals and checkpoints too (they run between steps)
    step_start_bytes: int | None = None
    # announced absolute peaks (allocated bytes) of phases that have not run yet
    peak_bytes: dict[str, int] = field(default_factory=dict)
    # (ts, allocated bytes, else use) of the first sample at step 0: the weights' load rate
    load_start: tuple[float, int] | None = None
    # announced arrivals (``POST /v1/admit``): arriving job -> (lands_at, need_bytes, the
    # residents' peak when announced)
    arrivals: dict[str, tuple[float, int, int]] = field(default_factory=dict)
    # of those, the ones that did not fit at the last sample before they landed
    unfit: set[str] = field(default_factory=set)
    # the measured figures of each periodic phase's last FIGURES_KEPT occurrences, oldest
    # first, as [step it ran at, bytes]: a figure measured again for the same occurrence
    # (a hook that publishes as the phase goes) replaces the one before
    history: dict[str, list[list[int]]] = field(default_factory=dict)
    # (ts, level_of) of the first sample of recent steps (one per LEVEL_SPACING_S): the
    # creep between phases
    levels: deque[tuple[float, int]] = field(default_factory=lambda: deque(maxlen=LEVELS_KEPT))
    # creep_bytes_per_s of the levels as they are (None: not worked out since they changed)
    _creep: float | None = field(default=None, repr=False, compare=False)

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
            "peak_bytes": dict(self.peak_bytes),
            "load_start": None if self.load_start is None else list(self.load_start),
            "arrivals": [
                {
                    "job": job,
                    "lands_at": at,
                    "need_bytes": need,
                    "resident_peak_bytes": peak,
                    "unfit": job in self.unfit,
                }
                for job, (at, need, peak) in self.arrivals.items()
            ],
            "history": {
                phase: [list(pair) for pair in figs] for phase, figs in self.history.items()
            },
            "levels": [[ts, level] for ts, level in self.levels],
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
        peaks = parse_schedule(
            {**check, "phase_extra_bytes": {}, "phase_peak_bytes": data.get("peak_bytes", {})}
        )
        state.peak_bytes = dict(peaks.phase_peak_bytes)
        last_ran = parse_schedule({**check, "phase_extra_bytes": data.get("last_ran", {})})
        state.last_ran = dict(last_ran.phase_extra_bytes)
        for pair in data.get("steps", []):
            ts, step = pair
            if not _finite_time(ts) or type(step) is not int or not 0 <= step <= MAX_COUNT:
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
        load = data.get("load_start")
        if load is not None:
            if not isinstance(load, list | tuple) or len(load) != 2:
                raise ValueError(f"phases load_start: {load!r} is not a (ts, bytes) pair")
            ts, level = load
            if not isinstance(ts, int | float) or type(level) is not int or level < 0:
                raise ValueError(f"phases load_start: {load!r} is not a (ts, bytes) pair")
            state.load_start = (float(ts), level)
        arrivals = data.get("arrivals", [])
        if not isinstance(arrivals, list) or len(arrivals) > MAX_ARRIVALS:
            raise ValueError(f"phases arrivals: must be a list of at most {MAX_ARRIVALS}")
        for raw in arrivals:
            if not isinstance(raw, Mapping):
                raise ValueError(f"phases arrivals: {str(raw)[:80]!r} is not an object")
            ev = parse_arrival({**check, **raw, "event": "arrival"})
            state.on_arrival(ev)
            if raw.get("unfit") is True:
                state.unfit.add(_arrival_key(ev))
        state.history = _parse_history(data.get("history", {}))
        state.levels.extend(_parse_levels(data.get("levels", [])))
        return state

    def on_arrival(self, event: ArrivalEvent) -> None:
        """An announced arrival (a repeated one, of the same job, replaces the first)."""
        job = _arrival_key(event)
        self.arrivals.pop(job, None)
        self.unfit.discard(job)
        self.arrivals[job] = (event.lands_at, event.need_bytes, event.resident_peak_bytes or 0)
        while len(self.arrivals) > MAX_ARRIVALS:
            oldest = next(iter(self.arrivals))
            del self.arrivals[oldest]
            self.unfit.discard(oldest)

    def carried(self) -> PhaseState | None:
        """What outlives the domain's job: its announced arrivals (they are the GPU's, not
        the job's); None when there are none."""
        if not self.arrivals:
            return None
        return PhaseState(arrivals=dict(self.arrivals), unfit=set(self.unfit))

    def _arrival_forecast(self, sample: Sample) -> PhaseForecast | None:
        """The earliest announced arrival that will not fit: judged, until it lands, against
        the residents' peak (the higher of the figure announced with it and the use now);
        once landed, the last verdict stands for ``ARRIVAL_GRACE_S`` and it is dropped.
        Judged in used bytes: the arrival's process takes device memory, not the running
        job's allocator's cached blocks."""
        usable = sample.total_bytes - int(MARGIN_FRAC * sample.total_bytes)
        here = max(sample.used_bytes, sample.peak_bytes or 0)
        best: PhaseForecast | None = None
        for job, (lands_at, need, peak) in list(self.arrivals.items()):
            headroom = usable - max(peak, here)
            if sample.ts < lands_at:
                if need > headroom:
                    self.unfit.add(job)
                else:
                    self.unfit.discard(job)
            elif sample.ts > lands_at + ARRIVAL_GRACE_S or job not in self.unfit:
                del self.arrivals[job]
                self.unfit.discard(job)
                continue
            if job in self.unfit:
                t = max(0.0, lands_at - sample.ts)
                if best is None or t < best.time_to_oom_s:
                    best = PhaseForecast("arrival", t, 0, need, max(0, headroom), False)
        return best

    def on_schedule(self, event: ScheduleEvent) -> None:
        """A (new or repeated) schedule: its periods replace the old ones; its figure for a
        phase replaces the current one, except that an announced figure never replaces a
        measured one. Its absolute peaks replace the announced ones, for the phases that
        have not run yet (once a phase has run, its own figure is what counts)."""
        self.schedule = event
        for phase, extra in event.phase_extra_bytes.items():
            is_measured = phase in event.measured
            if is_measured or phase not in self.measured:
                self.extra_bytes[phase] = extra
            if is_measured:
                self.measured.add(phase)
                self._figure_measured(phase, extra)
                if phase == "optimizer":
                    self.last_ran.setdefault("optimizer", 0)
        self.peak_bytes = {
            phase: peak
            for phase, peak in event.phase_peak_bytes.items()
            if phase not in self.measured and phase not in self.last_ran
        }

    def observe(self, sample: Sample) -> None:
        """Take a sample's step, phase and use into account (before :meth:`forecast`)."""
        step = sample.step
        if step is not None:
            steps = self.steps
            if steps and step < steps[-1][1]:  # the job started over: a new step count
                steps.clear()
                self.last_ran.clear()
                self.load_start = None
                self.levels.clear()
                self.history.clear()
                self._creep = None
            if not steps or step != steps[-1][1]:
                steps.append((sample.ts, step))
                self.step_start_bytes = level_of(sample)
                spaced = not self.levels or sample.ts - self.levels[-1][0] >= LEVEL_SPACING_S
                # a sample taken in an eval or a checkpoint holds the phase's own bytes
                if spaced and sample.phase not in SCHEDULED_PHASES:
                    self.levels.append((sample.ts, self.step_start_bytes))
                    self._creep = None
            if step == 0 and self.load_start is None:
                loaded = sample.allocated_bytes
                self.load_start = (sample.ts, sample.used_bytes if loaded is None else loaded)
        phase = sample.phase
        if phase in SCHEDULED_PHASES:
            assert phase is not None
            self._ran(phase, sample)
        else:
            self.level_bytes = sample.used_bytes

    def _ran(self, phase: str, sample: Sample) -> None:
        """The phase ran (the sample was taken in it): note the step (its announced absolute
        peak is spent), and measure what it needed above the level before it (its peak, or
        its use when it reports none, less the higher of that level and the use after it).
        The first measurement replaces the announced figure; later ones keep the largest
        seen (evals vary with their data).

        Only in used terms: a sample's ``peak_bytes`` is the device's (the reservation's)
        peak, and the allocator's allocated peak is not in any sample. Where samples carry
        the allocator's figures the phase is judged in allocation terms, so nothing is
        measured here; the figure is the hook's, from the allocated peak it reads itself,
        sent in its ``schedule`` event."""
        if sample.step is not None:
            self.last_ran[phase] = sample.step
        else:
            self.last_ran.setdefault(phase, 0)
        self.peak_bytes.pop(phase, None)
        if self.level_bytes is None or committed_bytes(sample) is not None:
            return
        high = sample.used_bytes if sample.peak_bytes is None else sample.peak_bytes
        extra = max(0, high - max(self.level_bytes, sample.used_bytes))
        if phase in self.measured:
            extra = max(extra, self.extra_bytes.get(phase, 0))
        self.extra_bytes[phase] = extra
        self.measured.add(phase)
        self._figure_measured(phase, extra)

    def _figure_measured(self, phase: str, extra: int) -> None:
        """Keep a periodic phase's measured figure, as the figure of its latest occurrence
        (the step it last ran at; -1 before any sample showed it run)."""
        if phase not in ("eval", "checkpoint"):
            return
        at = self.last_ran.get(phase, -1)
        figs = self.history.setdefault(phase, [])
        if figs and figs[-1][0] == at:
            figs[-1][1] = extra
        else:
            figs.append([at, extra])
            del figs[:-FIGURES_KEPT]

    def next_figure(self, phase: str) -> int | None:
        """The bytes ``phase`` will need next time: its figure, or, where each of its last
        two measured figures grew by more than ``GROWTH_MIN_FRAC`` on the one before, the
        last one plus the last growth (see ``GROWTH_MIN_FRAC``)."""
        extra = self.extra_bytes.get(phase)
        kept = self.history.get(phase, [])
        if extra is None or phase not in self.measured or len(kept) < 3 or kept[-1][1] != extra:
            return extra
        (s0, a), (s1, b), (s2, c) = kept[-3:]
        # three occurrences in a row: a hook that sends only new highs leaves gaps where an
        # occurrence needed less, and noisy highs are no growth
        period = self._period(phase)
        if period is None or s0 < 0 or s1 - s0 != period or s2 - s1 != period:
            return extra
        if b > a * (1 + GROWTH_MIN_FRAC) and c > b * (1 + GROWTH_MIN_FRAC):
            return c + (c - b)
        return extra

    def _period(self, phase: str) -> int | None:
        sched = self.schedule
        if sched is None:
            return None
        return sched.eval_every_steps if phase == "eval" else sched.checkpoint_every_steps

    def creep_bytes_per_s(self) -> float:
        """How fast the level between steps rises: the least-squares slope of the step starts
        of the ``CREEP_WINDOW_S`` seconds up to the latest, where it is clear of noise (see
        the constants); 0.0 otherwise, and never negative. Worked out once per new level."""
        if self._creep is None:
            self._creep = self._slope()
        return self._creep

    def _slope(self) -> float:
        if not self.levels:
            return 0.0
        last = self.levels[-1][0]
        pts = [(t, level) for t, level in self.levels if t >= last - CREEP_WINDOW_S]
        if len(pts) < CREEP_MIN_POINTS or pts[-1][0] - pts[0][0] < CREEP_MIN_SPAN_S:
            return 0.0
        slope, se = _fit(pts)
        if slope <= 0 or slope < CREEP_MIN_T * se:
            return 0.0
        # a creep rises all along: a level that jumped once or twice (a start-up allocation,
        # a cache that grew at one step) has flat quarters, and projects nothing
        n, rising = len(pts), 0
        for q in range(4):
            part = pts[q * n // 4 : (q + 1) * n // 4 + 1]
            rising += len(part) >= 2 and _fit(part)[0] >= CREEP_PART_SHARE * slope
        return slope if rising >= CREEP_PARTS_RISING else 0.0

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
        """The earliest scheduled phase that does not fit beside ``sample``'s level, or None
        (no schedule, no step seen, no step rate, or every phase fits). A phase does not fit
        when its figure is above the headroom (both in allocation terms where the sample
        carries the allocator's figures, else in used bytes), or when its announced
        absolute peak is above the device less what is held outside the allocator."""
        arrival = self._arrival_forecast(sample) if self.arrivals else None
        if self.schedule is None or not self.steps:
            return arrival
        step_s = self.step_s()
        if step_s is None:
            return arrival
        at_ts, step = self.steps[-1]
        since_s = max(0.0, sample.ts - at_ts)
        usable = sample.total_bytes - int(MARGIN_FRAC * sample.total_bytes)
        committed = committed_bytes(sample)
        level = sample.used_bytes if committed is None else committed
        outside = 0
        if sample.reserved_bytes is not None:
            outside = max(0, sample.used_bytes - sample.reserved_bytes)
        best: PhaseForecast | None = None
        announced_only = [p for p in self.peak_bytes if p not in self.extra_bytes]
        creep = self.creep_bytes_per_s()
        for phase in [*self.extra_bytes, *announced_only]:
            if phase == sample.phase:
                continue  # it is running now
            k = self.steps_to(phase, step)
            if k is None:
                continue
            base = level
            start = self.step_start_bytes
            if start is not None and (committed is not None or phase == "optimizer"):
                base = min(base, start)
            headroom = usable - base
            extra = self.next_figure(phase)
            t = max(0.0, k * step_s - since_s)
            # the room left when the phase comes, where the level between steps creeps up
            # the creep is projected no further than the window it was measured over, and
            # not at all where it alone would fill the room (that is the LSTM's to see)
            drain = creep * min(t, CREEP_WINDOW_S)
            room_then = headroom - int(drain) if 0 < drain < headroom else headroom
            if extra is not None and extra > room_then and (best is None or t < best.time_to_oom_s):
                measured = phase in self.measured
                best = PhaseForecast(phase, t, k, extra, max(0, room_then), measured)
            peak = self.peak_bytes.get(phase)
            if peak is not None and peak + outside > usable:
                if phase == "optimizer":
                    t = self._first_step_in_s(sample, step_s)
                else:
                    t = max(0.0, k * step_s - since_s)
                if best is None or t < best.time_to_oom_s:
                    need = max(0, peak + outside - base)  # above the level now
                    best = PhaseForecast(phase, t, k, need, max(0, headroom), False)
        if arrival is not None and (best is None or arrival.time_to_oom_s < best.time_to_oom_s):
            return arrival
        return best

    def _first_step_in_s(self, sample: Sample, step_s: float) -> float:
        """When the first optimizer step comes, for a job at step 0: after the rest of the
        weights' load, at the rate the samples since step 0 show, and one step. The weights
        are about the announced peak less the announced extra (the same preflight run gave
        both: the extra is what the first steps need above the loaded weights; less, where
        those steps free some of what was loaded before their peak). Without them, or
        once the load is done, or before a second sample gives a rate: one step."""
        peak, extra = self.peak_bytes.get("optimizer"), self.extra_bytes.get("optimizer")
        if peak is None or extra is None or "optimizer" in self.measured:
            return step_s
        if self.load_start is None:
            return step_s
        t0, level0 = self.load_start
        level = sample.used_bytes if sample.allocated_bytes is None else sample.allocated_bytes
        remaining = peak - extra - level
        elapsed = sample.ts - t0
        if remaining <= 0 or elapsed <= 0 or level <= level0:
            return step_s
        rate = (level - level0) / elapsed
        return remaining / rate + step_s


def _fit(pts: list[tuple[float, int]]) -> tuple[float, float]:
    """Least-squares slope of ``pts`` (bytes per second) and its standard error (inf where
    fewer than three points or no spread in time leave it unknown)."""
    n = len(pts)
    mt = sum(t for t, _ in pts) / n
    ml = sum(level for _, level in pts) / n
    sxx = sum((t - mt) ** 2 for t, _ in pts)
    if n < 3 or sxx <= 0:
        return 0.0, float("inf")
    slope = sum((t - mt) * (level - ml) for t, level in pts) / sxx
    resid = sum((level - ml - slope * (t - mt)) ** 2 for t, level in pts)
    return slope, (resid / (n - 2) / sxx) ** 0.5


def _finite_time(ts: Any) -> bool:
    """A timestamp a snapshot may hold: a finite number (not a bool)."""
    return isinstance(ts, int | float) and not isinstance(ts, bool) and math.isfinite(ts)


def _byte_count(value: Any) -> bool:
    return type(value) is int and 0 <= value <= MAX_COUNT


def _parse_history(raw: Any) -> dict[str, list[list[int]]]:
    """A snapshot's measured figures per periodic phase; ValueError naming what is wrong."""
    if not isinstance(raw, Mapping):
        raise ValueError("phases history: must be an object of phase -> figures")
    out: dict[str, list[list[int]]] = {}
    for phase, figs in raw.items():
        if phase not in ("eval", "checkpoint"):
            raise ValueError(f"phases history: {phase!r} is not eval or checkpoint")
        if (
            not isinstance(figs, list)
            or len(figs) > FIGURES_KEPT
            or any(
                not isinstance(pair, list)
                or len(pair) != 2
                or type(pair[0]) is not int
                or not -1 <= pair[0] <= MAX_COUNT
                or not _byte_count(pair[1])
                for pair in figs
            )
        ):
            raise ValueError(
                f"phases history.{phase}: {str(figs)[:80]!r} is not [step, bytes] pairs"
            )
        out[phase] = [list(pair) for pair in figs]
    return out


def _parse_levels(raw: Any) -> list[tuple[float, int]]:
    """A snapshot's step-start levels, oldest first and at least ``LEVEL_SPACING_S`` apart
    as they are kept; ValueError naming what is wrong."""
    if not isinstance(raw, list) or len(raw) > LEVELS_KEPT:
        raise ValueError(f"phases levels: must be a list of at most {LEVELS_KEPT}")
    out: list[tuple[float, int]] = []
    for pair in raw:
        if (
            not isinstance(pair, list | tuple)
            or len(pair) != 2
            or not _finite_time(pair[0])
            or not _byte_count(pair[1])
            or (out and pair[0] - out[-1][0] < LEVEL_SPACING_S)
        ):
            raise ValueError(
                f"phases levels: {str(pair)[:80]!r} is not a (ts, bytes) pair in order"
            )
        out.append((float(pair[0]), pair[1]))
    return out


def _arrival_key(event: ArrivalEvent) -> str:
    """What an announced arrival is kept under: its job, else its landing time."""
    return event.job if event.job is not None else f"@{event.lands_at:.3f}"


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
