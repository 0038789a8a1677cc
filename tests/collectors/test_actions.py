"""collectors/actions.py with real processes: shedding load, asking jobs to checkpoint."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import wait_until

from oomcast.collectors.actions import (
    ActionResult,
    Candidate,
    CheckpointAction,
    ShedAction,
    catches_signal,
    in_scope,
    live_start_time,
    proc_memory_cgroup,
    proc_uids,
    processes_in_cgroup,
    rss_bytes,
    send_signal,
)
from oomcast.model.control import Command
from oomcast.model.jobcontrol import jobctl_key
from oomcast.model.wire import Keys

GIB = 1 << 30

SLEEPER = r"""
import os, pathlib, signal, sys, time
ready, mode = sys.argv[1], sys.argv[2]
if mode == "ignore_term":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if mode == "ignore_usr1":
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
pathlib.Path(ready).write_text(str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
"""

# Catches SIGUSR1: writes a file and, when asked to, reports checkpoint_done itself.
SIGNAL_JOB = r"""
import json, os, pathlib, signal, sys, time
import redis
ready, flag, url, events, job, ack = sys.argv[1:7]
def on_usr1(signum, frame):
    pathlib.Path(flag).write_text("saved")
    if ack == "1":
        event = {"ts": time.time(), "node": "node-a", "device": f"proc:{os.getpid()}",
                 "event": "checkpoint_done", "job": job, "path": flag, "request_id": None}
        redis.Redis.from_url(url).xadd(events, {"v": "1", "event": json.dumps(event)})
signal.signal(signal.SIGUSR1, on_usr1)
pathlib.Path(ready).write_text(str(os.getpid()))
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    time.sleep(0.05)
"""

# A training loop with the real hook (host mode, no signal handler of its own).
HOOK_JOB = r"""
import pathlib, sys, time
from oomcast.collectors.hook import MemoryHook
ready, url, prefix, job, out, ok = sys.argv[1:7]
hook = MemoryHook(job, redis_url=url, key_prefix=prefix, node="node-a", mode="host",
                  publish_interval_s=0.05, control_poll_s=0.1, checkpoint_signal=None)
pathlib.Path(ready).write_text("ok")
deadline = time.monotonic() + 120
while time.monotonic() < deadline:
    hook.step()
    if hook.checkpoint_requested:
        pathlib.Path(out).write_text("checkpoint")
        hook.checkpoint_done(out, ok=(ok == "1"))
        hook.flush(5)
    time.sleep(0.02)
hook.close()
"""


def child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}


class Children:
    """Real child processes, each started and waited for until it says it is ready."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self, code: str, *args: str, ready: bool = True, **kw: Any
    ) -> subprocess.Popen[bytes]:
        flag = self.tmp / f"ready-{uuid.uuid4().hex[:8]}"
        proc = subprocess.Popen(
            [sys.executable, "-c", code, str(flag), *args], env=child_env(), **kw
        )
        self.procs.append(proc)
        if ready:
            assert wait_until(lambda: flag.exists() or proc.poll() is not None, 30)
            assert proc.poll() is None, f"child exited early ({proc.returncode})"
        return proc

    def sleeper(self, mode: str = "plain") -> subprocess.Popen[bytes]:
        return self.start(SLEEPER, mode)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait(10)


@pytest.fixture
def children(tmp_path: Path) -> Iterator[Children]:
    c = Children(tmp_path)
    yield c
    c.close()


def alive(proc: subprocess.Popen[bytes]) -> bool:
    """Alive and not a zombie (a child that exited is a zombie until reaped)."""
    return proc.poll() is None and live_start_time(proc.pid) is not None


def cand(
    proc: subprocess.Popen[bytes] | int, used: int | None, job: str, priority: int
) -> Candidate:
    pid = proc if isinstance(proc, int) else proc.pid
    return Candidate(pid, used, job, priority, live_start_time(pid))


