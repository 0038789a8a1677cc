"""An unmodified Lightning script: an MLP, Adam, a validation loop, the default checkpoint.

Usage: python lightning_mlp.py ROOT_DIR [--batch-size N] [--max-steps N] [--precision P]
[--accumulate N]
"""

import argparse

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

p = argparse.ArgumentParser()
p.add_argument("root_dir")
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--max-steps", type=int, default=-1)
p.add_argument("--precision", default="32-true")
p.add_argument("--accumulate", type=int, default=1)
cli = p.parse_args()


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(
            nn.Linear(512, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(), nn.Linear(4096, 10)
        )

    def training_step(self, batch, i):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self.net(x), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3)


data = TensorDataset(torch.randn(512, 512), torch.randint(0, 10, (512,)))
trainer = pl.Trainer(
    max_epochs=2,
    max_steps=cli.max_steps,
    accelerator="auto",
    devices=1,
    precision=cli.precision,
    accumulate_grad_batches=cli.accumulate,
    default_root_dir=cli.root_dir,
    enable_progress_bar=False,
    logger=False,
)
trainer.fit(
    Model(),
    DataLoader(data, batch_size=cli.batch_size),
    DataLoader(data, batch_size=2 * cli.batch_size),
)
