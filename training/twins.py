"""Leak twins of near misses: what any forecaster must do on a near miss if it is to warn
every leak 30 s ahead.

A near miss climbs, then stops short of its limit. Take the first moment of its climb where
it still keeps its pace (its last 10 s at least half as fast as its 30 s fit) and that pace
(the slower of the two), kept up, reaches the limit in under 30 s, and let a *twin* go on
from there in a straight line at that pace until it OOMs: a leak by the forecaster issue's
own words ("a climb that keeps its pace to the limit is a leak, however early"). The twin's
domain records the same samples and events as the near miss's up to that moment (the
*fork*), and the latest alert that warns the twin 30 s ahead (its *deadline*) comes before
the twin's first sample of its own. So every detector that reads the domain's stream,
whatever it is, sees the same records until the deadline and alerts on both or on neither:
it warns the twin in time only by alerting on the near miss.

A twin counts only where a forecaster that waits for the evidence gate's 30 s of growth
(``model/network.py``) could warn it: at the deadline the level had been growing for 30 s,
by the growth tracker's measure and by how long the climb had lasted (so the twin OOMs 60 s
or more into its run: a *long* OOM, ``training/classes.py``). Only traces without an OOM on
any domain are read, so the near miss is scored as one (``oomcast evaluate`` scores a trace
with an OOM by that OOM).

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
import re
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from oomcast.model.embedding import FEATURES, level_frac
from oomcast.model.network import GATE_GROWTH_S
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import Trace, load_trace, write_trace
from oomcast.training.classes import CENSOR_S, NEAR_LEVEL
from oomcast.training.dataset import Sequence, sequences_of_trace
from oomcast.training.evidence import run_cli, traces_in

LEAD_S = 30.0  # the lead the recall goal asks for
RISE_OVER_S = 10.0  # a tick is in a climb when it stands above the level this long before
RISE_EPS = 0.002  # by more than this (a fifth of a percent of the limit)
KEEPS_PACE = 0.5  # a climb whose last 10 s are slower than this share of its 30 s is stopping
_LEVEL = FEATURES.index("level_frac")
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
    growth_at_deadline_s: float  # the growth tracker's growth age at the twin's deadline
    climb_at_deadline_s: float  # how long the level had been climbing then

    @property
    def oom_after_s(self) -> float:
        """When the twin's line reaches the limit."""
        return self.fork_s + (1.0 - self.level) * 100.0 / self.pace_pct_per_s

    @property
    def deadline_s(self) -> float:
        return self.oom_after_s - LEAD_S


def find_fork(seq: Sequence) -> Fork | None:
    """The first tick of a near miss whose twin is a long leak with 30 s of growth behind
    its deadline, and whose deadline lies at or before the tick and before the run's last
    60 s (an alert there would be scored as censored, not as a warned near miss); None where
    no tick has one (the climb was never fast enough that near the limit, or not long
    enough).

    Growth is held to two measures, and must last the gate's 30 s by both: the growth
    tracker's (``log1p_growth_age_s``, what the shipped gate reads: the widest window whose
    slope is beyond noise, which can run ahead of the climb) and how long every tick has
    stood above the level 10 s before it (how long the climb has lasted)."""
    if seq.ooms or seq.max_level < NEAR_LEVEL or seq.known is None:
        return None
    # each row's time after the first sample: a run without an OOM knows its future up to
    # its end, span_s after its first sample
    tick_s = seq.span_s - seq.known
    growth = np.expm1(seq.x[:, _GROWTH].astype(np.float64))
    levels = seq.x[:, _LEVEL].astype(np.float64)
    for i in range(len(tick_s)):
        # a climb that keeps its pace: the last 10 s at least half as fast as the 30 s
        # fit (one that is stopping is not, whatever its 30 s fit still holds), and the
        # twin goes on at the slower of the two
        pace_30s, pace_10s = float(seq.x[i, _PACE]), float(seq.x[i, _PACE_10S])
        if pace_10s < KEEPS_PACE * pace_30s:
            continue
        pace = min(pace_30s, pace_10s)
        level = float(levels[i])
        if pace <= 0.0 or growth[i] <= 0.0 or level >= 1.0:
            continue
        left_s = (1.0 - level) * 100.0 / pace
        if left_s > LEAD_S:  # (the growth asked for below also makes the twin long)
            continue
        deadline = tick_s[i] + left_s - LEAD_S  # at or before this tick
        if deadline >= seq.span_s - CENSOR_S:
            # an alert this late in the run is scored as censored, not as a warned near
            # miss: the twin would cost the near miss nothing
            continue
        j = int(np.searchsorted(tick_s, deadline, side="right")) - 1
        if j < 0 or growth[j] < GATE_GROWTH_S - 1e-6:
            continue
        climb = _climb_s(levels, tick_s, j)
        if climb < GATE_GROWTH_S - 1e-6:
            continue
        return Fork(float(tick_s[i]), level, pace, float(growth[j]), climb)
    return None


