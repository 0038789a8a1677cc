"""training/train.py: rule scoring, the training loop's checkpoint, reproducibility."""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import oomcast_cmd
from support import leak_trace, steady_trace, write

from oomcast.model.embedding import EMBEDDING_VERSION
from oomcast.training.dataset import Sequence
from oomcast.training.train import Rule, best_rule, first_run, load_checkpoint, score_rules, train


def test_first_run_finds_the_sample_completing_n_in_a_row() -> None:
    f = np.asarray([0, 1, 0, 1, 1, 0, 1, 1, 1], dtype=bool)
    assert [first_run(f, n) for n in (1, 2, 3, 4)] == [1, 4, 8, None]
    assert first_run(np.asarray([True]), 2) is None
    assert first_run(np.zeros(0, dtype=bool), 1) is None


def seq(tto: list[float], ooms: bool) -> Sequence:
    n = len(tto)
    return Sequence(
        "s",
        np.zeros((n, 1), np.float32),
        np.zeros((n, 6), np.float32),
        np.ones((n, 6), np.float32),
        np.asarray(tto, dtype=np.float64),
        ooms,
    )


def test_score_rules_counts_leads_and_false_alarms_by_hand() -> None:
    inf = float("inf")
    seqs = [seq([60, 40, 20, 5], True), seq([inf] * 4, False), seq([inf] * 4, False)]
    risk = np.zeros((4, 6))
    oom = risk.copy()
    oom[1:, :] = 0.6  # from 40 s before the OOM
    ok1 = risk.copy()
    ok1[2, :] = 0.6  # one sample high: a single-sample rule fires, a 2-in-a-row rule does not
    rules = {
        (r.horizon_s, r.threshold, r.fire_after): r for r in score_rules(seqs, [oom, ok1, risk])
    }
    one = rules[(60, 0.5, 1)]
    assert (one.recall_30, one.recall_10, one.false_alarm_rate) == (1.0, 1.0, 0.5)
    two = rules[(60, 0.5, 2)]  # completes at the sample 20 s before: caught 10 s, not 30 s ahead
    assert (two.recall_30, two.recall_10, two.false_alarm_rate) == (0.0, 1.0, 0.0)
    assert rules[(60, 0.7, 1)].recall_10 == 0.0
    # the best rule keeps to the false-alarm budget first
    chosen = best_rule(list(rules.values()), max_false_alarms=0.0)
    assert chosen.false_alarm_rate == 0.0 and chosen.recall_10 == 1.0


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("sim")
    for split, n in (("train", 4), ("val", 2)):
        for i in range(n):
            write(
                root / split / f"{i}-leak.jsonl.gz",
                leak_trace(seconds_to_oom=120 + 20 * i, device=f"gpu{i}", seed=i),
            )
            write(
                root / split / f"{i}-ok.jsonl.gz", steady_trace(seconds=200, device=f"gpu{i + 10}")
            )
    return root


def run(data: Path, out: Path, seed: int) -> dict:  # type: ignore[type-arg]
    return train(
        data,
        out,
        epochs=2,
        windows_per_epoch=32,
        window=24,
        batch=16,
        seed=seed,
        mine_every=1,
        cache=out / "cache",
        log=lambda *_: None,
        progress=False,
    )


def test_training_writes_a_checkpoint_that_explains_itself(data: Path, tmp_path: Path) -> None:
    ckpt = run(data, tmp_path / "a", seed=0)
    on_disk = torch.load(tmp_path / "a" / "checkpoint.pt", weights_only=False)
    for key in (
        "weights",
        "optimizer",
        "config",
        "embedding_version",
        "rule",
        "epoch",
        "seed",
        "history",
        "data",
    ):
        assert key in on_disk, key
    assert on_disk["embedding_version"] == EMBEDDING_VERSION
    assert on_disk["optimizer"] is not None and len(on_disk["history"]) == 2
    assert set(on_disk["rule"]) >= {"horizon_s", "threshold", "fire_after", "false_alarm_rate"}
    # every GPU sequence twice: as the hook sees it, and as NVML alone does
    assert ckpt["data"]["train_sequences"] == 16 and ckpt["data"]["val_sequences"] == 8
    assert ckpt["data"]["nvml_views"] is True
    net, _ = load_checkpoint(tmp_path / "a" / "checkpoint.pt")
    assert net.cfg.n_features == on_disk["config"]["n_features"]
    assert (tmp_path / "a" / "history.json").is_file() and (tmp_path / "a" / "best.pt").is_file()


def test_training_is_reproducible_for_a_seed(data: Path, tmp_path: Path) -> None:
    a = run(data, tmp_path / "a", seed=7)["weights"]
    b = run(data, tmp_path / "b", seed=7)["weights"]
    c = run(data, tmp_path / "c", seed=8)["weights"]
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)


def test_cli_train_refuses_a_folder_without_splits(tmp_path: Path) -> None:
    done = subprocess.run(
        oomcast_cmd("train", "--data", str(tmp_path), "--out", str(tmp_path / "o")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "not a folder of traces" in done.stderr and "Traceback" not in done.stderr
    rules = [Rule(60, 0.5, 0.5, 0.5, 0.0)]
    assert best_rule(rules, 0.0) is rules[0]
