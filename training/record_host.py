"""Record real host-memory traces: the workloads of ``training.workloads`` run one by one
under ``training.cgroup_recorder``, each in its own memory cgroup with a hard limit.

For every planned run ``(scenario, seed, limit, knobs)`` the folder gets
``NNN-scenario.jsonl.gz`` and an entry in ``manifest.json``: the scenario and its knobs, the
limit, whether the kernel OOM-killed it and when, its duration, sample count and peak. The
manifest is rewritten after every run, so an interrupted recording keeps what it has and
``--resume`` carries on from there.

The plan below was sized on a 2-core, 24 GB VM (cgroup v1, no swap, torch 2.13 CPU) by
first running each scenario under a roomy 2 GiB limit and reading its peak: OOM scenarios
get limits they outgrow at different points of their run, near misses limits a little above
their peak (about 1.1-1.3x). Whether a run *did* OOM is what the kernel
decided and what the manifest says; ``expect`` only records the intent.

    python -m oomcast.training.record_host --out training/traces/host
    python -m oomcast.training.record_host --out training/traces/host --check
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomcast.collectors.cgroupfs import CgroupUnavailable, parse_size
from oomcast.model.schema import Event, Sample
from oomcast.model.trace import TraceError, load_trace
from oomcast.training.cgroup_recorder import record

MANIFEST = "manifest.json"
DEFAULT_INTERVAL_S = 0.25
DEFAULT_TIMEOUT_S = 130.0
NEAR_LIMIT_FRAC = 0.85  # the last sample of an OOM trace should be at least this full


@dataclass(frozen=True)
class RunSpec:
    scenario: str
    seed: int
    limit: str
    expect: str  # "oom" or "ok": what the plan aims for
    knobs: dict[str, Any] = field(default_factory=dict)

    def argv(self) -> list[str]:
        args = [self.scenario, "--seed", str(self.seed)]
        for key, value in self.knobs.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        return args


def _oom(scenario: str, seed: int, limit: str, **knobs: Any) -> RunSpec:
    return RunSpec(scenario, seed, limit, "oom", knobs)


def _ok(scenario: str, seed: int, limit: str, **knobs: Any) -> RunSpec:
    return RunSpec(scenario, seed, limit, "ok", knobs)


PLAN: tuple[RunSpec, ...] = (
    # --- runs that outgrow their limit (the kernel should kill them) ---
    _oom("leak", 0, "700M"),
    _oom("leak", 1, "900M", batch=6, steps=450),
    _oom("leak", 2, "800M", vocab=3000),
    _oom("growing_seq", 0, "800M"),
    _oom("growing_seq", 1, "900M", seq_step=48, every=6, steps=130),
    _oom("growing_seq", 2, "650M", scale=0.75, every=20, steps=200),
    _oom("growing_batch", 0, "900M"),
    _oom("growing_batch", 1, "1100M", every=10, steps=200),
    _oom("eval_no_grad", 0, "1000M"),
    _oom("eval_no_grad", 1, "1300M"),
    _oom("eval_no_grad", 2, "800M", holdout_every=10),
    _oom("optimizer_state", 0, "1100M"),
    _oom("optimizer_state", 1, "1300M", every=12),
    _oom("checkpoint_spike", 0, "700M"),
    _oom("checkpoint_spike", 1, "750M", keep=4, every=30),
    _oom("fragment_shapes", 0, "1100M"),
    _oom("fragment_shapes", 1, "1000M", median=128),
    _oom("fragment_shapes", 2, "1200M", cap1=800),
    # --- near misses: limits a little above what the run will need ---
    _ok("steady", 0, "720M"),
    _ok("steady", 1, "580M", batch=128, steps=80),
    _ok("plateau", 0, "760M"),
    _ok("plateau", 1, "680M", cache_batches=150),
    _ok("spikes", 0, "800M"),
    _ok("spikes", 1, "950M", big_batch=640),
    _ok("leak", 3, "620M", epoch_steps=110),
    _ok("checkpoint_spike", 2, "950M"),
    _ok("growing_seq", 3, "800M", steps=70),
    _ok("optimizer_state", 2, "1000M", layers=8, steps=150),
    _ok("eval_no_grad", 3, "1300M", steps=130),
    _ok("growing_batch", 2, "780M", every=10, steps=90),
)


def _write_json_atomic(path: Path, obj: Any) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1) + "\n", encoding="utf-8")
    os.replace(tmp, path)


def _torch_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("torch")
    except Exception:
        return None


def record_host(
    out: Path | str,
    plan: Sequence[RunSpec] = PLAN,
    *,
    interval_s: float = DEFAULT_INTERVAL_S,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    resume: bool = False,
    only: Sequence[str] | None = None,
    root: Path | str | None = None,
    log_dir: Path | str | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Record every run of ``plan`` into ``out``; returns the manifest. With ``only``, runs
    of other scenarios are not recorded, but keep their numbers and manifest entries."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="oomcast-record-"))
    logs.mkdir(parents=True, exist_ok=True)
    manifest_path = out / MANIFEST
    done: dict[str, dict[str, Any]] = {}
    if (resume or only) and manifest_path.exists():
        for entry in json.loads(manifest_path.read_text())["runs"]:
            if (out / entry["file"]).exists():
                done[entry["file"]] = entry
    manifest: dict[str, Any] = {
        "generator": "python -m oomcast.training.record_host",
        "node": socket.gethostname(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "torch": _torch_version(),
        "interval_s": interval_s,
        "timeout_s": timeout_s,
        "runs": [],
    }
    for i, spec in enumerate(plan, start=1):
        fname = f"{i:03d}-{spec.scenario}.jsonl.gz"
        skip = only is not None and spec.scenario not in only
        if fname in done and (resume or skip):
            manifest["runs"].append(done[fname])
            continue
        if skip:
            continue
        cmd = [sys.executable, "-m", "oomcast.training.workloads", *spec.argv()]
        log(f"[{i}/{len(plan)}] {spec.scenario} seed={spec.seed} limit={spec.limit} {spec.knobs}")
        with open(logs / f"{i:03d}-{spec.scenario}.log", "w") as child_log:
            result = record(
                cmd,
                limit_bytes=spec.limit,
                out=out / fname,
                job=f"{spec.scenario}-s{spec.seed}",
                root=root,
                name=f"oomcast-rec-{os.getpid()}-{i:03d}",
                interval_s=interval_s,
                timeout_s=timeout_s,
                stdout=child_log,
                stderr=child_log,
            )
        limit = parse_size(spec.limit)
        samples = [r for r in result["records"] if isinstance(r, Sample)]
        entry = {
            "file": fname,
            "scenario": spec.scenario,
            "seed": spec.seed,
            "params": dict(spec.knobs),
            "limit": spec.limit,
            "limit_bytes": limit,
            "expect": spec.expect,
            "oom": result["oom"],
            "oom_ts": result["oom_ts"],
            "start_ts": result["started_ts"],
            "duration_s": result["duration_s"],
            "samples": result["samples"],
            "exit_code": result["exit_code"],
            "timed_out": result["timed_out"],
            "peak_bytes": result["peak_bytes"],
            "peak_frac": round(result["peak_bytes"] / limit, 4),
            "last_used_frac": round(samples[-1].used_bytes / limit, 4) if samples else None,
        }
        manifest["runs"].append(entry)
        _write_json_atomic(manifest_path, manifest)
        log(
            f"    oom={entry['oom']} exit={entry['exit_code']} {entry['duration_s']:.0f}s"
            f" peak={entry['peak_frac']:.2f} of limit, {entry['samples']} samples"
        )
    _write_json_atomic(manifest_path, manifest)
    return manifest


def check_folder(folder: Path | str, near_frac: float = NEAR_LIMIT_FRAC) -> list[str]:
    """Problems with a recorded folder (empty list: all good): every trace loads, agrees
    with the manifest, and every OOM trace ends near its limit with the event after the last
    sample."""
    folder = Path(folder)
    problems: list[str] = []
    manifest = json.loads((folder / MANIFEST).read_text())
    for entry in manifest["runs"]:
        path = folder / entry["file"]
        try:
            trace = load_trace(path)
        except (OSError, TraceError) as exc:
            problems.append(f"{entry['file']}: does not load: {exc}")
            continue
        if trace.ooms != entry["oom"]:
            problems.append(f"{entry['file']}: manifest says oom={entry['oom']}, trace disagrees")
        if len(trace.samples) != 1:
            problems.append(f"{entry['file']}: {len(trace.samples)} domains, expected 1")
            continue
        [(domain, samples)] = trace.samples.items()
        if len(samples) != entry["samples"]:
            problems.append(f"{entry['file']}: {len(samples)} samples, manifest {entry['samples']}")
        if not trace.ooms:
            continue
        oom_ts = trace.oom_ts(domain)
        last = samples[-1]
        events = [e for e in trace.events if isinstance(e, Event) and e.event == "oom"]
        if oom_ts is None or oom_ts <= last.ts or len(events) != 1:
            problems.append(f"{entry['file']}: the oom event is not one event after the samples")
        full = max(last.used_bytes, last.peak_bytes or 0) / last.total_bytes
        if full < near_frac:
            problems.append(
                f"{entry['file']}: last sample only {full:.2f} of the limit before the OOM"
            )
    return problems


def summarize(folder: Path | str) -> str:
    folder = Path(folder)
    runs = json.loads((folder / MANIFEST).read_text())["runs"]
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    ooms = sum(1 for r in runs if r["oom"])
    lines = [
        f"{len(runs)} traces: {ooms} OOM-killed, {len(runs) - ooms} not;"
        f" {size / 1024:.0f} KiB on disk"
    ]
    for r in runs:
        lines.append(
            f"  {r['file']:<28} limit {r['limit']:>5} {'OOM' if r['oom'] else 'ok ':<3}"
            f" {r['duration_s']:5.0f}s peak {r['peak_frac']:.2f} samples {r['samples']}"
        )
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m oomcast.training.record_host",
        description="Record real host-memory OOM traces of PyTorch workloads in cgroups.",
    )
    parser.add_argument("--out", required=True, help="folder for the traces and manifest")
    parser.add_argument("--interval", type=float, default=DEFAULT_INTERVAL_S)
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S)
    parser.add_argument("--resume", action="store_true", help="keep runs already recorded")
    parser.add_argument("--only", nargs="*", default=None, help="scenarios to record")
    parser.add_argument("--root", default=None, help="parent cgroup directory")
    parser.add_argument("--log-dir", default=None, help="where the workloads' output goes")
    parser.add_argument("--check", action="store_true", help="check a recorded folder only")
    args = parser.parse_args(argv)
    if args.check:
        problems = check_folder(args.out)
        print(summarize(args.out))
        for p in problems:
            print(f"PROBLEM {p}")
        return 1 if problems else 0

    def on_term(signum: int, _frame: Any) -> None:
        raise SystemExit(128 + signum)  # unwinds through record()'s cleanup of the cgroup

    signal.signal(signal.SIGTERM, on_term)
    try:
        record_host(
            args.out,
            PLAN,
            only=args.only,
            interval_s=args.interval,
            timeout_s=args.timeout,
            resume=args.resume,
            root=args.root,
            log_dir=args.log_dir,
            log=lambda m: print(m, flush=True),
        )
    except CgroupUnavailable as exc:
        print(f"record_host: {exc}", file=sys.stderr)
        return 2
    print(summarize(args.out))
    problems = check_folder(args.out)
    for p in problems:
        print(f"PROBLEM {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
