"""Events that carry keys of their own besides the standard ones (DESIGN.md: readers ignore
keys they do not know).

A checkpoint acknowledgement names the request it answers, an action result its outcome:
:class:`DetailedEvent` is an :class:`~oomcast.model.schema.Event` with those extra keys, so
that it goes through :func:`oomcast.model.wire.encode_event` like every other event (one
encoding of the events stream) and decodes, with :func:`~oomcast.model.wire.decode_event`,
to its standard part.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.schema import Event

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
