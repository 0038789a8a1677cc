"""Small text helpers shared by every part: the two conversions every reader of Redis needs
(a reply, bytes or str depending on how the client was made, as text; a value as compact
JSON, what every stream entry, outbox item and snapshot field holds), and the Prometheus
text of metric families (the collector's and the service's ``/metrics``)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import Metric


def as_str(value: bytes | str) -> str:
    """``value`` as text: Redis replies are bytes unless the client decodes them."""
    return value.decode() if isinstance(value, bytes) else value


def compact_json(obj: Any) -> str:
    """``obj`` as JSON with no spaces: what oomcast writes into Redis fields."""
    return json.dumps(obj, separators=(",", ":"))


def exposition(families: Iterable[Metric]) -> bytes:
    """Prometheus text exposition (0.0.4, by ``prometheus_client``) of metric families
    already made: the collector's own figures and the service front's merge of its workers'
    both end here. ``prometheus_client`` is imported on call, so reading Redis replies needs
    nothing beyond the standard library."""
    from prometheus_client import CollectorRegistry, generate_latest

    class _Families:
        def __init__(self, made: list[Metric]) -> None:
            self.made = made

        def collect(self) -> list[Metric]:
            return self.made

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(list(families)))
    return generate_latest(registry)
