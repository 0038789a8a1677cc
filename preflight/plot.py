"""A PNG timeline of a replay for people: allocated and reserved bytes over the run's
requests, one shaded band per (step, phase), the capacity as a line, the OOM marked."""

from __future__ import annotations

from pathlib import Path

from oomcast.preflight.report import PreflightReport

_COLOURS = {
    "forward": "#4C72B0",
    "backward": "#DD8452",
    "optimizer": "#55A868",
    "eval": "#C44E52",
    "checkpoint": "#8172B3",
    "other": "#999999",
}


def plot_timeline(report: PreflightReport, path: str | Path) -> Path:
    """Write the timeline of ``report`` to ``path`` (PNG) and return the path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rep = report.replay
    gib = float(1 << 30)
    xs = list(range(len(rep.timeline)))
    fig, ax = plt.subplots(figsize=(11, 4.5), dpi=100)
    try:
        start = 0
        for i in range(1, len(rep.timeline) + 1):
            if i == len(rep.timeline) or rep.timeline[i][2] != rep.timeline[start][2]:
                p = rep.phases[rep.timeline[start][2]]
                ax.axvspan(start, i, color=_COLOURS.get(p.phase, "#999999"), alpha=0.12, lw=0)
                start = i
        ax.plot(xs, [t[1] / gib for t in rep.timeline], label="reserved", color="#333333")
        ax.plot(xs, [t[0] / gib for t in rep.timeline], label="allocated", color="#4C72B0")
        ax.axhline(report.capacity_bytes / gib, color="#C44E52", ls="--", label="capacity")
        if rep.oom is not None:
            ax.axvline(len(xs), color="#C44E52", lw=2)
            ax.annotate(
                f"OOM: {rep.oom.phase}, step {rep.oom.step}",
                (len(xs), 0),
                textcoords="offset points",
                xytext=(-4, 6),
                ha="right",
                color="#C44E52",
            )
        for name, colour in _COLOURS.items():
            if any(p.phase == name for p in rep.phases):
                ax.axvspan(0, 0, color=colour, alpha=0.3, label=name)
        ax.set_xlabel("allocator request (in order)")
        ax.set_ylabel("GiB")
        ax.set_title(f"{report.job} on {report.gpu}: {report.verdict_text()}", fontsize=9)
        ax.legend(loc="upper left", fontsize=8, ncol=3)
        out = Path(path)
        out.parent.mkdir(parents=True, exist_ok=True)
        fig.tight_layout()
        fig.savefig(out, format="png")
    finally:
        plt.close(fig)
    return out
