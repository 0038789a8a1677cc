"""How close is preflight on training scripts as written? Each example script in
``bench/preflight/scripts/``, at two batch sizes, predicted and run for real.

- ``predicted``: ``trace_script`` runs the script unmodified under fake tensors with the GPU
  emulated (what ``oomcast preflight --gpu NAME -- python SCRIPT ...`` does); the figure is
  the peak of live bytes it puts on the (emulated) device.
- ``truth``: the same script, same arguments, run for real on this machine's CPU in a
  child process under ``torch.profiler`` with ``profile_memory=True``: the CPU allocator's
  own account of every allocation and free (kernel scratch buffers included, which no
  dispatch mode sees), reduced to the peak of live bytes. Only what the harness must do to
  stand for a GPU run is changed, outside the script: optimizers take their ``foreach``
  path, as they do by default on CUDA (on CPU they would loop per tensor). The traced run
  keeps the CPU kernels' allocations too (``cuda_kernels=False``): the operators whose
  CUDA kernels allocate otherwise (attention, dropout, the cuBLAS workspace:
  ``preflight/kernels.py``) are emulated as on a GPU only when preflight targets one.

Each script runs ``--steps 3`` (train steps, then its eval and its checkpoint), so the
truth covers what preflight traces. Relative error is ``(predicted - truth) / truth``.

Verdicts: preflight's replay of its own trace through the caching-allocator simulator, at
a capacity of 0.8 and 1.5 times the true peak (no context allowance): it must say OOM at
0.8x (the job cannot fit below its live peak) and fit at 1.5x.

What the truth does not stand for: on a real GPU, CUDA kernels (cuDNN, cuBLAS, fused
attention) have their own workspaces and outputs (docs/preflight-accuracy.md has the H200
figures, from ``python -m oomcast.bench.preflight.scripts_gpu``), and a host-side dataset
held in memory is counted here (there is one CPU) but would not be on the GPU.

    python -m oomcast.bench.preflight.script_accuracy [--json] [--only mlp hf_gpt2]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent / "scripts"
STEPS = 3
VERDICT_FACTORS = (0.8, 1.5)
RESULT = "SCRIPT-ACCURACY "  # the line a child prints its JSON on (the scripts print too)
CHILD_TIMEOUT_S = 900


@dataclass(frozen=True)
class Case:
    name: str
    file: str
    family: str
    what: str
    argv: tuple[str, ...]  # {batch}, {steps}, {out} are filled in
    batches: tuple[int, int]


_PLAIN = ("--batch-size", "{batch}", "--steps", "{steps}", "--out")
CASES: tuple[Case, ...] = (
    Case("mlp", "mlp.py", "MLP", "Adam, eval under no_grad", (*_PLAIN, "{out}/c.pt"), (64, 1024)),
    Case(
        "cnn_bn",
        "cnn_bn.py",
        "CNN",
        "BatchNorm, SGD momentum, a scheduler",
        (*_PLAIN, "{out}/c.pt"),
        (16, 64),
    ),
    Case(
        "hf_resnet",
        "hf_resnet.py",
        "vision (transformers)",
        "ResNet from its config, save_pretrained",
        (*_PLAIN, "{out}/m"),
        (8, 32),
    ),
    Case(
        "hf_vit",
        "hf_vit.py",
        "vision (transformers)",
        "ViT from its config; eval without no_grad",
        (*_PLAIN, "{out}/c.pt"),
        (16, 64),
    ),
    Case(
        "hf_gpt2",
        "hf_gpt2.py",
        "LM (transformers)",
        "GPT-2 from its config, warmup schedule, clipping",
        (*_PLAIN, "{out}/c.pt"),
        (4, 16),
    ),
    Case(
        "hf_gpt2_ckpt",
        "hf_gpt2_ckpt.py",
        "LM (transformers)",
        "GPT-2, gradient checkpointing, sequence 512",
        (*_PLAIN, "{out}/m"),
        (4, 16),
    ),
    Case(
        "hf_bert_mlm",
        "hf_bert_mlm.py",
        "LM (transformers)",
        "BERT masked LM, gradient accumulation x2",
        (*_PLAIN, "{out}/c.pt"),
        (8, 32),
    ),
    Case(
        "hf_trainer",
        "hf_trainer.py",
        "framework",
        "Hugging Face Trainer: BERT classifier, its own eval and save",
        (
            "{out}/hf",
            "--batch-size",
            "{batch}",
            "--max-steps",
            "{steps}",
            "--eval-steps",
            "{steps}",
        ),
        (8, 32),
    ),
    Case(
        "lightning_mlp",
        "lightning_mlp.py",
        "framework",
        "PyTorch Lightning: sanity check, fit, ModelCheckpoint",
        ("{out}/pl", "--batch-size", "{batch}", "--max-steps", "{steps}"),
        (32, 256),
    ),
    Case(
        "lstm_lm",
        "lstm_lm.py",
        "RNN",
        "LSTM LM, truncated BPTT, hidden state carried",
        (*_PLAIN, "{out}/c.pt"),
        (8, 32),
    ),
    Case(
        "varlen_lm",
        "varlen_lm.py",
        "LM",
        "lengths drawn per batch, SDPA, tied embeddings",
        (*_PLAIN, "{out}/c.pt"),
        (8, 32),
    ),
    Case(
        "plain_lm",
        "plain_lm.py",
        "LM",
        "nn.TransformerEncoder LM (the issue's script)",
        (*_PLAIN, "{out}/c.pt", "--eval-every", "{steps}"),
        (8, 32),
    ),
)


def case(name: str) -> Case:
    for c in CASES:
        if c.name == name:
            return c
    raise KeyError(f"no case {name!r}: the cases are {', '.join(c.name for c in CASES)}")


def argv_for(c: Case, batch: int, out: Path, steps: int = STEPS) -> list[str]:
    return [a.format(batch=batch, steps=steps, out=out) for a in c.argv]


# -- the two children --------------------------------------------------------------------------


def truth_peak(path: str, argv: list[str]) -> dict[str, Any]:
    """Run the script for real under the profiler; the peak of the CPU allocator's live bytes.

    Run it in a process of its own (``--child truth``): the script's globals, imports and
    threads are its own, and nothing allocated before it skews the account."""
    import runpy

    from torch.optim.optimizer import register_optimizer_step_pre_hook
    from torch.profiler import ProfilerActivity, profile

    from oomcast.preflight.capture import foreach_like_cuda

    register_optimizer_step_pre_hook(lambda opt, args, kwargs: foreach_like_cuda(opt))
    sys.argv = [path, *argv]
    sys.path.insert(0, str(Path(path).resolve().parent))
    started = time.monotonic()
    with (
        contextlib.redirect_stdout(sys.stderr),
        profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof,
    ):
        runpy.run_path(path, run_name="__main__")
    seconds = time.monotonic() - started
    events = prof.profiler.kineto_results.events()
    mem = sorted((e.start_ns(), e.nbytes()) for e in events if e.name() == "[memory]")
    live = peak = 0
    for _, nbytes in mem:
        live += nbytes
        peak = max(peak, live)
    return {"peak_bytes": peak, "seconds": round(seconds, 2), "events": len(mem)}


def predicted_peak(path: str, argv: list[str], capacities: list[int]) -> dict[str, Any]:
    """Trace the script as preflight does; its peak of live device bytes, the phase it is
    reached in, and the verdict of the replay at each capacity."""
    from oomcast.preflight.allocconf import AllocConf
    from oomcast.preflight.replay import Replayer
    from oomcast.preflight.script import trace_script

    started = time.monotonic()
    # the CPU kernels' allocations, as the truth runs them (not CUDA's: preflight/kernels.py)
    trace = trace_script(
        path, argv, gpu="emulated", total_bytes=1 << 40, steps=STEPS, cuda_kernels=False
    )
    seconds = time.monotonic() - started
    ops = [op for op in trace.ops if op.phase != "teardown"]
    sizes: dict[int, int] = {}
    live = peak = 0
    peak_phase = ""
    for op in ops:
        if op.alloc:
            sizes[op.sid] = op.size
            live += op.size
        else:
            live -= sizes.pop(op.sid, 0)
        if live > peak:
            peak, peak_phase = live, op.phase
    verdicts = []
    for capacity in capacities:
        rep = Replayer(capacity, AllocConf(), None)
        for op in ops:
            if not rep.feed(op):
                break
        oom = rep.result.oom
        verdicts.append(
            {
                "capacity_bytes": capacity,
                "fits": oom is None,
                "where": None if oom is None else f"{oom.phase} of step {oom.step}",
            }
        )
    return {
        "peak_bytes": peak,
        "peak_phase": peak_phase,
        "steps": trace.steps_done,
        "stopped_by": trace.stopped_by,
        "saw_eval": trace.saw_eval,
        "eval_synthesized": trace.eval_synthesized,
        "saw_checkpoint": trace.saw_checkpoint,
        "stand_ins": len(trace.stand_ins),
        "seconds": round(seconds, 2),
        "verdicts": verdicts,
    }


def _child(kind: str, path: str, argv: list[str], capacities: list[int]) -> dict[str, Any]:
    caps = ",".join(map(str, capacities)) or "-"
    cmd = [sys.executable, "-m", "oomcast.bench.preflight.script_accuracy"]
    cmd += ["--child", kind, caps, path]
    env = dict(os.environ)
    if kind == "truth":
        env["CUDA_VISIBLE_DEVICES"] = ""  # the truth is the CPU allocator's, even on a GPU box
    run = subprocess.run(
        [*cmd, *argv], capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=env
    )
    for line in run.stdout.splitlines():
        if line.startswith(RESULT):
            got: dict[str, Any] = json.loads(line[len(RESULT) :])
            return got
    return {"error": f"exit {run.returncode}: {run.stderr.strip()[-1500:]}"}


# -- rows and the table ------------------------------------------------------------------------


@dataclass
class Row:
    case: str
    family: str
    batch_size: int
    truth: dict[str, Any] = field(default_factory=dict)
    predicted: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return "error" not in self.truth and "error" not in self.predicted

    @property
    def rel_err(self) -> float | None:
        if not self.ok:
            return None
        return float(self.predicted["peak_bytes"] / self.truth["peak_bytes"] - 1.0)

    @property
    def verdicts_right(self) -> list[bool]:
        if not self.ok:
            return []
        return [
            v["fits"] == (f >= 1.0)
            for f, v in zip(VERDICT_FACTORS, self.predicted["verdicts"], strict=True)
        ]


def measure_row(c: Case, batch: int) -> Row:
    row = Row(c.name, c.family, batch)
    path = str(SCRIPTS / c.file)
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "truth").mkdir()
        row.truth = _child("truth", path, argv_for(c, batch, Path(tmp) / "truth"), [])
    if "error" in row.truth:
        return row
    capacities = [int(f * row.truth["peak_bytes"]) for f in VERDICT_FACTORS]
    with tempfile.TemporaryDirectory() as tmp:
        row.predicted = _child("predict", path, argv_for(c, batch, Path(tmp)), capacities)
    return row


def measure(names: list[str] | None = None, progress: bool = True) -> list[Row]:
    rows = []
    for c in CASES:
        if names and c.name not in names:
            continue
        for batch in c.batches:
            row = measure_row(c, batch)
            if progress:
                err = row.rel_err
                print(
                    f"{c.name} bs {batch}: "
                    + (f"{err:+.2%}" if err is not None else "error")
                    + f" verdicts {sum(row.verdicts_right)}/{len(VERDICT_FACTORS)}",
                    file=sys.stderr,
                    flush=True,
                )
            rows.append(row)
    return rows


def summarize(rows: list[Row]) -> dict[str, Any]:
    errs = [(abs(e), r) for r in rows if (e := r.rel_err) is not None]
    out: dict[str, Any] = {
        "rows": len(rows),
        "measured": len(errs),
        "errors": [f"{r.case} bs {r.batch_size}" for r in rows if not r.ok],
        "verdicts_right": sum(sum(r.verdicts_right) for r in rows),
        "verdicts": sum(len(r.verdicts_right) for r in rows),
    }
    if errs:
        worst = max(errs, key=lambda x: x[0])
        out["median_abs_rel_err"] = statistics.median(e for e, _ in errs)
        out["max_abs_rel_err"] = worst[0]
        out["max_row"] = f"{worst[1].case} bs {worst[1].batch_size}"
    return out


def format_table(rows: list[Row]) -> str:
    lines = [
        "| script | bs | predicted | truth (allocator) | error | peak in | verdicts 0.8x/1.5x |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if not r.ok:
            why = (r.truth.get("error") or r.predicted.get("error") or "")[-200:]
            lines.append(f"| `{r.case}` | {r.batch_size} | error: {why} | | | | |")
            continue
        marks = " / ".join(
            ("fits" if v["fits"] else "OOM") + ("" if ok else " (wrong)")
            for v, ok in zip(r.predicted["verdicts"], r.verdicts_right, strict=True)
        )
        lines.append(
            f"| `{r.case}` | {r.batch_size} | {r.predicted['peak_bytes']:,} |"
            f" {r.truth['peak_bytes']:,} | {r.rel_err:+.2%} | {r.predicted['peak_phase']} |"
            f" {marks} |"
        )
    s = summarize(rows)
    if s["measured"]:
        lines.append("")
        lines.append(
            f"{s['measured']} rows: median |error| {s['median_abs_rel_err']:.2%}, max"
            f" {s['max_abs_rel_err']:.2%} ({s['max_row']}); verdicts right"
            f" {s['verdicts_right']}/{s['verdicts']}"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:  # --child KIND CAPACITIES|- SCRIPT ARGS... (from _child)
        kind, caps, path, *script_argv = argv[1:]
        if kind == "truth":
            result = truth_peak(path, script_argv)
        else:
            result = predicted_peak(path, script_argv, [int(x) for x in caps.split(",")])
        print(RESULT + json.dumps(result), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", nargs="+", metavar="CASE", help="cases (default: all)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    for name in args.only or []:
        case(name)  # a wrong name is an error before anything runs
    rows = measure(args.only)
    if args.json:
        print(json.dumps({"summary": summarize(rows), "rows": [asdict(r) for r in rows]}, indent=1))
    else:
        print(format_table(rows))


if __name__ == "__main__":
    main()
