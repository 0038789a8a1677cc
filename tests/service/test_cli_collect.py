"""``oomcast collect`` as a real process: several sources at once, its own /metrics, a clean
exit on SIGTERM, and clear refusals of bad flags."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import httpx
import redis
from support import LIMIT, free_port, oomcast_cmd, v2_files, wait_until, write_files

from oomcast.model.wire import Keys, decode_samples


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        oomcast_cmd(*args), capture_output=True, text=True, timeout=60, env=env or dict(os.environ)
    )


def test_bad_flags_are_refused_by_name(tmp_path: Path) -> None:
    r = run("collect", "--source", "nvml,gpu")
    assert r.returncode == 2 and "unknown gpu" in r.stderr
    r = run("collect", "--source", "cgroup,cgroup")
    assert r.returncode == 2 and "names a source twice" in r.stderr
    r = run("collect", "--source", "cgroup", "--cgroup-root", str(tmp_path))
    assert r.returncode == 2 and f"--cgroup-root {tmp_path}" in r.stderr
    r = run("collect", "--source", "nvml", "--priority", "pod:*")
    assert r.returncode == 2 and "expected GLOB=INTEGER" in r.stderr
    r = run("collect", "--source", "replay")
    assert r.returncode == 2 and "needs --trace" in r.stderr


def test_cgroup_and_sim_together_metrics_and_sigterm(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    write_files(root / "job", v2_files(limit=LIMIT) | {"cgroup.procs": "1"})
    port = free_port()
    env = {**os.environ, "OOMCAST_KEY_PREFIX": key_prefix, "OOMCAST_REDIS_URL": redis_url}
    proc = subprocess.Popen(
        oomcast_cmd(
            "collect",
            "--source",
            "cgroup,sim",
            "--node",
            "cli-node",
            "--gpus",
            "1",
            "--interval",
            "0.2",
            "--cgroup-interval",
            "0.2",
            "--cgroup-root",
            str(root),
            "--metrics-port",
            str(port),
        ),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        url = f"http://127.0.0.1:{port}"

        def sent_some() -> bool:
            try:
                text = httpx.get(f"{url}/metrics").text
            except httpx.HTTPError:
                return False
            return "oomcast_agent_samples_sent_total" in text and any(
                line.startswith("oomcast_agent_samples_sent_total ") and float(line.split()[1]) >= 6
                for line in text.splitlines()
            )

        assert wait_until(sent_some, 30)
        assert httpx.get(f"{url}/readyz").status_code == 200
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=20)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    assert "undelivered 0" in err
    devices = set()
    for _, fields in redis.Redis.from_url(redis_url).xrange(
        Keys(key_prefix).samples_for("cli-node")
    ):
        devices |= {d.sample.device for d in decode_samples(fields) if not isinstance(d, Exception)}
    assert devices == {"cgroup:/job", "gpu0"}
