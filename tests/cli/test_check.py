"""``oomcast check``: the settings, rules, model and Redis a deploy needs, checked before it,
each failure a sentence and a non-zero exit."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from support import free_port, oomcast_cmd


def check(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("OOMCAST_")}
    return subprocess.run(
        oomcast_cmd("check", *args),
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_good_deployment_passes_every_check(redis_url: str, key_prefix: str) -> None:
    out = check({"OOMCAST_REDIS_URL": redis_url, "OOMCAST_KEY_PREFIX": key_prefix}, "--json")
    assert out.returncode == 0, out.stdout + out.stderr
    result = json.loads(out.stdout)
    assert result["ok"] is True
    assert [c["name"] for c in result["checks"]] == [
        "settings",
        "rules",
        "actions",
        "model",
        "redis",
    ]
    assert all(c["ok"] for c in result["checks"])
    # nothing to deliver to is not a failure (serve starts), but it is said, as serve says it
    actions = result["checks"][2]
    assert actions["warn"] is True and "webhook needs OOMCAST_WEBHOOK_URL" in actions["says"]
    assert "shed needs OOMCAST_CONTROL_SECRET" in actions["says"]


def test_actions_with_somewhere_to_go_are_not_a_warning(tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "rules:\n  - name: r\n    when: {horizon_s: 30, fire_risk: 0.8}\n    actions: [webhook]\n"
    )
    env = {"OOMCAST_WEBHOOK_URL": "http://hooks.example:8080/oom",
           "OOMCAST_WEBHOOK_SECRET": "s" * 32}  # fmt: skip
    out = check(env, "--rules", str(rules), "--no-redis")
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok   actions   every action the rules name is configured" in out.stdout
    out = check({}, "--rules", str(rules), "--no-redis")
    assert out.returncode == 0
    assert "WARN actions" in out.stdout and "webhook needs OOMCAST_WEBHOOK_URL" in out.stdout


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_each_problem_is_named_and_fails_the_check(tmp_path: Path, redis_url: str) -> None:
    env_file = tmp_path / "oomcast.env"
    env_file.write_text("OOMCAST_ALERT_HORIZON_S=50\n")
    out = check({"OOMCAST_REDIS_URL": redis_url}, "--config", str(env_file), "--no-redis")
    assert out.returncode == 1
    assert "FAIL settings" in out.stdout and "OOMCAST_ALERT_HORIZON_S must be one of" in out.stdout

    rules = tmp_path / "rules.yaml"
    rules.write_text("rules:\n  - name: r\n    when: {fire_risk: 0.8}\n    actions: [webhook]\n")
    out = check({"OOMCAST_REDIS_URL": redis_url}, "--rules", str(rules), "--no-redis")
    assert out.returncode == 1
    assert "FAIL rules" in out.stdout and "'r'" in out.stdout and "horizon_s" in out.stdout
    assert "ok   settings" in out.stdout  # the others are still checked

    rules.write_text("rules:\n  - name: r\n    when: {horizon: 30, fire_risk: 0.8}\n"
                     "    actions: [webhook]\n")  # fmt: skip
    out = check({"OOMCAST_REDIS_URL": redis_url}, "--rules", str(rules), "--no-redis")
    assert "when.horizon: Extra inputs are not permitted (did you mean 'horizon_s'?)" in out.stdout

    out = check({"OOMCAST_REDIS_URL": redis_url}, "--rules", str(tmp_path / "no.yaml"))
    assert out.returncode == 1
    assert f"FAIL rules     --rules={tmp_path / 'no.yaml'}: cannot read it" in out.stdout
    out = check({"OOMCAST_RULES": str(tmp_path / "no.yaml")}, "--no-redis")
    assert f"OOMCAST_RULES={tmp_path / 'no.yaml'}: cannot read it" in out.stdout

    down = f"redis://127.0.0.1:{free_port()}"
    out = check({"OOMCAST_REDIS_URL": down})
    assert out.returncode == 1
    assert "FAIL redis" in out.stdout and "127.0.0.1" in out.stdout

    out = check({"OOMCAST_REDIS_URL": redis_url, "OOMCAST_MODEL_PATH": str(tmp_path / "m.onnx")})
    assert out.returncode == 1
    assert "OOMCAST_MODEL_PATH=" in out.stdout and "no such file" in out.stdout


def test_a_missing_config_file_is_a_usage_error(tmp_path: Path) -> None:
    out = check({}, "--config", str(tmp_path / "nope.env"), "--no-redis")
    assert out.returncode == 2
    assert "--config" in out.stderr and "no such file" in out.stderr
