"""Preflight against real CUDA runs: a prepared script for when a GPU is lent.

For every job of the preflight zoo (``oomcast.bench.preflight.zoo``) at both batch sizes:

1. the preflight's prediction: the fake-tensor capture (``device="cuda"``) replayed through
   the caching-allocator simulator (``preflight.replay``) at unlimited capacity gives the
   peak allocated and reserved bytes, overall and per phase (train, eval, checkpoint), and
   the smallest capacity the simulator says the job fits in;
2. the truth: the same job run for real on the GPU, ``torch.cuda.max_memory_allocated`` and
   ``max_memory_reserved`` read per phase (peaks reset at the start of each stretch);
3. real OOMs: the job run again under ``torch.cuda.set_per_process_memory_fraction`` just
   below and just above the predicted reserved peak and the predicted minimal capacity
   (``LIMITS``), beside the simulator's verdict at the same capacity.

The process's CUDA bytes before each row (the cuBLAS workspace, kept by the caching
allocator once the first matmul ran) are recorded as ``baseline`` and added to every
limit, since the preflight's figures are the job's own tensors.

    python -m oomcast.bench.preflight.gpu --out tests/fixtures/preflight-gpu.json

It prints one line of progress per row on stderr. On an H200 it should take 1-3 minutes (an
estimate from the CPU timings: the fake captures dominate; not yet run on a GPU).
``--device cpu`` is a dry run of the same plumbing without a GPU: the predictions are made,
the jobs run for real on CPU, the CUDA figures and the limit runs are left out (None).
``compare(table)`` reduces a table to relative errors and verdict agreement; the test
``tests/training/test_gpu_preflight.py`` uses it on the committed fixture.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import statistics
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from oomcast.bench.preflight.accuracy import FIGURES, figure_of, min_capacity, reference_run
from oomcast.bench.preflight.zoo import ZooRow, build_zoo
from oomcast.preflight.capture import JobCapture, capture_job
from oomcast.preflight.job import PreflightJob
from oomcast.preflight.replay import replay

UNLIMITED = 1 << 40
# (what the limit is relative to, factor): a real run is made under each
LIMITS = (("reserved", 0.9), ("reserved", 1.1), ("min_capacity", 0.95), ("min_capacity", 1.05))
Figures = dict[str, int | None]


def predict(cap: JobCapture) -> dict[str, Any]:
    """The preflight's figures for one capture (replayed at unlimited capacity)."""
    rep = replay(cap, UNLIMITED)
    alloc: Figures = {"peak": rep.peak_allocated_bytes}
    reserved: Figures = {"peak": rep.peak_reserved_bytes}
    for p in rep.phases:
        fig = figure_of(p.phase)
        if fig in FIGURES:
            alloc[fig] = max(alloc.get(fig) or 0, p.peak_allocated_bytes)
            reserved[fig] = max(reserved.get(fig) or 0, p.peak_reserved_bytes)
    return {
        "allocated": {f: alloc.get(f) for f in FIGURES},
        "reserved": {f: reserved.get(f) for f in FIGURES},
        "min_capacity": min_capacity(cap),
    }


@dataclass
class _PhaseMeter:
    """Per-phase CUDA peaks; remembers where the run was when it ended (an OOM)."""

    cuda: bool
    allocated: dict[str, int] = field(default_factory=dict)
    reserved: dict[str, int] = field(default_factory=dict)
    phase: str = "other"
    stretches: int = 0

    @contextlib.contextmanager
    def enter(self, phase: str) -> Iterator[None]:
        self.phase, self.stretches = figure_of(phase), self.stretches + 1
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        yield
        if self.cuda and phase != "host":
            torch.cuda.synchronize()
            fig = self.phase
            self.allocated[fig] = max(self.allocated.get(fig, 0), torch.cuda.max_memory_allocated())
            self.reserved[fig] = max(self.reserved.get(fig, 0), torch.cuda.max_memory_reserved())

    def figures(self, which: dict[str, int]) -> Figures:
        if not self.cuda:
            return dict.fromkeys(FIGURES)
        out: Figures = {f: which.get(f) for f in FIGURES}
        out["peak"] = max(which.values(), default=0)
        return out


def _clean(cuda: bool) -> None:
    gc.collect()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _real(job: PreflightJob, batch_size: int, device: str) -> dict[str, Any]:
    cuda = device == "cuda"
    meter = _PhaseMeter(cuda)
    reference_run(job, batch_size, meter.enter, device=device)
    _clean(cuda)
    return {
        "allocated": meter.figures(meter.allocated),
        "reserved": meter.figures(meter.reserved),
        "stretches": meter.stretches,
    }


def _limited(job: PreflightJob, batch_size: int, limit_bytes: int) -> dict[str, Any]:
    """Run the job on CUDA under a memory fraction: did it run out, and where?"""
    total = torch.cuda.get_device_properties(0).total_memory
    meter = _PhaseMeter(True)
    torch.cuda.set_per_process_memory_fraction(min(1.0, limit_bytes / total))
    oom: dict[str, Any] | None = None
    try:
        reference_run(job, batch_size, meter.enter, device="cuda")
    except torch.cuda.OutOfMemoryError as exc:
        oom = {"phase": meter.phase, "message": str(exc).splitlines()[0][:200]}
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        _clean(True)
    return {"fits": oom is None, "oom": oom}


