"""What a corpus run does to its memory, over time, inside a real program.

A run's *script* (JSON, written by the planner) says how long the job runs, how fast its
steps come, and which memory behaviours start when, in seconds of the run. The program calls
:meth:`Driver.end_step` after every step (from its own loop, or from its framework's
callback); the driver then applies every behaviour that is due, runs the job's healthy
evaluation and checkpoint when their period comes round, paces the loop to the script's
step period, and writes a line of step statistics every few seconds (the recorder compares
them with the program's calibration).

Behaviours are how real jobs use memory, in the program's own process:

- ``warmup``: a bounded cache filling, fast at first and ever slower (a start-up that levels
  off); ``plateau``: the same fill in a straight line to a cap, then held (a near miss).
- ``leak``: a layer's output kept on every step (a debugging hook left on), at a rate.
- ``cache``: inputs memoized per sample id, never evicted, at a rate.
- ``churn``: a shuffle buffer of samples of long-tailed sizes whose mean size rises: the
  allocator's free lists fragment as the sizes change, so RSS grows beside the data.
- ``eval_accum``: every evaluation gathers all of its outputs before reducing them, over an
  evaluation set that keeps growing (the default of several trainers): rising spikes.
- ``scale``: the batch (or sequence length, in sequence programs) grows with time.
- sudden ones, at one moment: ``step_scale`` (the batch multiplied), ``eval_spike`` (an
  evaluation that keeps autograd graphs), ``checkpoint`` (state serialized into memory),
  ``neighbour`` (a second job starting in the same container).

Rates are in bytes per second of run time, so a behaviour reaches the limit the recorder
set when the recorder planned it to, whatever the program's step period.
"""

from __future__ import annotations

import io
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

MIB = 1 << 20
CHUNK_BYTES = 1 * MIB
MAX_ITEMS_PER_STEP = 256
STATS_EVERY_S = 5.0

GROWING = ("leak", "cache", "churn", "eval_accum", "scale")
LEVELLING = ("warmup", "plateau")
SUDDEN = ("step_scale", "eval_spike", "checkpoint", "neighbour")
KINDS = GROWING + LEVELLING + SUDDEN


@dataclass
class Phase:
    """One behaviour of a script; which fields matter depends on ``kind``."""

    kind: str
    start_s: float
    rate_bps: float = 0.0  # growing: bytes per second of run time
    level_bytes: float = 0.0  # levelling: the bytes the fill ends at; sudden: the jump
    tau_s: float = 60.0  # warmup: time constant; plateau: seconds of the climb
    rate_per_s: float = 0.0  # scale: the batch multiplier's rise per second
    factor: float = 2.0  # step_scale: the multiplier from then on
    every_s: float = 30.0  # eval_accum: seconds between evaluations
    program: str = ""  # neighbour: which program starts
    script: dict[str, Any] = field(default_factory=dict)  # neighbour: its script

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Phase:
        if d.get("kind") not in KINDS:
            raise ValueError(f"phase kind {d.get('kind')!r} is not one of {KINDS}")
        known = set(cls.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"phase {d['kind']}: unknown keys {sorted(unknown)}")
        return cls(**d)


