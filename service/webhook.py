"""Signed webhook delivery, off the ingest path.

``submit`` never waits: it queues the alert (a full queue drops it and counts the drop).
Deliveries run as background tasks, each retried with exponential backoff up to a cap and
a number of attempts. The body is signed with HMAC-SHA256 in ``X-Oomcast-Signature``.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
from collections.abc import Callable
from typing import Any

import httpx

log = logging.getLogger(__name__)
SIGNATURE_HEADER = "X-Oomcast-Signature"


def sign_body(body: bytes, secret: str) -> str:
    return "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


def verify_signature(body: bytes, header: str | None, secret: str) -> bool:
    return header is not None and hmac.compare_digest(sign_body(body, secret), header)


class WebhookSender:
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
        self.url = url
        self._secret = secret
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._queue: asyncio.Queue[dict[str, Any]] = asyncio.Queue(maxsize=queue_size)
        self._on_result = on_result or (lambda result: None)
        self._client: httpx.AsyncClient | None = None
        self._worker: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(32)
        # The newest delivery per domain: the next one for that domain waits for it, so a
        # receiver never sees a retried "firing" land after its "resolved".
        self._last_of_domain: dict[tuple[Any, Any], asyncio.Task[None]] = {}

    def submit(self, payload: dict[str, Any]) -> bool:
        try:
            self._queue.put_nowait(payload)
        except asyncio.QueueFull:
            self._on_result("dropped")
            log.error(
                "webhook queue full; dropped %s alert for %s/%s",
                payload.get("status"),
                payload.get("node"),
                payload.get("device"),
            )
            return False
        return True

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self._worker = asyncio.create_task(self._dispatch(), name="webhook-dispatch")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Give queued and in-flight deliveries ``grace_s`` to finish, then cancel them."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                while not self._queue.empty() or self._inflight:
                    await asyncio.sleep(0.05)
        if self._worker:
            self._worker.cancel()
        for task in list(self._inflight):
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._client:
            await self._client.aclose()

    async def _dispatch(self) -> None:
        while True:
            payload = await self._queue.get()
            await self._slots.acquire()
            domain = (payload.get("node"), payload.get("device"))
            before = self._last_of_domain.get(domain)
            task = asyncio.create_task(self._deliver(payload, after=before))
            self._last_of_domain[domain] = task
            self._inflight.add(task)
            task.add_done_callback(lambda t, d=domain: self._done(t, d))

    def _done(self, task: asyncio.Task[None], domain: tuple[Any, Any]) -> None:
        self._inflight.discard(task)
        self._slots.release()
        if self._last_of_domain.get(domain) is task:
            del self._last_of_domain[domain]

    async def _deliver(
        self, payload: dict[str, Any], after: asyncio.Task[None] | None = None
    ) -> None:
        assert self._client is not None
        if after is not None:
            await asyncio.wait([after])
        body = json.dumps(payload, separators=(",", ":")).encode()
        headers = {
            "Content-Type": "application/json",
            SIGNATURE_HEADER: sign_body(body, self._secret),
            "User-Agent": "oomcast",
        }
        delay = self.backoff_s
        for attempt in range(1, self.max_attempts + 1):
            try:
                resp = await self._client.post(self.url, content=body, headers=headers)
                if resp.status_code < 300:
                    self._on_result("delivered")
                    return
                # 4xx other than 408/429 will not get better by retrying.
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    log.error("webhook refused (%d) %s", resp.status_code, resp.text[:200])
                    self._on_result("refused")
                    return
                problem = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            self._on_result("retry")
            if attempt == self.max_attempts:
                break
            log.warning(
                "webhook attempt %d failed (%s); retrying in %.1fs", attempt, problem, delay
            )
            await asyncio.sleep(delay)
            delay = min(self.backoff_max_s, delay * 2)
        log.error("webhook gave up after %d attempts: %s", self.max_attempts, problem)
        self._on_result("failed")
