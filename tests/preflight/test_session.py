from __future__ import annotations

import pytest
import torch
from preflight_jobs import small_mlp

from oomcast.preflight import PreflightSubmitted, submit
from oomcast.preflight.session import session


def test_submit_outside_a_session_prints_and_returns(capsys: pytest.CaptureFixture[str]) -> None:
    report = submit(small_mlp(), gpu="T4", remedies=False, steps=1)
    assert report is not None and report.fits
    assert "verdict: fits" in capsys.readouterr().err


def test_submit_reads_the_gpu_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OOMCAST_PREFLIGHT_GPU", "L4")
    report = submit(small_mlp(), remedies=False, steps=1)
    assert report is not None and report.gpu == "L4"
    monkeypatch.setenv("OOMCAST_PREFLIGHT_GPU", "L5")
    with pytest.raises(ValueError, match="unknown GPU 'L5'"):
        submit(small_mlp(), remedies=False, steps=1)


def test_submit_in_a_session_keeps_the_job_and_stops() -> None:
    job = small_mlp()
    with session(gpu="T4") as s, pytest.raises(PreflightSubmitted):
        submit(job, steps=1)
    assert s.job is job and s.options == {"gpu": "T4", "steps": 1}


def test_submit_takes_only_a_job() -> None:
    with pytest.raises(TypeError, match="PreflightJob"):
        submit("train.py", gpu="T4")  # type: ignore[arg-type]


def test_submit_without_a_gpu_does_no_harm_and_says_how_to_name_one(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A script that calls submit() must still run normally on a laptop or a CI runner."""
    monkeypatch.delenv("OOMCAST_PREFLIGHT_GPU", raising=False)
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device, which submit() would use")
    assert submit(small_mlp()) is None
    err = capsys.readouterr().err
    assert "no GPU to check mlp" in err and "pass gpu=" in err and "skipped" in err
