"""A GPT-2 from Hugging Face transformers' config (no download): AdamW with a warmup
schedule, gradient clipping, an eval under no_grad, torch.save.

Usage: python hf_gpt2.py [--batch-size N] [--seq N] [--steps N] [--out FILE]
"""

import argparse
import math

import torch
from transformers import GPT2Config, GPT2LMHeadModel, get_linear_schedule_with_warmup

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=8)
p.add_argument("--seq", type=int, default=256)
p.add_argument("--steps", type=int, default=1000)
p.add_argument("--out", default="gpt2.pt")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

config = GPT2Config(vocab_size=8192, n_positions=512, n_embd=256, n_layer=4, n_head=4)
model = GPT2LMHeadModel(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1)
sched = get_linear_schedule_with_warmup(opt, 100, args.steps)

for _step in range(args.steps):
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device=device)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)

model.eval()
with torch.no_grad():
    ids = torch.randint(0, config.vocab_size, (args.batch_size, args.seq), device=device)
    print(f"eval ppl {math.exp(model(input_ids=ids, labels=ids).loss.item()):.1f}")
torch.save(model.state_dict(), args.out)
