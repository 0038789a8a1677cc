"""Configuration, read from ``OOMCAST_*`` environment variables (or passed in): the one
place service code reads the environment (the Redis layout alone is ``model/wire.py``'s).

``Settings`` configures ``oomcast serve`` (and the demo's service); ``cli/env.py``'s
``CommandEnv`` holds what the other subcommands take from the environment as their flags'
defaults (the node agent's, the log level). Each is read once, when the command starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlparse

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from oomcast.model.cluster import cluster_url_problem
from oomcast.model.forecast import HORIZONS_S
from oomcast.model.wire import (
    DEFAULT_KEY_PREFIX,
    DEFAULT_PARTITIONS,
    DEFAULT_REDIS_URL,
    redact_url,
)
from oomcast.service.pipeline.rules import RESOLVE_AFTER_S


def _default_consumer() -> str:
    # Stable across restarts of one replica (a StatefulSet pod keeps its hostname), so a
    # restarted service finds its own unacknowledged entries first.
    return os.environ.get("HOSTNAME") or socket.gethostname()


def parse_partition_set(text: str, partitions: int) -> list[int]:
    """ "0-3,6" -> [0, 1, 2, 3, 6], each within 0..partitions-1."""
    owned: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi or lo)
        except ValueError:
            raise ValueError(
                f"OOMCAST_PARTITIONS_OWNED={text!r}: {part.strip()!r} is not a number or range"
            ) from None
        if not 0 <= first <= last < partitions:
            raise ValueError(
                f"OOMCAST_PARTITIONS_OWNED={text!r}: {part.strip()!r} is outside"
                f" 0..{partitions - 1} (OOMCAST_PARTITIONS={partitions})"
            )
        owned.update(range(first, last + 1))
    return sorted(owned)


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="OOMCAST_", extra="ignore")

    redis_url: str = DEFAULT_REDIS_URL
    key_prefix: str = DEFAULT_KEY_PREFIX
    partitions: int = Field(default=DEFAULT_PARTITIONS, ge=1, le=1024)
    # Which partitions this replica reads, e.g. "0-1" or "0,2", fixed (a StatefulSet that
    # pins them: no leases). Empty: replicas share the partitions by leases in Redis
    # (service/cluster/leases.py), a fair share each, taken over when a replica dies.
    partitions_owned: str = ""
    # A lease lives this long unrenewed (renewed every third of it): a dead replica's
    # partitions are taken over within lease_ttl_s plus one renewal (~13 s by default).
    lease_ttl_s: float = Field(default=10.0, ge=1.0, le=300.0)
    # Worker processes of one `oomcast serve` (service/cluster/workers.py): one per core to use.
    # "auto": one per core this process may use (service/cluster/workers.py, available_cpus).
    workers: str = "1"
    # A domain's state is snapshotted to Redis with every batch that alerts on it, and at
    # least this often otherwise: how far a new owner's forecaster state may lag.
    snapshot_every_s: float = Field(default=5.0, gt=0, le=3600.0)
    snapshot_history: int = Field(
        default=32, ge=0, le=10_000, description="history points kept in a domain's snapshot"
    )
    consumer_group: str = "oomcast-service"
    consumer_name: str = Field(default_factory=_default_consumer)
    claim_idle_ms: int = Field(
        default=30_000, ge=100, description="reclaim other consumers' entries idle this long"
    )
    read_count: int = Field(default=500, ge=1)
    stream_maxlen: int = Field(default=100_000, ge=1000)
    alerts_maxlen: int = Field(default=10_000, ge=100)
    # The fleet's scorecard (service/scorecard.py): each alert's and each OOM's outcome is
    # kept in Redis this long (and at most outcomes_maxlen of them); off: none is decided.
    outcomes: bool = True
    outcomes_retention_s: float = Field(default=30 * 86400.0, ge=3600.0)
    outcomes_maxlen: int = Field(default=500_000, ge=1000)
    # Traces kept for missed OOMs, false alarms and near misses (service/kept.py): at most
    # kept_traces of them (0: none kept), each for kept_retention_s, each holding
    # kept_window_s of samples before the OOM or the alert.
    kept_traces: int = Field(default=1000, ge=0, le=100_000)
    kept_retention_s: float = Field(default=14 * 86400.0, ge=3600.0)
    kept_window_s: float = Field(default=600.0, ge=30.0, le=3600.0)

    # "model" (the ONNX LSTM) or the name of a baseline (see `oomcast evaluate`)
    forecaster: str = "model"
    model_path: str | None = None  # default: the model shipped with oomcast
    # A challenger scored beside the model that acts, on the same samples, acting on nothing
    # (docs/scorecard.md): an ONNX model's path, or a baseline's name (`oomcast evaluate`).
    shadow_model_path: str | None = None
    alert_horizon_s: int = 60
    alert_fire_risk: float = Field(default=0.5, gt=0, le=1)
    alert_resolve_risk: float = Field(default=0.2, ge=0, lt=1)
    alert_fire_after: int = Field(
        default=2, ge=1, description="consecutive samples above fire_risk"
    )
    alert_resolve_after: int = Field(
        default=3, ge=1, description="consecutive samples below resolve_risk"
    )
    alert_resolve_after_s: float = Field(
        default=RESOLVE_AFTER_S,
        ge=0,
        le=86400,
        description="and the calm lasting at least this many seconds (by the samples' times)",
    )

    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    # Webhook and Alertmanager deliveries (the durable outbox, service/delivery/outbox.py): retried
    # with capped exponential backoff, across restarts, until delivery_max_age_s.
    delivery_timeout_s: float = Field(
        default=5.0, gt=0, description="one attempt's deadline: connect, send and the answer"
    )
    delivery_backoff_s: float = Field(default=0.5, gt=0, description="first retry's delay")
    delivery_backoff_max_s: float = Field(default=30.0, gt=0)
    delivery_max_age_s: float = Field(
        default=86_400.0, gt=0, description="a delivery still failing this long is given up"
    )
    delivery_degraded_after_s: float = Field(
        default=60.0, gt=0, description="/readyz says degraded once one is owed this long"
    )
    delivery_claim_s: float = Field(
        default=30.0, gt=0, description="a worker that died holding a delivery frees it then"
    )
    delivery_poll_s: float = Field(default=0.5, gt=0, description="how often retries are due")
    delivery_concurrency: int = Field(
        default=32, ge=1, description="attempts in flight at once, per target"
    )

    alertmanager_url: str | None = None  # e.g. http://alertmanager:9093
    alertmanager_resend_s: float = Field(default=60.0, gt=0)

    # Rules (service/pipeline/default_rules.yaml when unset) and the key that signs node commands.
    rules: str | None = None
    control_secret: SecretStr | None = None
    control_ttl_s: float = Field(default=30.0, gt=0, le=600)

    api_token: SecretStr | None = None
    # The largest request body the service reads (8 MiB: about 40,000 samples); a longer
    # one is refused with 413 before or while it arrives, never buffered whole.
    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1)
    history_len: int = Field(
        default=600, ge=10, description="samples kept per domain for /v1/devices"
    )
    live_after_s: float = Field(
        default=600.0, gt=0, description="a domain silent this long is dropped"
    )
    max_predict_samples: int = Field(default=10_000, ge=1)
    # A sample whose ts is further than this from when it reached Redis (the entry id's
    # time) is dead-lettered (reason ts_skew): one sample stamped 1e300 must not make every
    # later sample of its domain look out of order. 0 turns the check off (replaying old
    # traces through `oomcast collect --source replay --keep-ts`).
    max_ts_skew_s: float = Field(default=300.0, ge=0)
    # A node's samples that arrive behind its domain's newest one this many times in a row,
    # in time order among themselves, mean the clock moved back (or the newest was bogus):
    # the domain starts a new history instead of staying blind.
    resync_after: int = Field(default=3, ge=1)
    # Node actions (checkpoint, shed) need every sample of the domain for this long to be
    # attested (signed with the domain's own node key); samples over HTTP never are.
    attest_window_s: float = Field(default=600.0, ge=0)
    # Caps on the live domains one replica holds (each ~28 KB, docs/scaling.md): a new
    # domain past them is dead-lettered (domain_cap) and counted; held ones go on.
    max_domains: int = Field(
        default=50_000, ge=1, description="live domains one replica holds at most (~1.4 GB)"
    )
    max_domains_per_node: int = Field(
        default=512, ge=1, description="live domains of one node at most (GPUs and cgroups)"
    )
    # /metrics exports per-domain series (risk per horizon, time to OOM, use) for this many
    # live domains, the riskiest first; the rest are counted, so a 50,000-domain fleet does
    # not put 300,000 series on every scrape (0: none)
    metrics_domains: int = Field(
        default=1000, ge=0, description="live domains /metrics gives series of, riskiest first"
    )
    # OOMCAST_REDIS_URL names one node of a Redis Cluster (any node: the client learns the
    # others from it); every process of the deployment, agents included, must say so too.
    redis_cluster: bool = False

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        if urlparse(v).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"OOMCAST_REDIS_URL must be a redis://, rediss:// or unix:// URL: {redact_url(v)!r}"
            )
        return v

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if urlparse(v).scheme not in ("http", "https") or not urlparse(v).netloc:
            raise ValueError(f"OOMCAST_WEBHOOK_URL must be an http(s) URL: {redact_url(v)!r}")
        return v

    @field_validator("alertmanager_url")
    @classmethod
    def _alertmanager_url(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if urlparse(v).scheme not in ("http", "https") or not urlparse(v).netloc:
            raise ValueError(f"OOMCAST_ALERTMANAGER_URL must be an http(s) URL: {redact_url(v)!r}")
        return v.rstrip("/")

    def rules_path(self) -> str:
        from oomcast.service.pipeline.rulefile import DEFAULT_RULES

        return self.rules or str(DEFAULT_RULES)

    def uses_leases(self) -> bool:
        """Whether partitions are leased (no OOMCAST_PARTITIONS_OWNED) rather than fixed."""
        return not self.partitions_owned.strip()

    def owned_partitions(self) -> list[int]:
        if not self.partitions_owned.strip():
            return list(range(self.partitions))
        return parse_partition_set(self.partitions_owned, self.partitions)

    @field_validator("model_path")
    @classmethod
    def _model_path(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if not Path(v).is_file():
            raise ValueError(
                f"OOMCAST_MODEL_PATH={v}: no such file (unset it to use the shipped model)"
            )
        return v

    @field_validator("alert_horizon_s")
    @classmethod
    def _horizon(cls, v: int) -> int:
        if v not in HORIZONS_S:
            raise ValueError(f"OOMCAST_ALERT_HORIZON_S must be one of {HORIZONS_S}, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.delivery_claim_s <= self.delivery_timeout_s:
            raise ValueError(
                f"OOMCAST_DELIVERY_CLAIM_S ({self.delivery_claim_s}) must exceed"
                f" OOMCAST_DELIVERY_TIMEOUT_S ({self.delivery_timeout_s}), or a slow receiver"
                " could get one delivery from two replicas at once"
            )
        if self.delivery_backoff_max_s < self.delivery_backoff_s:
            raise ValueError(
                f"OOMCAST_DELIVERY_BACKOFF_MAX_S ({self.delivery_backoff_max_s}) must be at least"
                f" OOMCAST_DELIVERY_BACKOFF_S ({self.delivery_backoff_s})"
            )
        if self.webhook_url and not self.webhook_secret:
            raise ValueError(
                "OOMCAST_WEBHOOK_URL is set but OOMCAST_WEBHOOK_SECRET is not: receivers could"
                " not tell our alerts from forged ones; set a secret"
            )
        self.owned_partitions()  # refuses a bad OOMCAST_PARTITIONS_OWNED at start-up
        from oomcast.service.pipeline.rulefile import check_rules_file

        check_rules_file(self.rules_path())  # refuses a bad rule at start-up, naming it
        if self.alert_resolve_risk >= self.alert_fire_risk:
            raise ValueError(
                f"OOMCAST_ALERT_RESOLVE_RISK ({self.alert_resolve_risk}) must be below"
                f" OOMCAST_ALERT_FIRE_RISK ({self.alert_fire_risk}), or alerts would flap"
            )
        return self

    @model_validator(mode="after")
    def _cluster_url(self) -> Settings:
        problem = cluster_url_problem(self.redis_url) if self.redis_cluster else None
        if problem:
            raise ValueError(problem)
        return self


def child_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with ``overrides``: for the processes the demo starts."""
    return {**os.environ, **overrides}
