"""Build the FastAPI app. Heavy objects (Redis pool, forecaster, webhook client) are created
in the lifespan handler, never at import, so importing the app is cheap and side-effect free."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from oomcast.model.wire import Keys
from oomcast.service import forecaster
from oomcast.service.actions import Dispatcher
from oomcast.service.alertmanager import AlertmanagerSender
from oomcast.service.api.routes import alerts, devices, health, predict, rules, samples
from oomcast.service.context import ServiceContext
from oomcast.service.ingest import Ingestor
from oomcast.service.metrics import Metrics
from oomcast.service.rulefile import load_rules
from oomcast.service.settings import Settings
from oomcast.service.state import LiveState
from oomcast.service.webhook import WebhookSender

log = logging.getLogger("oomcast.service")


def build_context(settings: Settings) -> ServiceContext:
    keys = Keys(settings.key_prefix, settings.partitions)
    choice = forecaster.choose(settings)
    detector = choice.detector
    policy = forecaster.alert_policy(settings, choice)
    metrics = Metrics()
    metrics.model.info(
        {"version": detector.forecaster.version, "kind": choice.kind, "provider": choice.provider}
    )
    rules = load_rules(settings.rules_path(), policy)
    log.info("rules from %s: %s", settings.rules_path(), "; ".join(r.describe() for r in rules))
    live = LiveState(
        detector.forecaster, rules, horizon_s=policy.horizon_s, history_len=settings.history_len
    )
    client = aioredis.from_url(
        settings.redis_url, socket_connect_timeout=2, socket_timeout=10, health_check_interval=30
    )
    webhooks = None
    if settings.webhook_url and settings.webhook_secret:
        webhooks = WebhookSender(
            settings.webhook_url,
            settings.webhook_secret.get_secret_value(),
            timeout_s=settings.webhook_timeout_s,
            max_attempts=settings.webhook_max_attempts,
            backoff_s=settings.webhook_backoff_s,
            backoff_max_s=settings.webhook_backoff_max_s,
            queue_size=settings.webhook_queue,
            on_result=lambda result: metrics.webhooks.labels(result=result).inc(),
        )
    alertmanager = None
    if settings.alertmanager_url:
        alertmanager = AlertmanagerSender(
            settings.alertmanager_url,
            resend_s=settings.alertmanager_resend_s,
            on_result=lambda result: metrics.alertmanager.labels(result=result).inc(),
        )
    secret = settings.control_secret.get_secret_value() if settings.control_secret else None
    dispatcher = Dispatcher(
        keys,
        rules,
        webhook=webhooks,
        alertmanager=alertmanager,
        control_secret=secret,
        command_ttl_s=settings.control_ttl_s,
        on_command=lambda action, mode: metrics.commands.labels(action=action, mode=mode).inc(),
    )
    ingestor = Ingestor(
        client,
        keys,
        live,
        metrics,
        group=settings.consumer_group,
        consumer=settings.consumer_name,
        partitions=settings.owned_partitions(),
        live_after_s=settings.live_after_s,
        read_count=settings.read_count,
        claim_idle_ms=settings.claim_idle_ms,
        alerts_maxlen=settings.alerts_maxlen,
        dispatcher=dispatcher,
    )
    return ServiceContext(
        settings,
        keys,
        client,
        detector,
        live,
        metrics,
        ingestor,
        webhooks,
        forecaster_kind=choice.kind,
        forecaster_reason=choice.reason,
        provider=choice.provider,
        alertmanager=alertmanager,
        rules=rules,
        dispatcher=dispatcher,
    )


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = build_context(settings)
        app.state.ctx = ctx
        if ctx.webhooks:
            await ctx.webhooks.start()
        if ctx.alertmanager:
            await ctx.alertmanager.start()
        ctx.tasks.append(asyncio.create_task(ctx.ingestor.run(), name="ingest"))  # tasks[0]
        try:
            yield
        finally:
            await ctx.ingestor.stop(ctx.tasks[0])
            if ctx.webhooks:
                await ctx.webhooks.stop()
            if ctx.alertmanager:
                await ctx.alertmanager.stop()
            await ctx.redis.aclose()

    app = FastAPI(
        title="oomcast",
        version="0.1.0",
        summary="Forecasts out-of-memory failures of GPU training jobs before they happen.",
        lifespan=lifespan,
    )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors: list[dict[str, Any]] = [
            {"loc": list(e.get("loc", ())), "msg": e.get("msg"), "type": e.get("type")}
            for e in exc.errors()
        ]
        return JSONResponse(status_code=422, content={"detail": errors})

    for module in (predict, samples, devices, alerts, rules):
        app.include_router(module.router, prefix="/v1")
    app.include_router(health.router)
    return app
