"""A real PyTorch training job (bench/trainers/leaky.py, CPU) with a genuine leak and the
in-process hook, run under a real memory cgroup until the kernel kills it, watched by the node
agent's cgroup source: the OOM lands in Redis as an event, the job's samples too, and
``oomcast dump`` + ``oomcast evaluate`` read the run back as a labelled trace.

Skipped, with the reason, where this machine cannot make a memory cgroup."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import redis
from support import oomcast_cmd, wait_until

from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.cgroupfs import MemoryCgroup
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.model.schema import Event
from oomcast.model.trace import load_trace
from oomcast.model.wire import Keys, decode_event, decode_samples

MIB = 1 << 20
LIMIT = 640 * MIB


@pytest.fixture
def job_cgroup(make_cgroup: Any) -> MemoryCgroup:
    return make_cgroup("oomcast-leaky", LIMIT)


def trainer_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "oomcast.bench.trainers.leaky", *args]


def oom_events(client: redis.Redis, keys: Keys) -> list[Event]:
    events = [decode_event(f) for _, f in client.xrange(keys.events)]
    return [e for e in events if e.event == "oom"]


@pytest.mark.slow
def test_leaking_trainer_is_oom_killed_and_the_run_comes_back_as_a_trace(
    job_cgroup: MemoryCgroup, redis_url: str, key_prefix: str, tmp_path: Path
) -> None:
    node = "leaky-node"
    keys = Keys(key_prefix)
    client = redis.Redis.from_url(redis_url)
    source = CgroupSource(
        node, job_cgroup.path.parent, interval_s=0.25, include=(f"/{job_cgroup.name}",)
    )
    agent = NodeAgent([source], StreamPublisher(client), keys, interval_s=0.25)
    stop = threading.Event()
    watcher = threading.Thread(target=agent.run, args=(stop,), daemon=True)
    watcher.start()
    env = {
        **os.environ,
        "OOMCAST_REDIS_URL": redis_url,
        "OOMCAST_KEY_PREFIX": key_prefix,
        "OOMCAST_NODE": node,
        "OOMCAST_JOB": "leaky",
    }
    argv = ["--leak-after", "20", "--width", "1024", "--batch", "256", "--step-s", "0.03"]
    proc = subprocess.Popen(
        trainer_cmd(*argv),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        preexec_fn=lambda: job_cgroup.add_pid(os.getpid()),
    )
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
        # the agent reads the kill counter on a later tick and publishes the oom event
        wait_until(lambda: oom_events(client, keys), timeout_s=15)
        stop.set()
        watcher.join(15)
    log = out.decode(errors="replace")
    assert proc.returncode == -9, f"expected the kernel's SIGKILL, got {proc.returncode}:\n{log}"
    assert "hook mode host" in log  # no CUDA here: the hook reports the process's memory
    assert job_cgroup.oom_kills() >= 1

    # the OOM is in Redis, as the kernel decided it, on the job's cgroup
    ooms = oom_events(client, keys)
    assert [(e.node, e.device) for e in ooms] == [(node, f"cgroup:/{job_cgroup.name}")]
    # both the agent's cgroup samples and the hook's per-step samples reached the stream
    devices: set[str] = set()
    for _, fields in client.xrange(keys.samples_for(node)):
        devices |= {d.sample.device for d in decode_samples(fields) if not isinstance(d, Exception)}
    assert f"cgroup:/{job_cgroup.name}" in devices
    assert any(d.startswith("proc:") for d in devices), devices

    # dump the run as a trace, and score it like any other
    trace_path = tmp_path / "leaky.jsonl.gz"
    env_cli = {**env, "OOMCAST_KEY_PREFIX": key_prefix}
    dump = subprocess.run(
        oomcast_cmd("dump", "--node", node, "--out", str(trace_path)),
        env=env_cli,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dump.returncode == 0, dump.stderr
    assert "1 oom" in dump.stdout
    trace = load_trace(trace_path)
    cg_domain = (node, f"cgroup:/{job_cgroup.name}")
    oom_ts = trace.oom_ts(cg_domain)
    assert oom_ts is not None
    # the agent keeps watching the cgroup after the kill; what the forecast had is before it
    before = [s for s in trace.samples[cg_domain] if s.ts <= oom_ts]
    assert len(before) >= 10 and all(s.total_bytes == LIMIT for s in before)
    assert max(s.used_bytes for s in before) >= 0.8 * LIMIT  # it climbed to the wall
    ev = subprocess.run(
        oomcast_cmd("evaluate", "--traces", str(trace_path), "--json", "--min-lead", "1"),
        env=env_cli,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert ev.returncode == 0, ev.stderr
    result = json.loads(ev.stdout)
    assert result["detectors"]["model"]["oom_traces"] == 1
    assert result["detectors"]["model"]["ok_traces"] == 0