@dataclass
class Script:
    duration_s: float
    period_s: float
    batch: int = 32
    seq: int = 64
    width: int = 512
    eval_every_s: float = 60.0
    ckpt_every_s: float = 120.0
    phases: list[Phase] = field(default_factory=list)
    seed: int = 0

    @classmethod
    def from_json(cls, text: str) -> Script:
        d = json.loads(text)
        phases = [Phase.from_dict(p) for p in d.pop("phases", [])]
        script = cls(**d, phases=phases)
        if not (script.duration_s > 0 and script.period_s > 0):
            raise ValueError("duration_s and period_s must be positive")
        return script

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def touched(nbytes: int) -> torch.Tensor:
    """A float32 tensor of about ``nbytes`` whose pages are all written (so they count)."""
    return torch.empty(max(1, nbytes // 4)).uniform_()


class Holder:
    """Tensors kept alive to reach a byte count, made by ``source`` (or plain chunks)."""

    def __init__(self) -> None:
        self.items: list[torch.Tensor] = []
        self.nbytes = 0

    def fill_to(
        self,
        target: float,
        source: Callable[[], torch.Tensor | None] | None,
        max_items: int | None = MAX_ITEMS_PER_STEP,
    ) -> None:
        """Add items until ``target`` bytes are held, or ``max_items`` were added (a growth
        spreads over steps; a sudden one is one step, with no cap)."""
        added = 0
        while max_items is None or added < max_items:
            added += 1
            if self.nbytes >= target:
                return
            item = source() if source is not None else None
            if item is None or item.nbytes < 4096:
                item = touched(int(min(CHUNK_BYTES, max(4096.0, target - self.nbytes))))
            self.items.append(item)
            self.nbytes += item.nbytes

    def clear(self) -> None:
        self.items.clear()
        self.nbytes = 0


@dataclass
class JobHooks:
    """What a behaviour may ask of the program it runs in; every one optional."""

    leak_module: nn.Module | None = None  # whose output a leak keeps
    make_input: Callable[[], torch.Tensor] | None = None  # one decoded sample, for caches
    state: Callable[[], dict[str, Any]] | None = None  # what a checkpoint serializes
    healthy_eval: Callable[[], None] | None = None  # the job's own evaluation
    healthy_ckpt: Callable[[], None] | None = None  # the job's own checkpoint, to disk


class Driver:
    def __init__(
        self,
        script: Script,
        stats_path: str | None = None,
        hooks: JobHooks | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        self.script = script
        self.hooks = hooks or JobHooks()
        self.stats_path = stats_path
        self.clock, self.sleep = clock, sleep
        self.rng = random.Random(script.seed + 17)
        self.started = clock()
        self.step = 0
        self.holders: dict[int, Holder] = {}
        self.churn: list[torch.Tensor] = []
        self.fired: set[int] = set()
        self.kept: list[Any] = []  # what sudden behaviours keep
        self.neighbours: list[subprocess.Popen[bytes]] = []
        self.last_output: torch.Tensor | None = None
        self.next_eval = script.eval_every_s
        self.next_ckpt = script.ckpt_every_s
        self.evals: dict[int, float] = {}  # eval_accum phase -> when its next evaluation is
        self._base = self.started
        self._step_begun = self.started
        self._compute: list[float] = []
        self._periods: list[float] = []
        self._lag_resets = 0
        self._last_stats = self.started
        self._last_end = self.started
        self._hook_handle: Any = None
        if self.hooks.leak_module is not None:
            self._hook_handle = self.hooks.leak_module.register_forward_hook(self._capture)

    # -- what the program asks --------------------------------------------------------------
    def elapsed(self) -> float:
        return self.clock() - self.started

    def finished(self) -> bool:
        return self.elapsed() >= self.script.duration_s

    def scale(self) -> float:
        """The batch (or sequence) multiplier for the next step."""
        t = self.elapsed()
        factor = 1.0
        for p in self.script.phases:
            if p.kind == "scale" and t >= p.start_s:
                factor *= 1.0 + p.rate_per_s * (t - p.start_s)
            elif p.kind == "step_scale" and t >= p.start_s:
                factor *= p.factor
        return factor

    def size(self, batch: int, seq: int, sequence: bool) -> tuple[int, int]:
        """(batch, sequence length) for the next step."""
        f = self.scale()
        if sequence:
            return batch, max(4, round(seq * f))
        return max(1, round(batch * f)), seq

    def begin_step(self) -> None:
        """Optional: marks where the step's compute starts (else: where the last one ended)."""
        self._step_begun = self.clock()

    def end_step(self) -> None:
        now = self.clock()
        self._compute.append(now - max(self._step_begun, self._last_end))
        self.step += 1
        t = now - self.started
        for i, p in enumerate(self.script.phases):
            if t >= p.start_s:
                self._apply(i, p, t)
        if t >= self.next_eval:
            self.next_eval = t + self.script.eval_every_s
            if self.hooks.healthy_eval is not None:
                self.hooks.healthy_eval()
        if t >= self.next_ckpt:
            self.next_ckpt = t + self.script.ckpt_every_s
            if self.hooks.healthy_ckpt is not None:
                self.hooks.healthy_ckpt()
        self._pace()
        if self.clock() - self._last_stats >= STATS_EVERY_S:
            self.write_stats()

    def close(self) -> None:
        self.write_stats(final=True)
        for proc in self.neighbours:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()

    # -- behaviours ---------------------------------------------------------------------------
    def _capture(self, _m: nn.Module, _i: Any, out: Any) -> None:
        tensor = out[0] if isinstance(out, tuple | list) else out
        if isinstance(tensor, torch.Tensor):
            self.last_output = tensor
        elif hasattr(tensor, "last_hidden_state"):  # a Hugging Face output object
            self.last_output = tensor.last_hidden_state

    def _leaked(self) -> torch.Tensor | None:
        out = self.last_output
        return None if out is None else out.detach().clone()

    def _cached(self) -> torch.Tensor | None:
        return self.hooks.make_input() if self.hooks.make_input is not None else None

    def _holder(self, i: int) -> Holder:
        return self.holders.setdefault(i, Holder())

    def _apply(self, i: int, p: Phase, t: float) -> None:
        dt = t - p.start_s
        if p.kind == "leak":
            self._holder(i).fill_to(p.rate_bps * dt, self._leaked)
        elif p.kind == "cache":
            self._holder(i).fill_to(p.rate_bps * dt, self._cached)
        elif p.kind == "warmup":
            self._holder(i).fill_to(p.level_bytes * -math.expm1(-dt / p.tau_s), self._cached)
        elif p.kind == "plateau":
            self._holder(i).fill_to(p.level_bytes * min(1.0, dt / p.tau_s), self._cached)
        elif p.kind == "churn":
            self._churn(p.rate_bps * dt)
        elif p.kind == "eval_accum":
            self._eval_accum(i, p, t)
        elif p.kind in SUDDEN and i not in self.fired:
            self.fired.add(i)
            self._sudden(p)

    def _churn(self, target_bytes: float) -> None:
        """200 samples held; each step 8 new ones of a long-tailed size around the mean that
        puts the buffer at ``target_bytes``, and 8 evicted at random."""
        mean = max(64 * 1024.0, target_bytes / 200.0)
        for _ in range(8):
            size = min(4.0 * mean, self.rng.lognormvariate(math.log(mean) - 0.32, 0.8))
            self.churn.append(touched(int(size)))
        while len(self.churn) > 200:
            self.churn.pop(self.rng.randrange(len(self.churn)))

    def _eval_accum(self, i: int, p: Phase, t: float) -> None:
        """An evaluation every ``every_s``: it gathers outputs over ten steps (bytes growing
        with the evaluation set, ``rate_bps`` a second since the phase began), then reduces
        them and lets them go."""
        holder = self._holder(i)
        due = self.evals.setdefault(i, p.start_s)
        if t < due:
            return
        total = 8 * MIB + p.rate_bps * (t - p.start_s)
        holder.fill_to(holder.nbytes + total / 10.0, self._leaked)
        if holder.nbytes >= total:
            holder.clear()
            self.evals[i] = t + p.every_s

    def _sudden(self, p: Phase) -> None:
        if p.kind == "eval_spike":  # an evaluation that keeps every batch's graph
            self._holder(-1).fill_to(p.level_bytes, self._leaked, max_items=None)
        elif p.kind == "checkpoint":  # state serialized into memory, copies kept
            state = self.hooks.state() if self.hooks.state is not None else {}
            held = 0
            while held < p.level_bytes:
                buf = io.BytesIO()
                torch.save(state, buf)
                blob = bytearray(buf.getbuffer())
                if len(blob) < MIB:  # a small model: the rest of the snapshot is its buffers
                    blob = bytearray(os.urandom(int(min(64 * MIB, p.level_bytes - held))))
                self.kept.append(blob)
                held += len(blob)
        elif p.kind == "neighbour":
            cmd = [sys.executable, "-m", "oomcast.training.corpus.run", p.program,
                   "--script", json.dumps(p.script)]  # fmt: skip
            self.neighbours.append(
                subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        # step_scale acts through scale()

    # -- pacing and statistics ------------------------------------------------------------------
    def _pace(self) -> None:
        period = self.script.period_s
        target = self._base + self.step * period
        now = self.clock()
        if now < target:
            self.sleep(target - now)
        elif now - target > period:  # behind by more than a step: don't burst to catch up
            self._base = now - self.step * period
            self._lag_resets += 1
        end = self.clock()
        self._periods.append(end - self._last_end)
        self._last_end = end

    def write_stats(self, final: bool = False) -> None:
        self._last_stats = self.clock()
        if self.stats_path is None:
            return
        compute, periods = self._compute, self._periods
        line = {
            "t": round(self.elapsed(), 3),
            "step": self.step,
            "steps": len(compute),
            "compute_s": round(sum(compute) / len(compute), 5) if compute else None,
            "period_s": round(sum(periods) / len(periods), 5) if periods else None,
            "scale": round(self.scale(), 4),
            "lag_resets": self._lag_resets,
            "final": final,
        }
        self._compute, self._periods = [], []
        with open(self.stats_path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(line) + "\n")
