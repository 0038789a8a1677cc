from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from oomcast.model.trace import find_traces, load_trace
from oomcast.training.scenarios import GROWTH_FAMILIES, SAFE_FAMILIES
from oomcast.training.simulate import SPLITS, simulate, split_of


@pytest.mark.slow
def test_simulate_writes_split_labelled_traces(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cache = tmp_path / "cache"
    manifest = simulate(tmp_path / "a", n=12, seed=5, workers=2, cache_dir=cache, progress=True)
    assert "simulate" in (err := capsys.readouterr().err) and "12/12" in err  # a progress bar
    entries = manifest["traces"]
    assert len(entries) == 12 == sum(manifest["splits"].values())
    assert {e["family"] for e in entries} >= {"leak", "steady"}
    # Held out by (model, GPU size): no combination appears in two splits.
    combos: dict[tuple[str, int], str] = {}
    for e in entries:
        assert e["split"] in SPLITS
        assert combos.setdefault((e["capture"], e["gpu_gib"]), e["split"]) == e["split"]
        trace = load_trace(tmp_path / "a" / e["file"])
        assert trace.ooms == e["ooms"]
        if e["ooms"]:
            # the first OOM event (a job with a schedule announces it before: a schedule event)
            assert next(ev.ts for ev in trace.events if ev.event == "oom") == e["oom_ts"]
    assert len(find_traces(tmp_path / "a")) == 12
    on_disk = json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert on_disk["traces"] == entries
    again = simulate(tmp_path / "b", n=12, seed=5, workers=1, cache_dir=cache)
    assert "12/12" not in capsys.readouterr().err  # not asked for: no bar
    assert again["traces"] == entries  # deterministic for a seed, whatever the workers
    for e in entries:  # byte for byte
        assert (tmp_path / "a" / e["file"]).read_bytes() == (
            tmp_path / "b" / e["file"]
        ).read_bytes()
    safe = [e for e in entries if e["family"] in SAFE_FAMILIES]
    assert safe and not any(e["ooms"] for e in safe)
    # a family that grows without bound is never cut short before its OOM
    growing = [e for e in entries if e["family"] in GROWTH_FAMILIES]
    assert growing and all(e["ooms"] for e in growing)
    with pytest.raises(FileExistsError, match="--overwrite"):
        simulate(tmp_path / "b", n=3, seed=5, workers=1, cache_dir=cache)
    simulate(tmp_path / "b", n=3, seed=5, workers=1, cache_dir=cache, overwrite=True)
    assert len(find_traces(tmp_path / "b")) == 3


def test_split_is_a_function_of_the_combination() -> None:
    seen = {split_of(c, g) for c in ("mlp", "cnn", "varlen", "lstm_lm") for g in (16, 40, 80)}
    assert seen <= set(SPLITS)
    assert split_of("mlp", 16) == split_of("mlp", 16)


@pytest.mark.slow
def test_cli_simulate_then_evaluate(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "oomcast.cli.main"]
    done = subprocess.run(
        [
            *cmd,
            "simulate",
            "--out",
            str(tmp_path / "s"),
            "--n",
            "6",
            "--cache",
            str(tmp_path / "cache"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "wrote 6 traces" in done.stdout
    ev = subprocess.run(
        [*cmd, "evaluate", "--traces", str(tmp_path / "s"), "--json"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    some = next(iter(result["detectors"].values()))
    assert some["oom_traces"] + some["ok_traces"] == 6