def command(
    action: str = "shed",
    *,
    job: str | None = "prod",
    params: dict[str, Any] | None = None,
    dry_run: bool = False,
    cid: str | None = None,
) -> Command:
    now = time.time()
    return Command(
        id=cid or uuid.uuid4().hex,
        node="node-a",
        action=action,
        device="gpu0",
        job=job,
        params=params or {},
        dry_run=dry_run,
        issued_at=now,
        expires_at=now + 30,
        nonce=uuid.uuid4().hex,
        reason="test",
        forecast={},
    )


def ended(result: ActionResult) -> dict[int, str]:
    return {v["pid"]: v["ended"] for v in result.data["victims"]}


def skipped(result: ActionResult) -> dict[int, str]:
    return {s["pid"]: s["why"] for s in result.data["skipped"]}


# --- /proc helpers -------------------------------------------------------------------------


def test_catches_signal_reads_sigcgt(children: Children) -> None:
    plain = children.sleeper()
    ignoring = children.sleeper("ignore_usr1")
    catching = children.start(SIGNAL_JOB, "/dev/null", "u", "e", "j", "0")
    assert catches_signal(plain.pid, signal.SIGUSR1) is False
    assert catches_signal(ignoring.pid, signal.SIGUSR1) is False  # SIG_IGN is not a handler
    assert catches_signal(catching.pid, signal.SIGUSR1) is True
    assert catches_signal(catching.pid, signal.SIGUSR2) is False
    assert catches_signal(999_999_999, signal.SIGUSR1) is None


def test_rss_bytes_of_self() -> None:
    rss = rss_bytes(os.getpid())
    status = Path("/proc/self/status").read_text()
    vmrss = next(int(line.split()[1]) * 1024 for line in status.splitlines() if "VmRSS" in line)
    assert rss is not None and abs(rss - vmrss) < 64 << 20
    assert rss_bytes(999_999_999) is None


def test_processes_in_cgroup_reads_the_tree(tmp_path: Path, children: Children) -> None:
    child = children.sleeper()
    root = tmp_path / "cg"
    (root / "a" / "b").mkdir(parents=True)
    (root / "empty").mkdir()
    (root / "cgroup.procs").write_text(f"{os.getpid()}\n999999999\n")
    (root / "a" / "cgroup.procs").write_text(f"{child.pid}\n{os.getpid()}\n")
    (root / "a" / "b" / "cgroup.procs").write_text("0\n")  # a pid of another namespace
    assert processes_in_cgroup(root) == sorted({os.getpid(), child.pid})
    assert processes_in_cgroup(root / "a" / "b") == []
    assert processes_in_cgroup(tmp_path / "missing") == []


def test_processes_in_real_cgroup() -> None:
    path = proc_memory_cgroup(os.getpid())
    assert path is not None
    dirs = [Path("/sys/fs/cgroup/memory") / path.lstrip("/"), Path("/sys/fs/cgroup") / path[1:]]
    found = [d for d in dirs if (d / "cgroup.procs").exists()]
    if not found:
        pytest.skip("this machine's memory cgroup is not mounted where expected")
    assert os.getpid() in processes_in_cgroup(found[0])


def test_in_scope() -> None:
    assert in_scope("/kubepods/burstable/pod1/c1", "/kubepods")
    assert in_scope("/kubepods", "/kubepods/")
    assert not in_scope("/kubepods-besteffort/x", "/kubepods")
    assert not in_scope("/system.slice", "/kubepods")
    assert in_scope("/anything", "/")


def test_send_signal_guards(children: Children) -> None:
    assert send_signal(1, None, 0).startswith("error")
    assert send_signal(os.getpid(), None, 0).startswith("error")
    child = children.sleeper()
    start = live_start_time(child.pid)
    assert start is not None
    assert send_signal(child.pid, start + 1, signal.SIGKILL) == "reused"
    assert alive(child)
    assert send_signal(child.pid, start, signal.SIGKILL) == "sent"
    child.wait(10)
    assert send_signal(child.pid, start, signal.SIGKILL) == "gone"


# --- shed ----------------------------------------------------------------------------------


