"""Typed records of the trace format (DESIGN.md) and their validation.

A trace, a Redis sample stream and ``POST /v1/samples`` all carry the same JSON objects: a
*sample* of one memory domain, or an *event* such as ``oom``. Everything that reads them goes
through :func:`parse_record`, so a malformed object is refused the same way everywhere, with
an error that names the field.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any, TypeVar, cast, dataclass_transform

import orjson

from oomcast.model.processes import ProcessUse, parse_processes

KINDS = ("gpu", "host")
# used/allocated/reserved/peak may exceed capacity a little (a cgroup overshoots its limit
# before reclaim, NVML rounds); more than twice the capacity is a unit mix-up or garbage.
SANITY_FACTOR = 2.0
MAX_COUNT = (1 << 63) - 1  # counters and byte counts must fit in a signed 64-bit integer
OPTIONAL_BYTE_FIELDS = ("allocated_bytes", "reserved_bytes", "peak_bytes")
# What a job is doing when the in-process hook samples it (``phase``, with the training
# ``step``): the phase forecaster (model/phase.py) times the scheduled ones.
PHASES = ("forward", "backward", "optimizer", "eval", "checkpoint", "other")
_PHASE_SET = frozenset(PHASES)
# Names are keys of live state, Redis fields and log lines: bounded, and free of control
# characters (a newline in a device name would forge a log line). 512 leaves room for the
# longest Kubernetes cgroup paths (``cgroup:/kubepods.slice/...``, about 200 characters).
MAX_NAME_CHARS = 512
_CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")


class SchemaError(ValueError):
    """A record that does not follow the trace format; ``field`` names the offending key."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.message = message


Domain = tuple[str, str]  # (node, device)

_T = TypeVar("_T")


@dataclass_transform(frozen_default=True)
def record(cls: type[_T]) -> type[_T]:
    """A value class: a slotted dataclass, immutable to the type checker (mypy refuses an
    assignment to a field, as for ``frozen=True``) and hashable by its fields, but not frozen
    at run time: a frozen dataclass sets each field through ``object.__setattr__``, and for
    the 14 fields of a Sample that made its construction 2.0 us instead of 0.3 us, on a path
    that builds one per sample ingested (the drain's budget is about 18 us a sample)."""
    make: Callable[[type[_T]], type[_T]] = dataclass(slots=True, unsafe_hash=True)
    return make(cls)


@record
class Sample:
    ts: float
    node: str
    device: str
    kind: str
    total_bytes: int
    used_bytes: int
    allocated_bytes: int | None = None
    reserved_bytes: int | None = None
    peak_bytes: int | None = None
    alloc_retries: int | None = None
    job: str | None = None
    step: int | None = None  # training step of the job (the in-process hook's)
    phase: str | None = None  # one of PHASES
    processes: tuple[ProcessUse, ...] | None = None  # per-process GPU memory (model/processes.py)

    @property
    def domain(self) -> Domain:
        return (self.node, self.device)

    @property
    def used_frac(self) -> float:
        return self.used_bytes / self.total_bytes

    def to_dict(self) -> dict[str, Any]:
        # By hand, not dataclasses.asdict (which deep-copies every field): the agent calls
        # this for every sample it publishes, and asdict was a tenth of its tick.
        out: dict[str, Any] = {
            "ts": self.ts,
            "node": self.node,
            "device": self.device,
            "kind": self.kind,
            "total_bytes": self.total_bytes,
            "used_bytes": self.used_bytes,
        }
        for key in _OPTIONAL_SAMPLE_FIELDS:
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.processes is not None:
            out["processes"] = [p.to_dict() for p in self.processes]
        return out


_OPTIONAL_SAMPLE_FIELDS = (
    "allocated_bytes",
    "reserved_bytes",
    "peak_bytes",
    "alloc_retries",
    "job",
    "step",
    "phase",
)


@dataclass(slots=True, frozen=True)
class Event:
    ts: float
    node: str
    device: str
    event: str
    job: str | None = None

    @property
    def domain(self) -> Domain:
        return (self.node, self.device)

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if v is not None}


Record = Sample | Event


def _ts(obj: dict[str, Any]) -> float:
    if "ts" not in obj:
        raise SchemaError("ts", "is required")
    value = obj["ts"]
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SchemaError("ts", f"must be a number of unix seconds, got {value!r}")
    try:
        ts = float(value)
    except OverflowError:
        raise SchemaError("ts", "is far too large to be unix seconds") from None
    if not math.isfinite(ts) or ts <= 0:
        raise SchemaError("ts", f"must be a positive finite number of unix seconds, got {value!r}")
    return ts


