"""Signed commands from the service to a node agent (checkpoint a job, shed load).

The service acts on a node by adding an entry to the node's control stream
(:meth:`oomcast.model.wire.Keys.control`). Anyone who can write to Redis can write there, so
an agent acts only on a command that carries a valid HMAC-SHA256 of its exact bytes under a
secret shared by the service and the agents, that names this node, that is inside its
validity window, and whose nonce it has not seen before.

An entry has two fields: ``cmd``, the command as canonical JSON (sorted keys, no spaces),
and ``sig``, ``sha256=<hex HMAC-SHA256 of the cmd bytes>``. The agent checks the signature
over the bytes exactly as received, before it parses anything, so unauthenticated content
is never interpreted; the nonce is recorded only once every other check has passed, so a
command refused for its timing can still be accepted later, but no accepted command can
be accepted twice.

A command (JSON object)::

    {"id": "...", "node": "node-7", "action": "checkpoint" | "shed", "device": "gpu0",
     "job": "bert-ft-42" | null, "params": {...}, "dry_run": false,
     "issued_at": 1700000000.0, "expires_at": 1700000030.0, "nonce": "<hex>",
     "reason": "...", "forecast": {"risk": {...}, "time_to_oom_s": ..., ...}}

Keys: each node has a key of its own, :func:`node_key` of the master secret
(``OOMCAST_CONTROL_SECRET``, held by the service alone) and the node's name. The service
signs a node's commands with that node's key, and the node holds only its own
(``OOMCAST_NODE_KEY``), so a key stolen from one node signs commands for that node only.
The same key attests the node's sample entries (:func:`oomcast.model.wire.encode_samples`).

This module is plain Python (standard library only): the service signs with it, the node
agent verifies with it.
"""

from __future__ import annotations

import heapq
import json
import math
import secrets
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.signing import derive_key, sign, verify

ACTIONS = ("checkpoint", "shed")
# Actions that can lose work: they need evidence, signed by the domain's own node, behind
# the forecast (service) and the agent's own reading of the danger (node). A checkpoint
# only asks a job to save what it has; it loses nothing, so it needs neither (a forged
# forecast costs one save, and the rule's cooldown bounds how often).
DESTRUCTIVE_ACTIONS = frozenset({"shed"})
DEFAULT_TTL_S = 30.0
MAX_VALIDITY_S = 600.0  # expires_at - issued_at may not exceed this
DEFAULT_MAX_SKEW_S = 30.0
NONCE_CACHE_CAP = 100_000
MAX_CMD_BYTES = 64 * 1024  # a command is a few hundred bytes; refuse anything absurd unread
MIN_NONCE_HEX = 16  # 64 bits
MAX_NONCE_HEX = 128
MAX_ID_CHARS = 200

# Reason codes of CommandRejected. "busy" is also what the node agent answers when the same
# (device, action) is already running, or when the nonce cache is full.
REASONS = (
    "unsigned",
    "bad_signature",
    "malformed",
    "wrong_node",
    "expired",
    "not_yet_valid",
    "too_long",
    "replayed",
    "busy",
    # the agent's own reading of the domain did not confirm the state the command claims
    "unconfirmed",
)
# Refusals decided before the signature was verified: their content is not to be trusted.
UNAUTHENTICATED_REASONS = frozenset({"unsigned", "bad_signature"})

_HEX = frozenset("0123456789abcdefABCDEF")


class CommandRejected(Exception):
    """A command the agent will not act on. ``reason`` is one of :data:`REASONS`;
    ``command_id`` is set once the signature has been verified and the id could be read."""

    def __init__(
        self,
        reason: str,
        message: str,
        command_id: str | None = None,
        command: Command | None = None,
    ) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason
        self.message = message
        self.command_id = command_id
        # the parsed (authenticated) command, for refusals decided after parsing it
        self.command = command
        # whether the entry's signature had been verified when it was refused
        self.authenticated = command is not None
        # figures behind the refusal, for its audit event (measured vs claimed, ...)
        self.details: dict[str, Any] = {}


