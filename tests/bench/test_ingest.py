"""``oomcast bench ingest``: a real service drained from a real private Redis, and the
figures it prints add up."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from support import oomcast_cmd

from oomcast.bench.ingest import bench_ingest

needs_redis_server = pytest.mark.skipif(
    shutil.which("redis-server") is None, reason="the bench starts a private redis-server"
)


def _bench(*args: str) -> dict[str, object]:
    done = subprocess.run(
        oomcast_cmd("bench", "ingest", "--json", *args),
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


@pytest.mark.slow
@needs_redis_server
def test_a_tiny_drain_is_timed_and_every_sample_is_accounted_for() -> None:
    r = _bench("--domains", "40", "--seconds", "2")
    for key in (
        "samples_per_s",
        "cpu_pct",
        "rss_mb_start",
        "rss_mb_end",
        "p50_ms",
        "p99_ms",
        "samples_written",
        "samples_ingested",
        "entries_written",
        "drain_s",
    ):
        assert key in r, key
    assert r["mode"] == "drain"
    assert isinstance(r["samples_per_s"], int) and r["samples_per_s"] > 0
    # 5 nodes x 20 ticks of 8 GPUs, plus the one tick that wakes the service
    assert r["entries_written"] == 5 * 20 + 1
    assert r["samples_written"] == 8 * r["entries_written"]
    assert r["samples_ingested"] == r["samples_written"]
    assert r["deadletters"] == 0
    assert isinstance(r["rss_mb_start"], float) and r["rss_mb_start"] > 0


@pytest.mark.slow
@needs_redis_server
def test_two_replicas_split_the_partitions_and_drain_every_sample_once() -> None:
    r = bench_ingest(domains=64, seconds=2.0, partitions=4, replicas=2)
    assert r["replicas"] == 2
    each = r["samples_ingested_per_replica"]
    assert len(each) == 2 and all(n > 0 for n in each), each  # both had partitions
    assert sum(each) == r["samples_ingested"] == r["samples_written"]  # none twice, none lost
    assert r["redis_calls_per_1k_samples"] > 0 and r["redis_cpu_pct"] >= 0


def test_more_replicas_than_partitions_are_refused() -> None:
    with pytest.raises(ValueError, match="--replicas 5"):
        bench_ingest(domains=8, seconds=1.0, partitions=4, replicas=5)


@pytest.mark.slow
@needs_redis_server
def test_the_rate_mode_reports_latency_from_the_service_histogram() -> None:
    r = _bench("--domains", "40", "--rate", "400", "--seconds", "2")
    assert r["mode"] == "rate"
    assert r["producer"] == "precomputed"  # a short run's entries are made before the clock
    assert float(str(r["catch_up_s"])) < 1.5  # ... and that is not counted as catching up
    assert r["samples_ingested"] == r["samples_written"] == r["latency_samples"]
    assert isinstance(r["samples_written"], int) and 600 <= r["samples_written"] <= 900
    p50, p99 = r["p50_ms"], r["p99_ms"]
    assert isinstance(p50, float) and isinstance(p99, float) and 0 < p50 <= p99
    assert "interpolated" in str(r["latency_note"])


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_bad_rate_is_refused_with_its_value() -> None:
    done = subprocess.run(
        oomcast_cmd("bench", "ingest", "--rate", "0"), capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2
    assert "--rate 0" in done.stderr


def test_plot_without_soak_is_refused_before_anything_runs(tmp_path: Path) -> None:
    png = tmp_path / "rss.png"
    done = subprocess.run(
        oomcast_cmd("bench", "ingest", "--rate", "100", "--plot", str(png)),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "--soak" in done.stderr
    assert not png.exists()


@pytest.mark.slow
@needs_redis_server
def test_a_soak_records_rss_every_10_s_and_plots_it(tmp_path: Path) -> None:
    png = tmp_path / "rss.png"
    r = _bench("--domains", "16", "--soak", "--rate", "400", "--seconds", "12", "--plot", str(png))
    assert r["mode"] == "soak"
    series = r["rss_series"]
    assert isinstance(series, list)
    times = [t for t, _ in series]
    assert times[:2] == [0.0, pytest.approx(10.0, abs=1.0)] and times[-1] >= 12.0
    assert times == sorted(times)
    assert all(isinstance(mb, float) and mb > 10 for _, mb in series)
    assert series[0][1] == r["rss_mb_start"] and series[-1][1] == r["rss_mb_end"]
    assert r["samples_ingested"] == r["samples_written"] and r["deadletters"] == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
