"""The examples in README.md and docs/ are checked, so one that breaks fails CI: every
``oomcast ...`` command line parses with the real parser (the command and its flags exist,
with valid values), every rules file validates with the service's own checker, and every
``OOMCAST_*`` variable named is one that something reads. The docs' rule example once had
params for an action the rule did not take, and the service refused it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex
from pathlib import Path

import pytest

from oomcast.service.cli import build_parser
from oomcast.service.rulefile import check_rules_file
from oomcast.service.settings import CommandEnv, Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```([a-z]*)\n(.*?)```", re.S)


def blocks(kind: str | None = None) -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for lang, body in BLOCK.findall(path.read_text()):
            if kind is None or lang == kind:
                out.append((path.name, body))
    return out


def command_lines() -> list[tuple[str, str]]:
    found = []
    for name, body in blocks():
        for line in body.replace("\\\n", " ").split("\n"):
            line = line.split(" #")[0].strip()
            if not line.startswith("oomcast ") or ": error:" in line:  # output, not a command
                continue
            for sep in (" | ", " > ", " && ", " 2>"):
                line = line.split(sep)[0]
            found.append((name, line))
    return found


COMMANDS = command_lines()


def test_the_docs_have_commands_to_check() -> None:
    assert len(COMMANDS) >= 30
    assert {"README.md", "bench.md", "collectors.md"} <= {name for name, _ in COMMANDS}


@pytest.mark.parametrize(("doc", "line"), COMMANDS, ids=[f"{d}:{c}" for d, c in COMMANDS])
def test_every_documented_command_parses(doc: str, line: str) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(shlex.split(line)[1:])
    except SystemExit as exc:
        assert exc.code == 0, f"{doc}: `{line}`: {err.getvalue().strip()}"


def test_every_documented_rules_file_validates(tmp_path: Path) -> None:
    rule_files = [(n, b) for n, b in blocks("yaml") if re.match(r"\s*rules:", b)]
    assert rule_files, "no rules example found in the docs"
    for i, (name, body) in enumerate(rule_files):
        path = tmp_path / f"{i}.yaml"
        path.write_text(body)
        assert check_rules_file(path).rules, f"{name}: an empty rules example"


def known_variables() -> set[str]:
    names = {f"OOMCAST_{f.upper()}" for f in [*Settings.model_fields, *CommandEnv.model_fields]}
    # the hook's (collectors/hook_settings.py), the agent's downward-API ones, preflight's,
    # and the test suite's own (tests/)
    for folder in ("collectors", "preflight", "tests"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "test_doc_examples.py":  # this file names none on purpose
                names |= set(re.findall(r"OOMCAST_[A-Z0-9_]+", path.read_text()))
    return names


def test_every_documented_variable_is_read_by_something() -> None:
    known = known_variables()
    for path in DOCS:
        for name in set(re.findall(r"OOMCAST_[A-Z0-9_]*[A-Z0-9]", path.read_text())):
            if name.endswith("_") or name == "OOMCAST_ALERT":  # a family: OOMCAST_ALERT_*
                continue
            assert name in known, f"{path.name} names {name}, which nothing reads"


def test_every_whole_json_example_parses_and_records_validate() -> None:
    """A JSON example is either whole (it must parse, and a sample or an event in it must
    pass the trace parser) or visibly cut (it has a `...`, or is a fragment of an object,
    starting with a key): nothing in between, which is where a broken example hides."""
    from oomcast.model.schema import parse_record

    checked = 0
    for name, body in blocks("json"):
        text = body.strip()
        if "..." in text or text.startswith('"'):
            continue  # elided or a fragment: said so by its own shape
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as exc:
            raise AssertionError(f"{name}: a JSON example does not parse ({exc})") from None
        if isinstance(doc, dict) and {"ts", "node", "device"} <= set(doc):
            parse_record(doc)  # a sample or an event of the trace format
        checked += 1
    assert checked >= 2
