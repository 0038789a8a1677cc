"""The training commands' traps: ``oomcast export`` without ``--out`` used to overwrite the
model shipped with oomcast."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from oomcast.cli.common import SHIPPED_MODEL
from oomcast.cli.main import main
from oomcast.model.network import NetConfig, OOMForecastNet
from oomcast.training.train import ScoredRule, save_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("ckpt") / "c.pt"
    save_checkpoint(path, OOMForecastNet(NetConfig()), ScoredRule(60, 0.5, 0.9, 0.95, 0.01))
    return path


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_export_never_replaces_the_shipped_model_unasked(
    checkpoint: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    before = digest(SHIPPED_MODEL)
    assert main(["export", "--checkpoint", str(checkpoint), "--out", str(SHIPPED_MODEL)]) == 2
    assert "model shipped with oomcast" in capsys.readouterr().err
    assert digest(SHIPPED_MODEL) == before


def test_export_defaults_away_from_the_shipped_model_and_force_replaces(
    checkpoint: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # the default --out is relative: runs/latest/...
    assert main(["export", "--checkpoint", str(checkpoint)]) == 0
    written = tmp_path / "runs" / "latest" / "oomcast-lstm.onnx"
    assert written.is_file()
    assert main(["export", "--checkpoint", str(checkpoint)]) == 2  # exists: not replaced
    assert "the file exists; give --force" in capsys.readouterr().err
    assert main(["export", "--checkpoint", str(checkpoint), "--force", "--version", "v2"]) == 0
