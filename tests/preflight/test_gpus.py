from __future__ import annotations

import pytest

from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES, GPUS, capacity_for, lookup_gpu

MIB = 1 << 20


def test_the_catalogue_gives_nvml_totals_less_the_context() -> None:
    assert lookup_gpu("h100-80gb").total_bytes == 81559 * MIB
    name, capacity, total = capacity_for("A100-40GB")
    assert (name, total) == ("A100-40GB", 40960 * MIB)
    assert capacity == 40960 * MIB - CONTEXT_ALLOWANCE_BYTES
    assert capacity_for("T4", context_bytes=0)[1] == 15360 * MIB
    for gpu in GPUS.values():
        assert gpu.total_bytes % MIB == 0 and gpu.total_bytes > CONTEXT_ALLOWANCE_BYTES


def test_capacity_bytes_overrides_the_catalogue() -> None:
    assert capacity_for("H200", 10**9) == ("H200", 10**9, 143771 * MIB)
    assert capacity_for(None, 10**9) == ("custom", 10**9, None)


def test_an_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(ValueError) as info:
        capacity_for("H300")
    text = str(info.value)
    assert "unknown GPU 'H300'" in text and "H100-80GB" in text and "T4" in text
    with pytest.raises(ValueError, match="give a GPU name"):
        capacity_for(None)
    with pytest.raises(ValueError, match="leaves no memory"):
        capacity_for("T4", context_bytes=16 * 1024 * MIB)
