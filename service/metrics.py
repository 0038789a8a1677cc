"""Prometheus metrics of one service instance (own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.samples = Counter("oomcast_samples_ingested_total", "Samples forecast", registry=r)
        self.entries = Counter(
            "oomcast_stream_entries_total", "Stream entries read", ["stream"], registry=r
        )
        self.deadletters = Counter(
            "oomcast_deadletters_total",
            "Entries or samples moved to the dead-letter stream",
            registry=r,
        )
        self.duplicates = Counter(
            "oomcast_duplicate_samples_total", "Samples delivered twice and skipped", registry=r
        )
        self.late = Counter(
            "oomcast_late_samples_total",
            "Samples of a job read after its OOM event, skipped",
            registry=r,
        )
        self.claimed = Counter(
            "oomcast_claimed_entries_total",
            "Pending entries re-claimed after a restart or from a dead consumer",
            registry=r,
        )
        self.events = Counter("oomcast_events_total", "Events read", ["event"], registry=r)
        self.alerts = Counter("oomcast_alerts_total", "Alerts raised", ["status"], registry=r)
        self.webhooks = Counter(
            "oomcast_webhook_deliveries_total", "Webhook delivery outcomes", ["result"], registry=r
        )
        self.alertmanager = Counter(
            "oomcast_alertmanager_deliveries_total",
            "Alertmanager delivery outcomes",
            ["result"],
            registry=r,
        )
        self.commands = Counter(
            "oomcast_node_commands_total",
            "Signed commands sent to node agents",
            ["action", "mode"],
            registry=r,
        )
        self.redis_up = Gauge(
            "oomcast_redis_up", "1 when the last Redis call succeeded", registry=r
        )
        self.domains = Gauge(
            "oomcast_domains_live", "Memory domains with a live forecast", registry=r
        )
        self.forecast_latency = Histogram(
            "oomcast_forecast_latency_seconds",
            "From a sample's arrival in Redis to its forecast",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.model = Info("oomcast_model", "The forecaster in use", registry=r)
