"""The subcommands of the service itself: ``serve``, ``demo`` and ``bench``."""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

from oomcast.cli.common import UsageError, missing_extra
from oomcast.cli.env import CommandEnv
from oomcast.model.wire import redact_url, redis_url_from_env


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn
    from pydantic import ValidationError

    from oomcast.service.settings import Settings

    try:
        settings = Settings()
    except ValidationError as exc:  # a bad OOMCAST_* value or rule file: say which, and stop
        raise UsageError(settings_problems(exc)) from None
    if settings.model_path and settings.forecaster == "model":
        from oomcast.model.runtime import ModelLoadError, OnnxForecaster

        try:  # a named model that cannot load stops the service here, not after start-up
            OnnxForecaster(settings.model_path)
        except ModelLoadError as exc:
            raise UsageError(f"OOMCAST_MODEL_PATH={settings.model_path}: {exc}") from None
    from oomcast.service.cluster.workers import WORKER_ENV, WorkersError, parse_workers, run_front

    try:
        workers = parse_workers(
            args.workers or settings.workers, cap=len(settings.owned_partitions())
        )
    except WorkersError as exc:
        raise UsageError(str(exc)) from None
    if workers > 1 and not args.uds:
        try:
            run_front(settings, workers, args.host, args.port, args.log_level)
        except WorkersError as exc:
            raise UsageError(str(exc)) from None
        return 0
    from oomcast.service.main import create_app  # not in a front: it forecasts nothing
    from oomcast.service.pipeline.state import tune_gc

    app = create_app(settings)
    tune_gc()
    if args.uds:  # a worker of `serve --workers` (whose front logs the requests), or a proxy's
        worker = os.environ.get(WORKER_ENV) is not None
        uvicorn.run(app, uds=args.uds, log_level=args.log_level, access_log=not worker)
    else:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    return 0


def settings_problems(exc: Any) -> str:
    """A pydantic ValidationError of ``Settings`` as sentences, each naming its variable
    (``OOMCAST_ALERT_HORIZON_S: Input should be a valid integer ...``)."""
    problems = []
    for e in exc.errors():
        msg = str(e["msg"]).removeprefix("Value error, ")
        loc = "_".join(str(part) for part in e.get("loc", ()))
        if loc and not msg.startswith("OOMCAST_"):
            value = e.get("input")
            secret = any(w in loc for w in ("secret", "token", "url"))  # may hold a password
            shown = f"={value!r}" if isinstance(value, str | int | float) and not secret else ""
            msg = f"OOMCAST_{loc.upper()}{shown}: {msg}"
        problems.append(msg)
    return "; ".join(problems)


INGEST_DRAIN_SECONDS = 10.0  # of backlog: a 2 s one is mostly the service's first batches


def cmd_bench(args: argparse.Namespace) -> int:
    if args.seconds is None:
        drain = args.what == "ingest" and args.rate is None and not args.soak
        args.seconds = INGEST_DRAIN_SECONDS if drain else 2.0
    if args.what == "faults":
        return _bench_faults(args)
    if args.what == "ingest":
        return _bench_ingest(args)
    if args.what == "cluster":
        return _bench_cluster(args)
    url = args.redis_url or redis_url_from_env()
    result: dict[str, Any]
    if args.what == "inference":
        from oomcast.bench.inference import bench_inference

        model, weights = _bench_model(args.model)
        result = bench_inference(model, seconds=args.seconds, weights=weights)
    elif args.what == "hook":
        from oomcast.bench.hook import bench_hook

        result = bench_hook(args.steps, url)
    elif args.what == "api" and args.predict:
        from oomcast.bench.api import ApiBenchError, bench_predict, parse_concurrency

        try:
            result = bench_predict(
                parse_concurrency(args.concurrency), args.seconds, args.window, args.model
            )
        except (ValueError, ApiBenchError) as exc:
            raise UsageError(str(exc)) from None
    elif args.what == "api":
        from oomcast.bench.api import bench_api

        if args.domains < 1 or args.requests < 1:
            raise UsageError("bench api: --domains and --requests must be at least 1")
        result = bench_api(domains=args.domains, requests=args.requests)
    else:
        import redis

        from oomcast.bench.agent import bench_agent

        try:
            result = bench_agent(
                url, seconds=args.seconds, hz=args.hz, domains=args.domains, gpus=args.gpus
            )
        except ValueError as exc:
            raise UsageError(str(exc)) from None
        except redis.RedisError as exc:
            raise UsageError(f"bench agent needs a Redis at {redact_url(url)}: {exc}") from None
    _print_figures(result, args.json)
    return 0


def _print_figures(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:40} {value}")


