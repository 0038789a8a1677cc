"""``oomcast preflight``: --entry, scripts that submit() a job, --json, --plot, bad input
(scripts as written: tests/preflight/test_script.py).

(The CLI module is cli/preflight.py; its tests live here with the rest of
preflight's.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from support import oomcast_cmd

from oomcast.cli.main import main

HERE = Path(__file__).resolve().parent
ENTRY = ["--entry", "preflight_jobs:small_mlp"]

SCRIPT = """
import argparse, sys
import torch
from torch import nn
from oomcast.preflight import PreflightJob, submit

ap = argparse.ArgumentParser()
ap.add_argument("--width", type=int, required=True)
args = ap.parse_args()
w = args.width
job = PreflightJob(
    name=f"script-mlp{w}",
    model=lambda: nn.Sequential(nn.Linear(w, w), nn.ReLU(), nn.Linear(w, 10)),
    batch=lambda b, s: (torch.randn(b, w), torch.randint(0, 10, (b,))),
    loss=lambda m, b: nn.functional.cross_entropy(m(b[0]), b[1]),
    batch_size=16,
)
submit(job)
print("TRAINING STARTED")
"""


def _json(capsys: pytest.CaptureFixture[str]) -> dict[str, object]:
    out = capsys.readouterr().out
    obj: dict[str, object] = json.loads(out)
    return obj


def test_entry_json(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "preflight",
            "--gpu",
            "T4",
            "--json",
            "--steps",
            "1",
            "--no-remedies",
            "--entry",
            "preflight_jobs:small_mlp",
        ]
    )
    obj = _json(capsys)
    assert rc == 0 and obj["gpu"] == "T4" and obj["verdict"]["fits"] is True  # type: ignore[index]
    assert obj["phases"] and obj["remedies"] == []


def test_an_oom_exits_1_with_the_phase(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "preflight",
            "--capacity-bytes",
            str(1 << 20),
            "--steps",
            "1",
            "--entry",
            "preflight_jobs:small_mlp",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 1
    assert "verdict: OOM" in out and "remedies" in out


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_script_mode_hands_over_the_job_and_stops_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    plot = tmp_path / "timeline.png"
    argv_before = sys.argv[:]
    rc = main(
        [
            "preflight",
            "--gpu",
            "L4",
            "--json",
            "--steps",
            "1",
            "--plot",
            str(plot),
            "--",
            "python",
            str(script),
            "--width",
            "128",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    obj = json.loads(captured.out)
    assert obj["job"] == "script-mlp128"  # the script's own arguments reached it
    assert "TRAINING STARTED" not in captured.out
    assert plot.read_bytes()[:4] == b"\x89PNG"
    assert sys.argv == argv_before


def test_a_missing_script_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    rc = main(["preflight", "--gpu", "L4", "--", "python", str(tmp_path / "missing.py")])
    assert rc == 2 and "no such script" in capsys.readouterr().err


def test_a_failing_script_or_missing_module_is_a_usage_error_not_an_oom_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Exit status 1 means "would OOM": a launcher that gates on it must not read a typo in
    ``-m MODULE``, or a script that crashes before ``submit``, as a verdict (both exited 1
    with a raw traceback). Errors name the subcommand, not ``oomcast []``."""
    rc = main(["preflight", "--gpu", "T4", "--", "python", "-m", "no_such_pkg_here.train"])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("oomcast preflight: error: -m no_such_pkg_here.train: no such module")
    assert "PYTHONPATH" in err
    script = tmp_path / "crash.py"
    script.write_text("raise KeyError('batch_size')\n")
    rc = main(["preflight", "--gpu", "T4", "--", "python", str(script)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "oomcast preflight: error: " in err and "crash.py:1" in err
    assert "KeyError: 'batch_size'" in err and "Traceback" in err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--gpu", "T4", "--alloc-conf", "max_split_size_mb:abc", *ENTRY],
            "max_split_size_mb must be a whole number of MiB, not 'abc'",
        ),
        (
            ["--gpu", "T4", "--alloc-conf", "expandable:True", *ENTRY],
            "unknown alloc conf key 'expandable'",
        ),
        (["--gpu", "Z80", *ENTRY], "unknown GPU 'Z80'; known: H200, H100-80GB"),
        (ENTRY, "give --gpu NAME or --capacity-bytes N"),
        (["--gpu", "T4", "--entry", "preflight_jobs"], "--entry must be pkg.module:function"),
        (["--gpu", "T4", "--entry", "preflight_jobs:nothing"], "has no function nothing"),
        (["--gpu", "T4", "--entry", "preflight_jobs:param_bytes"], "returned int"),
        (["--gpu", "T4"], "give --entry pkg.module:function or -- python train.py ARGS"),
    ],
)
def test_bad_input_is_named(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["preflight", *argv])
    assert rc == 2
    assert message in capsys.readouterr().err


BLOCKED_RUN = """
import importlib.abc, sys
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.partition(".")[0] == "torch":
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Block())
from oomcast.cli.main import main
sys.exit(main(sys.argv[1:]))
"""


def test_without_torch_the_command_names_the_extra() -> None:
    out = subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, "preflight", "--gpu", "T4", "--entry", "x:y"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert "pip install 'oomcast[preflight]'" in out.stderr  # torch, not the training tools


@pytest.mark.slow
def test_the_installed_command_runs_an_entry() -> None:
    env = {**os.environ, "PYTHONPATH": str(HERE.parent / "preflight")}  # preflight_jobs.py
    out = subprocess.run(
        oomcast_cmd(
            "preflight",
            "--gpu",
            "H100-80GB",
            "--steps",
            "1",
            "--json",
            "--entry",
            "preflight_jobs:small_mlp",
        ),
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr
    obj = json.loads(out.stdout)
    assert obj["capacity_bytes"] == 81559 * (1 << 20) - 768 * (1 << 20)
    assert [r["name"] for r in obj["remedies"]][:2] == ["largest_batch", "expandable_segments"]


def test_script_mode_runs_a_module_too(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "my_train_mod.py").write_text(SCRIPT)
    monkeypatch.syspath_prepend(str(tmp_path))
    rc = main(
        [
            "preflight",
            "--capacity-bytes",
            str(1 << 30),
            "--steps",
            "1",
            "--no-remedies",
            "--json",
            "--",
            "python",
            "-m",
            "my_train_mod",
            "--width",
            "96",
        ]
    )
    captured = capsys.readouterr()
    assert rc == 0, captured.err
    assert json.loads(captured.out)["job"] == "script-mlp96"
