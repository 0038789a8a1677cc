"""What became of each alert and each OOM: the fleet's own labelled examples.

Every domain carries a ``Watch`` per scored model: the model's own alert rule (the rule it
was validated with, ``policy_rule``) run as an episode of its own, whatever rules the
operator configured, so the champion and a shadow are judged alike and a cooldown or a
custom rule changes nothing of the score. From what the service already sees, the watch
decides an ``Outcome``:

- ``oom``: the domain's job ran out of memory. ``warned`` says whether an alert stood (or
  had ended less than ``SETTLE_S`` before) at least 30 s before it (``30s``), at least 10 s
  (``10s``), later (``late``) or not at all (``no``); ``lead_s`` is from the alert's first
  sample. Classed as near the forecaster's scoring (``training/classes.py``) as the service
  can without a manifest's cause: ``short`` under 60 s after the job's first sample,
  ``sudden`` when the level 30 s before
  the OOM stood within ``SUDDEN_RISE`` of its low over the 90 s before that (one step, no
  growth to see), ``long`` otherwise.
- ``near_miss`` / ``false_alarm``: an alert ended and ``SETTLE_S`` passed with no OOM; a near
  miss when the domain came within 10% of its limit after the alert fired.
- ``censored``: the job ended (another job, silence, a timeline reset) while the alert
  stood or within ``CENSOR_S`` of its end: its future is unknown, neither a hit nor a false
  alarm. When another job takes the domain, the ended job's watch is held ``CENSOR_S``
  past its last sample: its OOM event may be read after the new job's first samples.
- ``exposure``: seconds of a job watched, flushed every ``EXPOSURE_FLUSH_S`` of its time
  and when it ends: the denominator of false alarms per 1,000 job-hours.

An outcome's ``id`` comes from what decided it (an OOM's ts; an alert's id, whatever the
alert is decided to be; the job's first sample for exposure), so deciding it again (a
batch read twice after a crash, a successor restored from an older snapshot) gives the
same id, and the store counts it once (``service/scorecard.py``). The watch is carried in
the domain's snapshot.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.forecast import Forecast
from oomcast.model.schema import Sample
from oomcast.service.pipeline.rules import Episode, Rule, advance

SETTLE_S = 300.0  # an alert that ended stays open this long for an OOM to claim it
CENSOR_S = 60.0  # a job that ends this close to an alert leaves it unjudged
NEAR_LEVEL = 0.9  # a near miss came within 10% of its limit
LONG_AFTER_S = 60.0  # an OOM this long after the job's first sample is a long one
SUDDEN_RISE = 0.03  # growth under this share of capacity before T-30 s: nothing to see
TRAIL_EVERY_S = 5.0  # the level (and the forecast's time to OOM) kept every this often ...
TRAIL_S = 180.0  # ... over this long: what an OOM's class and time-to-OOM error are read from
EXPOSURE_FLUSH_S = 6 * 3600.0  # a job's watched seconds are written out at least this often
CHAMPION = "champion"  # the model that acts; a shadow is scored beside it, acting on nothing
SHADOW = "shadow"
OUTCOMES = ("oom", "near_miss", "false_alarm", "censored", "exposure")
WARNED = ("30s", "10s", "late", "no")
OOM_CLASSES = ("long", "short", "sudden")


@dataclass(frozen=True, slots=True)
class Outcome:
    """One decided outcome of one domain for one scored model (``role``)."""

    id: str
    outcome: str  # one of OUTCOMES
    ts: float  # trace time it was decided at (the OOM, the settling, the job's end)
    node: str
    device: str
    kind: str
    job: str | None
    role: str
    model_version: str
    oom_class: str | None = None  # an OOM's: one of OOM_CLASSES
    warned: str | None = None  # an OOM's: one of WARNED
    lead_s: float | None = None  # the OOM's ts less the alert's first sample's
    alert_ts: float | None = None
    episode: str | None = None
    time_to_oom_s: float | None = None  # an OOM's: the forecast 30 s before it
    tto_error: float | None = None  # |that forecast - 30| / 30
    max_level: float = 0.0
    seconds: float = 0.0  # exposure: seconds of the job watched since the last flush
    cause: str | None = None  # what the alert said the OOM would come from
    claims: str | None = None  # an OOM's: the id of the alert it claims (alert_outcome_id)
    # an alert's settled by an OOM long after it ended ("oom"): its samples run into the OOM
    ended_by: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name in self.__slots__:
            value = getattr(self, name)
            if value is not None:
                out[name] = round(value, 3) if isinstance(value, float) else value
        return out

    @classmethod
    def from_dict(cls, data: Any) -> Outcome:
        """An outcome read back; ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("an outcome must be an object")
        unknown = set(data) - set(cls.__slots__)
        if unknown:
            raise ValueError(f"outcome: unknown fields {sorted(unknown)}")
        for name in ("id", "outcome", "node", "device", "kind", "role", "model_version"):
            if not isinstance(data.get(name), str):
                raise ValueError(f"outcome {name}: must be a string, got {data.get(name)!r}")
        if data["outcome"] not in OUTCOMES:
            raise ValueError(f"outcome: {data['outcome']!r} is not one of {OUTCOMES}")
        for name in ("ts", "max_level", "seconds"):
            if name in data and not _finite(data[name]):
                raise ValueError(f"outcome {name}: must be a finite number, got {data[name]!r}")
        for name in ("lead_s", "alert_ts", "time_to_oom_s", "tto_error"):
            if data.get(name) is not None and not _finite(data[name]):
                raise ValueError(f"outcome {name}: must be a number or null")
        if data.get("warned") not in (None, *WARNED):
            raise ValueError(f"outcome warned: {data['warned']!r} is not one of {WARNED}")
        if data.get("oom_class") not in (None, *OOM_CLASSES):
            raise ValueError(
                f"outcome oom_class: {data['oom_class']!r} is not one of {OOM_CLASSES}"
            )
        for name in ("job", "episode", "cause", "claims", "ended_by"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise ValueError(f"outcome {name}: must be a string or null")
        if "ts" not in data:
            raise ValueError("outcome ts: missing")
        fields: dict[str, Any] = {"job": None, **data}
        return cls(**fields)


def _finite(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v)


def outcome_id(*parts: object) -> str:
    key = "\0".join(repr(p) if isinstance(p, float) else str(p) for p in parts).encode()
    return hashlib.sha256(key).hexdigest()[:24]


def alert_outcome_id(role: str, alert_id: str | None, alert_ts: float | None) -> str:
    """One id per scored alert, whatever it is decided to be (a false alarm, a near miss,
    censored; an OOM that claims it records it as its ``claims``): deciding the same alert
    again, differently (after a replay from an older snapshot), is refused as a repeat."""
    return outcome_id("alert", role, alert_id, alert_ts)


@dataclass
class Watch:
    """One scored model's view of one domain's current job (see the module's docstring)."""

    start_ts: float | None = None  # the job's first sample
    last_ts: float | None = None
    flushed_ts: float | None = None  # exposure written up to here
    max_level: float = 0.0
    episode: Episode = field(default_factory=Episode)
    alert_ts: float | None = None  # the scored alert's first sample (episodes merged)
    alert_id: str | None = None
    alert_end_ts: float | None = None  # None while it stands
    alert_max_level: float = 0.0
    cause: str | None = None
    # (ts, level, the forecast's time to OOM or None) every TRAIL_EVERY_S, the last TRAIL_S
    trail: list[tuple[float, float, float | None]] = field(default_factory=list)
    # The previous job's watch, for CENSOR_S after its last sample once another job took the
    # domain: its OOM event may still come (read after the new job's first samples).
    ended: Watch | None = None
    ended_job: str | None = None
    ended_version: str | None = None
    # The model whose watch this is: its outcomes carry this version, whichever model acts
    # when they are decided (a swap moves watches with their models: service/model_swap.py)
    version: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in _WATCH_SCALARS}
        out["episode"] = self.episode.to_dict()
        out["trail"] = [list(p) for p in self.trail]
        if self.ended is not None:
            out["ended"] = self.ended.to_dict()
        return out

    @classmethod
    def from_dict(cls, data: Any, *, nested: bool = False) -> Watch:
        """A watch read back from a snapshot; ValueError naming what is wrong."""
        if not isinstance(data, dict):
            raise ValueError("watch must be an object")
        w = cls(episode=Episode.from_dict(data.get("episode", {})))
        ended = data.get("ended")
        if ended is not None:
            if nested:
                raise ValueError("watch ended: an ended job's watch holds no other")
            w.ended = cls.from_dict(ended, nested=True)
        w.trail = _trail(data.get("trail", []))
        for k in _WATCH_SCALARS:
            setattr(w, k, _scalar(k, data.get(k)))
        last = w.last_ts if w.last_ts is not None else w.start_ts
        if (w.start_ts is None) != (w.flushed_ts is None) or (
            w.start_ts is not None
            and w.flushed_ts is not None
            and last is not None
            and not w.start_ts <= w.flushed_ts <= last
        ):
            raise ValueError("watch: start_ts <= flushed_ts <= last_ts does not hold")
        return w

    def times(self) -> list[float]:
        """Every time the watch holds (a restored one must not lie in the future)."""
        held = (self.start_ts, self.last_ts, self.flushed_ts, self.alert_ts, self.alert_end_ts,
                *(p[0] for p in self.trail[-1:]))  # fmt: skip
        out = [t for t in held if t is not None]
        return out + (self.ended.times() if self.ended is not None else [])


