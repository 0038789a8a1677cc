"""Swap the model that acts, without a restart, on every replica, and say so.

One replica is asked: ``POST /v1/model`` with the API token (a model file's path, a
baseline's name, or ``{"promote": "shadow"}``), or ``SIGHUP``, which reloads the file
``OOMCAST_MODEL_PATH`` names (or the shipped model) as it is on disk now. That replica loads
the model, writes a swap record to Redis and an entry to the audit stream in one round trip,
and then swaps between two ingest rounds: no round sees half a swap, and no sample is
skipped. Every other replica reads the record every ``CHECK_EVERY_S`` from its ingest loop
and makes the same swap: with the same file at the same path (a shared volume or the same
image), checked against the record's SHA-256.

Promoting the shadow (``OOMCAST_SHADOW_MODEL_PATH``) is warm: the shadow has been stepped on
every sample, so its per-domain states become the champion's and the old champion becomes
the shadow, warm as well (promoting again undoes it). A model loaded from a path starts
cold on every domain (its first forecasts come from a short history) unless a shadow runs
the same model, in which case that shadow is promoted.

Everything read back from Redis may have been written by someone else, and a swap record
decides what pages people: records are sealed with a key derived from the service's
control or webhook secret, and a replica follows only a record whose seal it verifies.
Without either secret there is nothing to seal with: a swap then changes the replica asked
and no other (the answer says so). A record also names the model the swapping replica was
configured with (``base``): a replica configured with another model (a newer deploy) does
not follow it.
"""

from __future__ import annotations

import asyncio
import collections
import hashlib
import json
import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomcast.model.forecast import Detector
from oomcast.model.signing import service_keys
from oomcast.model.text import compact_json
from oomcast.service.delivery.outbox import ForgedItem, seal, unseal
from oomcast.service.pipeline import forecaster
from oomcast.service.pipeline.outcomes import SHADOW
from oomcast.service.pipeline.rulefile import load_rules
from oomcast.service.pipeline.rules import AlertPolicy, Rule

if TYPE_CHECKING:
    from oomcast.service.context import ServiceContext

log = logging.getLogger("oomcast.service")

KEY_CONTEXT = b"oomcast:model-swap:v1"
CHECK_EVERY_S = 2.0  # how often a replica reads the swap record
RETRY_FAILED_S = 60.0  # how long a replica waits before trying a swap that failed here again
HISTORY = 20  # swaps this replica remembers, for GET /v1/model
SHA256 = re.compile(r"^[0-9a-f]{64}$")
RECORD_FIELDS = {"seq": int, "version": str, "source": str, "base": str, "promoted": bool}


def swap_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    return service_keys(control_secret, webhook_secret, KEY_CONTEXT)


def record_key(prefix: str) -> str:
    return f"{prefix}:model"


