"""``oomcast explain`` on the command line: a snapshot pickle in, the diagnosis out."""

from __future__ import annotations

import json
import pickle
import subprocess
from pathlib import Path

import pytest
from support import oomcast_cmd

from oomcast.training.allocator import CachingAllocatorSim

MIB = 1 << 20


def explain(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(oomcast_cmd("explain", *args), capture_output=True, text=True, timeout=60)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_explain_reads_a_snapshot_pickle(tmp_path: Path) -> None:
    sim = CachingAllocatorSim(400 * MIB)
    handles = [sim.malloc(8 * MIB) for _ in range(40)]
    for h in handles[::2]:
        sim.free(h)
    path = tmp_path / "snap.pickle"
    path.write_bytes(pickle.dumps(sim.memory_snapshot()))
    out = explain(str(path), "--request-bytes", str(16 * MIB), "--capacity-bytes", str(400 * MIB))
    assert out.returncode == 0, out.stderr
    assert "it does not fit" in out.stdout and "expandable_segments:True" in out.stdout
    out = explain(str(path), "--json")
    assert out.returncode == 0
    assert json.loads(out.stdout)["fragmentation"] == 0.6


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_explain_refuses_what_it_cannot_read(tmp_path: Path) -> None:
    out = explain(str(tmp_path / "missing.pickle"))
    assert out.returncode == 2 and "no such file" in out.stderr
    junk = tmp_path / "junk"
    junk.write_text("hello")
    out = explain(str(junk))
    assert out.returncode == 2 and "not a bundle or a snapshot pickle" in out.stderr
    assert "Traceback" not in out.stderr
    out = explain(str(junk), "--request-bytes", "0")
    assert out.returncode == 2 and "--request-bytes 0" in out.stderr
