"""Signed webhook delivery, off the ingest path (the queue, ordering and retries are
``service/delivery.py``'s). The body is signed with HMAC-SHA256 in ``X-Oomcast-Signature``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from typing import Any

from oomcast.model.signing import sign, verify
from oomcast.service.delivery import OrderedSender

SIGNATURE_HEADER = "X-Oomcast-Signature"


def sign_body(body: bytes, secret: str) -> str:
    return sign(body, secret)


def verify_signature(body: bytes, header: str | None, secret: str) -> bool:
    return verify(body, header, secret)


class WebhookSender(OrderedSender):
    what = "webhook"

    def __init__(
        self,
        url: str,
        secret: str,
        *,
        timeout_s: float = 5.0,
        max_attempts: int = 6,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        queue_size: int = 1000,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(
            timeout_s=timeout_s,
            max_attempts=max_attempts,
            backoff_s=backoff_s,
            backoff_max_s=backoff_max_s,
            queue_size=queue_size,
            on_result=on_result,
        )
        self.url = url
        self._secret = secret

    def submit(self, payload: Mapping[str, Any]) -> bool:
        """Queue one alert; never waits. Deliveries of one domain keep their order."""
        return self._put((payload.get("node"), payload.get("device")), payload, _describe(payload))

    async def _deliver(self, payload: Mapping[str, Any]) -> None:
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign_body(body, self._secret),
            "User-Agent": "oomcast",
        }
        await self._post(self.url, lambda: body, headers, _describe(payload))


def _describe(payload: Mapping[str, Any]) -> str:
    return f"{payload.get('status')} alert for {payload.get('node')}/{payload.get('device')}"
