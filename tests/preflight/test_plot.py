from __future__ import annotations

from pathlib import Path

from preflight_jobs import param_bytes, wide_mlp

from oomcast.preflight import preflight
from oomcast.preflight.plot import plot_timeline


def test_a_png_timeline_is_written(tmp_path: Path) -> None:
    for name, capacity in (("fits", 10 * param_bytes(1024, 4)), ("oom", 3 * param_bytes(1024, 4))):
        report = preflight(wide_mlp(1024, 4, 8), capacity_bytes=capacity, steps=2, remedies=False)
        out = plot_timeline(report, tmp_path / "sub" / f"{name}.png")
        data = out.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