def _climb_s(levels: np.ndarray, tick_s: np.ndarray, j: int) -> float:
    """How long the level had been climbing at tick ``j``: back from it, every tick stands
    more than ``RISE_EPS`` above the level ``RISE_OVER_S`` before it; the climb is counted
    from the earliest such tick."""
    start = float(tick_s[j])
    for m in range(j, -1, -1):
        k = int(np.searchsorted(tick_s, tick_s[m] - RISE_OVER_S, side="right")) - 1
        if k < 0 or levels[m] - levels[k] <= RISE_EPS:
            break
        start = float(tick_s[m])
    return float(tick_s[j]) - start


def twin_records(trace: Trace, domain: tuple[str, str], fork: Fork) -> list[Record]:
    """The trace with ``domain`` turned into its leak twin: every sample up to the fork as
    recorded; after it, the fork's sample again at the recording's own interval, lifted onto
    the fork's line, until it reaches the limit, where the twin OOMs. What the domain
    recorded after the fork (the plateau, a job's teardown, its normal exit) is left out;
    its other events, and other domains, are kept."""
    exit_ts = trace.exit_ts(domain)
    samples = [s for s in trace.samples[domain] if exit_ts is None or s.ts <= exit_ts]
    first = samples[0].ts
    fork_ts = first + fork.fork_s + 1e-6  # the fork's sample, whatever the float rounding
    shared = [s for s in samples if s.ts <= fork_ts]
    step = float(np.median(np.diff([s.ts for s in samples]))) if len(samples) > 1 else 1.0
    out: list[Sample] = list(shared)
    base = shared[-1]
    oom_ts: float | None = None
    for k in range(1, int((fork.oom_after_s - fork.fork_s + 60.0) / step) + 2):
        ts = base.ts + k * step
        line = fork.level + fork.pace_pct_per_s / 100.0 * (ts - fork_ts)
        lift = max(0, math.ceil((line - level_frac(base)) * base.total_bytes))
        twin = _lifted(replace(base, ts=ts), lift)
        short = math.ceil((line - level_frac(twin)) * base.total_bytes)
        if short > 0 and twin.allocated_bytes is not None and twin.kind == "host":
            # use and peak stopped at the capacity, and the peak's share above use with
            # them: the anonymous memory takes the rest, so the twin stays on its line
            twin = replace(twin, allocated_bytes=twin.allocated_bytes + short)
        out.append(twin)
        if _full(twin):
            oom_ts = ts
            break
    if oom_ts is None:  # a line with a positive pace reaches the limit: only bad input
        raise ValueError(f"{trace.path}: the twin of {domain[1]} does not reach its limit")
    if oom_ts - LEAD_S >= out[len(shared)].ts:  # the twin's own samples come after it
        raise ValueError(
            f"{trace.path}: the twin of {domain[1]} OOMs at {oom_ts - first:.1f} s, so its"
            f" deadline is not before its first sample of its own"
        )
    records: list[Record] = list(out)
    for d, ss in trace.samples.items():
        if d != domain:
            records.extend(ss)
    records.extend(e for e in trace.events if e.domain != domain or e.ts <= fork_ts)
    records.append(Event(ts=oom_ts, node=domain[0], device=domain[1], event="oom", job=base.job))
    records.sort(key=lambda r: (r.ts, isinstance(r, Event)))
    return records


def _full(s: Sample) -> bool:
    """Where the twin OOMs: a cgroup when its anonymous level (``level_frac``: page cache
    is reclaimed first) reaches the limit; a GPU when its level or use does."""
    if s.kind == "host" and s.allocated_bytes is not None:
        return level_frac(s) >= 1.0
    return level_frac(s) >= 1.0 or s.used_bytes >= s.total_bytes


