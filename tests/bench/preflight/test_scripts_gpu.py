"""The GPU check of preflight on scripts as written, in its CPU dry run: the prediction side
runs, makes no CUDA context, and the truth side is left out without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from oomcast.bench.preflight.scripts_gpu import CASES, SCRIPTS, main, predict, truth


def test_every_case_names_a_script_that_ships() -> None:
    assert len(CASES) >= 24
    for c, _ in CASES.values():
        assert (SCRIPTS / c.file).is_file(), c.file


@pytest.mark.slow  # a few seconds of fake training
def test_the_dry_run_predicts_without_a_cuda_context(tmp_path: Path) -> None:
    row = predict("plain_lm_b8", tmp_path)
    assert {"backward", "eval", "forward", "optimizer"} <= set(row["phases"])
    assert row["steps"] == 3 and row["cuda_initialized"] is False
    assert row["peak_allocated_bytes"] > 0
    if not torch.cuda.is_available():
        assert truth("plain_lm_b8", tmp_path) is None


@pytest.mark.slow  # a few seconds of fake training
def test_predictions_join_truths_from_another_machine(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    real = 100 << 20
    stored = {"rows": [{"case": "mlp_b64", "truth": {"peak_allocated_bytes": real}}]}
    (tmp_path / "t.json").write_text(json.dumps(stored))
    main(["--only", "mlp_b64", "--join", str(tmp_path / "t.json")])
    (row,) = json.loads(capsys.readouterr().out)["rows"]
    pred = row["predicted"]["peak_allocated_bytes"]
    assert row["rel_error_allocated"] == round(pred / real - 1, 4)


def test_the_example_scripts_compile() -> None:
    for path in SCRIPTS.glob("*.py"):
        subprocess.run([sys.executable, "-m", "py_compile", str(path)], check=True)
