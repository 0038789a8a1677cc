"""One domain's live state as bytes, kept in Redis, so a replica that takes a partition over
continues its domains instead of starting them cold.

A blob (``encode`` / ``decode``) holds the forecaster's per-domain state (for the LSTM: its
``h`` and ``c``, the committed tick and the embedding's running fits; for a baseline, its
window), the last sample and forecast, the job, the counters, the newest points of the
history (bounded: enough to recognize redelivered samples) and every rule's open
episode, so an episode that fired on the old owner does not fire again on the new one.

The format is versioned (``SNAPSHOT_VERSION``, in a magic prefix and in the body). A blob
that is corrupt or of another format is ignored with a warning: the domain starts cold,
nothing crashes. A blob made with another model or embedding schema keeps everything but
the forecaster's state (that means nothing to another network): the episodes and the
counters still hold, so a rolling upgrade neither pages twice nor leaves an episode open.

``SnapshotStore`` keeps the blobs of one partition in one hash,
``<prefix>:snapshot:{<p>}`` (the partition's Cluster slot), written with the batch's
audit records, before the entries are acknowledged; with the writer's lease token the
write is fenced (a script writes only while the partition's lease holds that token), so a
replica that lost its lease cannot overwrite its successor's state.

Anyone who can write to Redis could write a blob too (a chosen LSTM state once made a flat
40% line read as an OOM, and a shed followed). With a key (derived from the service's
control secret, else its webhook secret: ``snapshot_key``) each blob is sealed when staged,
``sha256=<MAC>\n<blob>``, the MAC binding the blob to its partition and field; a blob whose
seal fails is not restored (its domain starts cold) and is counted. A restored blob whose
times lie ahead of the clock (past ``max_future_s``) is not restored either. And a restored
state is a warm start, not evidence: the domain's node actions wait until this replica has
applied its own attested samples for ``RESTORED_PROBATION_S``, counted from the first of
them (``LiveState.why_unattested``).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import math
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np
import orjson
import redis.asyncio as aioredis

from oomcast.model.embedding import EMBEDDING_VERSION, sample_dict
from oomcast.model.forecast import (
    Forecast,
    Forecaster,
    export_state,
    import_state,
    release_state,
)
from oomcast.model.phase import PhaseState
from oomcast.model.schema import Domain, parse_sample
from oomcast.model.signing import SIG_PREFIX, service_keys, sign, verify
from oomcast.model.text import compact_json
from oomcast.service.cluster.leases import lease_key
from oomcast.service.pipeline.history import History
from oomcast.service.pipeline.outcomes import CHAMPION, Watch
from oomcast.service.pipeline.rules import Episode
from oomcast.service.pipeline.state import DomainState, LiveState

log = logging.getLogger(__name__)

SNAPSHOT_VERSION = 1
MAGIC = b"oomcast-snapshot/%d\n" % SNAPSHOT_VERSION
HISTORY_POINTS = 32  # newest history points kept in a blob
# The fields that are encoded one by one; every other field of DomainState whose type is
# a plain scalar (int, float, str, bool, None) travels as is, so fields added later are
# carried without touching this module.
STRUCTURED = frozenset(
    {
        "domain",
        "forecaster_state",
        "shadow_states",
        "history",
        "last",
        "forecast",
        "episodes",
        "watches",
    }
)
# What only the replica holding the domain knows, and a blob must never set: when it restored
# the domain, and since when its own signed samples came (a restored state's probation).
LOCAL_ONLY = frozenset({"restored_at", "own_since"})
_SCALARS: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "float": (int, float),
    "str": (str,),
    "bool": (bool,),
    "None": (type(None),),
}


def _scalar_fields() -> dict[str, tuple[type, ...]]:
    """DomainState's plain scalar fields and the JSON types each accepts."""
    out: dict[str, tuple[type, ...]] = {}
    for f in fields(DomainState):
        if f.name in STRUCTURED or f.name in LOCAL_ONLY:
            continue
        names = [t.strip() for t in str(f.type).split("|")]
        if all(n in _SCALARS for n in names):
            out[f.name] = tuple(t for n in names for t in _SCALARS[n])
    return out


SCALAR_FIELDS = _scalar_fields()


SNAPSHOT_KEY_CONTEXT = b"oomcast:snapshots:v1"
MAX_FUTURE_S = 300.0  # how far ahead of the clock a restored time may lie (the ts skew)