def _lifted(s: Sample, lift: int) -> Sample:
    """``lift`` more bytes in use: allocated and reserved grow by it, use and peak too, up
    to the capacity (a cgroup's use counts page cache that would be reclaimed)."""
    if lift <= 0:
        return s
    total = s.total_bytes
    return replace(
        s,
        used_bytes=min(total, s.used_bytes + lift),
        allocated_bytes=None if s.allocated_bytes is None else s.allocated_bytes + lift,
        reserved_bytes=None if s.reserved_bytes is None else min(total, s.reserved_bytes + lift),
        peak_bytes=None if s.peak_bytes is None else min(total, s.peak_bytes + lift),
    )


@dataclass(frozen=True)
class NearMiss:
    source: Path
    domain: tuple[str, str]
    peak: float
    fork: Fork | None


def near_misses(paths: list[Path]) -> list[tuple[NearMiss, Trace]]:
    """Every domain that came within 10% of its limit, in the traces of ``paths`` without
    an OOM, with its fork (None: it has no twin)."""
    out = []
    for path in paths:
        trace = load_trace(path)
        if trace.ooms:
            continue
        for domain, samples in trace.samples.items():
            events = [e for e in trace.events if e.domain == domain]
            alone = Trace(trace.path, {domain: samples}, events)
            seqs = sequences_of_trace(alone, path.name)
            if not seqs or seqs[0].max_level < NEAR_LEVEL:
                continue
            fork = find_fork(seqs[0])
            out.append((NearMiss(path, domain, seqs[0].max_level, fork), trace))
    return out


def write_twins(found: list[tuple[NearMiss, Trace]], out: Path) -> list[dict[str, object]]:
    """Write the twins of ``found`` under ``out`` with a manifest (cause ``leak_twin``);
    returns the manifest's entries, with the OOM each twin was written with."""
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*-twin.jsonl.gz"):  # an earlier run's, which may not fork now
        stale.unlink()
    entries: list[dict[str, object]] = []
    for nm, trace in found:
        if nm.fork is None:
            continue
        name = nm.source.name.removesuffix(".gz").removesuffix(".jsonl")
        several = sum(other.source == nm.source for other, _ in found) > 1
        device = "-" + re.sub(r"[^A-Za-z0-9_.-]+", "_", nm.domain[1]) if several else ""
        file = f"{name}{device}-twin.jsonl.gz"
        records = twin_records(trace, nm.domain, nm.fork)
        write_trace(out / file, records)
        oom = next(r for r in records if isinstance(r, Event) and r.event == "oom")
        first = trace.samples[nm.domain][0].ts
        entries.append({
            "file": file, "cause": "leak_twin", "source": nm.source.name,
            "fork_s": round(nm.fork.fork_s, 1), "oom_after_s": round(oom.ts - first, 1),
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
    return run_cli(p.prog, lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    found = near_misses(traces_in(args.folder, args.split))
    for nm, _ in found:
        f = nm.fork
        if f is None:
            print(
                f"none {nm.source.name:44s} peak {nm.peak:.3f}: no tick whose pace reaches"
                f" the limit within {LEAD_S:g} s with {GATE_GROWTH_S:g} s of growth behind the"
                f" deadline"
            )
            continue
        print(
            f"fork {nm.source.name:44s} peak {nm.peak:.3f}: at {f.fork_s:6.1f} s, level"
            f" {f.level:.2f}, pace {f.pace_pct_per_s:.2f} %/s; the twin OOMs at"
            f" {f.oom_after_s:6.1f} s (its line), deadline {f.deadline_s:6.1f} s; growth then"
            f" {f.growth_at_deadline_s:.0f} s by the tracker, a climb of"
            f" {f.climb_at_deadline_s:.0f} s"
        )
    forked = sum(nm.fork is not None for nm, _ in found)
    print(
        f"runs within {100 * (1 - NEAR_LEVEL):g}% of their limit without an OOM {len(found)}:"
        f" {forked} share their past with a warnable leak up to its deadline (a detector"
        f" that warns every such leak {LEAD_S:g} s ahead alerts on each of them)"
    )
    if args.out is not None:
        entries = write_twins(found, args.out)
        print(f"wrote {len(entries)} twins to {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
