"""Redis key names and the encoding of stream entries (DESIGN.md, "Redis layout").

One sample-stream entry carries one tick of one node: field ``samples`` is a JSON list of
sample objects, each with its embedding (``emb``, ``emb_v``). Events travel one per entry in
the events stream, field ``event``. Node agents, ``POST /v1/samples`` and the service all
go through these functions, so the format is defined once.

Attestation: a node agent signs each sample entry it writes with its node key
(:func:`oomcast.model.control.node_key`), in field ``sig``: ``sha256=<hex HMAC-SHA256>`` of
``b"oomcast-samples-v1\n"``, the length of the entry's ``node`` field in bytes (4 bytes, big
endian), those bytes, then the exact bytes of the ``samples`` field. Anyone who can write to
Redis can add an entry, but only the holder of a node's key can add one that
:func:`entry_attested` accepts as that node's; the service acts on a node only on the word of
attested samples. The prefix keeps a sample signature from ever passing for a command's
(a command is JSON, which cannot start with it).

:func:`redact_url` is how every process writes a URL into a log line or message.
"""

from __future__ import annotations

import base64
import binascii
import math
import os
import re
import zlib
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast
from urllib.parse import parse_qsl, quote, urlsplit, urlunsplit

import numpy as np

from oomcast.model.forecast import Embedding
from oomcast.model.schema import (
    Event,
    Sample,
    SchemaError,
    decode_json,
    parse_event,
    parse_sample,
)
from oomcast.model.signing import sign, verify
from oomcast.model.text import compact_json

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

    def partition_of_stream(self, stream: str) -> int | None:
        """The partition whose sample stream ``stream`` is; None for any other key."""
        head, tail = f"{self.prefix}:samples:{{", "}"
        if not (stream.startswith(head) and stream.endswith(tail)):
            return None
        digits = stream[len(head) : -len(tail)]
        if not digits.isdigit() or self.samples(int(digits)) != stream:
            return None
        p = int(digits)
        return p if p < self.partitions else None

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


def sample_payload(
    sample: Sample, emb: list[float] | None, emb_v: int | None, *, binary: bool = True
) -> dict[str, Any]:
    """A sample object for a stream entry, with its embedding: as ``emb_f32`` (the
    default), or as the JSON list ``emb`` (6 decimals) with ``binary=False``."""
    obj = sample.to_dict()
    if emb is not None:
        if binary:
            raw = np.asarray(emb, dtype="<f4").tobytes()
            obj["emb_f32"] = base64.b64encode(raw).decode("ascii")
        else:
            obj["emb"] = [round(x, 6) for x in emb]
        obj["emb_v"] = emb_v
    return obj


SAMPLES_SIG_CONTEXT = b"oomcast-samples-v1\n"
MAX_ATTESTED_NODE_BYTES = 1024


def _attested_bytes(node: bytes, samples: bytes) -> bytes:
    return SAMPLES_SIG_CONTEXT + len(node).to_bytes(4, "big") + node + samples


def encode_samples(
    node: str, payloads: list[dict[str, Any]], key: str | None = None
) -> dict[str, str]:
    """The fields of one sample entry; with ``key`` (the node's key), signed in ``sig`` (see
    the module docstring). ValueError for an empty key."""
    fields = {
        "v": ENTRY_VERSION,
        "node": node,
        "n": str(len(payloads)),
        "samples": compact_json(payloads),
    }
    if key is not None:
        data = _attested_bytes(node.encode("utf-8"), fields["samples"].encode("utf-8"))
        fields["sig"] = sign(data, key)
    return fields


def field_bytes(fields: Mapping[Any, Any], key: str) -> bytes | None:
    """A stream entry's or hash's field as bytes (redis-py answers str or bytes), or None."""
    value = fields.get(key, fields.get(key.encode()))
    if isinstance(value, str):
        return value.encode("utf-8", "surrogateescape")
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    return None


def entry_attested(fields: Mapping[Any, Any], key_for_node: Callable[[str], str | None]) -> bool:
    """Whether a sample entry carries a valid ``sig`` under the key ``key_for_node`` gives for
    the entry's own ``node`` field. False for a missing or bad signature, a missing node or
    samples field, or a node without a key (None or empty)."""
    node, samples, sig = (
        field_bytes(fields, "node"),
        field_bytes(fields, "samples"),
        field_bytes(fields, "sig"),
    )
    if node is None or samples is None or sig is None:
        return False
    if not node or len(node) > MAX_ATTESTED_NODE_BYTES:
        return False
    try:
        name = node.decode("utf-8")
    except UnicodeDecodeError:
        return False
    key = key_for_node(name)
    if not key:
        return False
    return verify(_attested_bytes(node, samples), sig, key)


