"""The corpus's programs: real training and serving jobs, each driven by a run's script.

Thirteen programs. Seven are PyTorch loops written here (``training/programs.py``: an MLP
on tabular data, a CNN classifier, a Transformer and an LSTM language model, a conv
autoencoder, a two-tower recommender, a GAN). Six are built on what users run, with their
own loops, evaluation and checkpointing:

- ``hf_bert_trainer``: Hugging Face ``Trainer`` fine-tuning a BERT classifier;
- ``hf_gpt2_accelerate``: a GPT-2 language model in an ``accelerate`` loop, with
  ``gather_for_metrics`` in its evaluation and ``save_state`` checkpoints;
- ``lightning_cnn``: a PyTorch Lightning module fitted by ``Trainer.fit``, with its
  validation loop and ``ModelCheckpoint``;
- ``timm_vit``: a timm vision transformer with timm's optimizer factory, Mixup, soft-target
  loss and weight EMA;
- ``dataloader_workers``: a CNN fed by a two-worker ``DataLoader`` reading image shards
  from disk (the workers are processes of the same container);
- ``inference_server``: a FastAPI app under uvicorn serving an encoder, with a client
  sending it batches of requests over HTTP.

Every model is built from a config (nothing is downloaded).

timm imports torchvision, and torchvision's wheels cannot load their compiled operators
beside the CPU build of torch (they link torch's CUDA libraries): ``import torchvision``
then fails in its fake-kernel registrations (``operator torchvision::nms does not exist``).
Installed in the environment, that breaks every other library that imports torchvision when
it finds it (transformers, Lightning). So timm and torchvision are installed apart, in
``.venv/timm-site`` (``pip install --target .venv/timm-site --no-deps timm==1.0.31
torchvision==0.28.0``, or a folder named by ``OOMCAST_TIMM_SITE``), which only the
``timm_vit`` program puts on its path; before importing timm it declares the two operator
schemas torchvision registers fake kernels for (``nms``, ``qnms``: detection ops that no
classification model calls), so the import succeeds, and a call of either would still fail.

    python -m oomcast.training.corpus.run cnn_classifier --script '{"duration_s": 30, ...}'
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from oomcast.training.corpus.driver import Driver, JobHooks, Script

PLAIN = ("mlp_tabular", "cnn_classifier", "transformer_lm", "lstm_lm", "autoencoder",
         "recsys", "gan")  # fmt: skip
FRAMEWORK = ("hf_bert_trainer", "hf_gpt2_accelerate", "lightning_cnn", "timm_vit",
             "dataloader_workers", "inference_server")  # fmt: skip
PROGRAMS = PLAIN + FRAMEWORK


def _first_tensor(batch: Any) -> torch.Tensor:
    while isinstance(batch, tuple | list):
        batch = batch[0]
    assert isinstance(batch, torch.Tensor)
    return batch


def _captures(script: Script) -> bool:
    """Whether any behaviour keeps layer outputs (only then is the hook worth its cost)."""
    return any(p.kind in ("leak", "eval_accum", "eval_spike") for p in script.phases)


def _steps_per(script: Script) -> Callable[[float], int]:
    """Seconds -> steps at the script's period (frameworks count their periods in steps)."""

    def steps(seconds: float) -> int:
        return max(1, round(seconds / script.period_s))

    return steps


def _scratch(tag: str) -> Path:
    path = Path(tempfile.mkdtemp(prefix=f"oomcast-{tag}-"))
    import atexit

    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


# --- the PyTorch loops of training/programs.py ---------------------------------------------
def run_plain(program: str, script: Script, stats: str | None) -> None:
    from oomcast.training import programs

    classes = {"mlp_tabular": programs.MLPTabular, "cnn_classifier": programs.CNNClassifier,
               "transformer_lm": programs.TransformerLM, "lstm_lm": programs.LSTMLM,
               "autoencoder": programs.ConvAutoencoder, "recsys": programs.RecSys,
               "gan": programs.GAN, "dataloader_workers": programs.DataLoaderTrain}  # fmt: skip
    args = argparse.Namespace(batch=script.batch, width=script.width, seq=script.seq,
                              seed=script.seed, flush_every=20)  # fmt: skip
    job = classes[program](args)
    held_out = [job.inputs(job.batch, script.seq) for _ in range(2)]
    ckpt = _scratch("ckpt") / "model.pt"

    def checkpoint() -> None:
        state = {"model": job.model.state_dict()}
        if job.opt is not None:
            state["optim"] = job.opt.state_dict()
        torch.save(state, ckpt)

    def evaluate() -> None:
        job.evaluate(held_out, grad=False)

    hooks = JobHooks(
        leak_module=job.leak_layer() if _captures(script) else None,
        make_input=lambda: _first_tensor(job.inputs(4, script.seq)).float(),
        state=lambda: {"model": job.model.state_dict(),
                       "optim": job.opt.state_dict() if job.opt is not None else {}},
        healthy_eval=evaluate,
        healthy_ckpt=checkpoint if job.trains else None,
    )  # fmt: skip
    driver = Driver(script, stats, hooks)
    try:
        while not driver.finished():
            batch, seq = driver.size(job.batch, script.seq, job.sequence)
            driver.begin_step()
            job.step(job.inputs(batch, seq))
            driver.end_step()
    finally:
        driver.close()


