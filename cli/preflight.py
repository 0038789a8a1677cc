"""``oomcast preflight``: will a training job fit a GPU? (see docs/preflight.md)

The job comes from ``--entry pkg.module:function`` (a function returning a
``PreflightJob``) or from a training script as written, ``-- python train.py ARGS``, run in
this process on fake tensors (``preflight/script.py``; a script that calls
``oomcast.preflight.submit(job)`` is checked by that job). The options are checked before
anything runs. torch is imported only when the command runs.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import os
import sys
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from oomcast.cli.common import UsageError

if TYPE_CHECKING:
    from oomcast.preflight.job import PreflightJob
    from oomcast.preflight.report import PreflightReport

_PYTHONS = ("python", "python3", Path(sys.executable).name)


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "preflight",
        help="check before launch whether a training job fits a GPU, and where it would OOM",
        description="Run a few train steps, one eval and one checkpoint of a job on fake"
        " tensors (no memory used), replay the allocations through the CUDA caching-allocator"
        " simulator at the GPU's capacity and say per phase what it needs, whether it fits"
        " and what would make it fit. Exit status 0 if it fits, 1 if it would OOM.",
    )
    p.add_argument(
        "--gpu",
        help="target GPU from the catalogue (an unknown name lists them); no default: give"
        " --gpu or --capacity-bytes",
    )
    p.add_argument(
        "--capacity-bytes",
        type=int,
        help="bytes the allocator may reserve (overrides the GPU's total less the context)",
    )
    p.add_argument(
        "--context-bytes",
        type=int,
        default=None,
        help="CUDA context allowance subtracted from the GPU's total (default: 768 MiB)",
    )
    p.add_argument(
        "--alloc-conf",
        default=None,
        help="PYTORCH_CUDA_ALLOC_CONF-style settings, e.g. expandable_segments:True"
        " (default: $PYTORCH_CUDA_ALLOC_CONF, else torch's defaults)",
    )
    p.add_argument("--steps", type=int, default=3, help="train steps to run")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    p.add_argument("--plot", help="write a PNG timeline of the replay here")
    p.add_argument("--no-remedies", action="store_true", help="skip the remedy search")
    p.add_argument("--entry", help="pkg.module:function returning a PreflightJob")
    p.add_argument(
        "script",  # not "command": main() names the subcommand by args.command in errors
        metavar="command",
        nargs=argparse.REMAINDER,
        help="after --: python SCRIPT ARGS (or python -m MODULE ARGS), the script as written",
    )
    p.set_defaults(func=cmd_preflight)


def _options(args: argparse.Namespace) -> dict[str, Any]:
    from oomcast.preflight.gpus import CONTEXT_ALLOWANCE_BYTES

    if not args.gpu and args.capacity_bytes is None:
        raise UsageError("give --gpu NAME or --capacity-bytes N")
    if args.steps < 1:
        raise UsageError(f"--steps must be at least 1, not {args.steps}")
    from oomcast.preflight.gpus import capacity_for

    try:  # before anything runs: a wrong name must not cost a run of the script
        capacity_for(
            args.gpu,
            args.capacity_bytes,
            CONTEXT_ALLOWANCE_BYTES if args.context_bytes is None else args.context_bytes,
        )
    except ValueError as exc:
        raise UsageError(f"--gpu/--capacity-bytes: {exc}") from None
    conf = (
        args.alloc_conf
        if args.alloc_conf is not None
        else os.environ.get("PYTORCH_CUDA_ALLOC_CONF")
    )
    return {
        "gpu": args.gpu,
        "capacity_bytes": args.capacity_bytes,
        "alloc_conf": conf,
        "steps": args.steps,
        "context_bytes": CONTEXT_ALLOWANCE_BYTES
        if args.context_bytes is None
        else args.context_bytes,
        "remedies": not args.no_remedies,
    }


def _entry_job(entry: str) -> PreflightJob:
    from oomcast.preflight.job import PreflightJob

    module_name, sep, func_name = entry.partition(":")
    if not sep or not module_name or not func_name:
        raise UsageError(f"--entry must be pkg.module:function, not {entry!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise UsageError(f"--entry {entry}: cannot import {module_name}: {exc}") from None
    func = getattr(module, func_name, None)
    if not callable(func):
        raise UsageError(f"--entry {entry}: {module_name} has no function {func_name}")
    job = func()
    if not isinstance(job, PreflightJob):
        raise UsageError(f"--entry {entry} returned {type(job).__name__}, not a PreflightJob")
    return job


def _run_script(command: list[str], options: dict[str, Any]) -> PreflightReport:
    """Run the script as written under fake tensors (``preflight/script.py``) and report; a
    script that hands over a ``PreflightJob`` with ``submit(job)`` is checked by that job."""
    from oomcast.preflight.script import ScriptFailed, preflight_script

    if command and command[0] == "--":
        command = command[1:]
    if command and Path(command[0]).name in _PYTHONS:
        command = command[1:]
    if not command:
        raise UsageError("give --entry pkg.module:function or -- python train.py ARGS")
    module = command[1] if command[0] == "-m" and len(command) > 1 else None
    if module is None and not Path(command[0]).is_file():
        raise UsageError(f"no such script: {command[0]}")
    if module is not None:
        _find_module(module)
    path = None if module is not None else command[0]
    argv = command[2:] if module is not None else command[1:]
    try:
        return preflight_script(path, argv, module=module, **options)
    except ScriptFailed as exc:
        # the script's own failure is not a verdict: exit status 1 means "would OOM", so it
        # must not escape as a traceback (which exits 1 too); the traceback is printed
        if exc.__cause__ is not None:
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        raise UsageError(str(exc)) from None


def _find_module(module: str) -> None:
    """``-m MODULE`` must name a module this Python finds (UsageError, exit 2, if not)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError) as exc:
        spec, why = None, f" ({exc})"
    else:
        why = ""
    if spec is None:
        raise UsageError(
            f"-m {module}: no such module{why}; the folder you run from is not searched,"
            " so install the package or set PYTHONPATH (e.g. PYTHONPATH=. oomcast preflight"
            " ... -- python -m MODULE)"
        )


def cmd_preflight(args: argparse.Namespace) -> int:
    options = _options(args)
    if args.entry and args.script and args.script != ["--"]:
        raise UsageError("give --entry or a command after --, not both")
    from oomcast.preflight.api import preflight
    from oomcast.preflight.capture import CaptureError

    try:
        if args.entry:
            report = preflight(_entry_job(args.entry), **options)
        else:
            report = _run_script(list(args.script), options)
    except CaptureError as exc:
        raise UsageError(str(exc)) from None
    if args.plot:
        from oomcast.preflight.plot import plot_timeline

        written = plot_timeline(report, args.plot)
        print(f"wrote {written}", file=sys.stderr)
    if args.json:
        print(json.dumps(report.to_json()))
    else:
        print(report.text())
    return 0 if report.fits else 1
