"""A ResNet from Hugging Face transformers' config (no download): AdamW, a plain loop.

Usage: python hf_resnet.py [--batch-size N] [--steps N] [--out DIR]
"""

import argparse

import torch
from transformers import ResNetConfig, ResNetForImageClassification

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--steps", type=int, default=100)
p.add_argument("--out", default="resnet-out")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"

config = ResNetConfig(
    embedding_size=32,
    hidden_sizes=[64, 128, 256, 512],
    depths=[1, 1, 2, 1],
    layer_type="bottleneck",
    num_labels=20,
)
model = ResNetForImageClassification(config).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.05)

model.train()
for step in range(args.steps):
    pixels = torch.randn(args.batch_size, 3, 96, 96, device=device)
    labels = torch.randint(0, 20, (args.batch_size,), device=device)
    out = model(pixel_values=pixels, labels=labels)
    out.loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step}: {out.loss.item():.3f}")

model.eval()
with torch.no_grad():
    logits = model(pixel_values=torch.randn(args.batch_size, 3, 96, 96, device=device)).logits
print("eval top class", logits.argmax(-1)[0].item())
model.save_pretrained(args.out)