def test_shed_picks_lower_priority_largest_first(children: Children) -> None:
    prod, big, mid, small, peer = (children.sleeper() for _ in range(5))
    cands = [
        cand(prod, 6 * GIB, "prod", 10),
        cand(small, 1 * GIB, "low-small", 1),
        cand(mid, 2 * GIB, "low-mid", 1),
        cand(big, 4 * GIB, "low-big", 5),
        cand(peer, 8 * GIB, "peer", 10),  # same priority: not strictly lower
    ]
    result = ShedAction(grace_s=5, allowed_uids={0})(command(params={"need_bytes": 5 * GIB}), cands)
    assert result.outcome == "done", result
    assert ended(result) == {big.pid: "TERM", mid.pid: "TERM"}
    assert [v["pid"] for v in result.data["victims"]] == [big.pid, mid.pid]  # largest first
    assert result.data["freed_bytes"] == 6 * GIB
    assert result.data["protected_priority"] == 10
    assert big.wait(10) == -signal.SIGTERM and mid.wait(10) == -signal.SIGTERM
    assert alive(prod) and alive(small) and alive(peer)
    assert skipped(result)[peer.pid].startswith("priority 10 not below")
    assert skipped(result)[prod.pid] == "the protected job"


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_shed_term_then_kill_after_grace(children: Children) -> None:
    stubborn = children.sleeper("ignore_term")
    polite = children.sleeper()
    cands = [
        cand(stubborn, 2 * GIB, "batch-a", 0),
        cand(polite, 1 * GIB, "batch-b", 0),
    ]
    t0 = time.monotonic()
    result = ShedAction(grace_s=1.0, allowed_uids={0})(
        command(params={"need_bytes": 3 * GIB, "priority": 5}), cands
    )
    took = time.monotonic() - t0
    assert result.outcome == "done", result
    assert ended(result) == {stubborn.pid: "KILL", polite.pid: "TERM"}
    assert stubborn.wait(10) == -signal.SIGKILL
    assert polite.wait(10) == -signal.SIGTERM
    assert 1.0 <= took < 6


def test_shed_never_pid1_self_parent_or_protected(children: Children) -> None:
    protected_low = children.sleeper()
    other = children.sleeper()
    cands = [
        Candidate(1, 100 * GIB, "init", 0, live_start_time(1)),
        cand(os.getpid(), 50 * GIB, "agent", 0),
        cand(os.getppid(), 40 * GIB, "agent-parent", 0),
        cand(protected_low, 30 * GIB, "prod", 5),  # the protected job
        cand(other, 1 * GIB, "batch", 0),
    ]
    shed = ShedAction(grace_s=5, allowed_uids={0})
    cmd = command(params={"need_bytes": 200 * GIB, "allow_partial": True})
    planned = shed(command(params=cmd.params, dry_run=True), cands)
    assert planned.outcome == "dry_run"
    assert [v["pid"] for v in planned.data["victims"]] == [other.pid]
    why = skipped(planned)
    assert why[1] == "pid 1"
    assert why[os.getpid()] == "the agent or its parent"
    # the parent too, unless the parent is init (a test run whose shell went away)
    assert why[os.getppid()] == ("pid 1" if os.getppid() == 1 else "the agent or its parent")
    assert why[protected_low.pid] == "the protected job"
    # for real, with this process among the candidates (pid 1 stays out of a real run)
    result = shed(cmd, cands[1:])
    assert result.outcome == "done" and ended(result) == {other.pid: "TERM"}
    assert alive(protected_low)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a child as another uid")
def test_shed_skips_other_uids(children: Children) -> None:
    sleep = shutil.which("sleep")
    assert sleep is not None

    def as_nobody() -> None:
        os.setgid(65534)
        os.setuid(65534)

    nobody = subprocess.Popen([sleep, "60"], preexec_fn=as_nobody)
    children.procs.append(nobody)
    assert wait_until(lambda: (proc_uids(nobody.pid) or (0,))[0] == 65534, 10)
    mine = children.sleeper()
    cands = [cand(nobody, 4 * GIB, "tenant", 0), cand(mine, 1 * GIB, "batch", 0)]
    params = {"need_bytes": 1, "priority": 5}
    result = ShedAction(grace_s=5, allowed_uids={0})(command(params=params), cands)
    assert result.outcome == "done", result
    assert ended(result) == {mine.pid: "TERM"}
    assert skipped(result)[nobody.pid] == "uid 65534 not allowed"
    assert alive(nobody)
    # with the uid allowed it is picked (largest first)
    planned = ShedAction(allowed_uids={0, 65534})(command(params=params, dry_run=True), cands)
    assert [v["pid"] for v in planned.data["victims"]] == [nobody.pid]


