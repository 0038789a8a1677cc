"""Diagnosis bundles and what ``oomcast explain`` reads out of them.

A **bundle** is one gzip'ed JSON file the in-job hook writes when an alert fires for its
domain: the allocator's summary (``torch.cuda.memory_stats`` figures), the per-process GPU
use, the last minutes of samples, the forecast and the alert, and where CUDA is present
``torch.cuda.memory._snapshot()`` (every segment and block, with the stack that allocated
each live block when memory history is recorded). ``oomcast explain`` reads a bundle or a
plain PyTorch snapshot pickle (``torch.cuda.memory._dump_snapshot``) and says how
fragmented the cache is, whether the failing request would have fit the largest free
block, which code holds the most memory, and what would fix it. Nothing here imports torch:
a snapshot is plain data, and a pickle is read with an unpickler that refuses every class,
so a hostile file cannot run code.
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
import re
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

BUNDLE_FORMAT = "oomcast-diagnosis/1"
FRAGMENTED = 0.15  # free cached bytes / reserved bytes above which the cache counts as fragmented
NEAR_LIMIT = 0.90  # reserved / capacity at or above which the GPU counts as full
TOP_SITES = 8
EXPANDABLE = "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"


class DiagnosisError(ValueError):
    """A file ``oomcast explain`` cannot read, with the reason."""


@dataclass
class Site:
    where: str  # "file.py:123 in fn", or why no stack is known
    bytes: int
    blocks: int


@dataclass
class Diagnosis:
    source: str  # "bundle" or "snapshot"
    reserved_bytes: int
    allocated_bytes: int
    free_cached_bytes: int
    largest_free_block: int
    segments: int
    fragmentation: float  # free cached / reserved
    capacity_bytes: int | None
    failing_request: int | None
    fits_largest_free: bool | None
    alloc_retries: int | None
    top_sites: list[Site] = field(default_factory=list)
    # the sites that grew most since the hook's baseline (a leak's suspects), with its age
    growing: list[dict[str, Any]] = field(default_factory=list)
    growing_since_s: float | None = None
    remedies: list[str] = field(default_factory=list)
    thin: list[str] = field(default_factory=list)  # evidence that is missing
    context: dict[str, Any] = field(default_factory=dict)  # node, device, job, alert (bundle)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class _PlainUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        raise DiagnosisError(
            f"the pickle refers to {module}.{name}; oomcast explain reads only plain data"
            " (a torch.cuda.memory._dump_snapshot file)"
        )


def read_file(path: Path | str) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The snapshot in a file, and the bundle around it when the file is a bundle
    (``({}, bundle)`` for a bundle taken without CUDA)."""
    raw = Path(path).read_bytes()
    if raw[:2] == b"\x1f\x8b":
        try:
            bundle = json.loads(gzip.decompress(raw))
        except (OSError, ValueError) as exc:
            raise DiagnosisError(f"{path}: not a gzip'ed JSON bundle ({exc})") from None
        if not isinstance(bundle, dict) or bundle.get("format") != BUNDLE_FORMAT:
            raise DiagnosisError(f"{path}: not an oomcast bundle (format {BUNDLE_FORMAT})")
        snap = bundle.get("snapshot") or {}
        return _checked_snapshot(snap, path), bundle
    try:
        snap = _PlainUnpickler(io.BytesIO(raw)).load()
    except DiagnosisError as exc:
        raise DiagnosisError(f"{path}: {exc}") from None
    except Exception as exc:  # a truncated or foreign file: say so, never a traceback
        raise DiagnosisError(f"{path}: not a bundle or a snapshot pickle ({exc})") from None
    return _checked_snapshot(snap, path), None


def _checked_snapshot(snap: Any, path: Path | str) -> dict[str, Any]:
    if not isinstance(snap, dict) or not isinstance(snap.get("segments", []), list):
        raise DiagnosisError(f"{path}: a snapshot is a dict with a 'segments' list")
    return snap


def _site(frames: list[Mapping[str, Any]]) -> str:
    """The first frame in the user's code (not torch's own), else the innermost one."""
    if not frames:
        return "(no stack: record it with torch.cuda.memory._record_memory_history())"
    for f in frames:
        name = str(f.get("filename", ""))
        if "/torch/" not in name and not name.startswith("??") and name:
            return f"{name}:{f.get('line', '?')} in {f.get('name', '?')}"
    f = frames[0]
    return f"{f.get('filename', '?')}:{f.get('line', '?')} in {f.get('name', '?')}"


def site_bytes(snap: Mapping[str, Any]) -> dict[str, int]:
    """Live bytes per allocation site (the first frame of the job's own code) in a snapshot:
    what the hook keeps as a baseline, to say later which sites grew."""
    out: dict[str, int] = {}
    for seg in snap.get("segments", []):
        for b in seg.get("blocks", []):
            if b.get("state") == "active_allocated":
                where = _site(b.get("frames") or [])
                out[where] = out.get(where, 0) + int(b.get("size", 0))
    return out