def _bench_ingest(args: argparse.Namespace) -> int:
    """``oomcast bench ingest``: ``oomcast serve`` replicas fed real stream entries
    (docs/bench.md)."""
    from oomcast.bench.ingest import IngestBenchError, bench_ingest

    if args.plot and not args.soak:
        raise UsageError("--plot draws a soak's RSS over time: give it with --soak")
    if args.plot and not Path(args.plot).resolve().parent.is_dir():
        raise UsageError(f"--plot {args.plot}: its folder does not exist")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise UsageError(
            f"--plot needs matplotlib: pip install 'oomcast[{missing_extra('matplotlib')}]'"
        )
    try:
        replicas = int(args.replicas or "1")
    except ValueError:
        raise UsageError(f"--replicas {args.replicas!r}: ingest takes one count, e.g. 2") from None
    from oomcast.service.cluster.workers import WorkersError, parse_workers

    try:
        workers = parse_workers(args.workers or "auto", cap=args.partitions // max(replicas, 1))
    except WorkersError as exc:
        raise UsageError(str(exc)) from None
    try:
        result = bench_ingest(
            domains=args.domains,
            seconds=args.seconds,
            rate=args.rate,
            soak=args.soak,
            partitions=args.partitions,
            replicas=replicas,
            workers=workers,
            shadow_model=args.shadow_model,
        )
    except (ValueError, IngestBenchError) as exc:
        raise UsageError(str(exc)) from None
    _print_figures(result, args.json)  # first: a plot that fails loses no figure
    if args.plot:
        from oomcast.bench.plot import plot_soak

        print(f"wrote {plot_soak(result, args.plot)}", file=sys.stderr)
    return 0


def _bench_cluster(args: argparse.Namespace) -> int:
    """``oomcast bench cluster``: 1, then N replicas draining a local Redis Cluster."""
    from oomcast.bench.cluster import ClusterBenchError, bench_cluster, parse_replicas

    try:
        result = bench_cluster(
            domains=args.domains,
            seconds=args.seconds,
            counts=parse_replicas(args.replicas or "1,2"),
            partitions=args.partitions,
        )
    except (ValueError, ClusterBenchError) as exc:
        raise UsageError(str(exc)) from None
    _print_figures(result, args.json)
    return 0


def _bench_faults(args: argparse.Namespace) -> int:
    """``oomcast bench faults``: exit 1 when any scenario lost something or acted wrongly."""
    import sys

    from oomcast.bench.faults import FaultBenchError, format_text, parse_only, run_faults

    try:
        names = parse_only(args.only)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if args.receiver_down_s <= 0:
        raise UsageError(f"--receiver-down-s {args.receiver_down_s:g}: must be positive")
    say = None if args.json else (lambda line: print(line, file=sys.stderr, flush=True))
    try:
        result = run_faults(names, receiver_down_s=args.receiver_down_s, progress=say)
    except FaultBenchError as exc:
        raise UsageError(str(exc)) from None
    if args.json:
        print(json.dumps(result))
    else:
        print("\n".join(format_text(result)))
    return 0 if result["ok"] else 1


def _bench_model(path: str | None) -> tuple[Path, str]:
    """The model to time and what its weights are: given, shipped, or (with neither) an
    untrained network of the same shape, exported by ``oomcast.training`` (speed does not
    depend on the weights; this needs torch)."""
    from oomcast.model.runtime import DEFAULT_MODEL

    if path:
        return Path(path), "given"
    if DEFAULT_MODEL.is_file():
        return DEFAULT_MODEL, "shipped"
    import atexit
    import shutil
    import tempfile

    import torch

    from oomcast.model.network import NetConfig, OOMForecastNet
    from oomcast.training.export import export
    from oomcast.training.train import ScoredRule, save_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="oomcast-bench-"))
    atexit.register(shutil.rmtree, tmp, True)
    torch.manual_seed(0)
    save_checkpoint(tmp / "c.pt", OOMForecastNet(NetConfig()), ScoredRule(60, 0.5, 0, 0, 0))
    return export(tmp / "c.pt", tmp / "bench.onnx", version="bench-untrained"), "untrained"


def cmd_demo(args: argparse.Namespace) -> int:
    from oomcast.bench.demo import run_demo

    return run_demo(
        redis_url=args.env.redis_url,
        duration_s=args.duration,
        # a live table only on a terminal: piped to a file or `tee`, lines as they come
        live=not args.plain and sys.stdout.isatty(),
        port=args.port,
        speed=args.speed,
        private_redis=args.private_redis,
    )


