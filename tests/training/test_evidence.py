"""The evidence ceiling (training/evidence.py): a leak shows growth 30 s before its OOM, a
flat run that one step kills does not."""

from __future__ import annotations

from pathlib import Path

import pytest
from support import T0, leak_trace, sample

from oomcast.model.schema import Event
from oomcast.model.trace import write_trace
from oomcast.training.evidence import evidence, main


def test_a_leak_is_seen_and_a_step_out_of_the_blue_is_not(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write_trace(tmp_path / "leak.jsonl", leak_trace(start_frac=0.4, seconds_to_oom=300))
    flat = [sample(T0 + i, 0.5, job="flat") for i in range(300)]
    flat.append(Event(ts=T0 + 300, node="n1", device="gpu0", event="oom", job="flat"))
    write_trace(tmp_path / "step.jsonl", flat)
    young = leak_trace(start_frac=0.4, seconds_to_oom=40)  # a short OOM: not scored here
    write_trace(tmp_path / "young.jsonl", young)
    found = {e.trace.split(":")[0]: e for e in evidence(sorted(tmp_path.glob("*.jsonl")))}
    assert set(found) == {"leak.jsonl", "step.jsonl"}
    assert found["leak.jsonl"].gated and found["leak.jsonl"].growth_age_s > 200
    assert not found["step.jsonl"].visible
    assert main([str(tmp_path)]) == 0
    assert "long OOMs 2: growth beyond noise 30 s before the OOM in 1" in capsys.readouterr().out
