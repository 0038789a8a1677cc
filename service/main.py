"""Build the FastAPI app. Heavy objects (Redis pool, forecaster, webhook client) are created
in the lifespan handler, never at import, so importing the app is cheap and side-effect free."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import signal
from collections.abc import AsyncIterator, Callable
from typing import Any, cast

import redis.asyncio as aioredis
from fastapi import FastAPI, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import SecretStr
from redis.asyncio.cluster import RedisCluster
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import compile_path

from oomcast.model.control import node_keys
from oomcast.model.wire import Keys
from oomcast.service.api.edge import EdgeMiddleware
from oomcast.service.api.routes import (
    admit,
    alerts,
    apidocs,
    dashboard,
    devices,
    health,
    model,
    predict,
    rules,
    samples,
    scorecard,
)
from oomcast.service.cluster.leases import partition_owner
from oomcast.service.cluster.snapshot import SnapshotStore, snapshot_keys
from oomcast.service.context import Deliveries, ServiceContext
from oomcast.service.delivery.alertmanager import AlertmanagerTarget
from oomcast.service.delivery.outbox import Outbox, outbox_keys
from oomcast.service.delivery.webhook import WebhookTarget
from oomcast.service.delivery.worker import DeliveryWorker, Target
from oomcast.service.ingest import Ingestor
from oomcast.service.kept import TraceKeeper, kept_keys
from oomcast.service.metrics import Metrics
from oomcast.service.model_swap import ModelSwitch, swap_keys
from oomcast.service.pipeline import forecaster
from oomcast.service.pipeline.actions import Dispatcher
from oomcast.service.pipeline.rulefile import check_rules_file, rules_from
from oomcast.service.pipeline.state import LiveState
from oomcast.service.scorecard import OutcomeStore, outcome_keys
from oomcast.service.settings import Settings

log = logging.getLogger("oomcast.service")


def _secrets(settings: Settings) -> tuple[str | None, str | None]:
    """The control and webhook secrets, as plain strings (None where unset): what the keys
    the service seals its own Redis writes with are derived from."""

    def plain(secret: SecretStr | None) -> str | None:
        return secret.get_secret_value() if secret else None

    return plain(settings.control_secret), plain(settings.webhook_secret)


def build_deliveries(
    settings: Settings, keys: Keys, client: aioredis.Redis, metrics: Metrics
) -> Deliveries:
    """The outbox, the configured targets, and the worker that delivers what is owed."""
    outbox = Outbox(
        client,
        keys,
        degraded_after_s=settings.delivery_degraded_after_s,
        seal_keys=outbox_keys(*_secrets(settings)),
    )
    webhook = None
    if settings.webhook_url and settings.webhook_secret:
        webhook = WebhookTarget(settings.webhook_url, settings.webhook_secret.get_secret_value())
    alertmanager = None
    if settings.alertmanager_url:
        alertmanager = AlertmanagerTarget(
            settings.alertmanager_url, outbox, resend_s=settings.alertmanager_resend_s
        )
    targets: dict[str, Target] = {t.name: t for t in (webhook, alertmanager) if t is not None}
    worker = None
    if targets:
        worker = DeliveryWorker(
            outbox,
            targets,
            audit_stream=keys.alerts,
            audit_maxlen=settings.alerts_maxlen,
            timeout_s=settings.delivery_timeout_s,
            backoff_s=settings.delivery_backoff_s,
            backoff_max_s=settings.delivery_backoff_max_s,
            max_age_s=settings.delivery_max_age_s,
            claim_s=settings.delivery_claim_s,
            poll_s=settings.delivery_poll_s,
            concurrency=settings.delivery_concurrency,
            on_outcome=lambda t, r: metrics.deliveries.labels(target=t, result=r).inc(),
            on_health=metrics.delivery_health,
            worker=settings.consumer_name,
        )
    return Deliveries(outbox, worker, webhook, alertmanager)


def redis_client(settings: Settings, timeout_s: float) -> aioredis.Redis:
    """The service's Redis client: one server's, or with ``OOMCAST_REDIS_CLUSTER`` a Redis
    Cluster's (seeded by the URL's node; it routes each command to the node serving its
    keys' hash slot). Typed as ``Redis``: the cluster client takes every command oomcast
    sends with the same arguments and answers it the same way, and where a command could not
    be sent to one node (a read over several partitions) ``streams_read.is_cluster`` tells."""
    if settings.redis_cluster:
        cluster = RedisCluster.from_url(
            settings.redis_url, socket_connect_timeout=2, socket_timeout=timeout_s
        )
        return cast(aioredis.Redis, cluster)
    return aioredis.from_url(
        settings.redis_url,
        socket_connect_timeout=2,
        socket_timeout=timeout_s,
        health_check_interval=30,
    )


def build_context(settings: Settings) -> ServiceContext:
    keys = Keys(settings.key_prefix, settings.partitions)
    choice = forecaster.choose(settings)
    detector = choice.detector
    policy = forecaster.alert_policy(settings, choice)
    metrics = Metrics()
    metrics.model.info(
        {"version": detector.forecaster.version, "kind": choice.kind, "provider": choice.provider}
    )
    if settings.shadow_model_path and not settings.outcomes:
        raise ValueError(
            "OOMCAST_SHADOW_MODEL_PATH is set but OOMCAST_OUTCOMES=false: a shadow model is"
            " only scored, and nothing would score it"
        )
    shadow = forecaster.choose_shadow(settings)
    if shadow is not None:
        metrics.shadow_model.info({"version": shadow.forecaster.version})
    rule_specs = check_rules_file(settings.rules_path()).rules  # kept for model swaps
    rules = rules_from(rule_specs, policy)
    log.info("rules from %s: %s", settings.rules_path(), "; ".join(r.describe() for r in rules))
    live = LiveState(
        detector.forecaster,
        rules,
        horizon_s=policy.horizon_s,
        history_len=settings.history_len,
        resync_after=settings.resync_after,
        attest_window_s=settings.attest_window_s,
        max_domains=settings.max_domains,
        max_domains_per_node=settings.max_domains_per_node,
        # the models scored on the fleet's outcomes, each by the rule it was validated with
        scored=forecaster.scored_models(settings, policy, shadow),
    )
    # With leases, no round trip may outlast the slack between a lease's local deadline
    # and its expiry in Redis plus the commit margin (service/cluster/ownership.py): 0.4 x the TTL.
    timeout_s = max(2.0, 0.4 * settings.lease_ttl_s) if settings.uses_leases() else 10.0
    client = redis_client(settings, timeout_s)
    deliveries = build_deliveries(settings, keys, client, metrics)
    outcome_store = (
        OutcomeStore(
            client,
            keys.prefix,
            seal_keys=outcome_keys(*_secrets(settings)),
            maxlen=settings.outcomes_maxlen,
            retention_s=settings.outcomes_retention_s,
        )
        if settings.outcomes
        else None
    )
    secret = settings.control_secret.get_secret_value() if settings.control_secret else None
    keeper = (
        TraceKeeper(
            client,
            keys,
            seal_keys=kept_keys(*_secrets(settings)),
            key_for_node=node_keys(secret) if secret else None,
            window_s=settings.kept_window_s,
            max_count=settings.kept_traces,
            retention_s=settings.kept_retention_s,
            on_result=lambda result: metrics.kept.labels(result=result).inc(),
        )
        if outcome_store is not None and settings.kept_traces > 0
        else None
    )
    dispatcher = Dispatcher(
        keys,
        rules,
        webhook=deliveries.webhook,
        alertmanager=deliveries.alertmanager,
        outbox=deliveries.outbox if deliveries.worker else None,
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
        max_skew_s=settings.max_ts_skew_s,
        # samples signed with their node's key (derived from the control secret) are attested
        key_for_node=node_keys(secret) if secret else None,
        # partition leases unless OOMCAST_PARTITIONS_OWNED fixes them; state hand-over
        owner=partition_owner(settings, client),
        snapshots=SnapshotStore(
            client,
            keys.prefix,
            seal_keys=snapshot_keys(*_secrets(settings)),
            # a restored time may lie as far ahead as a sample's ts may, and a minute more
            max_future_s=settings.max_ts_skew_s + 60.0 if settings.max_ts_skew_s else math.inf,
        ),
        snapshot_every_s=settings.snapshot_every_s,
        snapshot_history=settings.snapshot_history,
        dispatcher=dispatcher,
        outcomes=outcome_store,
        keeper=keeper,
    )
    if deliveries.alertmanager is not None:
        ingestor.ownership.keep_alive_in(deliveries.alertmanager)
    ctx = ServiceContext(
        settings,
        keys,
        client,
        detector,
        live,
        metrics,
        ingestor,
        deliveries,
        forecaster_kind=choice.kind,
        forecaster_reason=choice.reason,
        provider=choice.provider,
        rules=rules,
        dispatcher=dispatcher,
        outcomes=outcome_store,
    )
    ctx.switch = ingestor.switch = ModelSwitch(
        ctx,
        source=settings.model_path or _shipped_or_named(settings, choice),
        shadow=shadow,
        shadow_source=settings.shadow_model_path,
        seal_keys=swap_keys(*_secrets(settings)),
        rule_specs=rule_specs,
    )
    return ctx


def _shipped_or_named(settings: Settings, choice: forecaster.Choice) -> str:
    """Where the champion came from when no OOMCAST_MODEL_PATH names it."""
    if choice.kind == "model":
        from oomcast.model.runtime import DEFAULT_MODEL

        return str(DEFAULT_MODEL)
    return str(choice.detector.forecaster.version)  # a baseline, by its version


def _reload_on_sighup(ctx: ServiceContext) -> Callable[[], None]:
    """SIGHUP reloads the model file (service/model_swap.py); returns what undoes that.
    Where signals cannot be handled here (not the main thread: an app run by a test
    client), nothing is installed."""
    switch = ctx.switch
    running: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()

    def on_hup() -> None:
        if switch is not None:
            task = loop.create_task(switch.reload_configured(), name="sighup-reload")
            running.add(task)
            task.add_done_callback(running.discard)

    try:
        loop.add_signal_handler(signal.SIGHUP, on_hup)
    except (NotImplementedError, RuntimeError, ValueError):
        return lambda: None

    def undo() -> None:
        loop.remove_signal_handler(signal.SIGHUP)

    return undo


def _allowed(spec: dict[str, Any], path: str) -> list[str]:
    """The methods the OpenAPI document lists for the route ``path`` falls under."""
    for template, operations in spec.get("paths", {}).items():
        regex, _, _ = compile_path(template)
        if regex.match(path):
            return sorted(m.upper() for m in operations if m.upper() in HTTP_METHODS)
    return []


HTTP_METHODS = {"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"}


def create_app(settings: Settings | None = None) -> FastAPI:
    settings = settings or Settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        ctx = build_context(settings)
        app.state.ctx = ctx
        await ctx.deliveries.start()
        ctx.tasks.append(asyncio.create_task(ctx.ingestor.run(), name="ingest"))  # tasks[0]
        if ctx.ingestor.keeper is not None:
            ctx.tasks.append(asyncio.create_task(ctx.ingestor.keeper.run(), name="keep-traces"))
        hup = _reload_on_sighup(ctx)
        try:
            yield
        finally:
            hup()
            await ctx.ingestor.stop(ctx.tasks[0])
            if ctx.ingestor.keeper is not None:
                await ctx.ingestor.keeper.stop(ctx.tasks[1])
            await ctx.deliveries.stop()  # what is still owed stays owed, in Redis
            await ctx.redis.aclose()

    app = FastAPI(
        title="oomcast",
        version="0.1.0",
        summary="Forecasts out-of-memory failures of GPU training jobs before they happen.",
        lifespan=lifespan,
        docs_url=None,  # Swagger UI from a CDN: blank offline; routes/apidocs.py serves /docs
        redoc_url=None,
    )

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors: list[dict[str, Any]] = [
            {"loc": list(e.get("loc", ())), "msg": str(e.get("msg")), "type": str(e.get("type"))}
            for e in exc.errors()
        ]
        return JSONResponse(status_code=422, content={"detail": errors})

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 405:  # Starlette's Allow names one route's methods, not the path's
            methods = _allowed(request.app.openapi(), request.url.path)
            if methods:
                exc.headers = {**(exc.headers or {}), "Allow": ", ".join(methods)}
        return await http_exception_handler(request, exc)

    # Outside routing: the token and the body limit are enforced before a body is read.
    token = settings.api_token.get_secret_value() if settings.api_token else None
    app.add_middleware(EdgeMiddleware, max_body_bytes=settings.max_body_bytes, api_token=token)

    for module in (predict, samples, devices, alerts, rules, admit, scorecard, model):
        app.include_router(module.router, prefix="/v1")
    app.include_router(health.router)
    app.include_router(apidocs.router)
    app.include_router(dashboard.router)  # / and /static: the web dashboard
    return app
