"""service/metrics.py: what the service exports about itself."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, Histogram

from oomcast.service.metrics import observe_many


def _figures(observations: list[tuple[float, int]], many: bool) -> dict[str, float]:
    r = CollectorRegistry()
    h = Histogram("lat_seconds", "x", buckets=(0.001, 0.01, 0.1, 1), registry=r)
    for amount, count in observations:
        if many:
            observe_many(h, amount, count)
        else:
            for _ in range(count):
                h.observe(amount)
    out = {}
    for metric in r.collect():
        for s in metric.samples:
            if not s.name.endswith("_created"):
                out[f"{s.name}{sorted(s.labels.items())}"] = s.value
    return out


@pytest.mark.parametrize(
    "observations",
    [[(0.0005, 8)], [(0.01, 3), (0.5, 1), (7.0, 8), (0.0, 0)], [(0.1, 1), (0.1000001, 2)]],
)
def test_observing_an_entrys_samples_at_once_is_observing_each(
    observations: list[tuple[float, int]],
) -> None:
    """Bucket counts, count and sum exactly as ``count`` separate observations give them,
    bucket edges (<= the bound) and the +Inf bucket included."""
    many, each = _figures(observations, many=True), _figures(observations, many=False)
    assert many.keys() == each.keys() and len(many) == 7  # 5 buckets, count, sum
    for name, value in each.items():
        assert many[name] == pytest.approx(value, rel=1e-12), name
