"""training/dataset.py: tick rows, labels, masks, views, the host split, caching and window
sampling."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from support import leak_trace, steady_trace, write

from oomcast.model.embedding import FEATURES, N_FEATURES, EmbeddingState, tick_rows
from oomcast.model.forecast import HORIZONS_S
from oomcast.model.schema import Event, Sample
from oomcast.model.trace import load_trace
from oomcast.training.dataset import (
    TICK_S,
    host_split,
    load_folder,
    load_paths,
    sample_windows,
    sequences_of,
    sequences_of_trace,
)

HOST = Path(__file__).resolve().parents[2] / "training" / "traces" / "host"


def test_oom_labels_say_whether_the_oom_falls_within_each_horizon(tmp_path: Path) -> None:
    path = write(tmp_path / "leak.jsonl", leak_trace(seconds_to_oom=200, interval_s=1.0))
    (seq,) = sequences_of(path)
    assert seq.ooms and seq.x.shape == (200, N_FEATURES)
    assert seq.tto[0] == pytest.approx(200) and seq.tto[-1] == pytest.approx(1)
    for k, h in enumerate(HORIZONS_S):
        assert np.array_equal(seq.y[:, k] == 1, seq.tto <= h)
    assert seq.m.all()  # the OOM tells every horizon's answer


def test_a_10_hz_trace_keeps_only_the_tick_rows_embedded_from_every_sample(
    tmp_path: Path,
) -> None:
    records = leak_trace(seconds_to_oom=120, interval_s=0.1)
    path = write(tmp_path / "fast.jsonl", records)
    (seq,) = sequences_of(path)
    samples = [r for r in records if isinstance(r, Sample)]
    rows = tick_rows([s.ts for s in samples], TICK_S)
    assert TICK_S == 1.0 and len(rows) < len(samples) / 9  # about one row a second
    assert seq.x.shape == (len(rows), N_FEATURES) and 115 <= len(rows) <= 125
    # each row is the embedding of its tick sample with the whole 10 Hz history behind it
    state = EmbeddingState()
    every = [state.embed(s) for s in samples]
    assert np.array_equal(seq.x, np.asarray([every[i] for i in rows], dtype=np.float32))
    dt = seq.x[1:, FEATURES.index("log1p_dt_s")]
    assert np.allclose(dt, np.log1p(0.1), atol=1e-4)  # the sample interval, not the tick's
    # labels and times to OOM are those of the tick samples
    oom = records[-1].ts
    assert np.allclose(seq.tto, [oom - samples[i].ts for i in rows])
    for k, h in enumerate(HORIZONS_S):
        assert np.array_equal(seq.y[:, k] == 1, seq.tto <= h)


def test_sequences_of_trace_takes_a_trace_in_memory_and_names_it(tmp_path: Path) -> None:
    path = write(tmp_path / "t.jsonl", leak_trace(seconds_to_oom=90, device="gpu3"))
    from_file = sequences_of(path)
    (seq,) = sequences_of_trace(load_trace(path), "in-memory")
    assert seq.name == "in-memory:gpu3" and from_file[0].name == "t.jsonl:gpu3"
    assert np.array_equal(seq.x, from_file[0].x) and np.array_equal(seq.y, from_file[0].y)
    assert seq.group == "" and seq.ooms
    (nvml,) = sequences_of_trace(load_trace(path), "in-memory", view="nvml")
    assert nvml.name == "in-memory:gpu3~nvml"


def test_the_1hz_view_sees_a_10_hz_trace_as_a_1_hz_source_would(tmp_path: Path) -> None:
    records = leak_trace(seconds_to_oom=120, interval_s=0.1)
    # one spike between whole seconds: the downsampled view must keep it as a peak
    spike_at = 605
    spiked = records[spike_at]
    assert isinstance(spiked, Sample)
    records[spike_at] = replace(spiked, used_bytes=spiked.total_bytes - 1)
    path = write(tmp_path / "fast.jsonl", records)
    (full,) = sequences_of(path)
    (slow,) = sequences_of(path, view="1hz")
    assert slow.name == "fast.jsonl:gpu0~1hz" and slow.ooms
    assert abs(len(slow.x) - len(full.x)) <= 2  # both tick about once a second
    dt = slow.x[1:, FEATURES.index("log1p_dt_s")]
    assert np.allclose(dt, np.log1p(1.0), atol=1e-3)  # samples a second apart
    assert slow.m.all()
    for k, h in enumerate(HORIZONS_S):
        assert np.array_equal(slow.y[:, k] == 1, slow.tto <= h)
    peak = FEATURES.index("peak_frac")
    assert slow.x[:, peak].max() > 0.999  # the spike survived as the next kept peak
    assert not np.array_equal(slow.x, full.x[: len(slow.x)])


def test_safe_traces_mask_the_horizons_that_run_past_the_end(tmp_path: Path) -> None:
    path = write(tmp_path / "ok.jsonl", steady_trace(seconds=400, interval_s=1.0))
    (seq,) = sequences_of(path)
    assert not seq.ooms and not seq.y.any() and np.isinf(seq.tto).all()
    last = len(seq.x) - 1
    for k, h in enumerate(HORIZONS_S):
        known = np.flatnonzero(seq.m[:, k])
        assert known.max() == last - h  # the last h seconds could still end in an OOM


def test_a_normal_exit_is_censored_like_a_trace_that_stops(tmp_path: Path) -> None:
    """A job that exits normally has shown it survived until then, nothing more: the long
    horizons of its last minutes are unknown, exactly as where the recording stopped."""
    records = steady_trace(seconds=400, interval_s=1.0)
    last = records[-1]
    plain = write(tmp_path / "plain.jsonl", records)
    ended = write(
        tmp_path / "ended.jsonl",
        [
            *records,
            Event(ts=last.ts, node=last.node, device=last.device, event="exit", job="j"),
        ],
    )
    (a,) = sequences_of(plain)
    (b,) = sequences_of(ended)
    assert not a.m.all()  # the plain trace's end masks the long horizons
    assert np.array_equal(a.m, b.m) and not b.y.any() and not b.ooms
    assert np.array_equal(a.x, b.x)
    assert np.array_equal(b.known_s(), b.known_s()[0] - np.arange(len(b.x)))
    assert b.oom_after_s is None and b.span_s == pytest.approx(399.0)


def test_load_folder_caches_and_gives_back_the_same_arrays(tmp_path: Path) -> None:
    folder = tmp_path / "traces"
    write(folder / "a.jsonl", leak_trace(seconds_to_oom=60))
    write(folder / "b.jsonl", steady_trace(seconds=90, device="gpu1"))
    cache = tmp_path / "cache"
    first = load_folder(folder, cache, workers=1)
    assert len(list(cache.glob("*.npz"))) == 1
    again = load_folder(folder, cache)
    assert [s.name for s in again] == [s.name for s in first]
    for a, b in zip(first, again, strict=True):
        assert np.array_equal(a.x, b.x) and np.array_equal(a.m, b.m) and a.ooms == b.ooms
        assert np.array_equal(a.y, b.y) and np.array_equal(a.tto, b.tto)
    # another view is another cache entry, with its own sequences
    nvml = load_folder(folder, cache, workers=1, view="nvml")
    assert len(list(cache.glob("*.npz"))) == 2
    assert all(s.name.endswith("~nvml") for s in nvml)
    with pytest.raises(FileNotFoundError, match="not a folder of traces"):
        load_folder(tmp_path / "empty-does-not-exist", cache)
    with pytest.raises(FileNotFoundError, match="no traces given"):
        load_paths([], cache)


def test_host_split_halves_the_recorded_runs_by_seed() -> None:
    train, test = host_split(HOST)
    runs = json.loads((HOST / "manifest.json").read_text())["runs"]
    assert len(train) + len(test) == len(runs) and not set(train) & set(test)
    assert all(p.is_file() for p in train + test)
    seeds = {r["file"]: r["seed"] for r in runs}
    assert all(seeds[p.name] % 2 == 0 for p in train)
    oom = {r["file"]: r["oom"] for r in runs}
    # both halves hold kernel OOM kills and near misses
    for half in (train, test):
        assert any(oom[p.name] for p in half) and not all(oom[p.name] for p in half)


@pytest.fixture(scope="module")
def seqs(tmp_path_factory: pytest.TempPathFactory) -> list:  # type: ignore[type-arg]
    folder = tmp_path_factory.mktemp("traces")
    write(folder / "leak.jsonl", leak_trace(seconds_to_oom=900, device="gpu0"))
    write(folder / "ok1.jsonl", steady_trace(seconds=900, device="gpu1"))
    write(folder / "ok2.jsonl", steady_trace(seconds=900, device="gpu2", level=0.5))
    return load_folder(folder, None, workers=1)


def test_focused_windows_end_in_the_last_five_minutes_before_the_oom(seqs: list) -> None:  # type: ignore[type-arg]
    rng = np.random.default_rng(0)
    xs, ys, ms, _ = sample_windows(seqs, 64, 50, rng, focus=1.0)
    assert xs.shape == (64, 50, N_FEATURES) and ys.shape == ms.shape == (64, 50, len(HORIZONS_S))
    # every window's last real sample is less than 300 s before the leak's OOM: its
    # longest-horizon label is 1
    for k in range(64):
        last = int(np.flatnonzero(np.abs(xs[k]).sum(axis=1) > 0).max())
        assert ys[k, last, -1] == 1.0


def test_weights_and_hard_moments_steer_the_sampling(seqs: list) -> None:  # type: ignore[type-arg]
    ok = [i for i, s in enumerate(seqs) if not s.ooms]
    rng = np.random.default_rng(1)
    # only the weighted sequence is drawn when the others weigh nothing
    w = np.zeros(len(seqs))
    w[ok[0]] = 1.0
    xs, ys, _, _ = sample_windows(seqs, 32, 40, rng, focus=0.0, weights=w)
    assert not ys.any()
    level = seqs[ok[0]].x[:, 0]
    for k in range(32):
        real = xs[k][np.abs(xs[k]).sum(axis=1) > 0, 0]
        assert np.isin(real, level).all()
    # hard moments: windows end within a few samples after the given moment
    hard = [(ok[1], 500)]
    xs, _, _, _ = sample_windows(seqs, 16, 40, rng, focus=0.0, hard=hard, hard_share=1.0)
    target = seqs[ok[1]].x[500]
    assert all((xs[k] == target).all(axis=1).any() for k in range(16))


def test_nvml_view_sequences_cover_gpu_domains_without_allocator_figures(tmp_path: Path) -> None:
    records = [
        replace(r, allocated_bytes=r.used_bytes // 2, reserved_bytes=r.used_bytes)
        if isinstance(r, Sample)
        else r
        for r in leak_trace(seconds_to_oom=120)
    ]
    records += [
        replace(r, device="cgroup:/x", kind="host") if isinstance(r, Sample) else r
        for r in steady_trace(seconds=100)
    ]
    path = write(tmp_path / "mixed.jsonl", sorted(records, key=lambda r: r.ts))
    full = sequences_of(path)
    [nvml] = sequences_of(path, view="nvml")  # the host domain has no NVML view
    assert nvml.name == "mixed.jsonl:gpu0~nvml"
    [gpu_full] = [s for s in full if s.name == "mixed.jsonl:gpu0"]
    assert np.array_equal(gpu_full.y, nvml.y) and np.array_equal(gpu_full.m, nvml.m)
    masks = [i for i, f in enumerate(FEATURES) if f.endswith("_present")]
    assert masks and not np.array_equal(gpu_full.x[:, masks], nvml.x[:, masks])
