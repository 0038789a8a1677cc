"""``oomcast collect``: a node agent. Sources, the Redis publisher, ``/metrics``, and the
control listener that carries out the service's signed commands; and ``oomcast
control-key``, which prints a node's key.

The agent's key is ``OOMCAST_NODE_KEY`` (or the file ``OOMCAST_NODE_KEY_FILE`` names), its
node's own (``oomcast control-key --node NAME`` prints it from the master
``OOMCAST_CONTROL_SECRET``). With it the agent attests its
samples and takes the service's commands; an agent given the master secret instead derives
its key from it, and warns: a node should hold only its own key."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import Any

from oomcast.cli.common import PROG, UsageError, keys_from_env, stop_on_signals
from oomcast.cli.env import CommandEnv
from oomcast.model.wire import redact_url, redis_url_from_env


def _default_cgroup_root() -> str:
    """/sys/fs/cgroup/memory on a cgroup v1 node, else /sys/fs/cgroup (v2)."""
    v1 = Path("/sys/fs/cgroup/memory")
    return str(v1) if (v1 / "memory.usage_in_bytes").exists() else "/sys/fs/cgroup"


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
            sources.append(ReplaySource(args.trace, speed=args.speed, keep_ts=args.keep_ts))
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


DEFAULT_METRICS_PORT = 9101


def cmd_collect(args: argparse.Namespace) -> int:
    from oomcast.collectors.agent import NodeAgent
    from oomcast.collectors.publisher import StreamPublisher
    from oomcast.collectors.redis_connect import connect

    env: CommandEnv = args.env
    if not 0 <= args.confirm_tolerance <= 100:
        raise UsageError(
            f"--confirm-tolerance {args.confirm_tolerance:g}: must be 0 to 100 percentage points"
        )
    sources = _build_sources(args)
    url = args.redis_url or redis_url_from_env()
    try:  # OOMCAST_REDIS_CLUSTER: the URL names one node of a Redis Cluster
        client = connect(url, cluster=env.redis_cluster, connect_timeout_s=0.5, timeout_s=2.0)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    publisher = StreamPublisher(
        client,
        maxlen=env.stream_maxlen,
        buffer_samples=args.buffer_samples,
    )
    # The agent ticks at the shortest source interval; each source says when it is due. A
    # replay checks its clock more often than it samples, to keep the trace's own spacing.
    intervals = [float(getattr(s, "interval_s", args.interval)) for s in sources]
    if "replay" in _parse_sources(args.source):
        intervals.append(0.05)
    key = agent_key(env, args.node)
    agent = NodeAgent(
        sources,
        publisher,
        keys_from_env(),
        interval_s=min(intervals),
        node=args.node,
        node_key=key,
    )
    listener = _control_listener(args, client, agent, key)
    extra = [listener] if listener is not None else []
    http = None
    explicit = args.metrics_port is not None or env.agent_metrics_port is not None
    port = args.metrics_port if args.metrics_port is not None else env.agent_metrics_port
    port = DEFAULT_METRICS_PORT if port is None else port
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
    stop = stop_on_signals()
    logging.getLogger(PROG).info(
        "collecting from %s into %s%s",
        args.source,
        redact_url(url),
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


def read_key_file(path: str) -> str | None:
    """The key in ``path`` (surrounding whitespace dropped); None when there is no such file
    (a node not provisioned yet: the agent runs without a key, and says so). UsageError for
    a file that cannot be read or holds no key."""
    log = logging.getLogger(PROG)
    p = Path(path)
    if not p.exists():
        log.warning(
            "OOMCAST_NODE_KEY_FILE=%s: no such file (this node's key was not provisioned):"
            " samples go unattested and no command is taken",
            path,
        )
        return None
    try:
        key = p.read_text(encoding="utf-8").strip()
        mode = p.stat().st_mode
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"OOMCAST_NODE_KEY_FILE={path}: cannot read the key ({exc})") from None
    if not key:
        raise UsageError(f"OOMCAST_NODE_KEY_FILE={path}: the file is empty, no key in it")
    if mode & 0o077:
        log.warning(
            "OOMCAST_NODE_KEY_FILE=%s is readable by others (mode %o): chmod 0400 it",
            path,
            mode & 0o777,
        )
    return key


def agent_key(env: CommandEnv, node: str) -> str | None:
    """This agent's key: ``OOMCAST_NODE_KEY``, else the one in ``OOMCAST_NODE_KEY_FILE``,
    else derived from the master ``OOMCAST_CONTROL_SECRET`` (with a warning), else None (no
    attestation, no commands)."""
    from oomcast.model.control import node_key

    log = logging.getLogger(PROG)
    own = env.node_key.get_secret_value() if env.node_key else None
    if not own and env.node_key_file:
        own = read_key_file(env.node_key_file)
    master = env.control_secret.get_secret_value() if env.control_secret else None
    if own:
        if master:
            log.warning(
                "both OOMCAST_NODE_KEY and OOMCAST_CONTROL_SECRET are set: using the node key;"
                " remove the master secret from this node (it signs for every node)"
            )
        return own
    if master:
        log.warning(
            "OOMCAST_CONTROL_SECRET (the master key) is set on node %s: deriving the node's key"
            " from it. A node should hold only its own key: set OOMCAST_NODE_KEY to the output"
            " of `oomcast control-key --node %s` and remove OOMCAST_CONTROL_SECRET here",
            node,
            node,
        )
        return node_key(master, node)
    log.info("no OOMCAST_NODE_KEY: this agent's samples are not attested and it takes no commands")
    return None


def _control_listener(args: argparse.Namespace, client: Any, agent: Any, key: str | None) -> Any:
    """The agent's side of the control path, when it has a key: signed commands from the
    service are verified, proven against the agent's own reading of the domain when live,
    then carried out (checkpoint, shed)."""
    if not key:
        return None
    from oomcast.collectors.actions import CheckpointAction, Executor, ShedAction
    from oomcast.collectors.control import ControlListener, make_resolve
    from oomcast.collectors.procinfo import ProcResolver
    from oomcast.collectors.proof import make_measure

    def source(name: str) -> Any:
        return next((s for s in agent.sources if getattr(s, "name", "") == name), None)

    nvml, cgroups = source("nvml"), source("cgroup")
    uids = {int(u) for u in args.shed_uids.split(",") if u.strip()} if args.shed_uids else None
    shed = ShedAction(
        grace_s=args.shed_grace,
        allowed_uids=uids,
        cgroup_scope=args.shed_cgroup_scope,
        proc_root=args.proc_root,
    )
    executors: dict[str, Executor] = {
        "checkpoint": CheckpointAction(client, agent.keys, ack_timeout_s=args.checkpoint_timeout),
        "shed": shed,
    }
    cgroup_root = cgroups.root if cgroups is not None else None
    resolve = make_resolve(
        nvml=nvml,
        cgroup_root=cgroup_root,
        procs=ProcResolver(args.proc_root, priorities=_priorities(args.priority)),
        proc_root=args.proc_root,
    )
    measure = make_measure(nvml=nvml, cgroup_root=cgroup_root, sim=source("sim"))
    return ControlListener(
        client,
        agent.keys,
        args.node,
        key,
        executors,
        resolve,
        measure=measure,
        confirm_tolerance=args.confirm_tolerance / 100.0,
    )


def cmd_control_key(args: argparse.Namespace) -> int:
    """Print the key of ``--node``, derived from the master secret in OOMCAST_CONTROL_SECRET."""
    from oomcast.model.control import node_key

    env: CommandEnv = args.env
    master = env.control_secret.get_secret_value() if env.control_secret else None
    if not master:
        raise UsageError(
            "OOMCAST_CONTROL_SECRET is not set: node keys are derived from the master secret"
            " the service holds; run this where that secret is"
        )
    if not args.node.strip():
        raise UsageError("--node must be a non-empty node name")
    print(node_key(master, args.node))
    return 0


def add_control_key_parser(sub: Any, env: CommandEnv) -> None:
    k = sub.add_parser(
        "control-key",
        help="print a node's key (for its agent's OOMCAST_NODE_KEY)",
        description="Print the key of one node, derived from the master secret in"
        " OOMCAST_CONTROL_SECRET. Give it to that node's agent as OOMCAST_NODE_KEY: it"
        " verifies the service's commands to that node and attests the node's samples, and"
        " is worth nothing on any other node.",
    )
    k.add_argument("--node", required=True, help="the node's name, as its agent's --node")
    k.set_defaults(func=cmd_control_key, env=env)


def add_parser(sub: Any, env: CommandEnv) -> None:
    c = sub.add_parser(
        "collect",
        help="run a node agent",
        description="Sample memory domains and stream them to Redis. Several sources may run"
        " at once: --source nvml,cgroup",
    )
    c.add_argument("--source", required=True, help="comma-separated: nvml, cgroup, sim, replay")
    c.add_argument("--trace", help="trace file to replay (.jsonl or .jsonl.gz)")
    c.add_argument("--speed", type=float, default=1.0, help="replay or simulate this much faster")
    c.add_argument(
        "--keep-ts",
        action="store_true",
        help="replay with the trace's own timestamps (the service must then run with"
        " OOMCAST_MAX_TS_SKEW_S=0); by default the first record is stamped with the time the"
        " replay starts, the spacing kept",
    )
    c.add_argument("--interval", type=float, default=1.0, help="sim sampling interval, seconds")
    c.add_argument("--nvml-interval", type=float, default=1.0, help="seconds between NVML samples")
    c.add_argument(
        "--cgroup-interval", type=float, default=1.0, help="seconds between cgroup samples"
    )
    c.add_argument(
        "--cgroup-root",
        default=env.cgroup_root or _default_cgroup_root(),
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
        default=env.proc_root,
        help="/proc of the processes using the GPUs (map pids to pods)",
    )
    c.add_argument(
        "--priority",
        action="append",
        metavar="GLOB=INT",
        help="priority of jobs (or process names) matching GLOB, where a process does not"
        " set OOMCAST_PRIORITY itself (repeatable; default 0)",
    )
    c.add_argument(
        "--node",
        default=env.node or os.uname().nodename,
        help="this node's name in every sample ($OOMCAST_NODE, else the hostname)",
    )
    c.add_argument("--gpus", type=int, default=4, help="simulated GPUs")
    c.add_argument(
        "--patterns",
        default="leak,sawtooth,step_growth,spiky",
        help="simulated patterns, cycled over the GPUs",
    )
    c.add_argument("--seed", type=int, default=0, help="sim: random seed of the patterns")
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
        "--confirm-tolerance",
        type=float,
        default=env.confirm_tolerance_pp,
        metavar="POINTS",
        help="before a live action the agent measures the domain itself; it refuses the"
        " command unless the used fraction it reads is at least the claimed one less this"
        " many percentage points (default $OOMCAST_CONFIRM_TOLERANCE_PP or 5)",
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
    c.set_defaults(func=cmd_collect, env=env)
