"""Scenario generators: realistic GPU memory traces from captured allocation logs.

A scenario replays the allocation log of a real (CPU) PyTorch training loop, with its byte
sizes scaled to a GPU job, through the caching-allocator simulator, on a GPU of a given
size, and adds what the GPU holds outside the allocator: the CUDA context, library
workspaces, NCCL buffers from the first collective, and other processes. Each family is a
way real jobs run out of memory, or only look as if they will:

OOM: ``leak``, ``seq_growth``, ``fragmentation``, ``eval_no_grad``, ``optimizer_state``,
``checkpoint_spike``, ``neighbour``.  No OOM: ``steady``, ``plateau``, ``spikes``.

Everything is drawn from a ``random.Random(seed)``, so a trace is a pure function of its
parameters.

Samples carry what the in-job hook would publish beside the memory figures: ``step`` (the
training steps completed) and ``phase`` (the phase the sample ends: ``other`` while the
weights load, then ``forward``, ``backward``, ``optimizer``, ``eval``, ``checkpoint``). A job
whose family has a scheduled phase (``eval_no_grad``: evals; ``checkpoint_spike`` and
``spikes``: checkpoints; ``optimizer_state``: the first optimizer step) announces a
``schedule`` event at its start (docs/phases.md): eval and checkpoint periods in steps, the
nominal ``step_s``, and the phases' extra bytes as the hook knows them: for a share of the
jobs (``announce_share``) the figures a preflight run would announce (the allocated bytes
the phase needs above the level before it, and the first optimizer step's absolute peak),
for the others none; then, after each occurrence that needs more than the figure so far,
the figure the CUDA hook measured (the allocator's allocated peak over the phase less the
allocated bytes before it). ``neighbour`` jobs announce nothing: the arrival of another
process on the GPU is not the job's to know. But the scheduler that places the neighbour
may have asked first: for a share of the neighbour traces (the same ``announce_share``) an
``arrival`` event, as ``POST /v1/admit`` with ``arrives_in_s`` records one, comes 10-120 s
before the neighbour starts.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from oomcast.model.events import ARRIVAL, SCHEDULED_PHASES, ArrivalEvent, ScheduleEvent
from oomcast.model.schema import Event, Record, Sample
from oomcast.training.allocator import CachingAllocatorSim, SimOutOfMemory
from oomcast.training.capture import CAPTURES, AllocationLog, Op, cached_capture

MIB = 1 << 20
GIB = 1 << 30
GPU_SIZES_GIB = (16, 24, 40, 48, 80, 94, 141)
INTERVALS_S = (0.1, 0.25, 0.5, 1.0, 2.0)
OOM_FAMILIES = (
    "leak",
    "seq_growth",
    "fragmentation",
    "eval_no_grad",
    "optimizer_state",
    "checkpoint_spike",
    "neighbour",
)
SAFE_FAMILIES = ("steady", "plateau", "spikes")
FAMILIES = OOM_FAMILIES + SAFE_FAMILIES
# Families whose memory grows without bound: a run of one that ends before its OOM has not
# escaped it, it was cut short. Such a trace is censored, not safe, so the simulator runs it
# longer (or draws again) until it does OOM; a run of ``optimizer_state`` or ``neighbour``
# that fits really is safe and is kept as a look-alike.
GROWTH_FAMILIES = ("leak", "seq_growth", "fragmentation", "eval_no_grad", "checkpoint_spike")
MAX_SAMPLES = 3000
PHASE_SHARE = {"forward": 0.35, "backward": 0.55, "optimizer": 0.10}
SCALED_PHASES = ("forward", "backward", "eval")  # activations grow with sequence or batch
# Storages under 1 KiB (scalars, masks, step counters) are left out of the replay: on a GPU
# they share a 2 MiB small-pool segment, and they are a fifth of all operations.
MIN_OP_BYTES = 1024
# Families whose job announces a schedule, and the phases it has (the first optimizer step
# is every job's, but only ``optimizer_state`` makes it the one that matters).
SCHEDULED = {
    "eval_no_grad": ("eval", "optimizer"),
    "checkpoint_spike": ("checkpoint", "optimizer"),
    "spikes": ("checkpoint", "optimizer"),
    "optimizer_state": ("optimizer",),
}
ANNOUNCE_SHARE = 0.5  # share of scheduled jobs whose phases a preflight run announces


class NeighbourOutOfMemory(Exception):
    """The other process on the GPU could not get the memory it asked for."""


@dataclass
class ScenarioParams:
    family: str
    seed: int
    capture: str
    gpu_gib: int
    interval_s: float
    step_s: float
    target_frac: float  # steady peak of the job as a fraction of what the allocator may use
    duration_s: float
    context_mib: int
    workspace_mib: int
    nccl_mib: int  # 0 for a single-GPU job
    expandable_segments: bool
    extra: dict[str, float] = field(default_factory=dict)  # family-specific knobs

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def draw_params(family: str, seed: int) -> ScenarioParams:
    """Random but plausible parameters for one trace of a family."""
    if family not in FAMILIES:
        raise ValueError(f"unknown scenario family {family!r}; choose one of {FAMILIES}")
    r = random.Random(f"{family}:{seed}")
    capture = r.choice(sorted(CAPTURES))
    if family == "fragmentation":
        capture = "varlen"
    extra: dict[str, float] = {}
    target = r.uniform(0.55, 0.80)
    duration = r.uniform(600, 1200)
    interval = r.choice(INTERVALS_S)
    if family == "leak":
        extra["time_to_oom_s"] = r.uniform(90, 900)
    elif family == "seq_growth":
        extra["grow_every_s"] = r.uniform(30, 120)
        extra["grow_by"] = r.uniform(0.08, 0.25)
    elif family == "fragmentation":
        target = r.uniform(0.45, 0.60)
        extra["shape_spread"] = r.uniform(0.2, 0.6)
        extra["drift_per_s"] = r.uniform(0.0005, 0.002)  # longer sequences over time
    elif family == "eval_no_grad":
        extra["eval_every_s"] = r.uniform(60, 240)
        extra["eval_batches"] = float(r.randint(2, 6))
        extra["eval_growth"] = r.uniform(1.3, 2.0)  # each eval keeps more outputs than the last
    elif family == "optimizer_state":
        target = r.uniform(0.85, 1.05)  # weights+grads fit; Adam's state may not
        extra["load_s"] = r.uniform(10, 60)
    elif family == "checkpoint_spike":
        extra["checkpoint_every_s"] = r.uniform(60, 300)
        extra["leak_per_s"] = r.uniform(
            0.0002, 0.001
        )  # slow creep until a checkpoint no longer fits
    elif family == "neighbour":
        extra["arrive_s"] = r.uniform(60, 400)
        extra["neighbour_frac"] = r.uniform(0.25, 0.6)
        extra["ramp_s"] = r.uniform(5, 40)
    elif family == "steady":
        target = r.uniform(0.65, 0.82)
    elif family == "plateau":
        target = r.uniform(0.45, 0.60)
        extra["growth_frac"] = r.uniform(0.15, 0.35)
        extra["tau_s"] = r.uniform(60, 300)
    elif family == "spikes":
        target = r.uniform(0.55, 0.70)
        extra["checkpoint_every_s"] = r.uniform(30, 120)
    return ScenarioParams(
        family=family,
        seed=seed,
        capture=capture,
        gpu_gib=r.choice(GPU_SIZES_GIB),
        interval_s=interval,
        step_s=round(r.uniform(0.2, 2.0), 3),
        target_frac=round(target, 4),
        # at most ~3,000 samples: a 0.1 s collector gives five minutes
        duration_s=round(min(duration, MAX_SAMPLES * interval), 1),
        context_mib=r.randint(300, 500),
        workspace_mib=r.choice((8, 32, 64, 128)),
        nccl_mib=r.choice((0, 0, r.randint(512, 1640))),
        expandable_segments=r.random() < 0.25,
        extra={k: round(v, 5) for k, v in extra.items()},
    )


@dataclass
class _Point:
    t: float
    allocated: int
    reserved: int
    retries: int
    step: int = 0  # training steps completed at this point
    phase: str = "other"  # the phase that ends here
    peak_allocated: int = -1  # the allocator's allocated peak since the previous point

    def __post_init__(self) -> None:
        if self.peak_allocated < self.allocated:
            self.peak_allocated = self.allocated


class _Run:
    """One simulated job on one GPU: the allocator, the log, the clock, the samples."""

    def __init__(
        self, p: ScenarioParams, log: AllocationLog, start_ts: float, node: str, device: str
    ) -> None:
        self.p = p
        self.log = log
        self.rng = random.Random(f"run:{p.family}:{p.seed}")
        self.total = p.gpu_gib * GIB
        self.outside = (p.context_mib + p.workspace_mib) * MIB  # held by the driver and libraries
        self.nccl = 0
        self.neighbour = 0
        self.alloc = CachingAllocatorSim(
            self._capacity(), expandable_segments=p.expandable_segments
        )
        usable = self.total - self.outside - p.nccl_mib * MIB
        self.scale = p.target_frac * usable / max(1, log.peak_bytes("train"))
        self.handles: dict[int, int] = {}
        self.t = 0.0
        self.start_ts = start_ts
        self.node, self.device = node, device
        self.job = f"{p.capture}-{p.family}-{p.seed}"
        self.points: list[_Point] = []
        self.memo: dict[tuple[Any, int, int], list[tuple[float, int, int, str, int]]] = {}
        self._compiled_cache: dict[tuple[int, float], list[tuple[bool, int, int, str]]] = {}
        self.dirty = False
        self.steps_done = 0  # training steps completed (the hook's ``step``)
        self.current = "other"  # the phase running now (the one an OOM happens in)
        # (time, bytes held outside the allocator from then on): context, NCCL, neighbours
        self.outside_events: list[tuple[float, int]] = [(0.0, self.outside)]
        self.peak_reserved = 0  # over the run (the allocator's peaks are reset at each point)

    def set_outside(self, nccl: int | None = None, neighbour: int | None = None) -> None:
        if nccl is not None:
            self.nccl = nccl
        if neighbour is not None:
            self.neighbour = neighbour
        self.outside_events.append((self.t, self.outside + self.nccl + self.neighbour))
        self.alloc.capacity_bytes = self._capacity()

    def outside_at(self, t: float) -> int:
        value = self.outside_events[0][1]
        for when, v in self.outside_events:
            if when > t:
                break
            value = v
        return value

    def _capacity(self) -> int:
        return max(0, self.total - self.outside - self.nccl - self.neighbour)

    def used(self, reserved: int) -> int:
        return self.outside + self.nccl + self.neighbour + reserved

    def mark(self, phase: str = "other") -> None:
        """A point: the allocator's state now, and its allocated peak since the previous
        point (then reset, as the hook resets it at each sample)."""
        s = self.alloc.stats()
        self.points.append(
            _Point(
                self.t,
                s.allocated_bytes,
                s.reserved_bytes,
                s.num_alloc_retries,
                self.steps_done,
                phase,
                s.peak_allocated_bytes,
            )
        )
        self.peak_reserved = max(self.peak_reserved, s.peak_reserved_bytes)
        self.alloc.reset_peak_stats()

    def apply(self, op: Op, factor: float = 1.0) -> None:
        if op.alloc:
            self.handles[op.sid] = self.alloc.malloc(int(op.size * self.scale * factor))
        elif op.sid in self.handles:
            self.alloc.free(self.handles.pop(op.sid))

    def load_weights(self, seconds: float) -> None:
        ops = self.log.persistent
        for i, op in enumerate(ops):
            self.apply(op)
            self.t += seconds / max(1, len(ops))
            if i % max(1, len(ops) // 20) == 0:
                self.mark()
        self.mark()

    def extra(self, size: int) -> int:
        """An allocation outside the captured steps (a leak, an eval that keeps its graph)."""
        self.dirty = True
        return self.alloc.malloc(size)

    def _compiled(self, ops: list[Op], factor: float) -> list[tuple[bool, int, int, str]]:
        key = (id(ops), factor)
        out = self._compiled_cache.get(key)
        if out is None:
            out = [
                (
                    op.alloc,
                    op.sid,
                    int(op.size * self.scale * (factor if op.phase in SCALED_PHASES else 1.0)),
                    op.phase,
                )
                for op in ops
                if not op.alloc or op.size >= MIN_OP_BYTES
            ]
            if factor == 1.0:  # varying factors are one-offs: do not keep them
                self._compiled_cache[key] = out
        return out

    def step(
        self,
        ops: list[Op],
        seconds: float,
        factor: float = 1.0,
        kind: int = 0,
        label: str | None = None,
    ) -> None:
        """Replay one step's ops over ``seconds``, marking the state at each phase's end
        (named by its ops, or ``label``). A training step (no ``label``) counts one more
        completed step at its end. A step that returns the allocator to the state it started
        from is memoized: replaying it again from that state would give the same stats, so
        it is skipped."""
        key = None
        train = label is None
        if factor == 1.0 and not self.dirty:
            key = (self.alloc.state_key(), kind, self.alloc.capacity_bytes)
            cached = self.memo.get(key)
            if cached is not None:
                t0 = self.t
                retries = self.alloc.stats().num_alloc_retries
                last = len(cached) - 1
                for j, (frac, allocated, reserved, phase, peak) in enumerate(cached):
                    self.t = t0 + frac * seconds
                    if j == last and train:
                        self.steps_done += 1
                    self.points.append(
                        _Point(self.t, allocated, reserved, retries, self.steps_done, phase, peak)
                    )
                return
        self.dirty = False
        t0 = self.t
        retries_before = self.alloc.stats().num_alloc_retries
        marks: list[tuple[float, int, int, str, int]] = []
        done = 0.0
        compiled = self._compiled(ops, factor)
        phase = compiled[0][3] if compiled else "forward"
        self.current = label or phase
        malloc, free, handles = self.alloc.malloc, self.alloc.free, self.handles
        for is_alloc, sid, size, op_phase in compiled:
            if op_phase != phase:
                done += PHASE_SHARE.get(phase, 0.0)
                self.t = t0 + done * seconds
                self.mark(label or phase)
                pt = self.points[-1]
                marks.append((done, pt.allocated, pt.reserved, pt.phase, pt.peak_allocated))
                phase = op_phase
                self.current = label or phase
            if is_alloc:
                handles[sid] = malloc(size)
            else:
                h = handles.pop(sid, None)
                if h is not None:
                    free(h)
        self.t = t0 + seconds
        if train:
            self.steps_done += 1
        self.mark(label or phase)
        pt = self.points[-1]
        marks.append((1.0, pt.allocated, pt.reserved, pt.phase, pt.peak_allocated))
        # Only a step that needed no retry may be skipped later: a skipped step adds none.
        if (
            key is not None
            and self.alloc.state_key() == key[0]
            and self.alloc.stats().num_alloc_retries == retries_before
        ):
            self.memo[key] = marks


def _train_ops(log: AllocationLog) -> tuple[list[Op], list[Op]]:
    """The first train step (it creates the optimizer state) and a steady one."""
    train = [s for s in log.steps if s.kind == "train"]
    return train[0].ops, train[min(2, len(train) - 1)].ops


def _kind_ops(log: AllocationLog, kind: str) -> list[Op] | None:
    for s in log.steps:
        if s.kind == kind:
            return s.ops
    return None


def _sample_points(
    run: _Run, p: ScenarioParams, oom_t: float | None
) -> tuple[list[Record], list[tuple[int, int] | None]]:
    """NVML-like samples every ``interval_s`` from the state points of the run; and, for
    each sample taken in (or at the end of) a scheduled phase, what the CUDA hook reads of
    that phase's occurrence: the allocated bytes before it began and the allocator's
    allocated peak since (None for the other samples)."""
    records: list[Record] = []
    hook_view: list[tuple[int, int] | None] = []
    pts = run.points
    if not pts:
        return records, hook_view
    end_t = pts[-1].t if oom_t is None else oom_t
    t = 0.0
    i = 0
    peak_used = 0
    occurrence = (pts[0].allocated, pts[0].allocated)  # (level before, allocated peak)
    noise = random.Random(f"noise:{p.family}:{p.seed}")
    while t <= end_t + 1e-9:
        # every point up to t contributes to the peak since the previous sample; a sample
        # whose span saw a scheduled phase end is tagged with it (its peak covers it)
        # with the step it ran at, as the hook's sample at the phase's end
        tag: _Point | None = None
        seen: tuple[int, int] | None = None
        while i + 1 < len(pts) and pts[i + 1].t <= t:
            i += 1
            peak_used = max(peak_used, run.outside_at(pts[i].t) + pts[i].reserved)
            if pts[i].phase in SCHEDULED_PHASES:
                if pts[i - 1].phase != pts[i].phase:  # an occurrence begins
                    occurrence = (pts[i - 1].allocated, pts[i].peak_allocated)
                else:
                    level, high = occurrence
                    occurrence = (level, max(high, pts[i].peak_allocated))
            if _scheduled_end(pts[i]):
                tag = pts[i]
                seen = occurrence
        pt = pts[i]
        if seen is None and pt.phase in SCHEDULED_PHASES:
            seen = occurrence
        used = run.outside_at(t) + pt.reserved
        peak_used = max(peak_used, used)
        jitter = int(noise.gauss(0, 2 * MIB))  # NVML also counts small driver allocations
        used = min(run.total, max(0, used + jitter))
        records.append(
            Sample(
                ts=round(run.start_ts + t, 3),
                node=run.node,
                device=run.device,
                kind="gpu",
                total_bytes=run.total,
                used_bytes=used,
                allocated_bytes=pt.allocated,
                reserved_bytes=pt.reserved,
                peak_bytes=min(run.total, max(used, peak_used)),
                alloc_retries=pt.retries,
                job=run.job,
                step=pt.step if tag is None else tag.step,
                phase=pt.phase if tag is None else tag.phase,
            )
        )
        hook_view.append(seen)
        peak_used = 0
        t += p.interval_s
    return records, hook_view


def _scheduled_end(pt: _Point) -> bool:
    """The point ends an eval, a checkpoint or the first optimizer step (its state
    appears): the phases a schedule times."""
    return pt.phase in ("eval", "checkpoint") or (pt.phase == "optimizer" and pt.step == 1)


def simulate_scenario(
    p: ScenarioParams,
    cache_dir: Path,
    *,
    start_ts: float = 1_700_000_000.0,
    node: str = "sim-node",
    device: str = "gpu0",
    announce_share: float = ANNOUNCE_SHARE,
) -> tuple[list[Record], dict[str, Any]]:
    """Run one scenario; returns its records (ending in an ``oom`` event if it OOMs) and a
    summary for the manifest. ``announce_share``: the chance that a scheduled job's phases
    are announced before they first run (drawn per trace, from its parameters)."""
    if not 0.0 <= announce_share <= 1.0:
        raise ValueError(f"announce_share={announce_share} must be between 0 and 1")
    log = cached_capture(p.capture, cache_dir)
    run = _Run(p, log, start_ts, node, device)
    first_ops, steady_ops = _train_ops(log)
    eval_ops = _kind_ops(log, "eval") or [op for op in steady_ops if op.phase == "forward"]
    ckpt_ops = _kind_ops(log, "checkpoint") or _checkpoint_ops(log)
    oom_t: float | None = None
    oom_job = run.job
    x = p.extra
    r = run.rng
    eval_every = _every_steps(x.get("eval_every_s"), p.step_s)
    ckpt_every = _every_steps(x.get("checkpoint_every_s"), p.step_s)
    try:
        run.load_weights(x.get("load_s", r.uniform(3, 20)))
        if p.nccl_mib:
            run.set_outside(nccl=p.nccl_mib * MIB)  # the first all-reduce creates NCCL's buffers
        run.step(first_ops, p.step_s, kind=1)
        evals = 0
        leaked: list[int] = []
        leak_per_step = _leak_per_step(run, p) if p.family == "leak" else 0
        neighbour_at = x.get("arrive_s", math.inf)
        while run.t < p.duration_s:
            factor = _step_factor(run, p)
            step_s = p.step_s * r.uniform(0.95, 1.05)
            run.step(steady_ops, step_s, factor)
            if leak_per_step:
                leaked.append(run.extra(leak_per_step))  # losses kept with their graphs
            if p.family == "checkpoint_spike" and x["leak_per_s"]:
                leaked.append(run.extra(int(x["leak_per_s"] * step_s * run.total)))
            if eval_every and run.steps_done % eval_every == 0:
                evals += 1
                _eval_spike(run, p, eval_ops, evals)
            if ckpt_every and run.steps_done % ckpt_every == 0:
                run.step(ckpt_ops, p.step_s * 2, kind=2, label="checkpoint")
            if run.t >= neighbour_at and not _ramp_neighbour(run, p, step_s):
                oom_job = f"neighbour-of-{run.job}"
                raise NeighbourOutOfMemory()
    except (SimOutOfMemory, NeighbourOutOfMemory):
        oom_t = run.t
        run.mark(run.current)
    records, hook_view = _sample_points(run, p, oom_t)
    announced = _announced(p, announce_share)
    if p.family in SCHEDULED:
        ops = {"first": first_ops, "steady": steady_ops, "eval": eval_ops, "checkpoint": ckpt_ops}
        figures, peaks = _preflight_figures(run, p, ops, log.persistent) if announced else ({}, {})
        records = _with_schedule(
            records, hook_view, run, p, (eval_every, ckpt_every), figures, peaks
        )
    if oom_t is not None:
        records.append(
            Event(
                ts=round(start_ts + oom_t + 1e-3, 3),
                node=node,
                device=device,
                event="oom",
                job=oom_job,
            )
        )
    arrival = None
    if p.family == "neighbour" and _announced(p, announce_share):
        records, arrival = _with_arrival(records, run, p, start_ts)
    stats = run.alloc.stats()
    summary = {
        "ooms": oom_t is not None,
        "oom_after_s": None if oom_t is None else round(oom_t, 3),
        "samples": sum(1 for rec in records if isinstance(rec, Sample)),
        "scale": round(run.scale, 3),
        "peak_reserved_gib": round(max(run.peak_reserved, stats.peak_reserved_bytes) / GIB, 3),
        "num_alloc_retries": stats.num_alloc_retries,
        "schedule": p.family in SCHEDULED,
        "announced": (p.family in SCHEDULED and announced) or arrival is not None,
    }
    if arrival is not None:
        summary["arrival_announced_s_before"] = round(arrival.lands_at - arrival.ts, 3)
    return records, summary


def _with_arrival(
    records: list[Record], run: _Run, p: ScenarioParams, start_ts: float
) -> tuple[list[Record], ArrivalEvent]:
    """The neighbour's arrival as a scheduler announces it through ``POST /v1/admit``: an
    ``arrival`` event 10-120 s before the neighbour starts (never before the trace's first
    sample), naming what it will take (its whole share of the GPU). Drawn from a generator
    of its own, so the samples are those of the same scenario unannounced."""
    r = random.Random(f"arrival:{p.seed}")
    lands_at = round(start_ts + p.extra["arrive_s"], 3)
    at = round(max(start_ts, lands_at - r.uniform(10.0, 120.0)), 3)
    event = ArrivalEvent(
        ts=at,
        node=run.node,
        device=run.device,
        event=ARRIVAL,
        job=f"neighbour-of-{run.job}",
        need_bytes=int(p.extra["neighbour_frac"] * run.total),
        lands_at=lands_at,
    )
    i = next((k for k, rec in enumerate(records) if rec.ts > at), len(records))
    return [*records[:i], event, *records[i:]], event


def _every_steps(every_s: float | None, step_s: float) -> int | None:
    """A period in seconds as the job schedules it: every so many steps."""
    return None if every_s is None else max(1, round(every_s / step_s))


def _announced(p: ScenarioParams, share: float) -> bool:
    """Whether this job's phases are announced before they run (a preflight run did)."""
    return random.Random(f"announce:{p.family}:{p.seed}").random() < share


