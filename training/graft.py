"""Carry an exported model to the current embedding schema and served graph, its network
untouched (``python -m oomcast.training.graft``).

An ONNX file exported before the straight-line component (``model/network.py``,
``straight_line``) and the ``drawdown_120s`` feature (embedding v7) holds a network that is
still good: retraining it only to move it to the new schema would change everything the
model card measured about it. This rewrites the graph instead:

- ``x`` takes the current schema's features; the old network's nodes read the features it
  was trained on (the schema only ever grows at its end) through a ``Slice``;
- its ``risk`` and ``tto_s`` become inputs of the straight-line tail, exported from the
  same torch code the service's own export runs (``served``): the risk is the higher of the
  network's (already calibrated and gated) and the straight line's through the evidence
  gate, and the time to OOM the line's where it holds;
- the metadata says so: the new version and schema, the tail's parameters
  (``oomcast.straight``) and the file it was grafted from (``oomcast.grafted``). The rule,
  its validation figures and the training record stay as they were.

    python -m oomcast.training.graft model/oomcast-lstm.onnx --version lstm-2026.12.05 \\
        --out model/oomcast-lstm.onnx
"""

from __future__ import annotations

import argparse
import hashlib
import json
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
from torch import nn

from oomcast.model.embedding import EMBEDDING_VERSION, FEATURES
from oomcast.model.network import STRAIGHT, evidence_gate, straight_line

# the old network's outputs and its slice of x, inside the grafted graph
X_NET, RISK_NET, TTO_NET = "graft/x", "graft/risk", "graft/tto_s"
_KEEP = ("x", RISK_NET, TTO_NET, "risk", "tto_s")


class Tail(nn.Module):
    """(x, the network's served risk and time to OOM) -> the same with the straight line,
    as ``served`` computes them (the gate is 0 or 1, so max(a, b) * gate is max(a * gate,
    b * gate))."""

    def __init__(self, horizons_s: tuple[int, ...]) -> None:
        super().__init__()
        self.horizons_s = horizons_s

    def forward(
        self, x: torch.Tensor, risk: torch.Tensor, tto: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        line, holds, line_s = straight_line(x, self.horizons_s)
        out = torch.maximum(risk, line * evidence_gate(x, self.horizons_s))
        return out, torch.where(holds, line_s.clamp(0.5, 3600.0), tto)


def _tail_graph(horizons_s: tuple[int, ...], n_horizons: int) -> Any:
    import onnx

    x = torch.zeros(2, 3, len(FEATURES))
    risk = torch.zeros(2, 3, n_horizons)
    tto = torch.ones(2, 3)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tail.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(
                Tail(horizons_s).eval(),
                (x, risk, tto),
                str(path),
                input_names=["x", RISK_NET, TTO_NET],
                output_names=["risk", "tto_s"],
                dynamic_axes={n: {0: "batch", 1: "time"} for n in _KEEP},
                opset_version=17,
                dynamo=False,
            )
        return onnx.load(str(path))


def graft(src: Path | str, out: Path | str, version: str) -> Path:
    """Write ``src`` (an exported model of an earlier schema) to ``out`` with the current
    schema's input and the straight-line tail. ValueError when ``src`` is not such a file."""
    import onnx
    from onnx import helper

    raw = Path(src).read_bytes()
    model = onnx.load_from_string(raw)
    meta = {p.key: p.value for p in model.metadata_props}
    old_features = json.loads(meta.get("oomcast.features", "[]"))
    if "oomcast.straight" in meta or old_features == list(FEATURES):
        raise ValueError(f"{src} already has the straight-line tail (today's schema)")
    if not old_features or list(FEATURES[: len(old_features)]) != old_features:
        raise ValueError(f"{src}: its features are not a prefix of today's schema")
    if "oomcast.recalibration" in meta:
        raise ValueError(
            f"{src} carries a recalibration fitted on the network's risk alone; graft the file"
            " it was refitted from, then run oomcast recalibrate on the grafted one"
        )
    opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), None)
    if opset != 17:
        raise ValueError(f"{src}: opset {opset}; the tail is exported at opset 17")
    horizons = tuple(int(h) for h in json.loads(meta["oomcast.horizons_s"]))
    g = model.graph
    for node in g.node:
        node.input[:] = [X_NET if i == "x" else i for i in node.input]
        node.output[:] = [{"risk": RISK_NET, "tto_s": TTO_NET}.get(o, o) for o in node.output]
    keep = helper.make_tensor("graft/keep", onnx.TensorProto.INT64, [1], [len(old_features)])
    zero = helper.make_tensor("graft/zero", onnx.TensorProto.INT64, [1], [0])
    axis = helper.make_tensor("graft/axis", onnx.TensorProto.INT64, [1], [2])
    g.initializer.extend([keep, zero, axis])
    cut = helper.make_node("Slice", ["x", "graft/zero", "graft/keep", "graft/axis"], [X_NET])
    g.node.insert(0, cut)
    x_in = next((i for i in g.input if i.name == "x"), None)
    if x_in is None:
        raise ValueError(f"{src}: its graph has no input named x")
    x_in.type.tensor_type.shape.dim[2].dim_value = len(FEATURES)

    tail = _tail_graph(horizons, len(horizons)).graph

    def named(n: str) -> str:
        return n if n in _KEEP or not n else f"line/{n}"

    for node in tail.node:
        node.input[:] = [named(i) for i in node.input]
        node.output[:] = [named(o) for o in node.output]
        node.name = named(node.name) if node.name else ""
        g.node.append(node)
    for init in tail.initializer:
        init.name = named(init.name)
        g.initializer.append(init)

    meta.update(
        {
            "oomcast.version": version,
            "oomcast.embedding_version": str(EMBEDDING_VERSION),
            "oomcast.features": json.dumps(list(FEATURES)),
            "oomcast.straight": json.dumps(STRAIGHT),
            "oomcast.grafted": json.dumps(
                {
                    "from_version": meta["oomcast.version"],
                    "from_sha256": hashlib.sha256(raw).hexdigest(),
                    "from_embedding_version": int(meta["oomcast.embedding_version"]),
                    "network_features": len(old_features),
                }
            ),
            "oomcast.network_features": str(len(old_features)),
        }
    )
    del model.metadata_props[:]
    for key, value in meta.items():
        entry = model.metadata_props.add()
        entry.key, entry.value = key, value
    onnx.checker.check_model(model, full_check=True)
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    data = model.SerializeToString()
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oomcast.training.graft", description=__doc__)
    p.add_argument("model", type=Path, help="an exported model of an earlier schema")
    p.add_argument("--version", required=True, help="the grafted model's version")
    p.add_argument("--out", type=Path, required=True, help="where to write it")
    args = p.parse_args(argv)
    out = graft(args.model, args.out, args.version)
    print(f"wrote {out} ({args.version}, embedding v{EMBEDDING_VERSION})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
