"""Write a folder of labelled traces (``oomcast simulate``) with a manifest.

For now the traces come from the demo patterns of ``collectors.sources.sim``; the
realistic caching-allocator simulator will add its scenarios here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from oomcast.collectors.sources.sim import GIB, PATTERNS, simulate_trace
from oomcast.model.schema import Event
from oomcast.model.trace import write_trace

GPU_SIZES_GIB = (16, 24, 40, 80, 141)
INTERVALS_S = (0.5, 1.0, 2.0)


def simulate(
    out: Path | str, n: int = 50, seed: int = 0, duration_s: float = 900.0
) -> dict[str, Any]:
    if n < 1:
        raise ValueError(f"n={n} must be at least 1")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    entries = []
    for i in range(n):
        pattern = PATTERNS[i % len(PATTERNS)]
        params = {
            "pattern": pattern,
            "seed": rng.randrange(1 << 30),
            "total_bytes": rng.choice(GPU_SIZES_GIB) * GIB,
            "interval_s": rng.choice(INTERVALS_S),
        }
        records = simulate_trace(
            pattern,
            seed=params["seed"],
            duration_s=duration_s,
            interval_s=params["interval_s"],
            total_bytes=params["total_bytes"],
            start_ts=1_700_000_000.0 + i * 10_000,
            node=f"sim-{i:04d}",
        )
        name = f"{i:04d}-{pattern}.jsonl.gz"
        write_trace(out / name, records)
        ooms = [r.ts for r in records if isinstance(r, Event) and r.event == "oom"]
        entries.append(
            {
                "file": name,
                **params,
                "ooms": bool(ooms),
                "oom_ts": ooms[0] if ooms else None,
                "samples": sum(1 for r in records if not isinstance(r, Event)),
            }
        )
    manifest = {"generator": "sim-patterns", "seed": seed, "n": n, "traces": entries}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest
