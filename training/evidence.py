"""What the growth tracker saw 30 s before each long OOM: the ceiling under the recall goal
for a forecaster that waits for growth, measured on the traces themselves.

For every OOM the scoring calls long (``training/classes.py``: 60 s or more after the
run's first sample, not a one-step cause), the embedding's growth tracker
(``log1p_growth_age_s``) is read at the last tick 30 s or more before the OOM: whether the
level had grown beyond noise by then, and whether for the 30 s the evidence gate asks for
(``model/network.py``). An OOM with neither gave the tracker nothing to warn on 30 s
ahead. Other signals can still warn it: the peaks of evaluations, phase forecasts, the
brink override at 98% (``docs/model-card.md`` counts them).

    python -m oomcast.training.evidence training/traces/jobs --split test
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from oomcast.model.embedding import FEATURES
from oomcast.model.network import GATE_GROWTH_S
from oomcast.model.trace import find_traces
from oomcast.training.classes import LONG_AFTER_S, SUDDEN_CAUSES
from oomcast.training.dataset import sequences_of
from oomcast.training.evaluate import Causes

_AGE = FEATURES.index("log1p_growth_age_s")
_LEVEL = FEATURES.index("level_frac")


@dataclass(frozen=True)
class Evidence:
    trace: str
    growth_age_s: float  # growth beyond noise, at the last tick 30 s or more before the OOM
    level: float  # the level then

    @property
    def visible(self) -> bool:
        return self.growth_age_s > 0.0

    @property
    def gated(self) -> bool:
        return self.growth_age_s >= GATE_GROWTH_S - 1e-6


def evidence(paths: list[Path], view: str = "full") -> list[Evidence]:
    """One entry per long OOM among ``paths``."""
    causes = Causes()
    out = []
    for path in paths:
        if causes.of(path) in SUDDEN_CAUSES:
            continue
        for s in sequences_of(path, view):
            if not s.ooms or s.oom_after_s is None or s.oom_after_s < LONG_AFTER_S:
                continue
            before = np.nonzero(s.tto >= 30.0)[0]
            if len(before) == 0:
                continue
            i = int(before[-1])
            age = math.expm1(float(s.x[i, _AGE]))
            out.append(Evidence(s.name, round(age, 1), round(float(s.x[i, _LEVEL]), 3)))
    return out


def traces_in(folder: Path, split: str | None) -> list[Path]:
    """The traces of ``folder`` (of its manifest's ``split``, where one is named). A folder
    that is missing, has no traces, or lacks the manifest a split needs is a ValueError
    that says so."""
    if not folder.is_dir():
        raise ValueError(f"{folder}: not a folder of traces")
    if split is None:
        found = find_traces(folder)
    else:
        manifest = folder / "manifest.json"
        if not manifest.is_file():
            raise ValueError(f"--split {split}: {folder} has no manifest.json naming splits")
        runs = json.loads(manifest.read_text(encoding="utf-8")).get("runs", [])
        entries = runs.values() if isinstance(runs, dict) else runs
        found = sorted(
            folder / r["file"]
            for r in entries
            if isinstance(r, dict) and isinstance(r.get("file"), str) and r.get("split") == split
        )
    if not found:
        raise ValueError(f"{folder}: no traces in it" + (f" of split {split}" if split else ""))
    return found


def run_cli(prog: str, body: Callable[[], int]) -> int:
    """``body`` with bad input (a missing folder, a malformed trace) said in one line on
    stderr, exit status 2, instead of a traceback."""
    try:
        return body()
    except (OSError, ValueError) as exc:
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oomcast.training.evidence", description=__doc__)
    p.add_argument("folder", type=Path)
    p.add_argument("--split", choices=("train", "val", "test"))
    p.add_argument("--view", choices=("full", "1hz", "nvml"), default="full")
    args = p.parse_args(argv)
    return run_cli(p.prog, lambda: _report(args))


def _report(args: argparse.Namespace) -> int:
    found = evidence(traces_in(args.folder, args.split), args.view)
    for e in found:
        mark = "gate" if e.gated else "seen" if e.visible else "NONE"
        print(f"{mark:4s} {e.trace:60s} growth {e.growth_age_s:6.1f} s, level {e.level:.2f}")
    n = len(found)
    print(
        f"long OOMs {n}: growth beyond noise 30 s before the OOM in"
        f" {sum(e.visible for e in found)}, for the gate's {GATE_GROWTH_S:g} s in"
        f" {sum(e.gated for e in found)}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
