"""Train the LSTM forecaster (``oomcast train``).

Reads the train and val splits written by ``oomcast simulate`` (plus any extra folders of
real traces), samples windows that over-represent the minutes before an OOM, fits the
survival head with a class-weighted loss, and keeps the epoch that alerts earliest on the
validation split while keeping false alarms under the target. The alert rule (horizon and
risk threshold) is chosen on the validation split too, and saved with the weights, the
optimizer state, the config and the feature-schema version, so a checkpoint explains
itself.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from oomcast.model.forecast import HORIZONS_S
from oomcast.model.network import NetConfig, OOMForecastNet, survival_loss
from oomcast.model.trace import find_traces
from oomcast.training.dataset import (
    Sequence,
    load_folder,
    load_paths,
    normalization,
    sample_windows,
)

THRESHOLDS = np.round(np.concatenate([np.arange(0.05, 0.95, 0.025), [0.95, 0.97, 0.99]]), 4)


@dataclass
class Rule:
    horizon_s: int
    threshold: float
    recall_30: float
    recall_10: float
    false_alarm_rate: float
    fire_after: int = 1  # consecutive samples at or above the threshold


FIRE_AFTER = (1, 2, 3)


def predict_sequences(
    net: OOMForecastNet, seqs: list[Sequence], batch: int = 64
) -> list[np.ndarray]:
    """Risk (time, H) for every sequence, run from its first sample as the service would."""
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
            risk, _ = net(torch.from_numpy(x))
            for j, i in enumerate(idx):
                results[i] = risk[j, : len(seqs[i].x)].numpy()
    out = [results[i] for i in range(len(seqs))]
    return out


def score_rules(seqs: list[Sequence], risks: list[np.ndarray]) -> list[Rule]:
    """Recall at 30 s and 10 s and the false-alarm rate of every (horizon, threshold,
    consecutive samples), counted as ``oomcast evaluate`` counts them."""
    rules = []
    ooms = [i for i, s in enumerate(seqs) if s.ooms]
    oks = [i for i, s in enumerate(seqs) if not s.ooms]
    for k, h in enumerate(HORIZONS_S):
        for p in THRESHOLDS:
            for after in FIRE_AFTER:
                caught30 = caught10 = 0
                for i in ooms:
                    at = first_run(risks[i][:, k] >= p, after)
                    if at is not None:
                        lead = seqs[i].tto[at]
                        caught30 += lead >= 30
                        caught10 += lead >= 10
                fa = sum(1 for i in oks if first_run(risks[i][:, k] >= p, after) is not None)
                rules.append(
                    Rule(
                        h,
                        float(p),
                        caught30 / max(1, len(ooms)),
                        caught10 / max(1, len(ooms)),
                        fa / max(1, len(oks)),
                        after,
                    )
                )
    return rules


def first_run(fired: np.ndarray, n: int) -> int | None:
    """Index of the sample that completes the first run of ``n`` consecutive True."""
    run = fired.copy()
    for j in range(1, n):
        run[j:] &= fired[:-j] if j < len(fired) else False
        run[:j] = False
    hit = np.flatnonzero(run)
    return int(hit[0]) if len(hit) else None


def best_rule(rules: list[Rule], max_false_alarms: float) -> Rule:
    ok = [r for r in rules if r.false_alarm_rate <= max_false_alarms]
    if not ok:
        return min(rules, key=lambda r: (r.false_alarm_rate, -r.recall_30))
    return max(
        ok,
        key=lambda r: (r.recall_30, r.recall_10, -r.false_alarm_rate, -r.fire_after, r.threshold),
    )


def hard_moments(
    net: OOMForecastNet, seqs: list[Sequence], rule: Rule, top: int = 256
) -> list[tuple[int, int]]:
    """Where the model comes closest to a false alarm: for every OOM-free sequence (and every
    OOM sequence's stretch more than 300 s before its OOM), the sample of highest risk at the
    rule's horizon; the ``top`` riskiest of those, as (sequence, sample) pairs."""
    k = list(HORIZONS_S).index(rule.horizon_s)
    calm = [i for i, s in enumerate(seqs) if not s.ooms or (s.tto > 300).any()]
    risks = predict_sequences(net, [seqs[i] for i in calm])
    found = []
    for i, r in zip(calm, risks, strict=True):
        s = seqs[i]
        ok = s.tto > 300  # inf for OOM-free sequences
        if not ok.any():
            continue
        col = np.where(ok, r[:, k], -1.0)
        at = int(np.argmax(col))
        found.append((float(col[at]), i, at))
    found.sort(reverse=True)
    return [(i, at) for _, i, at in found[:top]]


def train(
    data: Path | str,
    out: Path | str,
    *,
    extra_train: list[Path] | None = None,
    extra_weight: float = 20.0,
    epochs: int = 60,
    windows_per_epoch: int = 4096,
    window: int = 192,
    batch: int = 64,
    lr: float = 3e-3,
    pos_weight: float = 2.0,
    focus: float = 0.4,
    hard_share: float = 0.2,
    mine_every: int = 3,
    patience: int = 30,
    max_minutes: float = 25.0,
    max_false_alarms: float = 0.015,
    nvml_views: bool = True,
    seed: int = 0,
    cfg: NetConfig | None = None,
    cache: Path | str = "data/cache",
    log: Any = print,
    progress: bool = True,
) -> dict[str, Any]:
    """Fit the network; keep the epoch whose best validated rule catches the most OOM traces
    30 s ahead (then 10 s ahead) with at most ``max_false_alarms`` of the OOM-free traces
    alerted. ``extra_train`` are folders or trace files of real traces; their samples are
    drawn ``extra_weight`` times as often as simulated ones, since there are few of them."""
    from tqdm import tqdm

    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    torch.set_num_threads(max(1, min(2, torch.get_num_threads())))
    data, out = Path(data), Path(out)
    train_seqs = load_folder(data / "train", cache)
    if nvml_views:  # GPUs seen by NVML alone, without the hook's allocator figures
        train_seqs += load_folder(data / "train", cache, view="nvml")
    weights = [1.0] * len(train_seqs)
    extra_paths: list[Path] = []
    for item in extra_train or []:
        extra_paths += find_traces(item) if Path(item).is_dir() else [Path(item)]
    if extra_paths:
        extra = load_paths(extra_paths, cache)
        train_seqs += extra
        weights += [extra_weight] * len(extra)
    val_seqs = load_folder(data / "val", cache)
    if nvml_views:
        val_seqs += load_folder(data / "val", cache, view="nvml")
    cfg = cfg or NetConfig()
    net = OOMForecastNet(cfg)
    mean, std = normalization(train_seqs)
    net.set_normalization(torch.from_numpy(mean), torch.from_numpy(std))
    opt = torch.optim.AdamW(net.parameters(), lr=lr, weight_decay=1e-4)
    steps_per_epoch = -(-windows_per_epoch // batch)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=lr, total_steps=epochs * steps_per_epoch, pct_start=0.1
    )
    log(
        f"training on {len(train_seqs)} sequences ({len(extra_paths)} real traces weighted"
        f" x{extra_weight:g}), validating on {len(val_seqs)}; {epochs} epochs of"
        f" {windows_per_epoch} windows of {window} samples, at most {max_minutes:g} min"
    )
    started = time.monotonic()
    best: dict[str, Any] | None = None
    stale = 0
    history = []
    hard: list[tuple[int, int]] = []
    rule: Rule | None = None
    for epoch in range(1, epochs + 1):
        net.train()
        if rule is not None and mine_every and epoch % mine_every == 0:
            hard = hard_moments(net, train_seqs, rule)
            net.train()
        xs, ys, ms, _ = sample_windows(
            train_seqs,
            windows_per_epoch,
            window,
            rng,
            focus=focus,
            weights=np.asarray(weights),
            hard=hard,
            hard_share=hard_share if hard else 0.0,
        )
        losses = []
        bar = tqdm(
            range(0, windows_per_epoch, batch),
            desc=f"epoch {epoch}/{epochs}",
            unit="batch",
            leave=False,
            disable=not progress,
        )
        for a in bar:
            x = torch.from_numpy(xs[a : a + batch])
            log_s, _ = net.log_survival(x)
            loss = survival_loss(
                log_s,
                torch.from_numpy(ys[a : a + batch]),
                torch.from_numpy(ms[a : a + batch]),
                pos_weight,
            )
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
            opt.step()
            sched.step()
            losses.append(loss.item())
            bar.set_postfix(loss=f"{np.mean(losses[-20:]):.4f}")
        rule = best_rule(score_rules(val_seqs, predict_sequences(net, val_seqs)), max_false_alarms)
        elapsed = (time.monotonic() - started) / 60
        history.append(
            {"epoch": epoch, "loss": float(np.mean(losses)), "minutes": elapsed, **rule.__dict__}
        )
        log(
            f"epoch {epoch:3d}/{epochs}  loss {np.mean(losses):.4f}  val: recall@30s"
            f" {rule.recall_30:.1%} recall@10s {rule.recall_10:.1%} false alarms"
            f" {rule.false_alarm_rate:.1%} (risk@{rule.horizon_s}s >= {rule.threshold}"
            f" x{rule.fire_after})"
            f"  {elapsed:.1f} min"
        )
        ok = rule.false_alarm_rate <= max_false_alarms
        score = (ok, rule.recall_30, rule.recall_10, -rule.false_alarm_rate)
        if best is None or score > best["score"]:
            best = {
                "score": score,
                "epoch": epoch,
                "rule": rule,
                "state": {k: v.clone() for k, v in net.state_dict().items()},
            }
            stale = 0
            # the best so far, on disk at once: a long run can be looked at before it ends
            save_checkpoint(out / "best.pt", net, rule, epoch=epoch, seed=seed)
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
            "sim": str(data),
            "extra_train": [str(p) for p in extra_paths],
            "nvml_views": nvml_views,
            "train_sequences": len(train_seqs),
            "val_sequences": len(val_seqs),
        },
        history=history,
        minutes=round((time.monotonic() - started) / 60, 2),
    )
    (out / "history.json").write_text(json.dumps(history, indent=1))
    log(f"best epoch {best['epoch']}: {best['rule']}; saved {out / 'checkpoint.pt'}")
    return ckpt


def save_checkpoint(
    path: Path,
    net: OOMForecastNet,
    rule: Rule,
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
            k: float(v) if isinstance(v, np.floating) else v for k, v in rule.__dict__.items()
        },
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
    "Rule",
    "best_rule",
    "first_run",
    "load_checkpoint",
    "predict_sequences",
    "score_rules",
    "train",
]