_WATCH_SCALARS = ("start_ts", "last_ts", "flushed_ts", "max_level", "alert_ts", "alert_id",
                  "alert_end_ts", "alert_max_level", "cause", "ended_job",
                  "ended_version", "version")  # fmt: skip


def _trail(trail: Any) -> list[tuple[float, float, float | None]]:
    if not isinstance(trail, list) or len(trail) > 2 * TRAIL_S / TRAIL_EVERY_S + 2:
        raise ValueError("watch trail: must be a short list")
    out = []
    for p in trail:
        if not (isinstance(p, list) and len(p) == 3 and _finite(p[0]) and _finite(p[1])
                and (p[2] is None or _finite(p[2]))):  # fmt: skip
            raise ValueError(f"watch trail: {p!r} is not [ts, level, tto or null]")
        out.append((float(p[0]), float(p[1]), None if p[2] is None else float(p[2])))
    return out


def _scalar(k: str, v: Any) -> Any:
    if k in ("alert_id", "cause", "ended_job", "ended_version", "version"):
        if v is not None and not isinstance(v, str):
            raise ValueError(f"watch {k}: must be a string or null")
        return v
    if k in ("max_level", "alert_max_level"):
        if not _finite(v if v is not None else 0.0):
            raise ValueError(f"watch {k}: must be a number")
        return float(v or 0.0)
    if v is not None and not _finite(v):
        raise ValueError(f"watch {k}: must be a number or null")
    return v


