"""The subcommands that run ``oomcast.training`` (imported inside each command, so the
service image, which has no torch, never loads it): ``dump``, ``simulate``, ``evaluate``,
``recalibrate``, ``train``, ``export``, ``card``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from oomcast.cli.common import (
    CORPUS_TRACES,
    HOST_TRACES,
    JOBS_TRACES,
    PROG,
    SHIPPED_MODEL,
    UsageError,
    keys_from_env,
)
from oomcast.model.wire import redact_url, redis_url_from_env


def cmd_dump(args: argparse.Namespace) -> int:
    import redis

    url = args.redis_url or redis_url_from_env()
    client = redis.Redis.from_url(url, socket_connect_timeout=2.0)
    try:
        return _dump_outcomes(client, args) if args.outcomes else _dump_node(client, args)
    except redis.RedisError as exc:
        raise UsageError(f"cannot read from Redis at {redact_url(url)}: {exc}") from None


def _dump_node(client: Any, args: argparse.Namespace) -> int:
    from oomcast.training.from_redis import dump_trace

    if not args.node:
        raise UsageError("give --node NODE (whose stream to dump) or --outcomes")
    folder = Path(args.out).parent
    if not folder.is_dir():  # a typo in the path should not leave folders behind
        raise UsageError(f"--out {args.out}: the folder {folder} does not exist")
    result = dump_trace(
        client,
        keys_from_env(),
        args.node,
        args.out,
        devices=set(args.device) if args.device else None,
        since=args.since,
        until=args.until,
    )
    print(
        f"wrote {result.path}: {result.samples} samples of {len(result.domains)} domains"
        f" ({', '.join(result.domains)}), {result.events} events ({result.ooms} oom);"
        f" skipped {result.skipped_entries} bad entries, {result.duplicates} duplicates"
    )
    return 0


def _dump_outcomes(client: Any, args: argparse.Namespace) -> int:
    import os

    from oomcast.service.kept import kept_keys
    from oomcast.training.from_redis import dump_outcomes

    if args.node or args.device or args.until is not None:
        raise UsageError("--outcomes dumps every kept trace: --node, --device and --until"
                         " do not apply (--since does)")  # fmt: skip
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: with --outcomes it is a folder, and this is a file")
    if not out.parent.is_dir():
        raise UsageError(f"--out {out}: the folder {out.parent} does not exist")
    seal = kept_keys(
        os.environ.get("OOMCAST_CONTROL_SECRET") or None,
        os.environ.get("OOMCAST_WEBHOOK_SECRET") or None,
    )
    try:
        result = dump_outcomes(client, keys_from_env(), out, seal_keys=seal, since=args.since)
    except (ValueError, OSError) as exc:
        raise UsageError(f"--out {out}: {exc}") from None
    kinds = ", ".join(f"{n} {k}" for k, n in sorted(result.by_outcome.items())) or "none"
    print(
        f"wrote {len(result.written)} kept traces to {result.folder} ({kinds}) and"
        f" {result.folder / 'outcomes.json'}; left out {result.forged} with a bad seal,"
        f" {result.malformed} unreadable, {result.missing} expired"
    )
    if not result.sealed:
        print(
            "seals NOT checked: set the secret the service seals with (OOMCAST_CONTROL_SECRET,"
            " or OOMCAST_WEBHOOK_SECRET when it has no control secret); anyone who can write"
            " to Redis could have written these",
            file=sys.stderr,
        )
    if result.written:
        print(f"score them: {PROG} evaluate --traces {result.folder}; train on them:"
              f" {PROG} train --extra-train {result.folder}")  # fmt: skip
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if not args.out and not args.figures:
        raise UsageError("give --out DIR (traces) or --figures DIR (PNGs)")
    if not 0.0 <= args.announce_share <= 1.0:
        raise UsageError(f"--announce-share {args.announce_share:g}: must be between 0 and 1")
    from oomcast.training.simulate import simulate

    if args.figures:
        from oomcast.training.figures import plot_families

        for path in plot_families(args.figures, args.cache):
            print(f"wrote {path}")
        return 0
    manifest = simulate(
        args.out,
        n=args.n,
        seed=args.seed,
        workers=args.workers,
        cache_dir=args.cache,
        overwrite=args.overwrite,
        progress=not args.no_progress,
        announce_share=args.announce_share,
    )
    ooms = sum(1 for t in manifest["traces"] if t["ooms"])
    splits = ", ".join(f"{k} {v}" for k, v in manifest["splits"].items())
    print(
        f"wrote {manifest['n']} traces ({ooms} end in OOM; {splits}) and manifest.json to"
        f" {args.out} in {manifest['seconds']}s"
    )
    return 0


def cmd_evaluate(args: argparse.Namespace) -> int:
    from oomcast.model.baselines import baseline_detectors
    from oomcast.training.evaluate import evaluate, format_table

    paths = [p for found in _trace_groups(args.traces, args.split).values() for p in found]
    detectors = list(baseline_detectors())
    model = _model_detector(args.model)
    if model is not None:
        detectors.insert(0, model)
    if args.resample_s is not None and not 0 < args.resample_s < float("inf"):
        raise UsageError(f"--resample-s {args.resample_s:g}: must be a positive number of seconds")
    result = evaluate(
        detectors,
        paths,
        min_lead_s=args.min_lead,
        view=args.view,
        resample_s=args.resample_s,
        per_trace=args.per_trace,
        by_cause=args.by_cause,
        progress=not args.no_progress,
        phases=not args.no_phases,
    )
    print(
        json.dumps(result, indent=None if args.json else 1) if args.json else format_table(result)
    )
    return 0


def _trace_groups(given: list[str], split: str | None) -> dict[str, list[Path]]:
    """Each ``--traces`` argument's traces (a folder's, of ``split`` if given, or a file);
    UsageError naming an argument that holds none."""
    from oomcast.model.trace import find_traces

    groups: dict[str, list[Path]] = {}
    for name in given:
        path = Path(name)
        if path.is_dir():
            found = find_traces(path)
            if split is not None:
                found = _in_split(path, split, found)
            if not found:
                raise UsageError(f"--traces {name}: no traces (*.jsonl, *.jsonl.gz) in it"
                                 + (f" of split {split}" if split else ""))  # fmt: skip
        elif path.is_file():
            found = [path]
        else:
            raise UsageError(f"--traces {name}: not a folder or file")
        groups.setdefault(name, []).extend(found)
    return groups


def cmd_recalibrate(args: argparse.Namespace) -> int:
    from oomcast.model.runtime import ModelLoadError, OnnxForecaster

    groups = _trace_groups(args.traces, args.split)
    out = Path(args.out) if args.out else None
    if out is not None:
        from oomcast.training.recalibrate import onnx_available

        if out.exists():
            raise UsageError(f"--out {out}: the file exists; give a new file name")
        if not out.parent.is_dir():
            raise UsageError(f"--out {out}: the folder {out.parent} does not exist")
        if not onnx_available():
            raise UsageError("--out needs the onnx package to write the model: pip install"
                             " 'oomcast[train]'")  # fmt: skip
    model = Path(args.model) if args.model else SHIPPED_MODEL
    try:
        OnnxForecaster(model)  # a model that will not load is named before any work
    except ModelLoadError as exc:
        raise UsageError(f"--model {model}: {exc}") from None
    from oomcast.training.recalibrate import TooLittleEvidence, format_report, recalibrate

    try:
        result = recalibrate(model, groups, progress=not args.no_progress and not args.json)
    except TooLittleEvidence as exc:
        if args.json:
            print(json.dumps({"refused": str(exc), "evidence": exc.evidence.to_dict()}))
        print(f"{PROG} recalibrate: error: {exc}", file=sys.stderr)  # as main prints errors
        return 3
    if out is not None:
        from oomcast.training.recalibrate import ModelWriteError, write_model

        try:
            result.written = str(write_model(model, out, result))
        except (FileExistsError, ModelWriteError) as exc:
            raise UsageError(f"--out {out}: {exc}") from None
    print(json.dumps(result.to_dict()) if args.json else format_report(result))
    return 0


def _in_split(folder: Path, split: str, found: list[Path]) -> list[Path]:
    """The traces of ``found`` that the folder's manifest puts in ``split``."""
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise UsageError(f"--split {split}: {folder} has no manifest.json naming splits")
    runs = json.loads(manifest.read_text()).get("runs", [])
    names = {r["file"] for r in runs if isinstance(r, dict) and r.get("split") == split}
    return [p for p in found if p.name in names]