def growing_sites(
    before: Mapping[str, int], now: Mapping[str, int], top: int = TOP_SITES
) -> list[dict[str, Any]]:
    """The sites whose live bytes grew most between two summaries, largest growth first."""
    grew = [(where, n, n - before.get(where, 0)) for where, n in now.items()]
    grew = [g for g in grew if g[2] > 0]
    grew.sort(key=lambda g: -g[2])
    return [{"where": w, "bytes": n, "grew_bytes": g} for w, n, g in grew[:top]]


def _last_oom(snap: Mapping[str, Any]) -> int | None:
    for trace in reversed(snap.get("device_traces") or []):
        for entry in reversed(trace or []):
            if isinstance(entry, Mapping) and entry.get("action") == "oom":
                return int(entry.get("size", 0)) or None
    return None


_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30, "TiB": 1 << 40}
# CUDA's "Tried to allocate 2.00 GiB" and the CPU allocator's "you tried to allocate
# 2147483648 bytes", as the hook records the error that made it write the bundle
_CUDA_REQUEST = re.compile(r"[Tt]ried to allocate (\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB)\b")
_CPU_REQUEST = re.compile(r"[Tt]ried to allocate (\d+) bytes")


def request_from_message(text: str) -> int | None:
    """The failing request's size from an out-of-memory error's message, or None."""
    m = _CUDA_REQUEST.search(text)
    if m:
        return int(float(m.group(1)) * _UNITS[m.group(2)])
    m = _CPU_REQUEST.search(text)
    return int(m.group(1)) if m else None


def analyse(
    snap: Mapping[str, Any],
    *,
    bundle: Mapping[str, Any] | None = None,
    failing_request: int | None = None,
    capacity_bytes: int | None = None,
) -> Diagnosis:
    stats = dict((bundle or {}).get("allocator") or {})
    reserved = allocated = free = largest = 0
    sites: dict[str, Site] = {}
    segments = snap.get("segments", [])
    for seg in segments:
        for b in seg.get("blocks", []):
            size = int(b.get("size", 0))
            reserved += size
            if b.get("state") == "active_allocated":
                allocated += size
                where = _site(b.get("frames") or [])
                site = sites.setdefault(where, Site(where, 0, 0))
                site.bytes += size
                site.blocks += 1
            elif b.get("state") == "inactive":
                free += size
                largest = max(largest, size)
    if not segments and stats:  # no snapshot (no CUDA): the allocator's own figures
        reserved = int(stats.get("reserved_bytes", 0))
        allocated = int(stats.get("allocated_bytes", 0))
        free = max(0, reserved - allocated)
    request = (
        failing_request
        or (bundle or {}).get("failing_request_bytes")
        or _last_oom(snap)
        or request_from_message(str(((bundle or {}).get("alert") or {}).get("why") or ""))
    )
    capacity = capacity_bytes or stats.get("capacity_bytes") or None
    retries = stats.get("num_alloc_retries")
    d = Diagnosis(
        source="bundle" if bundle is not None else "snapshot",
        reserved_bytes=reserved,
        allocated_bytes=allocated,
        free_cached_bytes=free,
        largest_free_block=largest,
        segments=len(segments),
        fragmentation=round(free / reserved, 4) if reserved else 0.0,
        capacity_bytes=int(capacity) if capacity else None,
        failing_request=int(request) if request else None,
        fits_largest_free=(int(request) <= largest) if request and segments else None,
        alloc_retries=int(retries) if retries is not None else None,
        top_sites=sorted(sites.values(), key=lambda s: -s.bytes)[:TOP_SITES],
        growing=list((bundle or {}).get("growing_sites") or []),
        growing_since_s=(bundle or {}).get("growing_since_s"),
        context={
            k: bundle[k] for k in ("node", "device", "job", "alert") if bundle and k in bundle
        },
    )
    d.remedies, d.thin = _remedies(d, bool(segments))
    return d


