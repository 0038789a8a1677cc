"""The shipped model through the real pipeline: `oomcast serve` with its default forecaster
(the model), `oomcast collect --source replay`, the real Redis and a real webhook receiver.

The trace is a held-out simulated run (``tests/fixtures/sim-test-oom.jsonl.gz``, a copy of
``test/01844-checkpoint_spike.jsonl.gz`` from ``oomcast simulate --n 2000 --seed 0``: never
trained on). It is picked by a rule that does not look at the baselines: of the test split's
OOM traces on which the shipped model (``lstm-2026.12.01``, stepped as ``oomcast evaluate``
steps it) alerts at least 30 s ahead, those of the family with the most such traces
(``checkpoint_spike``: 26 of its 45), and of those the one with the fewest samples (132), to
keep the repository small. The same rule picked the same trace for the previous model.
Replace it by the same rule when the model changes.

The webhook must come at least 30 s before the OOM (45 s here), on the very sample at which
offline scoring (``first_alert_ts``) says the model alerts, and before the one baseline whose
false alarms are of the model's order (``kubelet_100MiB_10s``: 13 of the 276 OOM-free test
traces, against the model's 0; it never fires on this trace). One trace cannot show a
false-alarm rate; ``docs/model-card.md`` has the figures.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
from support import free_port, oomcast_cmd, start_serve

from oomcast.model.baselines import baseline_by_name
from oomcast.model.forecast import Detector
from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster
from oomcast.model.trace import load_trace
from oomcast.training.evaluate import first_alert_ts

TRACE = Path(__file__).resolve().parents[1] / "fixtures" / "sim-test-oom.jsonl.gz"
# Baselines about as quiet as the model on the simulated test split's OOM-free traces
# (docs/model-card.md has the figures).
QUIET_BASELINES = ("kubelet_100MiB_10s",)
SECRET = "model-e2e"


@pytest.mark.slow
@pytest.mark.skipif(not DEFAULT_MODEL.is_file(), reason="no shipped model (model/*.onnx)")
def test_the_model_warns_through_the_real_pipeline_as_scored_and_before_a_quiet_baseline(
    redis_url: str, key_prefix: str, webhook_receiver: Any, tmp_path: Path
) -> None:
    trace = load_trace(TRACE)
    ((domain, samples),) = trace.samples.items()
    oom_ts = trace.oom_ts(domain)
    assert oom_ts is not None
    fc = OnnxForecaster(DEFAULT_MODEL)
    scored = first_alert_ts(Detector("model", fc, fc.rule), samples, oom_ts)
    assert scored is not None
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
        "OOMCAST_MAX_TS_SKEW_S": "0",  # the trace is replayed fast with its own stamps
        "OOMCAST_CONSUMER_NAME": "model-e2e",
    }
    env.pop("OOMCAST_FORECASTER", None)
    env.pop("OOMCAST_MODEL_PATH", None)
    for key in [k for k in env if k.startswith("OOMCAST_ALERT_")]:
        env.pop(key)  # the model's own validated rule, as scored above
    server = start_serve(env, port)
    base = f"http://127.0.0.1:{port}"
    try:
        status = httpx.get(f"{base}/readyz").json()
        assert status["forecaster"]["kind"] == "model", status
        assert status["forecaster"]["provider"] == "CPUExecutionProvider"
        done = subprocess.run(
            oomcast_cmd(
                "collect", "--source", "replay", "--trace", str(TRACE), "--speed", "40", "--keep-ts"
            ),
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
    assert alert["model_version"] == fc.version
    model_ts = alert["observed_at"]
    lead = oom_ts - model_ts
    assert lead >= 30, f"the model warned only {lead:.1f}s ahead"
    assert model_ts == pytest.approx(scored), (
        f"the pipeline alerted at {model_ts} ({lead:.1f}s ahead), offline scoring at {scored}"
        f" ({oom_ts - scored:.1f}s ahead)"
    )
    for name, ts in baseline_alerts.items():
        assert ts is None or model_ts < ts, (
            f"{name} alerted at {ts} ({oom_ts - ts:.1f}s ahead), the model at {model_ts}"
            f" ({lead:.1f}s ahead)"
        )
