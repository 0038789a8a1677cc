"""The GPU check of preflight on scripts as written, in its CPU dry run: the prediction side
runs, makes no CUDA context, and the truth side is left out without a GPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oomcast.bench.preflight.scripts_gpu import CASES, SCRIPTS, predict, truth


def test_every_case_names_a_script_that_ships() -> None:
    for file, _, _ in CASES.values():
        assert (SCRIPTS / file).is_file(), file


@pytest.mark.slow  # a few seconds of fake training
def test_the_dry_run_predicts_without_a_cuda_context(tmp_path: Path) -> None:
    row = predict("plain_lm_b16", tmp_path)
    assert row["phases"] == ["backward", "eval", "forward", "optimizer", "other"]
    assert row["steps"] == 3 and row["cuda_initialized"] is False
    assert row["peak_allocated_bytes"] > 0
    if not torch.cuda.is_available():
        assert truth("plain_lm_b16", tmp_path) is None


def test_the_example_scripts_compile() -> None:
    for path in SCRIPTS.glob("*.py"):
        subprocess.run([sys.executable, "-m", "py_compile", str(path)], check=True)
