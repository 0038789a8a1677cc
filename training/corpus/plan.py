"""The corpus's plan: which runs each program gets, and each run's script and limit.

Every program is first *calibrated* alone under a roomy limit: its step's compute time, its
steady level of anonymous memory (what the kernel cannot reclaim) with the spikes of its own
evaluation and checkpoints, and the bytes one more unit of batch (or sequence) costs. From
that, each run of the program gets a step period (the program paced at about 2.5x its
compute, so another process on the machine does not stretch its time axis) and a limit
that puts the run where its kind says it must go:

==================  ========================================================================
kind                what the run does
==================  ========================================================================
``ordinary``        5-8 min of steady training at 40-75% of its limit
``warmup``          a start-up fill that slows and levels off at 60-90% of the limit
``near``            2-3 min steady, then a climb that stops at 85-95% and holds 3+ min
``oom_<cause>``     2-5 min steady, then growth (leak, cache, scale, churn, eval_accum)
                    that reaches the limit 1-4 min later
``startup_oom``     a fill from the first seconds that reaches the limit within a minute
``censored``        steady, then growth; the job ends normally before it reaches the limit
``sudden_<cause>``  steady, then one step over the limit (step_scale, eval_spike,
                    checkpoint, neighbour)
==================  ========================================================================

Whether a run OOMs is still the kernel's decision: the manifest records what happened, and
the scoring classes are read from the trace, not from the plan. Every number is drawn from
a generator seeded by the run's name, so a plan is the same every time it is made.
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import Any

from oomcast.training.corpus.driver import Phase, Script

MIB = 1 << 20
GIB = 1 << 30
MAX_LIMIT_BYTES = 5 * GIB  # two runs at once stay under 12 GB of limits
ROOMY_LIMIT_BYTES = 6 * GIB
CALIBRATION_S = 80.0
PROBE_AT_S = 50.0  # the calibration doubles the batch here

# Split by program: a held-out program was never seen in training or in choosing the rule.
SPLITS: dict[str, tuple[str, ...]] = {
    "train": ("mlp_tabular", "cnn_classifier", "transformer_lm", "recsys", "hf_bert_trainer",
              "hf_gpt2_accelerate", "dataloader_workers"),
    "val": ("autoencoder", "gan", "timm_vit"),
    "test": ("lstm_lm", "lightning_cnn", "inference_server"),
}  # fmt: skip
# Per program: batch, sequence length and width (the sizes its step runs at scale 1).
SIZES: dict[str, dict[str, int]] = {
    "mlp_tabular": {"batch": 256, "width": 1024},
    "cnn_classifier": {"batch": 16, "width": 512},
    "transformer_lm": {"batch": 8, "seq": 64, "width": 512},
    "lstm_lm": {"batch": 8, "seq": 64, "width": 512},
    "autoencoder": {"batch": 16, "width": 512},
    "recsys": {"batch": 256, "width": 256},
    "gan": {"batch": 32, "width": 512},
    "hf_bert_trainer": {"batch": 8, "seq": 64, "width": 512},
    "hf_gpt2_accelerate": {"batch": 8, "seq": 64, "width": 512},
    "lightning_cnn": {"batch": 16, "width": 512},
    "timm_vit": {"batch": 16, "width": 512},
    "dataloader_workers": {"batch": 16, "width": 512},
    "inference_server": {"batch": 16, "seq": 64, "width": 512},
}
GROWTH = ("leak", "cache", "scale", "churn", "eval_accum")
SUDDEN = ("step_scale", "eval_spike", "checkpoint", "neighbour")
NEIGHBOURS = ("mlp_tabular", "cnn_classifier", "autoencoder")
MAX_SCALE_GROWTH = 3.0
# A fill costs the container more than its bytes: the allocator's heap fragments around the
# training step's own allocations (the first near misses recorded came 40-55 MiB above their
# planned plateau, and two of three were killed), and the kernel charges its own memory.
FILL_OVERSHOOT = 1.2
KERNEL_BYTES = 24 * MIB  # a batch grown to 4x its size is as far as a scale run goes


def split_of(program: str) -> str:
    return next(s for s, progs in SPLITS.items() if program in progs)


def programs() -> list[str]:
    return [p for progs in SPLITS.values() for p in progs]


@dataclass
class Calibration:
    """What a program does alone, at scale 1 and 2 (``record.calibrate`` measures it)."""

    compute_s: float  # one step's compute, at scale 1
    compute_x2_s: float  # ... at scale 2
    level_bytes: float  # median anonymous memory, steady, at scale 1
    peak_bytes: float  # highest level seen at scale 1 (its eval and checkpoint included)
    per_scale_bytes: float  # the level at scale 2 minus at scale 1

    def period_s(self) -> float:
        return round(min(1.0, max(0.1, 2.5 * self.compute_s)), 3)

    def to_dict(self) -> dict[str, float]:
        return dict(self.__dict__)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Calibration:
        return cls(**{k: float(d[k]) for k in cls.__dataclass_fields__})


@dataclass
class RunPlan:
    name: str  # <program>-<kind>[-<n>]
    program: str
    kind: str  # ordinary, warmup, near, oom, startup_oom, censored, sudden
    cause: str  # the behaviour behind it ("none" for ordinary runs)
    split: str
    limit_bytes: int
    script: Script
    expect_oom: bool
    onset_s: float | None  # when the behaviour that matters starts (steady before it)

    def manifest(self) -> dict[str, Any]:
        return {
            "name": self.name, "program": self.program, "kind": self.kind, "cause": self.cause,
            "split": self.split, "limit_bytes": self.limit_bytes, "expect_oom": self.expect_oom,
            "onset_s": self.onset_s, "duration_s_planned": self.script.duration_s,
            "period_s": self.script.period_s, "script": self.script.to_json(),
        }  # fmt: skip


def calibration_script(program: str, seed: int = 0) -> Script:
    """Alone, roomy: steady at scale 1, then the batch (or sequence) doubled."""
    return sized(
        program, duration_s=CALIBRATION_S, period_s=0.3, seed=seed, eval_every_s=20.0,
        ckpt_every_s=30.0, phases=[Phase("step_scale", PROBE_AT_S, factor=2.0)],
    )  # fmt: skip


def sized(program: str, **fields: Any) -> Script:
    """A script at the program's sizes (``SIZES``)."""
    size = SIZES[program]
    return Script(batch=size["batch"], seq=size.get("seq", 64), width=size["width"], **fields)