class SnapshotError(ValueError):
    """A blob that cannot be restored; the domain starts cold."""


class ForgedSnapshot(SnapshotError):
    """A blob whose seal is missing or does not verify: not written by the service."""


def snapshot_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    """The keys snapshot blobs are sealed with (the first) and verified with (any); none
    when the service has no secret."""
    return service_keys(control_secret, webhook_secret, SNAPSHOT_KEY_CONTEXT)


def _sealed_bytes(partition: int, name: str, blob: bytes) -> bytes:
    return b"%d\n%s\n" % (partition, name.encode()) + blob


def seal(blob: bytes, keys: Sequence[str], partition: int, name: str) -> bytes:
    """``blob`` as stored: ``sha256=<MAC>\n`` ahead of it under the first of ``keys``, the
    MAC over the partition, the field name and the blob (a sealed blob moved to another
    domain does not verify); the blob alone when there is no key."""
    if not keys:
        return blob
    return sign(_sealed_bytes(partition, name, blob), keys[0]).encode() + b"\n" + blob


def unseal(stored: bytes, keys: Sequence[str], partition: int, name: str) -> bytes:
    """The blob of a stored value whose seal verifies under one of ``keys``; ForgedSnapshot
    otherwise. With no key there is nothing to check: a sealed value's blob is taken as is."""
    head, sep, blob = bytes(stored).partition(b"\n")
    sealed = bool(sep) and head.startswith(SIG_PREFIX.encode())
    if not keys:
        return blob if sealed else bytes(stored)
    if not sealed:
        raise ForgedSnapshot("no seal: not written by the service (or by a version before seals)")
    data = _sealed_bytes(partition, name, blob)
    if not any(verify(data, head, key) for key in keys):
        raise ForgedSnapshot("its seal does not verify under the service's keys")
    return blob


def encode(
    st: DomainState,
    forecaster: Forecaster,
    *,
    history_points: int = HISTORY_POINTS,
    shadows: Mapping[str, Forecaster] | None = None,
) -> bytes:
    """``st`` as a blob: JSON behind a versioned magic prefix. Not compressed: zlib would
    save 40% of the bytes for a third more CPU, and the service's CPU is what is scarce."""
    points = st.history.columns(history_points) if history_points > 0 else None
    fc = st.forecast
    body: dict[str, Any] = {
        "v": SNAPSHOT_VERSION,
        "model": forecaster.version,
        "emb_v": EMBEDDING_VERSION,
        "domain": list(st.domain),
        "forecaster": export_state(forecaster, st.forecaster_state),
        "last": None if st.last is None else sample_dict(st.last),
        "forecast": None
        if fc is None
        else {
            "risk": [[h, p] for h, p in fc.risk.items()],
            "tto": fc.time_to_oom_s,
            "observed_at": fc.observed_at,
            "model_version": fc.model_version,
        },
        "history": _encode_history(points),
        "episodes": {name: ep.to_dict() for name, ep in st.episodes.items()},
        "phases": None if st.phases is None else st.phases.to_dict(),  # the job's schedule
        # what each scored model's alert and the job came to so far (pipeline/outcomes.py)
        "watches": {role: w.to_dict() for role, w in st.watches.items()},
        # each shadow model's own forecaster state (null after a restart), with the model
        # whose watch and state these are
        "shadows": {
            role: {
                "model": model.version,
                "state": export_state(model, st.shadow_states[role])
                if role in st.shadow_states
                else None,
            }
            for role, model in (shadows or {}).items()
        },
        "scalars": {name: getattr(st, name) for name in SCALAR_FIELDS},
    }
    # orjson: the same JSON (no NaN can be in it: no time to OOM is null), a third the cost
    return MAGIC + orjson.dumps(body)


