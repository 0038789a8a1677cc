"""Preflight of scripts as written, against a real GPU: a prepared check for a machine with
one (the CPU machines check the same scripts against the CPU allocator, in
``script_accuracy``).

For each case of ``script_accuracy`` (12 example scripts in ``bench/preflight/scripts/``, two
batch sizes each, ``--steps 3``: train steps, the script's eval and its checkpoint):

1. ``truth``: the script run for real on the GPU, whole, in a child process;
   ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` read as it ends. Children
   run ``--jobs`` at a time (each process has its own peak figures).
2. ``predicted``: ``preflight_script`` at unlimited capacity (the GPU emulated: no CUDA
   context may be made), peak allocated and reserved bytes from its replay, which rounds
   blocks as the CUDA caching allocator does. Each prediction also says whether torch
   initialised CUDA (``cuda_initialized``) and whether NVML lists the process among the
   GPU's compute processes (``gpu_context``; None without NVML): both must stay false.

    python -m oomcast.bench.preflight.scripts_gpu --truth-only --jobs 6 --out truth.json  # GPU
    python -m oomcast.bench.preflight.scripts_gpu --join truth.json      # predictions, here

Without CUDA the truth is left out (None): that is the dry run the CPU machines can do.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from oomcast.bench.preflight.script_accuracy import CASES as ACCURACY_CASES
from oomcast.bench.preflight.script_accuracy import SCRIPTS, STEPS, Case, argv_for

# name -> (case, batch size)
CASES: dict[str, tuple[Case, int]] = {
    f"{c.name}_b{b}": (c, b) for c in ACCURACY_CASES for b in c.batches
}

# Runs a script for real, whole, and reports the CUDA allocator's peaks as it ends.
TRUTH = """
import json, os, runpy, sys, time
import torch
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(sys.argv[0])))
started = time.monotonic()
runpy.run_path(sys.argv[0], run_name="__main__")
torch.cuda.synchronize()
print("TRUTH " + json.dumps({
    "peak_allocated_bytes": torch.cuda.max_memory_allocated(),
    "peak_reserved_bytes": torch.cuda.max_memory_reserved(),
    "seconds": round(time.monotonic() - started, 2),
    "torch": torch.__version__,
    "gpu": torch.cuda.get_device_name(),
}), flush=True)
"""


def holds_gpu_context(pid: int | None = None) -> bool | None:
    """Whether NVML lists ``pid`` (default: this process) among a GPU's compute processes,
    which every process with a CUDA context is; None without NVML or a GPU."""
    try:
        import pynvml

        pynvml.nvmlInit()
        count = pynvml.nvmlDeviceGetCount()
    except Exception:  # no NVML library, no driver: nothing to ask
        return None
    pid = os.getpid() if pid is None else pid
    try:
        for i in range(count):
            handle = pynvml.nvmlDeviceGetHandleByIndex(i)
            if any(p.pid == pid for p in pynvml.nvmlDeviceGetComputeRunningProcesses(handle)):
                return True
        return False
    finally:
        pynvml.nvmlShutdown()


def predict(name: str, out: Path) -> dict[str, Any]:
    import torch

    from oomcast.preflight.script import preflight_script

    c, batch = CASES[name]
    started = time.monotonic()
    report = preflight_script(
        str(SCRIPTS / c.file),
        argv_for(c, batch, out),
        capacity_bytes=1 << 40,
        context_bytes=0,
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
        # the same question asked of the driver: does this process hold a CUDA context?
        "gpu_context": holds_gpu_context(),
    }


def truth(name: str, out: Path) -> dict[str, Any] | None:
    import torch

    if not torch.cuda.is_available():
        return None
    c, batch = CASES[name]
    run = subprocess.run(
        [sys.executable, "-c", TRUTH, str(SCRIPTS / c.file), *argv_for(c, batch, out)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ),
    )
    for line in run.stdout.splitlines():
        if line.startswith("TRUTH "):
            got: dict[str, Any] = json.loads(line[6:])
            return got
    return {"error": run.stderr[-2000:]}


def _in_folder(fn: Any, name: str) -> Any:
    with tempfile.TemporaryDirectory() as tmp:
        try:
            return fn(name, Path(tmp))
        except Exception as exc:  # report and go on: one broken case must not hide the rest
            return {"error": f"{type(exc).__name__}: {exc}"}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--only", nargs="+", choices=sorted(CASES), metavar="CASE")
    p.add_argument("--truth-only", action="store_true", help="only the real runs (the GPU part)")
    p.add_argument("--join", type=Path, help="truths from an earlier --truth-only run")
    p.add_argument("--jobs", type=int, default=1, help="real runs at once")
    args = p.parse_args(argv)
    names = args.only or list(CASES)
    rows: dict[str, dict[str, Any]] = {n: {"case": n} for n in names}
    if args.join:
        for row in json.loads(args.join.read_text())["rows"]:
            if row["case"] in rows:
                rows[row["case"]]["truth"] = row["truth"]
    else:
        with concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            for n, got in zip(names, pool.map(lambda n: _in_folder(truth, n), names), strict=True):
                rows[n]["truth"] = got
                print(json.dumps(rows[n]), file=sys.stderr, flush=True)
    if not args.truth_only:
        for n in names:
            rows[n]["predicted"] = pred = _in_folder(predict, n)
            real = rows[n].get("truth")
            if real and "error" not in real and "error" not in pred:
                rows[n]["rel_error_allocated"] = round(
                    pred["peak_allocated_bytes"] / real["peak_allocated_bytes"] - 1, 4
                )
            print(json.dumps(rows[n]), file=sys.stderr, flush=True)
    text = json.dumps({"steps": STEPS, "rows": list(rows.values())}, indent=1)
    if args.out:
        args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
