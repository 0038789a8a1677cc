"""What would make a job fit, each remedy checked by capturing and replaying the job again.

- ``largest_batch``: the largest batch size that fits (powers of two from the largest one not
  above the job's batch, then bisection, so the answer does not depend on the batch the job
  started from; sizes stay multiples of ``grad_accum``), or the note that none does.
- ``expandable_segments``: the same job with ``expandable_segments:True``.
- ``grad_accum``: when the job does not fit, the smallest number of micro-batches that fits
  at the same effective batch size (a divisor of the batch size).
- ``eval_no_grad``: when the job's eval builds a graph, the same eval under ``no_grad``.
- ``checkpoint_cpu``: when the checkpoint copies on the device, copies to host memory.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from oomcast.preflight.allocconf import AllocConf
from oomcast.preflight.job import PreflightJob
from oomcast.preflight.replay import Replay

Check = Callable[[PreflightJob, AllocConf], Replay]

MAX_BATCH_DOUBLINGS = 10  # the search looks at most 2**10 times the job's batch size


@dataclass
class Remedy:
    name: str
    change: str
    peak_reserved_bytes: int
    fits: bool
    # the new batch size or grad_accum, where the remedy has one; for memory_fraction, the
    # fraction in hundredths
    value: int | None = None

    def to_json(self) -> dict[str, object]:
        return {
            "name": self.name,
            "change": self.change,
            "peak_reserved_bytes": self.peak_reserved_bytes,
            "fits": self.fits,
            "value": self.value,
        }


def peak_of(r: Replay) -> int:
    """What a replay needed: its peak reserved, or at its OOM what it held plus the request."""
    return r.peak_reserved_bytes if r.oom is None else r.oom.reserved_bytes + r.oom.requested_bytes


def _bracket(run: Callable[[int], Replay], start: int) -> tuple[int, int | None]:
    """``(lo, hi)`` in batch units: ``lo`` fits (0: nothing does), ``hi`` does not (None:
    none found within the doublings). The search walks powers of two from the largest one
    not above ``start``, so a job started at 64 or at 96 brackets the same interval and
    gets the same answer (it once said 64 from one and 79 from the other)."""
    anchor = 1 << (max(start, 1).bit_length() - 1)
    if run(anchor).fits:
        lo = anchor
        for _ in range(MAX_BATCH_DOUBLINGS):
            if not run(lo * 2).fits:
                return lo, lo * 2
            lo *= 2
        return lo, None
    hi = anchor
    while hi > 1:
        if run(hi // 2).fits:
            return hi // 2, hi
        hi //= 2
    return 0, 1


def largest_fitting(run: Callable[[int], Replay], start: int) -> tuple[int, int | None]:
    """The largest number of batch units that fits, and the smallest above it that does
    not (None: none within the doublings); ``(0, 1)`` when not even 1 fits."""
    lo, hi = _bracket(run, start)
    if lo == 0 or hi is None:
        return lo, hi
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if run(mid).fits:
            lo = mid
        else:
            hi = mid
    return lo, hi


def largest_batch(job: PreflightJob, conf: AllocConf, check: Check) -> Remedy:
    unit = job.grad_accum
    results: dict[int, Replay] = {}

    def run(units: int) -> Replay:
        if units not in results:
            results[units] = check(replace(job, batch_size=units * unit), conf)
        return results[units]

    lo, hi = largest_fitting(run, job.batch_size // unit)
    if lo == 0:
        return Remedy("largest_batch", "no batch size fits, not even 1", peak_of(run(1)), False)
    if hi is None:
        change = f"batch_size {lo * unit} fits (searched no further)"
        return Remedy("largest_batch", change, peak_of(run(lo)), True, lo * unit)
    change = f"batch_size {lo * unit} (the job uses {job.batch_size}; {hi * unit} does not fit)"
    return Remedy("largest_batch", change, peak_of(run(lo)), True, lo * unit)


def grad_accum(job: PreflightJob, conf: AllocConf, check: Check) -> Remedy | None:
    tried = 0
    for k in range(job.grad_accum + 1, job.batch_size + 1):
        if job.batch_size % k:
            continue
        tried += 1
        r = check(replace(job, grad_accum=k), conf)
        if r.fits:
            return Remedy(
                "grad_accum",
                f"grad_accum {k}: {k} micro-batches of {job.batch_size // k},"
                f" same effective batch {job.batch_size}",
                peak_of(r),
                True,
                k,
            )
        if tried >= 8:
            break
    return None


def find_remedies(job: PreflightJob, conf: AllocConf, check: Check, base: Replay) -> list[Remedy]:
    out = [largest_batch(job, conf, check)]
    if not conf.expandable_segments:
        r = check(job, conf.with_expandable())
        out.append(Remedy("expandable_segments", "expandable_segments:True", peak_of(r), r.fits))
    if not base.fits and out[0].value is None:
        # not even batch size 1 fits: no micro-batch of a larger batch can
        change = "no grad_accum can fit: not even batch size 1 does"
        out.append(Remedy("grad_accum", change, out[0].peak_reserved_bytes, False))
    elif not base.fits:
        acc = grad_accum(job, conf, check)
        if acc is not None:
            out.append(acc)
        else:
            change = "no grad_accum fits (up to 8 divisors of the batch size tried)"
            out.append(Remedy("grad_accum", change, peak_of(base), False))
    late: list[tuple[str, str, bool, dict[str, object]]] = [
        (
            "eval_no_grad",
            "run eval under torch.no_grad()",
            not job.eval_no_grad,
            {"eval_no_grad": True},
        ),
        (
            "checkpoint_cpu",
            "checkpoint from CPU copies (.to('cpu'))",
            job.checkpoint == "device_copy",
            {"checkpoint": "cpu_copy"},
        ),
    ]
    for name, change, applies, fields in late:
        if not applies:
            continue
        if _before_first_eval(base):
            # the run is the same up to the OOM, which comes before the first eval/checkpoint
            out.append(Remedy(name, f"{change} (the OOM comes before it)", peak_of(base), False))
            continue
        r = check(replace(job, **fields), conf)  # type: ignore[arg-type]
        out.append(Remedy(name, change, peak_of(r), r.fits))
    return out


def _before_first_eval(r: Replay) -> bool:
    """The OOM happened before step 0's eval and checkpoint (see capture._run_schedule)."""
    oom = r.oom
    return oom is not None and (oom.step < 0 or (oom.step == 0 and oom.phase in _TRAIN))


_TRAIN = ("forward", "backward", "optimizer", "other")