def _baseline(cuda: bool) -> dict[str, int]:
    if not cuda:
        return {"allocated": 0, "reserved": 0}
    _clean(True)
    return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}


def _warm_up(cuda: bool) -> None:
    """First matmul and convolution: the cuBLAS workspace and cuDNN handles appear here, once."""
    if cuda:
        x = torch.randn(64, 64, device="cuda", requires_grad=True)
        (x @ x).sum().backward()  # type: ignore[no-untyped-call]  # torch: unannotated
        torch.nn.functional.conv2d(
            torch.randn(1, 3, 8, 8, device="cuda"), torch.randn(4, 3, 3, 3, device="cuda")
        )
        del x
        _clean(True)


def measure_row(row: ZooRow, batch_size: int, device: str) -> dict[str, Any]:
    """One zoo job at one batch size: prediction, real figures, limited runs."""
    cuda = device == "cuda"
    cap = capture_job(row.job, fake=True, device="cuda", batch_size=batch_size)
    pred = predict(cap)
    base = _baseline(cuda)
    out: dict[str, Any] = {
        "job": row.name,
        "family": row.family,
        "batch_size": batch_size,
        "capture_device": cap.device,
        "preflight": pred,
        "baseline": base,
        "real": _real(row.job, batch_size, device),
        "limits": [],
    }
    for basis, factor in LIMITS:
        ref = pred["reserved"]["peak"] if basis == "reserved" else pred["min_capacity"]
        job_bytes = int(factor * ref)
        sim = replay(cap, job_bytes)
        entry: dict[str, Any] = {
            "basis": basis,
            "factor": factor,
            "job_bytes": job_bytes,
            "limit_bytes": job_bytes + base["reserved"],
            "preflight_fits": sim.fits,
            "preflight_oom_phase": None if sim.oom is None else figure_of(sim.oom.phase),
            "real": _limited(row.job, batch_size, job_bytes + base["reserved"]) if cuda else None,
        }
        out["limits"].append(entry)
    return out


def run(jobs: list[str] | None, device: str) -> dict[str, Any]:
    """The whole table (every zoo row, or those named), printing progress on stderr."""
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --device cpu for a dry run")
    zoo = build_zoo()
    if jobs:
        unknown = set(jobs) - {r.name for r in zoo}
        if unknown:
            raise SystemExit(f"unknown zoo jobs: {', '.join(sorted(unknown))}")
        zoo = [r for r in zoo if r.name in jobs]
    torch.manual_seed(0)
    _warm_up(device == "cuda")
    rows = []
    t0 = time.monotonic()
    for row in zoo:
        for bs in row.batch_sizes:
            t = time.monotonic()
            rows.append(measure_row(row, bs, device))
            print(
                f"[{time.monotonic() - t0:6.1f}s] {row.name} bs={bs}: {time.monotonic() - t:.1f}s",
                file=sys.stderr,
                flush=True,
            )
    meta: dict[str, Any] = {
        "device": device,
        "torch": torch.__version__,
        "dry_run": device != "cuda",
    }
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=props.name, total_bytes=props.total_memory)
    return {"meta": meta, "rows": rows}


def _rel(guess: int | None, truth: int | None) -> float | None:
    return None if not truth or guess is None else (guess - truth) / truth


def compare(
    table: dict[str, Any], preflight: dict[str, dict[str, Any]] | None = None
) -> dict[str, Any]:
    """Median and max |relative error| of peak allocated and reserved per figure, and how
    many limit runs the simulator's verdict got right. ``preflight`` (``"job/bs"`` ->
    :func:`predict` output) replaces the table's own predictions, to check today's code
    against recorded real runs."""
    errs: dict[str, dict[str, list[float]]] = {"allocated": {}, "reserved": {}}
    agree = total = 0
    for row in table["rows"]:
        pred = (preflight or {}).get(f"{row['job']}/{row['batch_size']}", row["preflight"])
        for kind in errs:
            base = row["baseline"]["allocated" if kind == "allocated" else "reserved"]
            for fig in FIGURES:
                truth = row["real"][kind][fig]
                e = _rel(pred[kind][fig], None if truth is None else truth - base)
                if e is not None:
                    errs[kind].setdefault(fig, []).append(e)
        for lim in row["limits"]:
            if lim["real"] is not None:
                total += 1
                agree += lim["real"]["fits"] == lim["preflight_fits"]
    out: dict[str, Any] = {
        kind: {
            fig: {"n": len(v), "median_abs": statistics.median(abs(x) for x in v),
                  "max_abs": max(abs(x) for x in v)}
            for fig, v in per.items()
        }
        for kind, per in errs.items()
    }  # fmt: skip
    out["verdicts"] = {"n": total, "agree": agree}
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description="Preflight against real CUDA runs (needs a GPU)")
    p.add_argument("--out", type=Path, help="write the JSON table here")
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"),
                   help="cpu: a dry run of the plumbing, without the CUDA figures")  # fmt: skip
    p.add_argument("--jobs", help="comma-separated zoo job names (default: all)")
    args = p.parse_args(argv)
    table = run(args.jobs.split(",") if args.jobs else None, args.device)
    table["summary"] = compare(table)
    text = json.dumps(table, indent=1)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text + "\n")
    print(json.dumps(table["summary"], indent=1))


if __name__ == "__main__":
    main()
