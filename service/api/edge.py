"""The HTTP edge: what every request meets before FastAPI routes it or reads its body.

FastAPI reads and parses a request's body before it runs any dependency, so a token check
written as a dependency comes too late: an unauthenticated client could make the service
buffer and parse a body of any size (four 116 MB posts once took it to 3.2 GB). This module
is a plain ASGI middleware (not Starlette's ``BaseHTTPMiddleware``, which would buffer and
re-wrap the stream) that, in this order and without reading a byte of the body:

1. refuses ``/v1`` requests without the right bearer token (401), when a token is set;
2. refuses a body whose ``Content-Length`` is over the limit (413);

and then counts the bytes as the application pulls them, answering 413 as soon as the total
passes the limit, whether or not a length was declared (chunked bodies too).
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Iterable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

DEFAULT_MAX_BODY_BYTES = 8 * 1024 * 1024
PROTECTED_PREFIX = "/v1"
UNAUTHORIZED = "missing or wrong bearer token: send `Authorization: Bearer <OOMCAST_API_TOKEN>`"


def too_large_message(limit: int) -> str:
    return f"request body is over the limit of {limit} bytes (OOMCAST_MAX_BODY_BYTES)"


def is_protected(path: str) -> bool:
    """Whether ``path`` is under the API prefix that the token guards."""
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/")


def bearer_matches(headers: Iterable[tuple[bytes, bytes]], token: bytes) -> bool:
    """True when the request carries exactly one ``Authorization: Bearer <token>`` header.

    It works on the raw header bytes, so a header in any encoding (non-ASCII, latin-1, empty)
    is refused instead of failing to decode, and it compares digests of the credentials, so
    the comparison takes the same time whatever the client sent, its length included."""
    values = [value for name, value in headers if name.lower() == b"authorization"]
    if len(values) != 1:  # none, or several that could disagree
        return False
    scheme, _, credentials = values[0].strip().partition(b" ")
    credentials = credentials.strip(b" \t")
    if scheme.lower() != b"bearer" or not credentials:
        return False
    return hmac.compare_digest(hashlib.sha256(credentials).digest(), hashlib.sha256(token).digest())


class BodyTooLarge(Exception):
    """Raised from ``receive`` once the body passes the limit; the middleware answers 413."""


def _declared_length(headers: Iterable[tuple[bytes, bytes]]) -> int | None:
    """The ``Content-Length`` as a number, None when absent; ValueError when not a number
    or when several headers disagree (the server would not know which body to read)."""
    values = {value.strip() for name, value in headers if name.lower() == b"content-length"}
    if not values:
        return None
    if len(values) > 1 or not all(v.isdigit() for v in values):
        raise ValueError("Content-Length must be one whole number of bytes")
    return int(values.pop())


async def reply(
    send: Send, status: int, detail: str, headers: dict[str, str] | None = None
) -> None:
    """Send a whole ``{"detail": ...}`` JSON response, the shape FastAPI's errors have."""
    body = json.dumps({"detail": detail}).encode()
    raw = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
    ]
    raw += [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in (headers or {}).items()]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body})


class _BodyGuard:
    """Wraps one request's ``receive`` and ``send``: counts the body as it is pulled and,
    once it passes the limit, takes over the response (whatever the application did with
    the error its ``receive`` raised, a 400 of its own or an exception, is dropped)."""

    def __init__(self, receive: Receive, send: Send, limit: int) -> None:
        self._receive = receive
        self._send = send
        self.limit = limit
        self.received = 0
        self.overflowed = False
        self.started = False  # the application's response went out before any overflow

    async def receive(self) -> Message:
        if self.overflowed:
            raise BodyTooLarge(too_large_message(self.limit))
        message = await self._receive()
        if message["type"] == "http.request":
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.overflowed = True
                raise BodyTooLarge(too_large_message(self.limit))
        return message

    async def send(self, message: Message) -> None:
        if self.overflowed and not self.started:
            return  # the 413 is ours to send
        if message["type"] == "http.response.start":
            self.started = True
        await self._send(message)


class EdgeMiddleware:
    """Authentication and the body-size limit, before the body is read (module docstring).

    ``api_token`` None leaves ``/v1`` open (the token is then not required anywhere);
    routes outside ``/v1`` (health, metrics, the OpenAPI document) are always open."""

    def __init__(self, app: ASGIApp, *, max_body_bytes: int, api_token: str | None) -> None:
        if max_body_bytes < 1:
            raise ValueError(f"max_body_bytes must be at least 1, got {max_body_bytes}")
        self.app = app
        self.max_body_bytes = max_body_bytes
        self._token = api_token.encode() if api_token is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers: list[tuple[bytes, bytes]] = list(scope.get("headers", ()))
        try:
            declared = _declared_length(headers)
        except ValueError as exc:
            await reply(send, 400, str(exc), {"Connection": "close"})
            return
        has_body = bool(declared) or any(n.lower() == b"transfer-encoding" for n, _ in headers)
        # The server must not keep reading a body it refused, so such answers close the
        # connection (clients then see the answer instead of a stalled upload).
        closing = {"Connection": "close"} if has_body else {}
        path: str = scope.get("path", "")
        root: str = scope.get("root_path", "")
        if root and path.startswith(root):
            # behind a proxy (uvicorn --root-path) the routes see the path below the root
            path = path[len(root) :]
        if (
            self._token is not None
            and is_protected(path)
            and not bearer_matches(headers, self._token)
        ):
            await reply(send, 401, UNAUTHORIZED, {"WWW-Authenticate": "Bearer", **closing})
            return
        if declared is not None and declared > self.max_body_bytes:
            await reply(send, 413, too_large_message(self.max_body_bytes), {"Connection": "close"})
            return
        guard = _BodyGuard(receive, send, self.max_body_bytes)
        try:
            await self.app(scope, guard.receive, guard.send)
        except Exception:
            if not guard.overflowed or guard.started:
                raise
        if guard.overflowed and not guard.started:
            await reply(send, 413, too_large_message(self.max_body_bytes), {"Connection": "close"})
