"""AlertmanagerTarget, with the outbox and its worker as the service runs them, against a real
Prometheus Alertmanager (Debian's ``prometheus-alertmanager``; ``.ci/run`` installs it), each
test with its own instance on free loopback ports, clustering off, storage in tmp_path.

What Alertmanager 0.25 does that these tests rely on: ``GET /api/v2/alerts`` never lists a
resolved alert, whatever the filters (``active=true`` or not); a firing alert posted after its
resolve brings it back (the newest post wins); ``/metrics`` counts received alerts by status.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import os
import shutil
import subprocess
import time
from collections.abc import Callable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
import redis.asyncio as aioredis
from support import free_port, wait_until

from oomcast.model.wire import Keys
from oomcast.service.delivery.alertmanager import (
    DEFAULT_ALERTNAME,
    AlertmanagerTarget,
    annotations_for,
    rfc3339,
)
from oomcast.service.delivery.outbox import Outbox
from oomcast.service.delivery.worker import DELIVERY_HEADER, DeliveryWorker, new_delivery

GIB = 1 << 30
FAST = {"timeout_s": 1.0, "backoff_s": 0.05, "backoff_max_s": 0.3, "claim_s": 2.0, "poll_s": 0.02}


def _find_alertmanager() -> str | None:
    for name in ("prometheus-alertmanager", "alertmanager"):
        exe = shutil.which(name)
        if exe:
            return exe
    exe = "/usr/bin/prometheus-alertmanager"
    return exe if os.access(exe, os.X_OK) else None


AM_EXE = _find_alertmanager()
CONFIG = """\
route:
  receiver: "null"
  group_wait: 0s
receivers:
  - name: "null"
"""


class Alertmanager:
    """A private Alertmanager that a test can start, stop and start again."""

    def __init__(self, exe: str, tmp: Path) -> None:
        self.exe = exe
        self.tmp = tmp
        self.config = tmp / "alertmanager.yml"
        self.config.write_text(CONFIG)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp / "alertmanager.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 30.0) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.exe,
                    f"--config.file={self.config}",
                    f"--storage.path={self.tmp / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--cluster.listen-address=",
                    "--log.level=warn",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
            )

        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"alertmanager exited: {self.log.read_text()[-2000:]}")
            try:
                return httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False

        if wait_until(ready, timeout_s):
            return
        self.stop()
        raise RuntimeError(
            f"alertmanager not ready in {timeout_s}s: {self.log.read_text()[-2000:]}"
        )

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc = None


@pytest.fixture
def am_stopped(tmp_path: Path) -> Iterator[Alertmanager]:
    if AM_EXE is None:
        pytest.skip(
            "prometheus-alertmanager is not installed (apt-get install prometheus-alertmanager;"
            " .ci/run does it)"
        )
    server = Alertmanager(AM_EXE, tmp_path)
    yield server
    server.stop()


@pytest.fixture
def am(am_stopped: Alertmanager) -> Alertmanager:
    am_stopped.start()
    return am_stopped


async def eventually(
    check: Callable[[], Any], timeout_s: float = 20.0, interval_s: float = 0.05
) -> Any:
    """Poll ``check`` (plain or async) until it returns something truthy; that value, or fail."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = check()
        if inspect.isawaitable(got):
            got = await got
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s; last: {got!r}")
        await asyncio.sleep(interval_s)


async def am_alerts(url: str, **params: str) -> list[dict[str, Any]]:
    async with httpx.AsyncClient(timeout=5) as client:
        resp = await client.get(f"{url}/api/v2/alerts", params=params)
        resp.raise_for_status()
        return list(resp.json())


async def am_alerts_when(
    url: str, ok: Callable[[list[dict[str, Any]]], bool], **params: str
) -> list[dict[str, Any]] | None:
    """The alerts, if ``ok`` says they are what the test waits for; else None."""
    got = await am_alerts(url, **params)
    return got if ok(got) else None


