"""The service runs the model when it can, and says loudly when it cannot."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient
from support import GIB, T0

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
        risks = [out["risk"][h] for h in ("5", "15", "30", "60", "120", "300")]
        assert risks == sorted(risks)
        assert c.get("/v1/devices").json()["alert_horizon_s"] == 120  # the model's rule
        metrics = c.get("/metrics").text
        assert 'kind="model"' in metrics and 'provider="CPUExecutionProvider"' in metrics


def test_a_missing_model_falls_back_to_a_baseline_loudly(
    redis_url: str, key_prefix: str, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    s = Settings(
        redis_url=redis_url, key_prefix=key_prefix, model_path=str(tmp_path / "nowhere.onnx")
    )
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
