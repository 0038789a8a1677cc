"""Shared request dependencies, as ``Annotated`` aliases that tests can override."""

from __future__ import annotations

import hmac
from typing import Annotated, Any

from fastapi import Depends, Header, HTTPException, Request

from oomcast.model.schema import SchemaError
from oomcast.service.context import ServiceContext


def get_ctx(request: Request) -> ServiceContext:
    ctx: ServiceContext = request.app.state.ctx
    return ctx


Ctx = Annotated[ServiceContext, Depends(get_ctx)]


def require_token(ctx: Ctx, authorization: Annotated[str | None, Header()] = None) -> None:
    """With OOMCAST_API_TOKEN set, /v1 needs ``Authorization: Bearer <token>``."""
    token = ctx.settings.api_token
    if token is None:
        return
    expected = f"Bearer {token.get_secret_value()}"
    if authorization is None or not hmac.compare_digest(authorization, expected):
        raise HTTPException(401, "missing or wrong bearer token", {"WWW-Authenticate": "Bearer"})


Authorized = Depends(require_token)


def unprocessable(loc: list[Any], message: str) -> HTTPException:
    """A 422 shaped like FastAPI's own validation errors, naming the field."""
    return HTTPException(422, [{"loc": loc, "msg": message, "type": "value_error"}])


def schema_error(index: int, exc: SchemaError) -> HTTPException:
    loc: list[Any] = ["body", "samples", index]
    if exc.field:
        loc.append(exc.field)
    return unprocessable(loc, exc.message)
