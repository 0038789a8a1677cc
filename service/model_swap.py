"""Swap the model that acts, without a restart, on every replica, and say so.

One replica is asked: ``POST /v1/model`` with the API token (a model file's path, a
baseline's name, or ``{"promote": "shadow"}``), or ``SIGHUP``, which reloads the file
``OOMCAST_MODEL_PATH`` names (or the shipped model) as it is on disk now. That replica loads
the model, writes a swap record to Redis and an entry to the audit stream in one round trip,
and hands the swap to its ingest loop, which makes it between two rounds: no round sees
half a swap, and no sample is skipped. Every other replica reads the record every
``CHECK_EVERY_S`` from its ingest loop and makes its model match it: with the same file at
the same path (a shared volume or the same image), checked against the record's SHA-256.
The record is written with a compare-and-set, so of two swaps asked at once the one
written last is the one every replica ends on (the other's replica follows it too).

Promoting the shadow (``OOMCAST_SHADOW_MODEL_PATH``) is warm: the shadow has been stepped on
every sample, so its per-domain states become the champion's and the old champion becomes
the shadow, warm as well (promoting again undoes it). A model loaded from a path starts
cold on every domain (its first forecasts come from a short history) unless a shadow runs
the same model, in which case that shadow is promoted.

Everything read back from Redis may have been written by someone else, and a swap record
decides what pages people: records are sealed with a key derived from the service's
control or webhook secret over the key prefix too, and a replica follows only a record
whose seal it verifies. Without either secret there is nothing to seal with: a swap then
changes the replica asked and no other (the answer says so). A record also names the model
the swapping replica was configured with (``base``): a replica configured with another
model (a newer deploy) does not follow it. What a seal cannot stop: someone who can write
Redis putting back an older record the service once sealed (a swap later undone); every
replica then follows it, each logging and counting the swap.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from redis.exceptions import RedisError

from oomcast.model.forecast import Detector
from oomcast.model.signing import service_keys
from oomcast.model.text import compact_json
from oomcast.model.wire import answer_async
from oomcast.service.delivery.outbox import ForgedItem, seal, unseal
from oomcast.service.pipeline import forecaster
from oomcast.service.pipeline.outcomes import SHADOW
from oomcast.service.pipeline.rulefile import RuleSpec, rules_from
from oomcast.service.pipeline.rules import AlertPolicy, Rule

if TYPE_CHECKING:
    from oomcast.service.context import ServiceContext

log = logging.getLogger("oomcast.service")

KEY_CONTEXT = b"oomcast:model-swap:v1"
CHECK_EVERY_S = 2.0  # how often a replica reads the swap record
RETRY_FAILED_S = 60.0  # how long a replica waits before trying a swap that failed here again
HISTORY = 20  # swaps this replica remembers, for GET /v1/model
SHA256 = re.compile(r"^[0-9a-f]{64}$")
RECORD_FIELDS = {
    "seq": int,
    "version": str,
    "source": str,
    "base": str,
    "promoted": bool,
    "prefix": str,
}


def swap_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    return service_keys(control_secret, webhook_secret, KEY_CONTEXT)


def record_key(prefix: str) -> str:
    """A hash: ``seq`` (the swaps so far) and ``body`` (the newest swap, sealed)."""
    return f"{prefix}:model"


# Set the record only if no other swap was written since ``seq`` was read.
_CAS = """
if (redis.call('HGET', KEYS[1], 'seq') or '0') ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'seq', ARGV[2], 'body', ARGV[3])
return 1
"""
CAS_TRIES = 10
APPLY_WAIT_S = 30.0  # how long an asked swap waits for the ingest loop to make it


class SwapNotRecorded(Exception):
    """Redis failed while the swap was being written: it may or may not be on record."""


class SwapError(Exception):
    """A swap that cannot be made; ``status`` is the HTTP status that says why."""

    def __init__(self, message: str, status: int = 409) -> None:
        super().__init__(message)
        self.status = status


@dataclass
class Candidate:
    """A model ready to act: loaded, checked, with the rules it would act by."""

    detector: Detector
    kind: str  # "model" or "baseline"
    provider: str
    source: str  # the path or baseline name it was loaded from
    sha256: str | None  # of the file (None for a baseline)
    promoted: bool = False  # the shadow, promoted with its states


def _is_file(path: str) -> bool:
    try:
        return Path(path).is_file()
    except (OSError, ValueError):  # a name too long, a NUL byte: no such file
        return False


def file_sha256(path: str) -> str | None:
    """The file's SHA-256 (None when ``path`` is not a file); SwapError when it cannot be
    read."""
    if not _is_file(path):
        return None
    h = hashlib.sha256()
    try:
        with Path(path).open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    except OSError as exc:
        raise SwapError(f"{path}: cannot be read ({exc})") from None
    return h.hexdigest()


def load_candidate(source: str, sha256: str | None = None) -> Candidate:
    """Load ``source`` (blocking: run it in a thread); SwapError when it cannot be loaded or
    is not the file ``sha256`` says it should be. A path must name an ``.onnx`` file: the
    route must not become a way to learn about other files on the host."""
    if not forecaster.is_baseline(source):
        if not source.endswith(".onnx"):
            raise SwapError(f"{source}: not a baseline's name, nor a path ending in .onnx")
        if not _is_file(source):
            raise SwapError(f"{source}: no such model file here", status=404)
    digest = file_sha256(source)  # before loading: the file that is checked is the one loaded
    if sha256 is not None and digest != sha256:
        raise SwapError(f"{source}: not the file whose SHA-256 is {sha256}")
    try:
        det, kind, provider = forecaster.load_named(source, "model")
    except Exception as exc:
        raise SwapError(str(exc)) from None
    return Candidate(det, kind, provider, source, digest if kind == "model" else None)


def parse_record(raw: bytes | str, keys: tuple[str, ...]) -> dict[str, Any]:
    """The swap record as stored; ForgedItem when its seal fails, ValueError when it is
    not a record."""
    rec = json.loads(unseal(raw, keys))
    if not isinstance(rec, dict):
        raise ValueError("not an object")
    for name, kind in RECORD_FIELDS.items():
        if not isinstance(rec.get(name), kind):
            raise ValueError(f"{name} missing or not a {kind.__name__}")
    sha = rec.get("sha256")
    if sha is not None and not (isinstance(sha, str) and SHA256.match(sha)):
        raise ValueError("sha256 is not 64 hex digits")
    return rec


@dataclass
class _Pending:
    """A swap asked here, waiting for the ingest loop to make it between two rounds."""

    cand: Candidate
    rules: list[Rule]
    policy: AlertPolicy
    done: asyncio.Future[int]


class ModelSwitch:
    """This replica's champion (and shadow), and how to swap them (module docstring)."""

    def __init__(
        self,
        ctx: ServiceContext,
        *,
        source: str,
        shadow: Detector | None,
        shadow_source: str | None,
        seal_keys: tuple[str, ...],
        rule_specs: Sequence[RuleSpec],
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.sha256 = file_sha256(source) if ctx.forecaster_kind == "model" else None
        self.shadow = shadow
        self.shadow_source = shadow_source
        self.seal_keys = seal_keys
        # The rules file as read at start-up: a swap rebuilds the rules from it with the new
        # model's bars, and does not pick up edits made to the file since (no audit of those)
        self.rule_specs = list(rule_specs)
        self.configured = ctx.detector.forecaster.version  # what this replica started with
        self.configured_sha256 = self.sha256  # of the file it was started with
        self.seen: str | None = None  # the record (its sealed body's digest) acted on last
        self.failed: dict[str, float] = {}  # record digest -> when a swap to it failed here
        self.problem: str | None = None  # why the newest record was not followed
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._last_check = -float("inf")
        self._pending: list[_Pending] = []
        self.lock = asyncio.Lock()  # one swap asked at a time here

    @property
    def version(self) -> str:
        return str(self.ctx.detector.forecaster.version)

    @property
    def shadow_version(self) -> str | None:
        return None if self.shadow is None else str(self.shadow.forecaster.version)

    def describe(self) -> dict[str, Any]:
        """For GET /v1/model."""
        return {
            "model_version": self.version,
            "kind": self.ctx.forecaster_kind,
            "source": self.source,
            "sha256": self.sha256,
            "configured_version": self.configured,
            "shadow_model_version": self.shadow_version,
            "shadow_source": self.shadow_source if self.shadow is not None else None,
            "follows_swaps": bool(self.seal_keys),
            "problem": self.problem,
            "swaps": list(self.history),
        }

    # -- asked here ------------------------------------------------------------------------
    async def request(
        self,
        *,
        source: str | None = None,
        promote: bool = False,
        sha256: str | None = None,
        reason: str = "",
        how: str = "api",
    ) -> dict[str, Any]:
        """Swap to ``source`` (or promote the shadow), record it, have the ingest loop make
        it, and say what was done."""
        async with self.lock:
            before = self.version
            if promote:
                cand = self._promotion()
            else:
                assert source is not None
                cand = await asyncio.to_thread(load_candidate, source, sha256)
                same_file = cand.sha256 is None or cand.sha256 == self.sha256
                if cand.detector.forecaster.version == before and same_file:
                    return {"changed": False, "model_version": before, "reason": "already in use"}
                if cand.detector.forecaster.version == self.shadow_version:
                    cand = self._promotion(sha256=cand.sha256)  # the same model, warm
            version = str(cand.detector.forecaster.version)
            rules, policy = self._rules_for(cand)
            record: dict[str, Any] = {
                "version": version,
                "source": cand.source,
                "sha256": cand.sha256,
                "kind": cand.kind,
                "promoted": cand.promoted,
                "base": self.configured,
                "previous": before,
                "at": time.time(),
                "by": self.ctx.settings.consumer_name,
                "how": how,
                "reason": reason,
                "prefix": self.ctx.keys.prefix,
            }
            propagated = bool(self.seal_keys)
            try:
                digest = await self._write(record, propagated)
            except RedisError as exc:
                raise SwapNotRecorded(
                    f"{exc}; the swap may or may not be on record: see GET /v1/model on any"
                    " replica in a few seconds"
                ) from exc
            if digest is not None:
                self.seen = digest
            warm, applied = await self._hand_to_ingest(cand, rules, policy)
            self.problem = None
            self.ctx.metrics.model_swaps.labels(result="swapped").inc()
            done = {**record, "warm_domains": warm, "domains": len(self.ctx.live.domains)}
            self.history.appendleft(done)
            log.warning(
                "MODEL SWAPPED (%s, %s): %s -> %s from %s%s; %d of %d domains warm",
                how,
                reason or "no reason given",
                before,
                version,
                cand.source,
                " (the shadow, promoted)" if cand.promoted else "",
                warm,
                len(self.ctx.live.domains),
            )
            out = {"changed": True, **done, "applied": applied, "propagated": propagated}
            if not applied:
                out["not_applied_because"] = (
                    f"the ingest loop did not reach a round's end within {APPLY_WAIT_S:g} s;"
                    " the swap is made when it does"
                )
            if not propagated:
                out["not_propagated_because"] = (
                    "no OOMCAST_CONTROL_SECRET or OOMCAST_WEBHOOK_SECRET to seal the swap"
                    " record with: other replicas do not follow it; ask each of them"
                )
            return out

    async def _hand_to_ingest(
        self, cand: Candidate, rules: list[Rule], policy: AlertPolicy
    ) -> tuple[int, bool]:
        """Have the ingest loop make the swap between two rounds (``apply_pending``), and
        wait for it; where no ingest loop runs, make it here. (warm domains, applied)."""
        tasks = self.ctx.tasks
        if not tasks or tasks[0].done():
            return self._apply(cand, rules, policy), True
        done: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._pending.append(_Pending(cand, rules, policy, done))
        try:
            return await asyncio.wait_for(asyncio.shield(done), APPLY_WAIT_S), True
        except TimeoutError:
            return 0, False

    def apply_pending(self) -> None:
        """The swaps asked here, made now: called by the ingest loop between rounds."""
        pending, self._pending = self._pending, []
        for p in pending:
            try:
                warm = self._apply(p.cand, p.rules, p.policy)
            except Exception as exc:  # said to the one who asked; ingest goes on
                if not p.done.done():
                    p.done.set_exception(exc)
                continue
            if not p.done.done():
                p.done.set_result(warm)

    async def reload_configured(self) -> None:
        """SIGHUP: run what ``OOMCAST_MODEL_PATH`` (or the shipped model) holds now, if the
        file changed since it was last loaded (a SIGHUP with the file unchanged undoes no
        promotion)."""
        if self.ctx.settings.forecaster != "model":
            log.warning("SIGHUP: OOMCAST_FORECASTER names a baseline; there is no file to reload")
            return
        path = self.source_configured()
        digest: str | None = None
        try:
            digest = await asyncio.to_thread(file_sha256, path)
        except SwapError as exc:
            problem: str | None = str(exc)
        else:
            problem = None if digest is not None else f"{path}: no such file"
        if problem is not None:
            self.ctx.metrics.model_swaps.labels(result="refused").inc()
            log.error("SIGHUP: the model was not swapped: %s", problem)
            return
        if digest == self.configured_sha256:
            log.info("SIGHUP: %s is unchanged since it was loaded; nothing to swap", path)
            return
        try:
            out = await self.request(
                source=path, reason="SIGHUP: reload OOMCAST_MODEL_PATH", how="signal"
            )
        except Exception as exc:  # logged: nobody waits on a signal's answer
            self.ctx.metrics.model_swaps.labels(result="refused").inc()
            log.error("SIGHUP: the model was not swapped: %s", exc)
            return
        self.configured_sha256 = digest
        if not out["changed"]:
            log.info("SIGHUP: the model file holds %s, already in use", out["model_version"])

    def source_configured(self) -> str:
        from oomcast.model.runtime import DEFAULT_MODEL

        return self.ctx.settings.model_path or str(DEFAULT_MODEL)

    # -- asked on another replica ------------------------------------------------------------
    async def follow(self) -> None:
        """Called by the ingest loop between rounds: make the swaps asked here, then, at
        most every CHECK_EVERY_S, make this replica's model match the swap record in Redis
        (unless a swap is being asked here: it writes the record)."""
        self.apply_pending()
        if not self.seal_keys or self.lock.locked():
            return
        mono = time.monotonic()
        if mono - self._last_check < CHECK_EVERY_S:
            return
        self._last_check = mono
        raw: str | bytes | None = await answer_async(
            self.ctx.redis.hget(record_key(self.ctx.keys.prefix), "body")
        )
        if raw is None:
            return
        raw = raw.encode() if isinstance(raw, str) else bytes(raw)
        digest = hashlib.sha256(raw).hexdigest()
        if digest == self.seen:
            return
        try:
            rec = parse_record(raw, self.seal_keys)
            if rec["prefix"] != self.ctx.keys.prefix:
                raise ValueError(f"made for the key prefix {rec['prefix']!r}")
        except (ForgedItem, ValueError, UnicodeDecodeError) as exc:
            self.seen = digest  # counted once
            forged = isinstance(exc, ForgedItem)
            self.ctx.metrics.model_swaps.labels(result="forged" if forged else "refused").inc()
            self.problem = f"the swap record in Redis is refused: {exc}"
            log.error("the model swap record in Redis is refused (%s); it is not followed", exc)
            return
        if rec["base"] != self.configured:
            self.seen = digest
            self.problem = None
            self.ctx.metrics.model_swaps.labels(result="ignored").inc()
            log.warning(
                "the model swap record %d was made on replicas configured with %s; this one"
                " runs %s as configured and does not follow it",
                rec["seq"],
                rec["base"],
                self.configured,
            )
            return
        if rec["version"] == self.version and rec.get("sha256") in (None, self.sha256):
            self.seen, self.problem = digest, None
            self.failed.clear()
            return
        if mono - self.failed.get(digest, -float("inf")) < RETRY_FAILED_S:
            return
        try:
            cand = await self._candidate_for(rec)
            rules, policy = self._rules_for(cand)
        except SwapError as exc:
            self.failed[digest] = mono
            self.problem = f"swap {rec['seq']} to {rec['version']} not followed: {exc}"
            self.ctx.metrics.model_swaps.labels(result="refused").inc()
            log.error("MODEL SWAP NOT FOLLOWED: %s", self.problem)
            return
        before = self.version
        warm = self._apply(cand, rules, policy)
        self.seen, self.problem = digest, None
        self.failed.clear()
        self.ctx.metrics.model_swaps.labels(result="followed").inc()
        self.history.appendleft(
            {**rec, "previous_here": before, "followed_at": time.time(), "warm_domains": warm}
        )
        log.warning(
            "MODEL SWAPPED (followed swap %d made by %s): %s -> %s; %d domains warm",
            rec["seq"],
            rec.get("by"),
            before,
            rec["version"],
            warm,
        )

    async def _candidate_for(self, rec: dict[str, Any]) -> Candidate:
        if rec["version"] == self.shadow_version:
            return self._promotion()
        cand = await asyncio.to_thread(load_candidate, rec["source"], rec.get("sha256"))
        if cand.detector.forecaster.version != rec["version"]:
            raise SwapError(
                f"{rec['source']} here holds {cand.detector.forecaster.version}, not"
                f" {rec['version']}"
            )
        return cand

    # -- the swap itself ----------------------------------------------------------------------
    def _promotion(self, sha256: str | None = None) -> Candidate:
        if self.shadow is None or self.shadow_source is None:
            raise SwapError(
                "no shadow model runs on this replica (OOMCAST_SHADOW_MODEL_PATH)", status=409
            )
        det = self.shadow
        kind = "baseline" if forecaster.is_baseline(self.shadow_source) else "model"
        provider = str(getattr(det.forecaster, "provider", "python"))
        digest = sha256 if sha256 is not None else file_sha256(self.shadow_source)
        champion = Detector("model", det.forecaster, det.rule)
        return Candidate(champion, kind, provider, self.shadow_source, digest, promoted=True)

    def _rules_for(self, cand: Candidate) -> tuple[list[Rule], AlertPolicy]:
        """The rules ``cand`` would act by: the rules file as read at start-up, with the
        model's own validated rule unless the operator set one (as at start-up)."""
        choice = forecaster.Choice(cand.detector, cand.kind, f"swapped in: {cand.source}", "")
        policy = forecaster.alert_policy(self.ctx.settings, choice)
        return rules_from(self.rule_specs, policy), policy

    async def _write(self, record: dict[str, Any], propagated: bool) -> str | None:
        """The audit entry, and (when sealed) the record replicas follow, written with a
        compare-and-set; the sealed body's digest (None when not propagated)."""
        ctx = self.ctx
        key = record_key(ctx.keys.prefix)
        digest = None
        record["seq"] = 0
        if propagated:
            for _ in range(CAS_TRIES):
                seen: str | bytes | None = await answer_async(ctx.redis.hget(key, "seq"))
                current = int(seen) if seen is not None else 0
                record["seq"] = current + 1
                body = seal(compact_json(record), self.seal_keys)
                cas = ctx.redis.eval(_CAS, 1, key, str(current), str(current + 1), body)
                if await answer_async(cas):
                    digest = hashlib.sha256(body.encode()).hexdigest()
                    break
            else:
                raise SwapError("other swaps kept being written at the same time; try again")
        await ctx.redis.xadd(
            ctx.keys.alerts,
            {"alert": compact_json({"record": "model_swap", **record})},
            maxlen=ctx.settings.alerts_maxlen,
            approximate=True,
        )
        return digest

    def _apply(self, cand: Candidate, rules: list[Rule], policy: AlertPolicy) -> int:
        """Swap in ``cand`` (synchronous: the ingest loop calls it between two rounds).
        Returns the domains whose new champion state was warm."""
        ctx = self.ctx
        old = ctx.detector
        old_source, old_kind = self.source, ctx.forecaster_kind
        shadow = self.shadow
        if cand.promoted:  # the old champion becomes the shadow, scored by its own rule
            shadow = Detector("shadow", old.forecaster, old.rule)
        scored = forecaster.scored_models(ctx.settings, policy, shadow)
        warm = ctx.live.swap_champion(
            cand.detector.forecaster,
            rules,
            horizon_s=policy.horizon_s,
            scored=scored,
            promoted=SHADOW if cand.promoted else None,
        )
        ctx.detector = cand.detector
        ctx.rules = rules
        ctx.forecaster_kind = cand.kind
        ctx.forecaster_reason = f"swapped in from {cand.source}"
        ctx.provider = cand.provider or ctx.provider
        self.source, self.sha256 = cand.source, cand.sha256
        if cand.promoted:
            self.shadow, self.shadow_source = shadow, old_source
            ctx.metrics.shadow_model.info({"version": str(old.forecaster.version)})
            log.info("the old champion %s (%s) is now the shadow", old.forecaster.version, old_kind)
        ctx.metrics.model.info(
            {
                "version": cand.detector.forecaster.version,
                "kind": cand.kind,
                "provider": ctx.provider,
            }
        )
        return warm