def _body(blob: bytes) -> dict[str, Any]:
    if not isinstance(blob, bytes | bytearray):
        raise SnapshotError(f"a snapshot is bytes, got {type(blob).__name__}")
    if not blob.startswith(MAGIC):
        head = bytes(blob[:24])
        if head.startswith(b"oomcast-snapshot/"):
            raise SnapshotError(
                f"snapshot format {head.split(b'/')[1][:8]!r}, not {SNAPSHOT_VERSION}"
            )
        raise SnapshotError("not an oomcast snapshot (no magic prefix)")
    try:
        body = json.loads(blob[len(MAGIC) :])
    except (ValueError, RecursionError) as exc:
        raise SnapshotError(f"corrupt snapshot ({type(exc).__name__}: {exc})") from None
    if not isinstance(body, dict):
        raise SnapshotError("corrupt snapshot (its body is not an object)")
    if body.get("v") != SNAPSHOT_VERSION:
        raise SnapshotError(f"snapshot body of format {body.get('v')!r}, not {SNAPSHOT_VERSION}")
    return body


def _domain(body: Mapping[str, Any]) -> Domain:
    d = body.get("domain")
    if not (isinstance(d, list) and len(d) == 2 and all(isinstance(x, str) and x for x in d)):
        raise SnapshotError(f"snapshot domain must be [node, device], got {d!r}")
    return (d[0], d[1])


def _forecast(data: Any) -> Forecast | None:
    if data is None:
        return None
    risk = {int(h): float(p) for h, p in data["risk"]}
    tto = data["tto"]
    return Forecast(
        risk=risk,
        time_to_oom_s=None if tto is None else float(tto),
        observed_at=float(data["observed_at"]),
        model_version=str(data["model_version"]),
    )


def _encode_history(points: dict[str, np.ndarray] | None) -> dict[str, Any]:
    """Columns as base64 little-endian arrays: a JSON list of floats costs more to write
    than everything else in a blob together. Times and risks are float64 (exact; NaN for
    no time to OOM), byte counts int64."""
    if points is None:
        floats, ints, n = np.empty((3, 0), "<f8"), np.empty((2, 0), "<i8"), 0
    else:
        n = len(points["ts"])
        floats = np.stack([points["ts"], points["risk"], points["tto"]]).astype("<f8")
        ints = np.stack([points["used"], points["total"]]).astype("<i8")
    return {
        "n": n,
        "f8": base64.b64encode(floats.tobytes()).decode("ascii"),
        "i8": base64.b64encode(ints.tobytes()).decode("ascii"),
    }


def _history(data: Mapping[str, Any], maxlen: int) -> History:
    n = data["n"]
    if not isinstance(n, int) or n < 0:
        raise SnapshotError(f"snapshot history n: must be a count, got {n!r}")
    try:
        floats = np.frombuffer(base64.b64decode(data["f8"], validate=True), "<f8")
        ints = np.frombuffer(base64.b64decode(data["i8"], validate=True), "<i8")
    except (binascii.Error, TypeError) as exc:
        raise SnapshotError(f"snapshot history: not base64 ({exc})") from None
    if floats.size != 3 * n or ints.size != 2 * n:
        raise SnapshotError(f"snapshot history: arrays do not hold {n} points")
    ts, risk, tto = floats.reshape(3, n).tolist()
    used, total = ints.reshape(2, n).tolist()
    out = History(maxlen)
    for i in range(max(0, n - maxlen), n):
        t = tto[i]
        out.append(ts[i], used[i], total[i], risk[i], None if math.isnan(t) else t)
    return out


