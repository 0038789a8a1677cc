"""The ``oomcast`` command. Each subcommand imports what it needs when it runs, so the
collector image (no fastapi) and the service image (no torch) both run this entry point."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from oomcast.model.wire import redis_url_from_env

PROG = "oomcast"
CORPUS_TRACES = Path(__file__).resolve().parents[1] / "training" / "traces" / "corpus"
HOST_TRACES = Path(__file__).resolve().parents[1] / "training" / "traces" / "host"


class UsageError(Exception):
    """A mistake the user can fix; printed without a traceback."""


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise UsageError(f"{name}={raw!r} is not a whole number") from None


def _keys_from_env() -> Any:
    from oomcast.model.wire import Keys

    try:
        return Keys.from_env()
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _stop_on_signals() -> threading.Event:
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def _default_cgroup_root() -> str:
    """/sys/fs/cgroup/memory on a cgroup v1 node, else /sys/fs/cgroup (v2)."""
    v1 = Path("/sys/fs/cgroup/memory")
    return str(v1) if (v1 / "memory.usage_in_bytes").exists() else "/sys/fs/cgroup"


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from oomcast.service.main import create_app
    from oomcast.service.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:  # a bad OOMCAST_* value or rule file: say which, and stop
        problems = [str(e["msg"]).removeprefix("Value error, ") for e in exc.errors()]
        raise UsageError("; ".join(problems)) from None
    app = create_app(settings)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


SOURCES = ("nvml", "cgroup", "sim", "replay")


def _parse_sources(raw: str) -> list[str]:
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in SOURCES]
    if not names or unknown:
        raise UsageError(
            f"--source {raw!r}: unknown {', '.join(unknown) or 'empty list'};"
            f" choose from {', '.join(SOURCES)} (comma-separated for several)"
        )
    if len(set(names)) != len(names):
        raise UsageError(f"--source {raw!r} names a source twice")
    return names


def _build_sources(args: argparse.Namespace) -> list[Any]:
    sources: list[Any] = []
    for name in _parse_sources(args.source):
        if name == "replay":
            from oomcast.collectors.sources.replay import ReplaySource

            if not args.trace:
                raise UsageError("--source replay needs --trace FILE")
            if not Path(args.trace).is_file():
                raise UsageError(f"--trace {args.trace}: no such file")
            sources.append(ReplaySource(args.trace, speed=args.speed))
        elif name == "sim":
            from oomcast.collectors.sources.sim import SimGPU, SimSource

            patterns = args.patterns.split(",")
            gpus = [
                SimGPU(
                    args.node,
                    f"gpu{i}",
                    patterns[i % len(patterns)],
                    seed=args.seed,
                    time_scale=args.speed,
                )
                for i in range(args.gpus)
            ]
            sources.append(SimSource(gpus, interval_s=args.interval))
        elif name == "cgroup":
            from oomcast.collectors.cgroupfs import CgroupUnavailable
            from oomcast.collectors.sources.cgroup import CgroupSource

            try:
                sources.append(
                    CgroupSource(
                        args.node,
                        args.cgroup_root,
                        interval_s=args.cgroup_interval,
                        include=tuple(args.cgroup_include or ("*",)),
                        exclude=tuple(args.cgroup_exclude or ()),
                    )
                )
            except CgroupUnavailable as exc:
                raise UsageError(f"--cgroup-root {args.cgroup_root}: {exc}") from None
        elif name == "nvml":
            sources.append(_nvml_source(args))
    return sources


def _priorities(pairs: list[str] | None) -> dict[str, int]:
    """``--priority 'pod:*=10' --priority 'batch-*=-5'`` -> {glob: priority}."""
    out: dict[str, int] = {}
    for pair in pairs or []:
        glob, sep, value = pair.rpartition("=")
        try:
            out[glob] = int(value)
        except ValueError:
            sep = ""
        if not sep or not glob:
            raise UsageError(f"--priority {pair!r}: expected GLOB=INTEGER, e.g. 'pod:*=10'")
    return out


def _nvml_source(args: argparse.Namespace) -> Any:
    from oomcast.collectors.nvml import Nvml, NvmlUnavailable
    from oomcast.collectors.procinfo import ProcResolver
    from oomcast.collectors.sources.nvml import NvmlSource

    priorities = _priorities(args.priority)  # flags first: a typo should not wait on NVML
    nvml = Nvml()
    try:
        nvml.device_count()  # fail now, with the hint, rather than on the first tick
    except NvmlUnavailable as exc:
        raise UsageError(f"--source nvml: {exc}") from None
    return NvmlSource(
        args.node,
        nvml=nvml,
        procinfo=ProcResolver(args.proc_root, priorities=priorities),
        interval_s=args.nvml_interval,
    )


def cmd_collect(args: argparse.Namespace) -> int:
    import redis

    from oomcast.collectors.agent import NodeAgent
    from oomcast.collectors.publisher import StreamPublisher

    sources = _build_sources(args)
    url = args.redis_url or redis_url_from_env()
    client = redis.Redis.from_url(url, socket_connect_timeout=0.5, socket_timeout=2.0)
    publisher = StreamPublisher(
        client,
        maxlen=_env_int("OOMCAST_STREAM_MAXLEN", 100_000),
        buffer_samples=args.buffer_samples,
    )
    # The agent ticks at the shortest source interval; each source says when it is due. A
    # replay checks its clock more often than it samples, to keep the trace's own spacing.
    intervals = [float(getattr(s, "interval_s", args.interval)) for s in sources]
    if "replay" in _parse_sources(args.source):
        intervals.append(0.05)
    agent = NodeAgent(sources, publisher, _keys_from_env(), interval_s=min(intervals))
    listener = _control_listener(args, client, agent)
    extra = [listener] if listener is not None else []
    http = None
    explicit = args.metrics_port is not None or bool(os.environ.get("OOMCAST_AGENT_METRICS_PORT"))
    port = (
        args.metrics_port
        if args.metrics_port is not None
        else _env_int("OOMCAST_AGENT_METRICS_PORT", 9101)
    )
    if port:
        from oomcast.collectors.metrics import AgentHTTP

        try:
            http = AgentHTTP(agent, args.metrics_host, port, extra=extra).start()
        except OSError as exc:
            where = f"{args.metrics_host}:{port} ({exc.strerror})"
            if explicit:
                raise UsageError(f"--metrics-port {port}: cannot listen on {where}") from None
            # the default port, taken (a second agent on one machine): sample anyway
            logging.getLogger(PROG).warning("no /metrics: cannot listen on %s", where)
    stop = _stop_on_signals()
    logging.getLogger(PROG).info(
        "collecting from %s into %s%s",
        args.source,
        url,
        f"; metrics on http://{args.metrics_host}:{http.port}/metrics" if http else "",
    )
    try:
        if listener is not None:
            listener.start()
        agent.run(stop)
    finally:
        if listener is not None:
            listener.stop()
        if http is not None:
            http.close()
        for s in sources:
            close = getattr(s, "close", None)
            if callable(close):
                close()
    stats = publisher.stats
    print(
        f"{PROG} collect: {agent.stats.samples} samples, {agent.stats.events} events;"
        f" sent {stats.samples_sent}, dropped {stats.samples_dropped},"
        f" undelivered {publisher.buffered_samples}",
        file=sys.stderr,
    )
    return 0 if publisher.buffered_samples == 0 else 1


def _control_listener(args: argparse.Namespace, client: Any, agent: Any) -> Any:
    """The agent's side of the control path, when OOMCAST_CONTROL_SECRET is set: signed
    commands from the service are verified, then carried out (checkpoint, shed)."""
    secret = os.environ.get("OOMCAST_CONTROL_SECRET")
    if not secret:
        logging.getLogger(PROG).info("no OOMCAST_CONTROL_SECRET: this agent takes no commands")
        return None
    from oomcast.collectors.actions import CheckpointAction, ShedAction
    from oomcast.collectors.control import ControlListener, make_resolve
    from oomcast.collectors.procinfo import ProcResolver

    nvml = next((s for s in agent.sources if getattr(s, "name", "") == "nvml"), None)
    cgroups = next((s for s in agent.sources if getattr(s, "name", "") == "cgroup"), None)
    uids = {int(u) for u in args.shed_uids.split(",") if u.strip()} if args.shed_uids else None
    shed = ShedAction(
        grace_s=args.shed_grace,
        allowed_uids=uids,
        cgroup_scope=args.shed_cgroup_scope,
        proc_root=args.proc_root,
    )
    executors = {
        "checkpoint": CheckpointAction(client, agent.keys, ack_timeout_s=args.checkpoint_timeout),
        "shed": shed,
    }
    resolve = make_resolve(
        nvml=nvml,
        cgroup_root=cgroups.root if cgroups is not None else None,
        procs=ProcResolver(args.proc_root, priorities=_priorities(args.priority)),
        proc_root=args.proc_root,
    )
    return ControlListener(client, agent.keys, args.node, secret, executors, resolve)


def cmd_dump(args: argparse.Namespace) -> int:
    import redis

    from oomcast.training.from_redis import dump_trace

    url = args.redis_url or redis_url_from_env()
    client = redis.Redis.from_url(url, socket_connect_timeout=2.0)
    try:
        result = dump_trace(
            client,
            _keys_from_env(),
            args.node,
            args.out,
            devices=set(args.device) if args.device else None,
            since=args.since,
            until=args.until,
        )
    except redis.RedisError as exc:
        raise UsageError(f"cannot read from Redis at {url}: {exc}") from None
    print(
        f"wrote {result.path}: {result.samples} samples of {len(result.domains)} domains"
        f" ({', '.join(result.domains)}), {result.events} events ({result.ooms} oom);"
        f" skipped {result.skipped_entries} bad entries, {result.duplicates} duplicates"
    )
    return 0


def cmd_simulate(args: argparse.Namespace) -> int:
    if not args.out and not args.figures:
        raise UsageError("give --out DIR (traces) or --figures DIR (PNGs)")
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
    from oomcast.model.trace import find_traces
    from oomcast.training.evaluate import evaluate, format_table

    paths: list[Path] = []
    for given in args.traces:
        path = Path(given)
        if path.is_dir():
            found = find_traces(path)
            if not found:
                raise UsageError(f"--traces {given}: no traces (*.jsonl, *.jsonl.gz) in it")
            paths += found
        elif path.is_file():
            paths.append(path)
        else:
            raise UsageError(f"--traces {given}: not a folder or file")
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
    )
    print(
        json.dumps(result, indent=None if args.json else 1) if args.json else format_table(result)
    )
    return 0


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
        host=host,
        extra=[f for p in extra for f in (find_traces(p) if p.is_dir() else [p])],
        shapes=args.shapes,
        nvml_views=not args.no_nvml_views,
    )
    train(
        sources,
        args.out,
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


def cmd_bench(args: argparse.Namespace) -> int:
    url = args.redis_url or redis_url_from_env()
    result: dict[str, Any]
    if args.what == "inference":
        from oomcast.service.bench import bench_inference

        result = bench_inference(args.model, seconds=args.seconds)
    elif args.what == "hook":
        from oomcast.collectors.hook import bench_hook

        result = bench_hook(args.steps, url)
    else:
        import redis

        from oomcast.collectors.bench import bench_agent

        try:
            result = bench_agent(url, seconds=args.seconds, hz=args.hz, domains=args.domains)
        except redis.RedisError as exc:
            raise UsageError(f"bench agent needs a Redis at {url}: {exc}") from None
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:40} {value}")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from oomcast.service.demo import run_demo

    return run_demo(
        duration_s=args.duration,
        live=not args.plain,
        port=args.port,
        speed=args.speed,
        private_redis=args.private_redis,
    )


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description="Forecast GPU and container OOMs.")
    p.add_argument(
        "--log-level",
        default=os.environ.get("OOMCAST_LOG_LEVEL", "info"),
        choices=["debug", "info", "warning", "error"],
    )
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="the whole system on this machine, with a live view")
    d.add_argument("--duration", type=float, default=None, help="stop after this many seconds")
    d.add_argument("--plain", action="store_true", help="print lines instead of a live table")
    d.add_argument("--port", type=int, default=0, help="service port (default: a free one)")
    d.add_argument("--speed", type=float, default=1.0, help="simulated jobs run this much faster")
    d.add_argument(
        "--private-redis",
        action="store_true",
        help="always start a private redis-server, even if one is configured or running",
    )
    d.set_defaults(func=cmd_demo)

    s = sub.add_parser("serve", help="run the service")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.set_defaults(func=cmd_serve)

    c = sub.add_parser(
        "collect",
        help="run a node agent",
        description="Sample memory domains and stream them to Redis. Several sources may run"
        " at once: --source nvml,cgroup",
    )
    c.add_argument("--source", required=True, help="comma-separated: nvml, cgroup, sim, replay")
    c.add_argument("--trace", help="trace file to replay (.jsonl or .jsonl.gz)")
    c.add_argument("--speed", type=float, default=1.0, help="replay or simulate this much faster")
    c.add_argument("--interval", type=float, default=1.0, help="sim sampling interval, seconds")
    c.add_argument("--nvml-interval", type=float, default=1.0, help="seconds between NVML samples")
    c.add_argument(
        "--cgroup-interval", type=float, default=1.0, help="seconds between cgroup samples"
    )
    c.add_argument(
        "--cgroup-root",
        default=os.environ.get("OOMCAST_CGROUP_ROOT") or _default_cgroup_root(),
        help="where the memory cgroups are: /sys/fs/cgroup (v2) or /sys/fs/cgroup/memory (v1)",
    )
    c.add_argument(
        "--cgroup-include",
        action="append",
        help="glob on the cgroup path below the root, e.g. '/kubepods*' (repeatable)",
    )
    c.add_argument("--cgroup-exclude", action="append", help="glob of cgroups to leave out")
    c.add_argument(
        "--proc-root",
        default=os.environ.get("OOMCAST_PROC_ROOT", "/proc"),
        help="/proc of the processes using the GPUs (map pids to pods)",
    )
    c.add_argument(
        "--priority",
        action="append",
        metavar="GLOB=INT",
        help="priority of jobs (or process names) matching GLOB, where a process does not"
        " set OOMCAST_PRIORITY itself (repeatable; default 0)",
    )
    c.add_argument("--node", default=os.environ.get("OOMCAST_NODE") or os.uname().nodename)
    c.add_argument("--gpus", type=int, default=4, help="simulated GPUs")
    c.add_argument(
        "--patterns",
        default="leak,sawtooth,step_growth,spiky",
        help="simulated patterns, cycled over the GPUs",
    )
    c.add_argument("--seed", type=int, default=0)
    c.add_argument(
        "--buffer-samples",
        type=int,
        default=100_000,
        help="samples kept while Redis is unreachable",
    )
    c.add_argument("--redis-url", default=None, help="default: $OOMCAST_REDIS_URL")
    c.add_argument(
        "--checkpoint-timeout",
        type=float,
        default=120.0,
        help="seconds a job has to report its checkpoint saved",
    )
    c.add_argument(
        "--shed-grace", type=float, default=10.0, help="seconds between SIGTERM and SIGKILL"
    )
    c.add_argument(
        "--shed-uids",
        default=None,
        help="comma-separated uids whose processes may be shed; live shedding needs this or"
        " --shed-cgroup-scope (without a scope the agent only does dry runs)",
    )
    c.add_argument(
        "--shed-cgroup-scope",
        default=None,
        help="only shed processes whose cgroup path (as /proc/<pid>/cgroup shows it to the"
        " agent) starts with this, e.g. /kubepods.slice or /kubepods",
    )
    c.add_argument("--metrics-host", default="127.0.0.1", help="address of /metrics, /livez")
    c.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        help="port of the agent's /metrics, /livez and /readyz (0: none; default"
        " $OOMCAST_AGENT_METRICS_PORT or 9101, skipped with a warning when that is taken)",
    )
    c.set_defaults(func=cmd_collect)

    du = sub.add_parser(
        "dump",
        help="write what a node streamed to Redis as a labelled trace",
        description="Read one node's samples and events back from Redis into a trace file"
        " (.jsonl or .jsonl.gz) that evaluate and train read.",
    )
    du.add_argument("--node", required=True)
    du.add_argument("--out", required=True, help="trace file to write")
    du.add_argument("--device", action="append", help="only this device (repeatable)")
    du.add_argument(
        "--since", type=float, default=None, help="unix time Redis received the first entry"
    )
    du.add_argument("--until", type=float, default=None, help="unix time to stop at (ditto)")
    du.add_argument("--redis-url", default=None, help="default: $OOMCAST_REDIS_URL")
    du.set_defaults(func=cmd_dump)

    m = sub.add_parser("simulate", help="write labelled traces (train/val/test split)")
    m.add_argument("--out", help="folder for the traces and manifest.json")
    m.add_argument("--n", type=int, default=200)
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--workers", type=int, default=None, help="processes (default: all cores)")
    m.add_argument("--cache", default="data/captures", help="where captured allocation logs go")
    m.add_argument("--figures", help="instead: write one PNG per scenario family here")
    m.add_argument("--overwrite", action="store_true", help="replace traces already in --out")
    m.set_defaults(func=cmd_simulate)

    e = sub.add_parser("evaluate", help="score the forecasters on a folder of traces")
    e.add_argument(
        "--traces", required=True, nargs="+", help="folders of traces and/or trace files"
    )
    e.add_argument("--min-lead", type=float, default=10.0, help="seconds of warning that count")
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
    e.set_defaults(func=cmd_evaluate)

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
        default=str(CORPUS_TRACES),
        help="the recorded real-run corpus, split by program ('' for none; default: %(default)s)",
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
    t.add_argument("--seed", type=int, default=0)
    t.set_defaults(func=cmd_train)

    x = sub.add_parser("export", help="export a checkpoint to ONNX")
    x.add_argument("--checkpoint", default="runs/latest/checkpoint.pt")
    x.add_argument("--out", default="model/oomcast-lstm.onnx")
    x.add_argument("--version", default="lstm-dev")
    x.set_defaults(func=cmd_export)

    c = sub.add_parser(
        "card", help="measure a model and the baselines on held-out traces: tables and figures"
    )
    c.add_argument("--model", default="model/oomcast-lstm.onnx")
    c.add_argument("--sim-test", default="data/sim/test", help="the simulated test split")
    c.add_argument(
        "--corpus", default=str(CORPUS_TRACES), help="the recorded corpus (its test programs)"
    )
    c.add_argument("--figures", default="docs/figures", help="where the PNGs go")
    c.add_argument("--out", help="write the numbers here as JSON (default: print them)")
    c.set_defaults(func=cmd_card)

    b = sub.add_parser("bench", help="measure a hot path")
    b.add_argument(
        "what",
        choices=["inference", "hook", "agent"],
        help="inference: the forecaster per sample; hook: the in-process hook's step();"
        " agent: the node agent's CPU use",
    )
    b.add_argument("--model", help="ONNX model (default: shipped, else an untrained one)")
    b.add_argument("--seconds", type=float, default=2.0, help="per measurement (agent: total)")
    b.add_argument("--steps", type=int, default=20_000, help="hook: steps timed")
    b.add_argument("--hz", type=float, default=10.0, help="agent: sampling rate")
    b.add_argument("--domains", type=int, default=8, help="agent: memory cgroups watched")
    b.add_argument("--redis-url", default=None, help="hook, agent: default $OOMCAST_REDIS_URL")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise
    func: Callable[[argparse.Namespace], int] = args.func
    from oomcast.model.trace import TraceError

    try:
        return func(args)
    except UsageError as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except (TraceError, FileNotFoundError, ValueError) as exc:
        print(f"{PROG} {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