def test_shed_cgroup_scope(children: Children) -> None:
    child = children.sleeper()
    path = proc_memory_cgroup(child.pid)
    assert path is not None
    cands = [cand(child, GIB, "batch", 0)]
    params = {"need_bytes": 1, "priority": 5}
    planned = ShedAction(cgroup_scope=path)(command(params=params, dry_run=True), cands)
    assert planned.outcome == "dry_run"
    result = ShedAction(cgroup_scope="/no/such/scope")(command(params=params), cands)
    assert result.outcome == "refused"
    assert skipped(result)[child.pid] == "outside the cgroup scope"
    assert alive(child)


def test_shed_pid_reuse_guard(children: Children) -> None:
    child = children.sleeper()
    start = live_start_time(child.pid)
    assert start is not None
    stale = Candidate(child.pid, 4 * GIB, "batch", 0, start - 5)  # another process's pid
    unknown = Candidate(child.pid, 4 * GIB, "batch", 0, None)
    for c in (stale, unknown):
        result = ShedAction(grace_s=1, allowed_uids={0})(
            command(params={"need_bytes": 1, "priority": 5}), [c]
        )
        assert result.outcome == "refused"
        assert alive(child)
    assert skipped(result)[child.pid] == "start time unknown"


def test_shed_dry_run_kills_nothing(children: Children) -> None:
    a, b = children.sleeper(), children.sleeper()
    cands = [cand(a, 3 * GIB, "x", 0), cand(b, 2 * GIB, "y", 0)]
    result = ShedAction(grace_s=1, allowed_uids={0})(
        command(params={"need_bytes": 4 * GIB, "priority": 3}, dry_run=True), cands
    )
    assert result.outcome == "dry_run"
    assert ended(result) == {a.pid: "dry_run", b.pid: "dry_run"}
    assert "SIGTERM" in result.detail
    # nothing was sent: neither dies (a SIGTERM would end them within milliseconds)
    assert not wait_until(lambda: not (alive(a) and alive(b)), timeout_s=0.3)


def test_shed_shortfall_refused_unless_partial(children: Children) -> None:
    a = children.sleeper()
    cands = [cand(a, 1 * GIB, "x", 0), cand(children.sleeper(), 9 * GIB, "prod", 7)]
    result = ShedAction(grace_s=1, allowed_uids={0})(command(params={"need_bytes": 4 * GIB}), cands)
    assert result.outcome == "refused"
    assert result.data["shortfall_bytes"] == 3 * GIB
    assert "short" in result.detail
    assert alive(a)
    result = ShedAction(grace_s=5, allowed_uids={0})(
        command(params={"need_bytes": 4 * GIB, "allow_partial": True}), cands
    )
    assert result.outcome == "done" and ended(result) == {a.pid: "TERM"}


def test_shed_refuses_bad_params_and_unknown_priority(children: Children) -> None:
    a = children.sleeper()
    cands = [cand(a, GIB, "x", 0)]
    for params in ({}, {"need_bytes": -1}, {"need_bytes": "1G"}, {"need_bytes": True}):
        assert ShedAction(allowed_uids={0})(command(params=params), cands).outcome == "refused"
    # the protected job is not on this domain and no priority was given
    result = ShedAction(allowed_uids={0})(command(params={"need_bytes": 1}), cands)
    assert result.outcome == "refused" and "priority" in result.detail
    assert alive(a)


def test_shed_victim_already_gone(children: Children) -> None:
    a = children.sleeper()
    c = cand(a, GIB, "x", 0)
    a.kill()
    a.wait(10)
    result = ShedAction(allowed_uids={0})(command(params={"need_bytes": 1, "priority": 3}), [c])
    assert result.outcome == "refused" and skipped(result)[a.pid] == "gone"


