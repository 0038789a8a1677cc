"""training/programs.py: every program runs, and every cause does what it says to memory."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from oomcast.training.programs import CAUSES, PROGRAMS, build_parser

pytestmark = pytest.mark.slow


def _run(*argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomcast.training.programs", *argv],
        capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


@pytest.mark.parametrize("program", sorted(PROGRAMS))
def test_every_program_runs_a_few_steps(program: str) -> None:
    if program == "hf_bert" and importlib.util.find_spec("transformers") is None:
        pytest.skip("hf_bert needs transformers and accelerate (pip install transformers)")
    done = _run(program, "--steps", "6", "--duration-s", "0.5", "--batch", "4",
                "--eval-every", "3", "--ckpt-every", "4")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("cause", [c for c in CAUSES if c != "none"])
def test_every_cause_runs_in_a_program(cause: str) -> None:
    done = _run("cnn_classifier", "--cause", cause, "--steps", "8", "--duration-s", "0.5",
                "--batch", "4", "--every", "2", "--onset", "2", "--amount", "2")  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]


def _peak_rss_kib(*argv: str) -> int:
    """The program's own peak RSS: VmHWM of its address space. Not ``ru_maxrss``, which
    Linux carries across fork and exec: a child of this pytest process would report at
    least the RSS pytest had when it forked (over 1 GB late in a full run)."""
    code = (
        "import re, sys; sys.argv = ['programs', *sys.argv[1:]];"
        "from oomcast.training.programs import main; main(sys.argv[1:]);"
        "print(re.search(r'VmHWM:\\s+(\\d+) kB', open('/proc/self/status').read()).group(1))"
    )
    done = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                          timeout=120, check=True)  # fmt: skip
    return int(done.stdout.strip().splitlines()[-1])


def test_a_leak_grows_memory_with_the_steps_and_none_does_not() -> None:
    base = ["cnn_classifier", "--batch", "16", "--duration-s", "0.5", "--every", "1"]
    short_leak = _peak_rss_kib(*base, "--cause", "leak", "--steps", "10")
    long_leak = _peak_rss_kib(*base, "--cause", "leak", "--steps", "150")
    long_none = _peak_rss_kib(*base, "--cause", "none", "--steps", "150")
    # The hook keeps 16 x 16 x 64 x 64 floats (4 MiB) per step: 560 MiB over 140 more steps.
    # Peak RSS also holds the first steps' transient activations (measured 100-600 MiB,
    # varying run to run), which hide part of a short leak: 150 steps make the leak the
    # larger part whatever that transient was.
    print(f"peak RSS KiB: leak x10 {short_leak}, leak x150 {long_leak}, none x150 {long_none}")
    assert long_leak - short_leak > 200 * 1024
    assert long_none < long_leak - 200 * 1024


def test_the_parser_names_every_cause() -> None:
    args = build_parser().parse_args(["gan", "--cause", "churn"])
    assert args.cause == "churn" and set(CAUSES) >= {"leak", "cache", "neighbour"}
    with pytest.raises(SystemExit):
        build_parser().parse_args(["gan", "--cause", "meteor"])
