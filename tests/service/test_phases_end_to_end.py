"""Phase-aware forecasts through the whole service: samples with step and phase and a
``schedule`` event in the real Redis, read by the real ingest loop of the service (its app,
in this process), forecast by the shipped LSTM with its default rules, and the alert at a
real webhook receiver. The memory stream is flat at 60%: only the schedule can warn."""

from __future__ import annotations

import functools
import json
import os
import re
from typing import Any

import pytest
import redis
from fastapi.testclient import TestClient
from support import GIB, T0, wait_until

from oomcast.model.events import ScheduleEvent
from oomcast.model.phase import MARGIN_FRAC
from oomcast.model.runtime import OnnxForecaster
from oomcast.model.wire import Keys, encode_event, encode_samples
from oomcast.service.main import create_app
from oomcast.service.settings import Settings

TOTAL = 80 * GIB
USED = 48 * GIB  # 60%, flat
HEADROOM = TOTAL - int(MARGIN_FRAC * TOTAL) - USED


@functools.cache
def eval_every() -> int:
    """Steps (1 s each) between evaluations: the eval falls inside the shipped model's alert
    horizon from the first step, up to 100 s ahead, so the warning comes at once whatever
    horizon the model's validated rule has."""
    return min(100, OnnxForecaster().rule.horizon_s - 10)


def steps() -> int:
    """Samples sent, steps 0.. at 1 step/s stamped T0 + step: half way to the eval."""
    return eval_every() // 2 + 1


def hooked(node: str, step: int) -> dict[str, Any]:
    return {
        "ts": T0 + step,
        "node": node,
        "device": "cuda0",
        "kind": "gpu",
        "total_bytes": TOTAL,
        "used_bytes": USED,
        "peak_bytes": USED,
        "job": f"train-{node}",
        "step": step,
        "phase": "forward",
    }


def schedule(node: str, eval_extra: int) -> dict[str, str]:
    event = ScheduleEvent(
        T0, node, "cuda0", "schedule", f"train-{node}",
        eval_every_steps=eval_every(), checkpoint_every_steps=1000,
        phase_extra_bytes={"eval": eval_extra, "checkpoint": GIB},
    )  # fmt: skip
    return encode_event(event)


def events_read(c: TestClient, name: str) -> float:
    m = re.search(r'oomcast_events_total\{event="' + name + r'"\} (\S+)', c.get("/metrics").text)
    return float(m.group(1)) if m else 0.0


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_an_eval_that_will_not_fit_is_alerted_with_its_cause_and_one_that_fits_is_not(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: Any
) -> None:
    keys = Keys(key_prefix, 2)
    settings = Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        partitions=2,
        consumer_name="phases-e2e",
        forecaster="model",  # the shipped LSTM and its validated rule
        webhook_url=webhook_receiver.url,
        webhook_secret="phases-e2e-secret",
        max_ts_skew_s=0,  # stamped around support.T0 (2025)
    )
    with TestClient(create_app(settings)) as c:
        # a new replica reads the events stream from its end: send once it is up
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        assert c.get("/v1/rules").status_code == 200
        rclient.xadd(keys.events, schedule("n-oom", HEADROOM + 4 * GIB))  # type: ignore[arg-type]
        rclient.xadd(keys.events, schedule("n-fits", HEADROOM - 4 * GIB))  # type: ignore[arg-type]
        assert wait_until(lambda: events_read(c, "schedule") == 2)
        for node in ("n-oom", "n-fits"):
            payloads = [hooked(node, i) for i in range(steps())]
            rclient.xadd(keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]

        def seen(node: str) -> int:
            r = c.get(f"/v1/devices/{node}/cuda0", params={"history": 0})
            return int(r.json()["samples_seen"]) if r.status_code == 200 else 0

        assert wait_until(lambda: seen("n-oom") == steps() and seen("n-fits") == steps())
        firing = webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing")
        assert firing, c.get("/v1/alerts").text
        assert {r["json"]["node"] for r in firing} == {"n-oom"}  # the eval that fits: nothing
        alert = firing[0]["json"]
        assert alert["cause"] == "phase:eval" and alert["rule_name"] == "oom-forecast"
        assert alert["model_version"].startswith("lstm")
        # the eval runs at step eval_every(), stamped so: the forecast says when, from its
        # sample (from the first sample with a step rate to time it by: step 2)
        until_eval = T0 + eval_every() - alert["observed_at"]
        assert alert["observed_at"] == T0 + 2
        assert alert["time_to_oom_s"] >= 30
        assert abs(alert["time_to_oom_s"] - until_eval) <= 0.05 * until_eval
        devices = {d["node"]: d for d in c.get("/v1/devices").json()["devices"]}
        oom, fits = devices["n-oom"], devices["n-fits"]
        assert oom["cause"] == "phase:eval" and oom["alert"]["firing"]
        assert oom["time_to_oom_s"] == eval_every() - (steps() - 1)
        assert oom["phase"] == {
            "phase": "eval",
            "in_s": float(eval_every() - (steps() - 1)),
            "steps_away": eval_every() - (steps() - 1),
            "extra_bytes": HEADROOM + 4 * GIB,
            "headroom_bytes": HEADROOM,
            "measured": False,
        }
        assert fits["cause"] is None and fits["phase"] is None and not fits["alert"]["firing"]
        assert fits["evidence"].startswith("no OOM in sight")
        assert fits["alert_risk"] < 0.5
        audit = c.get("/v1/alerts").json()["alerts"]
        alerts = [a for a in audit if a.get("rule_name") == "oom-forecast"]
        assert [(a["status"], a["cause"]) for a in alerts] == [("firing", "phase:eval")]
        json.dumps(audit)  # what the API returned is plain JSON


