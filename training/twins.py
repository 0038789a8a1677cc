"""Leak twins of near misses: what any forecaster must do on a near miss if it is to warn
every leak 30 s ahead.

A near miss climbs, then stops short of its limit. Take the moment of its climb where its
pace (over the last 30 s and the last 10 s, the slower), kept up, reaches the limit in
under 30 s, and let a *twin* go on at that pace
until it OOMs: a leak by the forecaster issue's own words ("a climb that keeps its pace to
the limit is a leak, however early"). The twin's memory equals the near miss's up to that
moment (the *fork*), and the latest alert that warns the twin 30 s ahead (its *deadline*)
comes at or before the fork. So every detector that reads the stream, whatever it is, sees
the same samples until the deadline and alerts on both or on neither: it warns the twin in
time only by warning the near miss.

A twin counts only where the evidence gate (``model/network.py``) would let a forecaster
warn it: at the deadline the level had grown beyond noise for the gate's 30 s, and the twin
OOMs 60 s or more into its run (a *long* OOM, ``training/classes.py``).

    python -m oomcast.training.twins training/traces/jobs --split test --out data/twins/test
    oomcast evaluate --traces data/twins/test --min-lead 30

writes one twin per near miss that has a fork (and a manifest naming its source), and
prints every near miss with its fork or the reason it has none. Scoring the twins beside
their near misses shows the trade-off on the detector at hand.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from oomcast.model.embedding import FEATURES, level_frac
from oomcast.model.network import GATE_GROWTH_S
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import Trace, load_trace, write_trace
from oomcast.training.classes import LONG_AFTER_S, NEAR_LEVEL
from oomcast.training.dataset import Sequence, sequences_of_trace
from oomcast.training.evidence import _paths

LEAD_S = 30.0  # the lead the recall goal asks for
_LEVEL = FEATURES.index("level_frac")
_AGE = FEATURES.index("log1p_age_s")
_GROWTH = FEATURES.index("log1p_growth_age_s")
_PACE = FEATURES.index("slope_30s_pct_per_s")
_PACE_10S = FEATURES.index("slope_10s_pct_per_s")


@dataclass(frozen=True)
class Fork:
    """Where a near miss and its leak twin part. Times are seconds after the near miss's
    first sample."""

    fork_s: float
    level: float  # the level at the fork, a fraction of the limit
    pace_pct_per_s: float  # the pace the twin keeps (its 10 s or 30 s pace, the slower)
    growth_at_deadline_s: float  # growth beyond noise at the twin's deadline

    @property
    def oom_after_s(self) -> float:
        """When the twin's line reaches the limit."""
        return self.fork_s + (1.0 - self.level) * 100.0 / self.pace_pct_per_s

    @property
    def deadline_s(self) -> float:
        return self.oom_after_s - LEAD_S


def find_fork(seq: Sequence) -> Fork | None:
    """The first tick of a near miss whose twin is a long leak that the gate lets a
    forecaster warn 30 s ahead only by alerting inside the shared past; None where no tick
    has one (the climb was never fast enough that near the limit, or not long enough)."""
    if seq.ooms or seq.max_level < NEAR_LEVEL:
        return None
    age = np.expm1(seq.x[:, _AGE].astype(np.float64))
    growth = np.expm1(seq.x[:, _GROWTH].astype(np.float64))
    for i in range(len(age)):
        # the slower of the last 10 s and the 30 s fit: a climb that has already
        # stopped is not one that keeps its pace, whatever its 30 s fit still holds
        pace = float(min(seq.x[i, _PACE], seq.x[i, _PACE_10S]))
        level = float(seq.x[i, _LEVEL])
        if pace <= 0.0 or growth[i] <= 0.0 or level >= 1.0:
            continue
        left_s = (1.0 - level) * 100.0 / pace
        if left_s > LEAD_S or age[i] + left_s < LONG_AFTER_S:
            continue
        deadline = age[i] + left_s - LEAD_S  # at or before this tick
        j = int(np.searchsorted(age, deadline, side="right")) - 1
        if j < 0 or growth[j] < GATE_GROWTH_S - 1e-6:
            continue
        return Fork(float(age[i]), level, pace, float(growth[j]))
    return None


