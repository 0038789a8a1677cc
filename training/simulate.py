"""Write a folder of labelled traces (``oomcast simulate``), split for training.

Traces come from ``training/scenarios.py``: real allocation logs replayed through the
caching-allocator simulator. Half the traces are drawn from OOM families, half from
families that only look dangerous. The split is by scenario parameters: a (model, GPU
size) combination lands wholly in train, val or test, so the test set holds combinations
no model trained on. Output::

    DIR/manifest.json
    DIR/{train,val,test}/NNNNN-<family>.jsonl.gz
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import time
import zlib
from pathlib import Path
from typing import Any

from oomcast.model.trace import write_trace
from oomcast.training.capture import CAPTURES, cached_capture
from oomcast.training.progress import bar
from oomcast.training.scenarios import (
    ANNOUNCE_SHARE,
    FAMILIES,
    GROWTH_FAMILIES,
    MAX_SAMPLES,
    OOM_FAMILIES,
    SAFE_FAMILIES,
    draw_params,
    simulate_scenario,
)

SPLITS = ("train", "val", "test")
DEFAULT_CACHE = Path("data/captures")


def split_of(capture: str, gpu_gib: int) -> str:
    """Held-out by (model, GPU size): about 15% of combinations test, 15% val."""
    h = zlib.crc32(f"{capture}:{gpu_gib}".encode()) % 100
    return "test" if h < 15 else "val" if h < 30 else "train"


def family_for(i: int) -> str:
    pool = OOM_FAMILIES if i % 2 == 0 else SAFE_FAMILIES
    return pool[(i // 2) % len(pool)]


def _one(job: tuple[int, int, str, str, float]) -> dict[str, Any]:
    i, seed, out, cache, announce_share = job
    family = family_for(i)
    params = first = draw_params(family, seed * 1_000_003 + i)
    split = split_of(params.capture, params.gpu_gib)
    for attempt in range(1, 13):
        records, summary = simulate_scenario(
            params,
            Path(cache),
            start_ts=1_700_000_000.0 + i * 100_000.0,
            node=f"sim-{i:05d}",
            device=f"gpu{i % 8}",
            announce_share=announce_share,
        )
        if family in SAFE_FAMILIES and summary["ooms"]:
            # a look-alike family must not OOM: the draw was too tight; loosen it, run again
            params.target_frac = round(params.target_frac * 0.9, 4)
        elif family in GROWTH_FAMILIES and not summary["ooms"]:
            # cut short before its OOM: run it longer, up to the sample cap, then draw anew
            cap = round(MAX_SAMPLES * params.interval_s, 1)
            if params.duration_s < cap:
                params.duration_s = round(min(cap, params.duration_s * 2), 1)
            else:
                params = draw_params(family, (seed * 1_000_003 + i) * 31 + attempt)
                params.capture, params.gpu_gib = first.capture, first.gpu_gib  # same split
        else:
            break
    name = f"{split}/{i:05d}-{family}.jsonl.gz"
    write_trace(Path(out) / name, records)
    oom = [r.ts for r in records if getattr(r, "event", None) == "oom"]
    return {
        "file": name,
        "split": split,
        **params.to_dict(),
        **summary,
        "oom_ts": oom[0] if oom else None,
    }


def simulate(
    out: Path | str,
    n: int = 200,
    seed: int = 0,
    workers: int | None = None,
    cache_dir: Path | str = DEFAULT_CACHE,
    overwrite: bool = False,
    progress: bool = False,
    announce_share: float = ANNOUNCE_SHARE,
) -> dict[str, Any]:
    """Write ``n`` traces and their manifest to ``out``. ``announce_share``: the chance that a
    job with a schedule has its phases announced before they first run (training/scenarios.py)."""
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    if not 0.0 <= announce_share <= 1.0:
        raise ValueError(f"announce_share={announce_share} must be between 0 and 1")
    out, cache = Path(out), Path(cache_dir)
    out.mkdir(parents=True, exist_ok=True)
    old = [p for split in SPLITS for p in (out / split).glob("*.jsonl.gz")]
    if old and not overwrite:
        raise FileExistsError(
            f"{out} already holds {len(old)} traces; give an empty folder or --overwrite"
        )
    for p in old:
        p.unlink()
    started = time.monotonic()
    for name in CAPTURES:  # run the captures once, before workers read them
        cached_capture(name, cache)
    jobs = [(i, seed, str(out), str(cache), announce_share) for i in range(n)]
    workers = workers or min(len(jobs), os.cpu_count() or 1)
    if workers > 1:
        with mp.get_context("fork").Pool(workers) as pool:
            ordered = pool.imap(_one, jobs, chunksize=max(1, n // (workers * 8)))
            entries = list(bar(ordered, total=n, desc="simulate", unit="trace", show=progress))
    else:
        one_by_one = (_one(job) for job in jobs)
        entries = list(bar(one_by_one, total=n, desc="simulate", unit="trace", show=progress))
    manifest = {
        "generator": "scenarios",
        "seed": seed,
        "n": n,
        "announce_share": announce_share,
        "families": list(FAMILIES),
        "splits": {s: sum(1 for e in entries if e["split"] == s) for s in SPLITS},
        "seconds": round(time.monotonic() - started, 1),
        "traces": entries,
    }
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest
