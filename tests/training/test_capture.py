from __future__ import annotations

from pathlib import Path

import pytest
import torch

from oomcast.training.capture import AllocationLog, AllocationTracker, cached_capture, capture


def test_persistent_storages_are_the_parameters() -> None:
    log = capture("mlp", steps=3, dim=64, hidden=128, batch=8)
    params = (64 * 128 + 128) + (128 * 128 + 128) + (128 * 10 + 10)
    assert log.persistent_bytes() == params * 4
    assert all(op.alloc and op.phase == "persistent" for op in log.persistent)


def test_steps_balance_once_the_optimizer_state_exists() -> None:
    log = capture("mlp", steps=4, dim=64, hidden=128, batch=8)
    first, *rest = [s for s in log.steps if s.kind == "train"]

    def net(ops: list) -> int:  # type: ignore[type-arg]
        sizes = {op.sid: op.size for op in ops if op.alloc}
        return sum(sizes.values()) - sum(sizes.get(op.sid, 0) for op in ops if not op.alloc)

    # The first step leaves Adam's two moments (and step counters) alive: ~2x the weights.
    assert net(first.ops) >= 2 * log.persistent_bytes()
    for step in rest:
        assert abs(net(step.ops)) <= 64  # a steady step frees what it allocates
    phases = {op.phase for op in rest[0].ops}
    assert {"forward", "backward", "optimizer"} <= phases
    modules = {op.module for op in rest[0].ops if op.phase == "forward"}
    assert {"0", "2", "4"} & modules  # Sequential's layers by name


def test_activations_scale_with_the_batch() -> None:
    small = capture("mlp", steps=3, batch=16)
    big = capture("mlp", steps=3, batch=64)
    act_small = small.peak_bytes() - small.persistent_bytes()
    act_big = big.peak_bytes() - big.persistent_bytes()
    assert act_big > act_small


def test_eval_and_checkpoint_steps(tmp_path: Path) -> None:
    log = capture("cnn", steps=4, eval_every=2, checkpoint_every=4, batch=4, image=16)
    kinds = [s.kind for s in log.steps]
    assert kinds.count("eval") == 2 and kinds.count("checkpoint") == 1
    ckpt = next(s for s in log.steps if s.kind == "checkpoint")
    copied = sum(op.size for op in ckpt.ops if op.alloc)
    assert copied >= log.persistent_bytes()  # weights, plus the optimizer's moments
    path = tmp_path / "log.json.gz"
    log.save(path)
    again = AllocationLog.load(path)
    assert again.to_json() == log.to_json()


def test_tracker_sees_a_free_when_the_last_reference_goes() -> None:
    tracker = AllocationTracker()
    with tracker:
        x = torch.ones(1000)
        y = x * 2
        del x
    ops = tracker.take()
    allocs = [op for op in ops if op.alloc]
    frees = [op for op in ops if not op.alloc]
    assert [op.size for op in allocs] == [4000, 4000]
    assert [op.sid for op in frees] == [allocs[0].sid]
    del y


def test_cached_capture_runs_once(tmp_path: Path) -> None:
    a = cached_capture("mlp", tmp_path)
    assert (tmp_path / "mlp.json.gz").exists()
    b = cached_capture("mlp", tmp_path)
    assert a.to_json() == b.to_json()
    with pytest.raises(ValueError, match="unknown capture"):
        cached_capture("nope", tmp_path)