def twin_records(trace: Trace, domain: tuple[str, str], fork: Fork) -> list[Record]:
    """The trace with ``domain`` turned into its leak twin: every sample up to the fork as
    recorded; after it the level is lifted onto the fork's line wherever the recording fell
    below it (the same bytes added to use, allocated, reserved and peak), until it reaches
    the limit, where the twin OOMs. The domain's normal exit is dropped; other domains and
    events are kept."""
    samples = trace.samples[domain]
    first = samples[0].ts
    fork_ts = first + fork.fork_s
    out: list[Sample] = []
    oom_ts: float | None = None
    # past the end of the recording (a run that exited mid-climb), the last sample is
    # repeated at the recording's own interval, lifted onto the line
    step = float(np.median(np.diff([s.ts for s in samples]))) if len(samples) > 1 else 1.0
    limit_s = fork.oom_after_s + 60.0
    extra = (
        replace(samples[-1], ts=samples[-1].ts + k * step)
        for k in range(1, int(limit_s / step) + 2)
    )
    for s in (*samples, *extra):
        if s.ts <= fork_ts:
            out.append(s)
            continue
        line = fork.level + fork.pace_pct_per_s / 100.0 * (s.ts - fork_ts)
        lift = max(0, math.ceil((line - level_frac(s)) * s.total_bytes))
        twin = _lifted(s, lift)
        if level_frac(twin) >= 1.0 or twin.used_bytes >= twin.total_bytes:
            out.append(_lifted(s, min(lift, s.total_bytes - s.used_bytes)))
            oom_ts = s.ts
            break
        out.append(twin)
        if s.ts - first > limit_s:
            break
    if oom_ts is None:  # a line with a positive pace reaches the limit: only bad input
        raise ValueError(f"{trace.path}: the twin of {domain[1]} does not reach its limit")
    job = samples[-1].job
    records: list[Record] = list(out)
    for d, ss in trace.samples.items():
        if d != domain:
            records.extend(ss)
    records.extend(e for e in trace.events if e.domain != domain)
    records.append(Event(ts=oom_ts, node=domain[0], device=domain[1], event="oom", job=job))
    records.sort(key=lambda r: (r.ts, isinstance(r, Event)))
    return records


def _lifted(s: Sample, lift: int) -> Sample:
    if lift <= 0:
        return s
    return replace(
        s,
        used_bytes=s.used_bytes + lift,
        allocated_bytes=None if s.allocated_bytes is None else s.allocated_bytes + lift,
        reserved_bytes=None if s.reserved_bytes is None else s.reserved_bytes + lift,
        peak_bytes=None if s.peak_bytes is None else s.peak_bytes + lift,
    )


@dataclass(frozen=True)
class NearMiss:
    source: Path
    domain: tuple[str, str]
    peak: float
    fork: Fork | None


def near_misses(paths: list[Path]) -> list[tuple[NearMiss, Trace]]:
    out = []
    for path in paths:
        trace = load_trace(path)
        for domain, samples in trace.samples.items():
            if trace.oom_ts(domain) is not None:
                continue
            alone = Trace(
                trace.path, {domain: samples}, [e for e in trace.events if e.domain == domain]
            )
            for seq in sequences_of_trace(alone, path.name):
                if seq.max_level >= NEAR_LEVEL:
                    out.append((NearMiss(path, domain, seq.max_level, find_fork(seq)), trace))
    return out


def write_twins(found: list[tuple[NearMiss, Trace]], out: Path) -> list[dict[str, object]]:
    """Write the twins of ``found`` under ``out`` with a manifest (cause ``leak_twin``);
    returns the manifest's entries."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*-twin.jsonl.gz"):  # an earlier run's, which may not fork now
        stale.unlink()
    entries: list[dict[str, object]] = []
    for nm, trace in found:
        if nm.fork is None:
            continue
        name = nm.source.name.removesuffix(".gz").removesuffix(".jsonl")
        file = f"{name}-twin.jsonl.gz"
        write_trace(out / file, twin_records(trace, nm.domain, nm.fork))
        entries.append({
            "file": file, "cause": "leak_twin", "source": nm.source.name,
            "fork_s": round(nm.fork.fork_s, 1), "oom_after_s": round(nm.fork.oom_after_s, 1),
        })  # fmt: skip
    (out / "manifest.json").write_text(json.dumps({"runs": entries}, indent=1) + "\n")
    return entries


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m oomcast.training.twins",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("folder", type=Path)
    p.add_argument("--split", choices=("train", "val", "test"))
    p.add_argument("--out", type=Path, help="write the twins (and a manifest) here")
    args = p.parse_args(argv)
    found = near_misses(_paths(args.folder, args.split))
    for nm, _ in found:
        f = nm.fork
        if f is None:
            print(
                f"none {nm.source.name:44s} peak {nm.peak:.3f}: no tick whose pace"
                f" reaches the limit within {LEAD_S:g} s with the gate open"
            )
            continue
        print(
            f"fork {nm.source.name:44s} peak {nm.peak:.3f}: at {f.fork_s:6.1f} s, level"
            f" {f.level:.2f}, pace {f.pace_pct_per_s:.2f} %/s; the twin OOMs at"
            f" {f.oom_after_s:6.1f} s, deadline {f.deadline_s:6.1f} s, growth"
            f" {f.growth_at_deadline_s:.0f} s then"
        )
    forked = sum(nm.fork is not None for nm, _ in found)
    print(
        f"near misses {len(found)}: a warnable leak twin shares the past of {forked} up to"
        f" its deadline; a detector that warns every such leak {LEAD_S:g} s ahead warns"
        f" at least {forked} of them"
    )
    if args.out is not None:
        entries = write_twins(found, args.out)
        print(f"wrote {len(entries)} twins to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