def _peak_above(ops: list[Op], scale: float, factor: float = 1.0) -> int:
    """The most bytes ``ops`` hold at once above what was live before them (the ops as the
    replay sees them: scaled, small storages left out): a preflight's estimate, allocated
    bytes, without the allocator's rounding or fragmentation."""
    live: dict[int, int] = {}
    now = peak = 0
    for op in ops:
        if op.alloc:
            if op.size < MIN_OP_BYTES:
                continue
            size = int(op.size * scale * (factor if op.phase in SCALED_PHASES else 1.0))
            live[op.sid] = size
            now += size
            peak = max(peak, now)
        else:
            now -= live.pop(op.sid, 0)
    return peak


def _preflight_figures(
    run: _Run, p: ScenarioParams, ops: dict[str, list[Op]], weights: list[Op]
) -> tuple[dict[str, int], dict[str, int]]:
    """What a preflight run would announce for the job's phases: the extra bytes (for the
    first optimizer step, the most the first train steps need above the loaded weights:
    the first step creates the optimizer state, the next needs its activations beside it;
    one eval, its first: its batches' activations held together; one checkpoint), and the
    first optimizer step's absolute peak (the loaded weights and the first steps together):
    allocated bytes, all of them."""
    first_steps = ops["first"] + ops["steady"]
    figures = {"optimizer": _peak_above(first_steps, run.scale)}
    peaks = {"optimizer": _peak_above(weights + first_steps, run.scale)}
    phases = SCHEDULED[p.family]
    if "eval" in phases:
        keep = max(1, int(p.extra.get("eval_batches", 1) * p.extra.get("eval_growth", 1.0)))
        per_batch = sum(int(op.size * run.scale) for op in ops["eval"] if op.alloc)
        figures["eval"] = keep * per_batch
    if "checkpoint" in phases:
        figures["checkpoint"] = _peak_above(ops["checkpoint"], run.scale)
    return figures, peaks