@dataclass(frozen=True)
class Scored:
    """Who is scored: ``role`` (champion, shadow), by its own ``rule``. A shadow brings its
    own ``forecaster``, stepped on the same samples with a state of its own per domain; the
    champion's (None here) is the one that acts."""

    role: str
    rule: Rule
    forecaster: Any = None  # a Forecaster; Any: this module does not import the model's


def _base(w: Watch, s: Scored, sample: Sample, job: str | None, version: str) -> dict[str, Any]:
    return {
        "node": sample.node,
        "device": sample.device,
        "kind": sample.kind,
        "job": job,
        "role": s.role,
        "model_version": version,
        "max_level": w.max_level,
    }


def observe(
    w: Watch,
    s: Scored,
    sample: Sample,
    fc: Forecast,
    job: str | None,
    cause_of: Callable[[Any], str | None] | None = None,
    about: Any = None,
) -> list[Outcome]:
    """One forecast of the domain: the scored episode advanced; an ended alert settled
    when ``SETTLE_S`` passed without an OOM; exposure flushed when due. ``cause_of(about)``:
    what the domain's diagnosis says now, asked only when an alert fires."""
    ts = sample.ts
    out: list[Outcome] = []
    if w.ended is not None and ts - (w.ended.last_ts or ts) >= CENSOR_S:
        out.extend(_decide_ended(w, s, sample))  # no OOM came for the job before this one
    if w.start_ts is None:
        w.start_ts = w.flushed_ts = ts
    level = sample.used_frac
    if level > w.max_level:
        w.max_level = level
    if w.alert_ts is not None and level > w.alert_max_level:
        w.alert_max_level = level
    ep = w.episode
    if ep.firing or ep.above or s.rule.fires(fc):
        alert = advance(ep, s.rule, sample, fc, job, ts)
        if alert is not None and alert.status == "firing" and not alert.repeat:
            if w.alert_ts is None:  # a new scored alert (one ending recently merges in)
                w.alert_ts, w.alert_id = ts, alert.episode
                w.cause = cause_of(about) if cause_of is not None else None
                w.alert_max_level = level
            w.alert_end_ts = None
        elif alert is not None and alert.status == "resolved":
            w.alert_end_ts = ts
    if w.alert_end_ts is not None and ts - w.alert_end_ts >= SETTLE_S:
        out.append(_settled(w, s, sample, job, fc.model_version, ts))
    w.last_ts = ts
    trail = w.trail
    if not trail or ts - trail[-1][0] >= TRAIL_EVERY_S:
        trail.append((ts, level, fc.time_to_oom_s))
        while ts - trail[0][0] > TRAIL_S:
            del trail[0]
    if w.flushed_ts is not None and ts - w.flushed_ts >= EXPOSURE_FLUSH_S:
        out.append(_exposure(w, s, sample, job, fc.model_version))
    return out


