"""Everything a request handler or the ingest loop needs, built once per app."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import redis.asyncio as aioredis

from oomcast.model.forecast import Detector
from oomcast.model.wire import Keys
from oomcast.service.actions import Dispatcher
from oomcast.service.alertmanager import AlertmanagerSender
from oomcast.service.ingest import Ingestor
from oomcast.service.metrics import Metrics
from oomcast.service.rules import Rule
from oomcast.service.settings import Settings
from oomcast.service.state import LiveState
from oomcast.service.webhook import WebhookSender


@dataclass
class ServiceContext:
    settings: Settings
    keys: Keys
    redis: aioredis.Redis
    detector: Detector
    live: LiveState
    metrics: Metrics
    ingestor: Ingestor
    webhooks: WebhookSender | None = None
    alertmanager: AlertmanagerSender | None = None
    rules: list[Rule] = field(default_factory=list)
    dispatcher: Dispatcher | None = None
    forecaster_kind: str = "baseline"  # "model", "baseline" or "fallback"
    forecaster_reason: str = ""
    provider: str = "python"
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