def add_parsers(sub: Any, env: CommandEnv) -> None:
    d = sub.add_parser("demo", help="the whole system on this machine, with a live view")
    d.add_argument(
        "--duration",
        type=float,
        default=None,
        help="stop after this many seconds (default: run until Ctrl-C)",
    )
    d.add_argument("--plain", action="store_true", help="print lines instead of a live table")
    d.add_argument("--port", type=int, default=0, help="service port (default: a free one)")
    d.add_argument("--speed", type=float, default=1.0, help="simulated jobs run this much faster")
    d.add_argument(
        "--private-redis",
        action="store_true",
        help="always start a private redis-server, even if one is configured or running",
    )
    d.set_defaults(func=cmd_demo, env=env)

    s = sub.add_parser("serve", help="run the service")
    s.add_argument("--host", default="127.0.0.1", help="address to listen on")
    s.add_argument("--port", type=int, default=8000, help="port to listen on")
    s.add_argument(
        "--workers",
        default=None,
        metavar="N|auto",
        help="worker processes, one per core to use; they share the partitions and a front"
        " process answers the API for all of them; auto: the cores this process may use"
        " (affinity and cgroup CPU limit), at most the partitions (default $OOMCAST_WORKERS,"
        " else 1; docs/scaling.md)",
    )
    s.add_argument("--uds", default=None, help="listen on this Unix socket instead of a port")
    s.set_defaults(func=cmd_serve)


def add_bench_parser(sub: Any) -> None:
    b = sub.add_parser("bench", help="measure a hot path")
    b.add_argument(
        "what",
        choices=["inference", "hook", "agent", "faults", "api", "ingest", "cluster"],
        help="inference: the forecaster per sample; hook: the in-process hook's step();"
        " agent: the node agent's CPU use; faults: the fault scenarios on real processes"
        " (docs/bench.md); api: GET /v1/devices over --domains live domains; ingest: one"
        " oomcast serve draining --domains GPUs' samples from a private Redis; cluster: 1, then"
        " --replicas oomcast serve replicas draining them from a local 3-primary Redis Cluster",
    )
    b.add_argument("--model", help="ONNX model (default: shipped, else an untrained one)")
    b.add_argument(
        "--seconds",
        type=float,
        default=None,
        help="per measurement (agent: total; default 2, ingest drain: 10 s of backlog)",
    )
    b.add_argument("--steps", type=int, default=20_000, help="hook: steps timed")
    b.add_argument("--requests", type=int, default=50, help="api: requests timed per query")
    b.add_argument(
        "--predict",
        action="store_true",
        help="api: time POST /v1/predict on a real oomcast serve for --seconds per concurrency",
    )
    b.add_argument(
        "--concurrency", default="1,16", help="api --predict: the client counts to measure, in turn"
    )
    b.add_argument("--window", type=int, default=600, help="api --predict: samples per request")
    b.add_argument("--hz", type=float, default=10.0, help="agent: sampling rate")
    b.add_argument("--domains", type=int, default=8, help="agent: memory cgroups watched")
    b.add_argument("--gpus", type=int, default=8, help="agent: fake-NVML GPUs watched")
    b.add_argument("--redis-url", default=None, help="hook, agent: default $OOMCAST_REDIS_URL")
    b.add_argument(
        "--only",
        default=None,
        metavar="NAME[,NAME]",
        help="faults: run these scenarios only (redis_restart, service_sigkill,"
        " receiver_down, replica_loss, forged_command, forged_sample, maxmemory,"
        " oversized_body)",
    )
    b.add_argument(
        "--receiver-down-s",
        type=float,
        default=60.0,
        help="faults: how long the webhook receiver is down",
    )
    b.add_argument(
        "--rate",
        type=float,
        default=None,
        help="ingest: write this many samples/s for --seconds and report latency (default: drain)",
    )
    b.add_argument("--soak", action="store_true", help="ingest: the rate mode, with RSS every 10 s")
    b.add_argument(
        "--shadow-model",
        default=None,
        metavar="PATH|BASELINE",
        help="ingest: the service also scores this model beside its own"
        " (OOMCAST_SHADOW_MODEL_PATH), to measure what a shadow costs",
    )
    b.add_argument("--plot", default=None, help="ingest --soak: write a PNG of RSS over time here")
    b.add_argument(
        "--partitions", type=int, default=4, help="ingest, cluster: sample-stream partitions"
    )
    b.add_argument(
        "--replicas",
        default=None,
        help="ingest: oomcast serve replicas sharing the partitions (default 1); cluster: the"
        " replica counts to measure, in turn (default 1,2)",
    )
    b.add_argument(
        "--workers",
        default=None,
        metavar="N|auto",
        help="ingest: worker processes of each oomcast serve (serve --workers; default auto:"
        " one per core this process may use, at most the partitions per replica)",
    )
    b.add_argument("--json", action="store_true", help="print one JSON object of figures")
    b.set_defaults(func=cmd_bench)