async def am_received(url: str, status: str) -> float:
    """Alertmanager's own count of alerts received through API v2 with ``status``."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{url}/metrics")).text
    series = f'alertmanager_alerts_received_total{{status="{status}",version="v2"}}'
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.split()[-1])
    return 0.0


async def am_nothing_active(url: str) -> bool:
    return await am_alerts(url, active="true") == []


def payload(status: str = "firing", device: str = "gpu3", **over: Any) -> dict[str, Any]:
    now = time.time()
    out: dict[str, Any] = {
        "status": status,
        "node": "node-7",
        "device": device,
        "job": "train-42",
        "risk": {"30": 0.41, "60": 0.93, "300": 0.99},
        "time_to_oom_s": 45.0,
        "observed_at": now,
        "fired_at": now - 5,
        "sent_at": now,
        "action": "notify",
        "model_version": "tcn-2024.06",
        "episode": "ep-" + device,
        "rule": "risk within 60s >= 0.9 for 2 samples; resolves below 0.2 for 3",
        "reason": "risk 0.93 at 60s" if status == "firing" else "risk fell to 0.05",
        "used_bytes": int(71.5 * GIB),
        "total_bytes": 80 * GIB,
        "rule_name": "checkpoint-before-oom",
        "severity": "critical",
    }
    out.update(over)
    return out


def parse_ts(ts: str) -> float:
    return datetime.fromisoformat(ts).timestamp()


class Pusher:
    """What the service runs for Alertmanager: the target, the outbox and a worker (fast
    retries), on the test's Redis. ``submit`` owes one alert as the dispatcher does."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        url: str,
        *,
        resend_s: float = 60.0,
        generator_url: str | None = None,
        clock: Callable[[], float] = time.time,
        **worker: Any,
    ) -> None:
        self.results: list[str] = []
        self.client = aioredis.from_url(redis_url)
        self.outbox = Outbox(self.client, Keys(prefix))
        self.clock = clock
        self.target = AlertmanagerTarget(
            url, self.outbox, resend_s=resend_s, generator_url=generator_url, clock=clock
        )
        self.worker = DeliveryWorker(
            self.outbox,
            {"alertmanager": self.target},
            audit_stream=Keys(prefix).alerts,
            on_outcome=lambda t, r: self.results.append(r),
            clock=clock,
            **{**FAST, **worker},
        )

    async def __aenter__(self) -> Pusher:
        await self.worker.start()
        await self.target.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.target.stop()
        await self.worker.stop(grace_s=1.0)
        await self.client.aclose()

    async def submit(self, alert: dict[str, Any]) -> None:
        delivery = new_delivery(self.target, alert, self.clock())
        self.target.owed(delivery)
        assert await self.outbox.put([delivery], self.clock()) == 1


def test_firing_alert_appears_with_labels_and_annotations(
    am: Alertmanager, redis_url: str, key_prefix: str
) -> None:
    alert = payload()

    async def go() -> tuple[list[dict[str, Any]], list[str]]:
        async with Pusher(
            redis_url, key_prefix, am.url, generator_url="http://oomcast:8080/alerts"
        ) as p:
            sent_at = time.time()
            await p.submit(alert)
            await p.submit(payload(device="gpu5", job=None, rule_name=None, severity=None))
            got = await eventually(lambda: am_alerts_when(am.url, lambda a: len(a) == 2))
            await eventually(lambda: p.results.count("delivered") == 2)
        for a in got:
            assert abs(parse_ts(a["endsAt"]) - (sent_at + 300)) < 10  # endsAt = now + 5 min
        return got, p.results

    alerts, results = asyncio.run(go())
    got = {a["labels"]["device"]: a for a in alerts}
    assert results == ["delivered", "delivered"]
    gpu3 = got["gpu3"]
    assert gpu3["labels"] == {
        "alertname": "checkpoint-before-oom",
        "node": "node-7",
        "device": "gpu3",
        "job": "train-42",
        "severity": "critical",
    }
    ann = gpu3["annotations"]
    assert ann["summary"] == (
        "gpu3 on node-7 is forecast to run out of memory in ~45 s (risk 0.93 within 60 s)"
    )
    for part in (
        "71.5/80.0 GiB",
        "time_to_oom_s 45",
        "30s=0.41 60s=0.93 300s=0.99",
        "model_version tcn-2024.06",
        "episode ep-gpu3",
        "rule risk within 60s",
        "action notify",
    ):
        assert part in ann["description"], (part, ann["description"])
    assert gpu3["status"]["state"] == "active"
    assert gpu3["startsAt"] == rfc3339(alert["fired_at"])
    assert gpu3["generatorURL"] == "http://oomcast:8080/alerts"
    # Without rule_name, severity and job: the defaults, and no job label.
    assert got["gpu5"]["labels"] == {
        "alertname": DEFAULT_ALERTNAME,
        "node": "node-7",
        "device": "gpu5",
        "severity": "warning",
    }


