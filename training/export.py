"""Export a trained checkpoint to ONNX (``oomcast export``).

The graph runs the network over a stretch of ticks: ``x`` (batch, time, features), ``h``
and ``c`` (layers, batch, hidden) in; ``risk`` (batch, time, horizons, calibrated),
``tto_s`` (batch, time: seconds to the OOM, if one follows), ``h_out`` and ``c_out`` out.
Batch and time are dynamic: the service streams with time = 1, carrying each domain's ``h``
and ``c`` between calls and stepping any number of domains in one call. Everything the
runtime needs to use the file correctly travels in the ONNX metadata: horizons, tick,
feature-schema version and names, the alert rule chosen on validation, and the validation
figures.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch

from oomcast.model.embedding import EMBEDDING_VERSION, FEATURES, N_FEATURES
from oomcast.model.forecast import rule_fire_risk
from oomcast.model.network import (
    BRINK_LEVEL,
    GATE_GROWTH_S,
    PLATEAU_MARGIN,
    RETRIES_LEVEL,
    STRAIGHT,
    SequenceModule,
)
from oomcast.training.train import load_checkpoint


def export(
    checkpoint: Path | str, out: Path | str, version: str, extra_meta: dict[str, Any] | None = None
) -> Path:
    import onnx

    net, ckpt = load_checkpoint(checkpoint)
    cfg = net.cfg
    step = SequenceModule(net).eval()
    batch = 2
    # today's schema in: a network trained on an earlier one (a prefix) reads its own part,
    # and the straight line reads the rest
    x = torch.zeros(batch, 3, N_FEATURES)
    h = torch.zeros(cfg.layers, batch, cfg.hidden)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with warnings.catch_warnings():
        # the legacy exporter warns about LSTM batch sizes; h and c are inputs here, which
        # is exactly what makes any batch size safe
        warnings.simplefilter("ignore")
        torch.onnx.export(
            step,
            (x, h, h.clone()),
            str(out),
            input_names=["x", "h", "c"],
            output_names=["risk", "tto_s", "h_out", "c_out"],
            dynamic_axes={
                "x": {0: "batch", 1: "time"},
                "h": {1: "batch"},
                "c": {1: "batch"},
                "risk": {0: "batch", 1: "time"},
                "tto_s": {0: "batch", 1: "time"},
                "h_out": {1: "batch"},
                "c_out": {1: "batch"},
            },
            opset_version=17,
            dynamo=False,
        )
    model = onnx.load(str(out))
    meta = {
        "oomcast.version": version,
        "oomcast.horizons_s": json.dumps(list(cfg.horizons_s)),
        "oomcast.embedding_version": str(EMBEDDING_VERSION),
        "oomcast.features": json.dumps(list(FEATURES)),
        "oomcast.layers": str(cfg.layers),
        "oomcast.hidden": str(cfg.hidden),
        "oomcast.rule": json.dumps(ckpt["rule"]),
        "oomcast.tick_s": str(cfg.tick_s),
        "oomcast.tto_min_risk": str(min(0.5, rule_fire_risk(ckpt["rule"]))),
        "oomcast.bins_s": json.dumps(list(cfg.bins_s)),
        "oomcast.straight": json.dumps(STRAIGHT),
        "oomcast.network_features": str(cfg.n_features),
        "oomcast.gate": json.dumps(
            {
                "growth_s": GATE_GROWTH_S,
                "plateau_margin": PLATEAU_MARGIN,
                "brink_level": BRINK_LEVEL,
                "retries_level": RETRIES_LEVEL,
            }
        ),
        # the validation figures that chose the rule: per group, what it alerts on
        "oomcast.rule_validation": json.dumps(ckpt.get("rule_figures", {})),
        "oomcast.trained": json.dumps(
            {
                "epoch": ckpt["epoch"],
                "seed": ckpt["seed"],
                "data": ckpt["data"],
                "minutes": ckpt["minutes"],
            }
        ),
        **{f"oomcast.{k}": json.dumps(v) for k, v in (extra_meta or {}).items()},
    }
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.save(model, str(out))
    return out
