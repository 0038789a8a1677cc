"""collectors/control.py against the real Redis: signed commands in, action events out."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest
import redis
from support import wait_until

from oomcast.collectors.actions import ActionResult, Candidate, ShedAction, live_start_time
from oomcast.collectors.control import (
    ControlListener,
    encode_control_event,
    make_resolve,
)
from oomcast.collectors.metrics import render
from oomcast.collectors.proof import Measurement
from oomcast.model.control import Command, new_command, sign_command
from oomcast.model.wire import Keys, decode_event, event_attested

SECRET = "cluster-control-secret"
NODE = "node-a"


class Recorder:
    """An executor that records its calls; ``gate`` (when set) holds each call until opened."""

    def __init__(self, outcome: str = "done", gate: threading.Event | None = None) -> None:
        self.calls: list[tuple[Command, list[Any]]] = []
        self.entered = threading.Event()
        self.outcome = outcome
        self.gate = gate
        self._lock = threading.Lock()

    def __call__(self, command: Command, candidates: Sequence[Any]) -> ActionResult:
        with self._lock:
            self.calls.append((command, list(candidates)))
        self.entered.set()
        if self.gate is not None:
            self.gate.wait(20)
        return ActionResult(self.outcome, f"recorded {command.action}", {"n": len(candidates)})


GIB = 1 << 30
# what the test commands claim of their domain, and what the harness's agent measures
CLAIM = {"used_bytes": 76 * GIB, "total_bytes": 80 * GIB}


class Harness:
    def __init__(self, client: redis.Redis, prefix: str, **kw: Any) -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.reading: Measurement | None = Measurement(CLAIM["used_bytes"], CLAIM["total_bytes"])
        self.executor = kw.pop("executor", None) or Recorder()
        executors = kw.pop("executors", None) or {
            "checkpoint": self.executor,
            "shed": self.executor,
        }
        self.listener = ControlListener(
            client,
            self.keys,
            NODE,
            SECRET,
            executors,
            kw.pop("resolve", lambda cmd: [Candidate(4242, 1, "x", 0, 1)]),
            block_ms=100,
            measure=kw.pop("measure", lambda cmd: self.reading),
            **kw,
        )

    def send(self, fields: dict[str, str], node: str = NODE) -> None:
        self.client.xadd(self.keys.control(node), fields)

    def command(self, **kw: Any) -> dict[str, Any]:
        args: dict[str, Any] = {
            "node": NODE,
            "action": "checkpoint",
            "device": "gpu0",
            "job": "train-1",
            "forecast": {"risk": {"60": 0.9}, "time_to_oom_s": 80.0, **CLAIM},
            "reason": "forecast",
        }
        args.update(kw)
        return new_command(**args)

    def events(self) -> list[dict[str, Any]]:
        out = []
        for _, fields in self.client.xrange(self.keys.events):
            decode_event(fields)  # a standard event reader takes it
            # signed with the node's key (the listener's secret), as the service checks
            assert event_attested(fields, NODE, lambda node: SECRET if node == NODE else None)
            out.append(json.loads(fields[b"event"]))
        return out

    def wait_events(self, n: int, timeout_s: float = 15) -> list[dict[str, Any]]:
        assert wait_until(lambda: len(self.events()) >= n, timeout_s), self.events()
        return self.events()


@pytest.fixture
def harness(rclient: redis.Redis, key_prefix: str) -> Iterator[Harness]:
    h = Harness(rclient, key_prefix)
    h.listener.start()
    yield h
    assert h.listener.stop(10)


def test_valid_command_runs_the_executor(harness: Harness) -> None:
    cmd = harness.command()
    harness.send(sign_command(cmd, SECRET))
    (event,) = harness.wait_events(1)
    assert event["event"] == "action_result"
    assert event["id"] == cmd["id"] and event["action"] == "checkpoint"
    assert event["outcome"] == "done" and event["detail"] == "recorded checkpoint"
    assert event["data"] == {"n": 1}
    assert event["device"] == "gpu0" and event["job"] == "train-1" and event["node"] == NODE
    assert event["dry_run"] is False
    assert event["forecast"] == cmd["forecast"]
    assert isinstance(event["ts"], float)
    ((got, cands),) = harness.executor.calls
    assert got.id == cmd["id"] and cands == [Candidate(4242, 1, "x", 0, 1)]
    metrics = {(m[0], tuple(sorted(m[3].items()))): m[4] for m in harness.listener.metric_samples()}
    assert metrics[("oomcast_agent_control_commands_total", ())] == 1
    key = ("oomcast_agent_control_actions_total", (("action", "checkpoint"), ("outcome", "done")))
    assert metrics[key] == 1
    assert "oomcast_agent_control_refused_total" in render(harness.listener.metric_samples())


def refusal(harness: Harness, fields: dict[str, Any], reason: str, n: int = 1) -> dict[str, Any]:
    harness.send(fields)
    events = harness.wait_events(n)
    event = events[n - 1]
    assert event["event"] == "command_refused", event
    assert event["reason"] == reason, event
    assert event["node"] == NODE and event["message"]
    return event


def test_forged_command_is_refused(harness: Harness) -> None:
    cmd = harness.command(action="shed", params={"need_bytes": 1})
    event = refusal(harness, sign_command(cmd, "guessed-secret"), "bad_signature")
    # unauthenticated: only the id it claims is repeated, marked as such
    assert event["authenticated"] is False and event["id"] == cmd["id"]
    assert event["device"] == "control" and "job" not in event and "action" not in event
    assert harness.executor.calls == []


def test_unsigned_command_is_refused(harness: Harness) -> None:
    fields = sign_command(harness.command(), SECRET)
    del fields["sig"]
    refusal(harness, fields, "unsigned")
    assert harness.executor.calls == []


def test_malformed_commands_are_refused(harness: Harness) -> None:
    raw = '{"action":"checkpoint","id":"m-1"}'  # validly signed, but fields missing
    sig = "sha256=" + hmac.new(SECRET.encode(), raw.encode(), hashlib.sha256).hexdigest()
    event = refusal(harness, {"cmd": raw, "sig": sig}, "malformed")
    assert event["id"] == "m-1" and event["authenticated"] is True
    assert event["device"] == "control"  # its device could not be read
    refusal(harness, {"garbage": "yes", "sig": "sha256=00"}, "malformed", 2)
    refusal(harness, {"cmd": "{not json", "sig": "sha256=00"}, "bad_signature", 3)
    assert harness.executor.calls == []


def test_expired_command_is_refused(harness: Harness) -> None:
    cmd = harness.command(now=time.time() - 100, ttl_s=30)
    event = refusal(harness, sign_command(cmd, SECRET), "expired")
    assert event["id"] == cmd["id"] and event["device"] == "gpu0" and event["job"] == "train-1"
    assert event["authenticated"] is True and event["action"] == "checkpoint"
    assert harness.executor.calls == []


def test_replayed_command_is_refused(harness: Harness) -> None:
    fields = sign_command(harness.command(), SECRET)
    harness.send(fields)
    harness.wait_events(1)
    event = refusal(harness, fields, "replayed", 2)
    assert event["id"] == json.loads(fields["cmd"])["id"]
    assert len(harness.executor.calls) == 1


def test_command_for_another_node(harness: Harness) -> None:
    # signed for node-b but put on node-a's stream
    event = refusal(harness, sign_command(harness.command(node="node-b"), SECRET), "wrong_node")
    assert "node-b" in event["message"]
    # on node-b's own stream: node-a never reads it
    harness.send(sign_command(harness.command(node="node-b"), SECRET), node="node-b")
    assert harness.listener.stream == harness.keys.control(NODE)
    # a command for node-a after it: once node-a has acted on that, it has read all it reads
    marker = harness.command()
    harness.send(sign_command(marker, SECRET))
    assert wait_until(lambda: len(harness.events()) == 2)
    assert [c.id for c, _ in harness.executor.calls] == [marker["id"]]


def test_second_action_while_one_runs_is_busy(rclient: redis.Redis, key_prefix: str) -> None:
    gate = threading.Event()
    h = Harness(rclient, key_prefix, executor=Recorder(gate=gate))
    h.listener.start()
    try:
        first = h.command()
        h.send(sign_command(first, SECRET))
        assert h.executor.entered.wait(10)
        h.send(sign_command(h.command(), SECRET))  # the same job's checkpoint again
        busy = h.wait_events(1)[0]
        assert busy["event"] == "command_refused" and busy["reason"] == "busy"
        job = first["job"]
        assert h.listener.running == [(f"job:{job}", "checkpoint")]
        # the same job's checkpoint asked from another GPU is the same action: busy too
        h.send(sign_command(h.command(device="gpu1"), SECRET))
        assert h.wait_events(2)[-1]["reason"] == "busy"
        # another job's checkpoint, or another action, is not held up
        h.send(sign_command(h.command(job="other-job"), SECRET))
        h.send(sign_command(h.command(action="shed"), SECRET))
        assert wait_until(lambda: len(h.executor.calls) == 3, 10)
        gate.set()
        events = h.wait_events(5)
        results = [e for e in events if e["event"] == "action_result"]
        assert {(e["job"], e["action"]) for e in results} == {
            (job, "checkpoint"),
            ("other-job", "checkpoint"),
            (job, "shed"),
        }
        assert h.listener.wait_idle(5)
        # once done, the same action may run again
        h.send(sign_command(h.command(), SECRET))
        assert h.wait_events(5)[-1]["event"] == "action_result"
    finally:
        gate.set()
        assert h.listener.stop(10)


def test_commands_before_start_are_not_run(rclient: redis.Redis, key_prefix: str) -> None:
    h = Harness(rclient, key_prefix)
    h.send(sign_command(h.command(), SECRET))
    h.listener.start()
    try:
        late = h.command()
        h.send(sign_command(late, SECRET))
        (event,) = h.wait_events(1)
        assert event["id"] == late["id"]
        # the early command is ahead of the late one on the stream: the listener, which reads
        # in order, is past it once the late one has run
        assert h.listener.wait_idle(10)
        assert len(h.executor.calls) == 1
    finally:
        h.listener.stop(10)


def test_action_without_executor_is_disabled(rclient: redis.Redis, key_prefix: str) -> None:
    rec = Recorder()
    h = Harness(rclient, key_prefix, executors={"checkpoint": rec})
    h.listener.start()
    try:
        h.send(sign_command(h.command(action="shed", params={"need_bytes": 1}), SECRET))
        event = h.wait_events(1)[0]
        assert event["event"] == "command_refused" and event["reason"] == "disabled"
        assert rec.calls == []
    finally:
        h.listener.stop(10)


def test_executor_error_is_a_failed_result(rclient: redis.Redis, key_prefix: str) -> None:
    def broken(command: Command, candidates: Sequence[Any]) -> ActionResult:
        raise RuntimeError("boom")

    h = Harness(rclient, key_prefix, executors={"checkpoint": broken})
    h.listener.start()
    try:
        h.send(sign_command(h.command(), SECRET))
        event = h.wait_events(1)[0]
        assert event["outcome"] == "failed" and "boom" in event["detail"]
    finally:
        h.listener.stop(10)


def test_publish_event_callback(rclient: redis.Redis, key_prefix: str) -> None:
    got: list[dict[str, Any]] = []
    h = Harness(rclient, key_prefix, publish_event=got.append)
    h.listener.start()
    try:
        h.send(sign_command(h.command(), SECRET))
        h.send(sign_command(h.command(), "forged"))
        assert wait_until(lambda: len(got) == 2, 10)
        assert {e["event"] for e in got} == {"action_result", "command_refused"}
        assert h.events() == []  # nothing went to the stream directly
        assert decode_event(encode_control_event(got[0])).node == NODE
    finally:
        h.listener.stop(10)


def test_refusal_events_are_rate_limited(rclient: redis.Redis, key_prefix: str) -> None:
    h = Harness(rclient, key_prefix, refusal_events_per_min=3)
    h.listener.start()
    try:
        for _ in range(6):
            h.send({"cmd": "x"})
        assert wait_until(lambda: h.listener.stats.received == 6, 10)
        assert len(h.events()) == 3
        assert h.listener.stats.events_suppressed == 3
        assert h.listener.stats.refused == {"unsigned": 6}
    finally:
        h.listener.stop(10)


def test_real_shed_dry_run_through_the_listener(
    rclient: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        assert wait_until(lambda: live_start_time(child.pid) is not None, 10)
        start = live_start_time(child.pid)

        def resolve(cmd: Command) -> list[Candidate]:
            return [
                Candidate(child.pid, 2 << 30, "batch", 0, start),
                Candidate(os.getpid(), 9 << 30, "train-1", 5, live_start_time(os.getpid())),
            ]

        h = Harness(rclient, key_prefix, executors={"shed": ShedAction(grace_s=1)}, resolve=resolve)
        h.listener.start()
        try:
            cmd = h.command(action="shed", params={"need_bytes": 1 << 30}, dry_run=True)
            h.send(sign_command(cmd, SECRET))
            event = h.wait_events(1)[0]
            assert event["outcome"] == "dry_run" and event["dry_run"] is True
            assert [v["pid"] for v in event["data"]["victims"]] == [child.pid]
            assert child.poll() is None
        finally:
            h.listener.stop(10)
    finally:
        child.kill()
        child.wait(10)


def test_make_resolve_reads_a_cgroup_domain(tmp_path: Path) -> None:
    root = tmp_path / "cg"
    (root / "kubepods" / "podx").mkdir(parents=True)
    (root / "kubepods" / "podx" / "cgroup.procs").write_text(f"{os.getpid()}\n")
    resolve = make_resolve(cgroup_root=root)
    base = new_command(node=NODE, action="shed", device="cgroup:/kubepods", job="j")
    cmd = Command(**base)
    (c,) = resolve(cmd)
    assert c.pid == os.getpid() and c.used_bytes and c.start_time == live_start_time(c.pid)
    escape = Command(**{**base, "device": "cgroup:/../../etc"})
    assert resolve(escape) == []
    assert make_resolve()(Command(**{**base, "device": "gpu0"})) == []


def test_make_resolve_gpu_checkpoint_spans_the_jobs_gpus() -> None:
    class FakeNvml:
        tables: ClassVar[dict[str, list[Candidate]]] = {
            "gpu0": [Candidate(10, 5, "train-1", 1, 1), Candidate(11, 3, "other", 0, 1)],
            "gpu1": [Candidate(12, 5, "train-1", 1, 1), Candidate(13, 3, "other", 0, 1)],
        }

        def devices(self) -> list[str]:
            return list(self.tables)

        def processes(self, device: str) -> list[Candidate]:
            return self.tables.get(device, [])

    resolve = make_resolve(nvml=FakeNvml())
    base = new_command(node=NODE, action="checkpoint", device="gpu0", job="train-1")
    assert [c.pid for c in resolve(Command(**base))] == [10, 11, 12]
    assert [c.pid for c in resolve(Command(**{**base, "action": "shed"}))] == [10, 11]


def test_listener_refuses_empty_secret(rclient: redis.Redis) -> None:
    with pytest.raises(ValueError):
        ControlListener(rclient, Keys("x"), NODE, "", {}, lambda c: [])
    assert SECRET not in repr(ControlListener(rclient, Keys("x"), NODE, SECRET, {}, lambda c: []))


def test_a_command_issued_before_the_agent_started_is_not_run(
    rclient: redis.Redis, key_prefix: str
) -> None:
    """Nonces live in memory: after a restart, an old (still unexpired) entry added again
    must not run a second time."""
    h = Harness(rclient, key_prefix, executor=Recorder())
    h.listener.start()
    try:
        old = h.command(now=time.time() - 200, ttl_s=300)
        h.send(sign_command(old, SECRET))
        [event] = h.wait_events(1)
        assert event["event"] == "command_refused" and event["reason"] == "replayed"
        assert "before this agent started" in event["message"]
        assert h.executor.calls == []
    finally:
        assert h.listener.stop(10)