def _model_detector(path: str | None) -> Any:
    """The model as a detector (named ``model``), or None with a note when there is none."""
    from oomcast.model.forecast import Detector
    from oomcast.model.runtime import DEFAULT_MODEL, ModelLoadError, OnnxForecaster

    try:
        fc = OnnxForecaster(path or DEFAULT_MODEL)
    except ModelLoadError as exc:
        if path:
            raise UsageError(str(exc)) from None
        print(f"{PROG} evaluate: no model scored ({exc}); baselines only", file=sys.stderr)
        return None
    return Detector("model", fc, fc.rule)


def cmd_train(args: argparse.Namespace) -> int:
    from oomcast.model.trace import find_traces
    from oomcast.training.train import Sources, train

    sim = Path(args.data) if args.data else None
    if sim is not None:
        for folder in (sim / "train", sim / "val"):
            if not folder.is_dir():
                raise UsageError(f"{folder}: not a folder of traces (run oomcast simulate first)")
    corpus = Path(args.corpus) if args.corpus else None
    if corpus is not None and not (corpus / "manifest.json").is_file():
        raise UsageError(f"--corpus {corpus}: no manifest.json there")
    corpus_v1 = Path(args.corpus_v1) if args.corpus_v1 else None
    if corpus_v1 is not None and not (corpus_v1 / "manifest.json").is_file():
        raise UsageError(f"--corpus-v1 {corpus_v1}: no manifest.json there")
    host = Path(args.host_traces) if args.host_traces else None
    if host is not None and not host.is_dir():
        raise UsageError(f"--host-traces {host}: no such folder")
    extra = [Path(p) for p in args.extra_train]
    for path in extra:
        if not path.exists():
            raise UsageError(f"--extra-train {path}: no such file or folder")
    sources = Sources(
        sim=sim,
        corpus=corpus,
        corpus_v1=corpus_v1,
        host=host,
        extra=[f for p in extra for f in (find_traces(p) if p.is_dir() else [p])],
        shapes=args.shapes,
        nvml_views=not args.no_nvml_views,
    )
    if args.init_from and not Path(args.init_from).is_file():
        raise UsageError(f"--init-from {args.init_from}: no such checkpoint")
    train(
        sources,
        args.out,
        init_from=args.init_from,
        lr=args.lr,
        epochs=args.epochs,
        seed=args.seed,
        max_minutes=args.max_minutes,
        patience=args.patience,
        progress=not args.no_progress,
    )
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from oomcast.training.export import export

    if not Path(args.checkpoint).is_file():
        raise UsageError(f"--checkpoint {args.checkpoint}: no such file")
    out = Path(args.out)
    if out.exists() and not args.force:
        shipped = out.resolve() == SHIPPED_MODEL.resolve()
        raise UsageError(
            f"--out {out}: "
            + ("that is the model shipped with oomcast" if shipped else "the file exists")
            + "; give --force to replace it"
        )
    path = export(args.checkpoint, args.out, version=args.version)
    print(f"wrote {path} ({path.stat().st_size} bytes)")
    return 0


