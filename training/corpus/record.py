"""Record the real-job corpus (``training/traces/jobs``): resumable, two runs at a time.

    python -m oomcast.training.corpus.record --out training/traces/jobs --workers 2 --commit
    python -m oomcast.training.corpus.record --out training/traces/jobs --plan
    python -m oomcast.training.corpus.record --out training/traces/jobs --check

First every program is calibrated *alone* (nothing else recorded meanwhile), under a roomy
limit; the figures go to ``calibration.json``. Then the runs of ``plan.py`` are recorded,
at most ``--workers`` at a time, each pinned to a processor of its own and single-threaded,
under its own memory cgroup with its planned limit, sampled at 10 Hz. The kernel decides
whether a run is killed.

A run whose steps came more than 20% slower or faster than its planned period (measured
from the program's own step statistics, over its steady part) is recorded again, up to
twice; the manifest keeps the drift of the run it accepted. Everything already in the
manifest with its trace on disk is skipped, so a stopped recording resumes where it
stopped; ``--commit`` makes a git commit of each accepted run (its trace and the
manifest), so a recording that spans sessions loses nothing.

``--relimit-near`` records again every near miss that stopped short of the scoring's near
level (90% of its limit) without being killed: the plan's limit comes from a calibration
estimate of what a fill costs, and for some programs the fill cost less. The run's own
measured peak sets the new limit (the peak lands at 91-95% of it); ``relimits.json`` keeps
the first recording's limit and peak, and the manifest entry names them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from oomcast.collectors.cgroupfs import CgroupUnavailable, default_root
from oomcast.model.schema import Sample
from oomcast.model.trace import load_trace
from oomcast.training.cgroup_recorder import record
from oomcast.training.corpus.plan import (
    CALIBRATION_S,
    PROBE_AT_S,
    ROOMY_LIMIT_BYTES,
    SPLITS,
    Calibration,
    RunPlan,
    calibration_script,
    plan_program,
    programs,
    seeded_rng,
)

MANIFEST = "manifest.json"
CALIBRATION = "calibration.json"
RELIMITS = "relimits.json"
NEAR_LEVEL = 0.9  # as training/classes.py scores a near miss
RELIMIT_TARGET = (0.91, 0.95)  # where a re-recorded near miss's peak should land
INTERVAL_S = 0.1
MAX_DRIFT = 0.2
ATTEMPTS = 3
MAX_FAILURES = 4  # runs failing in a row before the recorder stops: something is broken
CGROUP_PREFIX = "oomcast-jobs-"
MIB = 1 << 20


class RunFailed(RuntimeError):
    """A run's program failed by itself (not killed for memory): it is not recorded."""


def _env() -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = "1"
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def level_of(s: Sample) -> float:
    """The level the embedding forecasts on a host domain: anonymous memory, plus whatever
    the peak saw above usage between two samples."""
    anon = s.allocated_bytes if s.allocated_bytes is not None else s.used_bytes
    return anon + max(0, (s.peak_bytes or s.used_bytes) - s.used_bytes)


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, indent=1) + "\n")
    os.replace(tmp, path)


