"""Everything a request handler or the ingest loop needs, built once per app."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis

from oomcast.model.forecast import Detector
from oomcast.model.wire import Keys
from oomcast.service.delivery.alertmanager import AlertmanagerTarget
from oomcast.service.delivery.outbox import Outbox
from oomcast.service.delivery.webhook import WebhookTarget
from oomcast.service.delivery.worker import DeliveryWorker
from oomcast.service.ingest import Ingestor
from oomcast.service.metrics import Metrics
from oomcast.service.pipeline.actions import Dispatcher
from oomcast.service.pipeline.rules import Rule
from oomcast.service.pipeline.state import LiveState
from oomcast.service.scorecard import OutcomeStore
from oomcast.service.settings import Settings

if TYPE_CHECKING:
    from oomcast.service.model_swap import ModelSwitch

HEALTH_TIMEOUT_S = 1.0


@dataclass
class Deliveries:
    """The outbox and what works it: the worker (None when no receiver is configured) and
    the targets."""

    outbox: Outbox
    worker: DeliveryWorker | None = None
    webhook: WebhookTarget | None = None
    alertmanager: AlertmanagerTarget | None = None

    async def start(self) -> None:
        if self.worker is not None:
            await self.worker.start()
        if self.alertmanager is not None:
            await self.alertmanager.start()

    async def stop(self) -> None:
        """Stop re-sends and the worker; what is owed stays owed, for the next one."""
        if self.alertmanager is not None:
            await self.alertmanager.stop()
        if self.worker is not None:
            await self.worker.stop()

    async def health(self) -> dict[str, Any]:
        """For ``/readyz``: how deliveries stand. Degraded deliveries do not make the service
        unready (ingest goes on, and what is owed stays owed), so this never turns 503."""
        if self.worker is None:
            return {"status": "not_configured", "affects_readiness": False}
        try:
            health = await asyncio.wait_for(self.outbox.health(time.time()), HEALTH_TIMEOUT_S)
        except Exception as exc:  # Redis down: readiness says so on its own
            return {
                "status": "unknown",
                "problem": f"{type(exc).__name__}: {exc}"[:200],
                "affects_readiness": False,
            }
        out = health.to_dict()
        out["affects_readiness"] = False
        if health.degraded:
            out["problem"] = (
                f"a delivery has been owed for more than {health.degraded_after_s:g} s;"
                " alerts are late (see targets.*.last_error); the service still ingests and"
                " keeps retrying"
            )
        return out


@dataclass
class ServiceContext:
    settings: Settings
    keys: Keys
    redis: aioredis.Redis
    detector: Detector
    live: LiveState
    metrics: Metrics
    ingestor: Ingestor
    deliveries: Deliveries
    rules: list[Rule] = field(default_factory=list)
    dispatcher: Dispatcher | None = None
    outcomes: OutcomeStore | None = None  # the scorecard's store (service/scorecard.py)
    forecaster_kind: str = "baseline"  # "model", "baseline" or "fallback"
    forecaster_reason: str = ""
    provider: str = "python"
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    switch: ModelSwitch | None = None  # swaps the model without a restart (model_swap.py)