EVENT_SIG_CONTEXT = b"oomcast-event-v1\n"


def encode_event(event: Event, key: str | None = None) -> dict[str, str]:
    """The fields of one event entry; with ``key`` (the key of the node the event names),
    signed in ``sig``: an HMAC-SHA256 over a fixed prefix and the exact bytes of the
    ``event`` field, which names the node, so the signature binds the event to it."""
    fields = {"v": ENTRY_VERSION, "event": compact_json(event.to_dict())}
    if key is not None:
        fields["sig"] = sign(EVENT_SIG_CONTEXT + fields["event"].encode("utf-8"), key)
    return fields


def event_attested(
    fields: Mapping[Any, Any], node: str, key_for_node: Callable[[str], str | None]
) -> bool:
    """Whether an event entry carries a valid ``sig`` under the key of ``node``: the node the
    entry's own (decoded) ``event`` field names. False for a missing or bad signature and
    for a node without a key."""
    raw, sig = field_bytes(fields, "event"), field_bytes(fields, "sig")
    if raw is None or sig is None or not node:
        return False
    key = key_for_node(node)
    if not key:
        return False
    return verify(EVENT_SIG_CONTEXT + raw, sig, key)


def _text(fields: Mapping[Any, Any], key: str) -> str | None:
    value = fields.get(key, fields.get(key.encode()))
    if isinstance(value, bytes):
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise SchemaError(key, "is not UTF-8") from None
    return cast(str | None, value)


def _json_field(fields: Mapping[Any, Any], key: str) -> Any:
    raw = _text(fields, key)
    if raw is None:
        raise SchemaError(key, f"entry has no '{key}' field")
    return decode_json(raw, key)


@dataclass(slots=True)
class DecodedSample:
    sample: Sample
    emb: Embedding | None
    emb_v: int | None


def _finite_number(x: Any) -> bool:
    if isinstance(x, bool) or not isinstance(x, int | float):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer too large for a float
        return False


def _emb_version(obj: dict[str, Any]) -> int:
    emb_v = obj.get("emb_v")
    if not isinstance(emb_v, int) or isinstance(emb_v, bool):
        raise SchemaError("emb_v", f"must be an integer schema version, got {emb_v!r}")
    return emb_v


def _json_embedding(obj: dict[str, Any]) -> tuple[list[float] | None, int | None]:
    emb = obj.get("emb")
    if emb is None:
        return None, None
    if not isinstance(emb, list) or not all(_finite_number(x) for x in emb):
        raise SchemaError("emb", "must be a list of finite numbers")
    return [float(x) for x in emb], _emb_version(obj)


def _f32_bytes(text: Any) -> bytes:
    """The raw bytes of an ``emb_f32`` field; SchemaError when it is not base64 of float32s."""
    if not isinstance(text, str):
        raise SchemaError("emb_f32", f"must be a base64 string, got {type(text).__name__}")
    try:  # base64.b64decode(text, validate=True) without its Python layers: the hot path
        raw = binascii.a2b_base64(text, strict_mode=True)
    except (binascii.Error, ValueError):
        raise SchemaError("emb_f32", "is not base64") from None
    if not raw or len(raw) % 4:
        raise SchemaError("emb_f32", f"holds {len(raw)} bytes, not a whole number of float32s")
    return raw


def _binary_embeddings(objs: list[Any]) -> dict[int, Embedding | SchemaError]:
    """The ``emb_f32`` embeddings of an entry's samples, by index: decoded and checked for
    finiteness all at once (one array for the entry, a row for each sample)."""
    raws: dict[int, bytes] = {}
    out: dict[int, Embedding | SchemaError] = {}
    for i, obj in enumerate(objs):
        if isinstance(obj, dict) and "emb_f32" in obj:
            try:
                raws[i] = _f32_bytes(obj["emb_f32"])
            except SchemaError as exc:
                out[i] = exc
    if not raws:
        return out
    width = len(next(iter(raws.values())))
    if all(len(r) == width for r in raws.values()):
        rows = np.frombuffer(b"".join(raws.values()), dtype="<f4").reshape(len(raws), -1)
        finite = np.isfinite(rows).all(axis=1).tolist()
        for k, (i, ok) in enumerate(zip(raws, finite, strict=True)):
            out[i] = rows[k] if ok else SchemaError("emb_f32", "must hold finite numbers")
        return out
    for i, raw in raws.items():  # embeddings of several widths in one entry: one by one
        row = np.frombuffer(raw, dtype="<f4")
        finite = bool(np.isfinite(row).all())
        out[i] = row if finite else SchemaError("emb_f32", "must hold finite numbers")
    return out


