"""The fleet's scorecard: outcomes (``service/pipeline/outcomes.py``) kept in Redis, counted
once, and summed over a window.

``OutcomeStore`` writes each outcome with one script call that adds its id to a sorted
set of ids (scored by the outcome's time) and appends it to the outcomes stream only if
the id was new: an outcome decided twice (a batch read again after a crash, a replica
that took the partition over from a snapshot and saw the same OOM) is on record once. Ids
and entries older than the retention are dropped as new ones come; the stream is also
capped in length.

Anyone who can write to Redis could add entries too, and a scorecard is what decides
whether a model may page people or act. With a key (from the service's control secret,
else its webhook secret) each entry is sealed, and entries whose seal fails are left out
of every sum and counted (``forged``). Without a key nothing is sealed, and nothing can be
told apart: the scorecard says so.

``scorecard`` turns outcomes into the figures an SRE reads (precision, recall at 10 s and
30 s, median lead, false alarms per 1,000 job-hours, time-to-OOM error), per scored model
and optionally by kind, node, job or cause; ``GET /v1/scorecard``, the dashboard and
``oomcast report`` all call it.
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import statistics
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis.asyncio as aioredis

from oomcast.model.signing import service_keys, sign, verify
from oomcast.model.text import as_str
from oomcast.service.pipeline.outcomes import Outcome

log = logging.getLogger(__name__)

OUTCOME_KEY_CONTEXT = b"oomcast:outcomes:v1"
RETENTION_S = 30 * 86400.0
MAXLEN = 500_000
READ_CHUNK = 5000
BY = ("kind", "node", "job", "cause", "model_version")

LATEST_S = 1e11  # no window reaches past this (about the year 5138)
MAX_READ = 200_000  # entries one scorecard reads at most (about 2 s of CPU): then truncated
# KEYS: the ids' sorted set, the stream (one Cluster slot: the {outcomes} hash tag).
# ARGV: now, id, the entry's body, its seal, maxlen, the oldest time kept, the id of the
# alert an OOM claims ("" for none). Ids are scored by when they were recorded (wall time),
# so a repeat is refused for the retention whatever the outcome's own time. An alert an
# OOM claimed is recorded as claimed, so it is not decided again as something else.
RECORD = """
if redis.call('ZADD', KEYS[1], 'NX', ARGV[1], ARGV[2]) == 0 then return 0 end
if ARGV[7] ~= '' then redis.call('ZADD', KEYS[1], 'NX', ARGV[1], ARGV[7]) end
redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[5], '*', 'o', ARGV[3], 'sig', ARGV[4])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[6])
redis.call('XTRIM', KEYS[2], 'MINID', '~', math.floor(tonumber(ARGV[6]) * 1000))
return 1
"""


def outcome_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    return service_keys(control_secret, webhook_secret, OUTCOME_KEY_CONTEXT)


def stream_key(prefix: str) -> str:
    return f"{prefix}:{{outcomes}}:stream"


def ids_key(prefix: str) -> str:
    return f"{prefix}:{{outcomes}}:ids"


@dataclass
class Read:
    """Outcomes read back, and the entries left out."""

    outcomes: list[Outcome] = field(default_factory=list)
    forged: int = 0  # seal missing or wrong (with a key)
    malformed: int = 0
    repeats: int = 0  # copies of an entry already read (same id)
    sealed: bool = False  # whether seals were checked
    read: int = 0  # entries read
    truncated: bool = False  # MAX_READ entries read before the window's end
    covers_from: float | None = None  # the oldest entry the stream still holds


class OutcomeStore:
    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        *,
        seal_keys: Sequence[str] = (),
        maxlen: int = MAXLEN,
        retention_s: float = RETENTION_S,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.seal_keys = tuple(seal_keys)
        self.maxlen = maxlen
        self.retention_s = retention_s

    @property
    def stream(self) -> str:
        return stream_key(self.prefix)

    def stage(self, pipe: Any, outcomes: Sequence[Outcome], now: float | None = None) -> int:
        """Queue the writes of ``outcomes`` on ``pipe`` (a pipeline); the pipeline's results
        for them, in order, say per outcome whether it was new (``added``). Returns how many
        results they take."""
        now = time.time() if now is None else now
        oldest = now - self.retention_s
        ids, stream = ids_key(self.prefix), self.stream
        at = round(now, 3)
        for o in outcomes:
            # sealed with the time it was recorded: the window is read from it, not from the
            # entry's id (which whoever writes an entry chooses)
            body = orjson.dumps(o.to_dict() | {"at": at})
            sig = sign(body, self.seal_keys[0]) if self.seal_keys else ""
            # plain EVAL, as the snapshots' fenced writes: a Cluster pipeline takes it too
            pipe.eval(RECORD, 2, ids, stream, repr(at), o.id, body, sig, self.maxlen, oldest,
                      o.claims or "")  # fmt: skip
        return len(outcomes)

    async def record(self, outcomes: Sequence[Outcome], now: float | None = None) -> list[bool]:
        """Write ``outcomes`` in one round trip; per outcome whether it was new (False: it
        was on record already, and is not counted again)."""
        if not outcomes:
            return []
        pipe = self.client.pipeline(transaction=False)
        self.stage(pipe, outcomes, now)
        return added(await pipe.execute())

    async def read(self, since: float, until: float | None = None) -> Read:
        """The outcomes recorded from ``since`` to ``until`` (unix seconds: when the service
        decided them, as sealed in each entry), oldest first, each id once (a copy of a
        sealed entry is left out as a repeat)."""
        out = Read(sealed=bool(self.seal_keys))
        until = math.inf if until is None else until
        seen: set[str] = set()
        first = await self.client.xrange(self.stream, count=1)
        if first:
            out.covers_from = _entry_s(first[0][0])
        if since > until:
            return out
        # the entry ids are written by Redis at the record's time, a minute's slack around
        # (stream ids are 64-bit milliseconds: a start past year 5000 is clamped there)
        cursor = f"{max(0, int((min(since, LATEST_S) - 60.0) * 1000))}-0"
        last = "+" if until >= LATEST_S else f"{int((until + 60.0) * 1000)}-0"
        while True:
            entries = await self.client.xrange(self.stream, min=cursor, max=last, count=READ_CHUNK)
            for _, fields in entries:
                found = self._decode(fields, out)
                if found is None:
                    continue
                o, at = found
                if not since <= at <= until:
                    continue
                if o.id in seen:
                    out.repeats += 1
                    continue
                seen.add(o.id)
                out.outcomes.append(o)
            out.read += len(entries)
            if len(entries) < READ_CHUNK:
                break
            if out.read >= MAX_READ:
                out.truncated = True
                break
            cursor = "(" + as_str(entries[-1][0])
            await asyncio.sleep(0)  # let ingest and other requests in between chunks
        return out

    def _decode(self, fields: dict[Any, Any], out: Read) -> tuple[Outcome, float] | None:
        body = fields.get(b"o", fields.get("o"))
        sig = fields.get(b"sig", fields.get("sig"))
        if body is None:
            out.malformed += 1
            return None
        raw = body if isinstance(body, bytes) else str(body).encode()
        given = sig if isinstance(sig, bytes) else str(sig or "").encode()
        if self.seal_keys and not any(verify(raw, given, k) for k in self.seal_keys):
            out.forged += 1
            return None
        try:
            data = orjson.loads(raw)
            at = data.pop("at") if isinstance(data, dict) else None
            if not isinstance(at, int | float) or not math.isfinite(at):
                raise ValueError("outcome at: must be the time it was recorded")
            return Outcome.from_dict(data), float(at)
        except (ValueError, TypeError, KeyError) as exc:
            log.warning("an outcome entry left out: %s", exc)
            out.malformed += 1
            return None


def added(results: Sequence[Any]) -> list[bool]:
    """Per staged outcome, from its pipeline results, whether it was new."""
    return [bool(a) for a in results]


def _entry_s(entry_id: Any) -> float:
    return int(as_str(entry_id).split("-")[0]) / 1000.0


_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 7 * 86400.0}


SINCE_PATTERN = r"^([0-9]+(\.[0-9]+)?[smhdw]|[0-9]{10,}(\.[0-9]+)?)$"


def parse_since(text: str, now: float) -> float:
    """A window's start: a span back from ``now`` (``7d``, ``24h``, ``90m``, ``3600s``, ``2w``;
    one past the epoch reaches back to it) or unix seconds (ten digits or more). ValueError
    naming what is wrong."""
    t = text.strip().lower()
    if not re.fullmatch(SINCE_PATTERN, t):
        raise ValueError(
            f"since={text!r}: a span back from now (7d, 24h, 90m, 3600s, 2w) or unix seconds"
        )
    if t[-1] in _UNITS:
        span = float(t[:-1]) * _UNITS[t[-1]]
        return max(0.0, now - span) if math.isfinite(span) else 0.0
    value = float(t)
    return value if math.isfinite(value) else now


# --- the figures ---------------------------------------------------------------------------


def _median(xs: Iterable[float]) -> float | None:
    v = list(xs)
    return round(statistics.median(v), 3) if v else None


def _ratio(a: int, b: int) -> float | None:
    return round(a / b, 4) if b else None


def figures(outcomes: Sequence[Outcome]) -> dict[str, Any]:
    """The scorecard of one model (one group): counts and the ratios an SRE reads."""
    ooms = [o for o in outcomes if o.outcome == "oom"]
    by_class: dict[str, Any] = {}
    for cls in ("long", "short", "sudden"):
        c = [o for o in ooms if o.oom_class == cls]
        w30 = sum(o.warned == "30s" for o in c)
        w10 = sum(o.warned in ("30s", "10s") for o in c)
        by_class[cls] = {
            "n": len(c),
            "warned_30s": w30,
            "warned_10s": w10,
            "recall_30s": _ratio(w30, len(c)),
            "recall_10s": _ratio(w10, len(c)),
        }
    warned = [o for o in ooms if o.warned != "no"]
    false_alarms = sum(o.outcome == "false_alarm" for o in outcomes)
    near = sum(o.outcome == "near_miss" for o in outcomes)
    censored = sum(o.outcome == "censored" for o in outcomes)
    seconds = sum(o.seconds for o in outcomes if o.outcome == "exposure")
    hours = seconds / 3600.0
    w30 = sum(o.warned == "30s" for o in ooms)
    w10 = sum(o.warned in ("30s", "10s") for o in ooms)
    return {
        "ooms": len(ooms),
        "warned_30s": w30,
        "warned_10s": w10,
        "missed_30s": len(ooms) - w30,
        "recall_30s": _ratio(w30, len(ooms)),
        "recall_10s": _ratio(w10, len(ooms)),
        "by_class": by_class,
        "alerts": len(warned) + false_alarms + near + censored,
        "false_alarms": false_alarms,
        "near_misses_alerted": near,
        "censored": censored,
        # of the alerts whose end is known, those an OOM followed (near misses apart)
        "precision": _ratio(len(warned), len(warned) + false_alarms),
        "median_lead_s": _median(o.lead_s for o in warned if o.lead_s is not None),
        "median_tto_error": _median(o.tto_error for o in ooms if o.tto_error is not None),
        "job_hours": round(hours, 3),
        "false_alarms_per_1000_job_hours": round(1000 * false_alarms / hours, 3) if hours else None,
    }


def scorecard(read: Read, since: float, until: float, by: str | None = None) -> dict[str, Any]:
    """The scorecard over a window: per scored model (role and version), and within each,
    per value of ``by`` (one of ``BY``) when asked."""
    if by is not None and by not in BY:
        raise ValueError(f"by={by!r}: one of {', '.join(BY)}")
    models: dict[tuple[str, str], list[Outcome]] = {}
    for o in read.outcomes:
        models.setdefault((o.role, o.model_version), []).append(o)
    rows = []
    for (role, version), outs in sorted(models.items()):
        row: dict[str, Any] = {"role": role, "model_version": version, **figures(outs)}
        if by is not None:
            groups: dict[str, list[Outcome]] = {}
            for o in outs:
                groups.setdefault(str(getattr(o, by) or "-"), []).append(o)
            row["by"] = {k: figures(v) for k, v in sorted(groups.items())}
        rows.append(row)
    return {
        "since": since,
        "until": until,
        "by": by,
        "models": rows,
        "outcomes": len(read.outcomes),
        "left_out": {"forged": read.forged, "malformed": read.malformed, "repeats": read.repeats},
        "sealed": read.sealed,
        "truncated": read.truncated,
        # the stream holds nothing older than this: a window that starts before it is short
        "covers_from": read.covers_from,
        "note": None
        if read.sealed
        else "the service has no secret: outcomes are not sealed, and a forged one could not be"
        " told apart",
    }