@pytest.mark.slow
def test_resent_while_firing_and_gone_once_resolved(
    am: Alertmanager, redis_url: str, key_prefix: str
) -> None:
    async def go() -> list[str]:
        async with Pusher(redis_url, key_prefix, am.url, resend_s=0.3) as p:
            await p.submit(payload())
            (first,) = await eventually(lambda: am_alerts(am.url, active="true"))
            # Re-sent every resend_s: Alertmanager's updatedAt and endsAt move forward.
            seen = [first]
            for _ in range(2):
                prev = seen[-1]["updatedAt"]
                later = await eventually(
                    lambda prev=prev: am_alerts_when(
                        am.url, lambda a: bool(a) and a[0]["updatedAt"] != prev, active="true"
                    )
                )
                seen.append(later[0])
            assert [a["updatedAt"] for a in seen] == sorted({a["updatedAt"] for a in seen})
            assert parse_ts(seen[-1]["endsAt"]) > parse_ts(seen[0]["endsAt"])
            assert {a["startsAt"] for a in seen} == {first["startsAt"]}  # one episode, one start
            # Alertmanager shows a resend before the pusher has recorded its answer: wait
            # for the record rather than race it.
            await eventually(lambda: p.results.count("resent") >= 2)
            assert p.results.count("delivered") == 1

            await p.submit(payload("resolved", sent_at=time.time()))
            assert p.target.firing == []
            # Alertmanager 0.25 does not list a resolved alert at all, active or not.
            await eventually(lambda: am_nothing_active(am.url))
            assert await am_alerts(am.url) == []
            assert await am_alerts(am.url, active="false") == []
            await eventually(lambda: am_received(am.url, "resolved"))
            assert await am_received(am.url, "resolved") == 1  # ended by us, not by expiry
            firing_before = await am_received(am.url, "firing")
            # No more re-sends after the resolve: no firing arrives, and it stays gone.
            await asyncio.sleep(1.2)  # a check that nothing happens: this one must wait
            assert await am_alerts(am.url) == []
            assert await am_received(am.url, "firing") == firing_before

            # A new episode on the same GPU fires again, with its own start.
            await p.submit(payload(episode="ep-2", fired_at=time.time(), sent_at=time.time()))
            (again,) = await eventually(lambda: am_alerts(am.url, active="true"))
            assert again["startsAt"] > first["startsAt"]
            return p.results

    results = asyncio.run(go())
    assert "expired" not in results and "refused" not in results


def test_down_at_first_gets_the_alert_once_it_comes_up(
    am_stopped: Alertmanager, redis_url: str, key_prefix: str
) -> None:
    async def go() -> list[str]:
        async with Pusher(redis_url, key_prefix, am_stopped.url) as p:
            await p.submit(payload())
            await eventually(lambda: p.results.count("retry") >= 2)
            assert "delivered" not in p.results
            await asyncio.to_thread(am_stopped.start)
            (got,) = await eventually(lambda: am_alerts(am_stopped.url, active="true"))
            assert got["labels"]["alertname"] == "checkpoint-before-oom"
            await eventually(lambda: "delivered" in p.results)
            return p.results

    results = asyncio.run(go())
    assert results[-1] == "delivered" and results.count("delivered") == 1
    assert set(results[:-1]) == {"retry"}


