from __future__ import annotations

import pytest
import torch
from preflight_jobs import small_mlp

from oomcast.preflight import PreflightSubmitted, submit
from oomcast.preflight.session import session


def test_submit_outside_a_session_prints_and_returns(capsys: pytest.CaptureFixture[str]) -> None:
    report = submit(small_mlp(), gpu="T4", remedies=False, steps=1)
    assert report.fits
    assert "verdict: fits" in capsys.readouterr().err


def test_submit_reads_the_gpu_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMCAST_PREFLIGHT_GPU", "L4")
    assert submit(small_mlp(), remedies=False, steps=1).gpu == "L4"
    monkeypatch.setenv("OOMCAST_PREFLIGHT_GPU", "L5")
    with pytest.raises(ValueError, match="unknown GPU 'L5'"):
        submit(small_mlp(), remedies=False, steps=1)


def test_submit_in_a_session_keeps_the_report_and_stops() -> None:
    with session(gpu="T4", remedies=False, steps=1) as s, pytest.raises(PreflightSubmitted):
        submit(small_mlp())
    assert s.report is not None and s.report.gpu == "T4"


def test_submit_takes_only_a_job() -> None:
    with pytest.raises(TypeError, match="PreflightJob"):
        submit("train.py", gpu="T4")  # type: ignore[arg-type]


def test_submit_without_a_gpu_says_how_to_name_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OOMCAST_PREFLIGHT_GPU", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device, which submit() would use")
    with pytest.raises(ValueError, match="pass gpu="):
        submit(small_mlp())
