"""Capture the tensor allocations of real PyTorch training loops, on CPU.

A ``TorchDispatchMode`` sees every operator that produces a tensor; the first time a
storage appears it is an allocation, and a ``weakref.finalize`` on the storage reports its
free. Parameters and buffers that exist before the loop are recorded as persistent. Each
allocation carries the phase of the loop (forward, backward, optimizer, eval, checkpoint)
and the module that was running. The byte sizes can be scaled afterwards, so a small CPU
run stands for a large GPU job with the same allocation pattern.

The result is an :class:`AllocationLog`: per training step, the ordered list of
allocations and frees, which ``training/scenarios.py`` replays through the
caching-allocator simulator.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from oomcast.training.module_stack import ModuleStack

PHASES = ("forward", "backward", "optimizer", "eval", "checkpoint", "other")


@dataclass
class Op:
    """One allocation (``size`` > 0 bytes) or free (``size`` == 0) of tensor storage ``sid``."""

    alloc: bool
    sid: int
    size: int
    phase: str
    module: str

    def to_list(self) -> list[Any]:
        return [1 if self.alloc else 0, self.sid, self.size, self.phase, self.module]


@dataclass
class StepLog:
    kind: str  # "train", "eval" or "checkpoint"
    ops: list[Op] = field(default_factory=list)


@dataclass
class AllocationLog:
    """What one captured run allocated: persistent storages, then the ops of each step."""

    model: str
    config: dict[str, Any]
    persistent: list[Op] = field(default_factory=list)
    steps: list[StepLog] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "model": self.model,
            "config": self.config,
            "persistent": [op.to_list() for op in self.persistent],
            "steps": [{"kind": s.kind, "ops": [op.to_list() for op in s.ops]} for s in self.steps],
        }

    @classmethod
    def from_json(cls, obj: dict[str, Any]) -> AllocationLog:
        def op(x: list[Any]) -> Op:
            return Op(bool(x[0]), int(x[1]), int(x[2]), str(x[3]), str(x[4]))

        return cls(
            model=obj["model"],
            config=obj["config"],
            persistent=[op(x) for x in obj["persistent"]],
            steps=[StepLog(s["kind"], [op(x) for x in s["ops"]]) for s in obj["steps"]],
        )

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with gzip.open(path, "wt", encoding="utf-8") as fh:
            json.dump(self.to_json(), fh, separators=(",", ":"))

    @classmethod
    def load(cls, path: Path) -> AllocationLog:
        with gzip.open(path, "rt", encoding="utf-8") as fh:
            return cls.from_json(json.load(fh))

    def persistent_bytes(self) -> int:
        return sum(op.size for op in self.persistent if op.alloc)

    def peak_bytes(self, kind: str = "train") -> int:
        """Highest live bytes within steps of a kind, persistent storages included."""
        live: dict[int, int] = {op.sid: op.size for op in self.persistent if op.alloc}
        peak = sum(live.values())
        for step in self.steps:
            for op in step.ops:
                if op.alloc:
                    live[op.sid] = op.size
                else:
                    live.pop(op.sid, None)
                if step.kind == kind:
                    peak = max(peak, sum(live.values()))
        return peak


class AllocationTracker(TorchDispatchMode):  # type: ignore[no-untyped-call]  # torch: unannotated
    # (TorchDispatchMode's __init_subclass__ and __init__ carry no annotations)
    """Records storage allocations and frees of every operator run under it."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]  # torch: unannotated __init__
        self.phase = "other"
        self.ops: list[Op] = []
        self._live: dict[int, int] = {}  # data_ptr -> storage id
        self._next_id = 1
        self.modules = ModuleStack()

    # -- modules ------------------------------------------------------------------------------
    def watch(self, model: nn.Module) -> None:
        """Label allocations with the module whose forward is running."""
        self.modules.watch(model)

    def close(self) -> None:
        self.modules.close()

    # -- storages -----------------------------------------------------------------------------
    def adopt(self, tensors: Iterator[torch.Tensor]) -> list[Op]:
        """Register storages that exist already (parameters, buffers) as persistent."""
        out = []
        for t in tensors:
            op = self._see(t, phase="persistent", module="")
            if op is not None:
                out.append(op)
        return out

    def _see(self, t: torch.Tensor, phase: str, module: str) -> Op | None:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        size = st.nbytes()
        if ptr == 0 or size == 0 or ptr in self._live:
            return None
        sid = self._next_id
        self._next_id += 1
        self._live[ptr] = sid
        op = Op(True, sid, size, phase, module)
        weakref.finalize(st, self._freed, ptr, sid)
        return op

    def _freed(self, ptr: int, sid: int) -> None:
        if self._live.get(ptr) == sid:
            del self._live[ptr]
            self.ops.append(Op(False, sid, 0, self.phase, ""))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        module = self.modules.current
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                op = self._see(t, self.phase, module)
                if op is not None:
                    self.ops.append(op)
        return out

    @contextlib.contextmanager
    def in_phase(self, phase: str) -> Iterator[None]:
        before, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = before

    def take(self) -> list[Op]:
        ops, self.ops = self.ops, []
        return ops


