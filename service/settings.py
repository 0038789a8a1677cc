"""Configuration, read from ``OOMCAST_*`` environment variables (or passed in): the one
place service code reads the environment (the Redis layout alone is ``model/wire.py``'s).

``Settings`` configures ``oomcast serve`` (and the demo's service); ``CommandEnv`` holds
what the other subcommands take from the environment as their flags' defaults (the node
agent's, the log level). Each is read once, when the command starts.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from urllib.parse import urlparse

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from oomcast.model.forecast import HORIZONS_S
from oomcast.model.wire import DEFAULT_KEY_PREFIX, DEFAULT_PARTITIONS, DEFAULT_REDIS_URL


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
    # Which partitions this replica reads, e.g. "0-1" or "0,2"; empty means all. Replicas
    # that split the work own disjoint sets covering 0..partitions-1.
    partitions_owned: str = ""
    consumer_group: str = "oomcast-service"
    consumer_name: str = Field(default_factory=_default_consumer)
    claim_idle_ms: int = Field(
        default=30_000, ge=100, description="reclaim other consumers' entries idle this long"
    )
    read_count: int = Field(default=500, ge=1)
    stream_maxlen: int = Field(default=100_000, ge=1000)
    alerts_maxlen: int = Field(default=10_000, ge=100)

    # "model" (the ONNX LSTM) or the name of a baseline (see `oomcast evaluate`)
    forecaster: str = "model"
    model_path: str | None = None  # default: the model shipped with oomcast
    alert_horizon_s: int = 60
    alert_fire_risk: float = Field(default=0.5, gt=0, le=1)
    alert_resolve_risk: float = Field(default=0.2, ge=0, lt=1)
    alert_fire_after: int = Field(
        default=2, ge=1, description="consecutive samples above fire_risk"
    )
    alert_resolve_after: int = Field(
        default=3, ge=1, description="consecutive samples below resolve_risk"
    )

    webhook_url: str | None = None
    webhook_secret: SecretStr | None = None
    webhook_timeout_s: float = Field(default=5.0, gt=0)
    webhook_max_attempts: int = Field(default=6, ge=1)
    webhook_backoff_s: float = Field(default=0.5, gt=0)
    webhook_backoff_max_s: float = Field(default=30.0, gt=0)
    webhook_queue: int = Field(default=1000, ge=1)

    alertmanager_url: str | None = None  # e.g. http://alertmanager:9093
    alertmanager_resend_s: float = Field(default=60.0, gt=0)

    # Rules (service/default_rules.yaml when unset) and the key that signs node commands.
    rules: str | None = None
    control_secret: SecretStr | None = None
    control_ttl_s: float = Field(default=30.0, gt=0, le=600)

    api_token: SecretStr | None = None
    history_len: int = Field(
        default=600, ge=10, description="samples kept per domain for /v1/devices"
    )
    live_after_s: float = Field(
        default=600.0, gt=0, description="a domain silent this long is dropped"
    )
    max_predict_samples: int = Field(default=10_000, ge=1)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, v: str) -> str:
        if urlparse(v).scheme not in ("redis", "rediss", "unix"):
            raise ValueError(
                f"OOMCAST_REDIS_URL must be a redis://, rediss:// or unix:// URL: {v!r}"
            )
        return v

    @field_validator("webhook_url")
    @classmethod
    def _webhook_url(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if urlparse(v).scheme not in ("http", "https") or not urlparse(v).netloc:
            raise ValueError(f"OOMCAST_WEBHOOK_URL must be an http(s) URL: {v!r}")
        return v

    @field_validator("alertmanager_url")
    @classmethod
    def _alertmanager_url(cls, v: str | None) -> str | None:
        if v in (None, ""):
            return None
        if urlparse(v).scheme not in ("http", "https") or not urlparse(v).netloc:
            raise ValueError(f"OOMCAST_ALERTMANAGER_URL must be an http(s) URL: {v!r}")
        return v.rstrip("/")

    def rules_path(self) -> str:
        from oomcast.service.rulefile import DEFAULT_RULES

        return self.rules or str(DEFAULT_RULES)

    def owned_partitions(self) -> list[int]:
        if not self.partitions_owned.strip():
            return list(range(self.partitions))
        return parse_partition_set(self.partitions_owned, self.partitions)

    @field_validator("alert_horizon_s")
    @classmethod
    def _horizon(cls, v: int) -> int:
        if v not in HORIZONS_S:
            raise ValueError(f"OOMCAST_ALERT_HORIZON_S must be one of {HORIZONS_S}, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> Settings:
        if self.webhook_url and not self.webhook_secret:
            raise ValueError(
                "OOMCAST_WEBHOOK_URL is set but OOMCAST_WEBHOOK_SECRET is not: receivers could"
                " not tell our alerts from forged ones; set a secret"
            )
        self.owned_partitions()  # refuses a bad OOMCAST_PARTITIONS_OWNED at start-up
        from oomcast.service.rulefile import check_rules_file

        check_rules_file(self.rules_path())  # refuses a bad rule at start-up, naming it
        if self.alert_resolve_risk >= self.alert_fire_risk:
            raise ValueError(
                f"OOMCAST_ALERT_RESOLVE_RISK ({self.alert_resolve_risk}) must be below"
                f" OOMCAST_ALERT_FIRE_RISK ({self.alert_fire_risk}), or alerts would flap"
            )
        return self


class CommandEnv(BaseSettings):
    """What the subcommands other than ``serve`` take from ``OOMCAST_*`` (flag defaults).
    It checks nothing of the service's own settings: an agent starts whatever the service's
    rule file says."""

    model_config = SettingsConfigDict(env_prefix="OOMCAST_", extra="ignore", env_ignore_empty=True)

    log_level: str = "info"
    redis_url: str | None = None  # None: not configured (the demo then looks for one)
    stream_maxlen: int = Field(default=100_000, ge=1)
    agent_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    control_secret: SecretStr | None = None  # verifies the service's commands on the agent
    cgroup_root: str | None = None
    proc_root: str = "/proc"
    node: str | None = None


def child_env(overrides: Mapping[str, str]) -> dict[str, str]:
    """This process's environment with ``overrides``: for the processes the demo starts."""
    return {**os.environ, **overrides}
