"""A job written for CUDA (.cuda(), .to("cuda"), device="cuda") runs as is."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from oomcast.preflight import PreflightJob
from oomcast.preflight.capture import capture_job


def _job(cuda: bool) -> PreflightJob:
    def model() -> nn.Module:
        m = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))
        return m.cuda().to("cuda") if cuda else m

    def batch(size: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if cuda:
            x = torch.randn(size, 64).cuda(non_blocking=True)
            return x, torch.randint(0, 10, (size,), device="cuda")
        return torch.randn(size, 64), torch.randint(0, 10, (size,))

    def loss(m: nn.Module, b: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = (b[0].to("cuda:0"), b[1].to(torch.device("cuda"))) if cuda else b
        return nn.functional.cross_entropy(m(x), y)

    return PreflightJob(
        name="cuda" if cuda else "plain", model=model, batch=batch, loss=loss, batch_size=16
    )


@pytest.mark.parametrize("fake", [True, False])
def test_cuda_moves_land_on_the_capture_device(fake: bool) -> None:
    cuda = capture_job(_job(cuda=True), fake=fake)
    plain = capture_job(_job(cuda=False), fake=fake)
    assert cuda.persistent_bytes() == plain.persistent_bytes() > 0
    assert cuda.peak_live_bytes() == plain.peak_live_bytes()
    assert [(o.alloc, o.size, o.phase) for o in cuda.ops] == [
        (o.alloc, o.size, o.phase) for o in plain.ops
    ]


def test_module_methods_are_restored_after_the_capture() -> None:
    before = (nn.Module.to, nn.Module.cuda)
    capture_job(_job(cuda=True))
    assert (nn.Module.to, nn.Module.cuda) == before


def test_a_fake_dtype_conversion_is_refused_with_the_phase() -> None:
    job = _job(cuda=False)
    job.model = lambda: nn.Linear(8, 8).half()
    with pytest.raises(RuntimeError, match="phase other of step -1"):
        capture_job(job)
