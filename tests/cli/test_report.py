"""``oomcast report``: the scorecard as a weekly review reads it."""

from __future__ import annotations

import argparse
import json
import socket
import time

import pytest
import redis.asyncio as aioredis
from support import free_port, start_serve

from oomcast.cli.common import UsageError
from oomcast.cli.report import report_lines, run
from oomcast.service.pipeline.outcomes import CHAMPION, Outcome
from oomcast.service.scorecard import OutcomeStore, Read, outcome_keys, scorecard

NOW = float(int(time.time()))


def outcome(i: int, kind: str, **kw: object) -> Outcome:
    return Outcome(f"o{i}", kind, NOW - 60 + i, "n1", f"gpu{i}", "gpu", f"job{i % 2}", CHAMPION,
                   "lstm-x", **kw)  # type: ignore[arg-type]  # fmt: skip


OUTS = [
    outcome(1, "oom", warned="30s", oom_class="long", lead_s=50.0, tto_error=0.1),
    outcome(2, "oom", warned="no", oom_class="sudden"),
    outcome(3, "false_alarm"),
    outcome(4, "exposure", seconds=7200.0),
]


def test_the_report_says_what_the_scorecard_counted() -> None:
    card = scorecard(Read(outcomes=OUTS, sealed=True), NOW - 7 * 86400, NOW, by="job")
    text = "\n".join(report_lines(card))
    assert "champion lstm-x" in text
    assert "OOMs 2: warned 30 s ahead 1 (50%), 10 s ahead 1 (50%), missed at 30 s 1" in text
    assert "long 1/1 at 30 s" in text and "sudden 0/1 at 30 s" in text
    assert "precision 50%, false alarms 1 (500 per 1,000 job-hours over 2 h)" in text
    assert "median lead 50 s" in text
    assert "job job0" in text and "job job1" in text


def test_an_empty_window_and_unsealed_outcomes_are_said_plainly() -> None:
    card = scorecard(Read(outcomes=[], sealed=False, forged=0), NOW - 3600, NOW)
    text = "\n".join(report_lines(card))
    assert "no outcome in this window" in text
    assert "not sealed" in text


def args(url: str, **kw: object) -> argparse.Namespace:
    return argparse.Namespace(url=url, token=None, since="7d", by=None, json=False, **kw)


def test_an_unreachable_service_or_a_bad_window_is_a_usage_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens here
    with pytest.raises(UsageError, match="cannot reach"):
        run(args(f"http://127.0.0.1:{port}"))
    with pytest.raises(UsageError, match="--by"):
        run(argparse.Namespace(url="http://x", token=None, since="7d", by="colour", json=False))


@pytest.mark.slow
def test_report_reads_a_running_service(
    redis_url: str, key_prefix: str, capsys: pytest.CaptureFixture[str]
) -> None:
    import asyncio
    import os

    async def put() -> None:
        client = aioredis.from_url(redis_url)
        store = OutcomeStore(client, key_prefix, seal_keys=outcome_keys("c0ntrol", None))
        await store.record(OUTS)
        await client.aclose()

    asyncio.run(put())
    port = free_port()
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url, "OOMCAST_KEY_PREFIX": key_prefix,
           "OOMCAST_CONTROL_SECRET": "c0ntrol", "OOMCAST_FORECASTER": "threshold_0.90"}  # fmt: skip
    proc = start_serve(env, port)
    try:
        assert run(args(f"http://127.0.0.1:{port}")) == 0
        text = capsys.readouterr().out
        assert "OOMs 2: warned 30 s ahead 1 (50%)" in text
        a = args(f"http://127.0.0.1:{port}")
        a.json = True
        assert run(a) == 0
        card = json.loads(capsys.readouterr().out)
        assert card["models"][0]["false_alarms"] == 1 and card["sealed"] is True
        a.since = "yesterday"
        with pytest.raises(UsageError, match=r"--since: .*7d, 24h"):
            run(a)
    finally:
        proc.terminate()
        proc.wait()