def read_stats(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(ValueError):
            lines.append(json.loads(line))
    return lines


def _weighted(lines: list[dict[str, Any]], key: str) -> float | None:
    rows = [(r[key], r["steps"]) for r in lines if r.get(key) is not None and r["steps"]]
    total = sum(n for _, n in rows)
    return sum(v * n for v, n in rows) / total if total else None


class Recorder:
    def __init__(self, out: Path, *, workers: int = 2, commit: bool = False,
                 log: Any = print) -> None:  # fmt: skip
        self.out = out.resolve()  # the programs run in folders of their own
        self.workers = workers
        self.commit = commit
        self.log = log
        self.logs = self.out / "logs"
        self.lock = threading.Lock()
        self.stop = threading.Event()
        out.mkdir(parents=True, exist_ok=True)
        self.logs.mkdir(exist_ok=True)
        path = out / MANIFEST
        self.manifest: dict[str, Any] = (
            json.loads(path.read_text()) if path.exists() else {"runs": []}
        )
        cpath = out / CALIBRATION
        self.calibrations: dict[str, Calibration] = {
            k: Calibration.from_dict(v)
            for k, v in (json.loads(cpath.read_text()) if cpath.exists() else {}).items()
        }
        rpath = out / RELIMITS
        self.relimits: dict[str, dict[str, Any]] = (
            json.loads(rpath.read_text()) if rpath.exists() else {}
        )

    # -- calibration -----------------------------------------------------------------------------
    def calibrate(self, program: str) -> Calibration:
        """The program alone under a roomy limit: steady at scale 1, then at scale 2."""
        script = calibration_script(program)
        stats = self.logs / f"calibration-{program}.stats.jsonl"
        stats.unlink(missing_ok=True)
        trace = self.out / "calibration" / f"{program}.jsonl.gz"
        trace.parent.mkdir(exist_ok=True)
        result = self._record(program, script.to_json(), ROOMY_LIMIT_BYTES, trace,
                              f"calibration-{program}", [0], CALIBRATION_S + 120)  # fmt: skip
        samples = [r for r in result["records"] if isinstance(r, Sample)]
        if not samples or result["oom"] or result["exit_code"] != 0:
            raise RuntimeError(f"calibration of {program} failed: see {self.logs}")
        t0 = samples[0].ts
        at1 = [level_of(s) for s in samples if 20 <= s.ts - t0 < PROBE_AT_S - 1]
        all1 = [level_of(s) for s in samples if 5 <= s.ts - t0 < PROBE_AT_S - 1]
        at2 = [level_of(s) for s in samples if s.ts - t0 >= PROBE_AT_S + 10]
        lines = read_stats(stats)
        before = [r for r in lines if 10 <= r["t"] < PROBE_AT_S]
        after = [r for r in lines if r["t"] >= PROBE_AT_S + 8]
        c1, c2 = _weighted(before, "compute_s"), _weighted(after, "compute_s")
        if not at1 or not at2 or c1 is None or c2 is None:
            raise RuntimeError(f"calibration of {program}: too few samples or step statistics")
        cal = Calibration(
            compute_s=round(c1, 5), compute_x2_s=round(c2, 5),
            level_bytes=statistics.median(at1), peak_bytes=max(all1),
            per_scale_bytes=max(0.0, statistics.median(at2) - statistics.median(at1)),
        )  # fmt: skip
        self.log(
            f"calibrated {program}: step {c1 * 1e3:.0f} ms (x2: {c2 * 1e3:.0f} ms), level"
            f" {cal.level_bytes / MIB:.0f} MiB, peak {cal.peak_bytes / MIB:.0f} MiB, +"
            f"{cal.per_scale_bytes / MIB:.0f} MiB per unit of scale; period {cal.period_s()} s"
        )
        return cal

    def ensure_calibrated(self, progs: Sequence[str]) -> None:
        for program in progs:
            if program in self.calibrations or self.stop.is_set():
                continue
            self.calibrations[program] = self.calibrate(program)
            _write_json(self.out / CALIBRATION,
                        {k: v.to_dict() for k, v in sorted(self.calibrations.items())})  # fmt: skip
            self._git([self.out / CALIBRATION, self.out / "calibration" / f"{program}.jsonl.gz"],
                      f"corpus: calibrate {program}")  # fmt: skip

    # -- the plan ------------------------------------------------------------------------------
    def plan(self, progs: Sequence[str]) -> list[RunPlan]:
        """Every run of the calibrated programs, interleaved (the first run of every program,
        then the second, ...) so that a partial corpus is balanced."""
        per = [plan_program(p, self.calibrations[p], self.calibrations)
               for p in progs if p in self.calibrations]  # fmt: skip
        order: list[RunPlan] = []
        for i in range(max((len(x) for x in per), default=0)):
            order += [x[i] for x in per if i < len(x)]
        for x in order:
            if x.name in self.relimits:
                x.limit_bytes = int(self.relimits[x.name]["limit_bytes"])
        return order

    def done(self) -> set[str]:
        """Runs recorded with their trace on disk, at the limit the plan now gives them."""
        return {
            r["name"] for r in self.manifest["runs"]
            if (self.out / r["file"]).exists()
            and r["limit_bytes"] == self.relimits.get(r["name"], r)["limit_bytes"]
        }  # fmt: skip

    def relimit_near(self) -> list[str]:
        """Give every near miss that peaked below the near level, unkilled, a new limit from
        its measured peak (kept in ``relimits.json``); the names, validation and test first."""
        order = {"val": 0, "test": 1, "train": 2}
        names = []
        known = json.dumps(self.relimits, sort_keys=True)
        for r in sorted(self.manifest["runs"], key=lambda r: (order.get(r["split"], 3),
                                                                r["name"])):  # fmt: skip
            known_limit = self.relimits.get(r["name"], {}).get("limit_bytes")
            if known_limit is not None and known_limit != r["limit_bytes"]:
                names.append(r["name"])  # given a new limit, not yet recorded under it
                continue
            if r["kind"] != "near" or r["oom"] or r["level_peak_frac"] >= NEAR_LEVEL:
                continue
            # short of the near level: the first time, or again under its new limit (a
            # program's peak varies a little from run to run)
            peak = r["level_peak_frac"] * r["limit_bytes"]
            tries = int(self.relimits.get(r["name"], {}).get("tries", 0)) + 1
            target = seeded_rng(f"{r['name']}:relimit:{tries}").uniform(*RELIMIT_TARGET)
            first = {k: r[k] for k in ("limit_bytes", "level_peak_frac", "duration_s")}
            self.relimits[r["name"]] = {
                "limit_bytes": int(peak / target),
                "first": self.relimits.get(r["name"], {}).get("first", first),
                "tries": tries,
            }
            names.append(r["name"])
        if json.dumps(self.relimits, sort_keys=True) != known:
            _write_json(self.out / RELIMITS, self.relimits)
            self._git([self.out / RELIMITS], "corpus: new limits for near misses that fell short")
        return names

    # -- recording -----------------------------------------------------------------------------
    def _record(self, program: str, script_json: str, limit: int, trace: Path, name: str,
                cpus: list[int], timeout_s: float) -> dict[str, Any]:  # fmt: skip
        stats = self.logs / f"{name}.stats.jsonl"
        # -P and a folder of its own: nothing lying in a shared working folder (a stray
        # inspect.py in /tmp once was) can shadow a module the program imports
        cmd = [sys.executable, "-P", "-m", "oomcast.training.corpus.run", program,
               "--script", script_json, "--stats", str(stats)]  # fmt: skip
        with (
            open(self.logs / f"{name}.log", "w") as child_log,
            tempfile.TemporaryDirectory(prefix="oomcast-run-") as cwd,
        ):
            return record(
                cmd, limit_bytes=limit, out=trace, job=name,
                name=f"{CGROUP_PREFIX}{os.getpid()}-{name}",
                interval_s=INTERVAL_S, timeout_s=timeout_s, stdout=child_log, stderr=child_log,
                cpus=cpus, env=_env(), cwd=cwd,
            )  # fmt: skip

    def record_run(self, plan: RunPlan, core: int) -> dict[str, Any]:
        """Record one run until its step period holds (at most ``ATTEMPTS`` times)."""
        cal = self.calibrations[plan.program]
        entry: dict[str, Any] = {}
        for attempt in range(1, ATTEMPTS + 1):
            stats = self.logs / f"{plan.name}.stats.jsonl"
            stats.unlink(missing_ok=True)
            tmp = self.out / f".{plan.name}.jsonl.gz"
            result = self._record(plan.program, plan.script.to_json(), plan.limit_bytes, tmp,
                                  plan.name, [core],
                                  plan.script.duration_s * 1.5 + 120)  # fmt: skip
            lines = read_stats(stats)
            onset = plan.onset_s if plan.onset_s is not None else plan.script.duration_s
            # the step period before growth starts; a start-up climb (onset a few seconds in)
            # is judged over its first minute, where the pace is held all the same
            until = max(onset, 60.0) + 5
            steady = [r for r in lines if 10 <= r["t"] <= until and r["scale"] <= 1.05]
            period = _weighted(steady, "period_s")
            compute = _weighted(steady, "compute_s")
            drift = None if period is None else period / plan.script.period_s - 1.0
            samples = [r for r in result["records"] if isinstance(r, Sample)]
            peak = max((level_of(s) for s in samples), default=0.0)
            entry = {
                **plan.manifest(), "file": f"{plan.name}.jsonl.gz", "oom": result["oom"],
                **({"relimited_from": self.relimits[plan.name]["first"]}
                   if plan.name in self.relimits else {}),
                "oom_ts": result["oom_ts"], "start_ts": result["started_ts"],
                "duration_s": result["duration_s"], "samples": result["samples"],
                "exit_code": result["exit_code"], "timed_out": result["timed_out"],
                "level_peak_frac": round(peak / plan.limit_bytes, 4),
                "period_drift": None if drift is None else round(drift, 4),
                "compute_ratio": None if compute is None else round(compute / cal.compute_s, 3),
                "attempts": attempt, "core": core, "node": socket.gethostname(),
            }  # fmt: skip
            if result["exit_code"] != 0 and not result["oom"] and result["samples"] < 100:
                tmp.unlink(missing_ok=True)
                raise RunFailed(f"{plan.name}: the program failed (exit {result['exit_code']});"
                                f" see {self.logs / (plan.name + '.log')}")  # fmt: skip
            ok = drift is not None and abs(drift) <= MAX_DRIFT
            self.log(
                f"{plan.name} [{plan.split}] core {core}: limit {plan.limit_bytes / MIB:.0f} MiB"
                f" oom={result['oom']} (planned {plan.expect_oom})"
                f" {result['duration_s']:.0f}s level peak {peak / plan.limit_bytes:.2f}"
                f" period drift {entry['period_drift']} compute x{entry['compute_ratio']}"
                + ("" if ok else f" -> attempt {attempt} rejected")
            )
            if ok or attempt == ATTEMPTS or self.stop.is_set():
                entry["accepted"] = ok
                os.replace(tmp, self.out / entry["file"])
                return entry
            tmp.unlink(missing_ok=True)
        return entry

    def _add(self, entry: dict[str, Any]) -> None:
        with self.lock:
            runs = [r for r in self.manifest["runs"] if r["name"] != entry["name"]] + [entry]
            self.manifest["runs"] = sorted(runs, key=lambda r: r["name"])
            self.manifest.update({
                "generator": "python -m oomcast.training.corpus.record",
                "interval_s": INTERVAL_S, "splits": {k: list(v) for k, v in SPLITS.items()},
            })  # fmt: skip
            _write_json(self.out / MANIFEST, self.manifest)
            self._git([self.out / MANIFEST, self.out / entry["file"]], f"corpus: {entry['name']}")

    def run_names(self, names: Sequence[str]) -> None:
        """Record the named runs (not yet done), in that order."""
        progs = sorted({self._program(n) for n in names})
        plans = {p.name: p for p in self.plan(progs)}
        self._run_plans([plans[n] for n in names if n in plans and n not in self.done()])

    def _program(self, name: str) -> str:
        return str(next(r["program"] for r in self.manifest["runs"] if r["name"] == name))

    def _git(self, paths: list[Path], message: str) -> None:
        if not self.commit:
            return
        top = subprocess.run(["git", "-C", str(self.out), "rev-parse", "--show-toplevel"],
                             capture_output=True, text=True,
                             check=False).stdout.strip()  # fmt: skip
        if not top:
            return
        for _ in range(20):  # another git command may hold the index for a moment
            add = subprocess.run(["git", "-C", top, "add", "-f", *map(str, paths)],
                                 capture_output=True, text=True, check=False)  # fmt: skip
            done = subprocess.run(
                ["git", "-C", top, "commit", "-q", "--no-verify", "-m", message, "--",
                 *map(str, paths)],
                capture_output=True, text=True, check=False,
            )  # fmt: skip
            if add.returncode == 0 and done.returncode == 0:
                return
            said = done.stdout + done.stderr
            if "nothing to commit" in said or "no changes added to commit" in said:
                return
            time.sleep(3)
        self.log(f"git commit of {message!r} failed: {done.stderr.strip()[:200]}")

    def run(self, progs: Sequence[str]) -> None:
        _remove_stale_cgroups()
        self.ensure_calibrated(progs)
        done = self.done()
        self._run_plans([p for p in self.plan(progs) if p.name not in done])

    def _run_plans(self, pending: list[RunPlan]) -> None:
        todo: queue.Queue[RunPlan] = queue.Queue()
        for p in pending:
            todo.put(p)
        self.log(f"{len(pending)} runs to record ({len(self.done())} done),"
                 f" {self.workers} at a time")  # fmt: skip

        failures = [0]  # in a row, over both workers

        def worker(core: int) -> None:
            while not self.stop.is_set():
                try:
                    plan = todo.get_nowait()
                except queue.Empty:
                    return
                try:
                    self._add(self.record_run(plan, core))
                    failures[0] = 0
                except Exception as exc:  # one broken run must not end the recording...
                    self.log(f"{plan.name} failed, not recorded: {exc}")
                    failures[0] += 1
                    if failures[0] >= MAX_FAILURES:  # ... but a broken setup must
                        self.log(f"{failures[0]} runs in a row failed: stopping")
                        self.stop.set()

        threads = [threading.Thread(target=worker, args=(core,)) for core in range(self.workers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()


def _remove_stale_cgroups() -> None:
    """Cgroups a killed recorder left behind (no process is in them any more)."""
    with contextlib.suppress(CgroupUnavailable, OSError):
        root = default_root()
        for path in root.glob(f"{CGROUP_PREFIX}*"):
            with contextlib.suppress(OSError):
                procs = (path / "cgroup.procs").read_text().split()
                if not procs:
                    path.rmdir()


def summarize(folder: Path) -> str:
    runs = json.loads((folder / MANIFEST).read_text())["runs"]
    lines = [f"{len(runs)} runs, {sum(r['duration_s'] for r in runs) / 3600:.1f} run-hours"]
    for split in SPLITS:
        rs = [r for r in runs if r["split"] == split]
        kinds: dict[str, list[int]] = {}
        for r in rs:
            k = kinds.setdefault(r["kind"], [0, 0])
            k[0] += 1
            k[1] += bool(r["oom"])
        lines.append(f"  {split}: {len(rs)} runs of {len({r['program'] for r in rs})} programs; "
                     + ", ".join(f"{k} {n} ({o} OOM)"
                                 for k, (n, o) in sorted(kinds.items())))  # fmt: skip
    drifts = [abs(r["period_drift"]) for r in runs if r.get("period_drift") is not None]
    if drifts:
        kept = sum(not r.get("accepted", True) for r in runs)
        lines.append(f"  period drift: median {statistics.median(drifts):.1%},"
                     f" max {max(drifts):.1%}; {kept} runs kept over 20%")  # fmt: skip
    return "\n".join(lines)


def check_folder(folder: Path) -> list[str]:
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
    p = argparse.ArgumentParser(prog="python -m oomcast.training.corpus.record",
                                description="Record the real-job corpus (resumable).")  # fmt: skip
    p.add_argument("--out", type=Path, default=Path("training/traces/jobs"))
    p.add_argument("--workers", type=int, default=2, help="runs at once, one per processor")
    p.add_argument("--only", nargs="*", default=None, help="programs (default: all)")
    p.add_argument("--commit", action="store_true", help="git commit each accepted run")
    p.add_argument("--plan", action="store_true", help="print the plan (calibrated programs)")
    p.add_argument("--check", action="store_true", help="check the recorded folder and stop")
    p.add_argument("--relimit-near", action="store_true",
                   help="record again, under a limit set from their measured peak, the near"
                   " misses that stopped short of 90%% of their limit")  # fmt: skip
    args = p.parse_args(argv)
    progs = args.only or programs()
    if args.workers > (os.cpu_count() or 1):
        p.error(f"--workers {args.workers}: this machine has {os.cpu_count()} processors")
    rec = Recorder(args.out, workers=args.workers, commit=args.commit,
                   log=lambda m: print(time.strftime("%H:%M:%S"), m, flush=True))  # fmt: skip
    if args.check:
        print(summarize(args.out))
        problems = check_folder(args.out)
        for line in problems:
            print("PROBLEM", line)
        return 1 if problems else 0
    if args.plan:
        plans = rec.plan(progs)
        for x in plans:
            print(x.name, x.split, f"limit {x.limit_bytes / MIB:.0f} MiB", x.script.to_json())
        hours = sum(x.script.duration_s for x in plans) / 3600
        print(f"{len(plans)} runs, at most {hours:.1f} run-hours")
        return 0

    def on_signal(signum: int, _frame: Any) -> None:
        rec.log(f"signal {signum}: stopping after the runs under way")
        rec.stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        if args.relimit_near:
            _remove_stale_cgroups()
            rec.run_names(rec.relimit_near())
        else:
            rec.run(progs)
    except CgroupUnavailable as exc:
        print(f"record: {exc}", file=sys.stderr)
        return 2
    print(summarize(args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