def _check_name(key: str, value: str) -> str:
    if len(value) > MAX_NAME_CHARS:
        raise SchemaError(key, f"is {len(value)} characters long; the limit is {MAX_NAME_CHARS}")
    if _CONTROL_CHARS.search(value):
        raise SchemaError(key, f"must not contain control characters, got {value[:80]!r}")
    return value


def _name(obj: dict[str, Any], key: str) -> str:
    if key not in obj:
        raise SchemaError(key, "is required")
    value = obj[key]
    if not isinstance(value, str) or not value.strip():
        raise SchemaError(key, f"must be a non-empty string, got {str(value)[:80]!r}")
    return _check_name(key, value)


def _optional_str(obj: dict[str, Any], key: str) -> str | None:
    value = obj.get(key)
    if value is None:
        return None
    if not isinstance(value, str):
        raise SchemaError(key, f"must be a string, got {str(value)[:80]!r}")
    return _check_name(key, value)


def _count(obj: dict[str, Any], key: str, *, required: bool) -> int | None:
    if key not in obj or obj[key] is None:
        if required:
            raise SchemaError(key, "is required")
        return None
    value = obj[key]
    # JSON writers in other languages send 1.6e10 for an integer; accept whole floats only.
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise SchemaError(key, f"must be a whole number, got {value!r}")
    if value < 0:
        raise SchemaError(key, f"must not be negative, got {value}")
    if value > MAX_COUNT:
        raise SchemaError(key, "does not fit in 64 bits")
    return value


# Names already found good (node, device and job names repeat on every tick): checked once.
# Bounded: emptied when full, so a flood of new names costs checks, not memory.
_GOOD_NAMES: set[str] = set()
_GOOD_NAMES_MAX = 200_000


def _good_name(value: object, *, blank_ok: bool = False) -> bool:
    """Whether ``value`` passes ``_name`` (or, ``blank_ok``, ``_optional_str``) as it is."""
    if type(value) is not str:
        return False
    if value in _GOOD_NAMES:
        return True
    if (
        len(value) > MAX_NAME_CHARS
        or (not blank_ok and (not value or value.isspace()))
        or _CONTROL_CHARS.search(value)
    ):
        return False
    if not blank_ok:  # a blank job name is good only as a job name
        if len(_GOOD_NAMES) >= _GOOD_NAMES_MAX:
            _GOOD_NAMES.clear()
        _GOOD_NAMES.add(value)
    return True


def _fast_sample(obj: dict[str, Any]) -> Sample | None:
    """The sample, when ``obj`` is as agents write it (float ts, int counts, names of plain
    text) and valid; None sends it down the field-by-field checks, which say what is wrong.
    Accepts exactly what those accept, for what it handles: the ingest hot path."""
    get, good = obj.get, _GOOD_NAMES
    ts, node, device, kind = get("ts"), get("node"), get("device"), get("kind")
    total, used = get("total_bytes"), get("used_bytes")
    if (
        type(ts) is not float
        or not 0.0 < ts < math.inf
        or (kind != "gpu" and kind != "host")
        or type(total) is not int
        or not 0 < total <= MAX_COUNT
        or type(used) is not int
        or not 0 <= used <= MAX_COUNT
        or used > SANITY_FACTOR * total
        or ((type(node) is not str or node not in good) and not _good_name(node))
        or ((type(device) is not str or device not in good) and not _good_name(device))
    ):
        return None
    bound = SANITY_FACTOR * total
    alloc, reserved, peak = get("allocated_bytes"), get("reserved_bytes"), get("peak_bytes")
    for v in (alloc, reserved, peak):
        if v is not None and (type(v) is not int or not 0 <= v <= MAX_COUNT or v > bound):
            return None
    retries, job = get("alloc_retries"), get("job")
    if retries is not None and (type(retries) is not int or not 0 <= retries <= MAX_COUNT):
        return None
    if (
        job is not None
        and (type(job) is not str or job not in good)
        and not _good_name(job, blank_ok=True)
    ):
        return None
    step, phase = get("step"), get("phase")
    if step is not None and (type(step) is not int or not 0 <= step <= MAX_COUNT):
        return None
    if phase is not None and (type(phase) is not str or phase not in _PHASE_SET):
        return None
    procs = get("processes")
    if procs is not None:
        procs, problem = parse_processes(procs, bound, _good_name)
        if problem is not None:
            return None
    node, device = cast(str, node), cast(str, device)
    return Sample(
        ts, node, device, kind, total, used, alloc, reserved, peak, retries, job, step, phase, procs
    )


def parse_sample(obj: dict[str, Any]) -> Sample:
    fast = _fast_sample(obj)
    return fast if fast is not None else _checked_sample(obj)


REQUIRED_SAMPLE_FIELDS = ("ts", "node", "device", "kind", "total_bytes", "used_bytes")


