"""A real CUDA leak watched the way a GPU node is watched: a prepared check for a machine with
a GPU (CPU machines run it with ``--dry-run``, which tests the plumbing only).

1. Redis: a ``redis-server`` of its own on a free port (``--redis-server`` names the binary).
2. The node agent on real NVML: ``oomcast collect --source nvml``, the whole GPU as ``gpu0``.
3. The leaky trainer (``bench/trainers/leaky.py``) on the GPU with the in-process hook,
   capped by ``torch.cuda.set_per_process_memory_fraction`` so that its leak meets a real
   ``OutOfMemoryError`` within a minute or two instead of filling the whole card.
4. ``oomcast dump`` reads the node back into a trace; ``oomcast evaluate --per-trace`` scores
   it with the shipped model and the baselines.

It prints one JSON object: the trainer's exit and last lines, the OOM events in Redis, the
hook's view (its capacity against the cap, its last use), NVML's view of the same GPU, and
each detector's verdict per domain (first alert, lead). Everything it wrote is in ``--out``.

    python -m oomcast.bench.gpu_leak --out /tmp/gpu-leak
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from oomcast.bench.procs import oomcast_argv as _oomcast

NODE = "gpu-leak-node"
JOB = "gpu-leak"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_redis(binary: str, port: int, folder: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        cwd=folder,
        stdout=(folder / "redis.log").open("wb"),
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if proc.poll() is not None:
            raise RuntimeError(f"redis-server exited: {(folder / 'redis.log').read_text()[-500:]}")
        time.sleep(0.05)
    proc.kill()
    raise RuntimeError("redis-server did not listen within 10 s")


def _summary(trace_path: Path) -> dict[str, Any]:
    from oomcast.model.trace import load_trace

    trace = load_trace(trace_path)
    out: dict[str, Any] = {}
    for domain, samples in trace.samples.items():
        oom = trace.oom_ts(domain)
        t0 = samples[0].ts
        last = samples[-1]
        out["/".join(domain)] = {
            "samples": len(samples),
            "seconds": round(last.ts - t0, 1),
            "oom_after_s": None if oom is None else round(oom - t0, 1),
            "total_bytes": last.total_bytes,
            "max_used_bytes": max(s.used_bytes for s in samples),
            "max_reserved_bytes": max((s.reserved_bytes or 0) for s in samples),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--redis-server", default=shutil.which("redis-server") or "redis-server")
    p.add_argument("--fraction", type=float, default=0.04, help="the trainer's cap on the GPU")
    p.add_argument("--width", type=int, default=2048, help="the leak is batch x width floats")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--leak-after", type=int, default=300, help="steady steps before the leak")
    p.add_argument("--timeout", type=float, default=240.0, help="seconds the trainer may run")
    p.add_argument("--dry-run", action="store_true", help="CPU, 150 steps, no NVML: plumbing")
    args = p.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)

    def stop(signum: int, frame: Any) -> None:  # `timeout` sends TERM: clean up as on error
        raise SystemExit(f"stopped by signal {signum}")

    signal.signal(signal.SIGTERM, stop)
    result: dict[str, Any] = {}
    port = _free_port()
    url = f"redis://127.0.0.1:{port}/0"
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": url,
        "OOMCAST_NODE": NODE,
        "OOMCAST_JOB": JOB,
        "PYTHONUNBUFFERED": "1",
    }
    with tempfile.TemporaryDirectory() as tmp:
        redis_proc = _start_redis(args.redis_server, port, Path(tmp))
        agent = None
        try:
            if not args.dry_run:
                agent = subprocess.Popen(
                    _oomcast("collect", "--source", "nvml", "--nvml-interval", "0.5"),
                    env=env,
                    stdout=(args.out / "agent.log").open("wb"),
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            trainer = [sys.executable, "-m", "oomcast.bench.trainers.leaky", "--job", JOB]
            trainer += ["--width", str(args.width), "--batch", str(args.batch)]
            trainer += ["--step-s", str(args.step_s), "--leak-after", str(args.leak_after)]
            if args.dry_run:
                trainer += ["--steps", "150", "--width", "256"]
            else:
                trainer += ["--device", "cuda", "--memory-fraction", str(args.fraction)]
            started = time.monotonic()
            run = subprocess.run(
                trainer, env=env, capture_output=True, text=True, timeout=args.timeout
            )
            (args.out / "trainer.log").write_text(run.stdout + run.stderr)
            result["trainer"] = {
                "returncode": run.returncode,
                "seconds": round(time.monotonic() - started, 1),
                "cuda_oom": "OutOfMemoryError" in run.stderr,
                "tail": (run.stdout + run.stderr).strip().splitlines()[-3:],
            }
            time.sleep(2.0)  # the agent's next NVML sample after the trainer left
        finally:
            if agent is not None:
                os.killpg(agent.pid, signal.SIGTERM)
                try:
                    agent.wait(15)
                except subprocess.TimeoutExpired:
                    os.killpg(agent.pid, signal.SIGKILL)
        try:
            trace_path = args.out / "gpu-leak.jsonl.gz"
            dump = subprocess.run(
                _oomcast("dump", "--node", NODE, "--out", str(trace_path)),
                env=env,
                capture_output=True,
                text=True,
                timeout=60,
            )
            result["dump"] = (dump.stdout + dump.stderr).strip().splitlines()[-3:]
            if dump.returncode == 0:
                result["domains"] = _summary(trace_path)
                per_trace = args.out / "per-trace.jsonl"
                ev = subprocess.run(
                    _oomcast(
                        "evaluate",
                        "--traces",
                        str(trace_path),
                        "--json",
                        "--no-progress",
                        "--per-trace",
                        str(per_trace),
                        "--min-lead",
                        "10",
                    ),
                    env=env,
                    capture_output=True,
                    text=True,
                    timeout=150,
                )
                (args.out / "evaluate.json").write_text(ev.stdout + ev.stderr)
                if ev.returncode == 0 and per_trace.exists():
                    result["per_trace"] = [
                        json.loads(line) for line in per_trace.read_text().splitlines() if line
                    ]
                else:
                    result["evaluate_error"] = ev.stderr[-1500:]
        finally:
            redis_proc.terminate()
            redis_proc.wait(10)
    text = json.dumps(result, indent=1)
    (args.out / "summary.json").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
