"""Shared request dependencies, as ``Annotated`` aliases that tests can override, and the
errors the routes raise."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, HTTPException, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from redis.exceptions import OutOfMemoryError, ReadOnlyError, ResponseError

from oomcast.model.schema import SchemaError
from oomcast.service.api.edge import UNAUTHORIZED, bearer_matches
from oomcast.service.context import ServiceContext

# Seconds a client is asked to wait (Retry-After) when Redis cannot take writes right now.
RETRY_AFTER_S = 5


def get_ctx(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServiceContext, Depends(get_ctx)]

# Declares the scheme in the OpenAPI document. The check itself is done on the raw header
# bytes: by the edge middleware before the body is read, and again here, so a route under
# /v1 stays guarded even if the middleware were left out.
bearer = HTTPBearer(
    auto_error=False,
    description="OOMCAST_API_TOKEN, sent as `Authorization: Bearer <token>`; needed on /v1"
    " when the service has a token configured.",
)


def require_token(
    request: Request,
    ctx: Ctx,
    _credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer)],
) -> None:
    """With OOMCAST_API_TOKEN set, /v1 needs ``Authorization: Bearer <token>``."""
    token = ctx.settings.api_token
    if token is None:
        return
    if not bearer_matches(request.scope.get("headers", ()), token.get_secret_value().encode()):
        raise HTTPException(401, UNAUTHORIZED, {"WWW-Authenticate": "Bearer"})


Authorized = Depends(require_token)


def unprocessable(loc: list[Any], message: str) -> HTTPException:
    """A 422 shaped like FastAPI's own validation errors, naming the field."""
    return HTTPException(422, [{"loc": loc, "msg": message, "type": "value_error"}])


def schema_error(index: int, exc: SchemaError) -> HTTPException:
    loc: list[Any] = ["body", "samples", index]
    if exc.field:
        loc.append(exc.field)
    return unprocessable(loc, exc.message)


def write_refusal(exc: BaseException) -> str | None:
    """Why Redis refuses writes while it answers (out of memory, or a read-only replica),
    or None when ``exc`` is some other error. redis-py raises its own classes for both
    replies (OOM, READONLY); a plain ResponseError whose text holds the OOM reply (a proxy's,
    or inside a pipeline, where redis-py puts the command first) counts too."""
    if isinstance(exc, ReadOnlyError):
        return "Redis is a read-only replica"
    if isinstance(exc, OutOfMemoryError) or (
        isinstance(exc, ResponseError) and "OOM command not allowed" in str(exc)
    ):
        return "Redis is out of memory (maxmemory reached, noeviction)"
    return None


def unavailable(message: str) -> HTTPException:
    """A 503 that tells the client when to try again."""
    return HTTPException(503, message, {"Retry-After": str(RETRY_AFTER_S)})
