"""Diagnosis bundles and their reading (``oomcast explain``), on snapshots made by the
caching-allocator simulator in torch's own snapshot format: a fragmented cache is named as
such with the expandable-segments remedy, a cache full of live tensors is not."""

from __future__ import annotations

import gzip
import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest

from oomcast.collectors.diagnosis import (
    EXPANDABLE,
    DiagnosisError,
    analyse,
    explain_text,
    read_file,
    write_bundle,
)
from oomcast.training.allocator import CachingAllocatorSim, SimOutOfMemory

MIB = 1 << 20


def frames(line: int) -> list[dict[str, Any]]:
    return [
        {"filename": "/venv/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "fw"},
        {"filename": "train.py", "line": line, "name": "step"},
    ]


def fragmented() -> tuple[dict[str, Any], int]:
    """8 MiB blocks packed two to a 20 MiB segment, every other one freed: 60% of the cache
    is free, yet no free block is longer than 8 MiB, and a 16 MiB request fails."""
    sim = CachingAllocatorSim(400 * MIB)
    handles = [sim.malloc(8 * MIB) for _ in range(40)]
    for h in handles[::2]:
        sim.free(h)
    with pytest.raises(SimOutOfMemory):
        sim.malloc(16 * MIB)
    site = {h: frames(10 + i % 2) for i, h in enumerate(handles)}
    snap = sim.memory_snapshot(lambda h: site[h])
    snap["device_traces"] = [[{"action": "oom", "size": 16 * MIB, "frames": []}]]
    return snap, 400 * MIB


def test_a_fragmented_cache_gets_the_expandable_segments_remedy() -> None:
    snap, capacity = fragmented()
    d = analyse(snap, capacity_bytes=capacity)
    assert d.reserved_bytes == 400 * MIB and d.allocated_bytes == 160 * MIB
    assert d.fragmentation == pytest.approx(0.6)
    assert d.largest_free_block == 8 * MIB and d.failing_request == 16 * MIB
    assert d.fits_largest_free is False
    assert d.remedies[0].startswith("fragmentation") and EXPANDABLE in d.remedies[0]
    assert d.top_sites[0].where == "train.py:11 in step"  # user code, not torch's frame
    assert sum(s.bytes for s in d.top_sites) == d.allocated_bytes
    text = explain_text(d)
    assert "it does not fit" in text and EXPANDABLE in text


def test_live_tensors_filling_the_gpu_are_not_called_fragmentation() -> None:
    sim = CachingAllocatorSim(200 * MIB)
    live = [sim.malloc(30 * MIB) for _ in range(6)]
    snap = sim.memory_snapshot(lambda h: frames(7))
    d = analyse(snap, capacity_bytes=200 * MIB, failing_request=40 * MIB)
    assert live and d.fragmentation < 0.15
    assert not any(r.startswith("fragmentation") for r in d.remedies)
    assert d.remedies[0].startswith("live tensors fill the GPU")
    assert "train.py:7 in step" in d.remedies[0]


def test_thin_evidence_is_said() -> None:
    sim = CachingAllocatorSim(100 * MIB)
    sim.malloc(5 * MIB)
    d = analyse(sim.memory_snapshot())  # no stacks, no capacity, no failing request
    assert any("no allocation stacks" in t for t in d.thin)
    assert any("capacity" in t for t in d.thin) and any("failing request" in t for t in d.thin)


def test_a_bundle_round_trips_with_its_context(tmp_path: Path) -> None:
    snap, capacity = fragmented()
    path = write_bundle(
        tmp_path / "bundles",
        node="n1",
        device="gpu0",
        job="pod:train",
        alert={"status": "firing", "risk": 0.93},
        samples=[{"ts": 1.0, "used_bytes": 1}],
        allocator={"capacity_bytes": capacity, "num_alloc_retries": 3},
        processes=[{"pid": 1, "used_bytes": 2}],
        snapshot=snap,
        failing_request_bytes=16 * MIB,
    )
    assert path.name.startswith("oomcast-n1-gpu0-") and path.suffixes[-2:] == [".json", ".gz"]
    got, bundle = read_file(path)
    assert bundle is not None and bundle["job"] == "pod:train"
    d = analyse(got, bundle=bundle)
    assert d.source == "bundle" and d.context["node"] == "n1" and d.capacity_bytes == capacity
    assert d.alloc_retries == 3 and any("retried 3 times" in r for r in d.remedies)
    assert not list((tmp_path / "bundles").glob("*.tmp"))


def test_a_bundle_without_cuda_uses_the_allocator_figures(tmp_path: Path) -> None:
    path = write_bundle(
        tmp_path,
        node="n",
        device="cgroup:/job",
        job=None,
        alert={},
        samples=[],
        allocator={"reserved_bytes": 100, "allocated_bytes": 40},
        processes=[],
        snapshot=None,
    )
    d = analyse(*read_file(path)[:1], bundle=read_file(path)[1])
    assert (d.reserved_bytes, d.allocated_bytes, d.free_cached_bytes) == (100, 40, 60)
    assert any("no memory snapshot" in t for t in d.thin)


@pytest.mark.parametrize(
    ("why", "asked"),
    [
        ("out of memory: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total"
         " capacity of 79.10 GiB of which 1.06 GiB is free.", 2 << 30),
        ("out of memory: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not"
         " enough memory: you tried to allocate 2147483648 bytes.", 2147483648),
    ],
)  # fmt: skip
def test_a_cpu_bundle_reads_the_failing_request_from_the_error(
    tmp_path: Path, why: str, asked: int
) -> None:
    """A job without CUDA has no memory history: the request is in the error's message (it
    used to say "no failing request recorded", and "in 0 segments")."""
    path = write_bundle(
        tmp_path, node="n", device="cgroup:/job", job="j", alert={"why": why}, samples=[],
        allocator={"reserved_bytes": 3 << 30, "allocated_bytes": 3 << 30}, processes=[],
        snapshot=None,
    )  # fmt: skip
    d = analyse(*read_file(path)[:1], bundle=read_file(path)[1])
    assert d.failing_request == asked
    assert not any("no failing request" in t for t in d.thin)
    text = explain_text(d)
    assert "0 segments" not in text and "(no block layout)" in text
    assert "the failing request was 2.00 GiB" in text


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch /tmp/oomcast-pwned",))


def test_a_hostile_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    bad = tmp_path / "evil.pickle"
    bad.write_bytes(pickle.dumps({"segments": [], "x": Boom()}))
    with pytest.raises(DiagnosisError, match=r"refers to posix.system|refers to os.system"):
        read_file(bad)
    assert not Path("/tmp/oomcast-pwned").exists()


def test_foreign_files_get_a_sentence(tmp_path: Path) -> None:
    junk = tmp_path / "junk.bin"
    junk.write_bytes(b"\x00\x01 not a pickle")
    with pytest.raises(DiagnosisError, match="not a bundle or a snapshot pickle"):
        read_file(junk)
    other = tmp_path / "other.json.gz"
    other.write_bytes(gzip.compress(json.dumps({"format": "something-else"}).encode()))
    with pytest.raises(DiagnosisError, match="not an oomcast bundle"):
        read_file(other)
    listy = tmp_path / "list.pickle"
    listy.write_bytes(pickle.dumps([1, 2]))
    with pytest.raises(DiagnosisError, match="'segments' list"):
        read_file(listy)
