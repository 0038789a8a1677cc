"""The same kind of GPT-2 trained with gradient checkpointing switched on the Hugging Face
way (``model.gradient_checkpointing_enable()``), longer sequences, eval, save_pretrained.

Usage: python hf_gpt2_ckpt.py [--batch-size N] [--steps N] [--out DIR]
"""

import argparse

import torch
from transformers import GPT2Config, GPT2LMHeadModel

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--out", default="gpt2-ckpt-out")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
SEQ = 512

model = GPT2LMHeadModel(
    GPT2Config(vocab_size=8192, n_positions=SEQ, n_embd=384, n_layer=6, n_head=6)
).to(device)
model.gradient_checkpointing_enable()
model.config.use_cache = False
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

model.train()
for _step in range(args.steps):
    ids = torch.randint(0, 8192, (args.batch_size, SEQ)).to(device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)

model.eval()
with torch.no_grad():
    ids = torch.randint(0, 8192, (args.batch_size, SEQ)).to(device)
    print("eval loss", model(input_ids=ids, labels=ids).loss.item())
model.save_pretrained(args.out)
