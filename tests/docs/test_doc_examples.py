"""The examples in README.md and docs/ are checked, so one that breaks fails CI.

- Every ``oomcast ...`` command line of a code block parses with the real parser, and is
  *run*: as a real process, through bash, exactly as written (``$(hostname)`` and all), in a
  temporary folder holding the files the doc assumes, against the local Redis under a key
  prefix of its own. It must exit as the doc says. A command that runs until stopped (the
  service, an agent, the demo) is started, probed until it works, and stopped. A command
  that cannot run here is in ``NOT_RUN`` with the reason; a documented command in neither
  table fails ``test_every_documented_command_is_run_or_listed``, so a new one cannot slip
  by unrun.
- Every ``curl`` example is sent to that running service.
- Every command named in the text (`` `oomcast NAME ...` ``) exists.
- Every rules file validates with the service's own checker, every ``OOMCAST_*`` variable
  named is one that something reads, and every whole JSON example parses.

The docs' rule example once had params for an action the rule did not take, and the
service refused it; the map of the code named an ``oomcast rules check`` that never existed.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import pickle
import re
import shlex
import shutil
import signal
import subprocess
import sys
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import httpx
import pytest
import redis
from support import free_port, wait_until

from oomcast.cli.env import CommandEnv
from oomcast.cli.main import build_parser
from oomcast.service.pipeline.rulefile import check_rules_file
from oomcast.service.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```([a-z]*)\n(.*?)```", re.S)
# a command: variables set before it, then `oomcast` (or a path to it: `.venv/bin/oomcast`)
COMMAND = re.compile(r"^((?:[A-Z_][A-Z0-9_]*=\S+\s+)*)(?:\S*/)?oomcast(?=\s|$)")
ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=")


def blocks(kind: str | None = None) -> list[tuple[str, str]]:
    out = []
    for path in DOCS:
        for lang, body in BLOCK.findall(path.read_text()):
            if kind is None or lang == kind:
                out.append((path.name, body))
    return out


def command_lines() -> list[tuple[str, str]]:
    """Every ``oomcast`` command of a code block, as (doc, line): its comment and whatever it
    pipes or redirects to are cut, a ``$ `` prompt dropped, each command of an ``&&`` chain
    taken on its own, ``.venv/bin/oomcast`` read as ``oomcast``; variables set in front of
    it (``OOMCAST_MODEL_PATH=... oomcast serve``) stay with it."""
    found = []
    for name, body in blocks():
        for raw in body.replace("\\\n", " ").split("\n"):
            line = raw.split(" #")[0].strip().removeprefix("$ ")
            if ": error:" in line:  # output, not a command
                continue
            for part in re.split(r"\s(?:&&|\|\||;)\s", line):
                for sep in (" | ", " > ", " 2>"):
                    part = part.split(sep)[0]
                part = re.sub(r" {2,}", " ", part.strip())
                if m := COMMAND.match(part):
                    found.append((name, f"{m.group(1)}oomcast{part[m.end() :]}"))
    return found


COMMANDS = command_lines()
DOCUMENTED = list(dict.fromkeys(line for _, line in COMMANDS))  # once each, in doc order


def argv_of(line: str) -> list[str]:
    """The command's arguments: the words after ``oomcast``, variables in front left out."""
    words = shlex.split(line)
    while words and ASSIGNMENT.match(words[0]):
        words.pop(0)
    return words[1:]


def test_the_docs_have_commands_to_check() -> None:
    assert len(COMMANDS) >= 30
    assert {"README.md", "bench.md", "collectors.md"} <= {name for name, _ in COMMANDS}


