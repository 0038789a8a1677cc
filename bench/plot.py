"""A PNG of a soak's resident memory over time (``oomcast bench ingest --soak --plot``):
what the team sizing a deployment looks at to see that memory levels off."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# The soak's own yardsticks (docs/bench.md): memory after warm-up, and the band around it.
WARM_S = 300.0
BAND = 0.05


def plot_soak(result: dict[str, Any], path: str | Path) -> Path:
    """Draw ``result["rss_series"]`` (``[seconds, MB]`` pairs from a ``--soak`` run) to
    ``path`` with the empty service, the value after warm-up and the +/-5% band around it."""
    series = result.get("rss_series")
    if not series or len(series) < 2:
        raise ValueError("plot_soak: the result has no rss_series (run bench ingest with --soak)")
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    minutes = [t / 60.0 for t, _ in series]
    mb = [float(m) for _, m in series]
    warm = next((m for t, m in series if t >= WARM_S), mb[-1])
    empty = float(result.get("rss_mb_start", mb[0]))
    domains = int(result.get("domains", 0))
    fig, ax = plt.subplots(figsize=(9, 4), dpi=100)
    try:
        ax.axhspan(
            warm * (1 - BAND),
            warm * (1 + BAND),
            color="#55A868",
            alpha=0.15,
            lw=0,
            label=f"{warm:.1f} MB at {WARM_S / 60:.0f} min, +/-{BAND:.0%}",
        )
        ax.axhline(empty, color="#999999", ls="--", label=f"empty service {empty:.1f} MB")
        ax.plot(minutes, mb, color="#4C72B0", label="RSS (front and workers)")
        per = (mb[-1] - empty) * 1024 / domains if domains else 0.0
        ax.set_title(
            f"oomcast serve RSS, {domains:,} domains at {result.get('rate_target', 0):,.0f}"
            f" samples/s: end {mb[-1]:.1f} MB, {per:.1f} KB per domain"
        )
        ax.set_xlabel("minutes")
        ax.set_ylabel("MB")
        ax.set_ylim(0, max(mb) * 1.15)
        ax.legend(loc="lower right")
        out = Path(path)
        fig.tight_layout()
        fig.savefig(out)
    finally:
        plt.close(fig)
    return out
