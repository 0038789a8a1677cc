"""The webhook receiver of the fault bench: a real HTTP server that counts deliveries.

It answers 200 to every POST and keeps, per ``X-Oomcast-Delivery`` id, how often it was
answered 2xx: delivery is at least once, so a receiver must drop repeats, and the bench
reports them instead of hiding them. It checks each body's HMAC signature too. It can be
taken down (the port then refuses connections) and brought back on the same port, and
told to hold its answers (a slow receiver) so a service can be killed mid-delivery.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from oomcast.model.signing import verify

DELIVERY_HEADER = "X-Oomcast-Delivery"
SIGNATURE_HEADER = "X-Oomcast-Signature"


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
            self.bad_signatures = self.without_id = 0

    def snapshot(self) -> tuple[Counter[str], dict[str, float]]:
        with self._lock:
            return Counter(self.received), dict(self.first_at)
