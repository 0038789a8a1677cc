"""The service runs the model when it can, and says loudly when it cannot."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from pydantic import ValidationError
from support import GIB, T0, oomcast_cmd

from oomcast.model import runtime
from oomcast.model.network import NetConfig, OOMForecastNet
from oomcast.service.main import create_app
from oomcast.service.settings import Settings
from oomcast.training.export import export
from oomcast.training.train import ScoredRule, save_checkpoint


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    torch.manual_seed(0)
    tmp = tmp_path_factory.mktemp("svc-model")
    rule = ScoredRule(120, 0.3, 0.9, 0.95, 0.01)
    save_checkpoint(tmp / "c.pt", OOMForecastNet(NetConfig()), rule)
    return export(tmp / "c.pt", tmp / "m.onnx", version="lstm-test")


def body() -> dict:  # type: ignore[type-arg]
    return {
        "samples": [
            {
                "ts": T0 + i,
                "node": "n",
                "device": "gpu0",
                "kind": "gpu",
                "total_bytes": 80 * GIB,
                "used_bytes": (40 + i) * GIB,
            }
            for i in range(5)
        ]
    }


def test_the_model_serves_with_its_own_rule(
    redis_url: str, key_prefix: str, model_path: Path
) -> None:
    s = Settings(redis_url=redis_url, key_prefix=key_prefix, model_path=str(model_path))
    with TestClient(create_app(s)) as c:
        ready = c.get("/readyz").json()
        assert ready["forecaster"]["kind"] == "model"
        assert ready["forecaster"]["provider"] == "CPUExecutionProvider"
        assert ready["model_version"] == "lstm-test"
        out = c.post("/v1/predict", json=body()).json()
        assert out["model_version"] == "lstm-test"
        risks = [out["risk"][h] for h in ("5", "15", "30", "45", "60", "120", "300")]
        assert risks == sorted(risks)
        assert c.get("/v1/devices").json()["alert_horizon_s"] == 120  # the model's rule
        rules = {r["name"]: r for r in c.get("/v1/rules").json()["rules"]}
        assert rules["oom-forecast"]["resolve_after_s"] == 30.0  # OOMCAST_ALERT_RESOLVE_AFTER_S
        assert rules["shed-lower-priority"]["resolve_after_s"] == 30.0
        metrics = c.get("/metrics").text
        assert 'kind="model"' in metrics and 'provider="CPUExecutionProvider"' in metrics


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_named_model_that_is_missing_stops_the_service(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """A typo in OOMCAST_MODEL_PATH used to start a baseline while /readyz said ready."""
    with pytest.raises(ValidationError, match=r"OOMCAST_MODEL_PATH=.*nowhere.onnx: no such file"):
        Settings(
            redis_url=redis_url, key_prefix=key_prefix, model_path=str(tmp_path / "nowhere.onnx")
        )
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url, "OOMCAST_KEY_PREFIX": key_prefix}
    env["OOMCAST_MODEL_PATH"] = str(tmp_path / "nowhere.onnx")
    out = subprocess.run(
        oomcast_cmd("serve", "--port", "1"), env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "OOMCAST_MODEL_PATH=" in out.stderr and "no such file" in out.stderr
    (tmp_path / "bad.onnx").write_bytes(b"not a model")
    env["OOMCAST_MODEL_PATH"] = str(tmp_path / "bad.onnx")
    out = subprocess.run(
        oomcast_cmd("serve", "--port", "1"), env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2, out.stderr
    assert "cannot load" in out.stderr and "Traceback" not in out.stderr


def test_the_shipped_model_missing_falls_back_to_a_baseline_loudly(
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(runtime, "DEFAULT_MODEL", tmp_path / "nowhere.onnx")
    s = Settings(redis_url=redis_url, key_prefix=key_prefix)
    with TestClient(create_app(s)) as c:
        ready = c.get("/readyz").json()
        assert ready["forecaster"]["kind"] == "fallback"
        assert "no model file" in ready["forecaster"]["reason"]
        assert ready["model_version"].startswith("baseline/")
        assert c.post("/v1/predict", json=body()).status_code == 200
        assert 'kind="fallback"' in c.get("/metrics").text
    assert any(
        "MODEL NOT LOADED" in r.getMessage() and r.levelname == "ERROR" for r in caplog.records
    )
