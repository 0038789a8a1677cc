"""Swapping the model that acts without a restart (service/model_swap.py): promoting the
shadow warm, loading a model, refusals, the audit entry, and other replicas following a
sealed swap record (and not a forged one)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from fastapi.testclient import TestClient
from support import free_port, oomcast_cmd, wait_until

from oomcast.model.runtime import DEFAULT_MODEL
from oomcast.model.wire import Keys, encode_samples
from oomcast.service.main import create_app
from oomcast.service.model_swap import record_key
from oomcast.service.pipeline.outcomes import CHAMPION, SHADOW
from oomcast.service.settings import Settings

GIB = 1 << 30
TOKEN = "swap-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def settings(redis_url: str, prefix: str, **kw: Any) -> Settings:
    given: dict[str, Any] = {
        "forecaster": "threshold_0.95",
        "api_token": TOKEN,
        "control_secret": "c0ntrol",
        "consumer_name": "svc-1",
    } | kw
    return Settings(redis_url=redis_url, key_prefix=prefix, partitions=1, max_ts_skew_s=0, **given)


def payload(device: str, ts: float, frac: float) -> dict[str, Any]:
    return {"ts": ts, "node": "n1", "device": device, "kind": "gpu",
            "total_bytes": 80 * GIB, "used_bytes": int(frac * 80 * GIB)}  # fmt: skip


def seen(c: TestClient, device: str = "gpu0") -> int:
    r = c.get(f"/v1/devices/n1/{device}", headers=AUTH)
    return int(r.json()["samples_seen"]) if r.status_code == 200 else 0


def two_ooms_scored(c: TestClient, start: float) -> dict[str, dict[str, Any]]:
    """The scorecard's models by role, once both have scored the OOM."""

    def models() -> dict[str, dict[str, Any]]:
        r = c.get("/v1/scorecard", params={"since": str(start - 10)}, headers=AUTH)
        return {m["role"]: m for m in r.json()["models"]}

    assert wait_until(lambda: sum(m.get("ooms", 0) for m in models().values()) == 2)
    return models()


