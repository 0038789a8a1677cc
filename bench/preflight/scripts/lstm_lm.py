"""A word-level LSTM language model with truncated backprop through time (the hidden state
is carried over and detached), gradient clipping, an eval, a save.

Usage: python lstm_lm.py [--batch-size N] [--steps N] [--out FILE]
"""

import argparse

import torch
import torch.nn.functional as F
from torch import nn

p = argparse.ArgumentParser()
p.add_argument("--batch-size", type=int, default=32)
p.add_argument("--steps", type=int, default=500)
p.add_argument("--bptt", type=int, default=64)
p.add_argument("--out", default="lstm.pt")
args = p.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 10000


class LSTMLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 400)
        self.rnn = nn.LSTM(400, 512, num_layers=2, dropout=0.2, batch_first=True)
        self.out = nn.Linear(512, VOCAB)

    def forward(self, x, state=None):
        h, state = self.rnn(self.emb(x), state)
        return self.out(h), state


model = LSTMLM().to(device)
opt = torch.optim.SGD(model.parameters(), lr=1.0)
state = None
for _step in range(args.steps):
    text = torch.randint(0, VOCAB, (args.batch_size, args.bptt + 1)).to(device)
    if state is not None:
        state = tuple(s.detach() for s in state)
    logits, state = model(text[:, :-1], state)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), text[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    nn.utils.clip_grad_norm_(model.parameters(), 0.25)
    opt.step()

model.eval()
with torch.no_grad():
    text = torch.randint(0, VOCAB, (args.batch_size, args.bptt + 1)).to(device)
    logits, _ = model(text[:, :-1])
    print("eval loss", F.cross_entropy(logits.reshape(-1, VOCAB), text[:, 1:].reshape(-1)).item())
torch.save(model, args.out)
