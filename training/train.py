"""Train the LSTM forecaster (``oomcast train``).

Reads its sources (``Sources``): the simulated GPU splits of ``oomcast simulate`` (as the
hook and as NVML alone see them), the recorded corpus of real jobs split by program (at 10 Hz
and seen at 1 Hz), the runs of the first, shorter corpus whose programs are trained on
(``corpus_v1``), the first host traces and plain shapes.

Every sequence is run from its first tick, as the service runs a domain, and every second of
it counts the same (sequences are drawn in proportion to their length: the exposure of a
fleet, where most seconds are far from any OOM). The loss is the discrete-time survival
likelihood (``model/network.py``): a run that never OOMed is censored at its end, so it
says nothing of the seconds after it.

After each epoch the risks are calibrated per horizon on the validation split, gated as the
service gates them, and the alert rule (horizon, fire_risk) is chosen there by the scoring
classes of ``training/classes.py``: the rule that warns the most long OOMs 30 s ahead while
at most 2% of the ordinary runs of *every* validation group get an alert and at most half
of the near misses do (censored alerts count as neither). Weights, calibration, optimizer,
config, feature-schema version, rule and the validation figures that chose it are saved
together, so a checkpoint explains itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from oomcast.model.forecast import HORIZONS_S
from oomcast.model.network import (
    NetConfig,
    OOMForecastNet,
    fit_calibration,
    hazard_loss,
    hazard_targets,
    served,
)
from oomcast.model.trace import find_traces
from oomcast.training.classes import CENSOR_S, LONG_AFTER_S, NEAR_LEVEL
from oomcast.training.dataset import (
    Sequence,
    labels,
    load_folder,
    load_paths,
    normalization,
)

MIN_THRESHOLD = 0.02  # below this a "risk" is noise, whatever the validation split says


@dataclass
class ScoredRule:
    """A candidate alert rule and what it scored on the validation split (the one kept is
    shipped in the model as ``model.forecast.AlertRule``)."""

    horizon_s: int
    fire_risk: float
    recall_30: float  # long OOMs warned 30 s ahead
    recall_10: float
    false_alarm_rate: float  # the worst validation group's share of ordinary runs alerted
    fire_after: int = 1  # consecutive samples at or above fire_risk
    near_miss_warned: float = 0.0  # share of near misses alerted
    figures: dict[str, Any] = field(default_factory=dict)  # what chose it, per group


# Rules fire on one tick: a rule counted in consecutive samples would mean 0.2 s at 10 Hz and
# 2 s at 1 Hz, and the same curve must get the same verdict at any rate.


def predict_sequences(
    net: OOMForecastNet,
    seqs: list[Sequence],
    batch: int = 64,
    raw: bool = False,
    tto: bool = False,
) -> list[np.ndarray]:
    """Risk (time, H) for every sequence, run from its first tick as the service would
    (calibrated and passed through the evidence gate); ``raw``: log survival before
    calibration and gate instead; ``tto``: seconds to OOM (time,) as served (``served``: the
    straight line's where it holds, else the curve's median)."""
    net.eval()
    out: list[np.ndarray] = []
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i].x))
    results: dict[int, np.ndarray] = {}
    with torch.no_grad():
        for a in range(0, len(order), batch):
            idx = order[a : a + batch]
            t_max = max(len(seqs[i].x) for i in idx)
            x = np.zeros((len(idx), t_max, seqs[0].x.shape[1]), np.float32)
            for j, i in enumerate(idx):
                x[j, : len(seqs[i].x)] = seqs[i].x
            xt = torch.from_numpy(x)
            log_s, log_tto, _ = net.heads(xt)
            if raw:
                val = log_s
            else:
                risk, seconds = served(net, log_s, log_tto, xt)
                val = seconds if tto else risk
            for j, i in enumerate(idx):
                results[i] = val[j, : len(seqs[i].x)].numpy()
    out = [results[i] for i in range(len(seqs))]
    return out


def score_rules(
    seqs: list[Sequence],
    risks: list[np.ndarray],
    max_false_alarms: float = 0.02,
    max_near_warned: float = 0.5,
) -> list[ScoredRule]:
    """For every horizon, a risk that alerts on at most ``max_false_alarms`` of the ordinary
    runs of *every* group and on at most ``max_near_warned`` of the near misses (the lowest
    such, raised as far as it catches the same long OOMs: ``margin_threshold``), and what it
    buys on the long OOMs, counted as ``oomcast evaluate`` counts them (the
    first tick at the risk is the alert; an alert in a censored run's last minute is
    neither a hit nor a false alarm). Thresholds are read off the runs' own highest risks,
    so the answer is exact whatever the scale of the risks."""
    long_ooms = [i for i, s in enumerate(seqs) if s.ooms and (s.oom_after_s or 0) >= LONG_AFTER_S]
    groups: dict[str, list[int]] = {}
    near: list[int] = []
    for i, s in enumerate(seqs):
        if not s.ooms:
            (near if s.max_level >= NEAR_LEVEL else groups.setdefault(s.group, [])).append(i)
    rules = []
    for k, h in enumerate(HORIZONS_S):

        def top(i: int, k: int = k) -> float:  # the highest risk before the run's last minute
            early = seqs[i].known_s() >= CENSOR_S
            r = risks[i][early, k]
            return float(r.max()) if len(r) else 0.0

        fire_risk = MIN_THRESHOLD
        for ids in [*groups.values(), near]:
            highs = np.sort([top(i) for i in ids])[::-1]
            share = max_near_warned if ids is near else max_false_alarms
            # at most that share, rounded to the nearest run: one alarm in 37 runs is 2.7%,
            # and a group of 37 must not be held to none when the ceiling is 2%
            allowed = int(np.floor(share * len(ids) + 0.5))
            if allowed < len(highs):
                fire_risk = max(fire_risk, float(highs[allowed]) + 1e-6)
        fire_risk = margin_threshold(seqs, risks, long_ooms, k, min(fire_risk, 1.0))
        per_group = {g: sum(top(i) >= fire_risk for i in ids) / len(ids)
                     for g, ids in groups.items()}  # fmt: skip
        warned_near = sum(top(i) >= fire_risk for i in near) / len(near) if near else 0.0
        caught30 = caught10 = 0
        for i in long_ooms:
            fired = risks[i][:, k] >= fire_risk
            lead = seqs[i].tto[fired]
            if len(lead):
                caught30 += bool(lead.max() >= 30)
                caught10 += bool(lead.max() >= 10)
        n = max(1, len(long_ooms))
        figures = {"long_ooms": len(long_ooms), "near_misses": len(near),
                   "ordinary": {g: len(ids) for g, ids in groups.items()},
                   "false_alarm_rate": {g: round(v, 4) for g, v in per_group.items()}}  # fmt: skip
        rules.append(ScoredRule(h, round(fire_risk, 6), caught30 / n, caught10 / n,
                                max(per_group.values(), default=0.0), 1, warned_near,
                                figures))  # fmt: skip
    return rules


def margin_threshold(
    seqs: list[Sequence], risks: list[np.ndarray], long_ooms: list[int], k: int, lowest: float
) -> float:
    """The threshold with a margin on both sides: ``lowest`` is the least risk that keeps to
    the false-alarm ceilings, so a healthy run a little unlike the validation runs alerts
    there; the highest risk that still catches, 30 s and 10 s ahead, every long OOM that
    ``lowest`` catches is as far as it can rise for free. Halfway between the two (the
    geometric mean: risks span decades) keeps most of that room on either side."""
    edges = []
    for i in long_ooms:
        lead, r = seqs[i].tto, risks[i][:, k]
        for need in (30.0, 10.0):
            ahead = r[lead >= need]
            best = float(ahead.max()) if len(ahead) else 0.0
            if best >= lowest:
                edges.append(best)
    highest = min(edges, default=lowest)
    return float(np.sqrt(lowest * highest)) if highest > lowest else lowest


def first_run(fired: np.ndarray, n: int) -> int | None:
    """Index of the sample that completes the first run of ``n`` consecutive True."""
    run = fired.copy()
    for j in range(1, n):
        run[j:] &= fired[:-j] if j < len(fired) else False
        run[:j] = False
    hit = np.flatnonzero(run)
    return int(hit[0]) if len(hit) else None


def best_rule(
    rules: list[ScoredRule], max_false_alarms: float, max_near_warned: float = 0.5
) -> ScoredRule:
    """The rule that catches most OOMs 30 s ahead (then 10 s ahead). ``score_rules`` already
    holds every rule to the false-alarm ceiling (rounded to the nearest run per group);
    rules from elsewhere over ``max_false_alarms`` by more than that rounding, or alerting on
    more than ``max_near_warned`` of the near misses, are left out."""
    ok = [r for r in rules if r.false_alarm_rate <= max(max_false_alarms, 0.03)
          and r.near_miss_warned <= max_near_warned + 1e-9]  # fmt: skip
    if not ok:
        return min(rules, key=lambda r: (r.false_alarm_rate, -r.recall_30))
    return max(
        ok,
        key=lambda r: (r.recall_30, r.recall_10, -r.false_alarm_rate, -r.fire_after, r.fire_risk),
    )


@dataclass
class Sources:
    """Where training and validation traces come from; a None source is left out."""

    sim: Path | None = None  # a folder written by ``oomcast simulate`` (train/ and val/)
    corpus: Path | None = None  # the corpus of real jobs (``training/corpus``), by program
    # the first, shorter corpus (``record_corpus``): its runs of programs the main corpus
    # trains on (none of its validation or test programs), for training only
    corpus_v1: Path | None = None
    host: Path | None = None  # the first recorded host traces (``record_host``): training
    extra: list[Path] = field(default_factory=list)  # more trace files for training
    shapes: int = 1200  # plain shapes (``training/shapes.py``) in training; a quarter in val
    nvml_views: bool = True
    # OOMs from one step with no prior change (a neighbour, the first eval or optimizer
    # step): no signal in the stream to learn from, only a prior to learn ("high and old
    # means danger"), which is what raised false alarms. They are left out of training and
    # validation; their look-alikes that fit stay. Phase-aware forecasts are their answer.
    drop_sudden: bool = True


SUDDEN_CAUSES = frozenset(
    ("eval_no_grad", "optimizer_state", "checkpoint_spike", "neighbour",  # simulated, host
     "step_up", "eval_spike", "checkpoint", "step_scale")  # the corpora
)  # fmt: skip


def grouped(
    seqs: list[Sequence], group: str, drop_sudden: bool, runs: dict[str, dict[str, Any]] | None
) -> list[Sequence]:
    """``seqs`` labelled with their ``group``; with ``drop_sudden``, an OOM from one step
    (``SUDDEN_CAUSES``) is left out, or, where a corpus manifest (``runs``, by file) says
    when its step came, kept up to then and censored there: the steady minutes before it
    ended in nothing the stream could have shown."""
    out = []
    for q in seqs:
        q.group = group
        run = (runs or {}).get(q.name.split(":", 1)[0])
        if not drop_sudden:
            out.append(q)
        elif run is not None and run.get("kind") == "sudden" and run.get("onset_s"):
            out.append(censor_at(q, float(run["onset_s"])))
        elif not (q.ooms and cause_of(q.name) in SUDDEN_CAUSES):
            out.append(q)
    return out


def censor_at(seq: Sequence, at_s: float) -> Sequence:
    """The sequence up to ``at_s`` seconds after its first sample, as a run that survived
    until then and is censored there."""
    if seq.ooms and seq.oom_after_s is not None:
        since_start = seq.oom_after_s - seq.tto
    else:
        since_start = seq.span_s - seq.known_s()
    keep = since_start < at_s
    known = at_s - since_start[keep]
    y, m = labels(np.full(int(keep.sum()), np.inf), known)
    return Sequence(seq.name, seq.x[keep], y, m, np.full(int(keep.sum()), np.inf), False,
                    seq.group, known=known, oom_after_s=None, max_level=seq.max_level,
                    span_s=at_s)  # fmt: skip


def cause_of(name: str) -> str:
    """The cause or family a sequence's trace file names: ``00006-eval_no_grad.jsonl.gz``,
    ``033b-lstm_lm-checkpoint.jsonl.gz``."""
    return name.split(":", 1)[0].removesuffix(".jsonl.gz").removesuffix(".jsonl").split("-")[-1]


# The share of the training draws each source gets (renormalized over the sources present);
# within a source every second counts the same. The real jobs are what the model will meet,
# and they are few beside the simulated seconds: their share is set, not left to their size.
SOURCE_SHARES = {"sim": 0.35, "corpus": 0.35, "corpus_v1": 0.08, "host": 0.04, "extra": 0.08,
                 "shapes": 0.10}  # fmt: skip


def source_weights(seqs: list[Sequence]) -> np.ndarray:
    """Per sequence, its source's share divided by the source's ticks: drawn in proportion
    to ticks times this, each source gets its share and each second within it the same."""
    ticks: dict[str, int] = {}
    for s in seqs:
        src = s.group.split(":")[0]
        ticks[src] = ticks.get(src, 0) + len(s.x)
    return np.asarray([SOURCE_SHARES[s.group.split(":")[0]] / ticks[s.group.split(":")[0]]
                       for s in seqs])  # fmt: skip


def load_sources(
    src: Sources, cache: Path | str, log: Any = print
) -> tuple[list[Sequence], list[Sequence]]:
    """(train, val) sequences, each with its ``group`` set to its source (and view)."""
    from oomcast.training.dataset import sequences_of_trace
    from oomcast.training.record_corpus import corpus_paths
    from oomcast.training.shapes import shape_traces

    train_seqs: list[Sequence] = []
    val_seqs: list[Sequence] = []

    def add(target: list[Sequence], seqs: list[Sequence], group: str,
            runs: dict[str, dict[str, Any]] | None = None) -> None:  # fmt: skip
        target.extend(grouped(seqs, group, src.drop_sudden, runs))

    if src.sim is not None:
        views = ("full", "nvml") if src.nvml_views else ("full",)
        for view in views:
            add(train_seqs, load_folder(src.sim / "train", cache, view=view), f"sim:{view}")
            add(val_seqs, load_folder(src.sim / "val", cache, view=view), f"sim:{view}")
    if src.corpus is not None:  # a corpus still being recorded may lack a split yet
        manifest = json.loads((src.corpus / "manifest.json").read_text())
        runs = {r["file"]: r for r in manifest["runs"]}
        for split, target in (("train", train_seqs), ("val", val_seqs)):
            paths = corpus_paths(src.corpus, split)
            for view in ("full", "1hz") if paths else ():
                add(target, load_paths(paths, cache, view=view), f"corpus:{view}", runs)
    if src.corpus_v1 is not None:
        from oomcast.training.corpus.plan import SPLITS as JOB_SPLITS

        held_out = set(JOB_SPLITS["val"]) | set(JOB_SPLITS["test"])
        runs = json.loads((src.corpus_v1 / "manifest.json").read_text())["runs"]
        paths = [src.corpus_v1 / r["file"] for r in runs if r["program"] not in held_out]
        for view in ("full", "1hz"):
            add(train_seqs, load_paths(paths, cache, view=view), f"corpus_v1:{view}")
    if src.host is not None:
        add(train_seqs, load_paths(find_traces(src.host), cache), "host")
    if src.extra:
        add(train_seqs, load_paths(src.extra, cache), "extra")
    if src.shapes:
        for target, n, seed in ((train_seqs, src.shapes, 1), (val_seqs, src.shapes // 4, 2)):
            seqs = [q for t in shape_traces(n, seed) for q in sequences_of_trace(t, t.path)]
            add(target, seqs, "shapes")
    if not train_seqs or not val_seqs:
        raise FileNotFoundError("no training or no validation traces: give a source")
    log(
        "sequences: train "
        + ", ".join(f"{g} {n}" for g, n in _count(train_seqs).items())
        + "; val "
        + ", ".join(f"{g} {n}" for g, n in _count(val_seqs).items())
    )
    return train_seqs, val_seqs


def _count(seqs: list[Sequence]) -> dict[str, int]:
    out: dict[str, int] = {}
    for s in seqs:
        out[s.group] = out.get(s.group, 0) + 1
    return out


def _batches(
    seqs: list[Sequence],
    weights: np.ndarray,
    n: int,
    batch: int,
    max_ticks: int,
    rng: np.random.Generator,
) -> list[list[tuple[Sequence, int, int]]]:
    """``n`` draws of (sequence, start, end) grouped by length into batches. A sequence is
    drawn in proportion to its ticks (times its source's weight): every second of every run
    counts the same. One longer than ``max_ticks`` is cut: its start half the time (as the
    service meets a job), else a stretch that ends at a random tick in its last two thirds
    (the end of the run, its OOM if it has one, as often as not)."""
    ticks = np.asarray([len(s.x) for s in seqs], dtype=np.float64)
    p = weights * ticks
    picks = rng.choice(len(seqs), size=n, p=p / p.sum())
    spans = []
    for i in picks:
        s = seqs[int(i)]
        length = len(s.x)
        if length <= max_ticks:
            spans.append((s, 0, length))
        elif rng.random() < 0.5:
            spans.append((s, 0, max_ticks))
        else:
            end = length if rng.random() < 0.5 else int(rng.integers(max_ticks, length + 1))
            spans.append((s, end - max_ticks, end))
    spans.sort(key=lambda sp: sp[2] - sp[1])
    out = [spans[a : a + batch] for a in range(0, len(spans), batch)]
    rng.shuffle(out)
    return out


WARM_UP_TICKS = 60  # a cut that does not start at the job's start: its first minute is unlabelled


def _stack(
    group: list[tuple[Sequence, int, int]],
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """(x, seconds to OOM, seconds of known future, tick weights) of a batch, padded."""
    t_max = max(b - a for _, a, b in group)
    n_feat = group[0][0].x.shape[1]
    xs = np.zeros((len(group), t_max, n_feat), np.float32)
    tto = np.full((len(group), t_max), np.inf, np.float32)
    known = np.zeros((len(group), t_max), np.float32)
    wts = np.zeros((len(group), t_max), np.float32)
    for j, (s, a, b) in enumerate(group):
        xs[j, : b - a] = s.x[a:b]
        tto[j, : b - a] = s.tto[a:b]
        known[j, : b - a] = s.known_s()[a:b]
        wts[j, : b - a] = 1.0
        if a > 0:
            wts[j, :WARM_UP_TICKS] = 0.0
    return xs, tto, known, wts


def train(
    sources: Sources,
    out: Path | str,
    *,
    epochs: int = 40,
    draws_per_epoch: int = 1536,
    batch: int = 32,
    chunk: int = 128,
    max_ticks: int = 1800,
    lr: float = 3e-3,
    ema_decay: float = 0.995,
    pos_weight: float = 1.0,
    oom_weight: float = 3.0,
    cell_penalty: float = 1e-3,
    init_from: Path | str | None = None,
    patience: int = 10,
    max_minutes: float = 30.0,
    max_false_alarms: float = 0.02,
    seed: int = 0,
    cfg: NetConfig | None = None,
    cache: Path | str = "data/cache",
    log: Any = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Fit the network, calibrate it on the validation split, and keep the epoch whose best
    rule catches the most validation OOMs 30 s ahead (then 10 s ahead) while alerting on at
    most ``max_false_alarms`` of the OOM-free sequences of *every* validation group.

    Each epoch draws ``draws_per_epoch`` sequences (by source weight; see
    ``SOURCE_SHARES``) and runs each from its start, in chunks of ``chunk`` ticks with the
    LSTM state carried from chunk to chunk (truncated backpropagation through time): the
    network is trained exactly as the service runs it, from a job's first sample on."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    out = Path(out)
    train_seqs, val_seqs = load_sources(sources, cache, log)
    weights = source_weights(train_seqs)
    cfg = cfg or NetConfig()
    net = OOMForecastNet(cfg)
    mean, std = normalization(train_seqs)
    net.set_normalization(torch.from_numpy(mean), torch.from_numpy(std))
    if init_from is not None:  # go on from an earlier run's weights (and its normalization)
        net.load_state_dict(load_checkpoint(init_from)[0].state_dict())
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    # validated and kept: an exponential average of the weights (the raw ones swing from
    # one epoch to the next, and the rule chosen on them with them)
    ema = torch.optim.swa_utils.AveragedModel(
        net,
        multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(ema_decay),  # type: ignore[no-untyped-call]
    )
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=epochs, eta_min=lr / 20)
    log(
        f"training on {len(train_seqs)} sequences, validating on {len(val_seqs)}; {epochs}"
        f" epochs of {draws_per_epoch} draws, chunks of {chunk} ticks, at most"
        f" {max_minutes:g} min"
    )
    started = time.monotonic()
    best: dict[str, Any] | None = None
    stale = 0
    history = []
    for epoch in range(1, epochs + 1):
        net.train()
        losses = []
        groups = _batches(train_seqs, weights, draws_per_epoch, batch, max_ticks, rng)
        bar = tqdm(groups, desc=f"epoch {epoch}/{epochs}", unit="batch", leave=False,
                   disable=not progress)  # fmt: skip
        for group in bar:
            xs, tto, known, wts = _stack(group)
            # the minutes before an OOM are a sliver of all seconds, and all that says when
            # an OOM comes: weighed up, so the curve's shape there (its median, the time to
            # OOM) is learned; the calibration afterwards puts the risks back in scale
            wts = np.where(tto <= cfg.bins_s[-1], wts * oom_weight, wts)
            state = None
            for a in range(0, xs.shape[1], chunk):
                x = torch.from_numpy(xs[:, a : a + chunk])
                logits, state = net.hazard_logits(x, state)
                survived, event = hazard_targets(
                    torch.from_numpy(tto[:, a : a + chunk]),
                    torch.from_numpy(known[:, a : a + chunk]),
                    cfg.bins_s,
                )
                loss = hazard_loss(
                    logits, survived, event, torch.from_numpy(wts[:, a : a + chunk]), pos_weight
                )
                # An LSTM free to integrate a constant input (the job's age, a flat level)
                # grows its cell state without bound over a long run: its outputs saturate
                # and stop depending on the input at all (cell states in the hundreds were
                # seen). A domain lives for days in service, so the state must stay bounded.
                loss = loss + cell_penalty * state[1].pow(2).mean()
                opt.zero_grad()
                loss.backward()  # type: ignore[no-untyped-call]  # torch: backward() is unannotated
                torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                ema.update_parameters(net)
                state = (state[0].detach(), state[1].detach())
                losses.append(loss.item())
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
        sched.step()
        judged = cast(OOMForecastNet, ema.module)  # the averaged weights
        calibrate(judged, val_seqs)
        risks = predict_sequences(judged, val_seqs)
        rule = best_rule(score_rules(val_seqs, risks, max_false_alarms), max_false_alarms)
        tto_err = tto_error(judged, val_seqs)
        elapsed = (time.monotonic() - started) / 60
        history.append({"epoch": epoch, "loss": float(np.mean(losses)), "minutes": elapsed,
                        "tto_rel_err_30s": tto_err, **rule.__dict__})  # fmt: skip
        log(
            f"epoch {epoch:3d}/{epochs}  loss {np.mean(losses):.4f}  val: long OOMs"
            f" {rule.recall_30:.1%} at 30 s, {rule.recall_10:.1%} at 10 s; false alarms"
            f" {rule.false_alarm_rate:.1%} (worst group), near misses warned"
            f" {rule.near_miss_warned:.0%} (risk@{rule.horizon_s}s >= {rule.fire_risk});"
            f" tto error @30s {tto_err:.0%}  {elapsed:.1f} min"
        )
        score = (round(rule.recall_30, 3), rule.recall_10, -tto_err)
        if best is None or score > best["score"]:
            best = {
                "score": score,
                "epoch": epoch,
                "rule": rule,
                "state": {k: v.clone() for k, v in judged.state_dict().items()},
            }
            stale = 0
            save_checkpoint(out / "best.pt", judged, rule, epoch=epoch, seed=seed)
        else:
            stale += 1
        if stale >= patience or elapsed > max_minutes:
            log("stopping: " + ("no better for a while" if stale >= patience else "time budget"))
            break
    assert best is not None
    net.load_state_dict(best["state"])
    ckpt = save_checkpoint(
        out / "checkpoint.pt",
        net,
        best["rule"],
        optimizer=opt,
        epoch=best["epoch"],
        seed=seed,
        data={
            "sim": str(sources.sim),
            "corpus": str(sources.corpus),
            "corpus_v1": str(sources.corpus_v1),
            "host": str(sources.host),
            "extra": [str(p) for p in sources.extra],
            "shapes": sources.shapes,
            "nvml_views": sources.nvml_views,
            "train_sequences": _count(train_seqs),
            "val_sequences": _count(val_seqs),
        },
        history=history,
        minutes=round((time.monotonic() - started) / 60, 2),
    )
    (out / "history.json").write_text(json.dumps(history, indent=1))
    log(f"best epoch {best['epoch']}: {best['rule']}; saved {out / 'checkpoint.pt'}")
    return ckpt


def calibrate(net: OOMForecastNet, seqs: list[Sequence]) -> None:
    """Fit the per-horizon calibration on ``seqs`` (the validation split)."""
    net.cal_a.fill_(1.0)
    net.cal_b.fill_(0.0)
    log_s = predict_sequences(net, seqs, raw=True)
    ls = torch.from_numpy(np.concatenate(log_s))
    y = torch.from_numpy(np.concatenate([s.y for s in seqs]))
    m = torch.from_numpy(np.concatenate([s.m for s in seqs]))
    fit_calibration(net, ls, y, m)


def tto_error(net: OOMForecastNet, seqs: list[Sequence], at_s: float = 30.0) -> float:
    """Median relative error of the time-to-OOM head at ``at_s`` before each OOM."""
    ooms = [s for s in seqs if s.ooms]
    if not ooms:
        return float("nan")
    preds = predict_sequences(net, ooms, tto=True)
    errs = []
    for s, p in zip(ooms, preds, strict=True):
        before = np.flatnonzero(s.tto >= at_s)
        if len(before):
            i = int(before[-1])
            errs.append(abs(float(p[i]) - s.tto[i]) / s.tto[i])
    return float(np.median(errs)) if errs else float("nan")


def save_checkpoint(
    path: Path,
    net: OOMForecastNet,
    rule: ScoredRule,
    *,
    optimizer: torch.optim.Optimizer | None = None,
    epoch: int = 0,
    seed: int = 0,
    data: dict[str, Any] | None = None,
    history: list[dict[str, Any]] | None = None,
    minutes: float = 0.0,
) -> dict[str, Any]:
    """Weights, optimizer, config, feature-schema version and the chosen rule, in one file."""
    ckpt = {
        "weights": net.state_dict(),
        "optimizer": optimizer.state_dict() if optimizer is not None else None,
        "config": net.cfg.to_dict(),
        "embedding_version": net.cfg.embedding_version,
        "rule": {
            k: float(v) if isinstance(v, np.floating) else v
            for k, v in rule.__dict__.items()
            if k != "figures"
        },
        "rule_figures": rule.figures,
        "epoch": epoch,
        "seed": seed,
        "data": data or {},
        "history": history or [],
        "minutes": minutes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(ckpt, path)
    return ckpt


def load_checkpoint(path: Path | str) -> tuple[OOMForecastNet, dict[str, Any]]:
    ckpt = torch.load(path, map_location="cpu", weights_only=False)
    net = OOMForecastNet(NetConfig.from_dict(ckpt["config"]))
    net.load_state_dict(ckpt["weights"])
    net.eval()
    return net, ckpt


__all__ = [
    "ScoredRule",
    "best_rule",
    "first_run",
    "load_checkpoint",
    "predict_sequences",
    "score_rules",
    "train",
]
