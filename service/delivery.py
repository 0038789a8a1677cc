"""What webhooks and Alertmanager pushes share: deliveries off the ingest path.

Items are queued as they are and never changed afterwards. ``_put`` never waits: a full
queue drops the item, counts the drop and says so (``has_room`` tells beforehand). Deliveries
run as background tasks, at most 32 at once, concurrently across keys but in order within
one key (a retried "firing" never lands after its "resolved"). Each delivery is an HTTP POST
retried with exponential backoff up to a cap on connection errors, 5xx, 408 and 429, and not
retried on any other 4xx. Outcomes go to ``on_result``: delivered, retry, refused, failed,
dropped.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Hashable
from typing import Any

import httpx

log = logging.getLogger(__name__)


class OrderedSender:
    what = "delivery"  # for log lines: "webhook", "alertmanager"

    def __init__(
        self,
        *,
        timeout_s: float = 5.0,
        max_attempts: int = 6,
        backoff_s: float = 0.5,
        backoff_max_s: float = 30.0,
        queue_size: int = 1000,
        on_result: Callable[[str], None] | None = None,
    ) -> None:
        self.timeout_s = timeout_s
        self.max_attempts = max_attempts
        self.backoff_s = backoff_s
        self.backoff_max_s = backoff_max_s
        self._queue: asyncio.Queue[tuple[Hashable, Any]] = asyncio.Queue(maxsize=queue_size)
        self._on_result = on_result or (lambda result: None)
        self._client: httpx.AsyncClient | None = None
        self._worker: asyncio.Task[None] | None = None
        self._inflight: set[asyncio.Task[None]] = set()
        self._slots = asyncio.Semaphore(32)
        # The newest delivery per key: the next one for that key waits for it.
        self._last_of_key: dict[Hashable, asyncio.Task[None]] = {}

    # -- what a subclass says -------------------------------------------------------------
    async def _deliver(self, item: Any) -> None:
        raise NotImplementedError

    def _finished(self, key: Hashable) -> None:
        """Called when a delivery of ``key`` is over, however it ended."""

    # -- the queue --------------------------------------------------------------------------
    def has_room(self) -> bool:
        """Whether the next ``submit`` will be queued (it never waits)."""
        return not self._queue.full()

    def _put(self, key: Hashable, item: Any, describe: str) -> bool:
        try:
            self._queue.put_nowait((key, item))
        except asyncio.QueueFull:
            self._on_result("dropped")
            log.error("%s queue full; dropped %s", self.what, describe)
            return False
        return True

    async def start(self) -> None:
        self._client = httpx.AsyncClient(timeout=self.timeout_s)
        self._worker = asyncio.create_task(self._dispatch(), name=f"{self.what}-dispatch")

    async def stop(self, grace_s: float = 2.0) -> None:
        """Give queued and in-flight deliveries ``grace_s`` to finish, then cancel them."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(grace_s):
                while not self._queue.empty() or self._inflight:
                    await asyncio.sleep(0.05)
        if self._worker:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
        for task in list(self._inflight):
            task.cancel()
        await asyncio.gather(*self._inflight, return_exceptions=True)
        if self._client:
            await self._client.aclose()

    async def _dispatch(self) -> None:
        while True:
            key, item = await self._queue.get()
            await self._slots.acquire()
            task = asyncio.create_task(self._after(self._last_of_key.get(key), item))
            self._last_of_key[key] = task
            self._inflight.add(task)
            task.add_done_callback(functools.partial(self._done, key=key))

    async def _after(self, before: asyncio.Task[None] | None, item: Any) -> None:
        if before is not None:
            await asyncio.wait([before])
        await self._deliver(item)

    def _done(self, task: asyncio.Task[None], key: Hashable) -> None:
        self._inflight.discard(task)
        self._slots.release()
        self._finished(key)
        if self._last_of_key.get(key) is task:
            del self._last_of_key[key]

    # -- one POST, retried --------------------------------------------------------------------
    async def _post(
        self, url: str, body: Callable[[], bytes], headers: dict[str, str], describe: str
    ) -> None:
        """POST ``body()`` (built anew for each attempt) until it is taken or refused, or the
        attempts run out."""
        assert self._client is not None
        delay = self.backoff_s
        problem = ""
        for attempt in range(1, self.max_attempts + 1):
            try:
                resp = await self._client.post(url, content=body(), headers=headers)
                if resp.status_code < 300:
                    self._on_result("delivered")
                    return
                # 4xx other than 408/429 will not get better by retrying.
                if 400 <= resp.status_code < 500 and resp.status_code not in (408, 429):
                    log.error(
                        "%s refused %s (%d): %s",
                        self.what,
                        describe,
                        resp.status_code,
                        resp.text[:200],
                    )
                    self._on_result("refused")
                    return
                problem = f"HTTP {resp.status_code}"
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            self._on_result("retry")
            if attempt == self.max_attempts:
                break
            log.warning(
                "%s attempt %d for %s failed (%s); retrying in %.1fs",
                self.what,
                attempt,
                describe,
                problem,
                delay,
            )
            await asyncio.sleep(delay)
            delay = min(self.backoff_max_s, delay * 2)
        log.error(
            "%s gave up on %s after %d attempts: %s",
            self.what,
            describe,
            self.max_attempts,
            problem,
        )
        self._on_result("failed")
