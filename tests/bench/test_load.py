"""The load and readings of the ingest bench (bench/load.py)."""

from __future__ import annotations

import math

import pytest

from oomcast.bench.load import Fleet, histogram_quantile
from oomcast.model.wire import decode_samples


def test_quantiles_are_interpolated_within_the_bucket_they_fall_in() -> None:
    buckets = [(0.01, 50.0), (0.1, 90.0), (1.0, 100.0), (math.inf, 100.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.01)
    assert histogram_quantile(0.7, buckets) == pytest.approx(0.01 + 0.09 * 20 / 40)
    assert histogram_quantile(0.99, buckets) == pytest.approx(0.1 + 0.9 * 9 / 10)
    # beyond the top finite bound: that bound, not infinity
    assert histogram_quantile(0.99, [(0.1, 1.0), (math.inf, 100.0)]) == pytest.approx(0.1)
    assert histogram_quantile(0.5, [(0.1, 0.0), (math.inf, 0.0)]) is None


def test_the_fleet_writes_what_an_agent_writes() -> None:
    fleet = Fleet(domains=12, secret="s")
    assert [fleet.size(i) for i in range(len(fleet.nodes))] == [8, 4]
    fields = fleet.entry(1, 1000.0)
    assert fields["node"] == fleet.nodes[1] and "sig" in fields
    decoded = decode_samples(dict(fields))
    assert len(decoded) == 4
    for d in decoded:
        assert not isinstance(d, Exception)
        assert d.emb is not None  # the node computed the embedding
