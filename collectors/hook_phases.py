"""The in-process hook's training step, phase and schedule (docs/phases.md).

:class:`PhaseHook` is mixed into :class:`~oomcast.collectors.hook.MemoryHook`. Every sample
the hook takes carries the job's ``step`` (completed training steps: ``hook.step(n)`` sets
it, ``hook.step()`` counts one more) and, inside a phase, the ``phase``::

    hook.set_schedule(eval_every_steps=500, checkpoint_every_steps=2000,
                      phase_extra_bytes={"eval": 6 << 30})
    for step, batch in enumerate(loader, 1):
        ...
        hook.step(step)
        if step % 500 == 0:
            with hook.phase("eval"):
                evaluate()

A phase begins with a sample (the level before it: the allocator's peaks are reset there)
and ends with one tagged with the phase, whose peak covers the phase. On a phase's first
occurrence the hook measures what it needed. On CUDA, in allocation terms (the service
judges a domain whose samples carry ``allocated_bytes`` and ``reserved_bytes`` against the
free memory plus the allocator's cached free blocks): the allocator's allocated peak over
the phase less the allocated bytes before it, so a checkpoint served from cached blocks
still measures what it needs. In host mode, in used bytes: its peak less the higher of the
level before it and the level after it (what the phase holds only while it runs; for the
optimizer, its state stays after the first step and is not counted again). A measured
figure replaces an announced one, and a later, larger occurrence replaces it again; each
change is published as a ``schedule`` event, and the schedule is published again every
``REPUBLISH_S`` (a service replica that starts later, or takes the domain over, learns it
from there).

Figures for phases not yet seen come from the user (``phase_extra_bytes=``) or, through
:meth:`PhaseHook.set_phase_extra_bytes`, from any other estimate (the seam a background
preflight run will use): announced figures never replace measured ones. The latter takes
``phase_peak_bytes=`` too: a phase's absolute peak, in allocated bytes (a preflight's
figure for the first optimizer step: weights, gradients, optimizer state and activations
together), which the service compares with the device before the job has loaded anything;
it is sent until the phase first runs.
"""

from __future__ import annotations

import contextlib
import operator
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

from oomcast.collectors.hook_memory import CudaReader
from oomcast.collectors.hook_outbox import HookOutbox
from oomcast.model.events import SCHEDULE, SCHEDULED_PHASES, ScheduleEvent, parse_schedule
from oomcast.model.schema import PHASES, Sample

REPUBLISH_S = 30.0  # the schedule again, for a service that missed it (events start at "$")