def decode_samples(fields: Mapping[Any, Any]) -> list[DecodedSample | SchemaError]:
    """Decode a sample entry. A broken entry raises; a broken sample inside a good entry is
    returned as its SchemaError in place, so one bad sample does not cost its neighbours."""
    objs = _sample_objects(fields)
    return _decoded(objs, _binary_embeddings(objs), 0)


def decode_sample_batch(
    entries: Sequence[Mapping[Any, Any]],
) -> list[list[DecodedSample | SchemaError] | Exception]:
    """``decode_samples`` of each entry, with the exception in place of an entry that does
    not decode; the binary embeddings of the whole batch are decoded and checked together
    (one array for them all, instead of one per entry: the service reads hundreds of
    entries per call)."""
    objs: list[list[Any] | Exception] = []
    flat: list[Any] = []
    for fields in entries:
        try:
            got = _sample_objects(fields)
        except Exception as exc:  # any undecodable entry, not only the foreseen ones
            objs.append(exc)
            continue
        objs.append(got)
        flat.extend(got)
    try:
        binary = _binary_embeddings(flat)
    except Exception:  # not foreseen: each entry on its own, so only its own entry fails
        return [_decode_or_error(fields) for fields in entries]
    out: list[list[DecodedSample | SchemaError] | Exception] = []
    base = 0
    for entry in objs:
        if isinstance(entry, Exception):
            out.append(entry)
            continue
        try:
            out.append(_decoded(entry, binary, base))
        except Exception as exc:
            out.append(exc)
        base += len(entry)
    return out


def _decode_or_error(fields: Mapping[Any, Any]) -> list[DecodedSample | SchemaError] | Exception:
    try:
        return decode_samples(fields)
    except Exception as exc:
        return exc


def _sample_objects(fields: Mapping[Any, Any]) -> list[Any]:
    objs = _json_field(fields, "samples")
    if not isinstance(objs, list):
        raise SchemaError("samples", "must be a JSON list of sample objects")
    return objs


def _decoded(
    objs: list[Any], binary: dict[int, Embedding | SchemaError], base: int
) -> list[DecodedSample | SchemaError]:
    """An entry's samples; its binary embeddings are ``binary``'s from index ``base`` on."""
    out: list[DecodedSample | SchemaError] = []
    for i, obj in enumerate(objs):
        try:
            if not isinstance(obj, dict):
                raise SchemaError("", f"must be an object, got {type(obj).__name__}")
            emb: Embedding | None
            emb_v: int | None
            got = binary.get(base + i)
            if got is None:
                emb, emb_v = _json_embedding(obj)
            elif isinstance(got, SchemaError):
                raise got
            else:
                emb, emb_v = got, _emb_version(obj)
            out.append(DecodedSample(parse_sample(obj), emb, emb_v))
        except SchemaError as exc:
            out.append(SchemaError(f"samples[{i}].{exc.field}".rstrip("."), exc.message))
    return out


def decode_event(fields: dict[Any, Any]) -> Event:
    obj = _json_field(fields, "event")
    if not isinstance(obj, dict):
        raise SchemaError("event", "must be a JSON object")
    return parse_event(obj)


_SECRET_QUERY = re.compile(r"pass|secret|token|key|auth|sig|credential", re.IGNORECASE)
_USERINFO = re.compile(r"//[^/?#@]*@")
MASK = "***"


def redact_url(url: str) -> str:
    """``url`` fit for a log line: the password masked (``redis://user:***@host``), a user name
    standing alone masked too (``https://***@host``: often a token), and query parameters that
    look secret (``password``, ``token``, ``key``, ...) masked. Works for redis://, rediss://,
    unix:// and http(s):// URLs; a string it cannot parse has anything between ``//`` and
    ``@`` masked."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if "@" in netloc:
            userinfo, host = netloc.rsplit("@", 1)
            user, sep, _ = userinfo.partition(":")
            netloc = f"{user}:{MASK}@{host}" if sep else f"{MASK}@{host}"
        query = parts.query
        if query:
            pairs = parse_qsl(query, keep_blank_values=True)
            if any(_SECRET_QUERY.search(k) for k, _ in pairs):
                query = "&".join(
                    f"{quote(k)}={MASK if _SECRET_QUERY.search(k) else quote(v)}" for k, v in pairs
                )
        return urlunsplit(parts._replace(netloc=netloc, query=query))
    except ValueError:  # e.g. a malformed IPv6 host
        return _USERINFO.sub(f"//{MASK}@", url)


_T = TypeVar("_T")


def answer(reply: Awaitable[_T] | _T) -> _T:
    """A sync client's reply: redis-py 5-7 type each command as either, for both clients."""
    return cast(_T, reply)


def answer_async(reply: Awaitable[_T] | _T) -> Awaitable[_T]:
    """An asyncio client's reply, to await (see ``answer``)."""
    return cast(Awaitable[_T], reply)
