"""Signed webhooks: what one delivery of an alert to ``OOMCAST_WEBHOOK_URL`` looks like.

The outbox and the worker (``service/delivery/outbox.py``, ``service/delivery/worker.py``)
make delivery durable and at least once; this module builds each attempt. The body is the
alert's record with ``delivery_id`` added, so the id a receiver de-duplicates on is covered by the
HMAC-SHA256 signature in ``X-Oomcast-Signature`` (a replayed body cannot pass as a new
delivery); the same id travels in ``X-Oomcast-Delivery``. Every attempt of one delivery
sends the same bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from oomcast.model.signing import sign, verify
from oomcast.model.text import compact_json
from oomcast.service.delivery.outbox import Delivery

SIGNATURE_HEADER = "X-Oomcast-Signature"


def sign_body(body: bytes, secret: str) -> str:
    return sign(body, secret)


def verify_signature(body: bytes, header: str | None, secret: str) -> bool:
    return verify(body, header, secret)


class WebhookTarget:
    name = "webhook"

    def __init__(self, url: str, secret: str) -> None:
        self.url = url
        self._secret = secret

    def order_key(self, payload: Mapping[str, Any]) -> str:
        """One domain's alerts go in order: a resolve never lands before its firing."""
        return f"{payload.get('node')}/{payload.get('device')}"

    def owed(self, delivery: Delivery) -> None:
        """Nothing to keep: a webhook is sent once per delivery."""

    def body(self, delivery: Delivery) -> bytes:
        payload = {**delivery.payload, "delivery_id": delivery.id}
        return compact_json(payload).encode()

    def request(self, delivery: Delivery, now: float) -> tuple[str, bytes, dict[str, str]]:
        body = self.body(delivery)
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign_body(body, self._secret),
            "User-Agent": "oomcast",
        }
        return self.url, body, headers
