"""Replay a capture through the caching-allocator simulator at a GPU's capacity.

Persistent storages (parameters, buffers, optimizer state made before step 0) are allocated
first, as phase ``other`` of step -1; then every op of the run in order. The replay stops at
the first request the simulated allocator refuses (``SimOutOfMemory``), as the job would.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from oomcast.preflight.allocconf import MIB, AllocConf
from oomcast.preflight.capture import TEARDOWN, JobCapture, PhaseOp, StopCapture
from oomcast.training.allocator import CachingAllocatorSim, SimOutOfMemory


@dataclass
class PhasePeak:
    step: int
    phase: str
    peak_allocated_bytes: int
    peak_reserved_bytes: int


@dataclass
class OomAt:
    """The request the simulated allocator refused, and its state then."""

    step: int
    phase: str
    module: str
    requested_bytes: int
    reserved_bytes: int
    allocated_bytes: int

    @property
    def fragmented(self) -> bool:
        """The cache held at least the request's bytes free, but not in one block: the
        memory was there, in pieces (fragmentation), not taken by live tensors."""
        return self.reserved_bytes - self.allocated_bytes >= self.requested_bytes


@dataclass
class Replay:
    capacity_bytes: int
    phases: list[PhasePeak] = field(default_factory=list)
    peak_allocated_bytes: int = 0
    peak_reserved_bytes: int = 0
    # (reserved - allocated) / reserved when reserved peaked: cache that earlier phases freed
    # and the allocator kept for reuse (normal), not fragmentation (``OomAt.fragmented``)
    cached_free_frac: float = 0.0
    oom: OomAt | None = None
    # one point per op: (allocated, reserved, index into ``phases``)
    timeline: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def fits(self) -> bool:
        return self.oom is None

    @property
    def headroom_bytes(self) -> int:
        """Capacity left at the peak; when it does not fit, minus the bytes missing."""
        if self.oom is None:
            return self.capacity_bytes - self.peak_reserved_bytes
        return self.capacity_bytes - self.oom.reserved_bytes - self.oom.requested_bytes


def make_allocator(
    capacity_bytes: int, conf: AllocConf, total_bytes: int | None = None
) -> CachingAllocatorSim:
    return CachingAllocatorSim(
        capacity_bytes,
        max_split_size=None if conf.max_split_size_mb is None else conf.max_split_size_mb * MIB,
        expandable_segments=conf.expandable_segments,
        max_non_split_rounding_size=conf.max_non_split_rounding_mb * MIB,
        device_total_bytes=total_bytes,
    )


class Replayer:
    """Replays ops one at a time, as they come (``feed``) or all at once (``replay``)."""

    def __init__(
        self, capacity_bytes: int, conf: AllocConf | None = None, total_bytes: int | None = None
    ) -> None:
        self.sim = make_allocator(capacity_bytes, conf or AllocConf(), total_bytes)
        self.result = Replay(capacity_bytes)
        self.base_capacity_bytes = capacity_bytes
        # set_per_process_memory_fraction's, the one in force now and the one in force when
        # the run peaked or ran out (None: none set then)
        self.fraction: float | None = None
        self.fraction_at_peak: float | None = None
        self.handles: dict[int, int] = {}
        self.index: dict[tuple[int, str], int] = {}
        self.done = False

    def feed(self, op: PhaseOp) -> bool:
        """Apply ``op``; False once a request has failed (the OOM is in ``result``)."""
        if self.done or op.phase == TEARDOWN:
            return not self.done  # the run is over: nothing left to learn
        if op.phase == "persistent":
            key = (-1, "other")
        elif op.alloc or not self.result.phases:
            key = (op.step, op.phase)
        else:  # a free is charged to the phase that allocated last: frees never open one
            key = _last(self.result)
        if not self.apply(op, key):
            self.done = True
        return not self.done

    def cap(self, fraction: float, total_bytes: int) -> None:
        """``torch.cuda.set_per_process_memory_fraction(fraction)``: from now on the allocator
        may reserve ``fraction`` of the device's ``total_bytes`` (what torch allows: the
        share of the card's total, not of what the context leaves), never more than the
        capacity it started with. Reserved bytes above a lowered cap stay until freed."""
        allowed = min(self.base_capacity_bytes, int(fraction * total_bytes))
        self.sim.capacity_bytes = allowed
        self.fraction = fraction
        # the result's capacity is the one in force where the run peaked or ran out
        # (``_at_peak``): a cap raised or lowered after that changed nothing the verdict says

    def _at_peak(self) -> None:
        self.result.capacity_bytes = self.sim.capacity_bytes
        self.fraction_at_peak = self.fraction

    def listen(self, op: PhaseOp) -> None:
        """A capture listener: stops the capture at the first OOM."""
        if not self.feed(op):
            raise StopCapture

    def apply(self, op: PhaseOp, key: tuple[int, str]) -> bool:
        sim, res = self.sim, self.result
        if op.alloc:
            try:
                self.handles[op.sid] = sim.malloc(op.size)
            except SimOutOfMemory as exc:
                res.oom = OomAt(
                    key[0], key[1], op.module, op.size, exc.reserved_bytes, exc.allocated_bytes
                )
                self._at_peak()
                return False
        else:
            handle = self.handles.pop(op.sid, None)
            if handle is None:
                return True
            sim.free(handle)
        i = self.index.get(key)
        if i is None:
            i = self.index[key] = len(res.phases)
            res.phases.append(PhasePeak(key[0], key[1], 0, 0))
        st = sim.stats()
        peak = res.phases[i]
        peak.peak_allocated_bytes = max(peak.peak_allocated_bytes, st.allocated_bytes)
        peak.peak_reserved_bytes = max(peak.peak_reserved_bytes, st.reserved_bytes)
        if st.reserved_bytes > res.peak_reserved_bytes:
            res.peak_reserved_bytes = st.reserved_bytes
            res.cached_free_frac = (st.reserved_bytes - st.allocated_bytes) / st.reserved_bytes
            self._at_peak()
        res.peak_allocated_bytes = max(res.peak_allocated_bytes, st.allocated_bytes)
        res.timeline.append((st.allocated_bytes, st.reserved_bytes, i))
        return True


def replay(
    capture: JobCapture,
    capacity_bytes: int,
    conf: AllocConf | None = None,
    total_bytes: int | None = None,
) -> Replay:
    """Run the capture's requests through a fresh simulated allocator of ``capacity_bytes``."""
    rep = Replayer(capacity_bytes, conf, total_bytes)
    for op in [*capture.persistent, *capture.ops]:
        if not rep.feed(op):
            break
    return rep.result


def _last(res: Replay) -> tuple[int, str]:
    p = res.phases[-1]
    return (p.step, p.phase)