def seeded_rng(name: str) -> random.Random:
    return random.Random(int(hashlib.sha256(name.encode()).hexdigest()[:12], 16))


def _kinds(program: str) -> list[tuple[str, str]]:
    """(kind, cause) of every run of a program, in recording order."""
    k = programs().index(program)
    growth = [GROWTH[(k + i) % len(GROWTH)] for i in range(3)]
    if split_of(program) == "test":  # held-out programs get every growth cause
        growth = list(GROWTH)
    sudden = SUDDEN[k % len(SUDDEN)]
    runs = [("ordinary", "none"), ("oom", growth[0]), ("near", "plateau"),
            ("sudden", sudden), ("oom", growth[1]), ("warmup", "warmup"),
            ("censored", ("leak", "scale")[k % 2]), ("startup_oom", ("plateau", "warmup")[k % 2]),
            ("oom", growth[2]), ("near", "warmup")]  # fmt: skip
    runs += [("oom", c) for c in growth[3:]]
    return runs


def plan_program(program: str, cal: Calibration, cals: dict[str, Calibration]) -> list[RunPlan]:
    out: list[RunPlan] = []
    seen: dict[str, int] = {}
    kinds = _kinds(program)
    if not scale_viable(cal):  # its batch cannot grow that far: another cause in its place
        unused = [c for c in GROWTH if c != "scale" and all(c != k[1] for k in kinds)]
        swap = {"scale": unused[0] if unused else "leak", "step_scale": "eval_spike"}
        kinds = [(k, swap.get(c, c)) for k, c in kinds]
    for kind, cause in kinds:
        base = f"{program}-{kind}" + ("" if kind in ("ordinary", "warmup", "near") else f"-{cause}")
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}-{seen[base]}"
        out.append(plan_run(name, program, kind, cause, cal, cals))
    return out


def scale_viable(cal: Calibration) -> bool:
    """Whether the batch (or sequence) can grow to the limits the plan sets: the nearest
    limit a growth run gets leaves 0.43x its peak of headroom."""
    peak = max(cal.peak_bytes, cal.level_bytes)
    return MAX_SCALE_GROWTH * cal.per_scale_bytes >= peak / 0.7 - cal.level_bytes


