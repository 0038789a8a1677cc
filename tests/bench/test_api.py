"""``oomcast bench api --predict``: a real ``oomcast serve`` answering real httpx clients over
sockets, and figures that add up. (The ``/v1/devices`` mode is tested beside its route, in
test_devices_api.py.)"""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
from support import oomcast_cmd

from oomcast.bench.api import parse_concurrency, predict_window
from oomcast.service.api.samples_in import parse_samples

needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="the bench starts a private redis-server"
)


def _bench(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        oomcast_cmd("bench", "api", "--predict", "--json", *args),
        capture_output=True,
        text=True,
        timeout=180,
    )


def test_concurrency_lists_are_read_and_bad_ones_named() -> None:
    assert parse_concurrency("1,16") == [1, 16]
    assert parse_concurrency(" 4 ") == [4]
    for bad, part in (("1,0", "'0'"), ("1,x", "'x'"), ("", "''"), ("2,,3", "''")):
        with pytest.raises(ValueError, match=part):
            parse_concurrency(bad)


def test_a_window_is_one_domain_at_10_hz_that_the_api_accepts() -> None:
    window = predict_window(3, 600, end_ts=1_750_000_000.0)
    samples = parse_samples(window, limit=10_000, one_domain=True)  # raises on anything wrong
    assert len(samples) == 600 and samples[-1].ts == 1_750_000_000.0
    assert samples[-1].ts - samples[0].ts == pytest.approx(59.9)
    assert predict_window(3, 600, 1_750_000_000.0) == window  # the same windows every run
    assert predict_window(4, 600, 1_750_000_000.0)[0]["node"] != window[0]["node"]


@pytest.mark.slow
@needs_redis_server
def test_predict_is_timed_at_each_concurrency() -> None:
    done = _bench("--concurrency", "1,4", "--seconds", "0.5", "--window", "600")
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["route"] == "POST /v1/predict" and out["window"] == 600
    assert out["model_version"] and out["body_bytes"] > 600 * 100
    assert set(out["by_concurrency"]) == {"1", "4"}
    for run in out["by_concurrency"].values():
        assert run["requests"] > 0 and run["seconds"] >= 0.5
        assert run["requests_per_s"] == pytest.approx(run["requests"] / run["seconds"], rel=0.01)
        assert run["samples_per_s"] == pytest.approx(run["requests_per_s"] * 600, rel=0.01)
        assert run["max_ms"] >= run["p99_ms"] >= run["p50_ms"] > 0
        assert run["service_cpu_pct"] > 0  # the service did the work, not something else
    # four clients queue behind one another: each waits longer than a lone one
    assert out["by_concurrency"]["4"]["p50_ms"] > out["by_concurrency"]["1"]["p50_ms"]


@pytest.mark.slow
@needs_redis_server
def test_an_answer_other_than_200_stops_the_bench_and_says_why() -> None:
    done = _bench("--concurrency", "1", "--seconds", "0.2", "--window", "10001")
    assert done.returncode == 2
    assert "answered the first request 422" in done.stderr
    assert "the limit is 10000" in done.stderr and done.stdout == ""
    logs = done.stderr.rsplit("the logs are kept in ", 1)[1].strip()
    assert "oomcast-bench-api-" in logs
    shutil.rmtree(logs)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_bad_arguments_are_refused_before_anything_starts() -> None:
    done = _bench("--concurrency", "1,zero")
    assert done.returncode == 2 and "'zero' is not a count" in done.stderr
    done = _bench("--window", "0")
    assert done.returncode == 2 and "window" in done.stderr