def test_the_in_job_hooks_schedule_reaches_the_service_and_warns(
    redis_url: str,
    key_prefix: str,
    webhook_receiver: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The real MemoryHook (host mode: this process's own memory) announces an eval every
    ``eval_every()`` steps at 1 s per step that needs more than the whole machine: the
    service warns that far ahead, with the cause; a second job whose eval fits is left
    alone."""
    from oomcast.collectors.hook import MemoryHook

    monkeypatch.delenv("OOMCAST_HOOK", raising=False)
    settings = Settings(
        redis_url=redis_url,
        key_prefix=key_prefix,
        partitions=2,
        consumer_name="phases-hook-e2e",
        webhook_url=webhook_receiver.url,
        webhook_secret="phases-e2e-secret",
    )
    with TestClient(create_app(settings)) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        hooks = {
            node: MemoryHook(
                f"train-{node}",
                redis_url=redis_url,
                key_prefix=key_prefix,
                node=node,
                partitions=2,
                mode="host",
                checkpoint_signal=None,
                publish_interval_s=0.02,
            )
            for node in ("n-hook-oom", "n-hook-fits")
        }
        try:
            for node, hook in hooks.items():
                extra = 1 << 20 if node == "n-hook-fits" else 1 << 50  # 1 MiB; 1 PiB
                hook.set_schedule(
                    eval_every_steps=eval_every(), step_s=1.0, phase_extra_bytes={"eval": extra}
                )
            assert wait_until(lambda: events_read(c, "schedule") == 2)
            for hook in hooks.values():
                hook.step(1)  # a sample after the schedule: one step less before the eval
                assert hook.flush(5.0)
            firing = webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing")
        finally:
            for hook in hooks.values():
                hook.close(timeout_s=1.0)

        def seen(node: str) -> int:
            devices = c.get("/v1/devices", params={"node": node}).json()["devices"]
            return int(devices[0]["samples_seen"]) if devices else 0

        # the schedule's sample and the step's, of each job
        assert wait_until(lambda: seen("n-hook-oom") == 2 and seen("n-hook-fits") == 2)
        assert [r["json"]["node"] for r in firing] == ["n-hook-oom"]
        alert = firing[0]["json"]
        assert alert["cause"] == "phase:eval" and alert["device"] == f"proc:{os.getpid()}"
        # eval_every() s when the service read the schedule before the step-0 sample
        # set_schedule takes (the events and the samples are separate streams, read in either
        # order), a second less when it forecast from the step-1 sample first
        assert eval_every() - 10 <= alert["time_to_oom_s"] <= eval_every()
        devices = {d["node"]: d for d in c.get("/v1/devices").json()["devices"]}
        assert not (devices["n-hook-fits"]["cause"] or "").startswith("phase:")
        assert not devices["n-hook-fits"]["alert"]["firing"]


def _plain(node: str, i: int) -> dict[str, Any]:
    """A GPU as the node agent reports it (NVML: no step, no phase), flat at 60%."""
    return {"ts": T0 + i, "node": node, "device": "gpu0", "kind": "gpu", "total_bytes": TOTAL,
            "used_bytes": USED, "job": f"train-{node}"}  # fmt: skip


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_an_announced_arrival_that_will_not_fit_warns_the_running_job_before_it_lands(
    redis_url: str, key_prefix: str, rclient: redis.Redis, webhook_receiver: Any
) -> None:
    """A scheduler places a job through ``POST /v1/admit`` with ``arrives_in_s``: the job
    already on that GPU is warned before the arrival lands, as soon as the landing is
    within its alert rule's horizon, with the cause and a remedy; on a GPU where the
    arrival fits, nothing fires."""
    keys = Keys(key_prefix, 2)
    settings = Settings(
        redis_url=redis_url, key_prefix=key_prefix, partitions=2, consumer_name="arrival-e2e",
        forecaster="model", webhook_url=webhook_receiver.url,
        webhook_secret="arrival-e2e-secret", max_ts_skew_s=0,
    )  # fmt: skip
    with TestClient(create_app(settings)) as c:
        assert wait_until(lambda: c.get("/readyz").status_code == 200)
        for node in ("n-full", "n-room"):
            payloads = [_plain(node, i) for i in range(30)]
            rclient.xadd(keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]

        def seen(node: str) -> int:
            r = c.get(f"/v1/devices/{node}/gpu0", params={"history": 0})
            return int(r.json()["samples_seen"]) if r.status_code == 200 else 0

        assert wait_until(lambda: seen("n-full") == 30 and seen("n-room") == 30)
        assert not webhook_receiver.requests  # a flat line: nothing yet
        big, small = HEADROOM + 4 * GIB, HEADROOM - 4 * GIB
        answers = {}
        for node, peak in (("n-full", big), ("n-room", small)):
            body = {"node": node, "device": "gpu0", "job": f"new-{node}", "arrives_in_s": 90,
                    "profile": {"peak_reserved_bytes": peak, "context_bytes": 0}}  # fmt: skip
            r = c.post("/v1/admit", json=body)
            assert r.status_code == 200, r.text
            answers[node] = r.json()
        assert answers["n-full"]["fits"] is False and answers["n-room"]["fits"] is True
        lands = T0 + 29 + 90  # on the domain's clock: its newest sample's ts plus 90 s
        assert answers["n-full"]["announced"] == {"job": "new-n-full", "lands_at": lands}
        for node in ("n-full", "n-room"):
            payloads = [_plain(node, i) for i in range(30, 100)]
            rclient.xadd(keys.samples_for(node), encode_samples(node, payloads))  # type: ignore[arg-type]
        assert wait_until(lambda: seen("n-full") == 100 and seen("n-room") == 100)
        firing = webhook_receiver.wait_for(lambda r: r["json"]["status"] == "firing")
        assert firing, c.get("/v1/alerts").text
        assert {r["json"]["node"] for r in firing} == {"n-full"}
        alert = firing[0]["json"]
        horizon = OnnxForecaster().rule.horizon_s  # the landing comes inside it: the alert
        assert alert["cause"] == "phase:arrival"
        assert alert["observed_at"] == lands - horizon  # ... before it lands
        assert alert["time_to_oom_s"] == pytest.approx(horizon, abs=0.5)
        assert any("place it on another GPU" in r for r in alert["remedies"])
        room = c.get("/v1/devices/n-room/gpu0", params={"history": 0}).json()
        assert not room["alert"]["firing"] and room["cause"] is None
