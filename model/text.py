"""The two small conversions every reader of Redis needs: a reply (bytes or str, depending
on how the client was made) as text, and a value as compact JSON (what every stream entry,
outbox item and snapshot field holds)."""

from __future__ import annotations

import json
from typing import Any


def as_str(value: bytes | str) -> str:
    """``value`` as text: Redis replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else value


def compact_json(obj: Any) -> str:
    """``obj`` as JSON with no spaces: what oomcast writes into Redis fields."""
    return json.dumps(obj, separators=(",", ":"))