def _with_schedule(
    records: list[Record],
    hook_view: list[tuple[int, int] | None],
    run: _Run,
    p: ScenarioParams,
    periods: tuple[int | None, int | None],
    announced: dict[str, int],
    announced_peaks: dict[str, int],
) -> list[Record]:
    """The samples with the hook's ``schedule`` events among them: one with the first
    sample (the periods, the nominal step time, the announced figures and peaks), and one
    after each sample that ends a phase which measured more than the figure so far (or for
    the first time). The measure is the CUDA hook's (collectors/hook_phases.py), in
    allocation terms: the allocator's allocated peak over the phase less the allocated
    bytes before it (``hook_view``, one entry per sample, from :func:`_sample_points`). A
    phase that has run no longer has an announced peak."""
    samples = [rec for rec in records if isinstance(rec, Sample)]
    if not samples:
        return records
    eval_every, ckpt_every = periods
    figures = dict(announced)
    peaks = dict(announced_peaks)
    measured: list[str] = []

    def event(ts: float) -> ScheduleEvent:
        return ScheduleEvent(
            ts=ts,
            node=run.node,
            device=run.device,
            event="schedule",
            job=run.job,
            eval_every_steps=eval_every,
            checkpoint_every_steps=ckpt_every,
            step_s=p.step_s,
            phase_extra_bytes=dict(figures),
            measured=tuple(measured),
            phase_peak_bytes=dict(peaks),
        )

    out: list[Record] = [event(samples[0].ts)]
    for s, seen in zip(samples, hook_view, strict=True):
        out.append(s)
        if s.phase in SCHEDULED_PHASES and seen is not None and _measures(s, measured):
            phase = str(s.phase)
            level, high = seen
            extra = max(0, high - level)
            if phase not in measured or extra > figures.get(phase, 0):
                figures[phase] = extra
                if phase not in measured:
                    measured.append(phase)
                peaks.pop(phase, None)
                out.append(event(s.ts))
    return out


