"""From traces to training arrays: embeddings, per-horizon labels and what is known.

Every sample of a trace is embedded (the embedding's fits run in trace time), and the rows
the network ticks at (``tick_rows``: about one per second of trace time) become the
sequence, exactly as the runtime steps a live domain.

For a sample at ``ts`` of a domain that OOMs at ``T``, the time to OOM is ``T - ts`` and
the label at horizon ``h`` is ``T - ts <= h``. A domain that never OOMs is *censored* at
its end, whether the job exited normally (an ``exit`` event) or the recording stopped: a
job that ends while climbing has not shown that it was safe, only that it survived until
then. So its label at ``h`` is a known 0 only where the trace runs at least ``h`` past
``ts`` (``known_s``: seconds of known future per tick); the discrete-time survival loss
takes from it exactly the bins that end before its end.

Each sequence also carries what the scoring classes need: when its OOM came after the
domain's first sample, the highest level it reached (near misses come within 10% of the
limit), and how long it ran.
"""

from __future__ import annotations

import hashlib
import itertools
import multiprocessing as mp
import os
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import BinaryIO

import numpy as np

from oomcast.model import embedding as embedding_module
from oomcast.model import growth as growth_module
from oomcast.model.embedding import EMBEDDING_VERSION, EmbeddingState, level_frac, tick_rows
from oomcast.model.forecast import HORIZONS_S
from oomcast.model.trace import Trace, find_traces, load_trace, nvml_view

TICK_S = 1.0

H = np.asarray(HORIZONS_S, dtype=np.float64)


@dataclass
class Sequence:
    """One domain of one trace."""

    name: str
    x: np.ndarray  # (time, features) float32
    y: np.ndarray  # (time, horizons) float32: OOM within the horizon
    m: np.ndarray  # (time, horizons) float32: 1 where the label is known
    tto: np.ndarray  # (time,) float64: seconds to the OOM, inf when none follows
    ooms: bool
    group: str = ""  # the source it came from (training weighs and scores by it)
    known: np.ndarray | None = None  # (time,) seconds of known future; None: all of it
    oom_after_s: float | None = None  # the OOM, in seconds after the domain's first sample
    max_level: float = 0.0  # the highest level reached, as a fraction of capacity
    span_s: float = 0.0  # first sample to the end (the OOM, the exit or the last sample)

    def known_s(self) -> np.ndarray:
        return np.full(len(self.tto), np.inf) if self.known is None else self.known


def sequences_of(path: Path, view: str = "full") -> list[Sequence]:
    """The sequences of one trace. ``view="nvml"``: only its GPU domains, as NVML sees them
    (the model must forecast nodes that run the agent without the in-process hook too);
    ``view="1hz"``: the trace downsampled to one sample a second first (a 10 Hz recording
    seen as a 1 Hz source would see it)."""
    trace = load_trace(path)
    if view == "1hz":
        from oomcast.model.trace import downsample_trace

        trace = downsample_trace(trace, 1.0)
    return sequences_of_trace(trace, path.name, view)


def sequences_of_trace(trace: Trace, name: str, view: str = "full") -> list[Sequence]:
    out = []
    for domain, all_samples in trace.samples.items():
        if view == "nvml":
            if all_samples[0].kind != "gpu":
                continue
            all_samples = [nvml_view(s) for s in all_samples]
        oom_ts = trace.oom_ts(domain)
        exit_ts = trace.exit_ts(domain) if oom_ts is None else None
        # what follows the OOM (or the job's normal end) belongs to no forecast
        end = oom_ts if oom_ts is not None else exit_ts
        samples = [s for s in all_samples if end is None or s.ts <= end]
        if not samples:
            continue
        state = EmbeddingState()
        emb = [state.embed(s) for s in samples]
        rows = tick_rows([s.ts for s in samples], TICK_S)
        x = np.asarray([emb[i] for i in rows], dtype=np.float32)
        ts = np.asarray([samples[i].ts for i in rows], dtype=np.float64)
        first = samples[0].ts
        if oom_ts is not None:
            tto = oom_ts - ts
            known = np.full(len(ts), np.inf)
            last = oom_ts
        else:  # censored at its end, however it ended
            tto = np.full(len(ts), np.inf)
            last = exit_ts if exit_ts is not None else samples[-1].ts
            known = last - ts
        y, m = labels(tto, known)
        suffix = "" if view == "full" else f"~{view}"
        out.append(Sequence(
            f"{name}:{domain[1]}{suffix}", x, y, m, tto, oom_ts is not None, known=known,
            oom_after_s=None if oom_ts is None else oom_ts - first,
            max_level=max(level_frac(s) for s in samples), span_s=last - first,
        ))  # fmt: skip
    return out