def cmd_card(args: argparse.Namespace) -> int:
    from oomcast.training.model_card import build

    if not Path(args.model).is_file():
        raise UsageError(f"--model {args.model}: no such file")
    if not Path(args.sim_test).is_dir():
        raise UsageError(f"--sim-test {args.sim_test}: no such folder")
    if not (Path(args.corpus) / "manifest.json").is_file():
        raise UsageError(f"--corpus {args.corpus}: no manifest.json there")
    result = build(
        args.model,
        sim_test=args.sim_test,
        corpus=args.corpus,
        figures_dir=args.figures,
        out_json=args.out,
    )
    if args.out:
        figures = ", ".join(result["figures"].values())
        print(f"wrote {args.out} and {figures} in {result['seconds']['total']:.0f}s")
    else:
        print(json.dumps(result, indent=1))
    return 0


def add_parsers(sub: Any) -> None:
    du = sub.add_parser(
        "dump",
        help="write what a node streamed to Redis, or the traces kept for the scorecard's"
        " misses, as labelled traces",
        description="Read one node's samples and events back from Redis into a trace file"
        " (.jsonl or .jsonl.gz) that evaluate and train read; or, with --outcomes, write the"
        " traces the service kept for its missed OOMs, false alarms and near misses into a"
        " folder.",
    )
    du.add_argument(
        "--node",
        help="the node as its agent names it: its --node, by default the node's hostname",
    )
    du.add_argument(
        "--outcomes",
        action="store_true",
        help="write the kept traces of missed OOMs, false alarms and near misses instead"
        " (--out is then a folder; --since: kept at or after this unix time)",
    )
    du.add_argument("--out", required=True, help="trace file to write (a folder with --outcomes)")
    du.add_argument("--device", action="append", help="only this device (repeatable)")
    du.add_argument(
        "--since", type=float, default=None, help="unix time Redis received the first entry"
    )
    du.add_argument("--until", type=float, default=None, help="unix time to stop at (ditto)")
    du.add_argument("--redis-url", default=None, help="default: $OOMCAST_REDIS_URL")
    du.set_defaults(func=cmd_dump)

    m = sub.add_parser("simulate", help="write labelled traces (train/val/test split)")
    m.add_argument("--out", help="folder for the traces and manifest.json")
    m.add_argument("--n", type=int, default=200, help="traces to write")
    m.add_argument("--seed", type=int, default=0, help="random seed (same seed, same traces)")
    m.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    m.add_argument("--cache", default="data/captures", help="where captured allocation logs go")
    m.add_argument("--figures", help="instead: write one PNG per scenario family here")
    m.add_argument("--overwrite", action="store_true", help="replace traces already in --out")
    m.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    m.add_argument(
        "--announce-share",
        type=float,
        default=0.5,
        metavar="P",
        help="share of scheduled jobs whose phases a preflight announces before they first run"
        " (default %(default)s)",
    )
    m.set_defaults(func=cmd_simulate)

    e = sub.add_parser("evaluate", help="score the forecasters on a folder of traces")
    e.add_argument(
        "--traces", required=True, nargs="+", help="folders of traces and/or trace files"
    )
    e.add_argument("--min-lead", type=float, default=10.0, help="seconds of warning that count")
    e.add_argument(
        "--split",
        choices=["train", "val", "test"],
        help="of a folder whose manifest.json splits its runs (a corpus), only this split",
    )
    e.add_argument(
        "--view",
        choices=["full", "nvml"],
        default="full",
        help="nvml: score GPU samples as NVML alone reports them (no allocator figures)",
    )
    e.add_argument("--json", action="store_true", help="print one JSON object")
    e.add_argument("--model", help="ONNX model to score (default: the shipped one, if any)")
    e.add_argument(
        "--per-trace",
        metavar="FILE",
        help="also write one JSON line per trace and detector (alert, lead, time-to-OOM checks)",
    )
    e.add_argument(
        "--resample-s",
        type=float,
        metavar="S",
        help="first downsample every trace to one sample per S seconds (peaks kept)",
    )
    e.add_argument(
        "--by-cause",
        action="store_true",
        help="also score per cause, as the traces' manifest.json names them",
    )
    e.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    e.add_argument(
        "--no-phases",
        action="store_true",
        help="score the detectors alone: without the phase forecasts the service merges in"
        " where a trace has a schedule (the nvml view never has them)",
    )
    e.set_defaults(func=cmd_evaluate)

    r = sub.add_parser(
        "recalibrate",
        help="refit the alert rule and the calibration from the fleet's own outcomes, shown"
        " beside the model's own",
        description="Run a model over labelled traces of your fleet (oomcast dump --outcomes,"
        " oomcast dump --node), refit its per-horizon calibration and its alert rule as"
        " training fits them, and print both side by side. Nothing changes unless --out is"
        " given: then a copy of the model carrying the refit is written, to be run as the"
        " service's shadow (OOMCAST_SHADOW_MODEL_PATH) and promoted later. Exits 3, naming"
        " the counts, when the traces hold too few OOMs, clean runs or job-hours.",
    )
    r.add_argument(
        "--traces",
        required=True,
        action="extend",
        nargs="+",
        help="folders of traces and/or trace files (repeatable); each is a group whose"
        " ordinary runs the rule holds to 2%% false alarms",
    )
    r.add_argument("--model", help=f"ONNX model to refit (default: {SHIPPED_MODEL})")
    r.add_argument("--out", help="write the refit model here (a new file; default: write nothing)")
    r.add_argument(
        "--split",
        choices=["train", "val", "test"],
        help="of a folder whose manifest.json splits its runs (a corpus), only this split",
    )
    r.add_argument("--json", action="store_true", help="print one JSON object")
    r.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r.set_defaults(func=cmd_recalibrate)

    t = sub.add_parser(
        "train",
        help="train the LSTM on simulated GPUs, the real-run corpus and plain shapes",
        description="Train the forecaster. Validation (epoch, calibration and alert rule) uses"
        " the simulated val split and the corpus's validation programs; the corpus's test"
        " programs and the simulated test split are never read.",
    )
    t.add_argument(
        "--data", default="data/sim", help="folder written by oomcast simulate ('' for none)"
    )
    t.add_argument(
        "--corpus",
        default=str(JOBS_TRACES),
        help="the corpus of real jobs, split by program ('' for none; default: %(default)s)",
    )
    t.add_argument(
        "--corpus-v1",
        default=str(CORPUS_TRACES),
        help="the first, shorter real-run corpus: its runs of programs the main corpus trains"
        " on are added to training ('' for none; default: %(default)s)",
    )
    t.add_argument(
        "--host-traces",
        default=str(HOST_TRACES),
        help="the first recorded host traces, all used for training ('' for none)",
    )
    t.add_argument(
        "--shapes", type=int, default=1200, help="plain shapes added to training (default 1200)"
    )
    t.add_argument("--out", default="runs/latest", help="where the checkpoint goes")
    t.add_argument(
        "--extra-train", nargs="*", default=[], help="more traces (files or folders) to train on"
    )
    t.add_argument("--epochs", type=int, default=40, help="default %(default)s")
    t.add_argument(
        "--patience", type=int, default=10, help="stop after this many epochs without progress"
    )
    t.add_argument("--no-progress", action="store_true", help="no progress bars")
    t.add_argument(
        "--no-nvml-views",
        action="store_true",
        help="train on the simulated GPUs as the hook sees them only (by default each GPU trace"
        " is also shown as NVML alone sees it, without allocator figures)",
    )
    t.add_argument("--max-minutes", type=float, default=30.0, help="default %(default)s")
    t.add_argument(
        "--init-from",
        help="go on from this checkpoint's weights (a run of the same network and features)",
    )
    t.add_argument(
        "--lr", type=float, default=3e-3, help="learning rate (lower it with --init-from)"
    )
    t.add_argument("--seed", type=int, default=0, help="random seed")
    t.set_defaults(func=cmd_train)

    x = sub.add_parser(
        "export",
        help="export a checkpoint to ONNX",
        description="Write a trained checkpoint as the ONNX model the service loads"
        " (OOMCAST_MODEL_PATH). It never replaces the model shipped with oomcast, or any"
        " existing file, unless --force is given.",
    )
    x.add_argument("--checkpoint", default="runs/latest/checkpoint.pt", help="from oomcast train")
    x.add_argument("--out", default="runs/latest/oomcast-lstm.onnx", help="ONNX file to write")
    x.add_argument("--version", default="lstm-dev", help="model version the service reports")
    x.add_argument("--force", action="store_true", help="replace --out if it exists")
    x.set_defaults(func=cmd_export)

    c = sub.add_parser(
        "card", help="measure a model and the baselines on held-out traces: tables and figures"
    )
    c.add_argument("--model", default=str(SHIPPED_MODEL), help="ONNX model to measure")
    c.add_argument("--sim-test", default="data/sim/test", help="the simulated test split")
    c.add_argument(
        "--corpus", default=str(JOBS_TRACES), help="the corpus of real jobs (its test programs)"
    )
    c.add_argument("--figures", default="docs/figures", help="where the PNGs go")
    c.add_argument("--out", help="write the numbers here as JSON (default: print them)")
    c.set_defaults(func=cmd_card)