def _measures(s: Sample, measured: list[str]) -> bool:
    """The sample ends a phase the hook measures: an eval, a checkpoint, or the first
    optimizer step (once: the later ones find the state already there)."""
    return s.phase in ("eval", "checkpoint") or (
        s.phase == "optimizer" and "optimizer" not in measured
    )


def _leak_per_step(run: _Run, p: ScenarioParams) -> int:
    """Bytes the leak family keeps per step: the headroom after the first step, spread over
    the steps to its time to OOM (give or take)."""
    head = run.alloc.capacity_bytes - run.alloc.stats().reserved_bytes
    steps_to_oom = max(1.0, p.extra["time_to_oom_s"] / p.step_s)
    return int(max(head, 0) / steps_to_oom * run.rng.uniform(0.9, 1.3))


def _step_factor(run: _Run, p: ScenarioParams) -> float:
    """How much larger than the captured step the next steady step is, by family."""
    x, r = p.extra, run.rng
    factor = 1.0
    if p.family == "seq_growth":
        factor = (1 + x["grow_by"]) ** math.floor(run.t / x["grow_every_s"])
    elif p.family == "fragmentation":
        spread = x["shape_spread"]
        base = 1 + x["drift_per_s"] * run.t
        factor = base * r.choice((0.6, 0.8, 1.0, 1.0 + spread / 2, 1.0 + spread))
    elif p.family == "plateau":
        factor = 1 + x["growth_frac"] / p.target_frac * (1 - math.exp(-run.t / x["tau_s"]))
    return factor


