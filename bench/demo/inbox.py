"""The demo's webhook receiver: a real HTTP server that checks every alert's signature."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from oomcast.service.delivery.webhook import SIGNATURE_HEADER, verify_signature


class WebhookInbox:
    """A real HTTP receiver that keeps every alert and whether its signature was valid."""

    def __init__(self, secret: str) -> None:
        inbox = self
        self.secret = secret
        self.received: list[tuple[dict[str, Any], bool]] = []
        self._lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                ok = verify_signature(body, self.headers.get(SIGNATURE_HEADER), inbox.secret)
                with inbox._lock:
                    inbox.received.append((json.loads(body), ok))
                self.send_response(200 if ok else 401)
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> WebhookInbox:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()

    def snapshot(self) -> list[tuple[dict[str, Any], bool]]:
        with self._lock:
            return list(self.received)
