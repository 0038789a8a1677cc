"""HMAC-SHA256 signing, the one place oomcast signs or checks bytes: the commands the service
sends to node agents (``model/control.py``), the sample entries node agents attest
(``model/wire.py``) and the webhook bodies the service posts (``service/delivery/webhook.py``). A
signature reads ``sha256=<hex digest>``. :func:`derive_key` makes the per-node keys."""

from __future__ import annotations

import hashlib
import hmac

SIG_PREFIX = "sha256="


def _key(secret: str) -> bytes:
    if not isinstance(secret, str) or not secret:
        raise ValueError("a signing secret must be a non-empty string")
    return secret.encode()


def sign(data: bytes, secret: str) -> str:
    """``sha256=<hex>`` of ``data`` under ``secret``; ValueError for an empty secret."""
    return SIG_PREFIX + hmac.new(_key(secret), data, hashlib.sha256).hexdigest()


def verify(data: bytes, signature: str | bytes | None, secret: str) -> bool:
    """Whether ``signature`` is ``data``'s under ``secret`` (compared in constant time)."""
    if signature is None:
        return False
    given = signature.encode() if isinstance(signature, str) else bytes(signature)
    expected = SIG_PREFIX.encode() + hmac.digest(_key(secret), data, "sha256").hex().encode()
    return hmac.compare_digest(expected, given)


def derive_key(secret: str, context: bytes) -> str:
    """A key of its own for ``context`` (hex HMAC-SHA256 of it under ``secret``): whoever holds
    the derived key cannot work back to ``secret`` nor to the key of any other context."""
    if not context:
        raise ValueError("a key derivation needs a non-empty context")
    return hmac.new(_key(secret), context, hashlib.sha256).hexdigest()


def service_keys(
    control_secret: str | None, webhook_secret: str | None, context: bytes
) -> tuple[str, ...]:
    """The keys the service seals what only it may write back to Redis (outbox items, state
    snapshots) with, for ``context``: one derived from the control secret and one from the
    webhook secret, for those set, in that order (the first seals, any verifies). Every
    replica with the same secrets derives the same."""
    return tuple(derive_key(s, context) for s in (control_secret, webhook_secret) if s)
