"""Reading and writing traces: JSON Lines, gzip'ed when the file name ends in ``.gz``.

Readers stop at the first bad line with a :class:`TraceError` that names the file and the
line, since a trace with a hole in it would silently skew replay and evaluation.
"""

from __future__ import annotations

import gzip
import io
import json
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO

from oomcast.model.schema import (
    Domain,
    Event,
    OrderChecker,
    Record,
    Sample,
    SchemaError,
    decode_json,
    parse_record,
)

TRACE_SUFFIXES = (".jsonl", ".jsonl.gz")


class TraceError(ValueError):
    def __init__(self, path: Path | str, line: int, message: str) -> None:
        super().__init__(f"{path}:{line}: {message}")
        self.path = str(path)
        self.line = line
        self.message = message


def _open_text(path: Path, mode: str) -> IO[str]:
    if path.name.endswith(".gz"):
        # mtime 0: the same records give the same bytes, run after run
        return io.TextIOWrapper(gzip.GzipFile(path, mode + "b", mtime=0), encoding="utf-8")
    return open(path, mode, encoding="utf-8")


def _open_lines(path: Path) -> gzip.GzipFile | io.BufferedReader:
    # Bytes, decoded line by line: a text wrapper reads ahead and would blame a bad byte
    # on an earlier line.
    return gzip.open(path, "rb") if path.name.endswith(".gz") else open(path, "rb")


def iter_trace(path: Path | str) -> Iterator[Record]:
    """Yield the records of a trace in file order, checking each domain's time order."""
    path = Path(path)
    order = OrderChecker()
    with _open_lines(path) as fh:
        lineno = 0
        while True:
            try:
                line = fh.readline()
            except (OSError, EOFError) as exc:
                raise TraceError(path, lineno + 1, f"unreadable: {exc}") from exc
            if not line:
                return
            lineno += 1
            if not line.strip():
                continue
            try:
                record = parse_record(decode_json(line))
                if isinstance(record, Sample):
                    order.accept(record)
            except SchemaError as exc:
                raise TraceError(path, lineno, str(exc)) from exc
            yield record


@dataclass
class Trace:
    """A whole trace in memory, split by domain."""

    path: str
    samples: dict[Domain, list[Sample]] = field(default_factory=dict)
    events: list[Event] = field(default_factory=list)

    def oom_ts(self, domain: Domain) -> float | None:
        """ts of the first OOM of this domain, or None if it never OOMs."""
        times = [e.ts for e in self.events if e.event == "oom" and e.domain == domain]
        return min(times) if times else None

    def exit_ts(self, domain: Domain) -> float | None:
        """ts of the domain's job ending normally (an ``exit`` event), or None. After a
        normal exit nothing can OOM: a trace that has one says how its job's story ended."""
        times = [e.ts for e in self.events if e.event == "exit" and e.domain == domain]
        return min(times) if times else None

    @property
    def ooms(self) -> bool:
        return any(e.event == "oom" for e in self.events)

    def records(self) -> list[Record]:
        """All records merged back into time order (samples before events at equal ts)."""
        merged: list[Record] = [s for ss in self.samples.values() for s in ss]
        merged.extend(self.events)
        merged.sort(key=lambda r: (r.ts, isinstance(r, Event)))
        return merged


def load_trace(path: Path | str) -> Trace:
    trace = Trace(path=str(path))
    for record in iter_trace(path):
        if isinstance(record, Sample):
            trace.samples.setdefault(record.domain, []).append(record)
        else:
            trace.events.append(record)
    return trace


def write_trace(path: Path | str, records: Iterable[Record]) -> int:
    """Write records as one JSON object per line; returns how many were written."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    n = 0
    with _open_text(path, "w") as fh:
        for record in records:
            fh.write(json.dumps(record.to_dict(), separators=(",", ":")))
            fh.write("\n")
            n += 1
    return n


def find_traces(folder: Path | str) -> list[Path]:
    """Trace files directly in or below a folder, sorted by name."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder of traces")
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name.endswith(TRACE_SUFFIXES))


def nvml_view(sample: Sample) -> Sample:
    """A GPU sample as the NVML source alone would have seen it: whole-GPU use, no allocator
    figures (allocated, reserved, step peak, retries, and the training step and phase come
    only from the in-process hook)."""
    if sample.kind != "gpu":
        return sample
    return replace(
        sample,
        allocated_bytes=None,
        reserved_bytes=None,
        peak_bytes=None,
        alloc_retries=None,
        step=None,
        phase=None,
    )


def as_nvml_sees_it(trace: Trace) -> Trace:
    """The trace with every GPU sample reduced to what NVML alone reports."""
    out = Trace(path=trace.path)
    out.samples = {d: [nvml_view(s) for s in ss] for d, ss in trace.samples.items()}
    out.events = list(trace.events)
    return out


def _check_interval(interval_s: float) -> None:
    if not interval_s > 0 or interval_s == float("inf"):
        raise ValueError(f"interval_s={interval_s} must be a positive number of seconds")


def downsample(samples: list[Sample], interval_s: float) -> list[Sample]:
    """Keep, per domain, one sample per ``interval_s`` of trace time: the first sample, then
    the first sample at or after each point of a grid of ``interval_s`` from it (a sampler
    polling at that period sees about these; a grid, unlike "interval_s after the last one
    kept", does not drift to longer intervals with the source's jitter).

    A kept sample stands for itself and the samples dropped since the previous kept one, so
    its ``peak_bytes`` becomes the highest of their peaks (``used_bytes`` where a sample has
    none): a spike between kept samples is not lost. A kept sample whose group reported no
    peak and whose own use is the highest is kept as it was, so a trace without peaks does
    not gain them where nothing was dropped."""
    _check_interval(interval_s)
    # float noise in unix-second timestamps: ten steps of 0.1 s from 1.75e9 add up to 1 s
    # less about 1e-6 (the spacing of floats there is 2.4e-7)
    slack = min(1e-4, interval_s * 1e-3)
    first_ts: dict[Domain, float] = {}
    next_due: dict[Domain, float] = {}
    peak: dict[Domain, int] = {}  # highest use of the group in progress
    reported: dict[Domain, bool] = {}  # whether any sample of the group reported a peak
    out: list[Sample] = []
    for s in samples:
        d = s.domain
        high = s.used_bytes if s.peak_bytes is None else s.peak_bytes
        if d in peak:
            high = max(high, peak[d])
            seen_peak = reported[d] or s.peak_bytes is not None
        else:
            seen_peak = s.peak_bytes is not None
        due = next_due.get(d)
        if due is None or s.ts >= due - slack:
            t0 = first_ts.setdefault(d, s.ts)
            next_due[d] = t0 + (math.floor((s.ts - t0 + slack) / interval_s) + 1) * interval_s
            peak.pop(d, None)
            reported.pop(d, None)
            if high != s.peak_bytes and (seen_peak or high > s.used_bytes):
                s = replace(s, peak_bytes=high)
            out.append(s)
        else:
            peak[d] = high
            reported[d] = seen_peak
    return out


def downsample_trace(trace: Trace, interval_s: float) -> Trace:
    """The trace with every domain's samples reduced by :func:`downsample`; events as they were."""
    out = Trace(path=trace.path)
    _check_interval(interval_s)
    out.samples = {d: downsample(ss, interval_s) for d, ss in trace.samples.items()}
    out.events = list(trace.events)
    return out