def audit(rclient: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return [json.loads(f[b"alert"]) for _, f in rclient.xrange(keys.alerts)]


@pytest.mark.slow
def test_promoting_the_shadow_swaps_models_and_their_states_and_loses_no_sample(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """The champion (95%) would miss a climb to 92% that OOMs; the shadow (90%) sees it.
    Promoted mid-climb, the 90% model acts at once (its state and its episode came with
    it), every sample is forecast once, the old champion goes on as the shadow, and the
    scorecard credits each model with its own outcome."""
    keys = Keys(key_prefix, 1)
    start = time.time() - 600
    app = create_app(settings(redis_url, key_prefix, shadow_model_path="threshold_0.90"))
    climb = [payload("gpu0", start + t, 0.5 if t < 100 else 0.92) for t in range(200)]
    with TestClient(app) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        for i in range(0, 120, 20):
            rclient.xadd(keys.samples_for("n1"), encode_samples("n1", climb[i : i + 20]))
        assert wait_until(lambda: seen(c) == 120)
        assert rclient.xlen(keys.alerts) == 0  # the 95% champion raises nothing at 92%
        live = app.state.ctx.live
        st = live.domains[("n1", "gpu0")]
        shadow_state, champion_state = st.shadow_states[SHADOW], st.forecaster_state

        made_by: list[str] = []
        original = live.swap_champion

        def watched(*args: Any, **kw: Any) -> int:
            task = asyncio.current_task()
            made_by.append(task.get_name() if task is not None else "no task")
            return original(*args, **kw)

        live.swap_champion = watched
        r = c.post("/v1/model", json={"promote": "shadow", "reason": "test"}, headers=AUTH)
        assert r.status_code == 200, r.text
        assert made_by == ["ingest"]  # between two of its rounds, never mid-round
        done = r.json()
        assert done["changed"] and done["promoted"] and done["propagated"]
        assert (done["previous"], done["version"]) == ("baseline/threshold_0.95",
                                                       "baseline/threshold_0.90")  # fmt: skip
        assert (done["warm_domains"], done["domains"]) == (1, 1)
        # the states changed places: nothing restarted cold
        assert st.forecaster_state is shadow_state
        assert st.shadow_states[SHADOW] is champion_state
        ready = c.get("/readyz").json()
        assert ready["model_version"] == "baseline/threshold_0.90"
        assert ready["shadow_model_version"] == "baseline/threshold_0.95"

        for i in range(120, 200, 20):
            rclient.xadd(keys.samples_for("n1"), encode_samples("n1", climb[i : i + 20]))
        assert wait_until(lambda: seen(c) == 200)  # every sample forecast, none twice

        def firing() -> list[dict[str, Any]]:
            return [
                a
                for a in audit(rclient, keys)
                if a.get("status") == "firing" and a["rule_name"] == "oom-forecast"
            ]

        assert wait_until(lambda: len(firing()) == 1)
        [alert] = firing()
        assert alert["model_version"] == "baseline/threshold_0.90"
        # the first two samples after the swap (fire_after=2): the new champion acted at once
        assert alert["observed_at"] == start + 121
        [swap] = [a for a in audit(rclient, keys) if a.get("record") == "model_swap"]
        assert (swap["how"], swap["reason"], swap["by"]) == ("api", "test", "svc-1")

        rclient.xadd(keys.events, {"event": json.dumps(
            {"ts": start + 200, "node": "n1", "device": "gpu0", "event": "oom"})})  # fmt: skip

        found = two_ooms_scored(c, start)
        # the 90% model warned 100 s ahead (its episode began before it was promoted)
        assert found[CHAMPION]["model_version"] == "baseline/threshold_0.90"
        assert (found[CHAMPION]["warned_30s"], found[CHAMPION]["missed_30s"]) == (1, 0)
        assert found[SHADOW]["model_version"] == "baseline/threshold_0.95"
        assert (found[SHADOW]["warned_30s"], found[SHADOW]["missed_30s"]) == (0, 1)

        # promoting again undoes it, warm both ways
        again = c.post("/v1/model", json={"promote": "shadow"}, headers=AUTH).json()
        assert again["version"] == "baseline/threshold_0.95"
        assert c.get("/v1/model", headers=AUTH).json()["swaps"][0]["version"] == again["version"]
        metrics = c.get("/metrics").text
        assert 'oomcast_model_swaps_total{result="swapped"} 2.0' in metrics
        assert (
            'oomcast_model_info{kind="baseline",provider="python",version="baseline/threshold_0.95"}'
            in metrics
        )


def test_swaps_are_refused_with_a_reason_and_change_nothing(
    redis_url: str, key_prefix: str, rclient: redis.Redis, tmp_path: Path
) -> None:
    keys = Keys(key_prefix, 1)
    app = create_app(settings(redis_url, key_prefix))
    with TestClient(app) as c:
        assert c.post("/v1/model", json={"promote": "shadow"}).status_code == 401
        r = c.post("/v1/model", json={"promote": "shadow"}, headers=AUTH)
        assert r.status_code == 409 and "no shadow model" in r.json()["detail"]
        r = c.post("/v1/model", json={}, headers=AUTH)
        assert r.status_code == 422
        r = c.post("/v1/model", json={"model": "x", "promote": "shadow"}, headers=AUTH)
        assert r.status_code == 422
        missing = tmp_path / "missing.onnx"
        r = c.post("/v1/model", json={"model": str(missing)}, headers=AUTH)
        assert r.status_code == 404 and str(missing) in r.json()["detail"]
        garbage = tmp_path / "garbage.onnx"
        garbage.write_bytes(b"not a model")
        r = c.post("/v1/model", json={"model": str(garbage)}, headers=AUTH)
        assert r.status_code == 409 and str(garbage) in r.json()["detail"]
        r = c.post("/v1/model", json={"model": str(DEFAULT_MODEL), "sha256": "0" * 64},
                   headers=AUTH)  # fmt: skip
        assert r.status_code == 409 and "not the file whose SHA-256 is " + "0" * 64 in r.text
        r = c.post("/v1/model", json={"model": "/etc/hostname"}, headers=AUTH)
        assert r.status_code == 409 and "ending in .onnx" in r.json()["detail"]
        same = c.post("/v1/model", json={"model": "threshold_0.95"}, headers=AUTH).json()
        assert same == {"changed": False, "model_version": "baseline/threshold_0.95",
                        "reason": "already in use"}  # fmt: skip
        assert c.get("/readyz").json()["model_version"] == "baseline/threshold_0.95"
    assert rclient.xlen(keys.alerts) == 0  # nothing was swapped: nothing audited
    assert rclient.get(record_key(key_prefix)) is None
    # without an API token nobody may swap, token or not
    open_app = create_app(settings(redis_url, key_prefix, api_token=None))
    with TestClient(open_app) as c:
        r = c.post("/v1/model", json={"model": "threshold_0.90"})
        assert r.status_code == 403 and "OOMCAST_API_TOKEN" in r.json()["detail"]


@pytest.mark.slow
def test_other_replicas_follow_a_sealed_swap_and_not_a_forged_or_foreign_one(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    a = create_app(settings(redis_url, key_prefix, consumer_name="a"))
    b = create_app(settings(redis_url, key_prefix, consumer_name="b"))
    with TestClient(a) as ca, TestClient(b) as cb:

        def version(c: TestClient) -> str:
            return str(c.get("/readyz").json()["model_version"])

        r = ca.post("/v1/model", json={"model": "threshold_0.90", "reason": "r"}, headers=AUTH)
        assert r.status_code == 200 and r.json()["propagated"] is True
        assert version(ca) == "baseline/threshold_0.90"
        assert wait_until(lambda: version(cb) == "baseline/threshold_0.90", 15)
        [followed] = cb.get("/v1/model", headers=AUTH).json()["swaps"]
        assert (followed["by"], followed["previous_here"]) == ("a", "baseline/threshold_0.95")

        # a record written by someone without the secret: refused, counted, not followed
        forged = {
            "seq": 99,
            "version": "baseline/kubelet_100MiB_10s",
            "source": "kubelet_100MiB_10s",
            "base": "baseline/threshold_0.95",
            "promoted": False,
        }
        rclient.hset(record_key(key_prefix), mapping={"seq": 99, "body": json.dumps(forged)})
        assert wait_until(lambda: 'result="forged"} 1.0' in cb.get("/metrics").text, 15)
        assert version(cb) == "baseline/threshold_0.90"
        assert "refused" in cb.get("/readyz").json()["model_swap_problem"]

        # Redis lost the record (a restart without persistence): the next swap is followed
        rclient.delete(record_key(key_prefix))
        r = ca.post("/v1/model", json={"model": "threshold_0.95"}, headers=AUTH)
        assert r.json()["seq"] == 1
        assert wait_until(lambda: version(cb) == "baseline/threshold_0.95", 15)
        assert cb.get("/readyz").json()["model_swap_problem"] is None

    # a replica restarted later comes up with the swapped model, before it reads anything
    # (the forged record is replaced by a real one first)
    a2 = create_app(settings(redis_url, key_prefix, consumer_name="a"))
    with TestClient(a2) as ca:
        r = ca.post("/v1/model", json={"model": "predict_linear_w60s_h60s"}, headers=AUTH)
        assert r.status_code == 200, r.text
    c2 = create_app(settings(redis_url, key_prefix, consumer_name="c"))
    with TestClient(c2) as cc:
        assert wait_until(lambda: cc.get("/readyz").json()["model_version"]
                          == "baseline/predict_linear_w60s_h60s", 15)  # fmt: skip
    # a replica configured with another model (a newer deploy) does not follow it
    d = create_app(settings(redis_url, key_prefix, consumer_name="d", forecaster="threshold_0.90"))
    with TestClient(d) as cd:
        assert wait_until(lambda: 'result="ignored"} 1.0' in cd.get("/metrics").text, 15)
        assert cd.get("/readyz").json()["model_version"] == "baseline/threshold_0.90"


def _model_with_version(src: Path, dst: Path, version: str) -> Path:
    onnx = pytest.importorskip("onnx")
    m = onnx.load(str(src))
    for p in m.metadata_props:
        if p.key == "oomcast.version":
            p.value = version
    onnx.save(m, str(dst))
    return dst


@pytest.mark.slow
def test_sighup_reloads_the_model_file_in_a_running_service(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """`oomcast serve` as a real process: SIGHUP with the file unchanged swaps nothing;
    with a new model written over it, the new one acts, and the audit stream says so."""
    path = tmp_path / "model.onnx"
    shutil.copy(DEFAULT_MODEL, path)
    port = free_port()
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url, "OOMCAST_KEY_PREFIX": key_prefix,
           "OOMCAST_MODEL_PATH": str(path), "OOMCAST_CONSUMER_NAME": "hup"}  # fmt: skip
    proc = subprocess.Popen(oomcast_cmd("serve", "--port", str(port)), env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)  # fmt: skip
    base = f"http://127.0.0.1:{port}"

    def version() -> str | None:
        try:
            r = httpx.get(f"{base}/readyz")
        except httpx.HTTPError:
            return None
        return str(r.json()["model_version"]) if r.status_code == 200 else None

    try:
        assert wait_until(lambda: version() is not None, 30)
        shipped = version()
        new = tmp_path / "new.onnx"
        _model_with_version(path, new, "lstm-test-reload")
        os.replace(new, path)
        proc.send_signal(signal.SIGHUP)
        assert wait_until(lambda: version() == "lstm-test-reload", 20)
        assert (
            'oomcast_model_swaps_total{result="swapped"} 1.0' in httpx.get(f"{base}/metrics").text
        )
        r = redis.Redis.from_url(redis_url)
        swaps = [json.loads(f[b"alert"]) for _, f in r.xrange(Keys(key_prefix, 8).alerts)]
        [swap] = [s for s in swaps if s.get("record") == "model_swap"]
        assert (swap["how"], swap["previous"], swap["version"]) == ("signal", shipped,
                                                                    "lstm-test-reload")  # fmt: skip
    finally:
        proc.terminate()
        proc.wait(20)


@pytest.mark.slow
def test_an_oom_right_after_a_promotion_is_credited_to_the_model_that_warned(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """No sample between the promotion and the OOM: each outcome still carries the version
    of the model whose watch it is, not the last forecast's."""
    keys = Keys(key_prefix, 1)
    start = time.time() - 600
    app = create_app(settings(redis_url, key_prefix, shadow_model_path="threshold_0.90"))
    climb = [payload("gpu0", start + t, 0.5 if t < 100 else 0.92) for t in range(160)]
    with TestClient(app) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        for i in range(0, 160, 20):
            rclient.xadd(keys.samples_for("n1"), encode_samples("n1", climb[i : i + 20]))
        assert wait_until(lambda: seen(c) == 160)
        r = c.post("/v1/model", json={"promote": "shadow"}, headers=AUTH)
        assert r.status_code == 200, r.text
        rclient.xadd(keys.events, {"event": json.dumps(
            {"ts": start + 160, "node": "n1", "device": "gpu0", "event": "oom"})})  # fmt: skip

        found = two_ooms_scored(c, start)
        assert found[CHAMPION]["model_version"] == "baseline/threshold_0.90"
        assert (found[CHAMPION]["warned_30s"], found[CHAMPION]["missed_30s"]) == (1, 0)
        assert found[SHADOW]["model_version"] == "baseline/threshold_0.95"
        assert (found[SHADOW]["warned_30s"], found[SHADOW]["missed_30s"]) == (0, 1)
