"""The durable outbox: webhook and Alertmanager deliveries owed, kept in Redis until taken.

A delivery is written here in the same pipeline as its alert's audit record, before the
stream entries that caused it are acknowledged (``Ingestor.commit``), so an alert is never
on record without being owed, and a crash or restart of the service loses none: whichever
replica's worker runs next delivers it (``service/delivery/worker.py``). A delivery leaves the
outbox only when its receiver answered 2xx, refused it (a 4xx no retry would mend), or it
grew older than its maximum age; each such end is final and is written to the audit stream.

Layout, per target (``webhook``, ``alertmanager``), under ``{prefix}:outbox:{o}:{target}``
(the ``{o}`` hash tag puts every key in one Redis Cluster slot, so one Lua script may touch
them all):

| key | type | holds |
|---|---|---|
| ``…:items`` | hash | id -> the delivery as staged (JSON; never changed) |
| ``…:meta`` | hash | id -> attempts so far, first failure, last error (JSON) |
| ``…:claims`` | hash | id -> the token of the worker holding it now |
| ``…:due`` | zset | id -> when it may next be tried; only the head of each order queue |
| ``…:created`` | zset | id -> when it was decided (the oldest owed one, for health) |
| ``…:failing`` | zset | id -> when its tries started failing |
| ``…:done`` | zset | id -> when it ended (so staging it again owes nothing) |
| ``…:seq`` | string | a counter that orders stagings |
| ``…:q:<order>`` | zset | id -> staging order, one queue per domain |

Order: deliveries with the same order key (a domain: node and device) are tried one at a
time, oldest first; only a queue's head is ever due, so a "resolved" never goes before the
"firing" of its domain has been delivered or given up. Claims: a worker takes due heads in
one script that also pushes their due time forward by the claim timeout, so two workers never
hold one delivery at once, and the claims of a worker that died come back due by themselves.
Staging is idempotent: an id already owed or already ended is not owed again.

Sealed items: anyone who can write to Redis could stage an item, and the worker would sign
it with the webhook secret and send it as the service's own. So with keys (derived from the
service's control secret and its webhook secret: ``outbox_keys``) every item is stored as
``sha256=<MAC> <JSON>`` from the moment it is staged, and an item taken from the outbox is
sent only if its MAC verifies and it sits under the id and target it was sealed for; one
that does not is removed unsent and reported as ``forged`` (counted, logged, audited with
its id and a fixed reason, nothing it claims).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis

from oomcast.model.signing import SIG_PREFIX, service_keys, sign, verify
from oomcast.model.text import as_str, compact_json
from oomcast.model.wire import Keys, answer_async

DONE_KEPT_S = 2 * 86_400.0  # how long an ended id is remembered, at least
TARGETS = ("webhook", "alertmanager")  # every kind of receiver deliveries may be owed to


OUTBOX_KEY_CONTEXT = b"oomcast:outbox-items:v1"


def outbox_keys(control_secret: str | None, webhook_secret: str | None) -> tuple[str, ...]:
    """The keys outbox items are sealed with, the first sealing, any verifying: derived
    from the control secret (which only the service holds) and from the webhook secret, for
    those set. Verifying with both keeps items owed across adding a control secret to a
    service that had only a webhook secret."""
    return service_keys(control_secret, webhook_secret, OUTBOX_KEY_CONTEXT)


class ForgedItem(ValueError):
    """An outbox item whose seal does not verify: it was not staged by this service."""


def seal(item: str, keys: Sequence[str]) -> str:
    """An item as stored: ``sha256=<MAC> <JSON>`` under the first of ``keys``, or the JSON
    alone when there is none."""
    return f"{sign(item.encode(), keys[0])} {item}" if keys else item


def unseal(stored: bytes | str, keys: Sequence[str]) -> str:
    """The JSON of a stored item whose seal verifies under one of ``keys``; ForgedItem
    otherwise. With no key there is nothing to check: a sealed item's JSON is taken as is."""
    try:
        text = as_str(stored)
    except UnicodeDecodeError:
        raise ForgedItem("not text (staged by something other than the service)") from None
    mac, sep, item = text.partition(" ")
    sealed = bool(sep) and mac.startswith(SIG_PREFIX)
    if not keys:
        return item if sealed else text
    if not sealed:
        raise ForgedItem("no seal (staged by something other than the service)")
    if not any(verify(item.encode(), mac, key) for key in keys):
        raise ForgedItem("its seal does not verify under the service's keys")
    return item