def _settled(
    w: Watch,
    s: Scored,
    sample: Sample,
    job: str | None,
    version: str,
    ts: float,
    ended_by: str | None = None,
) -> Outcome:
    kind = "near_miss" if w.alert_max_level >= NEAR_LEVEL else "false_alarm"
    out = Outcome(
        id=alert_outcome_id(s.role, w.alert_id, w.alert_ts),
        outcome=kind,
        ts=ts,
        alert_ts=w.alert_ts,
        episode=w.alert_id,
        cause=w.cause,
        ended_by=ended_by,
        **_base(w, s, sample, job, version) | {"max_level": w.alert_max_level},
    )
    _clear_alert(w)
    return out


def _exposure(w: Watch, s: Scored, sample: Sample, job: str | None, version: str) -> Outcome:
    assert w.flushed_ts is not None and w.start_ts is not None
    until = w.last_ts if w.last_ts is not None else w.flushed_ts
    out = Outcome(
        id=outcome_id("exposure", s.role, sample.node, sample.device, w.start_ts, w.flushed_ts),
        outcome="exposure",
        ts=until,
        seconds=max(0.0, until - w.flushed_ts),
        **_base(w, s, sample, job, version),
    )
    w.flushed_ts = until
    return out


def _clear_alert(w: Watch) -> None:
    w.alert_ts = w.alert_id = w.alert_end_ts = w.cause = None
    w.alert_max_level = 0.0


def on_oom(
    w: Watch,
    s: Scored,
    last: Sample,
    oom_ts: float,
    job: str | None,
    version: str,
) -> list[Outcome]:
    """The domain's job ran out of memory at ``oom_ts`` (``last``: its newest sample): the
    OOM's outcome and the job's exposure; the watch starts over for the next job. An OOM
    that came before the current job's first sample, within ``CENSOR_S`` of the previous
    job's last, is that job's (its event read after the new job's first samples). An OOM
    with no job watched since the last one (a repeat event) decides nothing."""
    e = w.ended
    if (
        e is not None
        and (w.start_ts is None or oom_ts < w.start_ts)
        and (e.last_ts is not None and oom_ts <= e.last_ts + CENSOR_S)
    ):
        ended_job, ended_version = w.ended_job, w.ended_version or version
        _forget_ended(w)
        return _oom(e, s, last, oom_ts, ended_job, ended_version)
    if w.start_ts is None:
        return []
    return _oom(w, s, last, oom_ts, job, version)