def test_a_resolve_is_never_overtaken_by_a_retried_firing(
    am_stopped: Alertmanager, redis_url: str, key_prefix: str
) -> None:
    async def go() -> list[str]:
        async with Pusher(redis_url, key_prefix, am_stopped.url) as p:
            # gpu0 fires and resolves while Alertmanager is down; gpu1 fires, stays firing.
            await p.submit(payload(device="gpu0"))
            await p.submit(payload("resolved", device="gpu0", sent_at=time.time() + 0.001))
            await p.submit(payload(device="gpu1"))
            await eventually(lambda: "retry" in p.results)  # tried while it is down
            await asyncio.to_thread(am_stopped.start)
            await eventually(lambda: p.results.count("delivered") == 3)
            active = await am_alerts(am_stopped.url, active="true")
            assert [a["labels"]["device"] for a in active] == ["gpu1"]
            assert await am_received(am_stopped.url, "resolved") == 1
            results = p.results

        # Why the order matters: a stale firing landing after the resolve revives the alert.
        stale = {
            "labels": {"alertname": "checkpoint-before-oom", "node": "node-7", "device": "gpu0"},
            "startsAt": rfc3339(time.time() - 5),
            "endsAt": rfc3339(time.time() + 300),
        }
        async with httpx.AsyncClient() as client:
            resp = await client.post(f"{am_stopped.url}/api/v2/alerts", json=[stale])
            assert resp.status_code == 200
        active = await am_alerts(am_stopped.url, active="true")
        assert sorted(a["labels"]["device"] for a in active) == ["gpu0", "gpu1"]
        return results

    assert "expired" not in asyncio.run(go())


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_no_resend_is_stacked_behind_a_push_still_owed(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there

    async def go() -> list[str]:
        async with Pusher(redis_url, key_prefix, dead, resend_s=0.05) as p:
            await p.submit(payload())
            items = p.outbox.key("alertmanager", "items")
            # many re-send periods pass while the first push is still being retried
            await eventually(lambda: p.results.count("retry") >= 10)
            assert rclient.hlen(items) == 1  # the first push alone: a resend adds nothing
            return p.results

    results = asyncio.run(go())
    assert "resent" not in results and "delivered" not in results


def test_a_404_is_retried_not_dropped(
    am: Alertmanager, redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    """A 404 may be an ingress in the middle of a deploy: the alert stays owed (only a
    receiver saying the body itself is wrong, 400/413/415/422, ends it unsent)."""

    async def go() -> list[str]:
        async with Pusher(redis_url, key_prefix, f"{am.url}/not-here") as p:
            await p.submit(payload())
            await eventually(lambda: p.results.count("retry") >= 2)
            assert rclient.hlen(p.outbox.key("alertmanager", "items")) == 1  # still owed
            return p.results

    results = asyncio.run(go())
    assert "refused" not in results and "delivered" not in results
    records = [json.loads(f[b"alert"]) for _, f in rclient.xrange(f"{key_prefix}:alerts")]
    assert records == []  # no end on record: it has not ended


def test_retries_5xx_429_408_and_sets_times_from_the_clock(
    webhook_receiver: Any, redis_url: str, key_prefix: str
) -> None:
    """Scripted answers (Alertmanager itself never sends these on demand)."""
    webhook_receiver.statuses = [503, 429, 408]
    now = 1_700_000_000.0
    t0 = time.monotonic()

    def clock() -> float:  # 2023, moving on at the real pace (retries fall due)
        return now + (time.monotonic() - t0)

    async def go() -> list[str]:
        # lease: max(3 * 200 s, 5 min) = 600 s. The attempt's deadline is roomy: the
        # scripted answers are the only failures this test counts (a busy machine once
        # took a second over one attempt and made a fourth retry).
        async with Pusher(
            redis_url,
            key_prefix,
            webhook_receiver.url,
            resend_s=200,
            clock=clock,
            timeout_s=10.0,
            claim_s=20.0,
        ) as p:
            await p.submit(payload(fired_at=now - 30, sent_at=now))
            await p.submit(payload("resolved", fired_at=now - 30, sent_at=now + 0.5))
            await eventually(lambda: p.results.count("delivered") == 2)
            return p.results

    assert asyncio.run(go()) == ["retry", "retry", "retry", "delivered", "delivered"]
    reqs = webhook_receiver.requests
    assert {r["path"] for r in reqs} == {"/hook/api/v2/alerts"}
    assert all(r["headers"]["Content-Type"] == "application/json" for r in reqs)
    firing, resolved = reqs[-2]["json"], reqs[-1]["json"]
    assert firing[0]["startsAt"] == "2023-11-14T22:12:50.000Z"
    # now + 600 s, at the attempt that got through (a second or so after the first)
    assert 0 <= parse_ts(firing[0]["endsAt"]) - (now + 600) < 10
    assert resolved[0]["startsAt"] == "2023-11-14T22:12:50.000Z"
    assert resolved[0]["endsAt"] == "2023-11-14T22:13:20.500Z"  # when it resolved: ends it
    assert resolved[0]["labels"] == firing[0]["labels"]
    assert "ended" in resolved[0]["annotations"]["summary"]
    ids = [r["headers"][DELIVERY_HEADER] for r in reqs]
    assert len(set(ids[:4])) == 1 and ids[4] != ids[3]  # one id per delivery, kept on retry


def test_summary_without_a_time_to_oom_and_timestamps() -> None:
    ann = annotations_for(
        payload(time_to_oom_s=None, risk={"60": 0.7, "300": 0.95}, rule="custom", device="gpu0")
    )
    assert ann["summary"] == (
        "gpu0 on node-7 is at risk of running out of memory (risk 0.95 within 300 s)"
    )
    assert json.dumps(ann)  # plain strings only
    assert rfc3339(0) == "1970-01-01T00:00:00.000Z"
    assert rfc3339(1.2345) == "1970-01-01T00:00:01.234Z"


@pytest.mark.slow
def test_the_service_pushes_a_rule_alert_that_alertmanager_shows(
    am: Alertmanager, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """`oomcast serve` with OOMCAST_ALERTMANAGER_URL, a replayed leak, the alert read back."""
    from support import leak_trace, oomcast_cmd, start_serve, write

    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n"
        "  - name: gpu-oom-soon\n"
        "    when: {model_rule: true}\n"
        "    actions: [alertmanager]\n"
        "    severity: critical\n"
    )
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_ALERTMANAGER_URL": am.url,
        "OOMCAST_RULES": str(rules),
        "OOMCAST_FORECASTER": "predict_linear_w60s_h60s_gate0.80_full",
        "OOMCAST_CONSUMER_NAME": "am-e2e",
        "OOMCAST_MAX_TS_SKEW_S": "0",  # replayed at 40x with the trace's own stamps
    }
    port = free_port()
    server = start_serve(env, port)
    try:
        # a leak that is still climbing when the replay ends: the episode stays firing
        records = leak_trace(seconds_to_oom=300, node="node-am")[:-1]
        trace = write(tmp_path / "leak.jsonl.gz", records)
        done = subprocess.run(
            oomcast_cmd(
                "collect",
                "--source",
                "replay",
                "--trace",
                str(trace),
                "--speed",
                "40",
                "--keep-ts",
                "--metrics-port",
                "0",
            ),
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr

        def active() -> list[dict[str, Any]]:
            return [
                a
                for a in httpx.get(f"{am.url}/api/v2/alerts").json()
                if a["labels"].get("alertname") == "gpu-oom-soon"
            ]

        assert wait_until(lambda: bool(active()), 30)
        [alert] = active()
        labels = alert["labels"]
        assert (labels["node"], labels["device"], labels["job"]) == ("node-am", "gpu0", "leaky")
        assert labels["severity"] == "critical"
        assert "out of memory" in alert["annotations"]["summary"]
        audit = httpx.get(f"http://127.0.0.1:{port}/v1/alerts").json()["alerts"]
        [firing] = [a for a in audit if a.get("rule_name") == "gpu-oom-soon"]
        assert firing["status"] == "firing" and firing["dispatched"] == {"alertmanager": "owed"}

        # and the audit says it was delivered, not merely handed over
        def delivered() -> bool:
            audit = httpx.get(f"http://127.0.0.1:{port}/v1/alerts").json()["alerts"]
            return any(
                a.get("record") == "delivery"
                and (a["target"], a["outcome"]) == ("alertmanager", "delivered")
                and a["episode"] == firing["episode"]
                for a in audit
            )

        assert wait_until(delivered)
    finally:
        server.terminate()
        server.wait(15)


def test_the_cause_and_the_remedies_are_annotations_of_their_own() -> None:
    ann = annotations_for(
        payload(
            cause="fragmentation",
            evidence="24% of the 76.0 GiB reserved is cached but not in use",
            remedies=["set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True", "empty_cache"],
            cause_thin=["no allocation stacks"],
        )
    )
    assert ann["summary"].endswith("[cause: fragmentation]")
    assert ann["cause"] == "fragmentation: 24% of the 76.0 GiB reserved is cached but not in use"
    assert ann["remedies"] == (
        "- set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True\n- empty_cache"
    )
    assert ann["evidence_thin"] == "no allocation stacks"
    assert "cause" not in annotations_for(payload())  # older payloads: nothing invented