def _checked_sample(obj: dict[str, Any]) -> Sample:
    """Field by field, each check naming its field when it fails; every missing required
    field at once (a 422 that named one at a time took as many tries as fields)."""
    missing = [k for k in REQUIRED_SAMPLE_FIELDS if obj.get(k) is None]
    if len(missing) > 1:
        raise SchemaError(missing[0], f"is required, and so are {', '.join(missing[1:])}")
    ts = _ts(obj)
    node = _name(obj, "node")
    device = _name(obj, "device")
    kind = obj.get("kind")
    if kind not in KINDS:
        raise SchemaError("kind", f"must be one of {', '.join(KINDS)}, got {kind!r}")
    total = _count(obj, "total_bytes", required=True)
    assert total is not None
    if total == 0:
        raise SchemaError("total_bytes", "must be positive, got 0")
    used = _count(obj, "used_bytes", required=True)
    assert used is not None
    bound = SANITY_FACTOR * total
    if used > bound:
        raise SchemaError(
            "used_bytes",
            f"{used} is more than {SANITY_FACTOR:g}x total_bytes ({total}); wrong units?",
        )
    optional: dict[str, int | None] = {}
    for key in OPTIONAL_BYTE_FIELDS:
        value = _count(obj, key, required=False)
        if value is not None and value > bound:
            raise SchemaError(
                key, f"{value} is more than {SANITY_FACTOR:g}x total_bytes ({total}); wrong units?"
            )
        optional[key] = value
    return Sample(
        ts=ts,
        node=node,
        device=device,
        kind=kind,
        total_bytes=total,
        used_bytes=used,
        allocated_bytes=optional["allocated_bytes"],
        reserved_bytes=optional["reserved_bytes"],
        peak_bytes=optional["peak_bytes"],
        alloc_retries=_count(obj, "alloc_retries", required=False),
        job=_optional_str(obj, "job"),
        step=_count(obj, "step", required=False),
        phase=_phase(obj),
        processes=_processes(obj, bound),
    )


def _processes(obj: dict[str, Any], bound: float) -> tuple[ProcessUse, ...] | None:
    procs, problem = parse_processes(obj.get("processes"), bound, _good_name)
    if problem is not None:
        raise SchemaError("processes", problem)
    return procs


def _phase(obj: dict[str, Any]) -> str | None:
    value = obj.get("phase")
    if value is None:
        return None
    if not isinstance(value, str) or value not in _PHASE_SET:
        raise SchemaError("phase", f"must be one of {', '.join(PHASES)}, got {str(value)[:80]!r}")
    return value


def parse_event(obj: dict[str, Any]) -> Event:
    name = obj.get("event")
    if not isinstance(name, str) or not name:
        raise SchemaError("event", f"must be a non-empty string, got {str(name)[:80]!r}")
    _check_name("event", name)
    if name == "schedule":
        # events.py builds on this module: imported here, where it is needed, not at the top
        from oomcast.model.events import parse_schedule

        return parse_schedule(obj)
    if name == "arrival":
        from oomcast.model.events import parse_arrival

        return parse_arrival(obj)
    return Event(
        ts=_ts(obj),
        node=_name(obj, "node"),
        device=_name(obj, "device"),
        event=name,
        job=_optional_str(obj, "job"),
    )


def decode_json(raw: str | bytes, field: str = "") -> Any:
    """json.loads that turns every way text can fail to be JSON into a SchemaError: syntax,
    bad UTF-8, numbers past Python's digit limit, nesting past the recursion limit.

    orjson first (several times faster: this is the ingest hot path); what it refuses (NaN,
    integers past 64 bits, lone surrogates) goes to the standard parser, so that the caller
    sees the same values, and the same errors, as before it: a sample with a 400-digit count
    is refused by the sample's own checks, not the whole entry by the parser."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        pass
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise SchemaError(field, f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError too
        raise SchemaError(field, f"not valid JSON: {type(exc).__name__}: {exc}"[:300]) from None


def parse_record(obj: Any) -> Record:
    """Parse one trace object into a Sample or an Event; unknown keys are ignored."""
    if not isinstance(obj, dict):
        raise SchemaError("", f"a record must be a JSON object, got {type(obj).__name__}")
    if "event" in obj:
        return parse_event(obj)
    return parse_sample(obj)


class OrderChecker:
    """Refuses a sample whose ts is not after the previous sample of the same domain."""

    def __init__(self) -> None:
        self._last_ts: dict[Domain, float] = {}

    def check(self, sample: Sample) -> None:
        last = self._last_ts.get(sample.domain)
        if last is not None and sample.ts <= last:
            raise SchemaError(
                "ts",
                f"{sample.ts} is not after the previous sample of {sample.node}/{sample.device}"
                f" ({last}); samples of one domain must be in time order",
            )

    def accept(self, sample: Sample) -> None:
        self.check(sample)
        self._last_ts[sample.domain] = sample.ts
