"""bench/inference.py: the benchmark runs end to end and reports what it measured (figures are
printed by `oomcast bench inference`, never asserted)."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from support import oomcast_cmd

from oomcast.bench.inference import bench_inference


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_bench_inference_reports_every_figure_and_restores_the_cpu_set() -> None:
    before = os.sched_getaffinity(0)
    out = bench_inference(seconds=0.02, sizes=(1, 50), window_runs=5)
    assert os.sched_getaffinity(0) == before
    assert out["provider"] == "CPUExecutionProvider" and out["cores"] == 1
    for n in (1, 50):
        for key in (
            f"us_per_sample_{n}",
            f"us_per_sample_{n}_embedded_in_service",
            f"onnx_only_us_per_sample_{n}",
        ):
            assert out[key] > 0, key
    for key in ("window_p50_ms", "window_p99_ms", "window_stepped_p50_ms"):
        assert out[key] > 0


@pytest.mark.slow
def test_cli_bench_json() -> None:
    done = subprocess.run(
        [*oomcast_cmd("bench", "inference", "--json", "--seconds", "0.02")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["window_samples"] == 300