def _scalars(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise SnapshotError("snapshot scalars must be an object")
    out = {}
    for name, value in data.items():
        accepts = SCALAR_FIELDS.get(name)
        if accepts is None:
            continue  # a field this version does not have
        if isinstance(value, bool) and bool not in accepts:
            raise SnapshotError(f"snapshot {name}: {value!r} is not a {accepts}")
        if not isinstance(value, accepts):
            raise SnapshotError(f"snapshot {name}: {value!r} is not a {accepts}")
        if isinstance(value, float) and not math.isfinite(value):
            raise SnapshotError(f"snapshot {name}: {value!r} is not finite")
        out[name] = value
    return out


def decode(
    blob: bytes,
    forecaster: Forecaster,
    rule_names: Iterable[str],
    *,
    history_len: int,
    now: float | None = None,
    max_future_s: float = MAX_FUTURE_S,
    shadows: Mapping[str, Forecaster] | None = None,
) -> DomainState | None:
    """The domain state ``blob`` holds, with a forecaster state of ``forecaster`` (a fresh
    one when the blob was made by another model), or None, with a warning, when the blob
    cannot be restored (the domain then starts cold). With ``now``, a blob holding a time
    more than ``max_future_s`` ahead of it is not restored."""
    try:
        body = _body(blob)
        domain = _domain(body)
    except SnapshotError as exc:
        log.warning("ignoring a snapshot (%s); its domain starts cold", exc)
        return None
    try:
        latest = None if now is None else now + max_future_s
        return _restore(
            body, domain, forecaster, set(rule_names), history_len, shadows or {}, latest
        )
    except Exception as exc:  # whatever a damaged blob trips over: a cold start, not a crash
        why = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        log.warning("ignoring the snapshot of %s/%s (%s); the domain starts cold", *domain, why)
        return None


def _restore(
    body: dict[str, Any],
    domain: Domain,
    forecaster: Forecaster,
    rules: set[str],
    history_len: int,
    shadows: Mapping[str, Forecaster],
    latest: float | None = None,
) -> DomainState:
    last = body["last"]
    episodes = body["episodes"]
    if not isinstance(episodes, dict):
        raise SnapshotError("snapshot episodes must be an object")
    st = DomainState(
        domain,
        None,
        _history(body["history"], history_len),
        last=None if last is None else parse_sample(last),
        forecast=_forecast(body["forecast"]),
        episodes={n: Episode.from_dict(e) for n, e in episodes.items() if n in rules},
    )
    for name, value in _scalars(body.get("scalars", {})).items():
        setattr(st, name, value)
    phases = body.get("phases")  # absent from blobs older than phase forecasts
    st.phases = None if phases is None else PhaseState.from_dict(phases)
    watches = body.get("watches") or {}  # absent from blobs older than the scorecard
    if not isinstance(watches, dict):
        raise SnapshotError("snapshot watches must be an object")
    try:
        st.watches = {str(r): Watch.from_dict(w) for r, w in watches.items()}
    except ValueError as exc:
        raise SnapshotError(f"snapshot watches: {exc}") from None
    if st.last is not None and st.last.domain != domain:
        raise SnapshotError(f"snapshot of {domain} holds a sample of {st.last.domain}")
    champion_data, kept = _states_by_model(body, domain, st, forecaster, shadows)
    if latest is not None:
        _check_times(st, latest)
    # Last: the ONNX forecasters take slots here, once nothing else can fail. A shadow's
    # state that does not import starts cold: a shadow never costs the champion its state.
    for role, data in kept.items():
        try:
            st.shadow_states[role] = import_state(shadows[role], data)
        except Exception as exc:
            log.warning(
                "the snapshot of %s/%s: shadow %s's state does not import (%s); it starts cold",
                *domain,
                role,
                exc,
            )
    try:
        st.forecaster_state = import_state(forecaster, champion_data)
    except Exception:
        for role, slot in st.shadow_states.items():
            release_state(shadows[role], slot)
        raise
    return st


def _states_by_model(
    body: Mapping[str, Any],
    domain: Domain,
    st: DomainState,
    forecaster: Forecaster,
    shadows: Mapping[str, Forecaster],
) -> tuple[Any, dict[str, Mapping[str, Any]]]:
    """Each of this replica's models gets the saved state and watch of the same model,
    whatever role it had in the blob (a replica that has not yet followed a promotion
    restores a blob made after it): the champion's state to import (None: cold), and the
    shadows' by role. A model the blob does not hold starts cold, and a shadow's watch is
    dropped unless the blob holds its model: an alert of one model is never credited to
    another. The champion's watch is kept when the blob's champion was another model (a
    deploy of a new one): its outcomes carry the old model's version."""
    saved = body.get("shadows") or {}  # absent from blobs older than shadow models
    if not isinstance(saved, dict):
        log.warning("the snapshot of %s/%s has malformed shadows: they start cold", *domain)
        saved = {}
    same_emb = body.get("emb_v") == EMBEDDING_VERSION
    versions: dict[str, Any] = {CHAMPION: body.get("model")}  # blob role -> its model
    states: dict[str, Any] = {CHAMPION: body.get("forecaster")}
    for role, entry in saved.items():
        if isinstance(entry, dict):
            versions[str(role)] = entry.get("model")
            if isinstance(entry.get("state"), dict):
                states[str(role)] = entry["state"]
    ours: dict[str, Forecaster] = {CHAMPION: forecaster, **shadows}
    source = {
        role: next((r for r, v in versions.items() if v == model.version), None)
        for role, model in ours.items()
    }
    if source[CHAMPION] is None:
        log.warning(
            "the snapshot of %s/%s was made by model %s (embedding v%s), not %s (v%s): its"
            " episodes and counters are kept, its forecaster state starts cold",
            *domain,
            body.get("model"),
            body.get("emb_v"),
            forecaster.version,
            EMBEDDING_VERSION,
        )
    watches = dict(st.watches)
    st.watches = {}
    for role in ours:
        src = source[role]
        if src is not None and src in watches:
            st.watches[role] = watches[src]
        elif role == CHAMPION and CHAMPION in watches and source[CHAMPION] is None:
            st.watches[role] = watches[CHAMPION]  # a new deploy: the old model's watch goes on
    champion_src = source[CHAMPION]
    champion_data = states.get(champion_src) if champion_src is not None and same_emb else None
    kept = {
        role: states[src]
        for role, src in source.items()
        if role != CHAMPION and src is not None and same_emb and src in states
    }
    return champion_data, kept


TIMES = ("last_oom_ts", "last_seen_wall", "attested_at", "unattested_at", "behind_ts")


def _check_times(st: DomainState, latest: float) -> None:
    """SnapshotError when a time the state holds lies after ``latest``: a ``last_oom_ts``
    of 1e12 would make the domain drop every real sample as late, for ever."""
    times = {name: getattr(st, name) for name in TIMES}
    times["last.ts"] = None if st.last is None else st.last.ts
    times["forecast.observed_at"] = None if st.forecast is None else st.forecast.observed_at
    for role, w in st.watches.items():
        times[f"watches.{role}"] = max(w.times(), default=None)
    for name, value in times.items():
        if value is not None and value > latest:
            raise SnapshotError(f"its {name} {value!r} lies ahead of the clock")


# --- Redis ------------------------------------------------------------------------------

# HSET (and refresh the TTL) only while the partition's lease holds the writer's token. KEYS:
# the partition's snapshot hash and its lease, one Cluster slot (the {<p>} hash tag). One
# HSET (HDEL) for the whole chunk: a call per field cost Redis a command per domain.
FENCED_HSET = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV, 3))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""
FENCED_HDEL = """
if redis.call('GET', KEYS[2]) ~= ARGV[1] then return 0 end
redis.call('HDEL', KEYS[1], unpack(ARGV, 2))
return 1
"""
CHUNK = 500  # fields per command (well within what Lua's unpack takes: about 8,000 values)
RESTORE_CHUNK = 100  # domains restored between two yields to the event loop