def _remedies(d: Diagnosis, have_layout: bool) -> tuple[list[str], list[str]]:
    out: list[str] = []
    thin: list[str] = []
    full = d.capacity_bytes is not None and d.reserved_bytes >= NEAR_LIMIT * d.capacity_bytes
    split_failure = (
        d.failing_request is not None
        and d.fits_largest_free is False
        and d.failing_request <= d.free_cached_bytes
    )
    if split_failure or (d.fragmentation >= FRAGMENTED and (full or d.capacity_bytes is None)):
        why = (
            f"the failing request ({_b(d.failing_request or 0)}) fits the cache's free bytes"
            f" ({_b(d.free_cached_bytes)}) but not its largest free block"
            f" ({_b(d.largest_free_block)})"
            if split_failure
            else f"{d.fragmentation:.0%} of the reserved memory is cached but free, in pieces"
        )
        out.append(
            f"fragmentation: {why}. Set {EXPANDABLE} (segments grow in place instead of"
            " splitting), or call torch.cuda.empty_cache() at phase boundaries (after eval,"
            " before a checkpoint)"
        )
    if d.growing:
        top = ", ".join(f"{g['where']} (+{_b(int(g['grew_bytes']))})" for g in d.growing[:3])
        out.append(
            f"leak suspects, the sites that grew most: {top}; look there for tensors kept"
            " across steps (a loss summed without .item(), outputs appended to a list)"
        )
    if d.alloc_retries:
        out.append(
            f"the allocator already freed its cache and retried {d.alloc_retries} times"
            f" (num_alloc_retries): a sign of fragmentation; {EXPANDABLE} usually removes it"
        )
    live_full = d.capacity_bytes is not None and d.allocated_bytes >= NEAR_LIMIT * d.capacity_bytes
    if live_full or (not out and full):
        top = f"; most held by {d.top_sites[0].where}" if d.top_sites else ""
        out.append(
            "live tensors fill the GPU: lower the batch size, use gradient checkpointing or"
            f" mixed precision, or move optimizer state off the GPU{top}"
        )
    if not have_layout:
        thin.append("no memory snapshot (no CUDA in the job): block layout unknown")
    elif d.top_sites and d.top_sites[0].where.startswith("(no stack"):
        thin.append("no allocation stacks: the top sites cannot be named")
    if d.capacity_bytes is None:
        thin.append("the GPU's capacity is not in the file: 'near the limit' cannot be judged")
    if d.failing_request is None:
        thin.append("no failing request recorded (no OOM yet, or memory history was off)")
    if not out:
        out.append("no remedy follows from this evidence: the cache is neither full nor fragmented")
    return out, thin


def _b(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"


def explain_text(d: Diagnosis) -> str:
    lines = []
    if d.context:
        where = "/".join(str(d.context.get(k, "?")) for k in ("node", "device"))
        lines.append(f"domain {where}, job {d.context.get('job') or '-'}")
    cap = f" of {_b(d.capacity_bytes)}" if d.capacity_bytes else ""
    layout = f"in {d.segments} segments" if d.segments else "(no block layout)"
    lines.append(
        f"reserved {_b(d.reserved_bytes)}{cap} {layout};"
        f" live {_b(d.allocated_bytes)}; cached but free {_b(d.free_cached_bytes)}"
        f" ({d.fragmentation:.0%} of reserved)"
    )
    if d.segments:
        lines.append(
            f"largest free block {_b(d.largest_free_block)}"
            + (
                f"; the failing request was {_b(d.failing_request)}"
                f" ({'it would fit' if d.fits_largest_free else 'it does not fit'})"
                if d.failing_request and d.fits_largest_free is not None
                else ""
            )
        )
    elif d.failing_request:
        lines.append(f"the failing request was {_b(d.failing_request)}")
    if d.growing:
        since = f" over the last {d.growing_since_s:.0f} s" if d.growing_since_s else ""
        lines.append(f"allocation sites that grew most{since} (a leak's suspects):")
        lines += [
            f"  +{_b(int(g['grew_bytes'])):>10}  now {_b(int(g['bytes'])):>11}  {g['where']}"
            for g in d.growing
        ]
    if d.top_sites:
        lines.append("top live allocations by site:")
        lines += [f"  {_b(s.bytes):>11}  {s.blocks:5} blocks  {s.where}" for s in d.top_sites]
    lines.append("remedies:")
    lines += [f"  - {r}" for r in d.remedies]
    if d.thin:
        lines.append("evidence is thin:")
        lines += [f"  - {t}" for t in d.thin]
    return "\n".join(lines)


def write_bundle(
    folder: Path | str,
    *,
    node: str,
    device: str,
    job: str | None,
    alert: Mapping[str, Any],
    samples: Sequence[Mapping[str, Any]],
    allocator: Mapping[str, Any],
    processes: Sequence[Mapping[str, Any]],
    snapshot: Mapping[str, Any] | None,
    failing_request_bytes: int | None = None,
    growing: Sequence[Mapping[str, Any]] = (),
    growing_since_s: float | None = None,
) -> Path:
    """Write one bundle into ``folder`` (created if needed); its path names the domain and
    the time, so two alerts never overwrite each other."""
    now = time.time()
    body = {
        "format": BUNDLE_FORMAT,
        "created_at": now,
        "node": node,
        "device": device,
        "job": job,
        "alert": dict(alert),
        "samples": [dict(s) for s in samples],
        "allocator": dict(allocator),
        "processes": [dict(p) for p in processes],
        "snapshot": dict(snapshot) if snapshot is not None else None,
        "failing_request_bytes": failing_request_bytes,
        "growing_sites": [dict(g) for g in growing],
        "growing_since_s": growing_since_s,
    }
    out = Path(folder)
    out.mkdir(parents=True, exist_ok=True)
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{node}-{device}")
    path = out / f"oomcast-{safe}-{int(now * 1000)}.json.gz"
    tmp = path.with_suffix(".tmp")
    tmp.write_bytes(gzip.compress(json.dumps(body, separators=(",", ":")).encode()))
    tmp.replace(path)  # a reader never sees half a bundle
    return path
