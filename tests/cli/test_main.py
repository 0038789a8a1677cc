"""The ``oomcast`` command's traps, each found by a new user: no --version, --help without
descriptions or defaults, a traceback where an extra is missing (the collector image could
not even start, lacking pydantic)."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions, version
from pathlib import Path

import pytest
from support import oomcast_cmd

from oomcast.cli.common import EXTRAS
from oomcast.cli.main import build_parser

# Run the CLI in a fresh interpreter where the named top-level modules cannot be imported,
# as on an image installed without their extra. A None in sys.modules is what a missing
# module looks like both to `import` (ModuleNotFoundError) and to importlib.util.find_spec
# (None): torch asks find_spec about optional modules such as onnxruntime while it imports,
# and a finder that raised there made torch's own import fail, which no real install does.
BLOCKED_RUN = """
import sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
from oomcast.cli.main import main
sys.exit(main(sys.argv[2:]))
"""


def run_without(blocked: set[str], *argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKED_RUN, ",".join(sorted(blocked)), *argv],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_version() -> None:
    out = subprocess.run(oomcast_cmd("--version"), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    assert out.stdout.strip() == f"oomcast {version('oomcast')}"


def _commands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def test_every_command_has_a_description_and_shows_its_defaults() -> None:
    commands = _commands(build_parser())
    assert {"serve", "collect", "check", "export", "simulate", "bench"} <= set(commands)
    for name, parser in commands.items():
        assert parser.description, f"oomcast {name} --help has no description"
        text = parser.format_help()
        for action in parser._actions:
            if not action.option_strings or action.dest == "help":
                continue
            flag = action.option_strings[0]
            assert action.help, f"oomcast {name} {flag} has no help"
            said = "default" in action.help.lower()  # the author wrote it out
            if action.default not in (None, False, [], "", argparse.SUPPRESS) and not said:
                shown = str(action.default)
                # argparse may wrap a long default: compare without whitespace
                assert shown.replace(" ", "") in "".join(text.split()), (
                    f"oomcast {name} --help does not show {flag}'s default {shown!r}"
                )


@pytest.mark.parametrize(
    ("argv", "module", "extra"),
    [
        (("simulate", "--out", "x"), "torch", "train"),
        (("train", "--data", ""), "torch", "train"),
        (("serve",), "uvicorn", "service"),
    ],
)
def test_a_missing_extra_is_named_not_a_traceback(
    argv: tuple[str, ...], module: str, extra: str
) -> None:
    blocked = {m for m, e in EXTRAS.items() if e in ("train", "service")}
    out = run_without(blocked, *argv)
    assert out.returncode == 2, out.stderr
    assert "Traceback" not in out.stderr
    assert f"needs {module}" in out.stderr and f"pip install 'oomcast[{extra}]'" in out.stderr


def _extra_distributions(extra: str) -> set[str]:
    """The distributions ``pip install 'oomcast[extra]'`` brings, as pyproject.toml lists
    them (an extra that names other extras of oomcast's brings theirs too)."""
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    extras = tomllib.loads(pyproject.read_text())["project"]["optional-dependencies"]
    out: set[str] = set()
    for req in extras[extra]:
        name = re.split(r"[\[<>=!~; ]", req, maxsplit=1)[0]
        if name == "oomcast":
            for inner in req.partition("[")[2].partition("]")[0].split(","):
                out |= _extra_distributions(inner.strip())
        else:
            out.add(name.lower().replace("_", "-"))
    return out


@pytest.mark.parametrize(
    ("extra", "argv"),
    [
        ("train", ("train", "--help")),
        ("train", ("evaluate", "--help")),
        ("train", ("recalibrate", "--help")),
        ("train", ("simulate", "--n", "2", "--seed", "0", "--workers", "1", "--out", "SIM")),
        ("preflight", ("preflight", "--help")),
    ],
)
def test_an_install_with_one_extra_runs_the_commands_it_is_for(
    extra: str, argv: tuple[str, ...], tmp_path: Path
) -> None:
    """`pip install 'oomcast[train]'` (what docs/recalibrate.md says to install) and then
    `oomcast recalibrate` said the command needs pydantic, from another extra. Every module
    an extra does not bring is blocked here, as on such an install."""
    brings = _extra_distributions(extra)
    dists = packages_distributions()
    blocked = {
        m
        for m in EXTRAS
        if not any(d.lower().replace("_", "-") in brings for d in dists.get(m, []))
    }
    assert "pydantic" not in blocked and "fastapi" in blocked  # the check has teeth
    out = run_without(blocked, *(str(tmp_path / a) if a == "SIM" else a for a in argv))
    assert out.returncode == 0, out.stderr


def test_the_collector_image_runs_the_agent_command() -> None:
    """The collector image installs only the core and the collector extra: every other
    extra's modules blocked, `oomcast collect --help` must still work."""
    blocked = {m for m, e in EXTRAS.items() if e != "collector"}
    out = run_without(blocked, "collect", "--help")
    assert out.returncode == 0, out.stderr
    assert "Sample memory domains" in out.stdout


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_a_bad_setting_names_its_variable_and_value() -> None:
    """pydantic's own message ("Input should be a valid integer") said neither which
    variable nor what it held."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
    env["OOMCAST_ALERT_HORIZON_S"] = "60s"
    out = subprocess.run(
        oomcast_cmd("serve", "--port", "1"), env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2
    assert "OOMCAST_ALERT_HORIZON_S='60s': Input should be a valid integer" in out.stderr
    env["OOMCAST_ALERT_HORIZON_S"] = "60"
    env["OOMCAST_WEBHOOK_SECRET"] = ""  # secrets and URLs are never echoed
    env["OOMCAST_REDIS_URL"] = "http://user:hunter2@redis:6379"
    out = subprocess.run(
        oomcast_cmd("serve", "--port", "1"), env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 2 and "hunter2" not in out.stderr


def test_a_base_install_without_an_extra_says_which_to_install() -> None:
    """The base package is the in-job hook's (numpy, redis, orjson): the command itself
    needs pydantic, from an extra. Without it, `oomcast` said ModuleNotFoundError in a
    traceback; it says what to install, and exits 2."""
    code = (
        "import sys; sys.modules['pydantic'] = None;"
        " from oomcast.cli.entry import main; sys.exit(main())"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, "--help"], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 2, done.stderr
    assert "needs pydantic" in done.stderr and "pip install 'oomcast[collector]'" in done.stderr
    assert "'oomcast[preflight]' (checking a job before launch)" in done.stderr
    assert "'oomcast[train]' (training, scoring and refitting models)" in done.stderr
    assert "Traceback" not in done.stderr
    ok = subprocess.run(
        [sys.executable, "-m", "oomcast.cli", "--version"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert ok.returncode == 0 and ok.stdout.strip(), ok.stderr