def _oom(
    w: Watch, s: Scored, last: Sample, oom_ts: float, job: str | None, version: str
) -> list[Outcome]:
    lead = None
    warned = "no"
    if (
        w.alert_ts is not None
        and w.alert_ts <= oom_ts
        and (w.alert_end_ts is None or oom_ts - w.alert_end_ts < SETTLE_S)
    ):
        lead = oom_ts - w.alert_ts
        warned = "30s" if lead >= 30.0 else "10s" if lead >= 10.0 else "late"
    tto, true_tto, level30, low = _before(w.trail, oom_ts)
    age = oom_ts - (w.start_ts if w.start_ts is not None else oom_ts)
    if age < LONG_AFTER_S:
        cls = "short"
    elif level30 is not None and low is not None and level30 - low < SUDDEN_RISE:
        cls = "sudden"
    else:
        cls = "long"
    out = [
        Outcome(
            id=outcome_id("oom", s.role, last.node, last.device, oom_ts),
            outcome="oom",
            ts=oom_ts,
            oom_class=cls,
            warned=warned,
            lead_s=lead,
            alert_ts=w.alert_ts if lead is not None else None,
            episode=w.alert_id if lead is not None else None,
            time_to_oom_s=tto,
            tto_error=None if tto is None or true_tto is None else abs(tto - true_tto) / true_tto,
            cause=w.cause if lead is not None else None,
            claims=alert_outcome_id(s.role, w.alert_id, w.alert_ts) if lead is not None else None,
            **_base(w, s, last, job, version),
        )
    ]
    if w.alert_ts is not None and lead is None:  # an older alert, settled as it stood
        out.insert(0, _settled(w, s, last, job, version, oom_ts, ended_by="oom"))
    out.extend(_end(w, s, last, job, version))
    return out


def hand_over(
    w: Watch, s: Scored, last: Sample | None, job: str | None, version: str
) -> tuple[Watch, list[Outcome]]:
    """Another job took the domain: the watch for it, holding this job's as ``ended`` (its
    OOM event may still come); an older ended job's outcome is decided now."""
    out = _decide_ended(w, s, last)
    fresh = Watch()
    if w.start_ts is not None:
        fresh.ended, fresh.ended_job, fresh.ended_version = w, job, version
    return fresh, out


def on_end(
    w: Watch, s: Scored, last: Sample | None, job: str | None, version: str
) -> list[Outcome]:
    """The job ended without an OOM (it fell silent, its timeline was reset): an alert
    standing or ended within ``CENSOR_S`` is censored, one ended earlier is settled as it
    stood; the job's exposure; the watch starts over. An ended job still held is decided
    first."""
    out = _decide_ended(w, s, last)
    if last is None or w.start_ts is None:
        _reset(w)
        return out
    if w.alert_ts is not None:
        end = w.last_ts if w.last_ts is not None else last.ts
        if w.alert_end_ts is None or end - w.alert_end_ts < CENSOR_S:
            out.append(
                Outcome(
                    id=alert_outcome_id(s.role, w.alert_id, w.alert_ts),
                    outcome="censored",
                    ts=end,
                    alert_ts=w.alert_ts,
                    episode=w.alert_id,
                    cause=w.cause,
                    **_base(w, s, last, job, version),
                )
            )
            _clear_alert(w)
        else:
            out.append(_settled(w, s, last, job, version, end))
    out.extend(_end(w, s, last, job, version))
    return out


def _decide_ended(w: Watch, s: Scored, last: Sample | None) -> list[Outcome]:
    e = w.ended
    if e is None:
        return []
    job, version = w.ended_job, w.ended_version or "unknown"
    _forget_ended(w)
    return on_end(e, s, last, job, version)


def _forget_ended(w: Watch) -> None:
    w.ended = w.ended_job = w.ended_version = None


def _end(w: Watch, s: Scored, last: Sample, job: str | None, version: str) -> list[Outcome]:
    out = []
    if w.flushed_ts is not None and w.last_ts is not None and w.last_ts > w.flushed_ts:
        out.append(_exposure(w, s, last, job, version))
    _reset(w)
    return out


def _reset(w: Watch) -> None:
    """The watch starts over for the next job (an ended job it holds is kept)."""
    fresh = Watch()
    for k in (*_WATCH_SCALARS, "episode", "trail"):
        if k not in ("ended_job", "ended_version"):
            setattr(w, k, getattr(fresh, k))


def _before(
    trail: list[tuple[float, float, float | None]], oom_ts: float
) -> tuple[float | None, float | None, float | None, float | None]:
    """From the trail before an OOM, at its last point 30 s or more before it: the
    forecast's time to OOM, the true one (the OOM's ts less that point's) and the level;
    and the lowest level in the 90 s before that point."""
    at = [p for p in trail if p[0] <= oom_ts - 30.0]
    if not at:
        return None, None, None, None
    ts, level, tto = at[-1]
    low = min(p[1] for p in at if p[0] >= ts - 90.0)
    return tto, oom_ts - ts, level, low
