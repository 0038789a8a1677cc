"""Record the real-run corpus: the programs of ``training/programs.py`` under real cgroup
limits, sampled at 10 Hz, with real kernel OOM kills (``training/traces/corpus``).

The plan is a list of *configs* (program, cause, knobs, pace). Each config is recorded as a
short series of runs, one after the other:

1. under a roomy limit (4 GiB): a healthy job far from its limit, and the measurement of
   the program's natural peak of anonymous memory (what the kernel cannot reclaim);
2. under limits set from that peak: a little above it (a *near miss*: the run comes close
   to its limit and survives), or below it, where the cause pushes the run over (an OOM;
   for a sudden cause, between the level before the cause starts and the peak it makes).

Whether a run OOMed is what the kernel decided, and what the manifest records. Configs run
in parallel worker processes (``--workers``), each in its own cgroup. The manifest names
every run's program, cause, knobs, limit, outcome and split; the split is by program, so a
held-out program was never seen in training in any form.

    python -m oomcast.training.record_corpus --out training/traces/corpus --workers 6
    python -m oomcast.training.record_corpus --out training/traces/corpus --check
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import socket
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from oomcast.collectors.cgroupfs import CgroupUnavailable
from oomcast.model.schema import Sample
from oomcast.model.trace import load_trace
from oomcast.training.cgroup_recorder import record
from oomcast.training.programs import GROWTH_CAUSES

MIB = 1 << 20
MANIFEST = "manifest.json"
INTERVAL_S = 0.1
ROOMY_LIMIT = 4 << 30
# The split is by program: these never appear in training or model selection.
SPLITS: dict[str, tuple[str, ...]] = {
    "train": ("mlp_tabular", "cnn_classifier", "transformer_lm", "autoencoder", "recsys",
              "embed_indexer"),
    "val": ("dataloader_train", "lstm_lm"),
    "test": ("hf_bert", "inference_server", "gan"),
}  # fmt: skip
# Per program: base knobs, the shortest step period it can keep on a shared core, the
# causes it supports and the size of each cause (``amount`` ranges, ``every`` choices).
PROGRAM_KNOBS: dict[str, dict[str, Any]] = {
    "mlp_tabular": {"batch": 256, "width": 1024, "period": 0.15},
    "cnn_classifier": {"batch": 16, "width": 512, "period": 0.2},
    "transformer_lm": {"batch": 8, "seq": 64, "width": 512, "period": 0.2},
    "lstm_lm": {"batch": 8, "seq": 64, "width": 512, "period": 0.2},
    "autoencoder": {"batch": 16, "width": 512, "period": 0.15},
    "recsys": {"batch": 256, "width": 256, "period": 0.4},
    "gan": {"batch": 32, "width": 512, "period": 0.2},
    "dataloader_train": {"batch": 16, "width": 512, "period": 0.25},
    "inference_server": {"batch": 16, "seq": 64, "width": 512, "period": 0.15},
    "embed_indexer": {"batch": 16, "seq": 64, "width": 512, "period": 0.15},
    "hf_bert": {"batch": 8, "seq": 64, "width": 512, "period": 0.12},
}
CAUSE_AMOUNT: dict[str, tuple[float, float]] = {
    "leak": (1, 1),
    "cache": (8, 40),  # x100 distinct ids of 256 KiB
    "growth": (2, 6),  # final batch (or length) factor - 1
    "step_up": (1, 2.5),
    "eval_spike": (4, 10),  # hold-out batches at the start
    "checkpoint": (2, 5),  # snapshots kept
    "churn": (3, 10),  # MiB: the final cap of a sample
    "neighbour": (1, 2),  # the neighbour's batch, relative to ours
    "none": (1, 1),
}
UNSUPPORTED: dict[str, tuple[str, ...]] = {
    "recsys": ("leak",),
    "hf_bert": ("cache", "eval_spike", "churn", "neighbour"),
    "inference_server": ("checkpoint",),
    "embed_indexer": ("checkpoint",),
}
CAUSE_ORDER = ("none", "leak", "cache", "growth", "step_up", "eval_spike", "checkpoint",
               "churn", "neighbour")  # fmt: skip


@dataclass
class Config:
    index: int
    program: str
    cause: str
    knobs: dict[str, Any]
    follow_ups: list[str]  # "oom" / "near", in order, after the roomy run
    seed: int = 0
    runs: list[dict[str, Any]] = field(default_factory=list)

    def argv(self, seed: int) -> list[str]:
        args = [self.program, "--cause", self.cause, "--seed", str(seed)]
        for key, value in self.knobs.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        return args

    @property
    def split(self) -> str:
        return next(s for s, progs in SPLITS.items() if self.program in progs)


def make_plan(seed: int = 0) -> list[Config]:
    """About 105 configs of 11 programs; about 300 runs in all."""
    rng = random.Random(seed)
    configs: list[Config] = []
    for program, base in PROGRAM_KNOBS.items():
        causes = [c for c in CAUSE_ORDER if c not in UNSUPPORTED.get(program, ())]
        for cause in causes:
            configs.append(_config(len(configs), program, cause, base, rng))
    # a few long runs (5 to 15 minutes): the hours of calm that real jobs mostly are
    for k, program in enumerate(("cnn_classifier", "gan", "lstm_lm", "hf_bert")):
        cfg = _config(len(configs), program, ("none", "none", "none", "growth")[k],
                      PROGRAM_KNOBS[program], rng, long=True)  # fmt: skip
        configs.append(cfg)
    # More OOMs of the held-out programs' growth causes, each coming a minute or more into
    # its run, so the test set can say how often a growth OOM is warned 30 s ahead.
    for program in SPLITS["test"]:
        for cause in GROWTH_CAUSES:
            if cause in UNSUPPORTED.get(program, ()):
                continue
            cfg = _config(len(configs), program, cause, PROGRAM_KNOBS[program], rng)
            cfg.knobs["steps"] = round(cfg.knobs["steps"] * 120 / cfg.knobs["duration_s"])
            cfg.knobs["duration_s"] = 120.0
            cfg.follow_ups = ["oom", "oom"]
            configs.append(cfg)
    configs.sort(key=lambda c: -c.knobs["duration_s"])  # the longest first: they pace the end
    return configs


def _config(
    index: int, program: str, cause: str, base: dict[str, Any], rng: random.Random,
    long: bool = False,
) -> Config:  # fmt: skip
    duration = rng.choice((300, 600, 900)) if long else rng.choice((20, 30, 45, 60, 90))
    period = base["period"] * rng.uniform(1.0, 1.6)
    steps = max(60, round(duration / period))
    lo, hi = CAUSE_AMOUNT[cause]
    knobs: dict[str, Any] = {
        "steps": steps,
        "duration_s": round(steps * period, 1),
        "batch": base["batch"],
        "width": base["width"],
    }
    if "seq" in base:
        knobs["seq"] = base["seq"]
    if cause != "none":
        knobs["amount"] = round(rng.uniform(lo, hi), 2)
        sudden = cause not in GROWTH_CAUSES
        knobs["onset"] = round(steps * rng.uniform(0.3, 0.7) if sudden else steps * 0.1)
        knobs["every"] = {
            "leak": rng.choice((1, 2, 3)),
            "eval_spike": rng.choice((30, 50, 80)),
            "checkpoint": rng.choice((20, 40)),
        }.get(cause, 5)
    if cause == "checkpoint" and program == "mlp_tabular":
        knobs["width"] = 2048
    if cause == "neighbour":
        knobs["neighbour"] = rng.choice(("mlp_tabular", "cnn_classifier", "autoencoder"))
    knobs["eval_every"] = rng.choice((25, 50, 100))
    knobs["ckpt_every"] = rng.choice((50, 100, 200))
    if cause == "none":
        follow = ["near", "near"] if rng.random() < 0.3 else ["near"]
    else:
        follow = ["oom", "near"] if rng.random() < 0.6 else ["near", "oom"]
    if long:
        follow = ["near"]
    return Config(index, program, cause, knobs, follow, seed=rng.randrange(10**6))


# --- limits from the roomy run -------------------------------------------------------------
def _anon(samples: list[Sample]) -> list[tuple[float, int]]:
    return [(s.ts, s.allocated_bytes or s.used_bytes) for s in samples]


def follow_up_limit(cfg: Config, roomy: list[Sample], kind: str, rng: random.Random) -> int | None:
    """The limit for a follow-up run, from the roomy run's anonymous memory; None when the
    cause made no difference that a limit could sit between (no OOM run is possible)."""
    points = _anon(roomy)
    if not points:
        return None
    peak = max(b for _, b in points) + 24 * MIB  # kernel memory beside the anon pages
    if kind == "near":
        return int(peak * rng.uniform(1.03, 1.18))
    t0, t1 = points[0][0], points[-1][0]
    if cfg.cause in GROWTH_CAUSES:
        warm = [b for t, b in points if t - t0 <= 0.15 * (t1 - t0) + 5.0]
        floor = max(warm) * 1.15
    elif cfg.cause == "none":
        return None
    else:
        onset_s = cfg.knobs["onset"] * cfg.knobs["duration_s"] / cfg.knobs["steps"]
        before = [b for t, b in points if t - t0 < onset_s]
        floor = (max(before) if before else peak * 0.5) * 1.08
    if peak - floor < 0.08 * peak:
        return None
    return int(floor + (peak - floor) * rng.uniform(0.35, 0.85))


# --- recording -------------------------------------------------------------------------
def record_config(cfg: Config, out: Path, logs: Path) -> list[dict[str, Any]]:
    """Every run of one config, roomy first; returns their manifest entries."""
    rng = random.Random(cfg.seed)
    entries = []
    roomy: list[Sample] | None = None
    for k, kind in enumerate(["roomy", *cfg.follow_ups]):
        if kind == "roomy":
            limit: int | None = ROOMY_LIMIT
        else:
            assert roomy is not None
            limit = follow_up_limit(cfg, roomy, kind, rng)
            if limit is None and kind == "oom":
                kind, limit = "near", follow_up_limit(cfg, roomy, "near", rng)
        assert limit is not None
        name = f"{cfg.index:03d}{'abcd'[k]}-{cfg.program}-{cfg.cause}"
        seed = cfg.seed + k
        cmd = [sys.executable, "-m", "oomcast.training.programs", *cfg.argv(seed)]
        with open(logs / f"{name}.log", "w") as child_log:
            result = record(
                cmd,
                limit_bytes=limit,
                out=out / f"{name}.jsonl.gz",
                job=f"{cfg.program}-{cfg.cause}-{seed}",
                name=f"oomcast-corpus-{os.getpid()}-{name}",
                interval_s=INTERVAL_S,
                timeout_s=cfg.knobs["duration_s"] * 2.5 + 60,
                stdout=child_log,
                stderr=child_log,
            )
        samples = [r for r in result["records"] if isinstance(r, Sample)]
        if kind == "roomy":
            roomy = samples
        anon_peak = max((b for _, b in _anon(samples)), default=0)
        entries.append({
            "file": f"{name}.jsonl.gz", "config": cfg.index, "program": cfg.program,
            "cause": cfg.cause, "split": cfg.split, "role": kind, "seed": seed,
            "knobs": cfg.knobs, "limit_bytes": limit, "oom": result["oom"],
            "oom_ts": result["oom_ts"], "start_ts": result["started_ts"],
            "duration_s": result["duration_s"], "samples": result["samples"],
            "exit_code": result["exit_code"], "timed_out": result["timed_out"],
            "anon_peak_frac": round(anon_peak / limit, 4),
        })  # fmt: skip
        print(
            f"{name}: {kind} limit {limit / MIB:.0f}MiB oom={result['oom']}"
            f" {result['duration_s']:.0f}s anon peak {anon_peak / limit:.2f}",
            flush=True,
        )
    return entries


def _worker(job: tuple[Config, str, str]) -> list[dict[str, Any]]:
    cfg, out, logs = job
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent stops us; record() cleans up
    try:
        return record_config(cfg, Path(out), Path(logs))
    except Exception as exc:  # one broken config must not end the recording
        print(f"config {cfg.index} ({cfg.program}/{cfg.cause}) failed: {exc!r}", flush=True)
        return []


def record_corpus(
    out: Path | str, *, workers: int = 6, seed: int = 0, only: Sequence[int] | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, Any]:  # fmt: skip
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    logs = Path(tempfile.mkdtemp(prefix="oomcast-corpus-logs-"))
    plan = make_plan(seed)
    path = out / MANIFEST
    manifest: dict[str, Any] = json.loads(path.read_text()) if path.exists() else {"runs": []}
    done = {e["config"] for e in manifest["runs"] if (out / e["file"]).exists()}
    todo = [c for c in plan if c.index not in done and (only is None or c.index in only)]
    manifest.update({
        "generator": "python -m oomcast.training.record_corpus", "node": socket.gethostname(),
        "cpus": os.cpu_count(), "interval_s": INTERVAL_S, "plan_seed": seed,
        "splits": {k: list(v) for k, v in SPLITS.items()},
    })  # fmt: skip
    log(f"{len(todo)} configs to record ({len(plan)} planned), {workers} at a time; logs {logs}")
    with mp.get_context("fork").Pool(workers) as pool:
        jobs = [(c, str(out), str(logs)) for c in todo]
        for entries in pool.imap_unordered(_worker, jobs):
            manifest["runs"] = [e for e in manifest["runs"] if e["file"] not in
                                {x["file"] for x in entries}] + entries  # fmt: skip
            manifest["runs"].sort(key=lambda e: e["file"])
            tmp = path.with_suffix(".tmp")
            tmp.write_text(json.dumps(manifest, indent=1) + "\n")
            os.replace(tmp, path)
    return manifest


def corpus_paths(folder: Path | str, split: str) -> list[Path]:
    """The traces of one split (``train``, ``val``, ``test``) of a recorded corpus."""
    folder = Path(folder)
    runs = json.loads((folder / MANIFEST).read_text())["runs"]
    return [folder / r["file"] for r in runs if r["split"] == split]


def summarize(folder: Path | str) -> str:
    folder = Path(folder)
    runs = json.loads((folder / MANIFEST).read_text())["runs"]
    size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
    lines = [f"{len(runs)} runs, {size / MIB:.1f} MiB on disk"]
    for split in SPLITS:
        rs = [r for r in runs if r["split"] == split]
        ooms = sum(r["oom"] for r in rs)
        near = sum(1 for r in rs if not r["oom"] and r["anon_peak_frac"] >= 0.75)
        lines.append(
            f"  {split}: {len(rs)} runs of {len({r['program'] for r in rs})} programs;"
            f" {ooms} OOM-killed, {near} near misses (>= 75% of the limit),"
            f" {len(rs) - ooms - near} far from it; causes of OOM:"
            f" {sorted({r['cause'] for r in rs if r['oom']})}"
        )
    durations = sorted(r["duration_s"] for r in runs)
    if durations:
        lines.append(f"  durations {durations[0]:.0f}-{durations[-1]:.0f} s")
    return "\n".join(lines)


def check_folder(folder: Path | str) -> list[str]:
    folder = Path(folder)
    problems = []
    for r in json.loads((folder / MANIFEST).read_text())["runs"]:
        try:
            trace = load_trace(folder / r["file"])
        except Exception as exc:
            problems.append(f"{r['file']}: {exc}")
            continue
        if trace.ooms != r["oom"]:
            problems.append(f"{r['file']}: manifest and trace disagree on the OOM")
    return problems


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m oomcast.training.record_corpus",
        description="Record the real-run corpus: real programs under real cgroup limits.",
    )
    p.add_argument("--out", default="training/traces/corpus", help="folder (default: %(default)s)")
    p.add_argument("--workers", type=int, default=6, help="configs recorded at once")
    p.add_argument("--seed", type=int, default=0, help="seed of the plan")
    p.add_argument("--only", type=int, nargs="*", default=None, help="config numbers")
    p.add_argument("--plan", action="store_true", help="print the plan and stop")
    p.add_argument("--check", action="store_true", help="check a recorded folder and stop")
    args = p.parse_args(argv)
    if args.plan:
        plan = make_plan(args.seed)
        for c in plan:
            print(c.index, c.split, c.program, c.cause, c.follow_ups, json.dumps(c.knobs))
        runs = sum(1 + len(c.follow_ups) for c in plan)
        hours = sum(c.knobs["duration_s"] * (1 + len(c.follow_ups) * 0.8) for c in plan) / 3600
        print(f"{len(plan)} configs, {runs} runs, about {hours:.1f} run-hours")
        return 0
    if args.check:
        print(summarize(args.out))
        problems = check_folder(args.out)
        for line in problems:
            print("PROBLEM", line)
        return 1 if problems else 0
    try:
        record_corpus(args.out, workers=args.workers, seed=args.seed, only=args.only)
    except CgroupUnavailable as exc:
        print(f"record_corpus: {exc}", file=sys.stderr)
        return 2
    print(summarize(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
