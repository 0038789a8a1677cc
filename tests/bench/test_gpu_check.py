from __future__ import annotations

import pytest
import torch

from oomcast.bench.gpu_check import simulated_oom_step, simulated_peaks
from oomcast.training.capture import capture


def test_simulated_side_of_the_gpu_check() -> None:
    log = capture("mlp", steps=3)
    peaks = simulated_peaks(log)
    assert peaks["peak_reserved"] >= peaks["peak_allocated"] >= log.persistent_bytes()
    # With a leak per step the simulator runs out later when it has more room.
    small = simulated_oom_step(8 << 20, log, 256 << 20)
    large = simulated_oom_step(8 << 20, log, 512 << 20)
    assert small is not None and large is not None and large > small


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_simulator_peaks_within_ten_percent_of_the_gpu() -> None:  # pragma: no cover
    from oomcast.bench.gpu_check import _gpu_run

    run = _gpu_run("mlp", {"model": "mlp"})
    assert abs(run["rel_err_allocated"]) <= 0.10
    assert abs(run["rel_err_reserved"]) <= 0.10