@pytest.mark.parametrize(("doc", "line"), COMMANDS, ids=[f"{d}:{c}" for d, c in COMMANDS])
def test_every_documented_command_parses(doc: str, line: str) -> None:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build_parser().parse_args(argv_of(line))
    except SystemExit as exc:
        assert exc.code == 0, f"{doc}: `{line}`: {err.getvalue().strip()}"


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def test_every_command_named_in_the_text_exists() -> None:
    """`` `oomcast NAME ...` `` in the prose (outside code blocks) names a real command, and
    `` `oomcast bench MODE` `` a real mode: the inline spans are fragments (``N``, ``DIR``,
    ``...``), so only the names are checked."""
    commands = _subcommands(build_parser())
    modes = next(a.choices for a in commands["bench"]._actions if a.dest == "what")
    assert modes
    named = 0
    for path in DOCS:
        prose = BLOCK.sub("", path.read_text())
        for span in re.findall(r"`oomcast ([^`\n]+)`", prose):
            words = span.split()
            if words[0].startswith("-"):
                continue
            named += 1
            assert words[0] in commands, f"{path.name}: `oomcast {span}`: no such command"
            if words[0] == "bench" and len(words) > 1 and words[1].isidentifier():
                assert words[1] in modes, f"{path.name}: `oomcast {span}`: no such bench"
    assert named >= 30


# --- running them ---------------------------------------------------------------------------

DEADLINE_S = 90  # per command; the slowest here (bench cluster, simulate) take 8-25 s


@dataclass
class Session:
    """The folder the documented commands run in, one for all of them (a later command reads
    what an earlier one wrote, as in the docs), their environment and what each returned."""

    cwd: Path
    env: dict[str, str]
    redis_url: str
    prefix: str
    port: int = 0  # the free port the command being run was given
    results: dict[str, subprocess.CompletedProcess[str]] = field(default_factory=dict)


@dataclass(frozen=True)
class Started:
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path


@dataclass(frozen=True)
class Run:
    """How a documented command runs here.

    ``extra`` is appended to the line (argparse takes the last of a repeated flag), only to
    shrink a run while the doc's flags keep their meaning; every use says why. ``after``:
    documented lines whose output this one reads (run first, once). ``inputs``: files the
    doc assumes are there, made by ``INPUTS``. ``env``: variables the doc says to set.
    A command that runs until stopped has ``until``: it is started, ``until`` is polled until
    true, ``then`` runs against it, it is sent ``stop`` and must end with one of ``stopped``.
    ``needs`` says why this machine cannot run it (then it is skipped), or None."""

    extra: str = ""
    rc: int = 0
    after: tuple[str, ...] = ()
    inputs: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    until: Callable[[Session, Started], bool] | None = None
    then: Callable[[Session], None] | None = None
    stop: signal.Signals = signal.SIGTERM
    stopped: tuple[int, ...] = (0,)
    needs: Callable[[], str | None] | None = None


def _get(s: Session, path: str) -> httpx.Response | None:
    try:
        return httpx.get(f"http://127.0.0.1:{s.port}{path}", timeout=5)
    except httpx.HTTPError:
        return None


def ready(s: Session, _: Started) -> bool:
    r = _get(s, "/readyz")
    return r is not None and r.status_code == 200


def ready_with_model(version: str) -> Callable[[Session, Started], bool]:
    def probe(s: Session, started: Started) -> bool:
        r = _get(s, "/readyz")
        return r is not None and r.status_code == 200 and r.json()["model_version"] == version

    return probe


def streamed(s: Session, _: Started) -> bool:
    """The agent's samples are in Redis: two ticks of them, so a dump has a trace to write."""
    client = redis.Redis.from_url(s.redis_url)
    try:
        total = 0
        for key in client.scan_iter(match=f"{s.prefix}:samples:*"):
            total += cast(int, client.xlen(key))
        return total >= 2
    finally:
        client.close()


def logged(text: str, stream: str = "err") -> Callable[[Session, Started], bool]:
    def probe(_: Session, started: Started) -> bool:
        path = started.err if stream == "err" else started.out
        return text in path.read_text(errors="replace")

    return probe


def curl_blocks() -> list[tuple[str, str]]:
    return [(n, b) for n, b in blocks("sh") if b.lstrip().startswith("curl ")]


def send_the_curl_examples(s: Session) -> None:
    """Every documented ``curl`` call, sent to the service on its port; ``--fail-with-body``
    added so that an answer other than 2xx fails the call."""
    for doc, body in curl_blocks():
        cmd = body.replace("localhost:8000", f"localhost:{s.port}")
        cmd = re.sub(r"^(\s*)curl ", r"\1curl --fail-with-body ", cmd)
        out = subprocess.run(
            ["bash", "-c", cmd], capture_output=True, text=True, timeout=30, env=s.env
        )
        assert out.returncode == 0, f"{doc}: {body.strip()}\n{out.stdout}{out.stderr}"
        assert isinstance(json.loads(out.stdout), dict), f"{doc}: {out.stdout}"