def field_of(domain: Domain) -> str:
    return compact_json(list(domain))


@dataclass
class Restored:
    """What loading a partition's snapshots gave."""

    states: list[DomainState] = field(default_factory=list)
    ignored: int = 0  # blobs that could not be restored (their domains start cold)
    forged: int = 0  # of those, blobs whose seal failed


@dataclass
class SnapshotStore:
    """The snapshot hashes under ``prefix``; ``ttl_s`` bounds how long the hash of a
    partition no replica writes any more survives."""

    client: aioredis.Redis
    prefix: str
    ttl_s: float = 86_400.0
    # blobs are sealed with the first, and restored only if their seal holds under one
    seal_keys: tuple[str, ...] = ()
    # how far ahead of the clock a restored time may lie (the service's ts skew, and more)
    max_future_s: float = MAX_FUTURE_S

    def key(self, partition: int) -> str:
        return f"{self.prefix}:snapshot:{{{partition}}}"

    def stage(
        self,
        pipe: Any,
        partition: int,
        items: Mapping[Domain, bytes],
        *,
        lease_token: str | None = None,
    ) -> int:
        """Queue the writes of ``items`` (domain -> blob) on ``pipe`` (the caller's pipeline,
        executed by the caller); returns the number of commands queued, so the caller can
        find their replies (with a token, each reply is 1 if written, 0 if the lease was not
        ours). Without a token (fixed partitions) the write is plain."""
        pairs = []
        for d, blob in items.items():
            name = field_of(d)
            pairs.append((name, seal(blob, self.seal_keys, partition, name)))
        ttl_ms = max(1, round(self.ttl_s * 1000))
        key = self.key(partition)
        queued = 0
        for i in range(0, len(pairs), CHUNK):
            chunk = pairs[i : i + CHUNK]
            if lease_token is None:
                pipe.hset(key, mapping=dict(chunk))
                pipe.pexpire(key, ttl_ms)
                queued += 2
            else:
                flat = [x for pair in chunk for x in pair]
                pipe.eval(
                    FENCED_HSET,
                    2,
                    key,
                    lease_key(self.prefix, partition),
                    lease_token,
                    ttl_ms,
                    *flat,
                )
                queued += 1
        return queued

    def drop(
        self,
        pipe: Any,
        partition: int,
        domains: Iterable[Domain],
        *,
        lease_token: str | None = None,
    ) -> int:
        """Queue the removal of ``domains``' blobs (domains expired as silent); returns the
        number of commands queued."""
        names = [field_of(d) for d in domains]
        key = self.key(partition)
        queued = 0
        for i in range(0, len(names), CHUNK):
            chunk = names[i : i + CHUNK]
            if lease_token is None:
                pipe.hdel(key, *chunk)
            else:
                pipe.eval(
                    FENCED_HDEL, 2, key, lease_key(self.prefix, partition), lease_token, *chunk
                )
            queued += 1
        return queued

    async def load(self, partition: int) -> list[tuple[str, bytes]]:
        """Every (field, stored value) of ``partition`` (scanned, so a big hash does not
        block Redis)."""
        out: list[tuple[str, bytes]] = []
        async for name, value in self.client.hscan_iter(self.key(partition), count=CHUNK):
            if not isinstance(value, bytes):
                raise TypeError(
                    "SnapshotStore needs a Redis client with decode_responses=False: blobs"
                    " are binary"
                )
            out.append((name.decode("utf-8", "replace"), value))
        return out

    async def restore(self, live: LiveState, partition: int) -> Restored:
        """Load ``partition``'s blobs into ``live`` (a LiveState), replacing what it held of
        those domains. Call it when the partition's lease is acquired, before reading."""
        out = Restored()
        for i, (name, stored) in enumerate(await self.load(partition)):
            if i and i % RESTORE_CHUNK == 0:
                await asyncio.sleep(0)  # a few hundred µs a domain: let requests in between
            try:
                blob = unseal(stored, self.seal_keys, partition, name)
            except ForgedSnapshot as exc:
                log.error(
                    "the snapshot of %s in partition %d was not written by this service (%s):"
                    " not restored, its domain starts cold",
                    name[:200],
                    partition,
                    exc,
                )
                out.ignored += 1
                out.forged += 1
                continue
            st = live.restore(blob, time.time(), max_future_s=self.max_future_s)
            if st is None:
                out.ignored += 1
            else:
                out.states.append(st)
        return out


