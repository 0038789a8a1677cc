"""What the OpenAPI document promises about responses: the error bodies and, per status, a
description and headers. Routes pick the statuses they can give, so the document lists every
answer a client (or a contract tester such as schemathesis) can get, and nothing else."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from oomcast.service.api.deps import RETRY_AFTER_S


class Problem(BaseModel):
    """Every error but 422: one sentence that says what is wrong."""

    detail: str = Field(..., description="what went wrong, in words")


class FieldProblem(BaseModel):
    loc: list[str | int] = Field(..., description='where: ["body", "samples", 3, "used_bytes"]')
    msg: str = Field(..., description="what is wrong with it")
    type: str = Field(..., description="a machine-readable kind, e.g. value_error, missing")


class ValidationProblem(BaseModel):
    """A 422: every field at fault, located from the top of the request."""

    detail: list[FieldProblem]


Responses = dict[int | str, dict[str, Any]]

_RETRY_AFTER = {
    "Retry-After": {
        "description": f"seconds to wait before trying again ({RETRY_AFTER_S})",
        "schema": {"type": "integer"},
    }
}

_ALL: Responses = {
    400: {
        "model": Problem,
        "description": "The body could not be read: a bad Content-Length, or a client that"
        " stopped sending it.",
    },
    401: {
        "model": Problem,
        "description": "No, malformed or wrong `Authorization: Bearer` token (only when the"
        " service has OOMCAST_API_TOKEN set).",
        "headers": {"WWW-Authenticate": {"schema": {"type": "string"}, "description": "Bearer"}},
    },
    403: {
        "model": Problem,
        "description": "Refused whatever the token: model swaps need the service to have"
        " OOMCAST_API_TOKEN set.",
    },
    404: {"model": Problem, "description": "No live memory domain of that name."},
    409: {
        "model": Problem,
        "description": "Nothing to promote: no shadow model runs (OOMCAST_SHADOW_MODEL_PATH).",
    },
    413: {
        "model": Problem,
        "description": "The body is over OOMCAST_MAX_BODY_BYTES (8 MiB unless configured).",
    },
    422: {
        "model": ValidationProblem,
        "description": "The request is well formed JSON but breaks a rule; `loc` names the field.",
    },
    503: {
        "model": Problem,
        "description": "Redis is unreachable or refuses writes (out of memory, read-only);"
        " nothing of the request was kept.",
        "headers": _RETRY_AFTER,
    },
}


def responses(*statuses: int) -> Responses:
    """The documented answers for ``statuses``, for a route's ``responses=``."""
    return {status: _ALL[status] for status in statuses}


# What every /v1 route can answer besides its own statuses.
V1 = (401,)
# ... and every route that takes a JSON body.
WITH_BODY = (400, 401, 413, 422)
