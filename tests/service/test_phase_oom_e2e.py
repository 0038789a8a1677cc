"""Phase-aware warnings end to end, on a real job and the real kernel OOM killer.

A real PyTorch training loop (bench/trainers/eval_spike.py, CPU) runs in a real memory
cgroup that its training fits in and its first eval does not: the eval keeps every batch's
graph alive. Nothing in its memory stream announces the eval; the job's hook does: the
schedule (an eval every 160 steps, 0.25 s a step) and the eval's extra bytes as a preflight
of the job's own code on fake tensors gives them (``set_phase_extra_bytes``).

Every other part is the real one too: the real Redis, `oomcast serve` with the shipped
model and its default rules (service/pipeline/default_rules.yaml: the ``oom-forecast`` rule asks for
a checkpoint), `oomcast collect` as the node agent with the control secret, relaying the
service's signed command to the job's control stream, and a real webhook receiver.

What it proves: the alert names the cause ``phase:eval`` and fires at least 30 s before the
eval begins (by the job's own clock, from its log), the job receives the checkpoint request
through its hook and saves, and the checkpoint is on disk, and loads, before the kernel kills
the job in its eval (SIGKILL, the cgroup's OOM kill counter). Skipped, with the reason, where
this machine cannot make a memory cgroup. The same job beside it, in a cgroup of its own,
announcing nothing, is the control: it dies in its eval unwarned and unsaved.
"""

from __future__ import annotations

import json
import signal
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from support import wait_until

from oomcast.collectors.cgroupfs import MemoryCgroup
from tests.service.test_actions_e2e import Stack, run_in

MIB = 1 << 20
LIMIT = 640 * MIB  # the training runs at about 360 MB resident; the eval needs ~770 MB more
EVAL_EVERY = 160
STEP_S = 0.25  # the first eval comes 40 s after the first step
LEAD_S = 30.0
DEFAULT_RULES = Path(__file__).parents[2] / "service" / "pipeline" / "default_rules.yaml"
TRAINER = [sys.executable, "-m", "oomcast.bench.trainers.eval_spike"]


