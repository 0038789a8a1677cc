"""Each remedy, checked again: what it says fits must fit, and the next step must not."""

from __future__ import annotations

from dataclasses import replace

import pytest
from preflight_jobs import MIB, param_bytes, wide_mlp

from oomcast.preflight import preflight
from oomcast.preflight.remedies import Remedy

GIB = 1 << 30


def _remedy(remedies: list[Remedy], name: str) -> Remedy:
    found = [m for m in remedies if m.name == name]
    assert len(found) == 1, [m.name for m in remedies]
    return found[0]


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_the_largest_batch_fits_and_the_next_does_not() -> None:
    job = wide_mlp(1024, 4, 64, checkpoint="none")
    capacity = 512 * MIB
    report = preflight(job, capacity_bytes=capacity, steps=2)
    assert report.fits
    best = _remedy(report.remedies, "largest_batch")
    assert best.fits and best.value is not None and best.value > job.batch_size
    again = preflight(
        replace(job, batch_size=best.value), capacity_bytes=capacity, steps=2, remedies=False
    )
    assert again.fits and again.replay.peak_reserved_bytes == best.peak_reserved_bytes
    over = preflight(
        replace(job, batch_size=best.value + 1), capacity_bytes=capacity, steps=2, remedies=False
    )
    assert not over.fits


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_job_that_does_not_fit_gets_a_smaller_batch_and_grad_accum() -> None:
    # 64 MiB per activation at batch 16384: eight of them do not fit beside the weights
    job = wide_mlp(1024, 8, 16384, checkpoint="none")
    capacity = 640 * MIB
    report = preflight(job, capacity_bytes=capacity, steps=2)
    assert not report.fits
    best = _remedy(report.remedies, "largest_batch")
    assert best.fits and best.value is not None and best.value < job.batch_size
    accum = _remedy(report.remedies, "grad_accum")
    assert accum.fits and accum.value is not None and accum.value > 1
    assert job.batch_size % accum.value == 0
    fits = preflight(
        replace(job, grad_accum=accum.value), capacity_bytes=capacity, steps=2, remedies=False
    )
    assert fits.fits
    smaller = [k for k in range(2, accum.value) if job.batch_size % k == 0]
    for k in smaller:  # the remedy is the smallest k that fits
        assert not preflight(
            replace(job, grad_accum=k), capacity_bytes=capacity, steps=2, remedies=False
        ).fits


@pytest.mark.slow
def test_eval_no_grad_and_checkpoint_from_cpu_apply_only_where_they_change_something() -> None:
    p = param_bytes(4096, 8)
    job = wide_mlp(4096, 8, 8, eval_batch_size=32768, eval_no_grad=False)
    report = preflight(job, capacity_bytes=5 * GIB, steps=2)
    assert report.replay.oom is not None and report.replay.oom.phase == "eval"
    no_grad = _remedy(report.remedies, "eval_no_grad")
    assert no_grad.fits
    ckpt = _remedy(report.remedies, "checkpoint_cpu")
    assert not ckpt.fits  # the eval still OOMs
    # a device checkpoint (3 * P of copies) is what breaks a 3 GiB budget that training fits
    plain = preflight(wide_mlp(4096, 8, 8), capacity_bytes=6 * p, steps=2)
    assert plain.replay.oom is not None and plain.replay.oom.phase == "checkpoint"
    assert _remedy(plain.remedies, "checkpoint_cpu").fits
    assert not [m for m in plain.remedies if m.name == "eval_no_grad"]  # eval uses no_grad
    cpu = preflight(wide_mlp(4096, 8, 8, checkpoint="cpu_copy"), capacity_bytes=6 * p, steps=2)
    assert cpu.fits and not [m for m in cpu.remedies if m.name == "checkpoint_cpu"]
    assert not [m for m in cpu.remedies if m.name == "grad_accum"]  # it fits already


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_expandable_segments_is_offered_unless_set() -> None:
    job = wide_mlp(256, 3, 32)
    off = preflight(job, capacity_bytes=GIB, steps=1)
    assert _remedy(off.remedies, "expandable_segments").fits
    on = preflight(job, capacity_bytes=GIB, steps=1, alloc_conf="expandable_segments:True")
    assert not [m for m in on.remedies if m.name == "expandable_segments"]


def test_the_largest_batch_does_not_depend_on_the_batch_the_search_started_from() -> None:
    """Where fitting is not monotone in the batch (allocator rounding), a search that starts
    from the job's own batch can land on different answers (64 from one start, 90 from
    another); anchored on powers of two, every start brackets the same interval."""
    from oomcast.preflight.remedies import largest_fitting
    from oomcast.preflight.replay import OomAt, Replay

    def run(batch: int) -> Replay:
        r = Replay(1 << 30)
        if not (batch <= 64 or 80 <= batch <= 90):
            r.oom = OomAt(0, "forward", "", 1, 1, 1)
        return r

    answers = {start: largest_fitting(run, start) for start in (64, 65, 96, 100, 127)}
    assert set(answers.values()) == {(90, 91)}, answers
    assert largest_fitting(run, 16) == (90, 91)  # up from 16: 32, 64 fit, 128 does not