@dataclass(frozen=True, slots=True)
class Command:
    id: str
    node: str
    action: str
    device: str
    job: str | None
    params: dict[str, Any]
    dry_run: bool
    issued_at: float
    expires_at: float
    nonce: str
    reason: str
    forecast: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "node": self.node,
            "action": self.action,
            "device": self.device,
            "job": self.job,
            "params": self.params,
            "dry_run": self.dry_run,
            "issued_at": self.issued_at,
            "expires_at": self.expires_at,
            "nonce": self.nonce,
            "reason": self.reason,
            "forecast": self.forecast,
        }


# --- signing --------------------------------------------------------------------------------


def canonical_json(obj: Any) -> str:
    """Sorted keys, no spaces, no NaN/Infinity (not JSON): the bytes that get signed."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), allow_nan=False)


def signature(data: bytes, secret: str) -> str:
    return sign(data, secret)


def sign_command(cmd: Mapping[str, Any], secret: str) -> dict[str, str]:
    """The control-stream fields for ``cmd``: ``{"cmd": canonical JSON, "sig": "sha256=..."}``.
    Raises ValueError for an empty secret or a value JSON cannot carry (NaN, infinity)."""
    raw = canonical_json(dict(cmd))
    return {"cmd": raw, "sig": signature(raw.encode(), secret)}


def new_command(
    *,
    node: str,
    action: str,
    device: str,
    job: str | None = None,
    params: Mapping[str, Any] | None = None,
    dry_run: bool = False,
    reason: str = "",
    forecast: Mapping[str, Any] | None = None,
    ttl_s: float = DEFAULT_TTL_S,
    now: float | None = None,
    id: str | None = None,
) -> dict[str, Any]:
    """A command dict with its id, nonce, issued_at and expires_at filled in."""
    if action not in ACTIONS:
        raise ValueError(f"action={action!r} must be one of {', '.join(ACTIONS)}")
    if not 0 < ttl_s <= MAX_VALIDITY_S:
        raise ValueError(f"ttl_s={ttl_s} must be in (0, {MAX_VALIDITY_S:g}]")
    if not node or not device:
        raise ValueError("node and device must be non-empty")
    issued = time.time() if now is None else float(now)
    return {
        "id": id or uuid.uuid4().hex,
        "node": node,
        "action": action,
        "device": device,
        "job": job,
        "params": dict(params or {}),
        "dry_run": bool(dry_run),
        "issued_at": issued,
        "expires_at": issued + ttl_s,
        "nonce": secrets.token_hex(16),
        "reason": reason,
        "forecast": dict(forecast or {}),
    }


# --- per-node keys ---------------------------------------------------------------------------

NODE_KEY_CONTEXT = b"oomcast-node-key-v1\n"


def node_key(master_secret: str, node: str) -> str:
    """The key of ``node`` (64 hex digits), derived from the master secret: it signs that
    node's commands and attests its samples, and says nothing of any other node's key."""
    if not isinstance(node, str) or not node:
        raise ValueError("node must be a non-empty name")
    return derive_key(master_secret, NODE_KEY_CONTEXT + node.encode("utf-8", "surrogateescape"))


NODE_KEYS_CACHED = 100_000


def node_keys(master_secret: str) -> Callable[[str], str | None]:
    """``node -> node_key(master_secret, node)`` (None for an empty name): the lookup the
    service gives :func:`oomcast.model.wire.entry_attested`. Raises ValueError now, not on
    the first lookup, for an empty secret."""
    node_key(master_secret, "-")  # an empty or non-string secret fails here
    known: dict[str, str] = {}  # every entry names its node: derived once (bounded)

    def key_for(node: str) -> str | None:
        if not node:
            return None
        key = known.get(node)
        if key is None:
            if len(known) >= NODE_KEYS_CACHED:
                known.clear()
            key = known[node] = node_key(master_secret, node)
        return key

    return key_for


# --- the nonce cache --------------------------------------------------------------------------


class NonceCache:
    """Nonces of accepted commands, each kept until its command expires (plus ``grace_s``,
    so that a clock stepped back a little cannot revive an evicted one). Bounded: expired
    nonces are evicted on insert; when ``cap`` unexpired nonces are held, new commands are
    refused ("busy") rather than an unexpired nonce forgotten. Thread-safe."""

    def __init__(self, cap: int = NONCE_CACHE_CAP, *, grace_s: float = 60.0) -> None:
        if cap < 1:
            raise ValueError(f"cap={cap} must be at least 1")
        if grace_s < 0:
            raise ValueError(f"grace_s={grace_s} must not be negative")
        self.cap = cap
        self.grace_s = grace_s
        self._until: dict[str, float] = {}
        self._heap: list[tuple[float, str]] = []
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._until)

    def __contains__(self, nonce: object) -> bool:
        return nonce in self._until

    def _evict(self, now: float) -> None:
        heap = self._heap
        while heap and heap[0][0] < now:
            until, nonce = heapq.heappop(heap)
            if self._until.get(nonce) == until:
                del self._until[nonce]

    def add(self, nonce: str, expires_at: float, now: float) -> None:
        """Record ``nonce`` until ``expires_at`` (+ grace). Raises CommandRejected:
        "replayed" if it is held, "busy" if the cache is full of unexpired nonces."""
        with self._lock:
            self._evict(now)
            if nonce in self._until:
                raise CommandRejected("replayed", f"nonce {nonce[:16]}... was already used")
            if len(self._until) >= self.cap:
                raise CommandRejected(
                    "busy",
                    f"nonce cache full ({self.cap} unexpired commands); refusing new commands"
                    " until some expire",
                )
            until = expires_at + self.grace_s
            self._until[nonce] = until
            heapq.heappush(self._heap, (until, nonce))


# --- verification ---------------------------------------------------------------------------


def _raw_field(fields: Mapping[Any, Any], key: str) -> bytes | None:
    value = fields.get(key, fields.get(key.encode()))
    if value is None:
        return None
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return str(value).encode()


def unverified_id(fields: Mapping[Any, Any]) -> str | None:
    """The ``id`` an entry's ``cmd`` claims, read *without* trusting it: for reporting a
    refused entry (a command signed with the wrong secret) so its sender can match it up.
    Never act on it."""
    raw = _raw_field(fields, "cmd")
    if raw is None or len(raw) > MAX_CMD_BYTES:
        return None
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError):
        return None
    cid = obj.get("id") if isinstance(obj, dict) else None
    return cid[:MAX_ID_CHARS] if isinstance(cid, str) and cid else None


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _number(obj: dict[str, Any], key: str) -> float:
    value = obj.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise CommandRejected("malformed", f"{key} must be a number of unix seconds")
    try:
        out = float(value)
    except OverflowError:
        raise CommandRejected("malformed", f"{key} is far too large") from None
    if not math.isfinite(out) or out <= 0:
        raise CommandRejected("malformed", f"{key} must be positive and finite")
    return out


def _string(obj: dict[str, Any], key: str, *, empty: bool = False, limit: int = 0) -> str:
    value = obj.get(key)
    if not isinstance(value, str) or (not empty and not value.strip()):
        raise CommandRejected("malformed", f"{key} must be a {'' if empty else 'non-empty '}string")
    if limit and len(value) > limit:
        raise CommandRejected("malformed", f"{key} is longer than {limit} characters")
    return value


def parse_command(raw: bytes) -> Command:
    """Parse the bytes of an authenticated ``cmd`` field. Raises CommandRejected("malformed")."""
    try:
        obj = json.loads(raw, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        raise CommandRejected("malformed", f"cmd is not valid JSON ({exc})"[:300]) from None
    if not isinstance(obj, dict):
        raise CommandRejected("malformed", f"cmd must be a JSON object, got {type(obj).__name__}")
    cid = obj.get("id")
    cid = cid[:MAX_ID_CHARS] if isinstance(cid, str) else None
    try:
        action = obj.get("action")
        if action not in ACTIONS:
            raise CommandRejected(
                "malformed", f"action must be one of {', '.join(ACTIONS)}, got {action!r}"[:300]
            )
        job = obj.get("job")
        if job is not None and (not isinstance(job, str) or not job):
            raise CommandRejected("malformed", "job must be a non-empty string or null")
        for key in ("params", "forecast"):
            if not isinstance(obj.get(key), dict):
                raise CommandRejected("malformed", f"{key} must be a JSON object")
        if not isinstance(obj.get("dry_run"), bool):
            raise CommandRejected("malformed", "dry_run must be true or false")
        nonce = _string(obj, "nonce", limit=MAX_NONCE_HEX)
        if len(nonce) < MIN_NONCE_HEX or not set(nonce) <= _HEX:
            raise CommandRejected(
                "malformed", f"nonce must be {MIN_NONCE_HEX} to {MAX_NONCE_HEX} hex digits"
            )
        command = Command(
            id=_string(obj, "id", limit=MAX_ID_CHARS),
            node=_string(obj, "node"),
            action=action,
            device=_string(obj, "device"),
            job=job,
            params=obj["params"],
            dry_run=obj["dry_run"],
            issued_at=_number(obj, "issued_at"),
            expires_at=_number(obj, "expires_at"),
            nonce=nonce.lower(),
            reason=_string(obj, "reason", empty=True),
            forecast=obj["forecast"],
        )
    except CommandRejected as exc:
        exc.command_id = cid
        raise
    if command.expires_at < command.issued_at:
        raise CommandRejected("malformed", "expires_at is before issued_at", cid)
    return command


def verify_command(
    fields: Mapping[Any, Any],
    secret: str,
    *,
    now: float,
    node: str,
    nonces: NonceCache,
    max_skew_s: float = DEFAULT_MAX_SKEW_S,
) -> Command:
    """Authenticate and check one control-stream entry; return its command, or raise
    CommandRejected. The signature is checked before anything is parsed, and the nonce is
    recorded last, only when the command is accepted."""
    if not isinstance(secret, str) or not secret:
        raise ValueError("the control secret must be a non-empty string")
    sig = _raw_field(fields, "sig")
    if sig is None:
        raise CommandRejected("unsigned", "entry has no 'sig' field")
    raw = _raw_field(fields, "cmd")
    if raw is None:
        raise CommandRejected("malformed", "entry has no 'cmd' field")
    if len(raw) > MAX_CMD_BYTES:
        raise CommandRejected("malformed", f"cmd is larger than {MAX_CMD_BYTES} bytes")
    if not verify(raw, sig, secret):
        raise CommandRejected("bad_signature", "the signature does not match the command")

    try:
        return _check_command(parse_command(raw), now, node, nonces, max_skew_s)
    except CommandRejected as exc:
        exc.authenticated = True
        raise


def _check_command(
    cmd: Command, now: float, node: str, nonces: NonceCache, max_skew_s: float
) -> Command:
    if cmd.node != node:
        raise CommandRejected(
            "wrong_node", f"command is for node {cmd.node!r}, not {node!r}", cmd.id, cmd
        )
    if now > cmd.expires_at:
        raise CommandRejected(
            "expired",
            f"expired {now - cmd.expires_at:.1f} s ago (at {cmd.expires_at})",
            cmd.id,
            cmd,
        )
    if cmd.issued_at > now + max_skew_s:
        raise CommandRejected(
            "not_yet_valid",
            f"issued {cmd.issued_at - now:.1f} s in the future (more than {max_skew_s:g} s of"
            " clock skew)",
            cmd.id,
            cmd,
        )
    if cmd.expires_at - cmd.issued_at > MAX_VALIDITY_S:
        raise CommandRejected(
            "too_long",
            f"valid for {cmd.expires_at - cmd.issued_at:.0f} s, more than {MAX_VALIDITY_S:g} s",
            cmd.id,
            cmd,
        )
    try:
        nonces.add(cmd.nonce, cmd.expires_at, now)
    except CommandRejected as exc:
        exc.command_id, exc.command = cmd.id, cmd
        raise
    return cmd


__all__ = [
    "ACTIONS",
    "DEFAULT_TTL_S",
    "MAX_VALIDITY_S",
    "REASONS",
    "UNAUTHENTICATED_REASONS",
    "Command",
    "CommandRejected",
    "NonceCache",
    "canonical_json",
    "new_command",
    "node_key",
    "node_keys",
    "parse_command",
    "sign_command",
    "signature",
    "unverified_id",
    "verify_command",
]
