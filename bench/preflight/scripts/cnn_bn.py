"""A CNN with BatchNorm on 64x64 images: SGD with momentum, a cosine schedule, eval, save.

Usage: python cnn_bn.py [--batch-size N] [--steps N] [--out FILE]
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=64)
p.add_argument("--steps", type=int, default=200)
p.add_argument("--out", default="cnn.pt")
args = p.parse_args()
device = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def block(cin: int, cout: int) -> nn.Module:
    return nn.Sequential(
        nn.Conv2d(cin, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.Conv2d(cout, cout, 3, padding=1, bias=False),
        nn.BatchNorm2d(cout),
        nn.ReLU(inplace=True),
        nn.MaxPool2d(2),
    )


model = nn.Sequential(
    block(3, 32),
    block(32, 64),
    block(64, 128),
    block(128, 256),
    nn.AdaptiveAvgPool2d(1),
    nn.Flatten(),
    nn.Linear(256, 10),
)
model.to(device)
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=5e-4)
sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, args.steps)

for _step in range(args.steps):
    images = torch.randn(args.batch_size, 3, 64, 64)
    labels = torch.randint(0, 10, (args.batch_size,))
    images, labels = images.to(device), labels.to(device)
    out = model(images)
    loss = F.cross_entropy(out, labels)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    sched.step()

model.eval()
correct = 0
with torch.no_grad():
    for _ in range(2):
        images = torch.randn(2 * args.batch_size, 3, 64, 64, device=device)
        correct += int((model(images).argmax(1) == 0).sum())
print("eval correct", correct)
torch.save(model.state_dict(), args.out)
