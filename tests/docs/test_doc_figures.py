"""The shipped model's timings, as the README and the docs quote them, agree with the model
file itself: its horizons, its alert rule (horizon and bar), when it reports a time to
OOM, its tick, its shape and its version. These are what an operator plans by ("how far
ahead does it warn?"), and they change whenever the model is retrained: a doc that quotes
the old model is a trap (issue 17 found the README and the model card disagreeing).

Each check reads the figure from the prose with a pattern that fails loudly when the
sentence is reworded, so a changed doc is looked at again rather than skipped."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from oomcast.model.forecast import rule_fire_risk

ROOT = Path(__file__).resolve().parents[2]
MODEL = ROOT / "model" / "oomcast-lstm.onnx"


def _duration(value: str, unit: str) -> int:
    """'5', 's' -> 5; '5', 'min' -> 300."""
    return int(value) * (60 if unit.startswith("min") else 1)


@pytest.fixture(scope="module")
def meta() -> dict[str, Any]:
    ort = pytest.importorskip("onnxruntime")
    raw = ort.InferenceSession(str(MODEL)).get_modelmeta().custom_metadata_map
    return {
        "version": raw["oomcast.version"],
        "horizons_s": json.loads(raw["oomcast.horizons_s"]),
        "rule": json.loads(raw["oomcast.rule"]),
        "tick_s": float(raw.get("oomcast.tick_s", "1.0")),
        "tto_min_risk": float(raw["oomcast.tto_min_risk"]),
        "layers": int(raw["oomcast.layers"]),
        "hidden": int(raw["oomcast.hidden"]),
    }


def _find(doc: str, pattern: str) -> re.Match[str]:
    text = " ".join((ROOT / doc).read_text().split())  # prose wraps anywhere
    m = re.search(pattern, text)
    assert m is not None, f"{doc}: no sentence matches {pattern!r}; was it reworded?"
    return m


def test_the_readme_quotes_the_models_horizons(meta: dict[str, Any]) -> None:
    m = _find("README.md", r"within (\d+) (s|min) to (\d+) (s|min) and the time left")
    quoted = (_duration(m[1], m[2]), _duration(m[3], m[4]))
    assert quoted == (min(meta["horizons_s"]), max(meta["horizons_s"])), (
        f"README says {quoted[0]}-{quoted[1]} s; the shipped model forecasts {meta['horizons_s']}"
    )


def test_the_model_card_names_the_shipped_version(meta: dict[str, Any]) -> None:
    m = _find("docs/model-card.md", r"\(version `([^`]+)`\)")
    assert m[1] == meta["version"]


def test_the_model_card_quotes_the_alert_rule(meta: dict[str, Any]) -> None:
    m = _find("docs/model-card.md", r"risk within \*\*(\d+) s >= (0\.\d+)\*\*")
    rule = meta["rule"]
    assert int(m[1]) == rule["horizon_s"]
    assert float(m[2]) == pytest.approx(rule_fire_risk(rule), abs=5e-4)
    m = _find("docs/model-card.md", r"reported once the risk within (\d+) s reaches (0\.\d+)")
    assert int(m[1]) == max(meta["horizons_s"])
    assert float(m[2]) == pytest.approx(meta["tto_min_risk"])


def test_the_dashboard_doc_quotes_the_alert_horizon(meta: dict[str, Any]) -> None:
    m = _find("docs/dashboard.md", r"\((\d+) s for the shipped model\)")
    assert int(m[1]) == meta["rule"]["horizon_s"]


def test_the_model_card_quotes_the_tick_and_the_network(meta: dict[str, Any]) -> None:
    m = _find("docs/model-card.md", r"ticks once per (second|(\d+) s) of trace time")
    assert (1.0 if m[1] == "second" else float(m[2])) == meta["tick_s"]
    m = _find("docs/model-card.md", r"(\d+)-layer LSTM \((\d+) units\)")
    assert (int(m[1]), int(m[2])) == (meta["layers"], meta["hidden"])
