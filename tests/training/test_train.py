"""training/train.py: rule scoring, prediction, calibration, the training loop's checkpoint,
reproducibility."""

from __future__ import annotations

import math
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from support import leak_trace, oomcast_cmd, steady_trace, write
from torch.nn.functional import binary_cross_entropy

from oomcast.model.embedding import EMBEDDING_VERSION
from oomcast.model.forecast import HORIZONS_S
from oomcast.model.network import NetConfig, OOMForecastNet
from oomcast.training import train as train_module
from oomcast.training.dataset import Sequence
from oomcast.training.train import (
    ScoredRule,
    Sources,
    best_rule,
    calibrate,
    first_run,
    load_checkpoint,
    load_sources,
    predict_sequences,
    score_rules,
    train,
    tto_error,
)

TINY = NetConfig(embed_dim=8, hidden=16, layers=1)


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """train() asks for two threads; on a busy two-core machine their spin-waits make a
    tiny run take minutes instead of a second. One thread (train keeps it) is steady."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_first_run_finds_the_sample_completing_n_in_a_row() -> None:
    f = np.asarray([0, 1, 0, 1, 1, 0, 1, 1, 1], dtype=bool)
    assert [first_run(f, n) for n in (1, 2, 3, 4)] == [1, 4, 8, None]
    assert first_run(np.asarray([True]), 2) is None
    assert first_run(np.zeros(0, dtype=bool), 1) is None


def seq(tto: list[float], ooms: bool, group: str = "", level: float = 0.5) -> Sequence:
    """A run of ``len(tto)`` ticks; an OOM one OOMs ten minutes in (a long OOM)."""
    n = len(tto)
    return Sequence(
        "s",
        np.zeros((n, 1), np.float32),
        np.zeros((n, len(HORIZONS_S)), np.float32),
        np.ones((n, len(HORIZONS_S)), np.float32),
        np.asarray(tto, dtype=np.float64),
        ooms,
        group,
        oom_after_s=600.0 if ooms else None,
        max_level=1.0 if ooms else level,
        span_s=600.0,
    )


def _risks(columns: list[list[float]]) -> np.ndarray:
    """(time, horizons) risks with the same curve at every horizon."""
    return np.repeat(np.asarray(columns, dtype=np.float64)[:, None], len(HORIZONS_S), axis=1)


def test_score_rules_keeps_to_the_ceiling_with_a_margin_on_both_sides() -> None:
    inf = float("inf")
    oom = seq([60, 40, 20, 5], True)
    oks = [seq([inf] * 4, False) for _ in range(4)]
    risks = [_risks([0.2, 0.4, 0.6, 0.8])]
    risks += [_risks([0.0, peak, 0.0, 0.0]) for peak in (0.1, 0.3, 0.5, 0.7)]
    seqs = [oom, *oks]
    # (ceiling, the lowest threshold within it, the one chosen, false alarms, recall 30/10):
    # the lowest sits on a quiet run; the chosen one is raised halfway (geometric) to the
    # least risk that still catches, as far ahead, every OOM the lowest catches
    for ceiling, lowest, chosen, fa, r30, r10 in (
        (0.0, 0.7, 0.7, 0.0, 0.0, 0.0),  # above every quiet run: fires 5 s before, too late
        (0.25, 0.5, math.sqrt(0.5 * 0.6), 0.25, 0.0, 1.0),  # one quiet run in four: 20 s
        (0.5, 0.3, math.sqrt(0.3 * 0.4), 0.5, 1.0, 1.0),  # two in four: 40 s before
    ):
        rules = score_rules(seqs, risks, ceiling)
        assert [r.horizon_s for r in rules] == list(HORIZONS_S)  # one rule per horizon
        for r in rules:
            assert r.fire_risk == pytest.approx(chosen, abs=2e-6), ceiling
            assert r.fire_risk > lowest  # strictly above the quiet run it must not fire on
            assert (r.false_alarm_rate, r.recall_30, r.recall_10) == (fa, r30, r10), ceiling
            assert r.fire_after == 1
    # quiet runs that never rise: from the floor (a risk of 0.001 is noise), not zero,
    # halfway up to the OOM's 0.4 forty seconds ahead
    flat = score_rules([oom, *oks], [risks[0]] + [_risks([0.0] * 4)] * 4, 0.0)
    floor = train_module.MIN_THRESHOLD
    assert all(r.fire_risk == pytest.approx(math.sqrt(floor * 0.4), abs=2e-6) for r in flat)
    assert all(r.recall_30 == 1.0 for r in flat)
    # each horizon reads its own column
    per_h = [np.zeros((4, len(HORIZONS_S))) for _ in seqs]
    per_h[1][1, 2] = 0.9  # a quiet run high at the 30 s horizon only
    rules = {r.horizon_s: r for r in score_rules(seqs, per_h, 0.0)}
    assert rules[30].fire_risk == pytest.approx(0.9, abs=2e-6) and rules[60].fire_risk == 0.02


def test_the_false_alarm_ceiling_holds_on_every_source() -> None:
    inf = float("inf")
    # one alarm in two quiet runs of one source, none in six of the other: pooled, a
    # threshold of 0.1 would keep to 1 in 8 (12.5%); per source it must rise above 0.8
    seqs = [seq([inf] * 3, False, "corpus:full") for _ in range(2)]
    seqs += [seq([inf] * 3, False, "shapes") for _ in range(6)]
    seqs += [seq([50, 20, 5], True, "shapes")]
    risks = [_risks([0.0, 0.8, 0.0]), _risks([0.0] * 3)] + [_risks([0.0, 0.1, 0.0])] * 6
    risks += [_risks([0.5, 0.9, 0.9])]
    (rule, *_) = score_rules(seqs, risks, 0.2)
    # just above 0.8, raised halfway to the 0.9 that warns the OOM 20 s ahead
    assert rule.fire_risk == pytest.approx(math.sqrt(0.8 * 0.9), abs=2e-6)
    assert rule.false_alarm_rate == 0.0
    assert (rule.recall_30, rule.recall_10) == (0.0, 1.0)
    # where no threshold can keep a source quiet (a run at risk 1), the rate reported is
    # that source's, not the pooled one
    risks[0] = _risks([0.0, 1.0, 0.0])
    (rule, *_) = score_rules(seqs, risks, 0.0)
    assert rule.fire_risk == 1.0 and rule.false_alarm_rate == 0.5


def test_rules_leave_censored_alerts_out_and_warn_at_most_half_the_near_misses() -> None:
    inf = float("inf")
    oom = seq([60, 40, 20, 5], True)
    late = seq([inf] * 4, False)  # an ordinary run, high only in its last minute
    late.known = np.asarray([200.0, 100.0, 50.0, 10.0])
    near = [seq([inf] * 4, False, level=0.95) for _ in range(2)]
    risks = [_risks([0.2, 0.4, 0.6, 0.8]), _risks([0.0, 0.0, 0.9, 0.9]),
             _risks([0.0, 0.5, 0.0, 0.0]), _risks([0.0, 0.3, 0.0, 0.0])]  # fmt: skip
    rule = score_rules([oom, late, *near], risks, 0.0)[0]
    # the censored alert (0.9 in the last minute) sets nothing; one near miss of two may
    # be warned, so the threshold sits above the other one (0.3), halfway to the OOM's 0.4
    assert rule.fire_risk == pytest.approx(math.sqrt(0.3 * 0.4), abs=2e-6)
    assert rule.near_miss_warned == 0.5 and rule.false_alarm_rate == 0.0
    assert rule.recall_30 == 1.0
    assert rule.figures["near_misses"] == 2 and rule.figures["long_ooms"] == 1
    # a short OOM (under a minute from its start) is not what the recall counts
    short = seq([20, 10, 5, 1], True)
    short.oom_after_s = 40.0
    (rule, *_) = score_rules([short, late], [_risks([0.9] * 4), _risks([0.0] * 4)], 0.0)
    assert rule.figures["long_ooms"] == 0 and rule.recall_30 == 0.0


def test_best_rule_falls_back_to_the_quietest_when_none_keeps_the_budget() -> None:
    rules = [
        ScoredRule(60, 0.5, 0.9, 0.9, 0.3),
        ScoredRule(30, 0.8, 0.2, 0.4, 0.1),
        ScoredRule(5, 0.9, 0.5, 0.5, 0.1),
    ]
    assert best_rule(rules, 0.05) is rules[2]  # lowest false alarms, then most recall
    assert best_rule(rules, 0.5) is rules[0]
    single = [ScoredRule(60, 0.5, 0.5, 0.5, 0.0)]
    assert best_rule(single, 0.0) is single[0]


def _random_net(seed: int) -> OOMForecastNet:
    torch.manual_seed(seed)
    net = OOMForecastNet(TINY)
    for name, p in net.named_parameters():  # risks spread over (0, 1), not all ~0.5
        if not name.startswith(("by_projection", "trust")):  # (those would saturate them)
            p.data.mul_(3.0)
    return net.eval()


def _random_seqs(seed: int, lengths: list[int]) -> list[Sequence]:
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        x = rng.normal(size=(n, TINY.n_features)).astype(np.float32)
        out.append(
            Sequence(
                "r",
                x,
                np.zeros((n, len(HORIZONS_S)), np.float32),
                np.ones((n, len(HORIZONS_S)), np.float32),
                np.full(n, np.inf),
                False,
            )
        )
    return out


def test_predict_sequences_runs_each_sequence_from_its_start_whatever_the_batch() -> None:
    net = _random_net(0)
    seqs = _random_seqs(1, [7, 50, 3, 50, 21])
    batched = predict_sequences(net, seqs, batch=4)  # padded, sorted by length, reassembled
    raw = predict_sequences(net, seqs, raw=True)
    tto = predict_sequences(net, seqs, tto=True)
    for s, r, ls, t in zip(seqs, batched, raw, tto, strict=True):
        with torch.no_grad():
            x = torch.from_numpy(s.x[None])
            alone, _ = net(x)
            log_s, log_tto, _ = net.heads(x)
        assert r.shape == (len(s.x), len(HORIZONS_S)) and t.shape == (len(s.x),)
        assert np.allclose(r, alone[0].numpy(), atol=1e-5)
        assert np.allclose(ls, log_s[0].numpy(), atol=1e-5)
        assert np.allclose(t, torch.exp(log_tto[0].clamp(-2.0, 9.0)).numpy(), rtol=1e-5)
    assert np.concatenate(batched).std() > 0.01
    # calibrated and raw are different things once a calibration is set
    with torch.no_grad():
        net.cal_b.fill_(2.0)
    assert not np.allclose(predict_sequences(net, seqs)[1], batched[1], atol=1e-3)


def test_tto_error_is_the_median_relative_error_30_s_before_each_oom() -> None:
    net = _random_net(2)
    with torch.no_grad():  # a curve whose OOM always falls between 50 and 60 s
        net.hazard.weight.zero_()
        net.hazard.bias.fill_(-30.0)
        net.hazard.bias[list(net.cfg.bins_s).index(60)] = 30.0
        net.trust.weight.zero_()  # and no say for the projection
        net.trust.bias.fill_(-30.0)
    seqs = [seq([100, 70, 40, 30, 20], True), seq([45, 35, 25], True), seq([np.inf] * 3, False)]
    for s in seqs:
        s.x = np.zeros((len(s.tto), TINY.n_features), np.float32)
    # the curve puts the OOM in the bin (50, 60]: its median 55 s. The last tick at least
    # 30 s before: 30 s (error 25/30) and 35 s (error 20/35)
    assert tto_error(net, seqs) == pytest.approx((25 / 30 + 20 / 35) / 2, rel=1e-4)
    assert np.isnan(tto_error(net, [seqs[2]]))  # no OOM: nothing to measure


def test_calibrate_refits_from_scratch_and_lowers_the_log_loss() -> None:
    net = _random_net(3)
    seqs = _random_seqs(4, [400] * 10)
    rng = np.random.default_rng(5)
    for s, r in zip(seqs, predict_sequences(net, seqs), strict=True):
        # the truth: a quarter of what the network says
        s.y = (rng.random(r.shape) < 0.25 * r).astype(np.float32)
    y = torch.from_numpy(np.concatenate([s.y for s in seqs]))
    identity = binary_cross_entropy(
        torch.from_numpy(np.concatenate(predict_sequences(net, seqs))).clamp(1e-6, 1 - 1e-6), y
    )
    with torch.no_grad():  # a stale calibration from another epoch
        net.cal_a.fill_(7.0)
        net.cal_b.fill_(5.0)
    calibrate(net, seqs)
    assert (net.cal_a != 7.0).all() and (net.cal_b != 5.0).all()
    fitted = binary_cross_entropy(torch.from_numpy(np.concatenate(predict_sequences(net, seqs))), y)
    assert float(fitted) < float(identity)
    assert (net.cal_b < 0).all()  # it learned to say less


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


def run(data: Path, out: Path, seed: int) -> dict[str, Any]:
    return train(
        Sources(sim=data, shapes=12),
        out,
        epochs=2,
        draws_per_epoch=8,
        batch=8,
        chunk=128,
        max_ticks=400,
        seed=seed,
        cfg=TINY,
        cache=out / "cache",
        log=lambda *_: None,
        progress=False,
    )


@pytest.fixture(scope="module")
def runs(data: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("runs")
    return {
        "a": (root / "a", run(data, root / "a", seed=7)),
        "b": (root / "b", run(data, root / "b", seed=7)),
        "c": (root / "c", run(data, root / "c", seed=8)),
    }


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_training_writes_a_checkpoint_that_explains_itself(runs: dict[str, Any]) -> None:
    out, ckpt = runs["a"]
    on_disk = torch.load(out / "checkpoint.pt", weights_only=False)
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
    assert on_disk["embedding_version"] == EMBEDDING_VERSION and on_disk["seed"] == 7
    assert on_disk["optimizer"] is not None and len(on_disk["history"]) == 2
    assert on_disk["config"]["tick_s"] == 1.0 and on_disk["config"]["hidden"] == 16
    rule = on_disk["rule"]
    assert set(rule) >= {"horizon_s", "fire_risk", "fire_after", "false_alarm_rate", "recall_30"}
    assert isinstance(rule["fire_risk"], float) and 0 < rule["fire_risk"] < 1
    assert rule["horizon_s"] in on_disk["config"]["horizons_s"]
    # the calibration travels with the weights, and was fitted on the validation split
    cal_a, cal_b = on_disk["weights"]["cal_a"], on_disk["weights"]["cal_b"]
    assert cal_a.shape == cal_b.shape == (len(HORIZONS_S),)
    assert not (torch.equal(cal_a, torch.ones(6)) and torch.equal(cal_b, torch.zeros(6)))
    # each source is counted by group; every simulated GPU twice (hook and NVML alone);
    # the plain shapes a quarter as many in validation
    assert ckpt["data"]["train_sequences"] == {"sim:full": 8, "sim:nvml": 8, "shapes": 12}
    assert ckpt["data"]["val_sequences"] == {"sim:full": 4, "sim:nvml": 4, "shapes": 3}
    assert ckpt["data"]["nvml_views"] is True and ckpt["data"]["shapes"] == 12
    net, loaded = load_checkpoint(out / "checkpoint.pt")
    assert net.cfg.n_features == on_disk["config"]["n_features"] and not net.training
    assert torch.equal(net.cal_a, cal_a) and torch.equal(net.cal_b, cal_b)
    assert loaded["rule"] == rule
    assert (out / "history.json").is_file() and (out / "best.pt").is_file()


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_training_is_reproducible_for_a_seed(runs: dict[str, Any]) -> None:
    a, b, c = (runs[k][1]["weights"] for k in "abc")
    assert set(a) == set(b) and "cal_a" in a
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not all(torch.equal(a[k], c[k]) for k in a)
    assert runs["a"][1]["rule"] == runs["b"][1]["rule"]


def test_load_sources_groups_what_it_reads_and_refuses_nothing_to_train_on(
    data: Path, tmp_path: Path
) -> None:
    train_seqs, val_seqs = load_sources(
        Sources(sim=data, shapes=8, nvml_views=False), tmp_path, log=lambda *_: None
    )
    assert {s.group for s in train_seqs} == {"sim:full", "shapes"}
    assert sum(s.group == "shapes" for s in train_seqs) == 8
    assert sum(s.group == "shapes" for s in val_seqs) == 2
    assert not any(s.name.endswith("~nvml") for s in train_seqs)
    with pytest.raises(FileNotFoundError, match="no training or no validation"):
        load_sources(Sources(shapes=0), tmp_path, log=lambda *_: None)
    with pytest.raises(FileNotFoundError, match="no training or no validation"):
        # training traces alone: nothing to calibrate and choose the rule on
        load_sources(
            Sources(extra=[data / "train" / "0-ok.jsonl.gz"], shapes=0),
            tmp_path,
            log=lambda *_: None,
        )


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_cli_train_refuses_a_folder_without_splits(tmp_path: Path) -> None:
    done = subprocess.run(
        oomcast_cmd("train", "--data", str(tmp_path), "--out", str(tmp_path / "o")),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "not a folder of traces" in done.stderr and "Traceback" not in done.stderr


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_cli_train_refuses_a_missing_checkpoint_to_go_on_from(data: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nope.pt"
    done = subprocess.run(
        oomcast_cmd("train", "--data", str(data), "--init-from", str(missing),
                    "--out", str(tmp_path / "o")),
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"--init-from {missing}: no such checkpoint" in done.stderr
    assert "Traceback" not in done.stderr and not (tmp_path / "o").exists()


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_training_can_go_on_from_an_earlier_checkpoint(
    data: Path, runs: dict[str, Any], tmp_path: Path
) -> None:
    earlier_dir, earlier = runs["a"]
    ckpt = train(
        Sources(sim=data, shapes=12),
        tmp_path / "more",
        epochs=1,
        draws_per_epoch=8,
        batch=8,
        max_ticks=400,
        lr=0.0,  # no step moves a weight: what comes out is what went in
        cfg=TINY,
        cache=tmp_path / "cache",
        init_from=earlier_dir / "checkpoint.pt",
        log=lambda *_: None,
        progress=False,
    )
    moved = [k for k in earlier["weights"] if not k.startswith("cal_")
             and not torch.equal(earlier["weights"][k], ckpt["weights"][k])]  # fmt: skip
    assert moved == []  # the weights of seed 7, not the fresh ones of the default seed 0


def test_a_sudden_corpus_oom_keeps_its_steady_minutes_censored_at_its_step() -> None:
    from oomcast.training.train import grouped

    sudden = seq([float(t) for t in range(300, 0, -1)], True)  # OOMs 600 s in; ticks 300-599
    sudden.name = "gan-sudden-checkpoint.jsonl.gz:cgroup:/x"
    sudden.known = None
    runs = {"gan-sudden-checkpoint.jsonl.gz": {"kind": "sudden", "onset_s": 450.0}}
    (kept,) = grouped([sudden], "corpus:full", True, runs)
    assert not kept.ooms and kept.group == "corpus:full" and kept.span_s == 450.0
    assert len(kept.x) == 150  # the ticks 300-449 s after the start: before the step
    assert np.isinf(kept.tto).all() and kept.known_s()[0] == 150.0
    assert kept.known_s()[-1] == 1.0 and not kept.y.any()
    # without a manifest, a sudden cause named in the file is left out; others stay
    other = seq([5.0, 4.0], True)
    other.name = "00001-neighbour.jsonl.gz:gpu0"
    leak = seq([5.0, 4.0], True)
    leak.name = "00002-leak.jsonl.gz:gpu0"
    assert [q.name for q in grouped([other, leak], "sim:full", True, None)] == [leak.name]
    assert len(grouped([other, leak], "sim:full", False, None)) == 2
