"""The node agent's own HTTP endpoint: Prometheus ``/metrics``, ``/livez`` and ``/readyz``.

The collector image carries no web framework (it must stay small and safe to run on every
node), so this is the standard library's HTTP server; the text it serves is written by
``prometheus_client`` (pure Python, no dependencies of its own), as the service's is.
What it shows, all read from counters the agent keeps anyway: ticks, samples collected /
sent / dropped, publish errors, the local buffer, errors per source, and whatever figures a
source offers through an optional ``metric_samples()`` (NVML errors and call time, cgroup
PSI per domain).

``/livez`` fails when the tick loop has stalled (no tick for five intervals and at least
10 s); ``/readyz`` fails while Redis does not take samples (some are waiting in the buffer
and the last attempt failed). Kubernetes restarts a stalled agent and shows a disconnected
one as not ready, without restarting it and losing its buffer.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterable, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from oomcast.collectors.agent import NodeAgent
from oomcast.model.text import exposition

log = logging.getLogger(__name__)

# (name, type, help, labels, value): one figure a source reports
MetricSample = tuple[str, str, str, dict[str, str], float]


def render(samples: Iterable[MetricSample]) -> str:
    """Prometheus text exposition (version 0.0.4, by ``prometheus_client``), one HELP/TYPE
    block per metric name, in the order the names first come."""
    families: dict[str, Metric] = {}
    for name, kind, help_text, labels, value in samples:
        family = families.get(name)
        if family is None:
            family = families[name] = (
                CounterMetricFamily(name, help_text)
                if kind == "counter"
                else GaugeMetricFamily(name, help_text)
            )
        sample_name = family.name + "_total" if kind == "counter" else name
        family.add_sample(sample_name, dict(sorted(labels.items())), float(value))
    return exposition(families.values()).decode()


def agent_samples(agent: NodeAgent, extra: Sequence[Any] = ()) -> list[MetricSample]:
    st, pub = agent.stats, agent.publisher.stats
    out: list[MetricSample] = [
        ("oomcast_agent_ticks_total", "counter", "Ticks of the sampling loop.", {}, st.ticks),
        (
            "oomcast_agent_samples_total",
            "counter",
            "Samples collected from all sources.",
            {},
            st.samples,
        ),
        ("oomcast_agent_events_total", "counter", "Events collected (oom, ...).", {}, st.events),
        (
            "oomcast_agent_samples_sent_total",
            "counter",
            "Samples Redis accepted.",
            {},
            pub.samples_sent,
        ),
        (
            "oomcast_agent_samples_dropped_total",
            "counter",
            "Samples dropped because the local buffer was full while Redis was unreachable.",
            {},
            pub.samples_dropped,
        ),
        (
            "oomcast_agent_publish_errors_total",
            "counter",
            "Failed attempts to write to Redis.",
            {},
            pub.publish_errors,
        ),
        (
            "oomcast_agent_publish_refused_total",
            "counter",
            "Entries Redis refused (full or read-only); each stays buffered and is sent again.",
            {},
            pub.entries_refused,
        ),
        (
            "oomcast_agent_buffered_samples",
            "gauge",
            "Samples waiting in the local buffer for Redis.",
            {},
            agent.publisher.buffered_samples,
        ),
        (
            "oomcast_agent_domains",
            "gauge",
            "Memory domains sampled in the last 10 minutes.",
            {},
            st.domains,
        ),
        (
            "oomcast_agent_last_tick_seconds",
            "gauge",
            "Duration of the last tick: polling, embedding and publishing.",
            {},
            st.last_tick_s,
        ),
    ]
    for source in agent.sources:
        name = getattr(source, "name", type(source).__name__)
        out.append(
            (
                "oomcast_agent_source_errors_total",
                "counter",
                "Polls of a source that raised.",
                {"source": name},
                st.source_errors.get(name, 0),
            )
        )
        figures = getattr(source, "metric_samples", None)
        if callable(figures):
            try:
                out.extend(figures())
            except Exception as exc:  # a broken figure must not take /metrics down
                log.warning("metrics of source %s failed: %s", name, exc)
    for part in extra:
        try:
            out.extend(part.metric_samples())
        except Exception as exc:
            log.warning("metrics of %s failed: %s", type(part).__name__, exc)
    return out


class AgentHTTP:
    """Serve the agent's endpoints from a daemon thread."""

    def __init__(
        self,
        agent: NodeAgent,
        host: str = "127.0.0.1",
        port: int = 9101,
        extra: Sequence[Any] = (),
    ) -> None:
        self.agent = agent
        self.extra = list(extra)  # more things with metric_samples(): the control listener
        self.started = time.monotonic()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._send(
                        200,
                        render(agent_samples(owner.agent, owner.extra)),
                        "text/plain; version=0.0.4",
                    )
                elif path == "/livez":
                    ok, why = owner.live()
                    self._send(200 if ok else 503, why + "\n", "text/plain")
                elif path == "/readyz":
                    ok, why = owner.ready()
                    self._send(200 if ok else 503, why + "\n", "text/plain")
                else:
                    self._send(404, "not found: try /metrics, /livez or /readyz\n", "text/plain")

            def _send(self, code: int, body: str, ctype: str) -> None:
                data = body.encode()
                self.send_response(code)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, format: str, *args: Any) -> None:
                return  # scrapes every few seconds would flood the log

        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.port = int(self.server.server_address[1])
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="agent-http", daemon=True
        )

    def live(self) -> tuple[bool, str]:
        st = self.agent.stats
        allowed = max(10.0, 5 * self.agent.interval_s)
        last = st.last_tick_at or self.started
        age = time.monotonic() - last
        if age > allowed:
            return False, f"no tick for {age:.1f}s (allowed {allowed:.0f}s)"
        return True, "ok"

    def ready(self) -> tuple[bool, str]:
        pub = self.agent.publisher
        if self.agent.stats.ticks == 0:
            return False, "not sampled yet"
        if pub.buffered_samples and pub.stats.publish_errors and not pub.connected:
            return False, f"Redis is not taking samples; {pub.buffered_samples} buffered"
        return True, "ok"

    def start(self) -> AgentHTTP:
        self._thread.start()
        return self

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