# --- Hugging Face Trainer ------------------------------------------------------------------
def run_hf_bert_trainer(script: Script, stats: str | None) -> None:
    import transformers
    from transformers import (
        BertConfig,
        BertForSequenceClassification,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    transformers.logging.set_verbosity_error()  # type: ignore[no-untyped-call]
    cfg = BertConfig(  # type: ignore[call-arg]  # num_labels goes through **kwargs
        vocab_size=8000, hidden_size=script.width // 4, num_hidden_layers=2,
        num_attention_heads=4, intermediate_size=script.width, num_labels=4,
        max_position_embeddings=8192,
    )  # fmt: skip
    model = BertForSequenceClassification(cfg)
    gen = torch.Generator().manual_seed(script.seed)
    hooks = JobHooks(
        leak_module=model.bert.encoder.layer[0] if _captures(script) else None,
        make_input=lambda: torch.randint(0, 8000, (4, script.seq), generator=gen).float(),
        state=lambda: {"model": model.state_dict()},
    )
    driver = Driver(script, stats, hooks)

    class Tokens(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
        def __init__(self, n: int) -> None:
            self.n = n

        def __len__(self) -> int:
            return self.n

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {"label": torch.tensor(i % 4)}

    def collate(items: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        length = driver.size(script.batch, script.seq, True)[1]
        ids = torch.randint(0, 8000, (len(items), length), generator=gen)
        return {"input_ids": ids, "labels": torch.stack([it["label"] for it in items])}

    class Drive(TrainerCallback):
        def on_step_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            driver.begin_step()

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            driver.end_step()
            if driver.finished():
                control.should_training_stop = True

    steps = _steps_per(script)
    targs = TrainingArguments(
        output_dir=str(_scratch("hf")), max_steps=10**7,
        per_device_train_batch_size=script.batch, per_device_eval_batch_size=script.batch,
        eval_strategy="steps", eval_steps=steps(script.eval_every_s),
        save_strategy="steps", save_steps=steps(script.ckpt_every_s), save_total_limit=1,
        logging_strategy="no", report_to=[], use_cpu=True, dataloader_num_workers=0,
        disable_tqdm=True, seed=script.seed,
    )  # fmt: skip
    trainer = Trainer(
        model=model, args=targs, train_dataset=Tokens(10**5), eval_dataset=Tokens(4 * script.batch),
        data_collator=collate, callbacks=[Drive()],
    )  # fmt: skip
    try:
        trainer.train()
    finally:
        driver.close()


# --- GPT-2 in an accelerate loop -----------------------------------------------------------
def run_hf_gpt2_accelerate(script: Script, stats: str | None) -> None:
    from accelerate import Accelerator
    from transformers import GPT2Config, GPT2LMHeadModel

    acc = Accelerator(cpu=True)
    cfg = GPT2Config(vocab_size=8000, n_positions=8192, n_embd=script.width // 4, n_layer=2,
                     n_head=4)  # fmt: skip
    raw = GPT2LMHeadModel(cfg)
    opt = torch.optim.AdamW(raw.parameters(), lr=3e-4)
    model, opt = acc.prepare(raw, opt)
    gen = torch.Generator().manual_seed(script.seed)
    ckpt_dir = _scratch("accel")

    def tokens(n: int, length: int) -> torch.Tensor:
        return torch.randint(0, 8000, (n, length), generator=gen)

    held_out = [tokens(script.batch, script.seq) for _ in range(4)]

    def evaluate() -> None:
        model.eval()
        preds = []
        with torch.no_grad():
            for ids in held_out:
                logits = model(input_ids=ids).logits
                preds.append(acc.gather_for_metrics(logits.argmax(-1)))
        model.train()
        torch.cat(preds).float().mean()

    hooks = JobHooks(
        leak_module=raw.transformer.h[0] if _captures(script) else None,
        make_input=lambda: tokens(4, script.seq).float(),
        state=lambda: {"model": raw.state_dict(), "optim": opt.state_dict()},
        healthy_eval=evaluate,
        healthy_ckpt=lambda: acc.save_state(str(ckpt_dir)),
    )
    driver = Driver(script, stats, hooks)
    model.train()
    try:
        while not driver.finished():
            _, length = driver.size(script.batch, script.seq, True)
            driver.begin_step()
            ids = tokens(script.batch, length)
            loss = model(input_ids=ids, labels=ids).loss
            acc.backward(loss)
            opt.step()
            opt.zero_grad(set_to_none=True)
            driver.end_step()
    finally:
        driver.close()


# --- PyTorch Lightning -----------------------------------------------------------------------
def run_lightning_cnn(script: Script, stats: str | None) -> None:
    import pytorch_lightning as pl
    from pytorch_lightning.callbacks import ModelCheckpoint

    from oomcast.training.workloads import small_cnn

    class LitCNN(pl.LightningModule):
        def __init__(self, width: int) -> None:
            super().__init__()
            self.net = small_cnn(width // 32)

        def training_step(self, batch: Any, _idx: int) -> torch.Tensor:
            x, y = batch
            return F.cross_entropy(self.net(x), y)

        def validation_step(self, batch: Any, _idx: int) -> torch.Tensor:
            x, y = batch
            loss = F.cross_entropy(self.net(x), y)
            self.log("val_loss", loss)
            return loss

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)

    lit = LitCNN(script.width)
    gen = torch.Generator().manual_seed(script.seed)

    def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.randn(n, 3, 64, 64, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    hooks = JobHooks(
        leak_module=lit.net[2] if _captures(script) else None,
        make_input=lambda: images(4)[0],
        state=lambda: {"model": lit.state_dict()},
    )
    driver = Driver(script, stats, hooks)

    class Batches(torch.utils.data.IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
        def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
            while True:
                yield images(driver.size(script.batch, script.seq, False)[0])

    class Drive(pl.Callback):
        def on_train_batch_start(self, trainer: Any, module: Any, batch: Any, idx: int) -> None:
            driver.begin_step()

        def on_train_batch_end(self, trainer: Any, module: Any, out: Any, batch: Any, idx: int
                               ) -> None:  # fmt: skip
            driver.end_step()
            if driver.finished():
                trainer.should_stop = True

    steps = _steps_per(script)
    val = torch.utils.data.TensorDataset(*images(4 * script.batch))
    trainer = pl.Trainer(
        accelerator="cpu", devices=1, max_epochs=-1, max_steps=-1, logger=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
        val_check_interval=steps(script.eval_every_s), check_val_every_n_epoch=None,
        callbacks=[Drive(), ModelCheckpoint(dirpath=str(_scratch("lightning")), save_top_k=1,
                   every_n_train_steps=steps(script.ckpt_every_s))],
    )  # fmt: skip
    loader = torch.utils.data.DataLoader(Batches(), batch_size=None)
    try:
        trainer.fit(
            lit,
            train_dataloaders=loader,
            val_dataloaders=torch.utils.data.DataLoader(val, batch_size=script.batch),
        )
    finally:
        driver.close()


# --- timm ------------------------------------------------------------------------------------
def timm_site() -> Path:
    """Where timm and torchvision are installed apart (see the module docstring)."""
    default = Path(sys.prefix) / "timm-site"
    return Path(os.environ.get("OOMCAST_TIMM_SITE", str(default)))


def import_timm() -> Any:
    """timm, importable beside the CPU build of torch (see the module docstring)."""
    site = timm_site()
    if site.is_dir() and str(site) not in sys.path:
        sys.path.insert(0, str(site))
    for op in ("nms", "qnms"):
        with contextlib.suppress(RuntimeError):  # already there: torchvision's ops did load
            torch.library.define(
                f"torchvision::{op}", "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor"
            )
    import timm

    return timm


def run_timm_vit(script: Script, stats: str | None) -> None:
    timm = import_timm()
    from timm.data import Mixup
    from timm.loss import SoftTargetCrossEntropy
    from timm.optim import create_optimizer_v2
    from timm.utils import ModelEmaV3

    model = timm.create_model("vit_tiny_patch16_224", img_size=64, patch_size=8, num_classes=10,
                              embed_dim=script.width // 4, depth=4, num_heads=4)  # fmt: skip
    opt = create_optimizer_v2(model, "adamw", lr=1e-3, weight_decay=0.05)
    ema = ModelEmaV3(model, decay=0.999)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, num_classes=10)
    loss_fn = SoftTargetCrossEntropy()
    gen = torch.Generator().manual_seed(script.seed)
    ckpt = _scratch("timm") / "model.pt"

    def images(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        n += n % 2  # Mixup pairs the batch with its flip: an even batch
        return torch.randn(n, 3, 64, 64, generator=gen), torch.randint(0, 10, (n,), generator=gen)

    held_out = [images(script.batch) for _ in range(2)]

    def evaluate() -> None:
        ema.module.eval()
        with torch.no_grad():
            for x, y in held_out:
                F.cross_entropy(ema.module(x), y)

    hooks = JobHooks(
        leak_module=model.blocks[0] if _captures(script) else None,
        make_input=lambda: images(4)[0],
        state=lambda: {"model": model.state_dict(), "ema": ema.state_dict(),
                       "optim": opt.state_dict()},
        healthy_eval=evaluate,
        healthy_ckpt=lambda: torch.save({"model": model.state_dict(), "ema": ema.state_dict()},
                                        ckpt),
    )  # fmt: skip
    driver = Driver(script, stats, hooks)
    model.train()
    try:
        while not driver.finished():
            n, _ = driver.size(script.batch, script.seq, False)
            driver.begin_step()
            x, y = mixup(*images(n))
            loss = loss_fn(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            ema.update(model)
            driver.end_step()
    finally:
        driver.close()


# --- an inference server ----------------------------------------------------------------------
def run_inference_server(script: Script, stats: str | None) -> None:
    import random

    import httpx
    import uvicorn
    from fastapi import FastAPI

    from oomcast.training.programs import DecoderBlock

    d = script.width // 4
    vocab = 5000
    encoder = nn.Sequential(nn.Embedding(vocab, d), *(DecoderBlock(d, 4) for _ in range(2)))
    head = nn.Linear(d, 32)
    encoder.eval()
    app = FastAPI()

    @app.post("/v1/embed")
    def embed(body: dict[str, list[list[int]]]) -> dict[str, list[list[float]]]:
        ids = torch.tensor(body["ids"])
        with torch.no_grad():
            vectors = head(encoder(ids).mean(1))
        return {"vectors": vectors.tolist()}

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the inference server did not start")
        time.sleep(0.05)
    rng = random.Random(script.seed)
    hooks = JobHooks(
        leak_module=encoder[1] if _captures(script) else None,
        make_input=lambda: torch.randint(0, vocab, (4, script.seq)).float(),
        state=lambda: {"encoder": encoder.state_dict(), "head": head.state_dict()},
    )
    driver = Driver(script, stats, hooks)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as client:
            while not driver.finished():
                batch, length = driver.size(script.batch, script.seq, True)
                burst = max(1, int(batch * rng.uniform(0.3, 1.7)))  # load varies per request
                driver.begin_step()
                ids = [[rng.randrange(vocab) for _ in range(length)] for _ in range(burst)]
                client.post("/v1/embed", json={"ids": ids}).raise_for_status()
                driver.end_step()
    finally:
        driver.close()
        server.should_exit = True
        thread.join(timeout=10)


RUNNERS: dict[str, Callable[[Script, str | None], None]] = {
    "hf_bert_trainer": run_hf_bert_trainer,
    "hf_gpt2_accelerate": run_hf_gpt2_accelerate,
    "lightning_cnn": run_lightning_cnn,
    "timm_vit": run_timm_vit,
    "inference_server": run_inference_server,
}


def run(program: str, script: Script, stats: str | None) -> None:
    torch.manual_seed(script.seed)
    torch.set_num_threads(1)
    if program in RUNNERS:
        RUNNERS[program](script, stats)
    else:
        run_plain(program, script, stats)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m oomcast.training.corpus.run",
        description="One program of the real-job corpus, driven by a run's script.",
    )
    p.add_argument("program", choices=PROGRAMS)
    p.add_argument("--script", required=True, help="the run's script (JSON)")
    p.add_argument("--stats", default=None, help="append step statistics (JSON lines) here")
    args = p.parse_args(argv)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    run(args.program, Script.from_json(args.script), args.stats)
    return 0


if __name__ == "__main__":
    sys.exit(main())
