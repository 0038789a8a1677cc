"""The shipped model through the real pipeline: `oomcast serve` with its default forecaster
(the model), `oomcast collect --source replay`, the real Redis and a real webhook receiver.

The trace is a held-out simulated run (``tests/fixtures/``, from the test split: never trained
on). The model's webhook must come earlier than the first alert of any baseline that keeps
quiet on at least half of the OOM-free test traces; the others (plain predict_linear) also
fire on nearly every healthy job's start-up, so being earlier than them proves nothing.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from conftest import free_port, oomcast_cmd, start_serve

from oomcast.model.baselines import baseline_by_name
from oomcast.model.runtime import DEFAULT_MODEL
from oomcast.model.trace import load_trace
from oomcast.training.evaluate import first_alert_ts

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "sim-test-oom.jsonl.gz"
# Baselines an operator could leave switched on (false alarms on under half of the simulated
# test split's OOM-free traces; docs/model-card.md has the figures).
QUIET_BASELINES = (
    "threshold_0.90",
    "threshold_0.95",
    "predict_linear_w60s_h60s_gate0.80_full",
    "kubelet_100MiB_10s",
)
SECRET = "model-e2e"


@pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="no shipped model (model/*.onnx)")
def test_the_model_warns_earlier_than_the_baselines_through_the_real_pipeline(
    redis_url: str, key_prefix: str, webhook_receiver: Any, tmp_path: Path
) -> None:
    trace = load_trace(TRACE)
    ((domain, samples),) = trace.samples.items()
    oom_ts = trace.oom_ts(domain)
    assert oom_ts is not None
    baseline_alerts = {
        name: first_alert_ts(baseline_by_name(name), samples, oom_ts) for name in QUIET_BASELINES
    }
    port = free_port()
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_WEBHOOK_URL": webhook_receiver.url,
        "OOMCAST_WEBHOOK_SECRET": SECRET,
        "OOMCAST_CONSUMER_NAME": "model-e2e",
    }
    env.pop("OOMCAST_FORECASTER", None)
    env.pop("OOMCAST_MODEL_PATH", None)
    server = start_serve(env, port)
    base = f"http://127.0.0.1:{port}"
    try:
        status = httpx.get(f"{base}/readyz").json()
        assert status["forecaster"]["kind"] == "model", status
        assert status["forecaster"]["provider"] == "CPUExecutionProvider"
        done = subprocess.run(
            oomcast_cmd("collect", "--source", "replay", "--trace", str(TRACE), "--speed", "40"),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        firing = webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing", 30)
    finally:
        server.terminate()
        server.wait(15)
    alert = firing[0]["json"]
    assert not alert["model_version"].startswith("baseline/")
    model_ts = alert["observed_at"]
    lead = oom_ts - model_ts
    assert lead >= 30, f"the model warned only {lead:.1f}s ahead"
    for name, ts in baseline_alerts.items():
        assert ts is None or model_ts < ts, (
            f"{name} alerted at {ts} ({oom_ts - ts:.1f}s ahead), the model at {model_ts}"
            f" ({lead:.1f}s ahead)"
        )