def _eval_spike(run: _Run, p: ScenarioParams, eval_ops: list[Op], evals: int) -> None:
    """The ``evals``-th evaluation: its batches' activations held together, then freed."""
    x = p.extra
    keep = int(x.get("eval_batches", 1) * x.get("eval_growth", 1.0) ** evals)
    held: list[int] = []
    run.current = "eval"
    for _ in range(max(1, keep)):  # no torch.no_grad(): activations stay alive
        held.extend(run.extra(int(op.size * run.scale)) for op in eval_ops if op.alloc)
        run.t += p.step_s * 0.3
        run.mark("eval")
    for h in held:
        run.alloc.free(h)
    run.mark("eval")


def _ramp_neighbour(run: _Run, p: ScenarioParams, step_s: float) -> bool:
    """Another process on the same GPU ramps up its own memory, until its share; False when
    the next ramp does not fit on the device (the OOM is the neighbour's doing)."""
    x = p.extra
    if not run.neighbour < x["neighbour_frac"] * run.total:
        return True
    want = min(
        int(x["neighbour_frac"] * run.total),
        run.neighbour + int(x["neighbour_frac"] * run.total * step_s / x["ramp_s"]),
    )
    if run.used(run.alloc.stats().reserved_bytes) + want - run.neighbour > run.total:
        return False
    run.set_outside(neighbour=want)
    return True


def _checkpoint_ops(log: AllocationLog) -> list[Op]:
    """A device-side copy of the weights when the capture has no checkpoint step."""
    ops = [Op(True, -i - 1, op.size, "checkpoint", "") for i, op in enumerate(log.persistent)]
    return ops + [Op(False, op.sid, 0, "checkpoint", "") for op in ops]