def delivery_id(record: Mapping[str, Any], target: str) -> str:
    """The id of one alert's delivery to one target, the same however often, and on
    whichever replica, it is computed: the episode (itself derived from the sample that
    started it), the status, and the ts of the sample the alert was made from (what tells
    apart two notifications of one episode with one status), then the target. Not the time
    it was decided: a batch forecast again after a crash or a takeover decides it again."""
    episode = record.get("episode") or "none"
    try:
        seq = round(float(record.get("observed_at") or 0.0) * 1000)
    except (TypeError, ValueError):
        seq = 0
    return f"{episode}.{record.get('status')}.{seq}.{target}"


@dataclass(frozen=True)
class Delivery:
    """One payload owed to one target. ``order``: deliveries sharing it go one at a time, in
    the order they were staged. ``quiet``: a keep-alive (an Alertmanager re-send), whose end
    is not audited. ``max_age_s``: this one's own age limit (None: the worker's)."""

    id: str
    target: str
    order: str
    payload: Mapping[str, Any]
    created_at: float
    quiet: bool = False
    max_age_s: float | None = None

    def to_json(self) -> str:
        return compact_json(
            {
                "id": self.id,
                "target": self.target,
                "order": self.order,
                "payload": self.payload,
                "created_at": self.created_at,
                "quiet": self.quiet,
                "max_age_s": self.max_age_s,
            }
        )

    @classmethod
    def from_json(cls, text: bytes | str) -> Delivery:
        obj = json.loads(text)
        return cls(
            id=str(obj["id"]),
            target=str(obj["target"]),
            order=str(obj["order"]),
            payload=obj["payload"],
            created_at=float(obj["created_at"]),
            quiet=bool(obj.get("quiet")),
            max_age_s=None if obj.get("max_age_s") is None else float(obj["max_age_s"]),
        )


@dataclass
class Progress:
    """What the tries of one delivery have met so far."""

    attempts: int = 0
    first_failed_at: float | None = None
    last_error: str | None = None

    @classmethod
    def from_json(cls, text: bytes | str) -> Progress:
        if not text:
            return cls()
        obj = json.loads(text)
        return cls(
            attempts=int(obj.get("attempts") or 0),
            first_failed_at=obj.get("first_failed_at"),
            last_error=obj.get("last_error"),
        )

    def to_json(self) -> str:
        return compact_json(
            {
                "attempts": self.attempts,
                "first_failed_at": self.first_failed_at,
                "last_error": self.last_error,
            }
        )


@dataclass
class Forged:
    """An item taken from the outbox whose seal did not verify: never sent."""

    id: bytes | str  # its field in the items hash, as Redis gave it
    target: str
    order: str | None  # its order queue, as the item claims (to unblock it), if readable
    why: str  # one of a few fixed reasons: nothing the item says

    def label(self) -> str:
        """The id, readable and bounded, for logs and the audit."""
        raw = self.id if isinstance(self.id, bytes) else self.id.encode("utf-8", "replace")
        return raw[:200].decode("utf-8", "replace")


@dataclass
class Claimed:
    """A delivery a worker holds, with the token that proves it still does."""

    delivery: Delivery
    progress: Progress
    token: str


@dataclass
class TargetHealth:
    owed: int = 0
    overdue: int = 0  # owed for longer than the degraded threshold
    oldest_owed_s: float | None = None
    failing: int = 0
    failing_for_s: float | None = None
    last_error: str | None = None


