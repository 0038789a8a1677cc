"""How close does the allocator simulator come to a real GPU? (needs CUDA; a prepared check)

Runs the captured training loops (``capture.CAPTURES``) on a real GPU, reading
``torch.cuda.memory_stats()`` after every step (with the step's peaks reset before it) and
NVML ``used`` at 10 Hz from a thread; then replays the CPU capture of the same loop through
the simulator at scale 1 and compares the peaks of allocated and reserved bytes. A second
part drives a leaking loop into a real ``OutOfMemoryError`` under
``torch.cuda.set_per_process_memory_fraction`` and reports the step at which the real run
and the simulator each ran out. Prints one JSON object; the aim is peaks within 10%.

    python -m oomcast.bench.gpu_check [--out FILE]

Without CUDA, ``--simulate-only`` prints the simulator's side alone (what the tests run).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from pathlib import Path
from typing import Any

from oomcast.training.allocator import CachingAllocatorSim, SimOutOfMemory
from oomcast.training.capture import CAPTURES, MODELS, AllocationLog, capture

CHECKED = ("mlp", "cnn", "lstm_lm", "transformer", "varlen")


def simulated_peaks(log: AllocationLog, capacity: int = 1 << 40) -> dict[str, int]:
    """Replay a capture at scale 1: peak allocated and reserved over its train steps."""
    sim = CachingAllocatorSim(capacity)
    handles: dict[int, int] = {}
    for op in log.persistent:
        handles[op.sid] = sim.malloc(op.size)
    for step in log.steps:
        for op in step.ops:
            if op.alloc:
                handles[op.sid] = sim.malloc(op.size)
            elif op.sid in handles:
                sim.free(handles.pop(op.sid))
    s = sim.stats()
    return {"peak_allocated": s.peak_allocated_bytes, "peak_reserved": s.peak_reserved_bytes}


def simulated_oom_step(leak_bytes: int, step_log: AllocationLog, capacity: int) -> int | None:
    """Steady steps plus a leak per step under ``capacity``: the step that runs out."""
    sim = CachingAllocatorSim(capacity)
    handles: dict[int, int] = {}
    try:
        for op in step_log.persistent:
            handles[op.sid] = sim.malloc(op.size)
        steady = [s for s in step_log.steps if s.kind == "train"]
        for i in range(100_000):
            for op in steady[min(i, len(steady) - 1)].ops:
                if op.alloc:
                    handles[op.sid] = sim.malloc(op.size)
                elif op.sid in handles:
                    sim.free(handles.pop(op.sid))
            sim.malloc(leak_bytes)
    except SimOutOfMemory:
        return i
    return None


def _gpu_run(name: str, args: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - GPU only
    import pynvml
    import torch

    spec = MODELS[args["model"]]
    cfg = {**spec.defaults, **{k: v for k, v in args.items() if k in spec.defaults}}
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    net = spec.build(cfg).cuda()
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    torch.cuda.reset_peak_memory_stats()
    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(torch.cuda.current_device())
    nvml_used: list[int] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            nvml_used.append(int(pynvml.nvmlDeviceGetMemoryInfo(handle).used))
            time.sleep(0.1)

    thread = threading.Thread(target=poll, daemon=True)
    thread.start()
    steps = []
    for step in range(int(args.get("steps", 6))):
        x, y = spec.batch(cfg, g, step)
        x, y = x.cuda(), y.cuda()
        loss = spec.loss(net(x), y)
        loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        st = torch.cuda.memory_stats()
        steps.append(
            {
                k: st[k]
                for k in (
                    "allocated_bytes.all.peak",
                    "reserved_bytes.all.peak",
                    "num_alloc_retries",
                    "num_ooms",
                )
            }
        )
        torch.cuda.reset_peak_memory_stats()
    stop.set()
    thread.join()
    real = {
        "peak_allocated": max(s["allocated_bytes.all.peak"] for s in steps),
        "peak_reserved": max(s["reserved_bytes.all.peak"] for s in steps),
        "nvml_used_max": max(nvml_used) if nvml_used else None,
    }
    a = dict(args)
    sim = simulated_peaks(capture(a.pop("model"), **a))
    return {
        "capture": name,
        "real": real,
        "simulated": sim,
        "rel_err_allocated": round(sim["peak_allocated"] / real["peak_allocated"] - 1, 4),
        "rel_err_reserved": round(sim["peak_reserved"] / real["peak_reserved"] - 1, 4),
    }


def _gpu_oom(fraction: float, leak_mib: int) -> dict[str, Any]:  # pragma: no cover - GPU only
    import torch

    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(fraction)
    capacity = int(fraction * torch.cuda.get_device_properties(0).total_memory)
    spec = MODELS["mlp"]
    cfg = dict(spec.defaults)
    net = spec.build(cfg).cuda()
    opt = torch.optim.Adam(net.parameters())
    g = torch.Generator().manual_seed(0)
    kept = []
    oom_step = None
    for step in range(100_000):
        try:
            x, y = spec.batch(cfg, g, step)
            loss = spec.loss(net(x.cuda()), y.cuda())
            loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
            opt.step()
            opt.zero_grad(set_to_none=True)
            kept.append(torch.empty(leak_mib << 20, dtype=torch.uint8, device="cuda"))
        except torch.cuda.OutOfMemoryError:
            oom_step = step
            break
    stats = torch.cuda.memory_stats()
    sim_step = simulated_oom_step(leak_mib << 20, capture("mlp", steps=3), capacity)
    return {
        "fraction": fraction,
        "real_oom_step": oom_step,
        "simulated_oom_step": sim_step,
        "num_ooms": stats["num_ooms"],
        "num_alloc_retries": stats["num_alloc_retries"],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path)
    p.add_argument("--simulate-only", action="store_true")
    args = p.parse_args()
    result: dict[str, Any] = {"runs": []}
    for name in CHECKED:
        a = dict(CAPTURES[name])
        if args.simulate_only:
            model = a.pop("model")
            result["runs"].append(
                {"capture": name, "simulated": simulated_peaks(capture(model, **a))}
            )
        else:
            result["runs"].append(_gpu_run(name, a))
    if not args.simulate_only:
        result["oom"] = _gpu_oom(0.02, 64)
    text = json.dumps(result, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
