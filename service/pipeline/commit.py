"""What one batch of stream entries becomes on its way down the ingest pipeline
(``service/ingest.py``): what forecasting it gave, and what must be written before its
entries are acknowledged."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from oomcast.model.schema import Domain
from oomcast.model.wire import Keys
from oomcast.service.cluster.ownership import Snapshots
from oomcast.service.delivery.outbox import Delivery
from oomcast.service.pipeline.actions import NodeCommand
from oomcast.service.pipeline.decode import DeadLetter
from oomcast.service.pipeline.rules import Alert


@dataclass
class Evaluated:
    """What forecasting a batch and running the rules on it gave."""

    alerts: list[Alert] = field(default_factory=list)
    audit_events: list[dict[str, Any]] = field(default_factory=list)
    deadletters: list[DeadLetter] = field(default_factory=list)
    touched: list[Domain] = field(default_factory=list)  # domains whose state moved


@dataclass
class Commit:
    """What must be on record before the batch is acknowledged: audit records (alerts and
    audited events), the deliveries they owe and dead letters, then node commands."""

    records: list[Mapping[str, Any]] = field(default_factory=list)
    deadletters: list[DeadLetter] = field(default_factory=list)
    commands: list[NodeCommand] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    snapshots: Snapshots = field(default_factory=Snapshots)  # domain state for a successor

    def drop(self, keys: Keys, lost: set[int]) -> None:
        """Forget what concerns the nodes of partitions no longer ours: the new owner
        forecasts those entries again and writes their records itself."""
        if not lost:
            return

        def ours(node: object) -> bool:
            return not isinstance(node, str) or keys.partition_of(node) not in lost

        self.records = [r for r in self.records if ours(r.get("node"))]
        self.deliveries = [d for d in self.deliveries if ours(d.payload.get("node"))]
        self.commands = [c for c in self.commands if ours(_command_node(c))]


def _command_node(command: NodeCommand) -> str | None:
    try:
        node = json.loads(command.fields["cmd"]).get("node")
    except (KeyError, ValueError, AttributeError):
        return None
    return node if isinstance(node, str) else None