class PhaseHook:
    """The step, phase and schedule half of the hook (see the module docstring). The hook
    provides ``_off``, ``_outbox``, ``node``, ``device``, ``job`` and ``_sample``, and calls
    ``_advance`` at each step and ``_noted`` with each sample."""

    _off: bool
    _outbox: HookOutbox
    node: str
    device: str
    job: str | None

    def _init_phases(self) -> None:
        self.step_number = 0  # completed training steps, as samples carry it
        self.current_phase: str | None = None
        self._schedule: dict[str, Any] = {}  # eval_every_steps, checkpoint_every_steps, step_s
        self._extra: dict[str, int] = {}  # phase -> bytes (announced or measured)
        self._measured: set[str] = set()
        self._peaks: dict[str, int] = {}  # phase -> announced absolute peak (allocated bytes)
        self._ran: set[str] = set()  # scheduled phases that have run (their peaks are spent)
        self._level_bytes: int | None = None  # use before the current phase
        self._level_allocated: int | None = None  # allocated bytes before it (CUDA)
        self._phase_allocated_peak: int | None = None  # the allocator's peak within it
        self._has_schedule = False
        self._next_schedule_at = 0.0
        self._phase_lock = threading.Lock()  # the seam may be called from another thread

    # --- provided by the hook ------------------------------------------------------------------

    def _sample(self) -> Sample | None:
        """Take a sample now (step and phase as they are) and queue it; None if it failed."""
        raise NotImplementedError

    def _publish(self, event: ScheduleEvent) -> None:
        self._outbox.put_event(event.to_detailed())

    # --- the training loop's side -------------------------------------------------------------

    def _advance(self, step: int | None) -> None:
        """Called by ``step()``: the step count, and the schedule again when it is due."""
        if step is None:
            self.step_number += 1
        else:
            try:
                n = operator.index(step)  # an int, or a numpy/torch integer
            except TypeError:
                n = -1
            if n < 0:
                raise ValueError(f"step={step!r} must be a whole number of steps, at least 0")
            self.step_number = n
        if self._has_schedule and time.monotonic() >= self._next_schedule_at:
            self._publish_schedule()

    def set_schedule(
        self,
        *,
        eval_every_steps: int | None = None,
        checkpoint_every_steps: int | None = None,
        step_s: float | None = None,
        phase_extra_bytes: Mapping[str, int] | None = None,
    ) -> None:
        """The job's schedule: eval every N steps, checkpoint every M, seconds per step (if
        known; the service measures it otherwise), and the extra bytes of the phases not
        yet seen (absolute peaks: :meth:`set_phase_extra_bytes`). Values left out keep what
        was set before. Published at once (with a sample: the level and the step the
        schedule starts from). ValueError (a :class:`~oomcast.model.schema.SchemaError`)
        naming a bad argument."""
        given = {
            "eval_every_steps": eval_every_steps,
            "checkpoint_every_steps": checkpoint_every_steps,
            "step_s": step_s,
        }
        self._update(given, phase_extra_bytes or {}, {})
        if not self._off:
            self._sample()
        self._publish_schedule()

    def set_phase_extra_bytes(
        self,
        phase_extra_bytes: Mapping[str, int],
        *,
        phase_peak_bytes: Mapping[str, int] | None = None,
    ) -> None:
        """Announce the extra bytes of phases (an estimate, e.g. from a preflight run in the
        background) and, with ``phase_peak_bytes``, their absolute peaks (allocated bytes:
        for the first optimizer step, weights, gradients, optimizer state and activations
        together): ignored for a phase already measured (a peak, for one that has run);
        published at once. Safe to call from another thread (it takes no sample).
        ValueError naming a bad phase or value."""
        self._update({}, phase_extra_bytes, phase_peak_bytes or {})
        self._publish_schedule()

    def _update(
        self,
        given: Mapping[str, Any],
        phase_extra_bytes: Mapping[str, int],
        phase_peak_bytes: Mapping[str, int],
    ) -> None:
        with self._phase_lock:
            schedule = {**self._schedule, **{k: v for k, v in given.items() if v is not None}}
            extra = dict(self._extra)
            for phase, value in phase_extra_bytes.items():
                if phase not in self._measured:
                    extra[phase] = value
            peaks = dict(self._peaks)
            for phase, value in phase_peak_bytes.items():
                if phase not in self._measured and phase not in self._ran:
                    peaks[phase] = value
            self._check(schedule, extra, phase_peak_bytes)
            self._schedule, self._extra, self._peaks = schedule, extra, peaks
            self._has_schedule = True

    @property
    def schedule(self) -> dict[str, Any]:
        """The periods and step time set so far (``eval_every_steps``, ...)."""
        with self._phase_lock:
            return dict(self._schedule)

    @property
    def phase_extra_bytes(self) -> dict[str, int]:
        """The figure of each phase the hook knows (measured, else announced)."""
        with self._phase_lock:
            return dict(self._extra)

    @property
    def phase_peak_bytes(self) -> dict[str, int]:
        """The announced absolute peaks of the phases that have not run yet."""
        with self._phase_lock:
            return dict(self._peaks)

    @property
    def measured_phases(self) -> frozenset[str]:
        return frozenset(self._measured)

    def begin_phase(self, phase: str) -> None:
        """The job enters ``phase`` (one of the trace format's phases): a sample, the level
        before it. A phase still open is ended first."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r} must be one of {', '.join(PHASES)}")
        if self.current_phase is not None:
            self.end_phase()
        if self._off:
            return
        self._sample()  # the level before it (_noted); the allocator's peaks are reset
        self._phase_allocated_peak = None
        self.current_phase = phase

    def end_phase(self, phase: str | None = None) -> None:
        """The phase ends: a sample tagged with it, whose peak covers it. ``phase`` names a
        phase that was not begun (a framework that only reports its end, as Hugging Face
        does for eval and save): the level before it is then the previous sample's."""
        name = phase if phase is not None else self.current_phase
        if name is None:
            return
        if name not in PHASES:
            raise ValueError(f"phase={name!r} must be one of {', '.join(PHASES)}")
        if self._off:
            self.current_phase = None
            return
        self.current_phase = name
        after = self._sample()
        self.current_phase = None
        if after is not None:
            self._measure(name, after)
            self._level_bytes = after.used_bytes
            self._level_allocated = after.allocated_bytes
        self._phase_allocated_peak = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """``with hook.phase("eval"): ...``: :meth:`begin_phase`, then :meth:`end_phase`."""
        self.begin_phase(name)
        try:
            yield
        finally:
            self.end_phase(name)

    def _noted(self, sample: Sample) -> None:
        """Called by the hook for every sample taken: the level outside any phase; inside
        one, the allocator's allocated peak over it so far (each sample's read covers the
        span since the one before, where the allocator's peaks were reset)."""
        if self.current_phase is None:
            self._level_bytes = sample.used_bytes
            self._level_allocated = sample.allocated_bytes
            return
        reader = getattr(self, "_reader", None)
        peak = reader.allocated_peak_bytes if isinstance(reader, CudaReader) else None
        if peak is not None:
            so_far = self._phase_allocated_peak
            self._phase_allocated_peak = peak if so_far is None else max(so_far, peak)

    # --- measuring and publishing ------------------------------------------------------------

    def _measure(self, phase: str, after: Sample) -> None:
        """The phase ended with ``after``: its announced peak is spent, and its figure is
        measured (allocation terms on CUDA, used bytes in host mode: module docstring)."""
        if phase not in SCHEDULED_PHASES:
            return
        with self._phase_lock:
            self._ran.add(phase)
            self._peaks.pop(phase, None)
        before, peak = self._level_allocated, self._phase_allocated_peak
        allocation_terms = after.allocated_bytes is not None and after.reserved_bytes is not None
        if allocation_terms and before is not None and peak is not None:
            extra = max(0, peak - before)
        elif self._level_bytes is not None and after.peak_bytes is not None:
            # host mode (or a torch that reports no allocated peak): in used bytes
            extra = max(0, after.peak_bytes - max(self._level_bytes, after.used_bytes))
        else:
            return  # no peak (track_peak=False): the announced figure stays
        with self._phase_lock:
            if phase in self._measured and extra <= self._extra.get(phase, 0):
                return
            self._extra[phase] = extra
            self._measured.add(phase)
        if self._has_schedule:  # else kept for when a schedule is set: nothing to time it by
            self._publish_schedule()

    def schedule_event(self, ts: float | None = None) -> ScheduleEvent:
        """The schedule as the ``schedule`` event the hook publishes."""
        with self._phase_lock:
            sched, extra, measured = dict(self._schedule), dict(self._extra), self._measured
            measured_list = tuple(p for p in SCHEDULED_PHASES if p in measured)
            peaks = dict(self._peaks)
        return ScheduleEvent(
            ts=time.time() if ts is None else ts,
            node=self.node,
            device=self.device or "-",
            event=SCHEDULE,
            job=self.job,
            eval_every_steps=sched.get("eval_every_steps"),
            checkpoint_every_steps=sched.get("checkpoint_every_steps"),
            step_s=sched.get("step_s"),
            phase_extra_bytes=extra,
            measured=measured_list,
            phase_peak_bytes=peaks,
        )

    def _publish_schedule(self) -> None:
        self._next_schedule_at = time.monotonic() + REPUBLISH_S
        if not self._off:
            self._publish(self.schedule_event())

    def _check(
        self, schedule: Mapping[str, Any], extra: Mapping[str, int], peaks: Mapping[str, int]
    ) -> None:
        """Refuse what the service would refuse, with the same message (one validator)."""
        obj = {"ts": 1.0, "node": "n", "device": "d", "event": SCHEDULE, **schedule}
        parse_schedule({**obj, "phase_extra_bytes": dict(extra), "phase_peak_bytes": dict(peaks)})
