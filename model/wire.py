"""Redis key names and the encoding of stream entries (DESIGN.md, "Redis layout").

One sample-stream entry carries one tick of one node: field ``samples`` is a JSON list of
sample objects, each with its embedding (``emb``, ``emb_v``). Events travel one per entry in
the events stream, field ``event``. Node agents, ``POST /v1/samples`` and the service all
go through these functions, so the format is defined once.
"""

from __future__ import annotations

import json
import math
import os
import zlib
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from oomcast.model.schema import (
    Event,
    Sample,
    SchemaError,
    decode_json,
    parse_event,
    parse_sample,
)

ENTRY_VERSION = "1"
DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"  # every process's default; OOMCAST_REDIS_URL
DEFAULT_KEY_PREFIX = "oomcast"
DEFAULT_PARTITIONS = 4


def redis_url_from_env(environ: Mapping[str, str] | None = None) -> str:
    """``OOMCAST_REDIS_URL``, or the default (a local Redis, database 0)."""
    env = os.environ if environ is None else environ
    return env.get("OOMCAST_REDIS_URL") or DEFAULT_REDIS_URL


@dataclass(frozen=True)
class Keys:
    """Every Redis key oomcast uses, under one prefix (tests use their own)."""

    prefix: str = DEFAULT_KEY_PREFIX
    partitions: int = DEFAULT_PARTITIONS

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Keys:
        """The layout ``OOMCAST_KEY_PREFIX`` and ``OOMCAST_PARTITIONS`` name (every process of
        one deployment must agree on both); ValueError, naming the variable, when malformed."""
        env = os.environ if environ is None else environ
        prefix = env.get("OOMCAST_KEY_PREFIX") or DEFAULT_KEY_PREFIX
        raw = env.get("OOMCAST_PARTITIONS") or str(DEFAULT_PARTITIONS)
        try:
            partitions = int(raw)
        except ValueError:
            raise ValueError(f"OOMCAST_PARTITIONS={raw!r} is not a whole number") from None
        return cls(prefix, partitions)

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ValueError(f"partitions={self.partitions} must be at least 1")
        if not self.prefix or any(c in self.prefix for c in "{} "):
            raise ValueError(f"key prefix {self.prefix!r} must be non-empty, without braces/spaces")

    def partition_of(self, node: str) -> int:
        return zlib.crc32(node.encode()) % self.partitions

    def samples(self, partition: int) -> str:
        # The hash tag keeps one partition's keys in one Redis Cluster slot.
        return f"{self.prefix}:samples:{{{partition}}}"

    def samples_for(self, node: str) -> str:
        return self.samples(self.partition_of(node))

    def all_samples(self) -> list[str]:
        return [self.samples(p) for p in range(self.partitions)]

    @property
    def events(self) -> str:
        return f"{self.prefix}:events"

    @property
    def alerts(self) -> str:
        return f"{self.prefix}:alerts"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}:deadletter"

    def control(self, node: str) -> str:
        return f"{self.prefix}:control:{{{node}}}"


def sample_payload(sample: Sample, emb: list[float] | None, emb_v: int | None) -> dict[str, Any]:
    obj = sample.to_dict()
    if emb is not None:
        obj["emb"] = [round(x, 6) for x in emb]
        obj["emb_v"] = emb_v
    return obj


def encode_samples(node: str, payloads: list[dict[str, Any]]) -> dict[str, str]:
    return {
        "v": ENTRY_VERSION,
        "node": node,
        "n": str(len(payloads)),
        "samples": json.dumps(payloads, separators=(",", ":")),
    }


def encode_event(event: Event) -> dict[str, str]:
    return {"v": ENTRY_VERSION, "event": json.dumps(event.to_dict(), separators=(",", ":"))}


def _text(fields: dict[Any, Any], key: str) -> str | None:
    value = fields.get(key, fields.get(key.encode()))
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise SchemaError(key, "is not UTF-8") from None
    return value


def _json_field(fields: dict[Any, Any], key: str) -> Any:
    raw = _text(fields, key)
    if raw is None:
        raise SchemaError(key, f"entry has no '{key}' field")
    return decode_json(raw, key)


@dataclass(slots=True)
class DecodedSample:
    sample: Sample
    emb: list[float] | None
    emb_v: int | None


def _finite_number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer too large for a float
        return False


def _embedding(obj: dict[str, Any]) -> tuple[list[float] | None, int | None]:
    emb, emb_v = obj.get("emb"), obj.get("emb_v")
    if emb is None:
        return None, None
    if not isinstance(emb, list) or not all(_finite_number(x) for x in emb):
        raise SchemaError("emb", "must be a list of finite numbers")
    if not isinstance(emb_v, int) or isinstance(emb_v, bool):
        raise SchemaError("emb_v", f"must be an integer schema version, got {emb_v!r}")
    return [float(x) for x in emb], emb_v


def decode_samples(fields: dict[Any, Any]) -> list[DecodedSample | SchemaError]:
    """Decode a sample entry. A broken entry raises; a broken sample inside a good entry is
    returned as its SchemaError in place, so one bad sample does not cost its neighbours."""
    objs = _json_field(fields, "samples")
    if not isinstance(objs, list):
        raise SchemaError("samples", "must be a JSON list of sample objects")
    out: list[DecodedSample | SchemaError] = []
    for i, obj in enumerate(objs):
        try:
            if not isinstance(obj, dict):
                raise SchemaError("", f"must be an object, got {type(obj).__name__}")
            emb, emb_v = _embedding(obj)
            out.append(DecodedSample(parse_sample(obj), emb, emb_v))
        except SchemaError as exc:
            out.append(SchemaError(f"samples[{i}].{exc.field}".rstrip("."), exc.message))
    return out


def decode_event(fields: dict[Any, Any]) -> Event:
    obj = _json_field(fields, "event")
    if not isinstance(obj, dict):
        raise SchemaError("event", "must be a JSON object")
    return parse_event(obj)
