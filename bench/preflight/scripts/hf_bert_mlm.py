"""Masked-language-model pretraining of a BERT from transformers' config (no download), in
a plain loop with gradient accumulation over 2 micro-batches.

Usage: python hf_bert_mlm.py [--batch-size N] [--steps N] [--out FILE]
"""

import argparse

import torch
from transformers import BertConfig, BertForMaskedLM

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=16)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--accum", type=int, default=2)
p.add_argument("--out", default="bert.pt")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
SEQ, VOCAB = 128, 12000

model = BertForMaskedLM(
    BertConfig(
        vocab_size=VOCAB,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=4,
        intermediate_size=1024,
        max_position_embeddings=SEQ,
    )
).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
micro = args.batch_size // args.accum


def batch(n: int) -> dict:
    ids = torch.randint(5, VOCAB, (n, SEQ))
    labels = ids.clone()
    mask = torch.rand(n, SEQ) < 0.15
    labels[~mask] = -100
    ids[mask] = 4  # [MASK]
    return {
        "input_ids": ids.to(device),
        "attention_mask": torch.ones_like(ids).to(device),
        "labels": labels.to(device),
    }


for _step in range(args.steps):
    for _ in range(args.accum):
        loss = model(**batch(micro)).loss / args.accum
        loss.backward()
    opt.step()
    opt.zero_grad()

model.eval()
with torch.no_grad():
    print("eval loss", model(**batch(args.batch_size)).loss.item())
torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, args.out)