def job_events(log: Path) -> list[dict[str, Any]]:
    """The job's JSON lines (its other output, torch's and the hook's logging, is skipped)."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith('{"ts"'):
            events.append(json.loads(line))
    return events


def first(events: list[dict[str, Any]], name: str) -> dict[str, Any] | None:
    return next((e for e in events if e["event"] == name), None)


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_an_eval_that_will_oom_is_warned_in_time_and_the_job_checkpoints_before_the_kill(
    make_cgroup: Any,
    redis_url: str,
    key_prefix: str,
    tmp_path: Path,
    webhook_receiver: Any,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cg: MemoryCgroup = make_cgroup("oomcast-phase-oom", LIMIT)
    bare_cg: MemoryCgroup = make_cgroup("oomcast-phase-bare", LIMIT)
    rules = yaml.safe_load(DEFAULT_RULES.read_text())["rules"]
    assert "checkpoint" in next(r for r in rules if r["name"] == "oom-forecast")["actions"]
    monkeypatch.setenv("OOMCAST_WEBHOOK_URL", webhook_receiver.url)
    monkeypatch.setenv("OOMCAST_WEBHOOK_SECRET", "phase-oom-e2e-secret")
    stack = Stack(tmp_path, redis_url, key_prefix, cg, rules)  # the shipped model
    log = tmp_path / "job.log"
    ckpt_dir = tmp_path / "ckpt"
    bare_log, bare_dir = tmp_path / "bare.log", tmp_path / "bare-ckpt"
    proc = bare = None
    try:
        job_env = {**stack.env, "OOMCAST_JOB": "eval-spike"}
        job_env.pop("OOMCAST_CONTROL_SECRET")  # the job holds no key; the agent does
        argv = ["--eval-every", str(EVAL_EVERY), "--step-s", str(STEP_S)]
        proc = run_in(cg, [*TRAINER, *argv, "--checkpoint-dir", str(ckpt_dir)], job_env, log)
        # the control, beside it: the same job announcing nothing (its stream is as flat)
        bare_argv = [*TRAINER, *argv, "--announce", "none", "--checkpoint-dir", str(bare_dir)]
        bare_env = {**job_env, "OOMCAST_JOB": "eval-spike-bare"}
        bare = run_in(bare_cg, bare_argv, bare_env, bare_log)
        code = proc.wait(150)
        events = job_events(log)
        text = log.read_text(errors="replace")[-3000:]
        assert code == -signal.SIGKILL, (
            f"the kernel should kill the job in its eval: {code}\n{text}"
        )
        assert cg.oom_kills() >= 1

        start, announced = first(events, "start"), first(events, "announced")
        assert start is not None and start["mode"] == "host", text
        assert announced is not None and announced["eval_extra_bytes"] > 256 * MIB
        eval_begin = first(events, "eval_begin")
        assert eval_begin is not None and eval_begin["step"] == EVAL_EVERY, text
        assert first(events, "eval_end") is None  # killed inside it
        device = f"proc:{start['pid']}"

        # the alert: the hook's domain, cause phase:eval, at least 30 s before the eval
        firing = webhook_receiver.wait_for(
            lambda r: r["json"]["status"] == "firing" and r["json"]["device"] == device, 5
        )
        assert firing, stack.audit()
        alert, received_at = firing[0]["json"], firing[0]["at"]
        assert alert["cause"] == "phase:eval" and alert["rule_name"] == "oom-forecast", alert
        assert alert["model_version"].startswith("lstm")
        assert received_at <= eval_begin["ts"] - LEAD_S, (received_at, eval_begin)
        assert alert["observed_at"] <= eval_begin["ts"] - LEAD_S
        # the forecast's time to OOM is the time left until the eval (within 10%)
        left = eval_begin["ts"] - alert["observed_at"]
        assert abs(alert["time_to_oom_s"] - left) <= 0.1 * left, (alert, left)

        # the request reached the job through its hook, and it saved before the eval
        asked, saved = first(events, "checkpoint_requested"), first(events, "checkpoint_saved")
        assert asked is not None and asked["source"] == "jobctl", text
        assert saved is not None, text
        assert alert["fired_at"] <= asked["ts"] <= saved["ts"] < eval_begin["ts"]
        path = Path(saved["path"])
        assert path.parent == ckpt_dir and path.is_file()
        assert path.stat().st_mtime < eval_begin["ts"]  # on disk before the eval, so the kill
        import torch

        state = torch.load(path, weights_only=False)
        assert state["step"] == saved["step"] and 0 < saved["step"] < EVAL_EVERY
        assert set(state) == {"step", "model", "optimizer"}

        # the audit closes the loop: the service's command, and the hook's answer, by its id
        def checkpoint_done() -> list[dict[str, Any]]:
            return [
                a
                for a in stack.audit()
                if a.get("event") == "action_result" and a.get("action") == "checkpoint"
            ]

        assert wait_until(checkpoint_done, 15), stack.audit()
        result = checkpoint_done()[0]
        assert result["outcome"] == "done", result
        assert result["command_id"] == alert["dispatched"]["checkpoint"]["command_id"]
        assert result["data"]["path"] == str(path), result

        # the control dies in its eval too, and nothing warned it: the warning above came
        # from the announced eval, not from the memory stream
        assert bare.wait(60) == -signal.SIGKILL, bare_log.read_text(errors="replace")[-3000:]
        assert bare_cg.oom_kills() >= 1
        bare_events = job_events(bare_log)
        bare_start, bare_eval = first(bare_events, "start"), first(bare_events, "eval_begin")
        assert bare_start is not None and bare_eval is not None
        assert first(bare_events, "announced") is None
        assert first(bare_events, "checkpoint_saved") is None
        bare_device = f"proc:{bare_start['pid']}"
        warned = [
            r["json"]
            for r in webhook_receiver.requests
            if r["json"].get("device") == bare_device
            and r["json"].get("observed_at", 0) < bare_eval["ts"]
        ]
        assert warned == []
    finally:
        for p in (proc, bare):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        stack.close()