@dataclass
class Health:
    """How deliveries stand: ``degraded`` when one has been owed longer than the threshold
    (its tries fail, it waits behind one whose tries fail, or no worker is trying)."""

    degraded_after_s: float
    targets: dict[str, TargetHealth] = field(default_factory=dict)

    @property
    def degraded(self) -> bool:
        return any(
            t.oldest_owed_s is not None and t.oldest_owed_s > self.degraded_after_s
            for t in self.targets.values()
        )

    def to_dict(self) -> dict[str, Any]:
        owed = sum(t.owed for t in self.targets.values())
        ages = [t.oldest_owed_s for t in self.targets.values() if t.oldest_owed_s is not None]
        return {
            "status": "degraded" if self.degraded else "ok",
            "owed": owed,
            "oldest_owed_s": round(max(ages), 3) if ages else None,
            "degraded_after_s": self.degraded_after_s,
            "targets": {
                name: {
                    "owed": t.owed,
                    "overdue": t.overdue,
                    "oldest_owed_s": None if t.oldest_owed_s is None else round(t.oldest_owed_s, 3),
                    "failing": t.failing,
                    "failing_for_s": None if t.failing_for_s is None else round(t.failing_for_s, 3),
                    "last_error": t.last_error,
                }
                for name, t in self.targets.items()
            },
        }


# KEYS: items, due, created, done, seq, then one order queue per delivery.
# ARGV: now, idle_only ("1": only into an empty queue), then id, item, created_at per delivery.
STAGE = """
local n = 0
for i = 1, #KEYS - 5 do
  local id, item, created = ARGV[3 * i], ARGV[3 * i + 1], ARGV[3 * i + 2]
  local q = KEYS[5 + i]
  if redis.call('HEXISTS', KEYS[1], id) == 0 and not redis.call('ZSCORE', KEYS[4], id)
      and (ARGV[2] ~= '1' or redis.call('ZCARD', q) == 0) then
    redis.call('HSET', KEYS[1], id, item)
    redis.call('ZADD', KEYS[3], created, id)
    redis.call('ZADD', q, redis.call('INCR', KEYS[5]), id)
    if redis.call('ZRANGE', q, 0, 0)[1] == id then
      redis.call('ZADD', KEYS[2], ARGV[1], id)
    end
    n = n + 1
  end
end
return n
"""

# KEYS: due, items, meta, claims, done. ARGV: now, claimed until, limit, token. An id that
# already ended is never taken again (an ended item written back by someone else).
CLAIM = """
local ids = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[3]))
local out = {}
for _, id in ipairs(ids) do
  local item = redis.call('HGET', KEYS[2], id)
  if item and redis.call('ZSCORE', KEYS[5], id) then
    redis.call('ZREM', KEYS[1], id)
    redis.call('HDEL', KEYS[2], id)
  elseif item then
    redis.call('ZADD', KEYS[1], ARGV[2], id)
    redis.call('HSET', KEYS[4], id, ARGV[4])
    table.insert(out, id)
    table.insert(out, item)
    table.insert(out, redis.call('HGET', KEYS[3], id) or '')
  else
    redis.call('ZREM', KEYS[1], id)
  end
end
return out
"""

# KEYS: due, meta, claims, failing. ARGV: id, token, due at, progress ('' keeps it), failing
# since ('' for none). Only while the token still holds the delivery.
RESCHEDULE = """
if redis.call('HGET', KEYS[3], ARGV[1]) ~= ARGV[2] then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
if ARGV[4] ~= '' then redis.call('HSET', KEYS[2], ARGV[1], ARGV[4]) end
if ARGV[5] ~= '' then redis.call('ZADD', KEYS[4], 'NX', ARGV[5], ARGV[1]) end
redis.call('ZADD', KEYS[1], 'XX', ARGV[3], ARGV[1])
return 1
"""

# KEYS: items, meta, claims, due, created, failing, done, the order queue.
# ARGV: id, now, how long ended ids are remembered, whether to remember this one ('1').
# 1 if it was owed (this call ended it).
FINISH = """
if redis.call('HDEL', KEYS[1], ARGV[1]) == 0 then return 0 end
redis.call('HDEL', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('ZREM', KEYS[5], ARGV[1])
redis.call('ZREM', KEYS[6], ARGV[1])
if ARGV[4] == '1' then redis.call('ZADD', KEYS[7], ARGV[2], ARGV[1]) end
redis.call('ZREMRANGEBYSCORE', KEYS[7], '-inf', tonumber(ARGV[2]) - tonumber(ARGV[3]))
redis.call('ZREM', KEYS[8], ARGV[1])
local head = redis.call('ZRANGE', KEYS[8], 0, 0)[1]
if head then redis.call('ZADD', KEYS[4], 'NX', ARGV[2], head) end
return 1
"""


