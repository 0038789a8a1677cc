"""What the subcommands other than ``serve`` read from ``OOMCAST_*``: their flag defaults."""

from __future__ import annotations

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class CommandEnv(BaseSettings):
    """What the subcommands other than ``serve`` take from ``OOMCAST_*`` (flag defaults).
    It checks nothing of the service's own settings: an agent starts whatever the service's
    rule file says."""

    model_config = SettingsConfigDict(env_prefix="OOMCAST_", extra="ignore", env_ignore_empty=True)

    log_level: str = "info"
    redis_url: str | None = None  # None: not configured (the demo then looks for one)
    stream_maxlen: int = Field(default=100_000, ge=1)
    agent_metrics_port: int | None = Field(default=None, ge=0, le=65535)
    # The master key (the service's; `oomcast control-key` derives node keys from it). An
    # agent given it instead of its node key derives its own key, with a warning.
    control_secret: SecretStr | None = None
    # This node's own key: verifies the service's commands and signs (attests) its samples.
    node_key: SecretStr | None = None
    # Or a file holding it: the DaemonSet mounts each node's own from the host
    # (/etc/oomcast/node-key), so that no agent is handed a secret that signs for another node.
    node_key_file: str | None = None
    # How far (percentage points of capacity) the agent's own reading of a domain may fall
    # short of the used fraction a live command claims before it refuses it as unconfirmed.
    confirm_tolerance_pp: float = Field(default=5.0, ge=0, le=100)
    cgroup_root: str | None = None
    proc_root: str = "/proc"
    node: str | None = None
    # The agent's OOMCAST_REDIS_URL (or --redis-url) names a Redis Cluster node (see Settings).
    redis_cluster: bool = False
    # Where `oomcast top` finds the service's API (--url)
    url: str = "http://127.0.0.1:8000"
