"""The ground-truth zoo: every job runs for real, and its batch size moves its memory."""

from __future__ import annotations

import math
from collections.abc import Iterator

import pytest
import torch
from torch.utils._pytree import tree_flatten

from oomcast.bench.preflight.zoo import build_zoo, varlen_seq, zoo_row
from oomcast.preflight.capture import capture_job

ZOO = build_zoo()
NAMES = [r.name for r in ZOO]
FAMILIES = {r.family for r in ZOO}


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    # the figures do not depend on it, and the machine is shared: more threads only contend
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_the_zoo_covers_the_families_the_issue_names() -> None:
    assert len(ZOO) >= 10
    assert len(set(NAMES)) == len(NAMES)
    assert {"mlp", "cnn", "rnn", "transformer", "recsys"} <= FAMILIES
    jobs = {r.name: r.job for r in ZOO}
    assert any(not j.eval_no_grad for j in jobs.values())  # an eval without no_grad
    assert any(j.checkpoint == "device_copy" for j in jobs.values())
    assert any(j.grad_accum > 1 for j in jobs.values())
    for r in ZOO:
        small, large = r.batch_sizes
        assert 1 <= small < large and r.job.batch_size == small
        assert small % r.job.grad_accum == 0 and large % r.job.grad_accum == 0


@pytest.mark.parametrize("name", NAMES)
def test_every_job_builds_and_trains_a_real_step(name: str) -> None:
    job = zoo_row(name).job
    torch.manual_seed(0)
    model = job.model()
    opt = job.optimizer(model.parameters())
    before = [p.detach().clone() for p in model.parameters()]
    loss = job.loss(model, job.batch(job.batch_size, 0))
    assert loss.dim() == 0 and math.isfinite(float(loss.detach()))
    loss.backward()  # type: ignore[no-untyped-call]  # torch: unannotated
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
    opt.step()
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True))
    model.eval()
    with torch.no_grad():
        out = (job.eval_step or job.loss)(model, job.batch(job.eval_batch_size or 2, 0))
    assert all(math.isfinite(float(t.float().sum())) for t in tree_flatten(out)[0])


@pytest.mark.parametrize("name", NAMES)
def test_the_larger_batch_needs_more_memory_in_forward_and_backward(name: str) -> None:
    row = zoo_row(name)
    peaks = []
    for bs in row.batch_sizes:
        cap = capture_job(
            row.job, fake=False, device="cpu", batch_size=bs, steps=1, evals=0, checkpoints=0
        )
        peaks.append(max(cap.peak_live_bytes("forward"), cap.peak_live_bytes("backward")))
    assert peaks[1] > peaks[0] > 0


def test_batches_depend_on_shapes_and_step_only() -> None:
    row = zoo_row("gpt_varlen")
    lengths = [varlen_seq(s) for s in range(6)]
    assert lengths == [varlen_seq(s) for s in range(6)]  # the same draws in every run
    assert len(set(lengths)) > 1
    for step, seq in enumerate(lengths[:3]):
        x, y = row.job.batch(4, step)
        assert x.shape == y.shape == (4, seq)


def test_an_unknown_job_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match=r"no zoo job named 'resnet50'.*mlp"):
        zoo_row("resnet50")
