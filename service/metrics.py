"""Prometheus metrics of one service instance (own registry, so tests can run several)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from oomcast.model.forecast import Forecast
from oomcast.service.delivery.outbox import Health

# A live domain's labels on its series. The training job is `job_name`: Prometheus gives
# every scraped series the scrape job as `job`, and would rename a `job` of ours to
# `exported_job`; for the same reason the service's scrape sets no `node` target label.
DOMAIN_LABELS = ("node", "device", "kind", "job_name")


class DomainRow(NamedTuple):
    """What the per-domain gauges show of one live domain."""

    node: str
    device: str
    kind: str
    job: str | None
    forecast: Forecast
    used_frac: float


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
        self.rejected = Counter(
            "oomcast_samples_rejected_total",
            "Samples (or whole entries) refused and dead-lettered, by reason",
            ["reason"],
            registry=r,
        )
        self.partitions_owned = Gauge(
            "oomcast_partitions_owned", "Sample-stream partitions this replica reads", registry=r
        )
        self.clock_resets = Counter(
            "oomcast_domain_clock_resets_total",
            "Domains that started a new history after samples kept arriving behind the newest",
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
        # The scorecard as counters (service/pipeline/outcomes.py): each outcome counted once,
        # by the replica that put it on record. Recall at 30 s over a week:
        #   sum(increase(oomcast_outcomes_total{outcome="oom",warned="30s"}[7d]))
        #   / sum(increase(oomcast_outcomes_total{outcome="oom"}[7d]))
        self.outcomes = Counter(
            "oomcast_outcomes_total",
            "Outcomes of alerts and OOMs, per scored model (role, model_version): outcome is"
            " oom, near_miss, false_alarm or censored; an OOM's oom_class and warned"
            " (30s, 10s, late, no)",
            ["role", "model_version", "outcome", "oom_class", "warned", "kind"],
            registry=r,
        )
        self.watched = Counter(
            "oomcast_watched_job_seconds_total",
            "Seconds of jobs watched, per scored model: false alarms per 1,000 job-hours is"
            " 3.6e6 x false alarms / this",
            ["role", "model_version", "kind"],
            registry=r,
        )
        # Traces kept for missed OOMs, false alarms and near misses (service/kept.py).
        self.kept = Counter(
            "oomcast_kept_traces_total",
            "Keep requests served: kept, repeat (kept already), empty (the stream no longer"
            " held the samples), unsigned (only samples their node did not sign), stale"
            " (over an hour old), forged (bad seal), malformed, failed (Redis)",
            ["result"],
            registry=r,
        )
        # Deliveries to receivers (service/delivery/worker.py). result: delivered, retry (an attempt
        # failed and will be retried), refused, expired; for Alertmanager re-sends, resent
        # and resend_expired; forged: an item in the outbox the service did not stage (its
        # seal failed), removed unsent.
        self.deliveries = Counter(
            "oomcast_deliveries_total",
            "Webhook and Alertmanager delivery outcomes",
            ["target", "result"],
            registry=r,
        )
        # Snapshots a replica would not restore because their seal failed (written into
        # Redis by someone other than the service): reason forged.
        self.snapshots_refused = Counter(
            "oomcast_snapshots_refused_total",
            "Domain snapshots not restored because their seal did not verify",
            ["reason"],
            registry=r,
        )
        self.deliveries_owed = Gauge(
            "oomcast_deliveries_owed",
            "Deliveries in the outbox, not yet delivered or given up",
            ["target"],
            registry=r,
        )
        self.deliveries_oldest = Gauge(
            "oomcast_deliveries_oldest_owed_seconds",
            "Age of the oldest delivery still owed (0 when none is)",
            ["target"],
            registry=r,
        )
        self.deliveries_overdue = Gauge(
            "oomcast_deliveries_overdue",
            "Deliveries owed for longer than OOMCAST_DELIVERY_DEGRADED_AFTER_S",
            ["target"],
            registry=r,
        )
        self.deliveries_failing = Gauge(
            "oomcast_deliveries_failing",
            "Owed deliveries whose last attempt failed",
            ["target"],
            registry=r,
        )
        self.deliveries_degraded = Gauge(
            "oomcast_deliveries_degraded",
            "1 while some delivery has been owed longer than OOMCAST_DELIVERY_DEGRADED_AFTER_S",
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
        self.domains_held = Gauge(
            "oomcast_domains_held",
            "Memory domains this replica holds state for, live or silent until they expire:"
            " what OOMCAST_MAX_DOMAINS caps",
            registry=r,
        )
        # Set at each scrape from the live state (not per sample): how the fleet stands now.
        self.domains_by_risk = Gauge(
            "oomcast_domains_by_risk",
            "Live domains by their risk at the alert horizon (band: low < 0.2 <= elevated"
            " < 0.5 <= high < 0.8 <= critical)",
            ["band"],
            registry=r,
        )
        self.alerts_firing = Gauge(
            "oomcast_alerts_firing", "Live domains with at least one rule firing now", registry=r
        )
        # One series per live domain, riskiest first up to OOMCAST_METRICS_DOMAINS, set at
        # each scrape and cleared before it (a domain that went away leaves no stale series)
        self.domain_risk = Gauge(
            "oomcast_domain_oom_risk",
            "Forecast probability that the domain runs out of memory within the horizon (seconds)",
            [*DOMAIN_LABELS, "horizon"],
            registry=r,
        )
        self.domain_tto = Gauge(
            "oomcast_domain_time_to_oom_seconds",
            "Forecast time to the domain's OOM; no series while none is in sight",
            DOMAIN_LABELS,
            registry=r,
        )
        self.domain_used = Gauge(
            "oomcast_domain_memory_used_ratio",
            "Used memory as a share of the domain's capacity, in the sample the forecast was"
            " made from",
            DOMAIN_LABELS,
            registry=r,
        )
        self.domains_left_out = Gauge(
            "oomcast_domain_series_left_out",
            "Live domains beyond OOMCAST_METRICS_DOMAINS, the least risky, with no per-domain"
            " series",
            registry=r,
        )
        self.forecast_latency = Histogram(
            "oomcast_forecast_latency_seconds",
            "From a sample's arrival in Redis to its forecast",
            buckets=(0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
            registry=r,
        )
        self.model = Info("oomcast_model", "The forecaster in use", registry=r)
        self.shadow_model = Info(
            "oomcast_shadow_model",
            "The shadow model scored beside the forecaster, acting on nothing (empty: none)",
            registry=r,
        )
        self.model_swaps = Counter(
            "oomcast_model_swaps_total",
            "Model swaps by how they ended: swapped (asked here), followed (asked on another"
            " replica), refused (the model would not load or match), forged (a swap record"
            " whose seal failed), ignored (a record for replicas configured otherwise)",
            ["result"],
            registry=r,
        )

    def domain_forecasts(self, ranked: Sequence[DomainRow], cap: int) -> None:
        """The per-domain gauges anew from ``ranked`` (riskiest first): the first ``cap``
        get series, the rest are counted in ``oomcast_domain_series_left_out``."""
        for g in (self.domain_risk, self.domain_tto, self.domain_used):
            g.clear()
        for row in ranked[:cap]:
            labels = (row.node, row.device, row.kind, row.job or "")
            for horizon, risk in row.forecast.risk.items():
                self.domain_risk.labels(*labels, str(horizon)).set(risk)
            if row.forecast.time_to_oom_s is not None:
                self.domain_tto.labels(*labels).set(row.forecast.time_to_oom_s)
            self.domain_used.labels(*labels).set(row.used_frac)
        self.domains_left_out.set(max(0, len(ranked) - cap))

    def delivery_health(self, health: Health) -> None:
        """The delivery gauges, from the outbox's health."""
        for target, th in health.targets.items():
            self.deliveries_owed.labels(target=target).set(th.owed)
            self.deliveries_oldest.labels(target=target).set(th.oldest_owed_s or 0.0)
            self.deliveries_failing.labels(target=target).set(th.failing)
            self.deliveries_overdue.labels(target=target).set(th.overdue)
        self.deliveries_degraded.set(1 if health.degraded else 0)


def observe_many(histogram: Histogram, amount: float, count: int) -> None:
    """``histogram.observe(amount)`` ``count`` times, in one step: the samples of one stream
    entry arrived together and are forecast together, so they share one latency, and
    observing each (a lock and a bucket search apiece) was 6% of ingest. Falls back to the
    loop where the client library's internals are not the ones this was written against."""
    buckets = getattr(histogram, "_buckets", None)
    bounds = getattr(histogram, "_upper_bounds", None)
    total = getattr(histogram, "_sum", None)
    if count <= 0:
        return
    if buckets is None or bounds is None or total is None or len(buckets) != len(bounds):
        for _ in range(count):
            histogram.observe(amount)
        return
    total.inc(amount * count)
    for i, bound in enumerate(bounds):
        if amount <= bound:
            buckets[i].inc(count)
            break
