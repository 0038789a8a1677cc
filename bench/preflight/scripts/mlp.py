"""A tabular MLP: Adam, a train loop, an eval under no_grad, torch.save at the end.

Usage: python mlp.py [--batch-size N] [--steps N] [--out FILE]
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=256)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--out", default="mlp.pt")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

model = nn.Sequential(
    nn.Linear(512, 2048),
    nn.ReLU(),
    nn.Dropout(0.1),
    nn.Linear(2048, 2048),
    nn.ReLU(),
    nn.Dropout(0.1),
    nn.Linear(2048, 2048),
    nn.ReLU(),
    nn.Linear(2048, 100),
).to(device)
opt = torch.optim.Adam(model.parameters(), lr=1e-3)

for step in range(args.steps):
    x = torch.randn(args.batch_size, 512).to(device)
    y = torch.randint(0, 100, (args.batch_size,)).to(device)
    loss = F.cross_entropy(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    if step % 10 == 0:
        print(f"step {step} loss {loss.item():.4f}")

model.eval()
with torch.no_grad():
    x = torch.randn(4 * args.batch_size, 512, device=device)
    acc = model(x).argmax(1) == torch.randint(0, 100, (4 * args.batch_size,), device=device)
    print(f"eval acc {acc.float().mean().item():.3f}")
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.out)