def plan_run(
    name: str, program: str, kind: str, cause: str, cal: Calibration,
    cals: dict[str, Calibration],
) -> RunPlan:  # fmt: skip
    rng = seeded_rng(name)
    level, peak = cal.level_bytes, max(cal.peak_bytes, cal.level_bytes)
    script = sized(
        program, duration_s=0.0, period_s=cal.period_s(), seed=rng.randrange(10**6),
        eval_every_s=rng.choice((30.0, 45.0, 60.0, 90.0)),
        ckpt_every_s=rng.choice((60.0, 120.0, 180.0)),
    )  # fmt: skip
    phases: list[Phase] = []
    onset: float | None = None
    expect_oom = False
    if kind == "ordinary":
        script.duration_s = rng.uniform(300, 480)
        limit = peak / rng.uniform(0.4, 0.75)
    elif kind == "warmup":
        fill = level * rng.uniform(0.4, 1.2)
        onset = rng.uniform(3, 10)
        phases.append(Phase("warmup", onset, level_bytes=fill, tau_s=rng.uniform(25, 60)))
        script.duration_s = rng.uniform(300, 360)
        limit = (peak + fill * FILL_OVERSHOOT + KERNEL_BYTES) / rng.uniform(0.6, 0.9)
    elif kind == "near":
        fill = level * rng.uniform(0.5, 1.5)
        onset = rng.uniform(90, 180)
        climb = rng.uniform(60, 150)
        shape = "plateau" if cause == "plateau" else "warmup"
        tau = climb if shape == "plateau" else climb / 3  # a warmup is 95% there at 3 tau
        phases.append(Phase(shape, onset, level_bytes=fill, tau_s=tau))
        script.duration_s = onset + climb + rng.uniform(180, 210)
        limit = (peak + fill * FILL_OVERSHOOT + KERNEL_BYTES) / rng.uniform(0.85, 0.95)
    elif kind in ("oom", "censored"):
        onset = rng.uniform(120, 300) if kind == "oom" else rng.uniform(120, 240)
        limit = peak / rng.uniform(0.35, 0.7)
        grow_s = rng.uniform(60, 240) if kind == "oom" else rng.uniform(90, 240)
        if cause == "scale":  # no further than the batch can grow
            limit = min(limit, level + MAX_SCALE_GROWTH * cal.per_scale_bytes)
        phases.append(_growth(cause, onset, (limit - level) / grow_s, cal, rng))
        if kind == "oom":
            script.duration_s = onset + 3 * grow_s + 60
            expect_oom = True
        else:  # the job ends normally while still climbing
            script.duration_s = onset + grow_s * rng.uniform(0.35, 0.75)
    elif kind == "startup_oom":
        fill = level * rng.uniform(1.0, 2.0)
        onset = rng.uniform(2, 5)
        reach = rng.uniform(15, 35)  # seconds from the first step to the limit
        climb = rng.uniform(30, 60)
        frac = (reach - onset) / climb if cause == "plateau" else -_expm1(-(reach - onset) / climb)
        phases.append(Phase(cause, onset, level_bytes=fill, tau_s=climb))
        script.duration_s = 240.0
        limit = level + fill * min(0.95, frac)
        expect_oom = True
    elif kind == "sudden":
        onset = rng.uniform(120, 240)
        phase, jump = _sudden(cause, onset, level, cal, cals, rng, script)
        phases.append(phase)
        script.duration_s = onset + 60
        limit = peak + 16 * MIB + jump * rng.uniform(0.3, 0.7)
        expect_oom = True
    else:
        raise ValueError(f"unknown run kind {kind!r}")
    script.phases = phases
    script.duration_s = round(script.duration_s, 1)
    limit_bytes = int(min(MAX_LIMIT_BYTES, limit))
    return RunPlan(name, program, kind, cause, split_of(program), limit_bytes, script, expect_oom,
                   None if onset is None else round(onset, 1))  # fmt: skip


def _expm1(x: float) -> float:
    import math

    return math.expm1(x)


def _growth(cause: str, onset: float, rate_bps: float, cal: Calibration, rng: random.Random
            ) -> Phase:  # fmt: skip
    if cause == "scale":
        per = max(cal.per_scale_bytes, 4 * MIB)
        return Phase("scale", onset, rate_per_s=rate_bps / per)
    if cause == "eval_accum":  # the evaluations' peaks rise at the rate
        return Phase("eval_accum", onset, rate_bps=rate_bps, every_s=rng.uniform(15, 40))
    return Phase(cause, onset, rate_bps=rate_bps)


def _sudden(
    cause: str, onset: float, level: float, cal: Calibration, cals: dict[str, Calibration],
    rng: random.Random, script: Script,
) -> tuple[Phase, float]:  # fmt: skip
    """The sudden behaviour and the bytes it adds at once."""
    if cause == "step_scale":
        factor = rng.uniform(2.0, 3.0)
        return Phase("step_scale", onset, factor=factor), (factor - 1) * max(
            cal.per_scale_bytes, 16 * MIB
        )
    if cause == "neighbour":
        other = rng.choice(NEIGHBOURS)
        ocal = cals.get(other, cal)
        nscript = sized(other, duration_s=90.0, period_s=ocal.period_s(),
                        seed=rng.randrange(10**6))  # fmt: skip
        return Phase("neighbour", onset, program=other, script=_plain(nscript)), ocal.level_bytes
    jump = level * rng.uniform(0.5, 1.2)
    return Phase(cause, onset, level_bytes=jump), jump


def _plain(script: Script) -> dict[str, Any]:
    import json

    data: dict[str, Any] = json.loads(script.to_json())
    return data