def seq_key(prefix: str) -> str:
    return f"{prefix}:model:seq"


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
    is not the file ``sha256`` says it should be."""
    if not forecaster.is_baseline(source) and not _is_file(source):
        raise SwapError(f"{source}: no such model file here, and not a baseline's name", status=404)
    digest = file_sha256(source)  # before loading: the file that is checked is the one loaded
    if sha256 is not None and digest != sha256:
        raise SwapError(
            f"{source}: its SHA-256 is {digest or 'unknown (a baseline)'}, not {sha256}:"
            " not the model the swap was made with"
        )
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
    ) -> None:
        self.ctx = ctx
        self.source = source
        self.shadow = shadow
        self.shadow_source = shadow_source
        self.seal_keys = seal_keys
        self.configured = ctx.detector.forecaster.version  # what this replica started with
        self.seen_seq = 0  # the newest record this replica acted on (or decided to ignore)
        self.failed: dict[int, float] = {}  # seq -> when a swap to it last failed here
        self.problem: str | None = None  # why the newest record was not followed
        self.history: collections.deque[dict[str, Any]] = collections.deque(maxlen=HISTORY)
        self._last_check = -float("inf")
        self._bad_raw: bytes | None = None  # the last record refused (counted once)
        self.lock = asyncio.Lock()  # one swap at a time here

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
            "configured_version": self.configured,
            "shadow_model_version": self.shadow_version,
            "shadow_source": self.shadow_source if self.shadow is not None else None,
            "follows_swaps": bool(self.seal_keys),
            "seen_seq": self.seen_seq,
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
        """Swap to ``source`` (or promote the shadow), record it, and say what was done."""
        async with self.lock:
            before = self.version
            if promote:
                cand = self._promotion()
            else:
                assert source is not None
                cand = await asyncio.to_thread(load_candidate, source, sha256)
                if cand.detector.forecaster.version == self.shadow_version:
                    cand = self._promotion(sha256=cand.sha256)  # the same model, warm
            version = str(cand.detector.forecaster.version)
            if version == before and not cand.promoted:
                return {"changed": False, "model_version": before, "reason": "already in use"}
            rules, policy = self._rules_for(cand)
            now = time.time()
            record: dict[str, Any] = {
                "version": version,
                "source": cand.source,
                "sha256": cand.sha256,
                "kind": cand.kind,
                "promoted": cand.promoted,
                "base": self.configured,
                "previous": before,
                "at": now,
                "by": self.ctx.settings.consumer_name,
                "how": how,
                "reason": reason,
            }
            propagated = bool(self.seal_keys)
            record["seq"] = await self._write(record, propagated)
            warm = self._apply(cand, rules, policy)
            if propagated:
                self.seen_seq = max(self.seen_seq, record["seq"])
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
            out = {"changed": True, **done, "propagated": propagated}
            if not propagated:
                out["not_propagated_because"] = (
                    "no OOMCAST_CONTROL_SECRET or OOMCAST_WEBHOOK_SECRET to seal the swap"
                    " record with: other replicas do not follow it; ask each of them"
                )
            return out

    async def reload_configured(self) -> None:
        """SIGHUP: run what ``OOMCAST_MODEL_PATH`` (or the shipped model) holds now."""
        if self.ctx.settings.forecaster != "model":
            log.warning("SIGHUP: OOMCAST_FORECASTER names a baseline; there is no file to reload")
            return
        try:
            out = await self.request(
                source=self.source_configured(),
                reason="SIGHUP: reload OOMCAST_MODEL_PATH",
                how="signal",
            )
        except Exception as exc:  # logged: nobody waits on a signal's answer
            self.ctx.metrics.model_swaps.labels(result="refused").inc()
            log.error("SIGHUP: the model was not swapped: %s", exc)
            return
        if not out["changed"]:
            log.info("SIGHUP: the model file holds %s, already in use", out["model_version"])

    def source_configured(self) -> str:
        from oomcast.model.runtime import DEFAULT_MODEL

        return self.ctx.settings.model_path or str(DEFAULT_MODEL)

    # -- asked on another replica ------------------------------------------------------------
    async def follow(self) -> None:
        """Make the swap the record in Redis asks for, if it is newer than what this
        replica did. Called from the ingest loop (between rounds); reads Redis at most every
        CHECK_EVERY_S, and never waits on a swap being asked here."""
        if not self.seal_keys or self.lock.locked():
            return
        mono = time.monotonic()
        if mono - self._last_check < CHECK_EVERY_S:
            return
        self._last_check = mono
        raw = await self.ctx.redis.get(record_key(self.ctx.keys.prefix))
        if raw is None:
            return
        try:
            rec = parse_record(raw, self.seal_keys)
        except (ForgedItem, ValueError, UnicodeDecodeError) as exc:
            if raw != self._bad_raw:
                self._bad_raw = raw
                forged = isinstance(exc, ForgedItem)
                self.ctx.metrics.model_swaps.labels(result="forged" if forged else "refused").inc()
                log.error("the model swap record in Redis is refused (%s); it is not followed", exc)
            return
        seq = rec["seq"]
        if seq <= self.seen_seq:
            return
        if rec["base"] != self.configured:
            self.seen_seq = seq
            self.ctx.metrics.model_swaps.labels(result="ignored").inc()
            log.warning(
                "the model swap record %d was made on replicas configured with %s; this one"
                " runs %s as configured and does not follow it",
                seq,
                rec["base"],
                self.configured,
            )
            return
        if rec["version"] == self.version:
            self.seen_seq = seq
            return
        if mono - self.failed.get(seq, -float("inf")) < RETRY_FAILED_S:
            return
        async with self.lock:
            try:
                cand = await self._candidate_for(rec)
                rules, policy = self._rules_for(cand)
            except SwapError as exc:
                self.failed[seq] = mono
                self.problem = f"swap {seq} to {rec['version']} not followed: {exc}"
                self.ctx.metrics.model_swaps.labels(result="refused").inc()
                log.error("MODEL SWAP NOT FOLLOWED: %s", self.problem)
                return
            before = self.version
            warm = self._apply(cand, rules, policy)
        self.seen_seq = seq
        self.problem = None
        self.failed.clear()
        self.ctx.metrics.model_swaps.labels(result="followed").inc()
        self.history.appendleft(
            {**rec, "previous_here": before, "followed_at": time.time(), "warm_domains": warm}
        )
        log.warning(
            "MODEL SWAPPED (followed swap %d made by %s): %s -> %s; %d domains warm",
            seq,
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
        kind = "baseline" if det.forecaster.version.startswith("baseline/") else "model"
        provider = str(getattr(det.forecaster, "provider", "python"))
        digest = sha256 if sha256 is not None else file_sha256(self.shadow_source)
        champion = Detector("model", det.forecaster, det.rule)
        return Candidate(champion, kind, provider, self.shadow_source, digest, promoted=True)

    def _rules_for(self, cand: Candidate) -> tuple[list[Rule], AlertPolicy]:
        """The rules ``cand`` would act by: the rules file, with its own validated rule
        unless the operator set one (as at start-up)."""
        choice = forecaster.Choice(cand.detector, cand.kind, f"swapped in: {cand.source}", "")
        policy = forecaster.alert_policy(self.ctx.settings, choice)
        try:
            rules = load_rules(self.ctx.settings.rules_path(), policy)
        except Exception as exc:  # the rules file changed on disk since start-up
            raise SwapError(f"the rules file no longer loads: {exc}") from None
        return rules, policy

    async def _write(self, record: dict[str, Any], propagated: bool) -> int:
        """The audit entry, and (when sealed) the record replicas follow; its seq."""
        ctx = self.ctx
        seq = int(await ctx.redis.incr(seq_key(ctx.keys.prefix))) if propagated else 0
        record["seq"] = seq
        pipe = ctx.redis.pipeline(transaction=False)
        if propagated:
            pipe.set(record_key(ctx.keys.prefix), seal(compact_json(record), self.seal_keys))
        pipe.xadd(
            ctx.keys.alerts,
            {"alert": compact_json({"record": "model_swap", **record})},
            maxlen=ctx.settings.alerts_maxlen,
            approximate=True,
        )
        await pipe.execute()
        return seq

    def _apply(self, cand: Candidate, rules: list[Rule], policy: AlertPolicy) -> int:
        """Swap in ``cand`` (synchronous: between two ingest rounds). Returns the domains
        whose new champion state was warm."""
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
        self.source = cand.source
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
