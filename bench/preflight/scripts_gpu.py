"""Preflight of scripts as written, on a machine with a GPU: a prepared check.

For each example script in ``bench/preflight/scripts/`` (a plain loop, a Hugging Face
``Trainer`` script, a Lightning script):

1. preflight's answer (``preflight_script``, at unlimited capacity): peak allocated and
   reserved bytes, the phases, the seconds it took, and whether a CUDA context was made (it
   must not be: the GPU is emulated);
2. for the plain scripts, the truth: the script run for real on the GPU in a child process,
   stopped after the same number of optimizer steps, ``torch.cuda.max_memory_allocated`` and
   ``max_memory_reserved`` read then.

    python -m oomcast.bench.preflight.scripts_gpu [--out FILE]

Without CUDA the truth is left out (None): that is the dry run the CPU machines can do.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent / "scripts"
# name -> (file, arguments after the output folder placeholder {out}, real run comparable)
CASES: dict[str, tuple[str, list[str], bool]] = {
    "plain_lm_b16": ("plain_lm.py", ["--batch-size", "16", "--out", "{out}/c.pt"], True),
    "plain_lm_b64": ("plain_lm.py", ["--batch-size", "64", "--out", "{out}/c.pt"], True),
    "hf_trainer": ("hf_trainer.py", ["{out}/hf"], False),
    "lightning_mlp": ("lightning_mlp.py", ["{out}/pl"], False),
}
STEPS = 3

# Runs a script for real and stops it after STEPS optimizer steps, reporting the CUDA peaks.
TRUTH = """
import json, os, runpy, sys
import torch
from torch.optim.optimizer import register_optimizer_step_post_hook
steps = [0]
def post(opt, args, kwargs):
    steps[0] += 1
    if steps[0] >= int(os.environ["STEPS"]):
        torch.cuda.synchronize()
        print("TRUTH " + json.dumps({
            "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
        }), flush=True)
        os._exit(0)
register_optimizer_step_post_hook(post)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def predict(name: str, out: Path) -> dict[str, Any]:
    import torch

    from oomcast.preflight.script import preflight_script

    file, argv, _ = CASES[name]
    started = time.monotonic()
    report = preflight_script(
        str(SCRIPTS / file),
        [a.format(out=out) for a in argv],
        capacity_bytes=1 << 40,
        steps=STEPS,
        remedies=False,
    )
    r = report.replay
    return {
        "peak_allocated_bytes": r.peak_allocated_bytes,
        "peak_reserved_bytes": r.peak_reserved_bytes,
        "phases": sorted({p.phase for p in r.phases}),
        "steps": report.steps,
        "seconds": round(time.monotonic() - started, 2),
        "cuda_initialized": bool(torch.cuda.is_initialized()),  # type: ignore[no-untyped-call]
        "notes": report.notes,
    }


def truth(name: str, out: Path) -> dict[str, Any] | None:
    import os

    import torch

    file, argv, comparable = CASES[name]
    if not comparable or not torch.cuda.is_available():
        return None
    run = subprocess.run(
        [sys.executable, "-c", TRUTH, str(SCRIPTS / file), *[a.format(out=out) for a in argv]],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "STEPS": str(STEPS)},
    )
    for line in run.stdout.splitlines():
        if line.startswith("TRUTH "):
            got: dict[str, Any] = json.loads(line[6:])
            return got
    return {"error": run.stderr[-2000:]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--only", action="append", choices=sorted(CASES))
    args = p.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.only or CASES:
            folder = Path(tmp) / name
            folder.mkdir()
            row: dict[str, Any] = {"case": name}
            try:
                row["predicted"] = predict(name, folder)
            except Exception as exc:  # report and go on: one broken case must not hide the rest
                row["predicted"] = {"error": f"{type(exc).__name__}: {exc}"}
            row["truth"] = truth(name, folder)
            pred, real = row["predicted"], row["truth"]
            if real and "error" not in real and "error" not in pred:
                row["rel_error_allocated"] = round(
                    pred["peak_allocated_bytes"] / real["peak_allocated_bytes"] - 1, 4
                )
            print(json.dumps({k: v for k, v in row.items() if k != "notes"}), file=sys.stderr)
            rows.append(row)
    text = json.dumps({"steps": STEPS, "rows": rows}, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
