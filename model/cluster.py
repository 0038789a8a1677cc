"""Redis Cluster: what the URL of one must look like, checked once for every process.

With ``OOMCAST_REDIS_CLUSTER`` set, ``OOMCAST_REDIS_URL`` names one node of the cluster (any
primary or replica: the client asks it for the others and for which node serves which hash
slot). A cluster has one database (0) and speaks TCP only, so a URL naming another database
or a unix socket cannot work; :func:`cluster_url_problem` says so before anything connects.

Which keys share a slot is the key layout's business (``model/wire.py``): every key of one
partition carries the hash tag ``{<p>}``, every key of the delivery outbox ``{o}``, so each
multi-key command and script of oomcast names keys of one slot.
"""

from __future__ import annotations

from urllib.parse import urlsplit


def cluster_url_problem(url: str) -> str | None:
    """Why ``url`` cannot seed a Redis Cluster client, in a sentence; None when it can."""
    parts = urlsplit(url)
    if parts.scheme not in ("redis", "rediss"):
        return (
            f"OOMCAST_REDIS_CLUSTER is set, so OOMCAST_REDIS_URL must be a redis:// or rediss://"
            f" URL of one cluster node (a cluster speaks TCP only), not {parts.scheme}://"
        )
    if not parts.hostname:
        return "OOMCAST_REDIS_CLUSTER is set, but OOMCAST_REDIS_URL names no host"
    db = parts.path.strip("/")
    if db not in ("", "0"):
        return (
            f"OOMCAST_REDIS_CLUSTER is set, but OOMCAST_REDIS_URL names database {db!r}: a Redis"
            " Cluster has database 0 only (drop the /N from the URL)"
        )
    return None
