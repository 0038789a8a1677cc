"""``oomcast bench cluster`` on a tiny load: every sample accounted for with one replica and
with two, the two holding half the partitions each; bad counts refused by name."""

from __future__ import annotations

import pytest

from oomcast.bench.cluster import bench_cluster, parse_replicas


def test_replica_counts_are_parsed_and_bad_ones_refused() -> None:
    assert parse_replicas("1,2") == [1, 2]
    with pytest.raises(ValueError, match="comma-separated"):
        parse_replicas("1;2")
    with pytest.raises(ValueError, match="at least 1"):
        parse_replicas("0,2")
    with pytest.raises(ValueError, match="--domains"):
        bench_cluster(domains=0, seconds=1)


@pytest.mark.slow
def test_a_tiny_drain_by_one_then_two_replicas() -> None:
    result = bench_cluster(domains=40, seconds=1.0, counts=(1, 2), partitions=4)
    one, two = result["runs"]
    for run in (one, two):
        assert run["samples_written"] == 40 * 10  # 10 ticks of 40 GPUs
        assert run["entries_written"] == 5 * 10  # 8 GPUs a node
        assert run["samples_per_s"] > 0 and run["redis_calls_per_sample"] > 0
    assert list(one["partitions_held"].values()) == [[0, 1, 2, 3]]
    held = sorted(p for parts in two["partitions_held"].values() for p in parts)
    assert held == [0, 1, 2, 3] and all(len(p) == 2 for p in two["partitions_held"].values())
    assert set(result["samples_per_s"]) == {"1", "2"} and result["speedup_vs_1"]["1"] == 1.0
