"""Events that carry keys of their own besides the standard ones (DESIGN.md: readers ignore
keys they do not know), and the one event the service reads such keys of: ``schedule``.

A checkpoint acknowledgement names the request it answers, an action result its outcome:
:class:`DetailedEvent` is an :class:`~oomcast.model.schema.Event` with those extra keys, so
that it goes through :func:`oomcast.model.wire.encode_event` like every other event (one
encoding of the events stream) and decodes, with :func:`~oomcast.model.wire.decode_event`,
to its standard part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.schema import (
    Event,
    SchemaError,
    _count,
    _name,
    _optional_str,
    _ts,
)

STANDARD_KEYS = ("ts", "node", "device", "event", "job")


def jsonable(value: Any) -> Any:
    """``value`` with what JSON cannot carry written as its ``str`` (what ``json.dumps(...,
    default=str)`` does): mappings and sequences are walked, tuples become lists."""
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, Mapping):
        return {
            k if isinstance(k, str | int | float | bool) else str(k): jsonable(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return str(value)


@dataclass(slots=True, frozen=True)
class DetailedEvent(Event):
    """An event with extra keys; ``extra`` may not redefine a standard key."""

    extra: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        clash = [k for k in self.extra if k in STANDARD_KEYS]
        if clash:
            raise ValueError(f"extra keys {clash} would replace standard keys of the event")

    @classmethod
    def from_dict(cls, obj: Mapping[str, Any]) -> DetailedEvent:
        """From an event dict (the standard keys plus any others); values JSON cannot carry
        become strings."""
        extra = {k: jsonable(v) for k, v in obj.items() if k not in STANDARD_KEYS}
        return cls(
            ts=float(obj["ts"]),
            node=str(obj["node"]),
            device=str(obj["device"]),
            event=str(obj["event"]),
            job=None if obj.get("job") is None else str(obj["job"]),
            extra=extra,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ts": self.ts, "node": self.node, "device": self.device}
        out["event"] = self.event
        if self.job is not None:
            out["job"] = self.job
        out.update(self.extra)
        return out


# --- the job's schedule -----------------------------------------------------------------------

# The phases a schedule may give extra bytes for: the ones that come at a known step (eval
# and checkpoint every N steps; the optimizer's first step, when its state appears).
SCHEDULED_PHASES = ("eval", "checkpoint", "optimizer")
SCHEDULE = "schedule"


@dataclass(slots=True, frozen=True)
class ScheduleEvent(Event):
    """A ``schedule`` event (DESIGN.md): when a job's periodic phases come and how much
    memory each needs on top of the level between them.

    ``eval_every_steps`` / ``checkpoint_every_steps``: the period, in training steps (the
    ``step`` of the samples), or None when the phase does not recur on a step count;
    ``step_s``: seconds per step as the job announces it (None: measured from the samples);
    ``phase_extra_bytes``: phase -> bytes the phase needs above the level before it;
    ``measured``: the phases whose figure was measured on a real occurrence (the others are
    announced: given by the user or a preflight run); ``phase_peak_bytes``: phase -> the
    most bytes the allocator holds at once while the phase runs, absolute (weights,
    gradients, optimizer state and activations together: allocated bytes, as a preflight
    run computes it before the job starts), for phases that have not run yet."""

    eval_every_steps: int | None = None
    checkpoint_every_steps: int | None = None
    step_s: float | None = None
    phase_extra_bytes: Mapping[str, int] = field(default_factory=dict)
    measured: tuple[str, ...] = ()
    phase_peak_bytes: Mapping[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ts": self.ts, "node": self.node, "device": self.device}
        out["event"] = self.event
        if self.job is not None:
            out["job"] = self.job
        for key in ("eval_every_steps", "checkpoint_every_steps", "step_s"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        out["phase_extra_bytes"] = dict(self.phase_extra_bytes)
        if self.measured:
            out["measured"] = list(self.measured)
        if self.phase_peak_bytes:
            out["phase_peak_bytes"] = dict(self.phase_peak_bytes)
        return out

    def to_detailed(self) -> DetailedEvent:
        """As a :class:`DetailedEvent`, the form the in-job hook queues its events in."""
        return DetailedEvent.from_dict(self.to_dict())


def _period(obj: Mapping[str, Any], key: str) -> int | None:
    value = _count(dict(obj), key, required=False)
    if value == 0:
        raise SchemaError(key, "must be at least 1 step (leave it out when the phase has none)")
    return value


def _step_s(obj: Mapping[str, Any]) -> float | None:
    value = obj.get("step_s")
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError("step_s", f"must be a number of seconds, got {str(value)[:80]!r}")
    try:
        seconds = float(value)
    except OverflowError:
        raise SchemaError("step_s", "is far too large") from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise SchemaError("step_s", f"must be a positive finite number of seconds, got {value!r}")
    return seconds


def _phase_bytes(obj: Mapping[str, Any], name: str, *, required: bool) -> dict[str, int]:
    """``phase_extra_bytes`` or ``phase_peak_bytes``: an object of phase -> byte count."""
    if name not in obj:
        if not required:
            return {}
        raise SchemaError(name, "is required (an empty object when none is known)")
    raw = obj[name]
    if raw is None and not required:
        return {}
    if not isinstance(raw, Mapping):
        raise SchemaError(name, f"must be an object, got {type(raw).__name__}")
    out: dict[str, int] = {}
    for phase, value in raw.items():
        key = f"{name}.{str(phase)[:40]}"
        if phase not in SCHEDULED_PHASES:
            raise SchemaError(key, f"is not one of the phases {', '.join(SCHEDULED_PHASES)}")
        count = _count({key: value}, key, required=True)
        assert count is not None
        out[phase] = count
    return out


def _measured(obj: Mapping[str, Any]) -> tuple[str, ...]:
    raw = obj.get("measured")
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(type(p) is str and p in SCHEDULED_PHASES for p in raw):
        raise SchemaError("measured", f"must be a list of {', '.join(SCHEDULED_PHASES)}")
    return tuple(dict.fromkeys(raw))


def parse_schedule(obj: Mapping[str, Any]) -> ScheduleEvent:
    """A ``schedule`` event, checked field by field; SchemaError names the field that is
    wrong. Keys it does not know are ignored, as for every record."""
    plain = dict(obj)
    if plain.get("event") != SCHEDULE:
        raise SchemaError("event", f"must be {SCHEDULE!r}, got {str(plain.get('event'))[:80]!r}")
    return ScheduleEvent(
        ts=_ts(plain),
        node=_name(plain, "node"),
        device=_name(plain, "device"),
        event=SCHEDULE,
        job=_optional_str(plain, "job"),
        eval_every_steps=_period(plain, "eval_every_steps"),
        checkpoint_every_steps=_period(plain, "checkpoint_every_steps"),
        step_s=_step_s(plain),
        phase_extra_bytes=_phase_bytes(plain, "phase_extra_bytes", required=True),
        measured=_measured(plain),
        phase_peak_bytes=_phase_bytes(plain, "phase_peak_bytes", required=False),
    )


# --- an announced arrival ----------------------------------------------------------------------

ARRIVAL = "arrival"


@dataclass(slots=True, frozen=True)
class ArrivalEvent(Event):
    """An ``arrival`` event: a scheduler announced (``POST /v1/admit`` with ``arrives_in_s``)
    that another job will start on this GPU at ``lands_at`` (ts), needing ``need_bytes`` of
    device memory (its preflight peak reserved plus its CUDA context); ``job`` names the
    arriving job. ``resident_peak_bytes``: what the GPU's residents had used at their highest
    when it was announced (the history the service held then), if known. The service takes
    arrivals only from its own authenticated API, never from the events stream; traces carry
    them so that evaluate replays the announcement (training/scenarios.py writes them)."""

    need_bytes: int = 0
    lands_at: float = 0.0
    resident_peak_bytes: int | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ts": self.ts, "node": self.node, "device": self.device}
        out["event"] = self.event
        if self.job is not None:
            out["job"] = self.job
        out["need_bytes"] = self.need_bytes
        out["lands_at"] = self.lands_at
        if self.resident_peak_bytes is not None:
            out["resident_peak_bytes"] = self.resident_peak_bytes
        return out


def parse_arrival(obj: Mapping[str, Any]) -> ArrivalEvent:
    """An ``arrival`` event, checked field by field; SchemaError names the field."""
    plain = dict(obj)
    if plain.get("event") != ARRIVAL:
        raise SchemaError("event", f"must be {ARRIVAL!r}, got {str(plain.get('event'))[:80]!r}")
    need = _count(plain, "need_bytes", required=True)
    assert need is not None
    if need == 0:
        raise SchemaError("need_bytes", "must be at least 1 byte")
    lands = plain.get("lands_at")
    if isinstance(lands, bool) or not isinstance(lands, int | float) or not math.isfinite(lands):
        raise SchemaError("lands_at", f"must be a finite timestamp, got {str(lands)[:80]!r}")
    return ArrivalEvent(
        ts=_ts(plain),
        node=_name(plain, "node"),
        device=_name(plain, "device"),
        event=ARRIVAL,
        job=_optional_str(plain, "job"),
        need_bytes=need,
        lands_at=float(lands),
        resident_peak_bytes=_count(plain, "resident_peak_bytes", required=False),
    )
