"""The webhook receiver of the fault bench: a real HTTP server that counts deliveries.

It answers 200 to every POST and keeps, per ``X-Oomcast-Delivery`` id, how often it was
answered 2xx: delivery is at least once, so a receiver must drop repeats, and the bench
reports them instead of hiding them. It checks each body's HMAC signature too. It can be
taken down (the port then refuses connections) and brought back on the same port, and
told to hold its answers (a slow receiver) so a service can be killed mid-delivery.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from oomcast.model.signing import verify

DELIVERY_HEADER = "X-Oomcast-Delivery"
SIGNATURE_HEADER = "X-Oomcast-Signature"


DRIP_EVERY_S = 2.0
HUGE_BYTES = 1 << 30


class CountingReceiver:
    def __init__(self, secret: str) -> None:
        self.secret = secret
        self.port = 0
        self.hold_s = 0.0  # how long each answer waits (a slow receiver)
        self.received: Counter[str] = Counter()  # delivery id -> 2xx answers
        self.first_at: dict[str, float] = {}  # delivery id -> wall time of its first receipt
        self.bad_signatures = 0
        self.without_id = 0
        self.in_flight = 0
        # How it answers: "ok" (200 at once), "drip" (the status line a byte every
        # DRIP_EVERY_S: a receiver that never quite answers), "huge_error" (a 500 whose body
        # is 1 GiB, streamed as fast as the sender reads it)
        self.mode = "ok"
        # every attempt met in a mode other than "ok": (delivery id, mode, start, end, bytes sent)
        self.attempts: list[tuple[str | None, str, float, float, int]] = []
        self._lock = threading.Lock()
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                delivery = self.headers.get(DELIVERY_HEADER)
                signed = verify(body, self.headers.get(SIGNATURE_HEADER), owner.secret)
                with owner._lock:
                    owner.in_flight += 1
                    hold = owner.hold_s
                    mode = owner.mode
                if mode != "ok":
                    t0, sent = time.time(), self._misbehave(mode)
                    with owner._lock:
                        owner.in_flight -= 1
                        owner.attempts.append((delivery, mode, t0, time.time(), sent))
                    self.close_connection = True
                    return
                try:
                    if hold:
                        time.sleep(hold)  # a slow receiver: the sender waits on this answer
                    with owner._lock:
                        if not signed:
                            owner.bad_signatures += 1
                        if delivery is None:
                            owner.without_id += 1
                        else:
                            owner.received[delivery] += 1
                            owner.first_at.setdefault(delivery, time.time())
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                finally:
                    with owner._lock:
                        owner.in_flight -= 1

            def _misbehave(self, mode: str) -> int:
                """Answer as a bad receiver would, until the sender hangs up; bytes sent."""
                sent = 0
                try:
                    if mode == "drip":
                        for byte in b"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n\r\n":
                            self.wfile.write(bytes([byte]))
                            self.wfile.flush()
                            sent += 1
                            # wait for the next drip, or see at once that the sender hung up
                            ready, _, _ = select.select([self.connection], [], [], DRIP_EVERY_S)
                            if ready and not self.connection.recv(1, socket.MSG_PEEK):
                                break
                    else:  # huge_error
                        head = f"HTTP/1.1 500 Oops\r\nContent-Length: {HUGE_BYTES}\r\n\r\n"
                        self.wfile.write(head.encode())
                        chunk = b"x" * (1 << 20)
                        while sent < HUGE_BYTES:
                            self.wfile.write(chunk)
                            sent += len(chunk)
                except OSError:  # the sender gave up: what a bad receiver leaves behind
                    pass
                return sent

            def log_message(self, format: str, *args: Any) -> None:
                return

        return Handler

    @property
    def listening(self) -> bool:
        return self._server is not None

    def up(self) -> None:
        """Listen (on the same port as before, after the first time)."""
        server = ThreadingHTTPServer(("127.0.0.1", self.port), self._handler())
        server.daemon_threads = True
        self.port = int(server.server_address[1])
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, daemon=True)
        self._thread.start()

    def down(self) -> None:
        """Stop listening: connections to the port are refused until ``up()``."""
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def reset(self) -> None:
        """Forget what was received (a new scenario counts its own deliveries only)."""
        with self._lock:
            self.received.clear()
            self.first_at.clear()
            self.attempts.clear()
            self.bad_signatures = self.without_id = 0
            self.mode = "ok"

    def snapshot(self) -> tuple[Counter[str], dict[str, float]]:
        with self._lock:
            return Counter(self.received), dict(self.first_at)


class AlertmanagerStandIn:
    """``POST /api/v2/alerts`` answered 200, and when each alert of each push arrived: a
    real HTTP receiver where the bench needs only the push times (the tests run the real
    Alertmanager)."""

    def __init__(self) -> None:
        self.pushes: list[tuple[float, list[dict[str, Any]]]] = []
        self._lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                try:
                    alerts = json.loads(body)
                except ValueError:
                    alerts = []
                with owner._lock:
                    owner.pushes.append((time.time(), alerts if isinstance(alerts, list) else []))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                return

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def first_push_of(self, node: str, device: str, after: float) -> float | None:
        """When an alert of ``node``/``device`` first arrived at or after ``after``."""
        with self._lock:
            for at, alerts in self.pushes:
                if at < after:
                    continue
                for a in alerts:
                    labels = a.get("labels", {}) if isinstance(a, dict) else {}
                    if labels.get("node") == node and labels.get("device") == device:
                        return at
        return None

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