class Outbox:
    """The deliveries owed, in Redis (see the module's doc). Safe to share between the
    ingest loop, which stages, and any number of workers, here or in other replicas."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: Keys,
        *,
        done_kept_s: float = DONE_KEPT_S,
        degraded_after_s: float = 60.0,
        seal_keys: Sequence[str] = (),
    ) -> None:
        self.client = client
        # items are sealed with the first, and sent only if their seal verifies under one
        self.seal_keys = tuple(seal_keys)
        self.base = f"{keys.prefix}:outbox:{{o}}"
        self.done_kept_s = done_kept_s
        self.degraded_after_s = degraded_after_s
        self.targets: list[str] = []  # those health reports on (the worker's)
        self._wake = asyncio.Event()

    # -- key names ------------------------------------------------------------------------
    def key(self, target: str, what: str) -> str:
        return f"{self.base}:{target}:{what}"

    def queue(self, target: str, order: str) -> str:
        return f"{self.base}:{target}:q:{order}"

    # -- staging ----------------------------------------------------------------------------
    def stage(self, pipe: Any, deliveries: Sequence[Delivery], now: float) -> None:
        """Add the writes that owe ``deliveries`` to ``pipe`` (a redis.asyncio pipeline),
        one script call per target. Owing an id already owed, or already ended, does
        nothing."""
        self._stage(pipe, deliveries, now, idle_only=False)

    async def put(
        self, deliveries: Sequence[Delivery], now: float, *, idle_only: bool = False
    ) -> int:
        """Owe ``deliveries`` now, in a round trip of their own; with ``idle_only``, each
        only if nothing of its order is owed. How many were newly owed."""
        pipe = self.client.pipeline(transaction=False)
        self._stage(pipe, deliveries, now, idle_only=idle_only)
        counts = await pipe.execute()
        self.wake()
        return sum(int(c) for c in counts)

    def _stage(
        self, pipe: Any, deliveries: Sequence[Delivery], now: float, idle_only: bool
    ) -> None:
        by_target: dict[str, list[Delivery]] = {}
        for d in deliveries:
            by_target.setdefault(d.target, []).append(d)
        for target, items in by_target.items():
            keys = [self.key(target, k) for k in ("items", "due", "created", "done", "seq")]
            keys += [self.queue(target, d.order) for d in items]
            args: list[Any] = [now, "1" if idle_only else "0"]
            for d in items:
                args += [d.id, seal(d.to_json(), self.seal_keys), d.created_at]
            pipe.eval(STAGE, len(keys), *keys, *args)

    def wake(self) -> None:
        """Tell this process's worker that something was staged."""
        self._wake.set()

    async def wait(self, timeout_s: float) -> None:
        """Until ``wake`` is called or ``timeout_s`` passes."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._wake.wait()
        except TimeoutError:
            pass
        self._wake.clear()

    # -- the worker's side --------------------------------------------------------------------
    async def claim(
        self,
        target: str,
        now: float,
        *,
        claim_s: float,
        limit: int,
        worker: str,
        forged: list[Forged] | None = None,
    ) -> list[Claimed]:
        """Take up to ``limit`` due deliveries of ``target`` for ``claim_s`` seconds. Items
        whose seal does not verify are not returned; they go to ``forged``, when given, for
        the caller to remove (:meth:`discard`)."""
        if limit <= 0:
            return []
        token = f"{worker}:{uuid.uuid4().hex[:12]}"
        keys = [self.key(target, k) for k in ("due", "items", "meta", "claims", "done")]
        got = cast(
            list[bytes | str],
            await answer_async(
                self.client.eval(CLAIM, len(keys), *keys, now, now + claim_s, limit, token)
            ),
        )
        out = []
        for i in range(0, len(got), 3):
            field, stored = got[i], got[i + 1]
            try:
                delivery = Delivery.from_json(unseal(stored, self.seal_keys))
                if delivery.id != as_str(field) or delivery.target != target:
                    # a genuine item copied under another id, or into another target's hash
                    raise ForgedItem("a copy: its id or target is not the one it was sealed for")
            except ForgedItem as exc:
                why = str(exc)
            except (ValueError, KeyError, TypeError, AttributeError):
                why = "unreadable (not an item the service staged)"
            else:
                try:
                    progress = Progress.from_json(got[i + 2])
                except (ValueError, KeyError, TypeError, AttributeError):
                    progress = Progress()  # its tries so far are lost, not the delivery
                out.append(Claimed(delivery, progress, token))
                continue
            if forged is not None:
                forged.append(Forged(field, target, _order_of(stored), why))
        return out

    async def discard(self, item: Forged, now: float) -> bool:
        """Remove an item that failed its seal, unsent, and make the next of its order
        queue due (as :meth:`finish` does, without remembering its id as ended)."""
        t = item.target
        keys = [
            self.key(t, k) for k in ("items", "meta", "claims", "due", "created", "failing", "done")
        ]
        keys.append(self.queue(t, item.order or ""))
        done = await answer_async(
            self.client.eval(FINISH, len(keys), *keys, item.id, now, self.done_kept_s, "0")
        )
        return bool(done)

    async def reschedule(
        self, claimed: Claimed, due_at: float, *, failed_at: float | None = None
    ) -> bool:
        """Give a held delivery back, due at ``due_at``, with its progress; False if another
        worker has taken it since (this one's claim ran out)."""
        d = claimed.delivery
        keys = [self.key(d.target, k) for k in ("due", "meta", "claims", "failing")]
        failing = "" if failed_at is None else failed_at
        done = await answer_async(
            self.client.eval(
                RESCHEDULE,
                len(keys),
                *keys,
                d.id,
                claimed.token,
                due_at,
                claimed.progress.to_json(),
                failing,
            )
        )
        return bool(done)

    async def finish(self, delivery: Delivery, now: float) -> bool:
        """End a delivery for good (delivered, refused or expired) and make the next of its
        order due. True if this call ended it, False if it had ended already."""
        t = delivery.target
        keys = [
            self.key(t, k) for k in ("items", "meta", "claims", "due", "created", "failing", "done")
        ]
        keys.append(self.queue(t, delivery.order))
        # a keep-alive is never staged again, so its id need not be remembered
        remember = "0" if delivery.quiet else "1"
        done = await answer_async(
            self.client.eval(FINISH, len(keys), *keys, delivery.id, now, self.done_kept_s, remember)
        )
        return bool(done)

    async def owed_elsewhere(self) -> dict[str, int]:
        """Deliveries owed to targets this replica does not deliver to (not configured here,
        or no longer configured): they wait for a replica that has them."""
        out = {}
        for target in TARGETS:
            if target not in self.targets:
                n = int(await answer_async(self.client.hlen(self.key(target, "items"))))
                if n:
                    out[target] = n
        return out

    # -- health ------------------------------------------------------------------------------
    async def health(self, now: float) -> Health:
        """Owed deliveries per target, the oldest one's age, and those whose tries fail."""
        out = Health(self.degraded_after_s)
        for target in self.targets:
            pipe = self.client.pipeline(transaction=False)
            pipe.hlen(self.key(target, "items"))
            pipe.zrange(self.key(target, "created"), 0, 0, withscores=True)
            pipe.zcard(self.key(target, "failing"))
            pipe.zrange(self.key(target, "failing"), 0, 0, withscores=True)
            pipe.zcount(self.key(target, "created"), "-inf", now - self.degraded_after_s)
            owed, oldest, failing, first_failing, overdue = await pipe.execute()
            th = TargetHealth(owed=int(owed), overdue=int(overdue), failing=int(failing))
            if oldest:
                th.oldest_owed_s = max(0.0, now - float(oldest[0][1]))
            if first_failing:
                fid, since = first_failing[0]
                th.failing_for_s = max(0.0, now - float(since))
                meta = await answer_async(self.client.hget(self.key(target, "meta"), as_str(fid)))
                th.last_error = Progress.from_json(meta or "").last_error
            out.targets[target] = th
        return out


def _order_of(stored: bytes | str) -> str | None:
    """The order queue an item names, read without trusting it (only to unblock the queue)."""
    try:
        text = as_str(stored)
        obj = json.loads(text.partition(" ")[2] if text.startswith(SIG_PREFIX) else text)
        order = obj.get("order") if isinstance(obj, dict) else None
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return order if isinstance(order, str) else None
