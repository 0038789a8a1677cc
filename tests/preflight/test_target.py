"""preflight/target.py: the GPU or capacity a preflight is checked against, and the notes
every report on it carries, the same for a described job and a script."""

from __future__ import annotations

import pytest

from oomcast.preflight.allocconf import AllocConf
from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES
from oomcast.preflight.target import Target


def test_a_named_gpu_leaves_room_for_the_context_and_a_capacity_wins() -> None:
    t = Target.resolve("H100-80GB", None, CONTEXT_ALLOWANCE_BYTES, None)
    assert t.label == "H100-80GB" and t.total_bytes is not None
    assert t.capacity_bytes == t.total_bytes - CONTEXT_ALLOWANCE_BYTES
    c = Target.resolve(None, 1 << 30, CONTEXT_ALLOWANCE_BYTES, "expandable_segments:True")
    assert c.capacity_bytes == 1 << 30 and c.conf.expandable_segments


def test_a_report_names_the_target_and_the_settings_it_does_not_model() -> None:
    t = Target.resolve(None, 1 << 30, 0, "garbage_collection_threshold:0.6")
    rep = t.replayer()
    report = t.report(job="j", batch_size=8, device="cpu", steps=1, replay=rep.result)
    assert report.capacity_bytes == 1 << 30 and report.alloc_conf == t.conf.to_string()
    assert report.notes == [
        "garbage_collection_threshold is accepted but not modelled (see docs/preflight.md)"
    ]
    assert isinstance(t.conf, AllocConf)


def test_an_unknown_gpu_is_refused() -> None:
    with pytest.raises(ValueError, match="A100-40GB"):
        Target.resolve("A100", None, 0, None)