# -- the models -----------------------------------------------------------------------------


class _LSTMLM(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.lstm = nn.LSTM(dim, dim, layers, batch_first=True)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(self.embed(x))
        logits: torch.Tensor = self.head(out)
        return logits


class _Encoder(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, batch_first=True, dropout=0.1)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits: torch.Tensor = self.head(self.encoder(self.embed(x)))
        return logits


@dataclass(frozen=True)
class ModelSpec:
    build: Callable[[dict[str, Any]], nn.Module]
    batch: Callable[[dict[str, Any], torch.Generator, int], tuple[torch.Tensor, torch.Tensor]]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    defaults: dict[str, Any]


def _tokens(
    cfg: dict[str, Any], g: torch.Generator, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    seq = int(cfg["seq"])
    if cfg.get("varlen"):
        seq = int(torch.randint(max(2, seq // 4), seq + 1, (1,), generator=g))
    x = torch.randint(0, cfg["vocab"], (cfg["batch"], seq), generator=g)
    return x, torch.randint(0, cfg["vocab"], (cfg["batch"], seq), generator=g)


def _lm_loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(out.reshape(-1, out.shape[-1]), y.reshape(-1))


MODELS: dict[str, ModelSpec] = {
    "mlp": ModelSpec(
        build=lambda c: nn.Sequential(
            nn.Linear(c["dim"], c["hidden"]),
            nn.ReLU(),
            nn.Linear(c["hidden"], c["hidden"]),
            nn.ReLU(),
            nn.Linear(c["hidden"], 10),
        ),
        batch=lambda c, g, s: (
            torch.randn(c["batch"], c["dim"], generator=g),
            torch.randint(0, 10, (c["batch"],), generator=g),
        ),
        loss=nn.functional.cross_entropy,
        defaults={"dim": 256, "hidden": 512, "batch": 64},
    ),
    "cnn": ModelSpec(
        build=lambda c: nn.Sequential(
            nn.Conv2d(3, c["width"], 3, padding=1),
            nn.BatchNorm2d(c["width"]),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c["width"], 2 * c["width"], 3, padding=1),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(2 * c["width"], 10),
        ),
        batch=lambda c, g, s: (
            torch.randn(c["batch"], 3, c["image"], c["image"], generator=g),
            torch.randint(0, 10, (c["batch"],), generator=g),
        ),
        loss=nn.functional.cross_entropy,
        defaults={"width": 16, "image": 32, "batch": 32},
    ),
    "lstm_lm": ModelSpec(
        build=lambda c: _LSTMLM(c["vocab"], c["dim"], c["layers"]),
        batch=_tokens,
        loss=_lm_loss,
        defaults={"vocab": 1000, "dim": 128, "layers": 2, "batch": 16, "seq": 32},
    ),
    "transformer": ModelSpec(
        build=lambda c: _Encoder(c["vocab"], c["dim"], c["layers"], c["heads"]),
        batch=_tokens,
        loss=_lm_loss,
        defaults={"vocab": 1000, "dim": 128, "layers": 2, "heads": 4, "batch": 8, "seq": 64},
    ),
    "varlen": ModelSpec(
        build=lambda c: _Encoder(c["vocab"], c["dim"], c["layers"], c["heads"]),
        batch=_tokens,
        loss=_lm_loss,
        defaults={
            "vocab": 1000,
            "dim": 128,
            "layers": 2,
            "heads": 4,
            "batch": 8,
            "seq": 96,
            "varlen": True,
        },
    ),
}


def capture(
    model: str,
    *,
    steps: int = 6,
    eval_every: int = 0,
    checkpoint_every: int = 0,
    seed: int = 0,
    **overrides: Any,
) -> AllocationLog:
    """Train ``model`` on random data for ``steps`` steps under the tracker (CPU, 1 thread)."""
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; choose one of {', '.join(MODELS)}")
    spec = MODELS[model]
    cfg = {**spec.defaults, **overrides}
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    net = spec.build(cfg)
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    tracker = AllocationTracker()
    tracker.watch(net)
    log = AllocationLog(model=model, config={**cfg, "seed": seed, "steps": steps})
    log.persistent = tracker.adopt(t for t in [*net.parameters(), *net.buffers()])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with tracker:
            for step in range(steps):
                x, y = spec.batch(cfg, g, step)
                with tracker.in_phase("forward"):
                    loss = spec.loss(net(x), y)
                with tracker.in_phase("backward"):
                    loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
                with tracker.in_phase("optimizer"):
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                del loss, x, y
                log.steps.append(StepLog("train", tracker.take()))
                if eval_every and (step + 1) % eval_every == 0:
                    with tracker.in_phase("eval"), torch.no_grad():
                        xe, _ = spec.batch(cfg, g, step)
                        out = net(xe)
                        del out, xe
                    log.steps.append(StepLog("eval", tracker.take()))
                if checkpoint_every and (step + 1) % checkpoint_every == 0:
                    with tracker.in_phase("checkpoint"):
                        # A checkpoint taken on the device: copies of weights and optimizer state.
                        snapshot = {k: v.clone() for k, v in net.state_dict().items()}
                        for st in opt.state.values():
                            for k, v in st.items():
                                if isinstance(v, torch.Tensor):
                                    snapshot[f"opt.{id(st)}.{k}"] = v.clone()
                        del snapshot
                    log.steps.append(StepLog("checkpoint", tracker.take()))
    finally:
        torch.set_num_threads(threads)
        tracker.close()
    return log


CAPTURES: dict[str, dict[str, Any]] = {
    # name -> capture arguments; a small fixed set, cached on disk by ``cached_capture``.
    "mlp": {"model": "mlp"},
    "mlp-wide": {"model": "mlp", "hidden": 1024, "batch": 128},
    "cnn": {"model": "cnn", "eval_every": 3, "checkpoint_every": 4},
    "cnn-large": {"model": "cnn", "width": 32, "image": 48, "batch": 32},
    "lstm_lm": {"model": "lstm_lm", "eval_every": 3},
    "lstm_lm-long": {"model": "lstm_lm", "seq": 64, "dim": 192},
    "transformer": {"model": "transformer", "eval_every": 3, "checkpoint_every": 4},
    "transformer-deep": {"model": "transformer", "layers": 4, "dim": 192, "heads": 6},
    "varlen": {"model": "varlen", "steps": 10},
}


def cached_capture(name: str, cache_dir: Path) -> AllocationLog:
    """A capture from ``CAPTURES``, run once and kept in ``cache_dir``."""
    if name not in CAPTURES:
        raise ValueError(f"unknown capture {name!r}; choose one of {', '.join(CAPTURES)}")
    path = cache_dir / f"{name}.json.gz"
    if path.exists():
        return AllocationLog.load(path)
    args = dict(CAPTURES[name])
    log = capture(args.pop("model"), **args)
    log.save(path)
    return log
