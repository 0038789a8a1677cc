"""An unmodified Lightning script: an MLP, Adam, a validation loop, the default checkpoint.

Usage: python lightning_mlp.py ROOT_DIR
"""

import sys

import pytorch_lightning as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 10))

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


data = TensorDataset(torch.randn(2048, 64), torch.randint(0, 10, (2048,)))
trainer = pl.Trainer(
    max_epochs=2,
    accelerator="auto",
    devices=1,
    default_root_dir=sys.argv[1],
    enable_progress_bar=False,
    logger=False,
)
trainer.fit(Model(), DataLoader(data, batch_size=32), DataLoader(data, batch_size=64))