# --- checkpoint ----------------------------------------------------------------------------


def events_of(client: redis.Redis, keys: Keys) -> list[dict[str, Any]]:
    return [json.loads(f[b"event"]) for _, f in client.xrange(keys.events)]


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_checkpoint_by_signal_to_a_catching_process(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    flag = tmp_path / "saved"
    job = children.start(SIGNAL_JOB, str(flag), redis_url, keys.events, "train-1", "1")
    plain = children.sleeper()  # another process of the job that does not catch SIGUSR1
    cands = [cand(job, GIB, "train-1", 5), cand(plain, GIB, "train-1", 5)]
    action = CheckpointAction(rclient, keys, hook_wait_s=0.5, ack_timeout_s=15)
    result = action(command("checkpoint", job="train-1"), cands)
    assert result.outcome == "done", result
    assert result.data["via"] == "signal"
    assert result.data["signalled_pids"] == [job.pid]
    assert result.data["path"] == str(flag)
    assert flag.read_text() == "saved"
    assert {"pid": plain.pid, "why": "does not catch SIGUSR1"} in result.data["not_signalled"]
    assert alive(job) and alive(plain)
    # the hook path was tried first: the request is on the job's control stream
    entries = rclient.xrange(jobctl_key(key_prefix, "train-1"))
    assert len(entries) == 1 and json.loads(entries[0][1][b"cmd"])["action"] == "checkpoint"


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_checkpoint_signalled_without_acknowledgement(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    flag = tmp_path / "saved"
    job = children.start(SIGNAL_JOB, str(flag), redis_url, keys.events, "train-1", "0")
    action = CheckpointAction(rclient, keys, hook_wait_s=0.3, ack_timeout_s=1)
    result = action(command("checkpoint", job="train-1"), [cand(job, GIB, "train-1", 5)])
    assert result.outcome == "failed"
    assert "signalled" in result.detail and "no acknowledgement" in result.detail
    assert wait_until(flag.exists, 5)
    assert alive(job)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_checkpoint_refused_when_nothing_catches_the_signal(
    children: Children, rclient: redis.Redis, key_prefix: str
) -> None:
    plain = children.sleeper()
    ignoring = children.sleeper("ignore_usr1")
    cands = [
        cand(plain, GIB, "train-1", 5),
        cand(ignoring, GIB, "train-1", 5),
        cand(os.getpid(), GIB, "train-1", 5),  # never the agent itself
        Candidate(1, GIB, "train-1", 5, live_start_time(1)),  # never PID 1
    ]
    action = CheckpointAction(rclient, key_prefix, hook_wait_s=0.3, ack_timeout_s=1)
    result = action(command("checkpoint", job="train-1"), cands)
    assert result.outcome == "refused"
    assert "catches SIGUSR1" in result.detail and "nothing signalled" in result.detail
    why = {d["pid"]: d["why"] for d in result.data["not_signalled"]}
    assert why[plain.pid] == why[ignoring.pid] == "does not catch SIGUSR1"
    assert why[1] == why[os.getpid()] == "pid 1 or the agent itself"
    # SIGUSR1's default action would have killed them
    assert not wait_until(lambda: not (alive(plain) and alive(ignoring)), timeout_s=0.3)


def test_checkpoint_through_the_hook(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    out = tmp_path / "ckpt.pt"
    job = children.start(HOOK_JOB, redis_url, key_prefix, "bert-ft", str(out), "1")
    action = CheckpointAction(rclient, keys, hook_wait_s=10, ack_timeout_s=20)
    cmd = command("checkpoint", job="bert-ft", cid="cmd-123")
    result = action(cmd, [cand(job, GIB, "bert-ft", 5)])
    assert result.outcome == "done", result
    assert result.data["via"] == "hook"
    assert result.data["path"] == str(out) and out.read_text() == "checkpoint"
    assert "signalled_pids" not in result.data
    names = [(e["event"], e.get("request_id")) for e in events_of(rclient, keys)]
    assert ("checkpoint_requested", "cmd-123") in names
    assert ("checkpoint_done", "cmd-123") in names
    assert alive(job)


def test_checkpoint_through_the_hook_that_fails(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    out = tmp_path / "ckpt.pt"
    job = children.start(HOOK_JOB, redis_url, key_prefix, "bert-ft", str(out), "0")
    action = CheckpointAction(rclient, key_prefix, hook_wait_s=10, ack_timeout_s=20)
    result = action(command("checkpoint", job="bert-ft"), [cand(job, GIB, "bert-ft", 5)])
    assert result.outcome == "failed" and "reported the checkpoint failed" in result.detail
    assert result.data["via"] == "hook"


def test_checkpoint_dry_run_sends_nothing(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    flag = tmp_path / "saved"
    job = children.start(SIGNAL_JOB, str(flag), redis_url, keys.events, "train-1", "1")
    plain = children.sleeper()
    action = CheckpointAction(rclient, keys, hook_wait_s=0.3, ack_timeout_s=1)
    result = action(
        command("checkpoint", job="train-1", dry_run=True),
        [cand(job, GIB, "train-1", 5), cand(plain, GIB, "train-1", 5)],
    )
    assert result.outcome == "dry_run"
    assert result.data["catching_pids"] == [job.pid]
    assert "SIGUSR1" in result.detail
    assert not wait_until(lambda: flag.exists() or not (alive(job) and alive(plain)), 0.3)
    assert rclient.exists(jobctl_key(key_prefix, "train-1")) == 0


def test_checkpoint_needs_a_job(rclient: redis.Redis, key_prefix: str) -> None:
    result = CheckpointAction(rclient, key_prefix)(command("checkpoint", job=None), [])
    assert result.outcome == "refused"


def test_checkpoint_only_the_commands_job(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    flag = tmp_path / "saved"
    other = children.start(SIGNAL_JOB, str(flag), redis_url, keys.events, "other", "1")
    action = CheckpointAction(rclient, keys, hook_wait_s=0.2, ack_timeout_s=1)
    result = action(command("checkpoint", job="train-1"), [cand(other, GIB, "other", 5)])
    assert result.outcome == "refused"
    assert not wait_until(flag.exists, timeout_s=0.2)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_checkpoint_cancel_ends_the_wait(
    children: Children, tmp_path: Path, rclient: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    keys = Keys(key_prefix)
    flag = tmp_path / "f"
    job = children.start(SIGNAL_JOB, str(flag), redis_url, keys.events, "t", "0")
    action = CheckpointAction(rclient, keys, hook_wait_s=0.2, ack_timeout_s=60)
    got: list[ActionResult] = []
    worker = threading.Thread(
        target=lambda: got.append(action(command("checkpoint", job="t"), [cand(job, 1, "t", 1)]))
    )
    t0 = time.monotonic()
    worker.start()
    assert wait_until(flag.exists, timeout_s=10)  # signalled: now it waits for the ack
    action.cancel()
    worker.join(10)
    assert got and got[0].outcome == "failed" and time.monotonic() - t0 < 10


def test_live_shedding_needs_a_scope_and_params_cannot_raise_the_bar(children: Children) -> None:
    low = children.sleeper()
    cands = [cand(low, 4 * GIB, "batch", 0), cand(children.sleeper(), 1 * GIB, "prod", 5)]
    unscoped = ShedAction(grace_s=1)(command(params={"need_bytes": 1}), cands)
    assert unscoped.outcome == "refused" and "needs a scope" in unscoped.detail
    assert low.poll() is None
    # a rule asking for priority 50 does not make the priority-5 job's peers at 10 victims
    peer = cand(children.sleeper(), 8 * GIB, "peer", 10)
    planned = ShedAction(allowed_uids={0})(
        command(params={"need_bytes": 1, "priority": 50}, dry_run=True), [*cands, peer]
    )
    assert planned.data["protected_priority"] == 5
    assert [v["job"] for v in planned.data["victims"]] == ["batch"]
