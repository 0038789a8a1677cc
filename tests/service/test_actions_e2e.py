"""Preemptive actions end to end, on real processes and the real kernel OOM killer.

Every part is the real one: `oomcast serve` (the shipped model, a rules file), `oomcast
collect --source cgroup` as the node agent with the control secret, the real Redis, and
workloads in a real memory cgroup. Skipped, with the reason, where no memory cgroup can be
made here; without oomcast each run is shown to end in the kernel's OOM kill.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import free_port, oomcast_cmd, start_serve, wait_until

from oomcast.collectors.cgroupfs import MemoryCgroup
from oomcast.model.control import new_command, node_key, sign_command
from oomcast.model.wire import Keys, decode_event

MIB = 1 << 20
SECRET = "e2e-control-secret"


def write_rules(path: Path, rules: list[dict[str, Any]]) -> Path:
    path.write_text(json.dumps({"rules": rules}))
    return path


class Stack:
    """`oomcast serve` and an `oomcast collect` agent watching one cgroup."""

    def __init__(
        self,
        tmp: Path,
        redis_url: str,
        prefix: str,
        cg: MemoryCgroup,
        rules: list[dict[str, Any]],
        forecaster: str | None = None,
    ) -> None:
        self.node = f"e2e-{cg.name}"
        self.keys = Keys(prefix)
        self.env = {
            **os.environ,
            "OOMCAST_REDIS_URL": redis_url,
            "OOMCAST_KEY_PREFIX": prefix,
            "OOMCAST_CONTROL_SECRET": SECRET,
            "OOMCAST_RULES": str(write_rules(tmp / "rules.json", rules)),
            "OOMCAST_CONSUMER_NAME": "e2e",
            "OOMCAST_NODE": self.node,
        }
        self.env.pop("OOMCAST_FORECASTER", None)
        if forecaster is not None:
            self.env["OOMCAST_FORECASTER"] = forecaster
        self.port = free_port()
        self.server = start_serve(self.env, self.port)
        self.agent_log = (tmp / "agent.log").open("w")
        self.agent = subprocess.Popen(
            oomcast_cmd(
                "collect",
                "--source",
                "cgroup",
                "--node",
                self.node,
                "--cgroup-root",
                str(cg.path.parent),
                "--cgroup-include",
                f"/{cg.name}",
                "--cgroup-interval",
                "0.25",
                "--shed-grace",
                "2",
                "--shed-uids",
                str(os.getuid()),
                "--metrics-port",
                "0",
            ),
            env=self.env,
            stdout=self.agent_log,
            stderr=subprocess.STDOUT,
        )
        self.client = redis.Redis.from_url(redis_url)

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def audit(self) -> list[dict[str, Any]]:
        return list(reversed(httpx.get(f"{self.base}/v1/alerts?limit=1000").json()["alerts"]))

    def samples_seen(self, device: str) -> int:
        r = httpx.get(f"{self.base}/v1/devices/{self.node}/{device}")
        return int(r.json()["samples_seen"]) if r.status_code == 200 else 0

    def forecasting(self, device: str) -> bool:
        """The agent streams ``device`` and the service has forecast it."""
        r = httpx.get(f"{self.base}/v1/devices/{self.node}/{device}")
        return r.status_code == 200

    def events(self) -> list[Any]:
        return [decode_event(f) for _, f in self.client.xrange(self.keys.events)]

    def close(self) -> None:
        for proc in (self.agent, self.server):
            proc.send_signal(signal.SIGTERM)
        for proc in (self.agent, self.server):
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.agent_log.close()


def run_in(
    cg: MemoryCgroup, argv: list[str], env: dict[str, str], log: Path
) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv,
        env=env,
        stdout=log.open("w"),
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: cg.add_pid(os.getpid()),
    )


TRAINER = [sys.executable, "-m", "oomcast.bench.trainers.leaky"]
# The leak pins 0.5 MiB a step, 5 MiB a second: from its start to the kill about a minute
# and a half, a long OOM (docs/model-card.md: the model wants 30 s of growth before it warns,
# and warns the OOMs that come a minute or more into a climb)
TRAIN_ARGS = ["--leak-after", "40", "--width", "1024", "--batch", "128", "--step-s", "0.1"]


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_checkpoint_before_the_oom_saves_the_work(
    make_cgroup: Any, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    # Without oomcast: the same leaking run dies with nothing saved.
    bare = make_cgroup("oomcast-ckpt-bare", 640 * MIB)
    bare_dir = tmp_path / "bare-ckpt"
    env = {**os.environ, "OOMCAST_HOOK": "off"}
    proc = run_in(
        bare, [*TRAINER, *TRAIN_ARGS, "--checkpoint-dir", str(bare_dir)], env, tmp_path / "bare.log"
    )
    assert proc.wait(180) == -9, (tmp_path / "bare.log").read_text()[-2000:]
    assert not bare_dir.exists() or not list(bare_dir.iterdir())

    # With oomcast: the forecast asks the job, through its hook, to checkpoint in time.
    cg = make_cgroup("oomcast-ckpt", 640 * MIB)
    rules = [
        {
            "name": "checkpoint-before-oom",
            "when": {"risk_above": 0.5, "horizon_s": 60, "for_samples": 1},
            "actions": ["checkpoint"],
            "cooldown_s": 0,
            "repeat_s": 3,  # keep the saved state fresh while the episode goes on
        }
    ]
    stack = Stack(tmp_path, redis_url, key_prefix, cg, rules)
    try:
        ckpt_dir = tmp_path / "ckpt"
        job_env = {**stack.env, "OOMCAST_JOB": "leaky"}
        job_env.pop("OOMCAST_CONTROL_SECRET")
        proc = run_in(
            cg,
            [*TRAINER, *TRAIN_ARGS, "--checkpoint-dir", str(ckpt_dir)],
            job_env,
            tmp_path / "job.log",
        )
        code = proc.wait(180)
        log = (tmp_path / "job.log").read_text()
        assert code == -9, f"the job should still die of its leak: {code}\n{log[-2000:]}"
        saved = sorted(ckpt_dir.glob("ckpt-step*.pt")) if ckpt_dir.exists() else []
        assert saved, f"no checkpoint saved before the OOM\n{log[-3000:]}\n{stack.audit()}"
        step = int(saved[-1].stem.removeprefix("ckpt-step"))
        assert step > 40, f"checkpoint at step {step}, before the leak started"
        import torch

        state = torch.load(saved[-1], weights_only=False)
        assert state["step"] == step and "model" in state and "optimizer" in state
        # the OOM is in Redis, and the audit tells the story: alert, command, the hook's answer
        assert wait_until(lambda: any(e.event == "oom" for e in stack.events()), 10)
        assert wait_until(
            lambda: any(
                a.get("event") == "action_result" and a.get("outcome") == "done"
                for a in stack.audit()
            ),
            15,
        ), stack.audit()
        audit = stack.audit()
        firings = [
            a
            for a in audit
            if a.get("rule_name") == "checkpoint-before-oom" and a["status"] == "firing"
        ]
        firing = firings[0]
        ids = {f["dispatched"]["checkpoint"]["command_id"] for f in firings}
        results = [a for a in audit if a.get("event") == "action_result"]
        assert {r["command_id"] for r in results} <= ids
        # the first firing's command is answered. A repeat sent before the job took the
        # first is answered by the same checkpoint (one checkpoint_done names every pending
        # request), and the agent may write that pair of results in either order
        answered = {r["command_id"]: r for r in results}
        result = answered.get(firing["dispatched"]["checkpoint"]["command_id"])
        assert result is not None and result["action"] == "checkpoint", results
        assert sum(r["outcome"] == "done" for r in results) >= 2  # repeated while firing
        assert result["forecast"]["risk"] == firing["risk"]  # the forecast behind the decision
        assert firing["observed_at"] < next(e.ts for e in stack.events() if e.event == "oom")
    finally:
        stack.close()


HOLD = """
import os, sys, time
held = b"\\x01" * ({mib} << 20)
print("holding", flush=True)
time.sleep({seconds})
print("done", flush=True)
"""

GROW = """
import time
chunks = []
while True:
    chunks.append(b"\\x01" * (4 << 20))
    time.sleep(0.1)
