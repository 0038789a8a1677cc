"""Synthetic GPU memory patterns, good enough to show the product working.

Each simulated GPU runs a job whose memory follows one pattern; jobs that reach capacity
emit an ``oom`` event and are restarted after a pause, like a job under a retrying
scheduler. The same GPUs run on wall-clock time (``SimSource``, for the demo and the agent)
or on virtual time (``simulate_trace``, for test traces), deterministic for a seed.
This is a demo source; the realistic allocator simulator lives in ``training/``.

Patterns: ``leak`` climbs steadily from its start-up level and OOMs after one to four
minutes; ``fast_leak`` climbs the same way, faster, and OOMs 62-80 s into its job (so the
demo shows an OOM, and a warning of it, within a minute and a half); ``step_growth`` grows
in steps; ``fragmenting`` is a job whose caching allocator reserves more and more while its
live tensors stay near two thirds of it (the split blocks it caches fit none of its
requests), its retry counter climbing near the end; ``sawtooth``, ``spiky`` and ``plateau``
look busy but never run out of memory.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field

from oomcast.model.schema import Event, Record, Sample

GIB = 1 << 30
PATTERNS = ("leak", "fast_leak", "step_growth", "sawtooth", "spiky", "plateau", "fragmenting")
OOM_PATTERNS = ("leak", "fast_leak", "step_growth", "fragmenting")
FRAGMENTED_LIVE = 0.68  # fragmenting: live tensors' share of what the allocator reserved
# a fast_leak's job time by which even the troughs of its activations reach capacity
FAST_LEAK_OOM_BY_S = (72.0, 78.0)


@dataclass
class SimGPU:
    node: str
    device: str
    pattern: str
    total_bytes: int = 80 * GIB
    seed: int = 0
    restart_after_s: float = 20.0
    time_scale: float = 1.0  # >1 makes everything happen faster
    job: str = ""
    _rng: random.Random = field(init=False, repr=False)
    _job_start: float | None = field(default=None, init=False)
    _down_until: float | None = field(default=None, init=False)
    _restarts: int = field(default=0, init=False)
    _retries: int = field(default=0, init=False)
    _params: dict[str, float] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        if self.pattern not in PATTERNS:
            raise ValueError(f"unknown pattern {self.pattern!r}; choose one of {PATTERNS}")
        self._rng = random.Random(f"{self.seed}:{self.node}:{self.device}")
        self._new_job()

    def _new_job(self) -> None:
        r = self._rng
        self._params = {
            "base": r.uniform(0.30, 0.50),  # weights + optimizer state, fraction of total
            "act": r.uniform(0.05, 0.12),  # activation sawtooth amplitude per step
            "step_s": r.uniform(0.8, 2.0),
            "leak_per_s": r.uniform(0.003, 0.007),  # fraction of total per second
            "step_every_s": r.uniform(15.0, 30.0),
            "step_frac": r.uniform(0.06, 0.10),
            "top": r.uniform(0.80, 0.90),
            "tau_s": r.uniform(20.0, 60.0),
            "spike_every_s": r.uniform(20.0, 40.0),
        }
        if self.pattern == "fast_leak":  # drawn here only: other patterns' draws are unchanged
            self._params["oom_by_s"] = r.uniform(*FAST_LEAK_OOM_BY_S)
        self._retries = 0
        base = self.job or f"{self.pattern}-{self.device}"
        self._job_name = f"{base}-{self._restarts}" if self._restarts else base

    def _frac(self, t: float) -> float:
        p, r = self._params, self._rng
        ctx = 0.006  # CUDA context
        warm = min(1.0, t / 5.0)  # job start-up: weights land in the first seconds
        phase = (t % p["step_s"]) / p["step_s"]
        act = p["act"] * (0.5 + 0.5 * math.sin(2 * math.pi * phase))
        base = p["base"] * warm
        noise = r.gauss(0.0, 0.003)
        if self.pattern == "leak":
            return ctx + base + act + p["leak_per_s"] * t + noise
        if self.pattern == "fast_leak":
            # A leak's steady climb, at the rate that brings the job to capacity at oom_by_s
            # even between activations, whatever its base; with half a leak's activations
            # their peaks get there at most 12% sooner. So it OOMs between ~0.88 and 1.0
            # times oom_by_s (+-1.5 s of noise), however the samples fall on the steps.
            rate = (1.0 - ctx - p["base"]) / p["oom_by_s"]
            return ctx + base + act * 0.5 + rate * t + noise
        if self.pattern == "fragmenting":  # the reserved bytes climb; the live ones lag
            return ctx + base + act * 0.5 + p["leak_per_s"] * 0.8 * t + noise
        if self.pattern == "step_growth":
            return ctx + base + act + p["step_frac"] * math.floor(t / p["step_every_s"]) + noise
        if self.pattern == "sawtooth":
            top = p["top"] + 0.05
            return ctx + (top - 0.10) * warm + 0.10 * ((t % 12.0) / 12.0) + noise
        if self.pattern == "spiky":
            spike = 0.25 if (t % p["spike_every_s"]) < 2.0 else 0.0
            return ctx + 0.55 * warm + act * 0.5 + spike + noise
        # plateau: grows towards top and stays there
        return (
            ctx
            + base
            + act * 0.3
            + (p["top"] - p["base"] - 0.05) * (1 - math.exp(-t / p["tau_s"]))
            + noise
        )

    def advance(self, ts: float) -> list[Record]:
        """The records of this GPU at time ``ts`` (a sample, perhaps followed by an OOM)."""
        if self._down_until is not None:
            if ts < self._down_until:
                return [self._sample(ts, 0.006)]  # only the driver's context while restarting
            self._down_until = None
            self._job_start = None
            self._restarts += 1
            self._new_job()
        if self._job_start is None:
            self._job_start = ts
        t = (ts - self._job_start) * self.time_scale
        frac = max(0.006, self._frac(t))
        if frac >= (0.88 if self.pattern == "fragmenting" else 0.97):
            self._retries += 1
        if frac >= 1.0:
            sample = self._sample(ts, 0.999)
            oom = Event(ts=ts, node=self.node, device=self.device, event="oom", job=self._job_name)
            self._down_until = ts + self.restart_after_s / self.time_scale
            return [sample, oom]
        return [self._sample(ts, frac)]

    def _sample(self, ts: float, frac: float) -> Sample:
        used = int(frac * self.total_bytes)
        ctx = int(0.006 * self.total_bytes)
        reserved = max(0, used - ctx)
        allocated = int(reserved * (FRAGMENTED_LIVE if self.pattern == "fragmenting" else 0.9))
        peak = min(int(used * 1.02), self.total_bytes)
        return Sample(
            ts=round(ts, 3),
            node=self.node,
            device=self.device,
            kind="gpu",
            total_bytes=self.total_bytes,
            used_bytes=used,
            allocated_bytes=allocated,
            reserved_bytes=reserved,
            peak_bytes=peak,
            alloc_retries=self._retries,
            job=self._job_name if self._down_until is None else None,
        )


def default_gpus(node: str, seed: int = 0, time_scale: float = 1.0) -> list[SimGPU]:
    """Four GPUs for the demo: two heading for OOM, two busy but safe."""
    patterns = ("leak", "sawtooth", "step_growth", "spiky")
    return [
        SimGPU(node, f"gpu{i}", pat, seed=seed, time_scale=time_scale)
        for i, pat in enumerate(patterns)
    ]


class SimSource:
    def __init__(self, gpus: list[SimGPU], interval_s: float = 1.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s={interval_s} must be positive")
        self.name = "sim"
        self.gpus = gpus
        self.interval_s = interval_s
        self._next_ts: float | None = None
        self._latest: dict[str, tuple[int, int]] = {}

    def poll(self, now: float) -> list[Record]:
        if self._next_ts is not None and now < self._next_ts:
            return []
        self._next_ts = now + self.interval_s
        out: list[Record] = []
        for gpu in self.gpus:
            out.extend(gpu.advance(now))
        for r in out:
            if isinstance(r, Sample):
                self._latest[r.device] = (r.used_bytes, r.total_bytes)
        return out

    def measure(self, device: str) -> tuple[int, int] | None:
        """(used, capacity) of a simulated GPU at its latest step: the simulator is that
        device, so this is what the agent reads of it before acting (``collectors/proof.py``)."""
        return self._latest.get(device)

    @property
    def exhausted(self) -> bool:
        return False


def simulate_trace(
    pattern: str,
    *,
    seed: int = 0,
    duration_s: float = 600.0,
    interval_s: float = 1.0,
    start_ts: float = 1_700_000_000.0,
    node: str = "sim-node",
    device: str = "gpu0",
    total_bytes: int = 80 * GIB,
    stop_at_oom: bool = True,
) -> list[Record]:
    """One GPU on virtual time; with ``stop_at_oom`` the trace ends at its first OOM."""
    gpu = SimGPU(node, device, pattern, total_bytes=total_bytes, seed=seed)
    records: list[Record] = []
    steps = int(duration_s / interval_s)
    for i in range(steps + 1):
        out = gpu.advance(start_ts + i * interval_s)
        records.extend(out)
        if stop_at_oom and any(isinstance(r, Event) for r in out):
            break
    return records
