"""preflight/callbacks.py: the preflight at train start, inside a real Hugging Face
``Trainer`` and a real PyTorch Lightning ``Trainer``, with tiny real models on CPU."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset, TensorDataset

from oomcast.preflight import PreflightOOM, PreflightTrainerCallback
from oomcast.preflight.callbacks import PreflightLightningCallback, fake_copy, resized_batch

MIB = 1 << 20
BIG = 64 << 30  # fits anything here
TINY = 1 * MIB  # fits none of them: the weights alone are larger
T4 = 15360 * MIB  # its total memory, as preflight/gpus.py has it


@pytest.mark.slow
def test_importing_the_callbacks_needs_neither_framework() -> None:
    code = (
        "import sys; import oomcast.preflight as p; p.PreflightTrainerCallback;"
        " import oomcast.preflight.callbacks;"
        " bad = [m for m in ('transformers', 'lightning', 'pytorch_lightning')"
        " if m in sys.modules];"
        " assert not bad, bad"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_the_batch_is_resized_along_its_first_dimension_only() -> None:
    batch = {"ids": torch.ones(4, 7, dtype=torch.long), "scale": torch.ones(3), "n": 5}
    out = resized_batch(batch, 9)
    assert out["ids"].shape == (9, 7) and out["ids"].dtype == torch.long
    assert out["scale"].shape == (3,) and out["n"] == 5


def test_the_fake_copy_has_fake_weights_keeps_them_tied_and_leaves_the_model_real() -> None:
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    model = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 10), nn.BatchNorm1d(10))
    model[1].weight = model[0].weight  # tied, as a language model's head and embedding
    with FakeTensorMode(allow_non_fake_inputs=True):
        copy = fake_copy(model)
    params = list(copy.parameters())
    assert len(params) == len(list(model.parameters())) == 4  # the tied one counted once
    assert copy[1].weight is copy[0].weight and copy[1].weight is not model[0].weight
    assert all(isinstance(t, FakeTensor) for t in [*params, *copy.buffers()])
    assert all(p.requires_grad for p in params)
    assert not any(isinstance(t, FakeTensor) for t in [*model.parameters(), *model.buffers()])


def test_a_batch_without_a_batch_dimension_or_an_empty_loader_is_refused() -> None:
    from oomcast.preflight.callbacks import first_batch

    with pytest.raises(ValueError, match="the batch has no tensor with a batch dimension: dict"):
        resized_batch({"x": torch.tensor(1.0)}, 4)
    with pytest.raises(ValueError, match="the train dataloader is empty"):
        first_batch([])


def test_bad_options_and_no_target_gpu_are_refused_by_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValueError, match="on_oom must be 'stop' or 'warn', not 'ignore'"):
        PreflightTrainerCallback("H100-80GB", on_oom="ignore")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="steps must be at least 1, not 0"):
        PreflightTrainerCallback("H100-80GB", steps=0)
    monkeypatch.delenv("OOMCAST_PREFLIGHT_GPU", raising=False)
    assert not torch.cuda.is_available()
    cb = PreflightTrainerCallback()
    with pytest.raises(ValueError, match=r"needs a GPU to check against.*OOMCAST_PREFLIGHT_GPU"):
        cb.on_train_begin(None, None, None, model=nn.Linear(2, 2), train_dataloader=[])


# --- Hugging Face ---------------------------------------------------------------------------


class Tokens(Dataset[dict[str, torch.Tensor]]):
    def __init__(self, n: int = 64, length: int = 16) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, 100, (n, length), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.ids[i],
            "attention_mask": torch.ones_like(self.ids[i]),
            "labels": self.labels[i],
        }


def hf_trainer(tmp: Path, callback: Any) -> Any:
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=32, num_labels=2,
    )  # fmt: skip
    args = TrainingArguments(
        output_dir=str(tmp), max_steps=2, per_device_train_batch_size=8,
        per_device_eval_batch_size=16, report_to=[], use_cpu=True, save_strategy="no",
        logging_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    model = BertForSequenceClassification(config)
    return Trainer(model=model, args=args, train_dataset=Tokens(), callbacks=[callback])


def param_copy(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.slow
def test_hugging_face_a_job_that_fits_is_reported_and_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cb = PreflightTrainerCallback(capacity_bytes=BIG, remedies=False, name="tiny-bert")
    trainer = hf_trainer(tmp_path, cb)
    trainer.train()
    assert trainer.state.global_step == 2
    report = cb.report
    assert report is not None and report.fits and report.batch_size == 8
    params = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    # the weights, and Adam's two moments of each, are in the peak
    assert report.replay.peak_allocated_bytes >= 3 * params
    phases = {p.phase for p in report.replay.phases}
    assert {"forward", "backward", "optimizer", "eval"} <= phases  # the save: host copies
    err = capsys.readouterr().err
    assert "preflight tiny-bert (batch 8)" in err and "verdict: fits" in err
    # the fake copy left the real model real
    assert all(type(p.data) is torch.Tensor for p in trainer.model.parameters())


@pytest.mark.slow
def test_hugging_face_an_oom_verdict_stops_the_run_before_its_first_step(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OOMCAST_PREFLIGHT_GPU", "T4")  # fits: the variable is read...
    cb = PreflightTrainerCallback(capacity_bytes=TINY, remedies=False)  # ...but an argument wins
    trainer = hf_trainer(tmp_path, cb)
    before = param_copy(trainer.model)
    with pytest.raises(PreflightOOM, match=r"would not fit .*: OOM while loading") as exc:
        trainer.train()
    assert exc.value.report is cb.report and not exc.value.report.fits
    assert trainer.state.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters(), strict=True))
    assert "verdict: OOM" in capsys.readouterr().err


@pytest.mark.slow
def test_hugging_face_warn_only_prints_the_oom_and_trains_and_the_gpu_comes_from_the_env(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OOMCAST_PREFLIGHT_GPU", "T4")
    cb = PreflightTrainerCallback(on_oom="warn", remedies=False, context_bytes=T4 - 256 * 1024)
    trainer = hf_trainer(tmp_path, cb)
    trainer.train()
    assert trainer.state.global_step == 2
    assert cb.report is not None and cb.report.gpu.startswith("T4")
    assert not cb.report.fits  # the allowance leaves the allocator 256 KiB of the T4
    assert "verdict: OOM" in capsys.readouterr().err


# --- Lightning ------------------------------------------------------------------------------


def lightning_module(width: int) -> Any:
    import pytorch_lightning as pl

    class Regressor(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(8, width), nn.ReLU(), nn.Linear(width, 1))
            self.validated = 0

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x), y)
            self.log("train_loss", loss)
            return loss

        def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.validated += 1
            return nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return Regressor()


def lightning_fit(tmp: Path, callback: Any, width: int = 256) -> tuple[Any, Any, Any]:
    import pytorch_lightning as pl

    torch.manual_seed(0)
    data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    trainer = pl.Trainer(
        max_steps=2, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp),
        callbacks=[callback], num_sanity_val_steps=0, limit_val_batches=1,
    )  # fmt: skip
    module = lightning_module(width)
    return trainer, module, data


@pytest.mark.slow
def test_lightning_a_job_that_fits_is_reported_and_trains(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cb = PreflightLightningCallback(capacity_bytes=BIG, remedies=False)
    trainer, module, data = lightning_fit(tmp_path, cb)
    trainer.fit(module, DataLoader(data, batch_size=16), DataLoader(data, batch_size=16))
    assert trainer.global_step == 2
    report = cb.report
    assert report is not None and report.fits and report.batch_size == 16
    assert report.job == "Regressor"
    params = sum(p.numel() * p.element_size() for p in module.parameters())
    assert report.replay.peak_allocated_bytes >= 3 * params  # weights + AdamW's moments
    # its eval is the module's validation_step, run on the fake copy (the module's own
    # counter does not move: validation is not due within 2 steps)
    assert "eval" in {p.phase for p in report.replay.phases} and module.validated == 0
    assert "verdict: fits" in capsys.readouterr().err
    assert all(type(p.data) is torch.Tensor for p in module.parameters())


@pytest.mark.slow
def test_lightning_an_oom_verdict_stops_the_fit_before_its_first_step(tmp_path: Path) -> None:
    cb = PreflightLightningCallback(capacity_bytes=TINY, remedies=False)
    trainer, module, data = lightning_fit(tmp_path, cb, width=2048)
    before = param_copy(module)
    with pytest.raises(PreflightOOM, match="Regressor would not fit"):
        trainer.fit(module, DataLoader(data, batch_size=16))
    assert trainer.global_step == 0
    assert all(torch.equal(a, b) for a, b in zip(before, module.parameters(), strict=True))


def test_phase_figures_are_what_a_hook_needs_to_forecast_each_phase() -> None:
    """Per scheduled phase, its first peak above the allocated level before it; for the
    first optimizer step also its absolute peak. Plain physics: Adam's first step holds the
    weights, their gradients and two moments at once (>= 4x the weights), and an eval that
    keeps its graph (no ``no_grad``) needs more than the same eval under ``no_grad``."""
    sys.path.insert(0, str(Path(__file__).parent))
    from preflight_jobs import param_bytes, wide_mlp

    from oomcast.preflight.api import preflight
    from oomcast.preflight.callbacks import phase_figures

    figures = {}
    for no_grad in (True, False):
        job = wide_mlp(width=512, layers=4, batch_size=64, eval_no_grad=no_grad)
        report = preflight(job, capacity_bytes=BIG, remedies=False, device="cpu")
        figures[no_grad] = phase_figures(report)
    extra, peaks = figures[True]
    assert set(extra) == {"eval", "checkpoint", "optimizer"}
    weights = param_bytes(512, 4)
    assert peaks["optimizer"] >= 4 * weights
    # judged from the start of step 0, where the weights are already loaded
    assert weights <= peaks["optimizer"] - extra["optimizer"] < 2 * weights
    assert extra["optimizer"] >= 3 * weights  # gradients and Adam's two moments
    assert extra["checkpoint"] >= weights  # a device copy of the weights at least
    assert figures[False][0]["eval"] > extra["eval"]


@pytest.mark.slow
def test_hugging_face_the_preflight_announces_its_figures_to_the_jobs_hook(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """The Trainer's oomcast hook learns each phase's figure from the preflight at train
    start, before any phase has run: the service can then forecast a first eval that will
    not fit (docs/phases.md). ``announce=False`` keeps them apart."""
    from oomcast.collectors.hook import MemoryHook
    from oomcast.preflight.callbacks import phase_figures

    for announce in (True, False):
        hook = MemoryHook(
            f"tiny-bert-{announce}", redis_url=redis_url, key_prefix=key_prefix,
            checkpoint_signal=None,
        )  # fmt: skip
        try:
            cb = PreflightTrainerCallback(capacity_bytes=BIG, remedies=False, announce=announce)
            hf_trainer(tmp_path / str(announce), cb).train()
            assert cb.report is not None
            extra, _ = phase_figures(cb.report)
            assert extra and extra.get("eval", 0) > 0
            assert hook.phase_extra_bytes == (extra if announce else {})
        finally:
            hook.close(timeout_s=0.5)
