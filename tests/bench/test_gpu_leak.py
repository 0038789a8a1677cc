"""The prepared GPU leak check (bench/gpu_leak.py), run here as its dry run: the same
plumbing (its own redis-server, the hook's samples, ``oomcast dump``, ``oomcast evaluate
--per-trace``) on a short CPU run, so that the check still works the day a GPU is lent."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from oomcast.bench.trainers.leaky import main as leaky_main


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs the redis-server binary")
def test_the_dry_run_dumps_and_scores_the_hooks_samples(tmp_path: Path) -> None:
    run = subprocess.run(
        [
            sys.executable,
            "-m",
            "oomcast.bench.gpu_leak",
            "--out",
            str(tmp_path),
            "--dry-run",
            "--step-s",
            "0.01",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-2000:]
    result = json.loads(run.stdout)
    assert result["trainer"]["returncode"] == 0 and not result["trainer"]["cuda_oom"]
    ((domain, seen),) = result["domains"].items()
    assert domain.startswith("gpu-leak-node/proc:")  # the hook's view of a CPU job
    assert seen["samples"] == 150 and seen["oom_after_s"] is None
    by_detector = {r["detector"]: r for r in result["per_trace"]}
    assert by_detector["model"]["class"] == "ordinary" and not by_detector["model"]["oom"]
    assert json.loads((tmp_path / "summary.json").read_text()) == result


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--memory-fraction", "0.5"], "needs --device cuda"),
        (["--device", "cuda", "--memory-fraction", "0"], "must be in (0, 1]"),
    ],
)
def test_the_leaky_trainer_refuses_a_cap_it_cannot_apply(
    argv: list[str], says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        leaky_main(argv)
    assert exit_.value.code == 2
    assert says in capsys.readouterr().err
