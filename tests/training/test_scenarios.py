from __future__ import annotations

from pathlib import Path

import pytest

from oomcast.model.schema import Event, Sample
from oomcast.model.trace import load_trace, write_trace
from oomcast.training.scenarios import (
    FAMILIES,
    OOM_FAMILIES,
    SAFE_FAMILIES,
    draw_params,
    simulate_scenario,
)


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("captures")


def test_parameters_are_deterministic_and_plausible() -> None:
    for family in FAMILIES:
        a, b = draw_params(family, 3), draw_params(family, 3)
        assert a == b
        assert a != draw_params(family, 4)
        assert 16 <= a.gpu_gib <= 141
        assert 0.1 <= a.interval_s <= 2.0
        assert 300 <= a.context_mib <= 500
        assert a.nccl_mib == 0 or 512 <= a.nccl_mib <= 1640
    with pytest.raises(ValueError, match="unknown scenario family"):
        draw_params("meteor", 0)


@pytest.mark.parametrize("family", FAMILIES)
def test_traces_are_valid_and_physically_consistent(
    family: str, cache: Path, tmp_path: Path
) -> None:
    params = draw_params(family, 1)
    records, summary = simulate_scenario(params, cache)
    path = tmp_path / "t.jsonl.gz"
    write_trace(path, records)
    trace = load_trace(path)  # schema and time order hold
    (domain,) = trace.samples
    samples = trace.samples[domain]
    assert len(samples) == summary["samples"] > 0
    context = params.context_mib << 20
    for s in samples:
        assert s.allocated_bytes is not None and s.reserved_bytes is not None
        assert s.reserved_bytes >= s.allocated_bytes
        assert s.used_bytes <= s.total_bytes == params.gpu_gib << 30
        # NVML sees the context and libraries on top of the allocator (a little noise aside)
        assert s.used_bytes >= s.reserved_bytes + context - (16 << 20)
        assert s.peak_bytes is not None and s.peak_bytes >= s.used_bytes - (16 << 20)
    retries = [s.alloc_retries or 0 for s in samples]
    assert retries == sorted(retries)  # cumulative
    ooms = [e for e in trace.events if e.event == "oom"]
    assert bool(ooms) == summary["ooms"]
    if ooms:
        assert ooms[0].ts >= samples[-1].ts


def test_same_parameters_same_trace(cache: Path) -> None:
    params = draw_params("leak", 2)
    a, _ = simulate_scenario(params, cache)
    b, _ = simulate_scenario(params, cache)
    assert a == b


@pytest.mark.slow
def test_oom_families_oom_and_safe_families_do_not(cache: Path) -> None:
    for family in OOM_FAMILIES:
        outcomes = [simulate_scenario(draw_params(family, s), cache)[1]["ooms"] for s in range(4)]
        assert any(outcomes), family
    for family in SAFE_FAMILIES:
        for seed in range(4):
            _, summary = simulate_scenario(draw_params(family, seed), cache)
            assert not summary["ooms"], (family, seed)


def test_nccl_buffers_and_a_neighbour_show_in_nvml_but_not_in_the_allocator(
    cache: Path,
) -> None:
    for seed in range(40):
        params = draw_params("neighbour", seed)
        if params.nccl_mib:
            break
    records, _ = simulate_scenario(params, cache)
    samples = [r for r in records if isinstance(r, Sample)]
    outside = [s.used_bytes - (s.reserved_bytes or 0) for s in samples]
    base = (params.context_mib + params.workspace_mib) << 20
    assert abs(outside[0] - base) < 16 << 20
    assert max(outside) >= base + (params.nccl_mib << 20) + (1 << 30)  # the neighbour arrived
    assert any(isinstance(r, Event) for r in records) or max(outside) < samples[0].total_bytes