def send_the_curl_examples_and_top(s: Session) -> None:
    """The curl calls, then the README's ``oomcast top`` once against the same service."""
    send_the_curl_examples(s)
    out = subprocess.run(
        ["oomcast", "top", "--url", f"http://127.0.0.1:{s.port}", "--once"],
        capture_output=True, text=True, timeout=60, env=s.env,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert re.match(r"\d\d:\d\d:\d\d \d+ live, \d+ firing", out.stdout), out.stdout


def cgroup_v1_memory() -> str | None:
    if (Path("/sys/fs/cgroup/memory") / "memory.usage_in_bytes").exists():
        return None
    return "no cgroup v1 memory hierarchy at /sys/fs/cgroup/memory on this machine"


# --- the inputs the docs assume ------------------------------------------------------------

JOBS_PY = """\
import torch
from torch import nn

from oomcast.preflight import PreflightJob


def job() -> PreflightJob:
    return PreflightJob(
        name="tiny-mlp",
        model=lambda: nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)),
        batch=lambda size, step: (torch.randn(size, 64), torch.randint(0, 8, (size,))),
        loss=lambda model, b: nn.functional.cross_entropy(model(b[0]), b[1]),
        batch_size=16,
    )
"""

# A training script as users write it: no oomcast in it (preflight runs it as written)
TRAIN_PY = """\
import argparse

import torch
from torch import nn

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=1e-3)
parser.add_argument("--batch-size", type=int, default=16)
args = parser.parse_args()
device = "cuda" if torch.cuda.is_available() else "cpu"
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).to(device)
opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
for step in range(1000):
    x = torch.randn(args.batch_size, 64, device=device)
    y = torch.randint(0, 8, (args.batch_size,), device=device)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    print(f"step {step} loss {loss.item():.3f}")
    if step % 100 == 99:
        model.eval()
        with torch.no_grad():
            model(x)
        model.train()
        torch.save(model.state_dict(), "model.pt")
"""

# The README's hook example, cut to a job that runs out of memory: the hook writes the
# diagnosis bundle `oomcast explain bundle.json.gz` reads.
BUNDLE_PY = """\
import sys, time
from pathlib import Path

from oomcast.collectors.hook import MemoryHook

out = Path(sys.argv[1])
hook = MemoryHook(job="doc-example", bundle_dir=str(out))
try:
    with hook.guard():
        for _ in range(3):
            hook.step()
        raise MemoryError("the example job ran out of memory")
except MemoryError:
    pass
deadline = time.monotonic() + 30
while not list(out.glob("*.json.gz")) and time.monotonic() < deadline:
    time.sleep(0.05)
hook.close()
"""


def make_mypkg(path: Path) -> None:
    path.mkdir()
    (path / "__init__.py").write_text("")
    (path / "jobs.py").write_text(JOBS_PY)
    (path / "train.py").write_text(TRAIN_PY)


def make_train_py(path: Path) -> None:
    path.write_text(TRAIN_PY)


def make_bundle(path: Path, s: Session) -> None:
    folder = path.parent / "bundles"
    out = subprocess.run(
        [sys.executable, "-c", BUNDLE_PY, str(folder)],
        env=s.env,
        capture_output=True,
        text=True,
        timeout=DEADLINE_S,
    )
    written = sorted(folder.glob("*.json.gz"))
    assert out.returncode == 0 and written, f"the hook wrote no bundle: {out.stderr[-2000:]}"
    shutil.copy(written[0], path)


def make_snapshot(path: Path) -> None:
    """A memory snapshot as ``torch.cuda.memory._dump_snapshot()`` writes it, from the
    allocator simulator: 8 MiB blocks, every other one freed."""
    from oomcast.training.allocator import CachingAllocatorSim

    sim = CachingAllocatorSim(400 << 20)
    handles = [sim.malloc(8 << 20) for _ in range(40)]
    for h in handles[::2]:
        sim.free(h)
    path.write_bytes(pickle.dumps(sim.memory_snapshot()))


def make_corpus_sample(path: Path) -> None:
    """The recorded corpus cut to its test programs' first OOM and first clean run each
    (6 of its 303 runs), with a manifest of those: for ``oomcast card``'s ``--corpus``."""
    corpus = ROOT / "training" / "traces" / "corpus"
    manifest = json.loads((corpus / "manifest.json").read_text())
    seen, runs = set(), []
    for run in manifest["runs"]:
        if run["split"] == "test" and (run["program"], run["oom"]) not in seen:
            seen.add((run["program"], run["oom"]))
            runs.append(run)
    path.mkdir()
    for run in runs:
        shutil.copy(corpus / run["file"], path / run["file"])
    (path / "manifest.json").write_text(json.dumps({**manifest, "runs": runs}))


INPUTS: dict[str, Callable[[Path, Session], None]] = {
    "corpus-sample": lambda p, s: make_corpus_sample(p),
    "mypkg": lambda p, s: make_mypkg(p),
    "train.py": lambda p, s: make_train_py(p),
    "bundle.json.gz": make_bundle,
    "snapshot.pickle": lambda p, s: make_snapshot(p),
}

# --- the tables: every documented command is in exactly one ---------------------------------

SIM = "oomcast simulate --out data/sim --n 2000"
TRAIN = "oomcast train --data data/sim --out runs/mine"
EXPORT = (
    "oomcast export --checkpoint runs/mine/checkpoint.pt --out runs/mine/model.onnx --version mine"
)
COLLECT_SIM = "oomcast collect --source sim --gpus 4"
DUMP = 'oomcast dump --node "$(hostname)" --out run.jsonl.gz'
SERVED = (0, -signal.SIGTERM)  # uvicorn ends by the signal again after a clean shutdown
SECONDS_1 = "--seconds 1"  # a bench's measuring time, 1 s here: the figures are not the test
ENTRY = (("PYTHONPATH", "."),)  # docs/preflight.md: mypkg must be importable

RUNS: dict[str, Run] = {
    "oomcast check": Run(),
    "oomcast serve --host 0.0.0.0 --port 8000": Run(
        extra="--host 127.0.0.1 --port {port}",  # loopback, and a free port
        until=ready,
        then=send_the_curl_examples_and_top,
        stopped=SERVED,
    ),
    # the front and its workers (docs/scaling.md): the README's curl goes through the front
    "oomcast serve --host 0.0.0.0 --port 8000 --workers auto": Run(
        extra="--host 127.0.0.1 --port {port}",
        until=ready,
        then=send_the_curl_examples,
        stopped=SERVED,
    ),
    COLLECT_SIM: Run(until=streamed),
    "oomcast collect --source replay --trace run.jsonl.gz --speed 10": Run(after=(DUMP,)),
    DUMP: Run(after=(COLLECT_SIM,)),
    # 10 traces, not 2000 (about 3 minutes): with seed 0 each split gets at least one
    SIM: Run(extra="--n 10"),
    "oomcast evaluate --traces data/sim/test --min-lead 30 --json": Run(after=(SIM,)),
    "oomcast evaluate --traces training/traces/host": Run(),
    "oomcast preflight --gpu H100-80GB -- python train.py": Run(inputs=("train.py",)),
    "oomcast bench inference": Run(extra="--seconds 0.1"),  # 0.1 s per size, not 2
    "oomcast bench hook": Run(),
    "oomcast bench agent": Run(),
    # one scenario, not all 8 (4-5 minutes): the JSON report is what this line shows
    "oomcast bench faults --json": Run(extra="--only oversized_body"),
    "oomcast bench ingest --domains 5000 --seconds 6": Run(extra=SECONDS_1),
    "oomcast bench cluster": Run(extra=SECONDS_1),
    "oomcast bench api --predict": Run(extra=SECONDS_1),
    "oomcast explain bundle.json.gz": Run(inputs=("bundle.json.gz",)),
    "oomcast --version": Run(),
    # one epoch, 8 plain shapes: a checkpoint to export, not a model to ship
    TRAIN: Run(extra="--epochs 1 --shapes 8", after=(SIM,)),
    EXPORT: Run(after=(TRAIN,)),
    "oomcast evaluate --traces data/sim/test --model runs/mine/model.onnx --min-lead 30": Run(
        after=(SIM, EXPORT)
    ),
    # the jobs corpus's test programs at 1 Hz, not 10 (seconds, not minutes), flags as written
    "oomcast evaluate --traces training/traces/jobs --split test --model runs/mine/model.onnx"
    " --min-lead 30 --per-trace runs/mine/per-trace.jsonl --by-cause": Run(
        extra="--resample-s 1", after=(EXPORT,)
    ),
    # the corpus's test programs by 6 of their runs, not all 95 (5 s, not 15-25)
    "oomcast card --model runs/mine/model.onnx --sim-test data/sim/test"
    " --out runs/mine/card.json": Run(
        extra="--corpus corpus-sample", after=(SIM, EXPORT), inputs=("corpus-sample",)
    ),
    "OOMCAST_MODEL_PATH=runs/mine/model.onnx oomcast serve": Run(
        extra="--port {port}",  # a free port, not 8000
        after=(EXPORT,),
        until=ready_with_model("mine"),
        stopped=SERVED,
    ),
    "oomcast demo": Run(
        until=logged("Ctrl-C stops the demo", "out"),
        stop=signal.SIGINT,  # the doc's Ctrl-C
    ),
    "oomcast bench faults --only forged_command,oversized_body": Run(),
    "oomcast bench ingest --domains 5000 --json": Run(extra=SECONDS_1),
    "oomcast bench ingest --domains 5000 --workers 1 --json": Run(extra=SECONDS_1),
    "oomcast bench ingest --domains 2000 --rate 5000 --seconds 30": Run(extra=SECONDS_1),
    # the soak mode for 1 s, not 30 minutes: it starts, writes at the rate, reports RSS
    "oomcast bench ingest --domains 2000 --rate 5000 --seconds 1800 --soak --plot soak-rss.png"
    " --json": Run(extra=SECONDS_1),
    "oomcast bench ingest --domains 5000 --seconds 6 --replicas 2 --json": Run(extra=SECONDS_1),
    "oomcast bench cluster --domains 2000 --seconds 10 --json": Run(extra=SECONDS_1),
    "oomcast bench api --predict --concurrency 1,16 --window 600 --seconds 10 --json": Run(
        extra=SECONDS_1
    ),
    "oomcast collect --source cgroup --cgroup-root /sys/fs/cgroup/memory"
    " --cgroup-include '/kubepods*'": Run(
        until=logged("collecting from cgroup"), needs=cgroup_v1_memory
    ),
    "oomcast explain snapshot.pickle --request-bytes 17179869184 --capacity-bytes 85520809984": Run(
        inputs=("snapshot.pickle",)
    ),
    "oomcast explain snapshot.pickle --json": Run(inputs=("snapshot.pickle",)),
    "oomcast preflight --gpu H100-80GB --entry mypkg.jobs:job": Run(inputs=("mypkg",), env=ENTRY),
    "oomcast preflight --gpu A100-40GB -- python train.py --batch-size 64 --lr 3e-4": Run(
        inputs=("train.py",)
    ),
    "oomcast preflight --gpu H100-80GB --json -- python -m mypkg.train": Run(
        inputs=("mypkg",), env=ENTRY
    ),
    "oomcast preflight --gpu L4 --json --plot timeline.png --entry mypkg.jobs:job": Run(
        inputs=("mypkg",), env=ENTRY
    ),
}

NVML = "reads NVML: needs an NVIDIA driver and GPU (without them it exits 2, saying so)"
REPORT = (
    "reads a running service's GET /v1/scorecard (at OOMCAST_URL): tests/cli/test_report.py"
    " runs it against a real `oomcast serve` on outcomes it put on record"
)
KEPT = (
    "reads the traces a running service kept in Redis for its misses: tests/service/"
    "test_kept.py runs `oomcast dump --outcomes` on a missed OOM the real app kept, and"
    " `oomcast evaluate --traces` and `oomcast train --extra-train` on what it wrote"
)
NOT_RUN: dict[str, str] = {
    "OOMCAST_SHADOW_MODEL_PATH=/models/oomcast-lstm-next.onnx oomcast serve": "a model path"
    " of the reader's; tests/service/test_scorecard.py runs the service with a shadow (a"
    " baseline) and tests/service/pipeline/test_outcomes.py steps the shipped ONNX model as"
    " one",
    "oomcast dump --outcomes --out fleet-misses": KEPT,
    "oomcast evaluate --traces fleet-misses --json": KEPT,
    "oomcast train --extra-train fleet-misses --out runs/with-fleet": "trains for up to 30"
    " minutes on every source; tests/service/test_kept.py runs it for one epoch on a kept"
    " trace (`--extra-train`) and a few plain shapes",
    "oomcast top --url http://127.0.0.1:8000": "redraws until Ctrl-C, against a service: the"
    " `oomcast serve --host 0.0.0.0 --port 8000` line's run sends it, `--once`, to that"
    " service (and tests/cli/test_top.py checks what it prints)",
    "oomcast report --since 7d": REPORT,
    "oomcast report --since 7d --by kind": REPORT,
    "oomcast collect --source nvml,cgroup": NVML,
    "oomcast collect --source nvml --priority 'pod:*=0' --priority 'batch-*=-10'": NVML,
    "oomcast bench faults": "all 8 scenarios take 4-5 minutes; the same bench runs here as"
    " `--json` with one scenario, and as the `--only forged_command,oversized_body` line",
    "oomcast bench faults --receiver-down-s 20": "keeps the receiver down 20 s and then waits"
    " out the delivery back-off (up to 30 s): about a minute, for one of the 8 scenarios",
    "oomcast preflight --gpu H200 --steps 2 --entry preflight_jobs:big_lm": "an example"
    " report of an 8.3-billion-parameter model, 12-40 s of CPU; tests/preflight/test_api.py"
    " runs its --json form",
}


def _kill_group(proc: subprocess.Popen[bytes] | subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(10)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    return True


def _tail(text: str, n: int = 3000) -> str:
    return text[-n:].strip()


def _once(s: Session, cmd: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    proc = subprocess.Popen(
        ["bash", "-c", cmd],
        cwd=s.cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group: whatever it starts can be found
    )
    try:
        out, err = proc.communicate(timeout=DEADLINE_S)
    except subprocess.TimeoutExpired:
        _kill_group(proc)
        out, err = proc.communicate()
        raise AssertionError(f"`{cmd}` ran past {DEADLINE_S} s:\n{_tail(err)}") from None
    left = not wait_until(lambda: not _group_alive(proc.pid), 10)
    _kill_group(proc)
    assert not left, f"`{cmd}` left processes running after it exited"
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _until_stopped(
    s: Session, cmd: str, env: dict[str, str], spec: Run, slug: str
) -> subprocess.CompletedProcess[str]:
    assert spec.until is not None
    logs = s.cwd / ".logs"
    logs.mkdir(exist_ok=True)
    out_path, err_path = logs / f"{slug}.out", logs / f"{slug}.err"
    with out_path.open("wb") as out, err_path.open("wb") as err:
        proc = subprocess.Popen(
            ["bash", "-c", cmd], cwd=s.cwd, env=env, stdout=out, stderr=err, start_new_session=True
        )
    started, until = Started(proc, out_path, err_path), spec.until

    def err_text() -> str:
        return _tail(err_path.read_text(errors="replace"))

    try:
        up = wait_until(lambda: proc.poll() is not None or until(s, started), DEADLINE_S)
        assert proc.poll() is None, f"`{cmd}` exited {proc.returncode} unasked:\n{err_text()}"
        assert up, f"`{cmd}` did not come up within {DEADLINE_S} s:\n{err_text()}"
        if spec.then is not None:
            spec.then(s)
        proc.send_signal(spec.stop)  # bash exec'd the command: this pid is oomcast's
        try:
            rc = proc.wait(30)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"`{cmd}` did not stop within 30 s of {spec.stop.name}") from None
    finally:
        _kill_group(proc)
    assert rc in spec.stopped, f"`{cmd}` ended {rc} on {spec.stop.name}:\n{err_text()}"
    return subprocess.CompletedProcess(
        cmd, 0, out_path.read_text(errors="replace"), err_path.read_text(errors="replace")
    )


def run_documented(s: Session, line: str) -> subprocess.CompletedProcess[str]:
    """Run ``line`` (after what it reads), once per session; fail unless it ended as its
    doc says."""
    spec = RUNS[line]
    if spec.needs is not None and (why := spec.needs()):
        pytest.skip(why)
    if line not in s.results:
        for earlier in spec.after:
            run_documented(s, earlier)
        for name in spec.inputs:
            if not (s.cwd / name).exists():
                INPUTS[name](s.cwd / name, s)
        s.port = free_port()
        m = COMMAND.match(line)
        assert m is not None
        # bash execs the command, so the process started is oomcast itself (it gets the signal)
        cmd = f"{m.group(1)}exec {line[m.end(1) :]} {spec.extra.format(port=s.port)}".rstrip()
        env = {**s.env, **dict(spec.env)}
        slug = re.sub(r"[^a-z0-9]+", "-", line.lower())[:60]
        if spec.until is not None:
            s.results[line] = _until_stopped(s, cmd, env, spec, slug)
        else:
            s.results[line] = _once(s, cmd, env)
    got = s.results[line]
    assert got.returncode == spec.rc, (
        f"`{got.args}` exited {got.returncode}, not {spec.rc}:\n{_tail(got.stderr)}"
    )
    return got


@pytest.fixture(scope="module")
def session(tmp_path_factory: pytest.TempPathFactory, redis_url: str) -> Iterator[Session]:
    cwd = tmp_path_factory.mktemp("docs-run")
    (cwd / "training").symlink_to(ROOT / "training")  # the docs run from the repository root
    prefix = f"oomcast-doctest-{uuid.uuid4().hex[:10]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
    env.update(
        PATH=f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}",  # this oomcast
        PYTHONUNBUFFERED="1",
        OOMCAST_REDIS_URL=redis_url,
        OOMCAST_KEY_PREFIX=prefix,
        OOMCAST_BUNDLE_DIR="off",  # bundles only where a command asks (bundle.json.gz)
        OOMCAST_AGENT_METRICS_PORT="0",  # agents serve no /metrics: port 9101 may be anyone's
    )
    yield Session(cwd, env, redis_url, prefix)
    client = redis.Redis.from_url(redis_url)
    keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
    if keys:
        client.delete(*keys)
    client.close()


def test_every_documented_command_is_run_or_listed() -> None:
    documented = set(DOCUMENTED)
    unaccounted = [line for line in DOCUMENTED if line not in RUNS and line not in NOT_RUN]
    assert not unaccounted, f"run these (RUNS) or say why not (NOT_RUN): {unaccounted}"
    stale = sorted((RUNS.keys() | NOT_RUN.keys()) - documented)
    assert not stale, f"no longer in the docs: {stale}"
    assert not RUNS.keys() & NOT_RUN.keys()
    for spec in RUNS.values():
        assert set(spec.after) <= RUNS.keys() and set(spec.inputs) <= INPUTS.keys()
    assert len(RUNS) >= 3 * len(NOT_RUN)


def test_every_curl_example_is_sent_to_the_service() -> None:
    """The ``curl`` examples are sent to ``oomcast serve`` when its README line runs."""
    found = curl_blocks()
    assert found, "no curl example found"
    for doc, body in found:
        assert "localhost:8000" in body, f"{doc}: a curl example not sent anywhere: {body}"
    assert RUNS["oomcast serve --host 0.0.0.0 --port 8000"].then is send_the_curl_examples_and_top


RUN_LINES = [line for line in DOCUMENTED if line in RUNS]


@pytest.mark.slow
@pytest.mark.timeout(400)  # a line run alone first runs what it reads (card: 4 commands)
@pytest.mark.parametrize("line", RUN_LINES, ids=RUN_LINES)
def test_every_documented_command_runs(session: Session, line: str) -> None:
    got = run_documented(session, line)
    if "--json" in argv_of(line) and RUNS[line].until is None:
        try:
            doc = json.loads(got.stdout)
        except json.JSONDecodeError:
            raise AssertionError(f"`{line}` printed no JSON object:\n{_tail(got.stdout)}") from None
        assert isinstance(doc, dict), f"`{line}` printed {type(doc).__name__}, not an object"


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
            if path.name != "test_doc_examples.py":  # this file sets them for the docs' commands
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
