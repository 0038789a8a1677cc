"""``oomcast collect`` as a real process: several sources at once, its own /metrics, a clean
exit on SIGTERM, and clear refusals of bad flags."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import LIMIT, free_port, oomcast_cmd, v2_files, wait_until, write_files

from oomcast.model.control import new_command, node_key, node_keys, sign_command
from oomcast.model.wire import Keys, decode_samples, entry_attested


def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        oomcast_cmd(*args), capture_output=True, text=True, timeout=60, env=env or dict(os.environ)
    )


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
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


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
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


# --- keys, proof, secrets in logs -----------------------------------------------------------

MASTER = "cli-master-secret"


class Agent:
    """``oomcast collect`` as a process, its stderr in a file (read while it runs)."""

    def __init__(self, tmp: Path, env: dict[str, str], *args: str, node: str = "cli-node"):
        self.log = tmp / f"agent-{node}-{free_port()}.log"
        with self.log.open("w") as fh:
            self.proc = subprocess.Popen(
                oomcast_cmd(
                    "--log-level", "info", "collect", "--node", node, "--metrics-port", "0", *args
                ),
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=fh,
            )

    def stderr(self) -> str:
        return self.log.read_text()

    def stop(self, kill: bool = False) -> str:
        """SIGTERM (or, with ``kill``, SIGKILL: no draining of undelivered samples)."""
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        return self.stderr()


def entries(url: str, key_prefix: str, node: str) -> list[dict[bytes, bytes]]:
    stream = Keys(key_prefix).samples_for(node)
    return [f for _, f in redis.Redis.from_url(url).xrange(stream) if f[b"node"] == node.encode()]


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_no_log_line_shows_the_redis_password(
    private_redis: Any, key_prefix: str, tmp_path: Path
) -> None:
    admin = redis.Redis.from_url(private_redis.url)
    admin.config_set("requirepass", "hunter2-s3cret")
    url = private_redis.url.replace("redis://", "redis://:hunter2-s3cret@")
    env = {**os.environ, "OOMCAST_KEY_PREFIX": key_prefix, "OOMCAST_REDIS_URL": url}
    env.pop("OOMCAST_CONTROL_SECRET", None)
    agent = Agent(tmp_path, env, "--source", "sim", "--gpus", "1", "--interval", "0.1")
    try:
        assert wait_until(lambda: len(entries(url, key_prefix, "cli-node")) >= 2, 30)
    finally:
        err = agent.stop()
    assert "collecting from sim into redis://:***@127.0.0.1:" in err, err
    assert "hunter2-s3cret" not in err
    # a flag's URL, to a Redis that is not there: the start-up line and the warnings it causes
    bad = f"redis://agent:hunter2-s3cret@127.0.0.1:{free_port()}/0"
    agent = Agent(tmp_path, env, "--source", "sim", "--gpus", "1", "--redis-url", bad)
    try:
        assert wait_until(lambda: "Redis did not take samples" in agent.stderr(), 30)
    finally:
        err = agent.stop(kill=True)  # it would wait 10 s to deliver what it holds
    assert "redis://agent:***@127.0.0.1:" in err and "hunter2-s3cret" not in err


def test_control_key_prints_the_node_key() -> None:
    env = {**os.environ, "OOMCAST_CONTROL_SECRET": MASTER}
    r = run("control-key", "--node", "node-7", env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == node_key(MASTER, "node-7")
    env.pop("OOMCAST_CONTROL_SECRET")
    r = run("control-key", "--node", "node-7", env=env)
    assert r.returncode == 2 and "OOMCAST_CONTROL_SECRET is not set" in r.stderr


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_agent_attests_with_its_node_key_and_warns_about_the_master(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    base = {**os.environ, "OOMCAST_KEY_PREFIX": key_prefix, "OOMCAST_REDIS_URL": redis_url}
    base.pop("OOMCAST_CONTROL_SECRET", None)
    keys = node_keys(MASTER)
    # its own key: attested, no warning
    agent = Agent(
        tmp_path,
        {**base, "OOMCAST_NODE_KEY": node_key(MASTER, "n-own")},
        "--source",
        "sim",
        "--gpus",
        "1",
        "--interval",
        "0.1",
        node="n-own",
    )
    try:
        assert wait_until(lambda: len(entries(redis_url, key_prefix, "n-own")) >= 2, 30)
    finally:
        err = agent.stop()
    assert all(entry_attested(f, keys) for f in entries(redis_url, key_prefix, "n-own"))
    assert "master key" not in err
    # the master secret: it derives the same key, and says a node should not hold the master
    agent = Agent(
        tmp_path,
        {**base, "OOMCAST_CONTROL_SECRET": MASTER},
        "--source",
        "sim",
        "--gpus",
        "1",
        "--interval",
        "0.1",
        node="n-master",
    )
    try:
        assert wait_until(lambda: len(entries(redis_url, key_prefix, "n-master")) >= 2, 30)
    finally:
        err = agent.stop()
    assert all(entry_attested(f, keys) for f in entries(redis_url, key_prefix, "n-master"))
    assert "A node should hold only its own key" in err, err
    assert MASTER not in err and node_key(MASTER, "n-master") not in err


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_agent_reads_its_key_from_the_file_the_daemonset_mounts(
    redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    """The DaemonSet hands each agent its node's own key as a host file
    (OOMCAST_NODE_KEY_FILE), never the master secret: with the file it attests; without
    it (a node not provisioned) it runs unattested and says why; an empty file is refused."""
    base = {**os.environ, "OOMCAST_KEY_PREFIX": key_prefix, "OOMCAST_REDIS_URL": redis_url}
    base.pop("OOMCAST_CONTROL_SECRET", None)
    key_file = tmp_path / "node-key"
    key_file.write_text(node_key(MASTER, "n-file") + "\n")
    key_file.chmod(0o400)
    args = ("--source", "sim", "--gpus", "1", "--interval", "0.1")
    agent = Agent(tmp_path, {**base, "OOMCAST_NODE_KEY_FILE": str(key_file)}, *args, node="n-file")
    try:
        assert wait_until(lambda: len(entries(redis_url, key_prefix, "n-file")) >= 2, 30)
    finally:
        err = agent.stop()
    assert all(
        entry_attested(f, node_keys(MASTER)) for f in entries(redis_url, key_prefix, "n-file")
    )
    assert "readable by others" not in err and node_key(MASTER, "n-file") not in err
    missing = str(tmp_path / "absent")
    agent = Agent(tmp_path, {**base, "OOMCAST_NODE_KEY_FILE": missing}, *args, node="n-none")
    try:
        assert wait_until(lambda: len(entries(redis_url, key_prefix, "n-none")) >= 2, 30)
    finally:
        err = agent.stop()
    assert not any(
        entry_attested(f, node_keys(MASTER)) for f in entries(redis_url, key_prefix, "n-none")
    )
    assert f"OOMCAST_NODE_KEY_FILE={missing}: no such file" in err, err
    empty = tmp_path / "empty-key"
    empty.write_text("\n")
    r = run(
        "collect", *args, "--node", "n-empty", env={**base, "OOMCAST_NODE_KEY_FILE": str(empty)}
    )
    assert r.returncode == 2 and "the file is empty" in r.stderr, r.stderr


HOLD = "import time; print('up', flush=True); time.sleep(120)"


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_agent_sheds_only_when_its_own_reading_confirms_the_command(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    """The defect: a validly signed shed, made from forged samples of a nearly full domain,
    killed a real process. The agent reads the cgroup itself (its files say 20% used) and
    refuses; a command whose claim its reading bears out sheds the low-priority process."""
    keeper = subprocess.Popen(
        [sys.executable, "-c", HOLD],
        env={**os.environ, "OOMCAST_JOB": "keeper", "OOMCAST_PRIORITY": "10"},
        stdout=subprocess.PIPE,
    )
    victim = subprocess.Popen(
        [sys.executable, "-c", HOLD],
        env={**os.environ, "OOMCAST_JOB": "batch", "OOMCAST_PRIORITY": "0"},
        stdout=subprocess.PIPE,
    )
    node = "cli-proof"
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    procs = f"{keeper.pid}\n{victim.pid}"
    write_files(root / "job", v2_files(current=LIMIT // 5, limit=LIMIT) | {"cgroup.procs": procs})
    env = {
        **os.environ,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_NODE_KEY": node_key(MASTER, node),
    }
    env.pop("OOMCAST_CONTROL_SECRET", None)
    client = redis.Redis.from_url(redis_url)
    keys = Keys(key_prefix)
    agent = Agent(
        tmp_path,
        env,
        "--source",
        "cgroup",
        "--cgroup-root",
        str(root),
        "--cgroup-interval",
        "0.2",
        "--shed-uids",
        str(os.getuid()),
        "--shed-grace",
        "1",
        node=node,
    )
    try:
        assert keeper.stdout and keeper.stdout.readline() and victim.stdout
        assert victim.stdout.readline()
        assert wait_until(lambda: len(entries(redis_url, key_prefix, node)) >= 1, 30)

        def shed(used: int) -> dict[str, str]:
            cmd = new_command(
                node=node,
                action="shed",
                device="cgroup:/job",
                job="keeper",
                params={"need_bytes": 1},
                forecast={"used_bytes": used, "total_bytes": LIMIT},
            )
            return sign_command(cmd, node_key(MASTER, node))

        def events() -> list[dict[str, Any]]:
            return [
                json.loads(f[b"event"])
                for _, f in client.xrange(keys.events)
                if json.loads(f[b"event"])["node"] == node
            ]

        client.xadd(keys.control(node), shed(int(LIMIT * 0.97)))  # forged: "97% used"
        assert wait_until(lambda: len(events()) >= 1, 20)
        (refused,) = events()
        assert refused["event"] == "command_refused" and refused["reason"] == "unconfirmed"
        assert refused["measured"]["used_bytes"] == LIMIT // 5
        assert refused["claimed"]["used_bytes"] == int(LIMIT * 0.97)
        assert victim.poll() is None and keeper.poll() is None  # nobody was shed

        client.xadd(keys.control(node), shed(LIMIT // 5))  # what the agent reads itself
        assert wait_until(lambda: len(events()) >= 2, 30)
        result = events()[1]
        assert result["event"] == "action_result" and result["outcome"] == "done", result
        assert [v["pid"] for v in result["data"]["victims"]] == [victim.pid]
        assert victim.wait(10) is not None and keeper.poll() is None
    finally:
        agent.stop()
        for p in (keeper, victim):
            p.kill()
            p.wait()
