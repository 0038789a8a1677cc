from __future__ import annotations

import json

from preflight_jobs import param_bytes, wide_mlp

from oomcast.preflight import preflight
from oomcast.preflight.replay import OomAt, Replay
from oomcast.preflight.report import PreflightReport

MIB = 1 << 20

KEYS = {
    "gpu",
    "capacity_bytes",
    "alloc_conf",
    "phases",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
    "headroom_bytes",
    "cached_free_frac",
    "verdict",
    "remedies",
}


def test_json_and_text_of_an_oom() -> None:
    report = preflight(wide_mlp(4096, 8, 8), capacity_bytes=3 * param_bytes(4096, 8), steps=1)
    obj = json.loads(json.dumps(report.to_json()))
    assert set(obj) >= KEYS
    assert obj["verdict"]["fits"] is False
    assert (obj["verdict"]["phase"], obj["verdict"]["step"]) == ("optimizer", 0)
    assert obj["verdict"]["requested_bytes"] > 0
    assert obj["verdict"]["fragmented"] is False  # Adam's state is live: no cache to blame
    assert obj["phases"][0] == {
        "step": -1,
        "phase": "other",
        "peak_allocated_bytes": param_bytes(4096, 8),
        "peak_reserved_bytes": param_bytes(4096, 8),
    }
    assert {"name", "change", "peak_reserved_bytes", "fits"} <= set(obj["remedies"][0])
    text = report.text()
    assert "OOM at phase optimizer of step 0" in text
    assert "largest_batch" in text and "remedies" in text


def test_a_fit_reports_headroom() -> None:
    report = preflight(wide_mlp(256, 3, 32), gpu="T4", steps=1, remedies=False)
    obj = report.to_json()
    assert obj["verdict"] == {
        "fits": True,
        "phase": None,
        "step": None,
        "requested_bytes": None,
        "reserved_bytes": None,
        "allocated_bytes": None,
        "fragmented": None,
    }
    assert obj["headroom_bytes"] == obj["capacity_bytes"] - obj["peak_reserved_bytes"] > 0
    assert 0 <= obj["cached_free_frac"] < 1 and "fragmentation" not in obj
    assert report.fits and report.text().count("\n") > 5


def _report_of(oom: OomAt) -> PreflightReport:
    rep = Replay(capacity_bytes=1000 * MIB, oom=oom)
    return PreflightReport("job", "T4", 1000 * MIB, None, "", 8, "cpu", 1, rep)


def test_an_oom_with_the_request_free_in_the_cache_is_fragmentation_and_says_so() -> None:
    pieces = _report_of(OomAt(0, "forward", "", 100 * MIB, 900 * MIB, 700 * MIB))
    assert pieces.to_json()["verdict"]["fragmented"] is True
    assert "fragmentation (expandable_segments:True" in pieces.verdict_text()
    full = _report_of(OomAt(0, "forward", "", 300 * MIB, 900 * MIB, 700 * MIB))
    assert full.to_json()["verdict"]["fragmented"] is False
    assert "fragmentation" not in full.verdict_text()
    assert "live tensors fill the GPU" in full.verdict_text()
