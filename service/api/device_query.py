"""One page of the live domains, filtered and riskiest first, for ``GET /v1/devices``.

At fleet size (10,000 domains and more) the list is never sorted whole: each request makes
one pass over the domains (the filters, and the sort key of those that pass), then keeps
only the page it answers with ``heapq.nsmallest``, O(n log page). Pages follow each other by
keyset: the cursor is the sort key of the last domain shown, and the next page starts
strictly after it. The key ends with (node, device), so the order is total and a cursor
names one place in it: while the domains stand still, walking the pages shows every one
exactly once; when risks move between requests, a domain can move past the cursor (seen
twice, or not at all), but the pages never shift by whole rows the way offsets do.
"""

from __future__ import annotations

import base64
import fnmatch
import heapq
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from oomcast.model.schema import Domain
    from oomcast.service.pipeline.state import DomainState

# (-risk at the alert horizon, -risk at any horizon, -used fraction, node, device)
SortKey = tuple[float, float, float, str, str]
_GLOB = re.compile(r"[*?\[]")
# A page asked for with this header also has ``cursors``: each device's place in the order,
# which the front of ``serve --workers`` merges the workers' pages by.
CURSORS_HEADER = "x-oomcast-cursors"


class BadCursor(ValueError):
    """A cursor this service did not hand out (or one from an incompatible version)."""


@dataclass(frozen=True, slots=True)
class DeviceFilter:
    """What a client asks for: each field None (or False for ``after``) means no filter.
    ``node`` is an exact name or a glob; ``job`` a glob (a domain with no job never matches
    it); ``min_risk`` is the risk at the alert horizon; ``after`` a decoded cursor."""

    node: str | None = None
    job: str | None = None
    kind: str | None = None
    min_risk: float | None = None
    firing: bool | None = None
    after: SortKey | None = None


@dataclass(frozen=True, slots=True)
class DevicePage:
    total: int  # live domains
    matched: int  # live domains that pass the filters (the cursor aside)
    page: list[DomainState]
    next_cursor: str | None  # None: this is the last page


_Match = re.Pattern[str] | str | None


def _matcher(pattern: str | None, *, glob_only: bool) -> _Match:
    """A compiled glob, or the plain string when ``pattern`` has no glob character (and an
    exact match is wanted)."""
    if pattern is None:
        return None
    if not glob_only and not _GLOB.search(pattern):
        return pattern
    return re.compile(fnmatch.translate(pattern))


def _matches(m: _Match, value: str | None) -> bool:
    if m is None:
        return True
    if value is None:
        return False
    return value == m if isinstance(m, str) else m.match(value) is not None


def sort_key(st: DomainState, horizon_s: int) -> SortKey:
    fc = st.forecast
    assert fc is not None
    used = st.last.used_frac if st.last is not None else 0.0
    return (-fc.risk_at(horizon_s), -fc.max_risk, -used, st.domain[0], st.domain[1])


# (its key, the state, and the forecast and sample the key was made from)
_Entry = tuple[SortKey, "DomainState", object, object]


class RankCache:
    """Each domain's sort key, kept while its forecast and latest sample are the same
    objects: a request then costs a lookup per domain, not a key (``max_risk`` reads every
    horizon). Replaced by what each unfiltered query saw, so forgotten domains drop out."""

    def __init__(self) -> None:
        self.entries: dict[Domain, _Entry] = {}


def _passes(st: DomainState, where: DeviceFilter, node: _Match, job: _Match, horizon: int) -> bool:
    fc = st.forecast
    assert fc is not None
    if where.kind is not None and (st.last is None or st.last.kind != where.kind):
        return False
    if node is not None and not _matches(node, st.domain[0]):
        return False
    if job is not None and not _matches(job, st.job):
        return False
    if where.min_risk is not None and fc.risk_at(horizon) < where.min_risk:
        return False
    return where.firing is None or where.firing == any(e.firing for e in st.episodes.values())


def query_devices(
    states: Iterable[DomainState],
    *,
    horizon_s: int,
    now: float,
    live_after_s: float,
    where: DeviceFilter,
    limit: int,
    cache: RankCache | None = None,
) -> DevicePage:
    """The page of at most ``limit`` live domains that pass ``where``, riskiest first."""
    node = _matcher(where.node, glob_only=False)
    job = _matcher(where.job, glob_only=True)
    filtered = any(
        v is not None for v in (where.node, where.job, where.kind, where.min_risk, where.firing)
    )
    old = cache.entries if cache is not None else {}
    fresh: dict[Domain, _Entry] = {}
    after = where.after
    total = matched = 0
    # No new object per domain when its key is cached: at 10,000 domains, allocating even a
    # tuple each sets off the garbage collector, which then walks the whole live state.
    hits: list[_Entry] = []
    for st in states:
        fc = st.forecast
        if fc is None or now - st.last_seen_wall > live_after_s:
            continue
        total += 1
        if filtered and not _passes(st, where, node, job, horizon_s):
            continue
        matched += 1
        hit = old.get(st.domain)
        if hit is None or hit[1] is not st or hit[2] is not fc or hit[3] is not st.last:
            hit = (sort_key(st, horizon_s), st, fc, st.last)
        fresh[st.domain] = hit
        if after is None or hit[0] > after:
            hits.append(hit)
    if cache is not None and not filtered:  # a filtered pass saw only some of the domains
        cache.entries = fresh
    elif cache is not None:
        old.update(fresh)
        if len(old) > 2 * total:  # filtered passes alone: drop the forgotten domains
            old.clear()
    # Keys are unique (they end with the domain), so entries compare by key alone.
    best = heapq.nsmallest(limit, hits)
    more = len(hits) > limit
    return DevicePage(
        total=total,
        matched=matched,
        page=[entry[1] for entry in best],
        next_cursor=encode_cursor(best[-1][0]) if more and best else None,
    )


# Every string this pattern matches decodes to some place in the order (an unknown one
# simply starts the page there), so a cursor can be refused only for its shape, which the
# OpenAPI document states: at least 24 bytes (the three floats) in unpadded base64url.
CURSOR_PATTERN = r"^(?:[A-Za-z0-9_-]{4}){8,}(?:[A-Za-z0-9_-]{2,3})?$"
_FLOATS = struct.Struct(">ddd")
_LENGTH = struct.Struct(">H")  # then the node name's length in bytes, the node, the device


def encode_cursor(key: SortKey) -> str:
    """Opaque to clients: the key, packed (floats exactly) and in URL-safe base64."""
    node = key[3].encode("utf-8", "surrogatepass")
    device = key[4].encode("utf-8", "surrogatepass")
    raw = _FLOATS.pack(key[0], key[1], key[2]) + _LENGTH.pack(min(len(node), 0xFFFF))
    raw += node + device
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def _text(raw: bytes) -> str:
    try:
        return raw.decode("utf-8", "surrogatepass")
    except UnicodeDecodeError:  # not one of ours: still a place in the order
        return raw.decode("utf-8", "replace")


def decode_cursor(cursor: str) -> SortKey:
    """The key a cursor holds; BadCursor when it is not of the documented shape."""
    if not re.fullmatch(CURSOR_PATTERN, cursor):
        raise BadCursor("not a cursor this service gave out (as a `next`): wrong shape")
    raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4))
    a, b, c = _FLOATS.unpack_from(raw)
    rest = raw[_FLOATS.size :]
    n = _LENGTH.unpack_from(rest)[0] if len(rest) >= _LENGTH.size else 0
    names = rest[_LENGTH.size :]
    return (a, b, c, _text(names[:n]), _text(names[n:]))
