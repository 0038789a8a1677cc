"""A causal transformer LM on batches of varying length (the length of each batch drawn with
Python's random, seeded), padded to a multiple of 8, with F.scaled_dot_product_attention.

Usage: python varlen_lm.py [--batch-size N] [--steps N] [--out FILE]
"""

import argparse
import random

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--out", default="varlen.pt")
p.add_argument("--seed", type=int, default=0)
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
random.seed(args.seed)
VOCAB, DIM, HEADS, LAYERS, MAXLEN = 8000, 256, 8, 4, 384


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.qkv = nn.Linear(DIM, 3 * DIM)
        self.proj = nn.Linear(DIM, DIM)
        self.mlp = nn.Sequential(nn.Linear(DIM, 4 * DIM), nn.GELU(), nn.Linear(4 * DIM, DIM))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, HEADS, DIM // HEADS).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, t, DIM))
        return x + self.mlp(self.ln2(x))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok = nn.Embedding(VOCAB, DIM)
        self.pos = nn.Embedding(MAXLEN, DIM)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.ln = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)
        self.head.weight = self.tok.weight  # tied

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1], device=ids.device))
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.ln(x))


model = LM().to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
for _step in range(args.steps):
    length = random.randint(64, MAXLEN - 1)
    length = (length + 7) // 8 * 8
    ids = torch.randint(0, VOCAB, (args.batch_size, length + 1), device=device)
    logits = model(ids[:, :-1])
    loss = F.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

model.eval()
with torch.inference_mode():
    ids = torch.randint(0, VOCAB, (args.batch_size, MAXLEN), device=device)
    print("eval logits", tuple(model(ids).shape))
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.out)
