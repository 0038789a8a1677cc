"""Request bodies that carry samples, and their validation into Sample records."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field, JsonValue

from oomcast.model.schema import OrderChecker, Sample, SchemaError, parse_sample
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


class SamplesBody(BaseModel):
    # Samples are validated by oomcast's own schema (the one source of truth for traces,
    # streams and HTTP), so a 422 names the same fields a trace reader would.
    samples: list[dict[str, Any]] = Field(
        ...,
        description="Sample objects of the trace format, oldest first.",
        json_schema_extra={"examples": [[EXAMPLE_SAMPLE]]},
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
