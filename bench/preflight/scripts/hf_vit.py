"""A ViT from Hugging Face transformers' config (no download), with a validation pass that
forgets ``no_grad`` (it only calls ``model.eval()``), as real scripts sometimes do.

Usage: python hf_vit.py [--batch-size N] [--steps N] [--out FILE]
"""

import argparse

import torch
from transformers import ViTConfig, ViTForImageClassification

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--out", default="vit.pt")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

config = ViTConfig(
    image_size=64,
    patch_size=8,
    hidden_size=256,
    num_hidden_layers=4,
    num_attention_heads=8,
    intermediate_size=1024,
    num_labels=100,
)
model = ViTForImageClassification(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4)

for _step in range(args.steps):
    pixels = torch.randn(args.batch_size, 3, 64, 64).to(device)
    labels = torch.randint(0, 100, (args.batch_size,)).to(device)
    loss = model(pixel_values=pixels, labels=labels).loss
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)

model.eval()  # no torch.no_grad(): the activations are kept for a backward that never comes
pixels = torch.randn(2 * args.batch_size, 3, 64, 64).to(device)
val_loss = model(
    pixel_values=pixels, labels=torch.zeros(2 * args.batch_size, dtype=torch.long, device=device)
).loss
print(f"val loss {val_loss.item():.3f}")
torch.save(
    {"model": model.state_dict(), "optimizer": opt.state_dict(), "step": args.steps}, args.out
)
