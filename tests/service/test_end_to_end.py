"""The whole pipeline as a user runs it: `oomcast collect --source replay` and
`oomcast serve` as real processes, the real Redis, and a real HTTP webhook receiver."""

from __future__ import annotations

import gzip
import hashlib
import hmac
import os
import subprocess
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import free_port, leak_trace, oomcast_cmd, start_serve, steady_trace, wait_until, write

from oomcast.model.schema import Event
from oomcast.model.wire import Keys

SECRET = "e2e-secret"


@pytest.fixture
def stack(redis_url: str, key_prefix: str, webhook_receiver: Any) -> Any:
    port = free_port()
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_WEBHOOK_URL": webhook_receiver.url,
        "OOMCAST_WEBHOOK_SECRET": SECRET,
        "OOMCAST_CONSUMER_NAME": "e2e",
        "OOMCAST_FORECASTER": "predict_linear_w60s_h60s_gate0.80_full",
        # traces replayed fast with their own (2025) stamps, so the test can compare them
        "OOMCAST_MAX_TS_SKEW_S": "0",
    }
    server = start_serve(env, port)
    base = f"http://127.0.0.1:{port}"

    def replay(trace: Path, speed: float) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            oomcast_cmd(
                "collect",
                "--source",
                "replay",
                "--trace",
                str(trace),
                "--speed",
                str(speed),
                "--keep-ts",
            ),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    yield base, replay
    server.terminate()
    server.wait(15)


@pytest.mark.slow
def test_replayed_oom_fires_a_signed_webhook_before_the_oom(
    stack: Any, tmp_path: Path, webhook_receiver: Any, rclient: redis.Redis, key_prefix: str
) -> None:
    base, replay = stack
    records = leak_trace(seconds_to_oom=300, start_frac=0.5, node="node-7", device="gpu3")
    oom = records[-1]
    assert isinstance(oom, Event)
    done = replay(write(tmp_path / "leak.jsonl.gz", records), speed=30)
    assert done.returncode == 0, done.stderr
    firing = webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing")
    assert len(firing) == 1, "exactly one firing alert per episode"
    req = firing[0]
    alert = req["json"]
    assert (alert["node"], alert["device"], alert["job"]) == ("node-7", "gpu3", "leaky")
    assert alert["observed_at"] < oom.ts  # forecast from a sample before the OOM...
    assert oom.ts - alert["observed_at"] >= 10  # ...with time to act
    assert alert["model_version"].startswith("baseline/")
    expected = "sha256=" + hmac.new(SECRET.encode(), req["body"], hashlib.sha256).hexdigest()
    assert req["headers"]["X-Oomcast-Signature"] == expected
    # In wall-clock time too: the webhook arrived before the OOM event reached Redis.
    (oom_entry,) = rclient.xrange(Keys(key_prefix).events)
    assert req["at"] * 1000 < int(oom_entry[0].split(b"-")[0])
    # The OOM ends the episode with a resolved notification, and the audit stream has both.
    assert webhook_receiver.wait_for(lambda r: r["json"]["status"] == "resolved")
    audit = httpx.get(f"{base}/v1/alerts").json()["alerts"]
    statuses = [a["status"] for a in audit if a.get("rule_name") == "oom-forecast"]
    assert statuses == ["resolved", "firing"]
    # each record says what was done with it: the webhook owed; no Alertmanager and no
    # control secret configured here, so those actions are recorded as not configured
    firing = next(
        a for a in audit if a.get("rule_name") == "oom-forecast" and a["status"] == "firing"
    )
    assert firing["dispatched"] == {
        "webhook": "owed",
        "alertmanager": "not_configured",
        "checkpoint": "not_configured",
    }


@pytest.mark.slow
def test_replayed_trace_without_oom_fires_nothing(
    stack: Any, tmp_path: Path, webhook_receiver: Any
) -> None:
    base, replay = stack
    records = steady_trace(level=0.85, amplitude=0.05, seconds=300, node="node-8")
    done = replay(write(tmp_path / "steady.jsonl", records), speed=30)
    assert done.returncode == 0, done.stderr

    def all_forecast() -> bool:
        r = httpx.get(f"{base}/v1/devices/node-8/gpu0")
        return r.status_code == 200 and r.json()["samples_seen"] == len(records)

    assert wait_until(all_forecast, 30)
    assert webhook_receiver.requests == []
    assert httpx.get(f"{base}/v1/alerts").json()["count"] == 0


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_replay_stops_at_a_corrupt_line_naming_file_and_line(stack: Any, tmp_path: Path) -> None:
    _, replay = stack
    path = write(tmp_path / "bad.jsonl.gz", leak_trace(seconds_to_oom=30))
    with gzip.open(path, "rt") as fh:
        lines = fh.read().splitlines()
    lines[6] = lines[6][:-5]  # truncated JSON on line 7
    with gzip.open(path, "wt") as fh:
        fh.write("\n".join(lines) + "\n")
    done = replay(path, speed=100)
    assert done.returncode == 2
    assert f"{path}:7:" in done.stderr
    assert "not valid JSON" in done.stderr
