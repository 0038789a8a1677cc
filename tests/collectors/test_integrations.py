"""The Lightning and Hugging Face callbacks against the real Redis: driven by duck-typed
fake trainers, and, where the libraries are installed, by a real ``transformers.Trainer`` and
a real ``pytorch_lightning.Trainer`` (the schedule, step and phases)."""

from __future__ import annotations

import json
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from oomcast.collectors import integrations
from oomcast.collectors.hook import MemoryHook
from oomcast.collectors.integrations import (
    OomcastLightningCallback,
    OomcastTrainerCallback,
    lightning_callback_class,
)
from oomcast.model import frameworks


@pytest.fixture
def hook(redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[MemoryHook]:
    monkeypatch.delenv("OOMCAST_HOOK", raising=False)
    h = MemoryHook(
        "ft-job",
        redis_url=redis_url,
        key_prefix=key_prefix,
        node="n-int",
        mode="host",
        checkpoint_signal=None,
        publish_interval_s=0.02,
    )
    yield h
    h.close(timeout_s=0.5)


def events(client: redis.Redis, hook: MemoryHook) -> list[dict[str, Any]]:
    return [json.loads(f[b"event"]) for _, f in client.xrange(hook.keys.events)]


# --- Hugging Face ---


class Control:
    def __init__(self) -> None:
        self.should_save = False


def test_trainer_callback_steps_saves_on_request_and_reports(
    hook: MemoryHook, rclient: redis.Redis, tmp_path: Path
) -> None:
    cb = OomcastTrainerCallback(hook)
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    state = types.SimpleNamespace(global_step=7)
    control = Control()
    assert cb.on_step_end(args, state, control) is control
    assert hook.stats.steps == 1 and not control.should_save
    # events the callback does not use are accepted, as the Trainer calls them all
    for name in ("on_init_end", "on_train_begin", "on_log", "on_evaluate", "on_substep_end"):
        getattr(cb, name)(args, state, control, logs={})
    with pytest.raises(AttributeError):
        _ = cb.not_an_event
    req = hook.request_checkpoint("risk")
    assert req is not None
    cb.on_step_end(args, state, control)
    assert control.should_save  # the Trainer saves at the end of this step
    cb.on_save(args, state, control)
    assert not hook.checkpoint_requested
    cb.on_save(args, state, control)  # a scheduled save later: nothing to report
    cb.on_train_end(args, state, control)
    assert not hook.closed  # the caller's hook stays open
    assert hook.close()
    got = [e for e in events(rclient, hook) if e["event"] == "checkpoint_done"]
    assert len(got) == 1
    assert got[0]["request_id"] == req.id
    assert got[0]["path"] == str(tmp_path / "checkpoint-7")


class FakeDist:
    """``torch.distributed`` with a process group of ``world`` ranks; ``others`` is what the
    other ranks bring to the all-reduce (1: one of them has a request)."""

    def __init__(self, initialized: bool = True, world: int = 2, others: int = 0) -> None:
        self.initialized = initialized
        self.world = world
        self.others = others
        self.backend = "gloo"
        self.reduced: list[tuple[Any, Any, Any]] = []

    def install(self, monkeypatch: pytest.MonkeyPatch, torch: Any) -> None:
        dist = torch.distributed
        monkeypatch.setattr(dist, "is_available", lambda: True)
        monkeypatch.setattr(dist, "is_initialized", lambda: self.initialized)
        monkeypatch.setattr(dist, "get_world_size", self.get_world_size)
        monkeypatch.setattr(dist, "get_backend", lambda *a: self.backend)
        monkeypatch.setattr(dist, "all_reduce", self.all_reduce)

    def get_world_size(self, *args: Any) -> int:
        if not self.initialized:
            raise AssertionError("torch.distributed used by a single process")
        return self.world

    def all_reduce(self, tensor: Any, op: Any = None, **kwargs: Any) -> None:
        if not self.initialized:
            raise AssertionError("torch.distributed used by a single process")
        self.reduced.append((tensor.device.type, tensor.tolist(), op))
        tensor.fill_(max(int(tensor.item()), self.others))


def test_trainer_callback_saves_on_every_rank_when_any_rank_has_a_request(
    hook: MemoryHook, rclient: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    dist = FakeDist(others=1)  # another rank got the signal; this one has nothing pending
    dist.install(monkeypatch, torch)
    cb = OomcastTrainerCallback(hook)
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    state = types.SimpleNamespace(global_step=3)
    control = Control()
    cb.on_step_end(args, state, control)
    assert control.should_save  # this rank saves with the others, or they wait for it
    assert dist.reduced == [("cpu", [0], torch.distributed.ReduceOp.MAX)]
    cb.on_save(args, state, control)  # nothing of this rank's to answer: no event
    # a request of this rank's own, the other ranks having none
    dist.others = 0
    control = Control()
    cb.on_step_end(args, state, control)
    assert not control.should_save
    req = hook.request_checkpoint("risk")
    assert req is not None
    state.global_step = 4
    cb.on_step_end(args, state, control)
    assert control.should_save and dist.reduced[-1][1] == [1]
    cb.on_save(args, state, control)
    assert len(dist.reduced) == 3  # one all-reduce per step, on every rank
    assert hook.close()
    got = [(e["event"], e["request_id"], e.get("path")) for e in events(rclient, hook)]
    assert got == [
        ("checkpoint_requested", req.id, None),
        ("checkpoint_done", req.id, str(tmp_path / "checkpoint-4")),
    ]


def test_trainer_callback_in_one_process_makes_no_collective(
    hook: MemoryHook, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    FakeDist(initialized=False).install(monkeypatch, torch)  # any collective raises
    cb = OomcastTrainerCallback(hook)
    args = types.SimpleNamespace(output_dir=str(tmp_path))
    state = types.SimpleNamespace(global_step=1)
    control = Control()
    cb.on_step_end(args, state, control)
    assert not control.should_save
    hook.request_checkpoint("risk")
    cb.on_step_end(args, state, control)
    assert control.should_save
    # a process group of one rank: nothing to agree on either
    FakeDist(world=1).install(monkeypatch, torch)
    monkeypatch.setattr(torch.distributed, "all_reduce", None)
    assert integrations.any_rank(True) and not integrations.any_rank(False)


def test_any_rank_reduces_on_the_cuda_device_with_nccl(monkeypatch: pytest.MonkeyPatch) -> None:
    torch = pytest.importorskip("torch")
    dist = FakeDist()
    dist.install(monkeypatch, torch)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    dist.backend = "nccl"
    assert integrations.reduce_device(torch, torch.distributed) == torch.device("cuda", 3)
    dist.backend = "gloo"
    assert integrations.reduce_device(torch, torch.distributed) == torch.device("cpu")


def test_trainer_callback_owns_and_closes_a_hook_it_made(
    redis_url: str, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("OOMCAST_HOOK", raising=False)
    cb = OomcastTrainerCallback(
        job="own", redis_url=redis_url, key_prefix=key_prefix, mode="host", checkpoint_signal=None
    )
    assert cb.hook.job == "own" and not cb.hook.closed
    ns = types.SimpleNamespace()
    cb.on_train_end(ns, ns, Control())
    assert cb.hook.closed


# --- Lightning ---


class FakeLightningCallback:
    """Lightning's base class, as far as the callback needs it."""

    def __init__(self) -> None:
        self.base_initialized = True


class FakeStrategy:
    """A distributed strategy: ``others`` is whether another rank has a request."""

    def __init__(self, others: bool = False) -> None:
        self.others = others
        self.calls: list[tuple[bool, bool]] = []

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        self.calls.append((decision, all))
        return (decision and self.others) if all else (decision or self.others)


class LegacyStrategy:
    """An older Lightning's: the decision holds when it holds on every rank. The other rank
    runs the same callback: it passes "I have no request" unless ``others``."""

    def __init__(self, others: bool) -> None:
        self.others = others
        self.calls: list[bool] = []

    def reduce_boolean_decision(self, decision: bool) -> bool:
        self.calls.append(decision)
        return decision and not self.others


class FakeTrainer:
    def __init__(self, root: Path, fail: bool = False) -> None:
        self.default_root_dir = str(root)
        self.global_step = 0
        self.checkpoint_callback = None
        self.saved: list[str] = []
        self.fail = fail

    def save_checkpoint(self, path: str) -> None:
        if self.fail:
            raise OSError("disk full")
        self.saved.append(path)


@pytest.fixture
def fake_lightning(monkeypatch: pytest.MonkeyPatch) -> type:
    pkg = types.ModuleType("lightning")
    sub = types.ModuleType("lightning.pytorch")
    sub.Callback = FakeLightningCallback  # type: ignore[attr-defined]
    pkg.pytorch = sub  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lightning", pkg)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", sub)
    monkeypatch.setattr(frameworks, "_LIGHTNING_CLASSES", {})
    return FakeLightningCallback


def test_lightning_callback_subclasses_lightnings_callback(
    fake_lightning: type, hook: MemoryHook
) -> None:
    cb = OomcastLightningCallback(hook)
    assert isinstance(cb, fake_lightning)
    assert cb.base_initialized
    assert type(cb).__name__ == "OomcastLightningCallback"
    assert lightning_callback_class() is type(cb)  # made once


def test_lightning_callback_saves_on_request_and_reports(
    fake_lightning: type, hook: MemoryHook, rclient: redis.Redis, tmp_path: Path
) -> None:
    cb = OomcastLightningCallback(hook)
    trainer = FakeTrainer(tmp_path)
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert hook.stats.steps == 1 and trainer.saved == []
    req = hook.request_checkpoint("risk")
    assert req is not None
    trainer.global_step = 12
    cb.on_train_batch_end(trainer, None, None, None, 1)
    expected = str(tmp_path / "checkpoints" / "oomcast-step=12.ckpt")
    assert trainer.saved == [expected]
    assert not hook.checkpoint_requested
    # the ModelCheckpoint's directory wins over the default, an explicit dirpath over both
    trainer.checkpoint_callback = types.SimpleNamespace(dirpath=str(tmp_path / "mc"))
    assert cb.checkpoint_path(trainer) == str(tmp_path / "mc" / "oomcast-step=12.ckpt")
    explicit = OomcastLightningCallback(hook, dirpath=tmp_path / "x")
    assert explicit.checkpoint_path(trainer) == str(tmp_path / "x" / "oomcast-step=12.ckpt")
    assert hook.close()
    done = [e for e in events(rclient, hook) if e["event"] == "checkpoint_done"]
    assert [(e["request_id"], e["path"]) for e in done] == [(req.id, expected)]


def test_lightning_callback_reports_a_failed_save_and_goes_on(
    fake_lightning: type, hook: MemoryHook, rclient: redis.Redis, tmp_path: Path
) -> None:
    cb = OomcastLightningCallback(hook)
    req = hook.request_checkpoint("risk")
    assert req is not None
    cb.on_train_batch_end(FakeTrainer(tmp_path, fail=True), None, None, None, 0)
    assert not hook.checkpoint_requested
    assert hook.close()
    names = [(e["event"], e.get("request_id")) for e in events(rclient, hook)]
    assert names == [("checkpoint_requested", req.id), ("checkpoint_failed", req.id)]


def test_lightning_callback_saves_on_every_rank_when_any_rank_has_a_request(
    fake_lightning: type, hook: MemoryHook, rclient: redis.Redis, tmp_path: Path
) -> None:
    cb = OomcastLightningCallback(hook)
    trainer = FakeTrainer(tmp_path)
    trainer.world_size = 2  # type: ignore[attr-defined]
    trainer.strategy = FakeStrategy(others=True)  # type: ignore[attr-defined]
    trainer.global_step = 5
    cb.on_train_batch_end(trainer, None, None, None, 0)
    # this rank saw nothing, but save_checkpoint waits for every rank: it must save too
    first = str(tmp_path / "checkpoints" / "oomcast-step=5.ckpt")
    assert trainer.saved == [first]
    trainer.strategy.others = False  # type: ignore[attr-defined]
    cb.on_train_batch_end(trainer, None, None, None, 1)
    assert trainer.saved == [first]
    req = hook.request_checkpoint("risk")
    assert req is not None
    trainer.global_step = 6
    cb.on_train_batch_end(trainer, None, None, None, 2)
    second = str(tmp_path / "checkpoints" / "oomcast-step=6.ckpt")
    assert trainer.saved == [first, second]
    # asked at every batch, for "any rank"
    assert trainer.strategy.calls == [(False, False), (False, False), (True, False)]  # type: ignore[attr-defined]
    # a failed save for another rank's request: nothing of this rank's to report either
    failing = FakeTrainer(tmp_path, fail=True)
    failing.strategy = FakeStrategy(others=True)  # type: ignore[attr-defined]
    cb.on_train_batch_end(failing, None, None, None, 3)
    assert hook.close()
    got = [(e["event"], e["request_id"], e.get("path")) for e in events(rclient, hook)]
    assert got == [("checkpoint_requested", req.id, None), ("checkpoint_done", req.id, second)]


def test_lightning_callback_in_one_process_asks_no_other_rank(
    fake_lightning: type, hook: MemoryHook, tmp_path: Path
) -> None:
    cb = OomcastLightningCallback(hook)
    trainer = FakeTrainer(tmp_path)
    trainer.world_size = 1  # type: ignore[attr-defined]
    trainer.strategy = FakeStrategy(others=True)  # type: ignore[attr-defined]
    cb.on_train_batch_end(trainer, None, None, None, 0)
    assert trainer.saved == [] and trainer.strategy.calls == []  # type: ignore[attr-defined]


def test_lightning_callback_with_an_older_strategy_still_asks_for_any_rank(
    fake_lightning: type, hook: MemoryHook, tmp_path: Path
) -> None:
    cb = OomcastLightningCallback(hook)
    trainer = FakeTrainer(tmp_path)
    trainer.strategy = LegacyStrategy(others=True)  # type: ignore[attr-defined]
    cb.on_train_batch_end(trainer, None, None, None, 0)  # not "every rank has none"
    assert len(trainer.saved) == 1 and trainer.strategy.calls == [True]  # type: ignore[attr-defined]
    trainer.strategy = LegacyStrategy(others=False)  # type: ignore[attr-defined]
    cb.on_train_batch_end(trainer, None, None, None, 1)
    assert len(trainer.saved) == 1


def test_lightning_callback_reports_an_oom_that_ends_the_fit(
    fake_lightning: type, hook: MemoryHook, rclient: redis.Redis, tmp_path: Path
) -> None:
    cb = OomcastLightningCallback(hook)
    trainer = FakeTrainer(tmp_path)
    cb.on_exception(trainer, None, ValueError("not memory"))
    cb.on_exception(trainer, None, MemoryError())
    # reported synchronously: in Redis before on_exception returns
    assert [e["event"] for e in events(rclient, hook)] == ["oom"]


def test_lightning_callback_closes_only_a_hook_it_made(
    fake_lightning: type,
    hook: MemoryHook,
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
) -> None:
    trainer = FakeTrainer(tmp_path)
    OomcastLightningCallback(hook).on_train_end(trainer, None)
    assert not hook.closed
    own = OomcastLightningCallback(
        job="own", redis_url=redis_url, key_prefix=key_prefix, mode="host", checkpoint_signal=None
    )
    own.on_train_end(trainer, None)
    assert own.hook.closed


def test_lightning_callback_without_lightning_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name in ("lightning", "lightning.pytorch", "pytorch_lightning"):
        monkeypatch.setitem(sys.modules, name, None)  # import fails, installed or not
    with pytest.raises(ImportError, match="pip install lightning"):
        OomcastLightningCallback()


def test_pytorch_lightning_is_the_fallback(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    legacy = types.ModuleType("pytorch_lightning")
    base = type("Callback", (), {})
    legacy.Callback = base  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "pytorch_lightning", legacy)
    monkeypatch.setattr(frameworks, "_LIGHTNING_CLASSES", {})
    assert issubclass(lightning_callback_class(), base)


def test_importing_oomcast_needs_neither_library() -> None:
    import subprocess

    code = (
        "import sys; import oomcast.collectors.integrations, oomcast.collectors.hook;"
        " assert not {'lightning', 'pytorch_lightning', 'transformers', 'torch'} & set(sys.modules)"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# --- the schedule, step and phases, from the real libraries ---


def _tiny_batches() -> Any:
    torch = pytest.importorskip("torch")
    return torch.utils.data.TensorDataset(torch.randn(64, 4))


def _published(client: redis.Redis, hook: MemoryHook) -> tuple[list[Any], list[Any]]:
    from oomcast.model.events import ScheduleEvent
    from oomcast.model.wire import DecodedSample, decode_event, decode_samples

    schedules = [decode_event(f) for _, f in client.xrange(hook.keys.events)]
    samples = [
        d.sample
        for _, f in client.xrange(hook.keys.samples_for(hook.node))
        for d in decode_samples(f)
        if isinstance(d, DecodedSample)
    ]
    return [e for e in schedules if isinstance(e, ScheduleEvent)], samples


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_hf_schedule_reads_steps_ratios_and_strategies(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    args = transformers.TrainingArguments
    state = transformers.TrainerState(max_steps=1000)
    steps = args(
        output_dir=str(tmp_path), eval_strategy="steps", eval_steps=50, save_steps=200,
        report_to=[], use_cpu=True,
    )  # fmt: skip
    assert integrations.hf_schedule(steps, state) == {
        "eval_every_steps": 50,
        "checkpoint_every_steps": 200,
    }
    ratio = args(
        output_dir=str(tmp_path), eval_strategy="steps", eval_steps=0.25, save_strategy="no",
        report_to=[], use_cpu=True,
    )  # fmt: skip
    assert integrations.hf_schedule(ratio, state) == {"eval_every_steps": 250}
    epochs = args(
        output_dir=str(tmp_path), eval_strategy="epoch", save_strategy="epoch", report_to=[],
        use_cpu=True,
    )  # fmt: skip
    assert integrations.hf_schedule(epochs, state) == {}


@pytest.mark.slow
def test_a_real_hugging_face_trainer_announces_its_schedule_and_marks_its_phases(
    hook: MemoryHook, rclient: redis.Redis, tmp_path: Path
) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")

    class Tiny(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def forward(self, x: Any, labels: Any = None) -> dict[str, Any]:
            out = self.linear(x).squeeze(-1)
            return {"loss": ((out - labels) ** 2).mean(), "logits": out}

    class Rows(torch.utils.data.Dataset):  # type: ignore[misc]
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> dict[str, Any]:
            return {"x": torch.full((4,), i / 64), "labels": torch.tensor(float(i % 2))}

    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=12, eval_strategy="steps", eval_steps=5,
        save_strategy="steps", save_steps=10, per_device_train_batch_size=4, report_to=[],
        use_cpu=True, logging_steps=100, disable_tqdm=True, save_only_model=True,
    )  # fmt: skip
    cb = OomcastTrainerCallback(hook, phase_extra_bytes={"optimizer": 1 << 20})
    trainer = transformers.Trainer(
        model=Tiny(), args=args, train_dataset=Rows(), eval_dataset=Rows(), callbacks=[cb]
    )
    trainer.train()
    assert hook.close()
    schedules, samples = _published(rclient, hook)
    first, last = schedules[0], schedules[-1]
    assert (first.eval_every_steps, first.checkpoint_every_steps) == (5, 10)
    assert dict(first.phase_extra_bytes) == {"optimizer": 1 << 20} and first.measured == ()
    assert set(last.measured) == {"eval", "checkpoint"}  # measured on their first run
    assert [s.step for s in samples if s.phase is None][1:] == list(range(1, 13))
    marked = [(s.step, s.phase) for s in samples if s.phase is not None]
    assert marked == [
        (5, "eval"), (10, "eval"), (10, "checkpoint"), (12, "eval"), (12, "checkpoint")
    ]  # fmt: skip


@pytest.mark.slow
def test_a_real_lightning_fit_announces_its_schedule_and_marks_its_evals(
    hook: MemoryHook, rclient: redis.Redis, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    torch = pytest.importorskip("torch")
    pl = pytest.importorskip("pytorch_lightning")
    monkeypatch.setitem(sys.modules, "lightning", None)  # the one installed here, if any

    class Tiny(pl.LightningModule):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 1)

        def training_step(self, batch: Any, i: int) -> Any:
            return self.linear(batch[0]).pow(2).mean()

        def validation_step(self, batch: Any, i: int) -> None:
            self.log("v", self.linear(batch[0]).mean())

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    loader = torch.utils.data.DataLoader(_tiny_batches(), batch_size=4)
    saves = pl.callbacks.ModelCheckpoint(dirpath=str(tmp_path), every_n_train_steps=6)
    trainer = pl.Trainer(
        max_steps=12, val_check_interval=4, callbacks=[OomcastLightningCallback(hook), saves],
        logger=False, enable_progress_bar=False, enable_model_summary=False, accelerator="cpu",
        default_root_dir=str(tmp_path), num_sanity_val_steps=0, limit_val_batches=2,
    )  # fmt: skip
    trainer.fit(Tiny(), loader, loader)
    assert hook.close()
    schedules, samples = _published(rclient, hook)
    assert (schedules[0].eval_every_steps, schedules[0].checkpoint_every_steps) == (4, 6)
    assert schedules[-1].measured == ("eval",)
    evals = [s.step for s in samples if s.phase == "eval"]
    assert evals == [4, 8, 12]
