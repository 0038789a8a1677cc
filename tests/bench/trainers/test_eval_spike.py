"""bench/trainers/eval_spike.py: the eval's announced figure, its arguments, and a short
real run. The run under a memory cgroup, warned and killed, is
tests/service/test_phase_oom_e2e.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from oomcast.bench.trainers import eval_spike as trainer


def test_the_announced_eval_figure_is_what_the_real_eval_holds_and_scales_with_its_batches() -> (
    None
):
    # fake tensors (nothing allocated) against the same capture on real tensors
    fake = trainer.eval_extra_bytes(128, 16, 64, 6)
    real = trainer.eval_extra_bytes(128, 16, 64, 6, fake=False)
    assert fake == real
    # each kept batch holds its input and both ReLU outputs (64 x (64 + 128 + 128) floats)
    per_batch = 64 * (64 + 128 + 128) * 4
    assert 6 * per_batch <= fake <= 6 * per_batch + 64 * 1024
    assert trainer.eval_extra_bytes(128, 16, 64, 12) >= fake + 6 * per_batch


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--eval-every", "0"], "--eval-every must be at least 1, got 0"),
        (["--step-s", "0"], "--step-s must be positive, got 0.0"),
        (["--eval-batches", "-2"], "--eval-batches must be at least 1, got -2"),
    ],
)
def test_bad_arguments_are_refused_by_name(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        trainer.parse_args(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_a_short_run_trains_evaluates_and_logs_each_event_with_its_time(tmp_path: Path) -> None:
    argv = ["--steps", "4", "--eval-every", "2", "--step-s", "0.01", "--width", "32"]
    argv += ["--eval-batch", "8", "--eval-batches", "2", "--batch", "8"]
    out = subprocess.run(
        [sys.executable, "-m", "oomcast.bench.trainers.eval_spike", *argv],
        env={**os.environ, "OOMCAST_HOOK": "off"},
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    events = [json.loads(line) for line in out.splitlines() if line.startswith('{"ts"')]
    names = [(e["event"], e.get("step")) for e in events]
    assert names == [
        ("start", None),
        ("announced", None),
        ("eval_begin", 2),
        ("eval_end", 2),
        ("eval_begin", 4),
        ("eval_end", 4),
        ("finished", None),
    ]
    assert events[0]["mode"] == "off" and events[1]["eval_extra_bytes"] > 0
    ts = [e["ts"] for e in events]
    assert ts == sorted(ts)