"""


def start_pair(
    cg: MemoryCgroup, env: dict[str, str], tmp: Path, stack: Stack | None = None
) -> tuple[Any, Any]:
    """The high-priority holder, then (once the service has seen it hold for about 3 s, where
    a service watches) the low-priority job that grows until the cgroup is full."""
    hi_env = {**env, "OOMCAST_PRIORITY": "10", "OOMCAST_JOB": "trainer-hi"}
    lo_env = {**env, "OOMCAST_PRIORITY": "0", "OOMCAST_JOB": "batch-lo"}
    hi = run_in(
        cg, [sys.executable, "-S", "-c", HOLD.format(mib=300, seconds=40)], hi_env, tmp / "hi.log"
    )
    assert wait_until(lambda: "holding" in (tmp / "hi.log").read_text(), 20)
    if stack is not None:  # 12 samples at the agent's 0.25 s: the holder's level is known
        device = f"cgroup:/{cg.name}"
        start = stack.samples_seen(device)
        assert wait_until(lambda: stack.samples_seen(device) >= start + 12, 20)
    lo = run_in(cg, [sys.executable, "-S", "-c", GROW], lo_env, tmp / "lo.log")
    return hi, lo


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_shedding_the_low_priority_job_lets_the_high_priority_one_finish(
    make_cgroup: Any, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    # Without oomcast: the kernel kills the largest process, the high-priority trainer.
    bare = make_cgroup("oomcast-shed-bare", 512 * MIB)
    (tmp_path / "bare").mkdir()
    hi, lo = start_pair(bare, dict(os.environ), tmp_path / "bare")
    try:
        assert hi.wait(60) == -9, "without oomcast the trainer should be OOM-killed"
        assert bare.oom_kills() >= 1
    finally:
        for p in (hi, lo):
            if p.poll() is None:
                p.kill()
                p.wait()

    cg = make_cgroup("oomcast-shed", 512 * MIB)
    rules = [
        {
            "name": "shed-lower-priority",
            "when": {"risk_above": 0.5, "horizon_s": 60, "for_samples": 1},
            "actions": ["shed"],
            "cooldown_s": 0,
            "dry_run": False,
            "params": {"shed": {"target_frac": 0.7}},
        }
    ]
    # The neighbour fills the cgroup about 5 s after it starts: sooner than the shipped model
    # has history enough to trust a trend (docs/model-card.md). This test is about shedding,
    # so it runs the predict_linear baseline, which projects from the climb's first samples.
    stack = Stack(tmp_path, redis_url, key_prefix, cg, rules, forecaster="predict_linear_w60s_h60s")
    try:
        # start_pair waits for the service to have the holder's samples: the agent, which
        # samples only cgroups with processes in them, has seen the cgroup by then
        hi, lo = start_pair(cg, dict(os.environ), tmp_path, stack)
        lo_code = lo.wait(60)
        hi_code = hi.wait(60)
        assert lo_code in (-signal.SIGTERM, -signal.SIGKILL), f"low-priority job: {lo_code}"
        assert hi_code == 0, (tmp_path / "hi.log").read_text()
        assert "done" in (tmp_path / "hi.log").read_text()
        assert cg.oom_kills() == 0, "the kernel had to kill something after all"
        assert wait_until(lambda: any(a.get("event") == "action_result" for a in stack.audit()), 15)
        result = next(a for a in stack.audit() if a.get("event") == "action_result")
        assert result["action"] == "shed" and result["outcome"] == "done", result
        victims = result["data"]["victims"]
        assert [v["job"] for v in victims] == ["batch-lo"]
        assert result["data"]["protected_job"] == "trainer-hi"
    finally:
        for p in (hi, lo):
            if p.poll() is None:
                p.kill()
        stack.close()


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_forged_expired_and_replayed_commands_are_refused_and_audited(
    make_cgroup: Any, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    cg = make_cgroup("oomcast-ctl", 256 * MIB)
    hold = [sys.executable, "-S", "-c", HOLD.format(mib=20, seconds=60)]
    keeper = run_in(cg, hold, {**os.environ, "OOMCAST_PRIORITY": "5"}, tmp_path / "k.log")
    victim = run_in(cg, hold, {**os.environ, "OOMCAST_PRIORITY": "0"}, tmp_path / "v.log")
    stack = Stack(
        tmp_path,
        redis_url,
        key_prefix,
        cg,
        [{"name": "notify", "when": {"model_rule": True}, "actions": ["webhook"]}],
    )
    try:
        # the agent samples the cgroup, so its control listener (started first) is reading
        assert wait_until(lambda: stack.forecasting(f"cgroup:/{cg.name}"), 30)
        stream = stack.keys.control(stack.node)
        device = f"cgroup:/{cg.name}"

        def shed(**kw: Any) -> dict[str, Any]:
            return new_command(
                node=stack.node,
                action="shed",
                device=device,
                job="x",
                params={"need_bytes": 1, "priority": 100},
                **kw,
            )

        key = node_key(SECRET, stack.node)  # the service signs with the node's key
        stack.client.xadd(stream, sign_command(shed(), "not-the-secret"))  # forged
        stack.client.xadd(stream, sign_command(shed(now=time.time() - 120), key))  # expired
        good = sign_command(shed(dry_run=True), key)
        stack.client.xadd(stream, good)
        stack.client.xadd(stream, good)  # replayed
        stack.client.xadd(stream, {"cmd": json.dumps(shed())})  # unsigned

        def refusals() -> list[str]:
            return sorted(a["reason"] for a in stack.audit() if a.get("event") == "command_refused")

        expected = sorted(["bad_signature", "expired", "replayed", "unsigned"])
        assert wait_until(lambda: refusals() == expected, 20), (refusals(), stack.audit())
        results = [a for a in stack.audit() if a.get("event") == "action_result"]
        assert [r["outcome"] for r in results] == ["dry_run"]  # only the good one ran, dry
        assert results[0]["data"]["victims"][0]["pid"] == victim.pid  # whom it would stop
        assert victim.poll() is None and keeper.poll() is None  # nobody was shed
    finally:
        victim.kill()
        keeper.kill()
        stack.close()