MIN_PER_BATCH = 64


@dataclass
class SnapshotSchedule:
    """Which touched domains to snapshot with a batch: those with an alert in it (their
    episodes moved: always, in the alert's own round trip) and the others at most once
    every ``every_s`` (their forecaster state may lag that much behind on a takeover)."""

    every_s: float = 5.0
    # Of the domains due, at most this share of a batch's touched domains (and at least
    # MIN_PER_BATCH) are snapshotted with it; the rest wait for the next batches. Without
    # it, domains that first reported together (a service start, a takeover) fall due
    # together every every_s: one batch then encodes thousands of blobs, and every sample
    # read meanwhile waits (the rate bench's p99).
    share: float = 0.25
    _last: dict[Domain, float] = field(default_factory=dict)

    def pick(self, touched: Iterable[Domain], urgent: Iterable[Domain], now: float) -> list[Domain]:
        """The domains to snapshot now (``now`` in any monotonic seconds), marked done."""
        out = list(dict.fromkeys(urgent))
        chosen = set(out)
        seen = 0
        due: list[Domain] = []
        for d in touched:
            seen += 1
            if d not in chosen and now - self._last.get(d, -math.inf) >= self.every_s:
                due.append(d)
                chosen.add(d)
        budget = max(MIN_PER_BATCH, math.ceil(self.share * seen))
        out.extend(due[:budget])
        for d in out:
            self._last[d] = now
        return out

    def forget(self, domains: Iterable[Domain]) -> None:
        """Domains no longer ours (expired, or their partition lost)."""
        for d in domains:
            self._last.pop(d, None)
