"""Small helpers for reading and writing Redis streams with redis-py, whose replies are
bytes or str depending on the client and whose type hints are loose unions."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, cast


def text(value: Any) -> str:
    """A stream id or field value as str."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


def entries_of(resp: Any) -> list[tuple[str, Mapping[Any, Any]]]:
    """The (entry id, fields) of an XREAD reply, in order, whatever stream they came from."""
    out: list[tuple[str, Mapping[Any, Any]]] = []
    for _stream, entries in resp or []:
        for entry_id, fields in entries:
            out.append((text(entry_id), fields))
    return out


def last_id(client: Any, stream: str) -> str:
    """The id of the newest entry of ``stream`` (``0-0`` when it is empty or missing)."""
    entries = client.xrevrange(stream, count=1)
    return text(entries[0][0]) if entries else "0-0"


def stream_fields(fields: Mapping[str, str]) -> dict[Any, Any]:
    """``fields`` as XADD's hints want them (they take no ``dict[str, str]``); no copy."""
    return cast("dict[Any, Any]", fields)
