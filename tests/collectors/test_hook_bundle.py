"""The hook writes a diagnosis bundle when a checkpoint is requested (an alert fired) and
when the job reports an OOM, and tells the service where it is."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import wait_until

from oomcast.collectors.diagnosis import analyse, read_file
from oomcast.collectors.hook import MemoryHook
from oomcast.collectors.hook_settings import HookSettings
from oomcast.model.jobcontrol import encode_jobctl, jobctl_key


@pytest.fixture
def make_hook(redis_url: str, key_prefix: str) -> Iterator[Callable[..., MemoryHook]]:
    made: list[MemoryHook] = []

    def make(job: str, **kwargs: Any) -> MemoryHook:
        hook = MemoryHook(
            job,
            redis_url=redis_url,
            key_prefix=key_prefix,
            node="n-bundle",
            mode="host",
            checkpoint_signal=None,
            publish_interval_s=0.02,
            control_poll_s=0.05,
            **kwargs,
        )
        made.append(hook)
        return hook

    yield make
    for hook in made:
        hook.close(timeout_s=0.5)


def events(client: redis.Redis, hook: MemoryHook) -> list[dict[str, Any]]:
    out = []
    for _id, fields in client.xrange(hook.keys.events):
        ev = json.loads(fields[b"event"]) if b"event" in fields else None
        if ev is not None and ev.get("node") == "n-bundle":
            out.append(ev)
    return out


def test_a_checkpoint_request_writes_a_bundle_and_says_where(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    hook = make_hook("job-b", bundle_dir=str(tmp_path))
    for _ in range(5):
        hook.step()
    rclient.xadd(jobctl_key(key_prefix, "job-b"), encode_jobctl(id="req-9", reason="risk 0.9"))
    assert wait_until(lambda: len(hook.bundles) == 1)
    path = hook.bundles[0]
    assert path.parent == tmp_path and path.name.startswith("oomcast-n-bundle-")
    snap, bundle = read_file(path)
    assert bundle is not None and bundle["job"] == "job-b"
    assert bundle["alert"] == {"why": "checkpoint requested: risk 0.9", "request_id": "req-9"}
    assert len(bundle["samples"]) == 5 and bundle["snapshot"] is None  # host mode: no CUDA
    assert bundle["allocator"]["capacity_bytes"] == bundle["samples"][-1]["total_bytes"]
    d = analyse(snap, bundle=bundle)
    assert d.context["node"] == "n-bundle" and any("no memory snapshot" in t for t in d.thin)
    assert hook.close()
    saved = [e for e in events(rclient, hook) if e["event"] == "diagnosis_saved"]
    assert [(e["path"], e["request_id"]) for e in saved] == [(str(path), "req-9")]


def test_a_reported_oom_writes_a_bundle(
    make_hook: Callable[..., MemoryHook], tmp_path: Path
) -> None:
    hook = make_hook("job-o", bundle_dir=str(tmp_path))
    hook.step()
    error = RuntimeError(
        "[enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: not enough memory:"
        " you tried to allocate 2147483648 bytes.\nException raised from ..."
    )
    hook.report_oom(error)
    assert wait_until(lambda: len(hook.bundles) == 1)
    bundle = read_file(hook.bundles[0])[1]
    assert bundle["alert"]["why"] == f"out of memory: RuntimeError: {str(error).splitlines()[0]}"  # type: ignore[index]
    # what `oomcast explain` reads back from it
    assert analyse(read_file(hook.bundles[0])[0], bundle=bundle).failing_request == 2 << 30


def test_bundles_can_be_turned_off_and_default_to_a_temporary_folder() -> None:
    assert HookSettings.from_env({"OOMCAST_BUNDLE_DIR": "off"}).bundle_dir is None
    assert HookSettings.from_env({"OOMCAST_BUNDLE_DIR": "/data/b"}).bundle_dir == "/data/b"
    assert HookSettings.from_env({}).bundle_dir.endswith("oomcast-bundles")  # type: ignore[union-attr]
    assert HookSettings.from_env({}, bundle_dir="/x").bundle_dir == "/x"


def test_no_bundle_when_off(make_hook: Callable[..., MemoryHook]) -> None:
    hook = make_hook("job-n", bundle_dir="off")
    hook.step()
    assert hook.bundle_soon("test") is None and hook.write_bundle("test") is None
