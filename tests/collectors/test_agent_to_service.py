"""The node agent with both real-node sources (NVML through the fake module, cgroups from a
fixture tree) publishing to the real Redis, and a real ``oomcast serve`` forecasting from it."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from support import free_port, start_serve, v2_files, wait_until, write_files

from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.nvml import Nvml
from oomcast.collectors.procinfo import ProcResolver
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.cgroup import CgroupSource
from oomcast.collectors.sources.nvml import NvmlSource
from oomcast.model.wire import Keys, decode_event
from tests.collectors.fake_nvml import GIB, MIB, FakeGpu, FakeNvml
from tests.collectors.test_procinfo import write_proc

UID = "7c1e0f7a-5b7e-4c59-9d1a-2f0c3a4b5c6d"
CGROUP_LIMIT = 2 * GIB


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_agent_publishes_both_sources_and_the_service_forecasts(
    tmp_path: Path, redis_url: str, key_prefix: str
) -> None:
    # one GPU with a leaking training process of a Kubernetes pod
    proc = tmp_path / "proc"
    write_proc(
        proc,
        4242,
        cgroup=f"0::/kubepods.slice/kubepods-pod{UID.replace('-', '_')}.slice/x\n",
        environ={"OOMCAST_PRIORITY": "10"},
    )
    gpu = FakeGpu(total=16 * GIB, used=6 * GIB, reserved=300 * MIB, processes=[(4242, 6 * GIB)])
    nvml_src = NvmlSource("node-a", nvml=Nvml(module=FakeNvml([gpu])), procinfo=ProcResolver(proc))
    # one container memory cgroup (v2) creeping toward its limit
    root = tmp_path / "cg"
    root.mkdir()
    (root / "cgroup.controllers").write_text("memory\n")
    job = write_files(root / "loader", v2_files(limit=CGROUP_LIMIT) | {"cgroup.procs": "77"})
    cg_src = CgroupSource("node-a", root)

    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url, "OOMCAST_KEY_PREFIX": key_prefix}
    port = free_port()
    server = start_serve(env, port)
    try:
        keys = Keys(key_prefix)
        t = [time.time() - 40]
        agent = NodeAgent(
            [nvml_src, cg_src],
            StreamPublisher(redis.Redis.from_url(redis_url)),
            keys,
            clock=lambda: t[0],
        )
        for i in range(40):
            gpu.used = 6 * GIB + i * 200 * MIB  # +200 MiB/s: full in about 45 s
            gpu.processes = [(4242, gpu.used)]
            (job / "memory.current").write_text(str(1 * GIB + i * 10 * MIB))
            agent.tick()
            t[0] += 1.0
        (job / "memory.events").write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 1\n")
        agent.tick()

        base = f"http://127.0.0.1:{port}"

        def both_live() -> bool:
            devices = httpx.get(f"{base}/v1/devices").json()["devices"]
            return {d["device"] for d in devices} >= {"gpu0", "cgroup:/loader"}

        assert wait_until(both_live, 20), httpx.get(f"{base}/v1/devices").text
        devices: list[dict[str, Any]] = httpx.get(f"{base}/v1/devices").json()["devices"]
        by_device = {d["device"]: d for d in devices}
        g = by_device["gpu0"]
        assert g["node"] == "node-a" and g["job"] == f"pod:{UID}"
        assert g["model_version"] and not g["model_version"].startswith("baseline/")
        assert all(0.0 <= p <= 1.0 for p in g["risk"].values())
        url = f"{base}/v1/devices/node-a/cgroup:/loader"
        # the 40 samples before the kill (the one read with the kill may count as after it)
        assert wait_until(lambda: len(httpx.get(url).json()["history"]) >= 40, 30)
        detail = httpx.get(url).json()
        assert detail["history"][-1]["total_bytes"] == CGROUP_LIMIT
        assert set(g["risk"]) == {"5", "15", "30", "45", "60", "120", "300"}
        # the cgroup's OOM kill reached the events stream
        [(_, fields)] = redis.Redis.from_url(redis_url).xrange(keys.events)
        event = decode_event(fields)
        assert (event.event, event.device, event.node) == ("oom", "cgroup:/loader", "node-a")
        # the per-process table the shedding action will use
        [p] = nvml_src.processes("gpu0")
        assert (p.pid, p.job, p.priority) == (4242, f"pod:{UID}", 10)
    finally:
        server.terminate()
        server.wait(15)
