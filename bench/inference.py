"""``oomcast bench inference``: the cost of streaming forecasts, measured, not asserted.

Steps N domains at once through the ONNX forecaster, on one core, with the embeddings the
nodes computed (the service's hot path) and, for comparison, with the embeddings computed
in the service; then times the stateless window forecast of ``POST /v1/predict``.
"""

from __future__ import annotations

import os
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from oomcast.model.embedding import EmbeddingState
from oomcast.model.runtime import DEFAULT_MODEL, OnnxForecaster
from oomcast.model.schema import Sample

GIB = 1 << 30


def _samples(n: int, t: int) -> list[Sample]:
    return [
        Sample(
            ts=1_700_000_000.0 + t,
            node=f"n{i // 8}",
            device=f"gpu{i % 8}",
            kind="gpu",
            total_bytes=80 * GIB,
            used_bytes=int((0.5 + 0.001 * t) * 80 * GIB),
            allocated_bytes=int(0.4 * 80 * GIB),
            reserved_bytes=int(0.45 * 80 * GIB),
            peak_bytes=int(0.52 * 80 * GIB),
            alloc_retries=0,
            job="bench",
        )
        for i in range(n)
    ]


def bench_inference(
    model: str | Path | None = None,
    seconds: float = 2.0,
    sizes: tuple[int, ...] = (1, 100, 5000),
    window_runs: int = 100,
    weights: str | None = None,
) -> dict[str, Any]:
    """Time the forecaster ``model`` (default: the shipped one; ``oomcast bench`` exports an
    untrained one when none is shipped); ``weights`` says which it is, for the report."""
    cores = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    if cores:
        os.sched_setaffinity(0, {min(cores)})  # one core
    try:
        path = Path(model) if model else DEFAULT_MODEL
        kind = weights or ("given" if model else "shipped")
        return _bench(path, kind, seconds, sizes, window_runs)
    finally:
        if cores:
            os.sched_setaffinity(0, cores)


def _bench(
    path: Path, weights: str, seconds: float, sizes: tuple[int, ...], window_runs: int
) -> dict[str, Any]:
    fc = OnnxForecaster(path, providers=["CPUExecutionProvider"], threads=1)
    out: dict[str, Any] = {
        "model": str(path),
        "weights": weights,
        "provider": fc.provider,
        "cores": 1,
    }
    for n in sizes:
        states = [fc.init_state() for _ in range(n)]
        steps = [_samples(n, t) for t in range(4)]
        embs: list[list[list[float] | None]] = []
        for batch in steps:
            e = [EmbeddingState() for _ in range(n)]
            embs.append([e[i].embed(s) for i, s in enumerate(batch)])
        for node_side in (True, False):
            done, t0 = 0, time.perf_counter()
            while time.perf_counter() - t0 < seconds:
                k = done % len(steps)
                fc.step(states, steps[k], embs[k] if node_side else None)
                done += 1
            per = (time.perf_counter() - t0) / (done * n) * 1e6
            key = f"us_per_sample_{n}" + ("" if node_side else "_embedded_in_service")
            out[key] = round(per, 3)
        # the ONNX call alone, for the share the rest of the path takes
        x = np.asarray(embs[0], dtype=np.float32)[:, None, : fc.n_features]
        h = np.zeros((fc.layers, n, fc.hidden), np.float32)
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds / 2:
            fc.session.run(None, {"x": x, "h": h, "c": h})
            done += 1
        out[f"onnx_only_us_per_sample_{n}"] = round(
            (time.perf_counter() - t0) / (done * n) * 1e6, 3
        )
        for st in states:
            fc.release(st)
        out.update(_service_path(fc, n, seconds))
    # POST /v1/predict: a 300-sample window, embedded and run in one call from a zero state;
    # and the same window stepped sample by sample, for comparison
    window = [_samples(1, t)[0] for t in range(300)]
    out["window_samples"] = len(window)
    for name, run in (
        ("window", lambda: fc.window(window)),
        ("window_last", lambda: fc.window_last(window)),
        ("window_stepped", lambda: _stepped(fc, window)),
    ):
        lat = []
        for _ in range(window_runs):
            t0 = time.perf_counter()
            run()
            lat.append((time.perf_counter() - t0) * 1000)
        lat.sort()
        out[f"{name}_p50_ms"] = round(statistics.median(lat), 3)
        out[f"{name}_p99_ms"] = round(lat[int(0.99 * (len(lat) - 1))], 3)
    return out


def _stepped(fc: OnnxForecaster, window: list[Sample]) -> None:
    st = fc.init_state()
    for s in window:
        fc.step([st], [s])
    fc.release(st)


def _service_path(fc: OnnxForecaster, n: int, seconds: float) -> dict[str, float]:
    """Microseconds per sample through ``LiveState.apply``, as ingest calls it: n domains a
    round, each with the float32 embedding row its node sent (decoded from ``emb_f32``),
    the default rules run on every forecast, the history ring written. Each round is timed
    on its own, its samples made beforehand (not timed); the figure is the median round, so
    that another process taking the core for a moment (this machine is shared) does not
    move it, and the mean is given beside it."""
    from oomcast.service.pipeline.rulefile import DEFAULT_RULES, load_rules
    from oomcast.service.pipeline.rules import RESOLVE_AFTER_S, AlertPolicy
    from oomcast.service.pipeline.state import LiveState, tune_gc

    tune_gc()  # as oomcast serve does
    policy = AlertPolicy(
        fc.rule.horizon_s, fc.rule.fire_risk, fc.rule.fire_risk / 2, resolve_after_s=RESOLVE_AFTER_S
    )
    live = LiveState(fc, load_rules(DEFAULT_RULES, policy), horizon_s=policy.horizon_s)
    rounds: list[tuple[list[Sample], list[np.ndarray]]] = []
    emb = [EmbeddingState() for _ in range(n)]
    for t in range(8):
        batch = _samples(n, t)
        rows = [np.asarray(emb[i].embed(s), dtype="<f4") for i, s in enumerate(batch)]
        rounds.append((batch, rows))
    signed = [True] * n
    per_round: list[float] = []
    done, t_end = 0, time.perf_counter() + seconds
    while time.perf_counter() < t_end or done < 2 * len(rounds):
        batch, rows = rounds[done % len(rounds)]
        shift = 8.0 * (done // len(rounds))  # every round later than the last one
        later = [replace(s, ts=s.ts + shift) for s in batch]
        t0 = time.perf_counter()
        live.apply(later, 0.0, rows, signed)
        per_round.append((time.perf_counter() - t0) / n * 1e6)
        done += 1
    timed = per_round[len(rounds) :]  # the first pass makes every domain's state: not timed
    return {
        f"service_path_us_per_sample_{n}": round(statistics.median(timed), 3),
        f"service_path_us_per_sample_{n}_mean": round(statistics.fmean(timed), 3),
        f"service_path_rounds_{n}": len(timed),
    }
