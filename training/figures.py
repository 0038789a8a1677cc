"""Figures of the simulated scenarios: one example per family, for the docs."""

from __future__ import annotations

from pathlib import Path

from oomcast.model.schema import Event, Sample
from oomcast.training.scenarios import FAMILIES, OOM_FAMILIES, draw_params, simulate_scenario

GIB = 1 << 30


def plot_families(out_dir: Path | str, cache_dir: Path | str, tries: int = 20) -> list[Path]:
    """One PNG per family: used (NVML), reserved and allocated over time, the OOM marked.
    For an OOM family the first seed that does OOM is shown."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for family in FAMILIES:
        for seed in range(tries):
            params = draw_params(family, seed)
            records, summary = simulate_scenario(params, Path(cache_dir))
            if summary["ooms"] == (family in OOM_FAMILIES):
                break
        samples = [r for r in records if isinstance(r, Sample)]
        t0 = samples[0].ts
        ts = [s.ts - t0 for s in samples]
        fig, ax = plt.subplots(figsize=(8, 3.2), dpi=90)
        ax.plot(ts, [s.used_bytes / GIB for s in samples], label="used (NVML)", lw=1.2)
        ax.plot(ts, [(s.reserved_bytes or 0) / GIB for s in samples], label="reserved", lw=1)
        ax.plot(ts, [(s.allocated_bytes or 0) / GIB for s in samples], label="allocated", lw=0.8)
        ax.axhline(samples[0].total_bytes / GIB, color="k", ls=":", lw=0.8, label="capacity")
        for r in records:
            if isinstance(r, Event) and r.event == "oom":
                ax.axvline(r.ts - t0, color="r", lw=1.5, label="OOM")
        ax.set_title(
            f"{family}: {params.capture} on a {params.gpu_gib} GiB GPU, samples every"
            f" {params.interval_s:g}s (seed {seed})",
            fontsize=9,
        )
        ax.set_xlabel("seconds")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7, loc="lower right")
        fig.tight_layout()
        path = out / f"scenario-{family}.png"
        fig.savefig(path)
        plt.close(fig)
        written.append(path)
    return written
