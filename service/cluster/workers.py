"""``oomcast serve --workers N``: one service that uses N cores.

A replica's ingest loop is one Python process, so one replica uses one core. With
``--workers N`` the service is a small front process and N worker processes:

- each **worker** is a whole replica (``oomcast serve --uds ...``): its own ingest loop,
  live state, rules and deliveries, named ``<OOMCAST_CONSUMER_NAME>-w<i>``. The workers share
  the partitions as any replicas do: by leases, or, with ``OOMCAST_PARTITIONS_OWNED``, by a
  fixed, contiguous share of the partitions named there. Each domain is forecast by exactly
  one worker, and a worker that dies has its partitions taken over by the others while the
  front starts it again;
- the **front** listens on ``--host``/``--port`` and answers the API as one service. What
  does not depend on live state (``/v1/predict``, ``/v1/samples``, ``/v1/alerts``,
  ``/v1/rules``, the dashboard's files, ``/docs``) goes to one worker in turn. What does is
  asked of every worker and merged: ``/v1/devices`` (pages merged by their sort keys, so
  cursors walk the whole fleet), one domain (``/v1/devices/{node}/{device}``,
  ``/v1/admit``: the worker that holds it answers), ``/readyz`` (ready when every worker
  is) and ``/metrics`` (counters and histograms summed over the workers, gauges labelled
  ``worker``).

The front does no forecasting, so the workers have the cores to themselves. It talks to
them over Unix sockets in a private folder.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import itertools
import logging
import math
import os
import signal
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from oomcast.model.text import exposition
from oomcast.service.api.device_query import CURSORS_HEADER, BadCursor, decode_cursor
from oomcast.service.api.edge import EdgeMiddleware
from oomcast.service.settings import Settings, parse_partition_set

log = logging.getLogger("oomcast.service.cluster.workers")

WORKER_ENV = "OOMCAST_WORKER_INDEX"  # set in each worker's environment: its index
STOP_WAIT_S = 30.0  # a worker's own drain on SIGTERM, before it is killed
RESTART_MAX_S = 30.0  # a worker that keeps dying is started again at most this often
FORWARD_TIMEOUT_S = 30.0
# hop-by-hop headers, and those the front's own response sets
_DROP_REQUEST = {b"host", b"content-length", b"connection", b"transfer-encoding"}
_DROP_RESPONSE = {"content-length", "connection", "transfer-encoding", "content-encoding"}


class WorkersError(ValueError):
    """``--workers`` cannot be honoured as configured; the message says why."""


def available_cpus() -> int:
    """The cores this process may use: its CPU affinity, lowered by a cgroup CPU limit
    (``cpu.max`` in cgroup v2, ``cpu.cfs_quota_us`` in v1, as a container's limit sets)."""
    n = len(os.sched_getaffinity(0))
    quota = _cgroup_cpu_quota()
    return max(1, min(n, math.ceil(quota))) if quota is not None else n


def _cgroup_cpu_quota() -> float | None:
    with contextlib.suppress(OSError, ValueError):
        fields = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if fields and fields[0] != "max":
            return int(fields[0]) / int(fields[1])
        return None
    with contextlib.suppress(OSError, ValueError):
        base = Path("/sys/fs/cgroup/cpu,cpuacct")
        if not base.is_dir():
            base = Path("/sys/fs/cgroup/cpu")
        quota = int((base / "cpu.cfs_quota_us").read_text())
        period = int((base / "cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    return None


def parse_workers(text: str | int, cap: int) -> int:
    """``--workers`` / ``OOMCAST_WORKERS``: a count, or ``auto`` (the available cores, at
    most ``cap``, the partitions: a worker without one would read nothing)."""
    value = str(text).strip().lower()
    if value == "auto":
        return max(1, min(available_cpus(), cap))
    try:
        n = int(value)
    except ValueError:
        raise WorkersError(f"--workers {text!r}: a count (e.g. 2) or auto") from None
    if n < 1:
        raise WorkersError(f"--workers {n}: must be at least 1")
    return n


def worker_partitions(settings: Settings, workers: int) -> list[str | None]:
    """Each worker's ``OOMCAST_PARTITIONS_OWNED``: None for all (they lease), or, when the
    service owns a fixed set, a contiguous share of it each."""
    if workers < 1:
        raise WorkersError(f"--workers {workers}: must be at least 1")
    if settings.uses_leases():
        if workers > settings.partitions:
            raise WorkersError(
                f"--workers {workers}: more workers than partitions"
                f" (OOMCAST_PARTITIONS={settings.partitions}); the rest would have nothing to do"
            )
        return [None] * workers
    owned = parse_partition_set(settings.partitions_owned, settings.partitions)
    if workers > len(owned):
        raise WorkersError(
            f"--workers {workers}: more workers than partitions owned"
            f" (OOMCAST_PARTITIONS_OWNED={settings.partitions_owned!r} names {len(owned)})"
        )
    shares = [
        owned[i * len(owned) // workers : (i + 1) * len(owned) // workers] for i in range(workers)
    ]
    return [",".join(map(str, share)) for share in shares]


def _die_with_parent() -> None:  # pragma: no cover - runs in the child, before exec
    """The worker gets SIGTERM if the front dies, even by SIGKILL (Linux's PDEATHSIG)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Worker:
    index: int
    socket: Path
    env: dict[str, str]
    proc: asyncio.subprocess.Process | None = None
    started: float = 0.0
    restarts: int = 0
    client: httpx.AsyncClient = field(init=False)

    def __post_init__(self) -> None:
        self.client = httpx.AsyncClient(
            transport=httpx.AsyncHTTPTransport(uds=str(self.socket)),
            base_url="http://oomcast-worker",
            timeout=FORWARD_TIMEOUT_S,
        )

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None


class WorkerPool:
    """Starts the workers, starts again any that ends while the service runs, and stops
    them (SIGTERM, their drain, then SIGKILL) on the way out."""

    def __init__(self, settings: Settings, workers: int, log_level: str) -> None:
        shares = worker_partitions(settings, workers)
        self.settings = settings
        self.folder = Path(tempfile.mkdtemp(prefix="oomcast-workers-"))
        self.log_level = log_level
        self.workers = []
        for i, share in enumerate(shares):
            env = dict(os.environ, OOMCAST_CONSUMER_NAME=f"{settings.consumer_name}-w{i}")
            env["OOMCAST_WORKERS"] = "1"
            env[WORKER_ENV] = str(i)
            if share is not None:
                env["OOMCAST_PARTITIONS_OWNED"] = share
            self.workers.append(Worker(i, self.folder / f"w{i}.sock", env))
        self._stopping = False
        self._watch: list[asyncio.Task[None]] = []
        self._turn = itertools.cycle(range(len(self.workers)))

    def argv(self, w: Worker) -> list[str]:
        return [
            sys.executable, "-m", "oomcast.cli.main", "--log-level", self.log_level,
            "serve", "--uds", str(w.socket),
        ]  # fmt: skip

    async def _spawn(self, w: Worker) -> None:
        with contextlib.suppress(FileNotFoundError):
            w.socket.unlink()
        w.proc = await asyncio.create_subprocess_exec(
            *self.argv(w), env=w.env, preexec_fn=_die_with_parent
        )
        w.started = time.monotonic()
        log.info("worker %d started (pid %d)", w.index, w.proc.pid)

    async def _keep(self, w: Worker) -> None:
        """Wait on the worker; while the service runs, start it again when it ends."""
        backoff = 1.0  # doubled for each worker that dies within a minute of its start
        while not self._stopping:
            if w.proc is not None:
                rc = await w.proc.wait()
                if self._stopping:
                    return
                lived = time.monotonic() - w.started
                delay = 1.0 if lived > 60 else backoff
                log.error(
                    "worker %d (pid %d) ended with %s after %.0f s; starting it again in"
                    " %.0f s (its partitions go to the other workers meanwhile)",
                    w.index, w.proc.pid, rc, lived, delay,
                )  # fmt: skip
            else:
                delay = backoff
            backoff = min(RESTART_MAX_S, delay * 2)
            await asyncio.sleep(delay)
            if self._stopping:
                return
            w.restarts += 1
            try:
                await self._spawn(w)
            except OSError as exc:  # no process at all (out of PIDs or memory): try again
                w.proc = None
                log.error("worker %d could not be started (%s)", w.index, exc)

    async def start(self) -> None:
        for w in self.workers:
            await self._spawn(w)
        self._watch = [asyncio.create_task(self._keep(w)) for w in self.workers]

    async def stop(self) -> None:
        self._stopping = True
        for w in self.workers:
            if w.running():
                assert w.proc is not None
                with contextlib.suppress(ProcessLookupError):
                    w.proc.send_signal(signal.SIGTERM)
        for w in self.workers:
            if w.proc is None:
                continue
            try:
                await asyncio.wait_for(w.proc.wait(), STOP_WAIT_S)
            except TimeoutError:
                log.error("worker %d did not stop in %.0f s: killed", w.index, STOP_WAIT_S)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
                await w.proc.wait()
        for task in self._watch:
            task.cancel()
        for w in self.workers:
            await w.client.aclose()
        for w in self.workers:
            with contextlib.suppress(FileNotFoundError):
                w.socket.unlink()
        with contextlib.suppress(OSError):
            self.folder.rmdir()

    def next_worker(self) -> Worker:
        """The next running worker in turn (the next in turn at all if none runs)."""
        for _ in range(len(self.workers)):
            w = self.workers[next(self._turn)]
            if w.running():
                return w
        return self.workers[next(self._turn)]


# --- forwarding ----------------------------------------------------------------------


def _headers(request: Request, extra: dict[str, str] | None = None) -> list[tuple[bytes, bytes]]:
    out = [(k, v) for k, v in request.scope["headers"] if k.lower() not in _DROP_REQUEST]
    out += [(k.encode(), v.encode()) for k, v in (extra or {}).items()]
    return out


def _target(request: Request) -> str:
    """The path and query exactly as the client sent them (percent-escapes kept: a device
    name may hold a ``/`` or a ``%``)."""
    raw: bytes = request.scope.get("raw_path") or request.url.path.encode()
    query: bytes = request.scope.get("query_string") or b""
    return (raw + (b"?" + query if query else b"")).decode("latin-1")


@dataclass
class Answer:
    worker: int
    status: int
    headers: dict[str, str]
    body: bytes

    def response(self) -> Response:
        headers = {k: v for k, v in self.headers.items() if k not in _DROP_RESPONSE}
        return Response(self.body, status_code=self.status, headers=headers)


async def _ask(
    w: Worker, request: Request, body: bytes, extra: dict[str, str] | None = None
) -> Answer | str:
    """The worker's answer to the request, or why there is none."""
    if not w.running():
        return f"worker {w.index} is not running (it is being started again)"
    try:
        r = await w.client.request(
            request.method, _target(request), headers=_headers(request, extra), content=body
        )
    except httpx.HTTPError as exc:
        return f"worker {w.index} (pid {w.pid}) did not answer: {type(exc).__name__} {exc}"
    return Answer(w.index, r.status_code, dict(r.headers), r.content)


def _unavailable(problems: Iterable[str]) -> JSONResponse:
    return JSONResponse(
        {"detail": "; ".join(problems)}, status_code=503, headers={"Retry-After": "5"}
    )


async def _ask_all(
    pool: WorkerPool, request: Request, extra: dict[str, str] | None = None
) -> tuple[list[Answer], list[str]]:
    body = await request.body()
    got = await asyncio.gather(*(_ask(w, request, body, extra) for w in pool.workers))
    answers = [a for a in got if isinstance(a, Answer)]
    return answers, [a for a in got if isinstance(a, str)]


def merge_device_pages(bodies: Sequence[dict[str, Any]], limit: int) -> dict[str, Any]:
    """One /v1/devices page from the workers' pages for the same query: each worker gave
    its own best ``limit`` after the cursor, so the best ``limit`` of their union is the
    fleet's, and the last one's key is where the next page starts."""
    rows: list[tuple[Any, str, Any]] = []
    for body in bodies:
        cursors = body.get("cursors")
        if not isinstance(cursors, list) or len(cursors) != len(body["devices"]):
            raise BadCursor("a worker's page came without its cursors")
        rows += [(decode_cursor(c), c, d) for c, d in zip(cursors, body["devices"], strict=True)]
    rows.sort(key=lambda row: row[0])
    page = rows[:limit]
    more = len(rows) > limit or any(body.get("next") for body in bodies)
    matched = sum(int(body["matched"]) for body in bodies)
    return {
        "alert_horizon_s": bodies[0]["alert_horizon_s"],
        "total": sum(int(body["total"]) for body in bodies),
        "matched": matched,
        "count": matched,
        "next": page[-1][1] if more and page else None,
        "devices": [row[2] for row in page],
    }


async def list_devices(pool: WorkerPool, request: Request) -> Response:
    answers, problems = await _ask_all(pool, request, {CURSORS_HEADER: "1"})
    if problems:
        return _unavailable(problems)
    bad = [a for a in answers if a.status != 200]
    if bad:  # a refused query (422) is refused the same by every worker: pass one on
        return bad[0].response()
    limit = int(request.query_params.get("limit", "100"))
    merged = merge_device_pages([orjson.loads(a.body) for a in answers], limit)
    return Response(orjson.dumps(merged), media_type="application/json")


async def one_domain(pool: WorkerPool, request: Request) -> Response:
    """The answer of the worker that holds the domain; 404 when none does."""
    answers, problems = await _ask_all(pool, request)
    found = [a for a in answers if a.status != 404]
    if found:
        return min(found, key=lambda a: a.status).response()  # a 200 before any error
    if problems:
        return _unavailable(problems)
    return answers[0].response()


def _swap_problem(bodies: list[dict[str, Any]]) -> str | None:
    """A worker's reason for not following a model swap, or the workers' models differing
    (a swap asked of one worker, with no secret to seal it for the others)."""
    for b in bodies:
        if b.get("model_swap_problem"):
            return f"worker {b['worker']}: {b['model_swap_problem']}"
    versions = {str(b["model_version"]) for b in bodies if b.get("model_version")}
    if len(versions) > 1:
        return f"the workers run different models: {', '.join(sorted(versions))}"
    return None


async def readyz(pool: WorkerPool, request: Request) -> Response:
    answers, problems = await _ask_all(pool, request)
    bodies: list[dict[str, Any]] = []
    for a in answers:
        try:
            body = orjson.loads(a.body)
        except orjson.JSONDecodeError:
            body = {"status": "not ready", "problem": f"HTTP {a.status}"}
        body["worker"] = a.worker
        bodies.append(body)
        if a.status != 200:
            problems.append(f"worker {a.worker}: {body.get('problem') or 'not ready'}")
    checks: dict[str, bool] = {}
    for body in bodies:
        for name, ok in (body.get("checks") or {}).items():
            checks[name] = checks.get(name, True) and bool(ok)
    first = bodies[0] if bodies else {}
    out: dict[str, Any] = {
        "status": "not ready" if problems else "ready",
        "redis": all(b.get("redis") for b in bodies) and bool(bodies),
        "redis_writable": all(b.get("redis_writable") for b in bodies) and bool(bodies),
        "ingest": all(b.get("ingest") for b in bodies) and not problems,
        "checks": checks,
        "model_version": first.get("model_version"),
        "shadow_model_version": next(
            (b["shadow_model_version"] for b in bodies if "model_version" in b), None
        ),
        "model_swap_problem": _swap_problem(bodies),
        "forecaster": first.get("forecaster"),
        "partitions": sorted({p for b in bodies for p in b.get("partitions") or []}),
        "problem": problems[0] if problems else None,
        "deliveries": first.get("deliveries"),
        "workers": [
            {
                "worker": w.index,
                "pid": w.pid,
                "running": w.running(),
                "restarts": w.restarts,
                "ready": any(b["worker"] == w.index and b.get("status") == "ready" for b in bodies),
                "partitions": next(
                    (b.get("partitions") for b in bodies if b["worker"] == w.index), []
                ),
            }
            for w in pool.workers
        ],
    }
    return JSONResponse(out, status_code=503 if problems else 200)


def merge_metrics(texts: Sequence[tuple[int, str]], pool: WorkerPool | None = None) -> bytes:
    """The workers' Prometheus texts as one: counters, histograms and summaries summed
    sample by sample (``*_created`` kept at the earliest), gauges labelled ``worker``; and
    the front's own ``oomcast_workers`` and ``oomcast_worker_restarts_total``."""
    families: dict[str, Metric] = {}
    sums: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], float]] = {}
    for index, text in texts:
        for fam in text_string_to_metric_families(text):
            out = families.get(fam.name)
            if out is None:
                out = families[fam.name] = Metric(fam.name, fam.documentation, fam.type, fam.unit)
                sums[fam.name] = {}
            # The text format writes a counter's creation time as a gauge of its own,
            # ``<name>_created``: one per service, the earliest worker's.
            created = fam.name.endswith("_created")
            for s in fam.samples:
                if fam.type in ("gauge", "info", "stateset", "unknown") and not created:
                    out.add_sample(s.name, {**s.labels, "worker": str(index)}, s.value)
                    continue
                key = (s.name, tuple(sorted(s.labels.items())))
                acc = sums[fam.name]
                if key not in acc:
                    acc[key] = s.value
                elif created or s.name.endswith("_created"):
                    acc[key] = min(acc[key], s.value)
                else:
                    acc[key] += s.value
    for name, acc in sums.items():
        for (sample, labels), value in acc.items():
            families[name].add_sample(sample, dict(labels), value)
    if pool is not None:
        up = Metric("oomcast_workers", "Worker processes of this service, by state.", "gauge")
        running = sum(w.running() for w in pool.workers)
        up.add_sample("oomcast_workers", {"state": "running"}, running)
        up.add_sample("oomcast_workers", {"state": "down"}, len(pool.workers) - running)
        restarts = Metric(
            "oomcast_worker_restarts", "Workers started again after they ended.", "counter"
        )
        restarts.add_sample(
            "oomcast_worker_restarts_total", {}, sum(w.restarts for w in pool.workers)
        )
        families["oomcast_workers"] = up
        families["oomcast_worker_restarts"] = restarts
    return exposition(families.values())


async def metrics(pool: WorkerPool, request: Request) -> Response:
    answers, _ = await _ask_all(pool, request)  # a worker that is down has no figures to add
    texts = [(a.worker, a.body.decode()) for a in answers if a.status == 200]
    return Response(merge_metrics(texts, pool), media_type=CONTENT_TYPE_LATEST)


async def forward(pool: WorkerPool, request: Request) -> Response:
    """Anything that does not depend on live state: one worker, in turn; another if that
    one does not answer."""
    body = await request.body()
    problems = []
    for _ in range(len(pool.workers)):
        got = await _ask(pool.next_worker(), request, body)
        if isinstance(got, Answer):
            return got.response()
        problems.append(got)
    return _unavailable(problems)


async def swap_model(pool: WorkerPool, request: Request) -> Response:
    """``POST /v1/model``: to one worker, never sent twice (a promotion sent again would
    undo itself); the others follow its sealed swap record. Without a secret there is no
    record they could trust: refused rather than leave the workers on different models."""
    if len(pool.workers) > 1 and not (pool.settings.control_secret or pool.settings.webhook_secret):
        return JSONResponse(
            {
                "detail": "with --workers, model swaps need OOMCAST_CONTROL_SECRET or"
                " OOMCAST_WEBHOOK_SECRET: the other workers follow a swap only by its sealed"
                " record, and without one they would run another model"
            },
            status_code=409,
        )
    body = await request.body()
    problems = []
    for _ in range(len(pool.workers)):
        w = pool.next_worker()
        if not w.running():  # not sent: another may take it
            problems.append(f"worker {w.index} is not running")
            continue
        got = await _ask(w, request, body)
        if isinstance(got, Answer):
            return got.response()
        return _unavailable([got, "the swap may or may not have been made: see GET /v1/model"])
    return _unavailable(problems)


def forward_sighup(pool: WorkerPool) -> None:
    """SIGHUP to the front: to one running worker when the workers share a secret (the
    others follow its swap record), else to each."""
    running = [w for w in pool.workers if w.running() and w.proc is not None]
    shared = pool.settings.control_secret or pool.settings.webhook_secret
    for w in running[:1] if shared else running:
        assert w.proc is not None
        with contextlib.suppress(ProcessLookupError):
            w.proc.send_signal(signal.SIGHUP)
    log.info("SIGHUP passed to %s", "one worker" if shared else f"{len(running)} workers")


Handler = Callable[[WorkerPool, Request], Awaitable[Response]]


def _route(path: str, method: str) -> Handler:
    if path == "/readyz":
        return readyz
    if path == "/metrics":
        return metrics
    if path == "/v1/devices" and method == "GET":
        return list_devices
    if path.startswith("/v1/devices/") or (path == "/v1/admit" and method == "POST"):
        return one_domain
    if path == "/v1/model" and method == "POST":
        return swap_model
    return forward


def create_front(settings: Settings, pool: WorkerPool) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        await pool.start()
        loop = asyncio.get_running_loop()
        hup = False
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(signal.SIGHUP, forward_sighup, pool)  # not fatal here
            hup = True
        try:
            yield
        finally:
            if hup:
                loop.remove_signal_handler(signal.SIGHUP)
            await pool.stop()

    app = FastAPI(lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.get("/livez", include_in_schema=False)
    async def livez() -> dict[str, str]:
        return {"status": "ok"}

    @app.api_route(
        "/{path:path}",
        methods=["GET", "POST", "PUT", "PATCH", "DELETE", "HEAD", "OPTIONS"],
        include_in_schema=False,
    )
    async def everything(request: Request, path: str) -> Response:
        return await _route(request.url.path, request.method)(pool, request)

    # The same edge as a worker's: the token and the body limit before a body is read.
    token = settings.api_token.get_secret_value() if settings.api_token else None
    app.add_middleware(EdgeMiddleware, max_body_bytes=settings.max_body_bytes, api_token=token)
    return app


def run_front(settings: Settings, workers: int, host: str, port: int, log_level: str) -> None:
    import uvicorn

    pool = WorkerPool(settings, workers, log_level)
    uvicorn.run(create_front(settings, pool), host=host, port=port, log_level=log_level)
