"""An ordinary training script: a small transformer LM, AdamW, a loop, an eval, torch.save.

Usage: python plain_lm.py [--batch-size N] [--layers N] [--dim N] [--out FILE]
"""

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--steps", type=int, default=20)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--dim", type=int, default=256)
p.add_argument("--eval-every", type=int, default=2)
p.add_argument("--out", default="ckpt.pt")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
V, T = 5000, 128


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(V, args.dim)
        self.pos = nn.Parameter(torch.zeros(T, args.dim))
        layer = nn.TransformerEncoderLayer(args.dim, 4, 4 * args.dim, batch_first=True)
        self.body = nn.TransformerEncoder(layer, args.layers)
        self.head = nn.Linear(args.dim, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mask = torch.triu(torch.ones(T, T, device=x.device, dtype=torch.bool), 1)
        return self.head(self.body(self.emb(x) + self.pos, mask=mask))


model = LM().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
for step in range(args.steps):
    x = torch.randint(0, V, (args.batch_size, T + 1)).to(device)
    logits = model(x[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step} loss {loss.item():.3f}")
    if (step + 1) % args.eval_every == 0:
        model.eval()
        with torch.no_grad():
            xe = torch.randint(0, V, (2 * args.batch_size, T + 1), device=device)
            el = F.cross_entropy(model(xe[:, :-1]).flatten(0, 1), xe[:, 1:].flatten())
        print(f"eval loss {el.item():.3f} ppl {math.exp(el.item()):.1f}")
        model.train()
        torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.out)