def labels(tto: np.ndarray, known: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per tick and horizon: (OOM within it, whether that is known) as float32 arrays."""
    y = tto[:, None] <= H[None, :]
    m = y | (known[:, None] >= H[None, :])
    return y.astype(np.float32), m.astype(np.float32)


def load_folder(
    folder: Path | str,
    cache_dir: Path | str | None = None,
    workers: int | None = None,
    view: str = "full",
) -> list[Sequence]:
    """Every sequence of every trace below ``folder``, cached as one .npz per folder."""
    paths = find_traces(folder)
    if not paths:
        raise FileNotFoundError(f"no traces in {folder}")
    return load_paths(paths, cache_dir, workers, view)


def host_split(folder: Path | str) -> tuple[list[Path], list[Path]]:
    """The recorded host traces split in two by their run's seed: even seeds train, odd seeds
    are held out, so every workload has runs on both sides. Files are named
    ``NNN-<workload>.jsonl.gz`` and the manifest gives each run's seed."""
    import json

    folder = Path(folder)
    runs = json.loads((folder / "manifest.json").read_text())["runs"]
    train = [folder / r["file"] for r in runs if r["seed"] % 2 == 0]
    test = [folder / r["file"] for r in runs if r["seed"] % 2 == 1]
    return train, test


def load_paths(
    paths: list[Path],
    cache_dir: Path | str | None = None,
    workers: int | None = None,
    view: str = "full",
) -> list[Sequence]:
    """Every sequence of the given traces, cached as one .npz per set of files."""
    if not paths:
        raise FileNotFoundError("no traces given")
    key = hashlib.sha1(
        "|".join(f"{p}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in paths).encode()
        + f"v{EMBEDDING_VERSION}:{view}".encode()
        # the embedding's own code: a changed feature must never be read from an old cache
        + hashlib.sha1(Path(embedding_module.__file__).read_bytes()).digest()
        + hashlib.sha1(Path(growth_module.__file__).read_bytes()).digest()
        + hashlib.sha1(Path(__file__).read_bytes()).digest()  # and the labelling
    ).hexdigest()[:16]
    cache = Path(cache_dir) / f"seq-{key}.npz" if cache_dir else None
    if cache is not None and cache.exists():
        return _from_npz(cache)
    workers = workers or min(4, os.cpu_count() or 1)
    if workers > 1 and len(paths) > 8:
        with mp.get_context("fork").Pool(workers) as pool:
            nested = pool.map(partial(sequences_of, view=view), paths, chunksize=16)
    else:
        nested = [sequences_of(p, view) for p in paths]
    seqs = [s for group in nested for s in group]
    if not seqs:
        raise FileNotFoundError(f"the traces {paths[0]} ... hold no samples")
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        _to_npz(cache, seqs)
    return seqs


def _to_npz(path: Path, seqs: list[Sequence]) -> None:
    """Written beside and renamed into place: two trainings (or a training and an
    evaluation) filling the same cache at once never leave a torn file for the next."""
    lengths = np.asarray([len(s.x) for s in seqs])
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with tmp.open("wb") as out:
        _savez(out, seqs, lengths)
    os.replace(tmp, path)


def _savez(out: BinaryIO, seqs: list[Sequence], lengths: np.ndarray) -> None:
    np.savez_compressed(
        out,
        names=np.asarray([s.name for s in seqs]),
        lengths=lengths,
        ooms=np.asarray([s.ooms for s in seqs]),
        x=np.concatenate([s.x for s in seqs]),
        y=np.concatenate([s.y for s in seqs]),
        m=np.concatenate([s.m for s in seqs]),
        tto=np.concatenate([s.tto for s in seqs]),
        known=np.concatenate([s.known_s() for s in seqs]),
        oom_after_s=np.asarray([np.nan if s.oom_after_s is None else s.oom_after_s for s in seqs]),
        max_level=np.asarray([s.max_level for s in seqs]),
        span_s=np.asarray([s.span_s for s in seqs]),
    )


def _from_npz(path: Path) -> list[Sequence]:
    with np.load(path) as z:  # each z[key] decompresses anew: read every array once
        names, lengths, ooms = z["names"], z["lengths"], z["ooms"]
        x, y, m, tto, known = z["x"], z["y"], z["m"], z["tto"], z["known"]
        after, top, span = z["oom_after_s"], z["max_level"], z["span_s"]
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return [
        Sequence(str(names[i]), x[a:b], y[a:b], m[a:b], tto[a:b], bool(ooms[i]), known=known[a:b],
                 oom_after_s=None if np.isnan(after[i]) else float(after[i]),
                 max_level=float(top[i]), span_s=float(span[i]))
        for i, (a, b) in enumerate(itertools.pairwise(bounds))
    ]  # fmt: skip


def normalization(seqs: list[Sequence]) -> tuple[np.ndarray, np.ndarray]:
    x = np.concatenate([s.x for s in seqs])
    return x.mean(axis=0), x.std(axis=0)


def sample_windows(
    seqs: list[Sequence],
    n: int,
    length: int,
    rng: np.random.Generator,
    focus: float = 0.5,
    weights: np.ndarray | None = None,
    hard: list[tuple[int, int]] | None = None,
    hard_share: float = 0.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``n`` windows of ``length`` samples (zero-padded, masked). A share ``focus`` ends in
    the last five minutes before an OOM, so the rare moments that matter are not drowned
    by hours of calm; a share ``hard_share`` ends at one of the ``hard`` (sequence, sample)
    moments (where the model last raised a false alarm); the rest are drawn uniformly over
    all samples, each sequence's samples weighted by ``weights``. A window that does not
    start at its trace's beginning masks its first steps, while the LSTM warms up."""
    n_feat = seqs[0].x.shape[1]
    n_h = seqs[0].y.shape[1]
    xs = np.zeros((n, length, n_feat), np.float32)
    ys = np.zeros((n, length, n_h), np.float32)
    ms = np.zeros((n, length, n_h), np.float32)
    w = np.ones(len(seqs)) if weights is None else np.asarray(weights, dtype=np.float64)
    lengths = np.asarray([len(s.x) for s in seqs], dtype=np.float64) * w
    p_any = lengths / lengths.sum()
    oom_idx = np.asarray([i for i, s in enumerate(seqs) if s.ooms and w[i] > 0], dtype=np.intp)
    p_oom = w[oom_idx] / w[oom_idx].sum() if len(oom_idx) else None
    for k in range(n):
        u = rng.random()
        if len(oom_idx) and u < focus:
            s = seqs[oom_idx[rng.choice(len(oom_idx), p=p_oom)]]
            near = np.flatnonzero(s.tto <= 300.0)
            end = int(near[rng.integers(len(near))]) + 1 if len(near) else len(s.x)
        elif hard and u < focus + hard_share:
            i, at = hard[rng.integers(len(hard))]
            s = seqs[i]
            end = min(len(s.x), at + 1 + int(rng.integers(0, 8)))
        else:
            s = seqs[rng.choice(len(seqs), p=p_any)]
            end = int(rng.integers(1, len(s.x) + 1))
        start = max(0, end - length)
        if start > 0 and rng.random() < 0.5:
            start = 0 if end <= 4 * length else start  # some windows see the job's beginning
            end = min(end, start + length)
        seg = slice(start, end)
        t = end - start
        xs[k, :t] = s.x[seg]
        ys[k, :t] = s.y[seg]
        ms[k, :t] = s.m[seg]
        if start > 0:
            ms[k, : min(t, 16)] = 0.0  # warm-up
    return xs, ys, ms, np.zeros(n)
