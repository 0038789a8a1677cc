"""The soak's RSS plot: drawn from the series the bench records, refused without one."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomcast.bench.plot import plot_soak


def test_a_soak_series_is_drawn_to_a_png(tmp_path: Path) -> None:
    import matplotlib.image as mpimg

    series = [[0.0, 300.0]] + [[10.0 * k, 360.0 + min(k, 24) * 0.5] for k in range(1, 181)]
    result = {"domains": 2000, "rate_target": 5000.0, "rss_mb_start": 300.0}
    out = plot_soak(result | {"rss_series": series}, tmp_path / "rss.png")
    img = mpimg.imread(out)
    assert img.shape[0] == 400 and img.shape[1] == 900  # 9 x 4 in at 100 dpi
    assert img[..., :3].std() > 0.05  # something was drawn, not a blank canvas


@pytest.mark.parametrize("result", [{}, {"rss_series": [[0.0, 100.0]]}])
def test_a_result_without_a_series_is_refused(tmp_path: Path, result: dict[str, object]) -> None:
    with pytest.raises(ValueError, match="--soak"):
        plot_soak(result, tmp_path / "rss.png")
    assert not (tmp_path / "rss.png").exists()
