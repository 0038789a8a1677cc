"""Request bodies that carry samples, and their validation into Sample records."""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, Field, JsonValue, WithJsonSchema

from oomcast.model.processes import MAX_PROCESSES
from oomcast.model.schema import (
    KINDS,
    MAX_NAME_CHARS,
    OPTIONAL_BYTE_FIELDS,
    PHASES,
    SANITY_FACTOR,
    OrderChecker,
    Sample,
    SchemaError,
    parse_sample,
)
from oomcast.service.api.deps import schema_error, unprocessable

EXAMPLE_SAMPLE: dict[str, JsonValue] = {
    "ts": 1764400000.0,
    "node": "gpu-node-17",
    "device": "gpu0",
    "kind": "gpu",
    "total_bytes": 85899345920,
    "used_bytes": 71000000000,
    "allocated_bytes": 60000000000,
    "reserved_bytes": 69000000000,
    "peak_bytes": 72000000000,
    "alloc_retries": 0,
    "job": "llama-ft-42",
}


# No control characters (they would forge log lines), and not only whitespace. U+0085 (NEL)
# is whitespace to Python's str.strip(), which the service checks with, but not to an ECMA
# regex's \s, which clients check with: so it is named here.
_NAME_PATTERN = r"^[^\u0000-\u001f\u007f]*[^\s\u0000-\u001f\u007f\u0085][^\u0000-\u001f\u007f]*$"
_JOB_PATTERN = r"^[^\u0000-\u001f\u007f]*$"
_NAME: dict[str, JsonValue] = {
    "type": "string",
    "minLength": 1,
    "maxLength": MAX_NAME_CHARS,
    "pattern": _NAME_PATTERN,
}
# Integers past 2**53 do not survive every JSON parser (I-JSON, RFC 7493: a JavaScript
# client rounds them), so over HTTP a count stays at or below it: 8 PiB for a byte count.
# The trace format itself allows up to 2**63 - 1 (MAX_COUNT).
MAX_JSON_INT = 2**53
COUNT_FIELDS = ("total_bytes", "used_bytes", *OPTIONAL_BYTE_FIELDS, "alloc_retries", "step")
_COUNT: dict[str, JsonValue] = {"type": "integer", "minimum": 0, "maximum": MAX_JSON_INT}
_OPTIONAL_COUNT: dict[str, JsonValue] = {**_COUNT, "type": ["integer", "null"]}

# The JSON Schema of one sample, written from model/schema.py's rules, so the OpenAPI
# document promises what parse_sample accepts. Two rules are beyond JSON Schema and are
# said in words: a byte count may be at most SANITY_FACTOR times total_bytes, and samples of
# one domain must come in time order.
SAMPLE_SCHEMA: dict[str, JsonValue] = {
    "type": "object",
    "description": "One sample of the trace format (docs/api.md). used_bytes, allocated_bytes,"
    f" reserved_bytes and peak_bytes may be at most {SANITY_FACTOR:g} times total_bytes;"
    " samples of one domain (node, device) must have increasing ts. Unknown keys are ignored.",
    "required": ["ts", "node", "device", "kind", "total_bytes", "used_bytes"],
    "properties": {
        "ts": {"type": "number", "exclusiveMinimum": 0, "description": "unix seconds"},
        "node": _NAME,
        "device": _NAME,
        "kind": {"type": "string", "enum": list(KINDS)},
        "total_bytes": {**_COUNT, "minimum": 1},
        "used_bytes": _COUNT,
        **{key: _OPTIONAL_COUNT for key in (*OPTIONAL_BYTE_FIELDS, "alloc_retries")},
        "job": {**_NAME, "type": ["string", "null"], "minLength": 0, "pattern": _JOB_PATTERN},
        "step": {**_OPTIONAL_COUNT, "description": "training step (the in-process hook's)"},
        "phase": {
            "type": ["string", "null"],
            "enum": [*PHASES, None],
            "description": "what the job is doing (docs/phases.md)",
        },
        "processes": {
            "type": ["array", "null"],
            "maxItems": MAX_PROCESSES,
            "description": "per-process memory of a GPU (NVML), each process's used_bytes at"
            f" most {SANITY_FACTOR:g} times total_bytes",
            "items": {
                "type": "object",
                "required": ["pid", "used_bytes"],
                "properties": {
                    "pid": {"type": "integer", "minimum": 1, "maximum": 2**31 - 1},
                    "used_bytes": _OPTIONAL_COUNT,
                    "job": {
                        **_NAME,
                        "type": ["string", "null"],
                        "minLength": 0,
                        "pattern": _JOB_PATTERN,
                    },
                },
                "additionalProperties": True,
            },
        },
    },
    "additionalProperties": True,
}


class SamplesBody(BaseModel):
    # Samples are validated by oomcast's own schema (the one source of truth for traces,
    # streams and HTTP), so a 422 names the same fields a trace reader would; the OpenAPI
    # document shows that schema (SAMPLE_SCHEMA) rather than "any object".
    samples: Annotated[
        list[dict[str, Any]],
        WithJsonSchema(
            {
                "type": "array",
                "items": SAMPLE_SCHEMA,
                "minItems": 1,
                "description": "Sample objects of the trace format, oldest first; at most"
                " OOMCAST_MAX_PREDICT_SAMPLES of them (10,000 unless configured).",
                "examples": [[EXAMPLE_SAMPLE]],
            }
        ),
    ] = Field(...)


def _check_json_ints(sample: Sample) -> None:
    for key in COUNT_FIELDS:
        value = getattr(sample, key)
        if value is not None and value > MAX_JSON_INT:
            raise SchemaError(
                key, f"{value} is past {MAX_JSON_INT} (2**53), which JSON cannot carry exactly"
            )


def parse_samples(objs: list[dict[str, Any]], *, limit: int, one_domain: bool) -> list[Sample]:
    """Validate every sample before anything is used, so a bad one rejects the request whole."""
    if not objs:
        raise unprocessable(["body", "samples"], "must hold at least one sample")
    if len(objs) > limit:
        raise unprocessable(["body", "samples"], f"holds {len(objs)} samples; the limit is {limit}")
    order = OrderChecker()
    out: list[Sample] = []
    for i, obj in enumerate(objs):
        try:
            sample = parse_sample(obj)
            _check_json_ints(sample)
            order.accept(sample)
        except SchemaError as exc:
            raise schema_error(i, exc) from None
        if one_domain and out and sample.domain != out[0].domain:
            raise unprocessable(
                ["body", "samples", i, "device"],
                f"is {sample.node}/{sample.device}, but this request is for"
                f" {out[0].node}/{out[0].device}; predict takes one domain at a time",
            )
        out.append(sample)
    return out
