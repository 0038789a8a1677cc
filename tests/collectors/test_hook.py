"""The in-process hook against the real Redis: samples, drops, OOM events, checkpoint
requests by signal and by control stream, and the CUDA path on a faked ``torch.cuda``."""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
from support import free_port, wait_until

from oomcast.bench.hook import bench_hook
from oomcast.collectors import hook as hook_mod
from oomcast.collectors.hook import (
    MemoryHook,
    encode_jobctl,
    format_gpu_uuid,
    jobctl_key,
    memory_limit_bytes,
    parse_jobctl,
    redact_url,
)
from oomcast.collectors.procinfo import SelfMemory
from oomcast.model.embedding import EMBEDDING_VERSION, FEATURES, N_FEATURES, EmbeddingState
from oomcast.model.schema import SchemaError
from oomcast.model.wire import DecodedSample, decode_event, decode_samples

GIB = 1 << 30
MIB = 1 << 20
NODE = "n-hook"
UUID = "5a3c5f0e-1b2c-4d3e-8f90-a1b2c3d4e5f6"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OOMCAST_HOOK", "OOMCAST_JOB", "OOMCAST_NODE", "OOMCAST_KEY_PREFIX"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_hook(redis_url: str, key_prefix: str) -> Iterator[Callable[..., MemoryHook]]:
    made: list[MemoryHook] = []

    def make(job: str = "job-1", **kwargs: Any) -> MemoryHook:
        kwargs.setdefault("redis_url", redis_url)
        kwargs.setdefault("checkpoint_signal", None)
        kwargs.setdefault("publish_interval_s", 0.02)
        kwargs.setdefault("control_poll_s", 0.05)
        hook = MemoryHook(job, key_prefix=key_prefix, node=NODE, **kwargs)
        made.append(hook)
        return hook

    yield make
    for hook in made:
        hook.close(timeout_s=0.5)


def read_samples(client: redis.Redis, hook: MemoryHook) -> list[DecodedSample]:
    out: list[DecodedSample] = []
    for _id, fields in client.xrange(hook.keys.samples_for(hook.node)):
        for decoded in decode_samples(fields):
            assert isinstance(decoded, DecodedSample), decoded
            out.append(decoded)
    return out


def read_events(client: redis.Redis, hook: MemoryHook) -> list[dict[str, Any]]:
    out = []
    for _id, fields in client.xrange(hook.keys.events):
        decode_event(fields)  # what the service does; it must accept the entry
        out.append(json.loads(fields[b"event"]))
    return out


# --- host mode and publishing ---


def test_samples_of_a_cpu_torch_loop_reach_the_stream_with_their_embedding(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    torch = pytest.importorskip("torch")
    hook = make_hook("loop")
    expected = "cuda" if torch.cuda.is_available() else "host"
    assert hook.mode == expected
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    steps = 25
    for _ in range(steps):
        loss = model(torch.randn(32, 64)).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        hook.step()
    assert hook.close()
    got = read_samples(rclient, hook)
    assert len(got) == steps
    assert hook.stats.samples == steps and hook.stats.dropped == 0
    state = EmbeddingState()
    for d in got:
        s = d.sample
        assert (s.node, s.job) == (NODE, "loop")
        if expected == "host":
            assert s.kind == "host" and s.device == f"proc:{os.getpid()}"
        assert 0 < s.used_bytes <= s.total_bytes
        assert s.peak_bytes is None or s.peak_bytes >= s.used_bytes
        assert d.emb_v == EMBEDDING_VERSION
        assert d.emb is not None and len(d.emb) == N_FEATURES
        # the embedding the node agent would have computed for the same samples
        assert d.emb == pytest.approx(state.embed(s), abs=1e-5)
    ts = [d.sample.ts for d in got]
    assert ts == sorted(ts) and len(set(ts)) == steps


def test_host_peak_sees_a_transient_allocation_and_is_reset(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host", peak_reset_s=0)  # reset at every sample
    hook.step()
    block = b"\x01" * (256 * MIB)  # touched, so resident
    del block
    hook.step()
    hook.step()
    assert hook.close()
    first, spiked, after = (d.sample for d in read_samples(rclient, hook))
    if first.peak_bytes is None:
        pytest.skip("the kernel does not let this process reset its peak RSS")
    assert spiked.peak_bytes is not None and after.peak_bytes is not None
    assert spiked.peak_bytes - spiked.used_bytes >= 200 * MIB
    assert after.peak_bytes - after.used_bytes < 64 * MIB  # the reset worked


def test_host_step_resets_the_peak_at_most_once_per_peak_reset_s(
    make_hook: Callable[..., MemoryHook], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each write to clear_refs takes the mmap write lock: at every step it would make step()
    # wait behind (and stall) other threads' page faults.
    hook = make_hook(mode="host")  # peak_reset_s: 1 s by default
    proc = hook._reader.memory  # type: ignore[union-attr]
    assert proc is not None
    if proc.clear_fd is None:
        pytest.skip("the kernel does not let this process reset its peak RSS")
    resets: list[int] = []
    real_write = os.write

    def write(fd: int, data: bytes) -> int:
        if fd == proc.clear_fd:
            resets.append(fd)
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    t0 = time.monotonic()
    for _ in range(100):
        hook.step()
        time.sleep(0.002)
    elapsed = time.monotonic() - t0
    monkeypatch.undo()
    assert hook.stats.samples == 100
    assert len(resets) <= 1 + int(elapsed)


def test_host_peak_between_resets_covers_the_samples_since_the_reset() -> None:
    now = [100.0]
    proc = SelfMemory(True, peak_reset_s=10.0, clock=lambda: now[0])
    try:
        if proc.clear_fd is None:
            pytest.skip("the kernel does not let this process reset its peak RSS")
        assert proc.resets == 1  # the one that checks the kernel allows it
        proc.read()
        block = b"\x01" * (256 * MIB)  # touched, so resident
        del block
        for _ in range(5):  # no reset yet: every sample since still carries the spike
            rss, peak = proc.read()
            assert peak is not None and peak - rss >= 200 * MIB
        assert proc.resets == 1
        now[0] += 10.0
        rss, peak = proc.read()  # reads the peak, then resets it: the spike is not lost
        assert peak is not None and peak - rss >= 200 * MIB
        assert proc.resets == 2
        rss, peak = proc.read()
        assert peak is not None and peak - rss < 64 * MIB
        assert proc.resets == 2
    finally:
        proc.close()


def test_peak_reset_s_must_not_be_negative(make_hook: Callable[..., MemoryHook]) -> None:
    with pytest.raises(ValueError, match="peak_reset_s"):
        make_hook(mode="host", peak_reset_s=-1.0)


def test_min_interval_subsamples_a_fast_loop(make_hook: Callable[..., MemoryHook]) -> None:
    hook = make_hook(mode="host", min_interval_s=60.0)
    for _ in range(50):
        hook.step()
    assert (hook.stats.steps, hook.stats.samples) == (50, 1)


def test_unreachable_redis_never_blocks_a_step(key_prefix: str) -> None:
    port = free_port()  # nothing listens there: every connection is refused
    hook = MemoryHook(
        "job-1",
        redis_url=f"redis://127.0.0.1:{port}/0",
        key_prefix=key_prefix,
        node=NODE,
        mode="host",
        checkpoint_signal=None,
        buffer_samples=20,
        publish_interval_s=0.01,
        redis_timeout_s=0.5,
    )
    try:
        durations = []
        for _ in range(300):
            t0 = time.perf_counter()
            hook.step()
            durations.append(time.perf_counter() - t0)
            time.sleep(0.0005)
        assert wait_until(lambda: hook.stats.publish_errors > 0 and hook.stats.publish_dropped > 0)
        assert hook.stats.samples == 300
        assert statistics.median(durations) < 0.002
    finally:
        t0 = time.monotonic()
        assert not hook.close(timeout_s=0.3)  # nothing could be delivered, and it says so
        assert time.monotonic() - t0 < 3.0


@pytest.fixture
def stalled_redis() -> Iterator[str]:
    """A port that accepts connections (the kernel's backlog) and never answers."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(64)
    yield f"redis://127.0.0.1:{sock.getsockname()[1]}/0"
    sock.close()


def test_a_stalled_redis_fills_the_queue_but_steps_stay_fast(
    stalled_redis: str, key_prefix: str
) -> None:
    hook = MemoryHook(
        "job-1",
        redis_url=stalled_redis,
        key_prefix=key_prefix,
        node=NODE,
        mode="host",
        checkpoint_signal=None,
        queue_size=8,
        publish_interval_s=0.01,
        redis_timeout_s=3.0,
    )
    try:
        hook.step()
        # once the thread has taken that sample it waits on Redis for 3 s
        # once the thread has taken that sample it waits on Redis for 3 s, the sample still
        # in the publisher's buffer
        pub = hook._outbox.publisher
        assert pub is not None
        assert wait_until(lambda: hook._outbox.queue.empty() and pub.buffered_samples > 0)
        worst = 0.0
        for _ in range(100):
            t0 = time.perf_counter()
            hook.step()
            worst = max(worst, time.perf_counter() - t0)
        assert worst < 1.0  # a step that waited on Redis would take 3 s
        assert hook.stats.queue_dropped >= 90  # 8 fit in the queue
        assert hook.stats.samples == 101
    finally:
        t0 = time.monotonic()
        assert not hook.close(timeout_s=0.2)
        assert time.monotonic() - t0 < 3.0


def test_a_full_queue_drops_the_oldest_and_counts(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host", queue_size=5, publish_interval_s=3600.0)  # the thread idles
    mark = 0.0
    for i in range(15):
        if i == 10:
            mark = time.time()
        hook.step()
    assert hook.stats.queue_dropped == 10
    assert hook.flush(5.0)
    got = read_samples(rclient, hook)
    assert len(got) == 5
    assert all(d.sample.ts >= mark for d in got)  # the newest five were kept


# --- OOM events ---


def _oom_errors() -> list[type[BaseException]]:
    errors: list[type[BaseException]] = [MemoryError]
    try:
        import torch

        errors.append(torch.OutOfMemoryError)
    except ImportError:
        pass
    return errors


@pytest.mark.parametrize("error", _oom_errors(), ids=lambda e: e.__name__)
def test_guard_publishes_an_oom_event_before_reraising(
    error: type[BaseException], make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    # The thread idles between rounds for an hour: only the guard's own flush can deliver.
    hook = make_hook("big-job", mode="host", publish_interval_s=3600.0)
    with pytest.raises(error, match="boom"), hook.guard():
        hook.step()
        raise error("boom")
    # no close() or flush(): the event must already be there
    events = read_events(rclient, hook)
    assert [e["event"] for e in events] == ["oom"]
    assert (events[0]["node"], events[0]["device"], events[0]["job"]) == (
        NODE,
        f"proc:{os.getpid()}",
        "big-job",
    )
    assert len(read_samples(rclient, hook)) == 1  # the samples before it went out too
    assert hook.stats.ooms == 1


def test_guard_lets_other_errors_through_without_an_event(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    with pytest.raises(ValueError), hook.guard():
        raise ValueError("not memory")
    assert hook.close()
    assert read_events(rclient, hook) == []


def test_oom_event_is_sent_directly_when_the_thread_is_gone(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    hook._outbox.stop_event.set()  # the background thread stops, as if wedged or killed
    hook._outbox.wake.set()
    assert hook._outbox.thread is not None
    hook._outbox.thread.join(5.0)
    with pytest.raises(MemoryError), hook.guard():
        raise MemoryError
    assert [e["event"] for e in read_events(rclient, hook)] == ["oom"]


# --- checkpoint requests ---


def test_sigusr1_requests_a_checkpoint_and_chains_the_previous_handler(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    chained: list[int] = []

    def previous(signum: int, frame: object) -> None:
        chained.append(signum)

    old = signal.signal(signal.SIGUSR1, previous)
    try:
        hook = make_hook(mode="host", checkpoint_signal=signal.SIGUSR1)
        calls: list[tuple[Any, threading.Thread]] = []
        hook.on_checkpoint_request(lambda req: calls.append((req, threading.current_thread())))
        assert not hook.checkpoint_requested
        os.kill(os.getpid(), signal.SIGUSR1)
        assert wait_until(lambda: hook.checkpoint_requested)
        req = hook.checkpoint_request
        assert req is not None and req.source == "signal" and "SIGUSR1" in (req.reason or "")
        assert len(calls) == 1 and calls[0][0] == req
        assert calls[0][1] is threading.main_thread()
        assert chained == [signal.SIGUSR1]
        hook.checkpoint_done("/ckpt/step-10")
        assert not hook.checkpoint_requested
        assert hook.close()
        assert signal.getsignal(signal.SIGUSR1) is previous  # restored
        events = read_events(rclient, hook)
        assert [e["event"] for e in events] == ["checkpoint_requested", "checkpoint_done"]
        assert events[0]["request_id"] == events[1]["request_id"] == req.id
        assert events[0]["source"] == "signal"
        assert events[1]["path"] == "/ckpt/step-10"
    finally:
        signal.signal(signal.SIGUSR1, old)


def test_a_hook_made_outside_the_main_thread_installs_no_handler(
    make_hook: Callable[..., MemoryHook],
) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    made: list[MemoryHook] = []
    t = threading.Thread(
        target=lambda: made.append(make_hook(mode="host", checkpoint_signal=signal.SIGUSR1))
    )
    t.start()
    t.join()
    assert made and made[0].mode == "host"
    assert signal.getsignal(signal.SIGUSR1) is before


def test_control_stream_command_requests_a_checkpoint(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis, key_prefix: str
) -> None:
    key = jobctl_key(key_prefix, "job-ctl")
    assert key == f"{key_prefix}:jobctl:{{job-ctl}}"
    stale_id = f"{int((time.time() - 60) * 1000)}-0"  # for an earlier run of the job
    rclient.xadd(key, encode_jobctl("checkpoint", id="stale"), id=stale_id)
    hook = make_hook("job-ctl", mode="host")
    calls: list[tuple[Any, threading.Thread]] = []
    hook.on_checkpoint_request(lambda req: calls.append((req, threading.current_thread())))
    rclient.xadd(key, {"cmd": "{not json"})
    rclient.xadd(key, encode_jobctl("shed", id="x"))
    rclient.xadd(key, encode_jobctl("checkpoint", id="req-1", reason="risk 0.9 within 60s"))
    assert wait_until(lambda: hook.checkpoint_requested and hook.stats.control_ignored == 2)
    assert [c[0].id for c in calls] == ["req-1"]
    req, thread = calls[0]
    assert (req.source, req.reason) == ("jobctl", "risk 0.9 within 60s")
    assert thread is not threading.main_thread()  # the hook's thread took it
    hook.checkpoint_done(ok=False)
    assert not hook.checkpoint_requested
    assert hook.close()
    events = read_events(rclient, hook)
    assert [(e["event"], e["request_id"]) for e in events] == [
        ("checkpoint_requested", "req-1"),
        ("checkpoint_failed", "req-1"),
    ]
    assert hook.stats.checkpoint_requests == 1


def test_checkpoint_done_answers_every_pending_request(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    first = hook.request_checkpoint("before eval")
    second = hook.request_checkpoint("risk")
    assert first is not None and second is not None
    assert hook.checkpoint_requested and hook.checkpoint_request == first
    hook.checkpoint_done("/ckpt/a")
    assert not hook.checkpoint_requested and hook.checkpoint_request is None
    assert hook.close()
    done = [e for e in read_events(rclient, hook) if e["event"] == "checkpoint_done"]
    assert len(done) == 1
    assert done[0]["request_id"] == first.id
    assert done[0]["request_ids"] == [first.id, second.id]
    assert done[0]["path"] == "/ckpt/a"


# --- off ---


@pytest.mark.parametrize("how", ["argument", "environment"])
def test_off_mode_is_a_no_op(
    how: str,
    monkeypatch: pytest.MonkeyPatch,
    redis_url: str,
    key_prefix: str,
    rclient: redis.Redis,
) -> None:
    if how == "environment":
        monkeypatch.setenv("OOMCAST_HOOK", "off")
    before = signal.getsignal(signal.SIGUSR1)
    hook = MemoryHook(
        "job-1", redis_url=redis_url, key_prefix=key_prefix, enabled=how != "argument"
    )
    assert hook.mode == "off"
    assert signal.getsignal(signal.SIGUSR1) is before
    for _ in range(10):
        hook.step()
    assert hook.stats.steps == 0 and hook.stats.samples == 0
    assert hook.request_checkpoint("x") is None and not hook.checkpoint_requested
    hook.checkpoint_done("/ckpt")
    with pytest.raises(MemoryError), hook.guard():
        raise MemoryError
    assert hook.flush(0.1)
    assert hook.close()
    assert list(rclient.scan_iter(match=f"{key_prefix}:*")) == []


# --- the CUDA path, on a faked torch.cuda ---


class FakeUuid:
    def __init__(self, text: str) -> None:
        self.text = text

    def __str__(self) -> str:
        return self.text


class FakeCuda:
    def __init__(self) -> None:
        self.total = 80 * GIB
        self.free = 30 * GIB
        self.stats: dict[str, int] = {
            "allocated_bytes.all.current": 30 * GIB,
            "reserved_bytes.all.current": 40 * GIB,
            "reserved_bytes.all.peak": 50 * GIB,
            "num_alloc_retries": 3,
            "num_ooms": 0,
        }
        self.devices_asked: list[int] = []
        self.resets = 0
        self.observers: list[Callable[..., None]] = []
        self.props: Any = SimpleNamespace(uuid=FakeUuid(UUID))
        self.fraction = 1.0  # torch.cuda.set_per_process_memory_fraction's, 1.0 when unset

    def get_per_process_memory_fraction(self, device: int) -> float:
        return self.fraction

    def memory_stats(self, device: int) -> dict[str, int]:
        self.devices_asked.append(device)
        return dict(self.stats)

    def reset_peak_memory_stats(self, device: int) -> None:
        self.resets += 1
        self.stats["reserved_bytes.all.peak"] = self.stats["reserved_bytes.all.current"]

    def mem_get_info(self, device: int) -> tuple[int, int]:
        return self.free, self.total

    def oom(self, device: int = 0) -> None:
        for observer in self.observers:
            observer(device, 2 * GIB, 78 * GIB, 0)


@pytest.fixture
def fake_cuda(monkeypatch: pytest.MonkeyPatch) -> FakeCuda:
    torch = pytest.importorskip("torch")
    fake = FakeCuda()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: fake.props)
    monkeypatch.setattr(torch.cuda, "memory_stats", fake.memory_stats)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    monkeypatch.setattr(torch.cuda, "mem_get_info", fake.mem_get_info)
    monkeypatch.setattr(
        torch.cuda, "get_per_process_memory_fraction", fake.get_per_process_memory_fraction
    )
    monkeypatch.setattr(
        torch._C, "_cuda_attach_out_of_memory_observer", fake.observers.append, raising=False
    )
    return fake


def test_cuda_sample_fields_and_uuid_device(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook("gpu-job")
    assert hook.mode == "cuda"
    assert hook.device == f"GPU-{UUID}"
    assert len(fake_cuda.observers) == 1
    hook.step()  # the step's reservation peaked 10 GiB above where it ends
    fake_cuda.stats["num_alloc_retries"] = 5
    fake_cuda.free = 20 * GIB
    hook.step()  # no peak above the current reservation since the reset
    assert hook.close()
    first, second = (d.sample for d in read_samples(rclient, hook))
    assert (first.kind, first.device, first.job) == ("gpu", f"GPU-{UUID}", "gpu-job")
    assert first.total_bytes == 80 * GIB
    assert first.used_bytes == 50 * GIB  # total - free: the whole device's use
    assert (first.allocated_bytes, first.reserved_bytes) == (30 * GIB, 40 * GIB)
    assert first.peak_bytes == 60 * GIB  # used + (peak reserved - reserved)
    assert first.alloc_retries == 3
    assert (second.used_bytes, second.peak_bytes, second.alloc_retries) == (60 * GIB, 60 * GIB, 5)
    assert fake_cuda.resets == 2
    assert set(fake_cuda.devices_asked) == {0}


def test_a_memory_fraction_cap_is_the_samples_capacity(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    # set_per_process_memory_fraction(0.5) on 80 GiB: the allocator stops at 40 GiB reserved
    hook = make_hook("gpu-job")
    fake_cuda.fraction = 0.5
    fake_cuda.stats["reserved_bytes.all.current"] = 30 * GIB
    fake_cuda.stats["reserved_bytes.all.peak"] = 36 * GIB
    hook.step()  # the device has 30 GiB free: more than the cap leaves (10 GiB)
    fake_cuda.free = 4 * GIB  # a neighbour filled the device: now less room than the cap's
    hook.step()
    fake_cuda.fraction = 1.0  # the cap lifted: the whole device again
    hook.step()
    assert hook.close()
    capped, crowded, whole = (d.sample for d in read_samples(rclient, hook))
    assert (capped.total_bytes, capped.used_bytes) == (40 * GIB, 30 * GIB)
    assert capped.peak_bytes == 36 * GIB  # used + how far the reservation rose above it
    assert (crowded.total_bytes, crowded.used_bytes) == (40 * GIB, 36 * GIB)  # 4 GiB left
    assert crowded.peak_bytes == 36 * GIB  # the reservation did not rise since the last read
    assert (whole.total_bytes, whole.used_bytes) == (80 * GIB, 76 * GIB)


def test_a_fraction_torch_cannot_read_is_no_cap(
    fake_cuda: FakeCuda,
    make_hook: Callable[..., MemoryHook],
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import torch

    def broken(device: int) -> float:
        raise RuntimeError("no such device")

    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", broken)
    hook = make_hook("gpu-job")
    hook.step()
    assert hook.close()
    (sample,) = (d.sample for d in read_samples(rclient, hook))
    assert (sample.total_bytes, sample.used_bytes) == (80 * GIB, 50 * GIB)


def test_track_peak_off_leaves_the_peaks_alone(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    gpu = make_hook("gpu-job", track_peak=False)
    host = make_hook("host-job", mode="host", track_peak=False)
    gpu.step()
    host.step()
    assert gpu.close() and host.close()
    assert fake_cuda.resets == 0  # max_memory_* stay the user's
    samples = {d.sample.job: d.sample for d in read_samples(rclient, gpu)}
    assert samples["gpu-job"].peak_bytes is None and samples["host-job"].peak_bytes is None
    assert samples["host-job"].used_bytes > 0


def test_cuda_device_without_uuid_is_cudaN_never_gpuN(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook]
) -> None:
    fake_cuda.props = SimpleNamespace(name="old driver")
    assert make_hook().device == "cuda0"
    fake_cuda.props = SimpleNamespace(uuid=FakeUuid("00000000-0000-0000-0000-000000000000"))
    assert make_hook().device == "cuda0"


def test_cuda_ooms_become_one_event_each(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    import torch

    hook = make_hook("gpu-job")
    hook.step()
    fake_cuda.stats["num_ooms"] = 1  # an OOM the loop caught and survived
    hook.step()
    hook.step()
    fake_cuda.oom()  # the observer and the counter see the same OOM
    fake_cuda.stats["num_ooms"] = 2
    hook.step()
    fake_cuda.oom(device=1)  # another GPU's OOM is not this domain's
    hook.step()
    fake_cuda.oom()  # then a fatal one: observer first, then the exception
    fake_cuda.stats["num_ooms"] = 3
    with pytest.raises(torch.OutOfMemoryError), hook.guard():
        raise torch.OutOfMemoryError("CUDA out of memory")
    with pytest.raises(MemoryError), hook.guard():  # host memory is not the GPU's domain
        raise MemoryError
    assert hook.close()
    ooms = [e for e in read_events(rclient, hook) if e["event"] == "oom"]
    assert [e["source"] for e in ooms] == ["num_ooms", "observer", "observer"]
    assert all(e["device"] == f"GPU-{UUID}" and e["job"] == "gpu-job" for e in ooms)
    assert hook.stats.ooms == 3
    # after an OOM the domain's history starts afresh, as the node agent does it; the sample
    # of the step that OOMed is the first after it
    age = [
        d.emb[FEATURES.index("log1p_age_s")]
        for d in read_samples(rclient, hook)
        if d.emb is not None
    ]
    assert age[1] == 0.0 and age[2] > 0.0
    assert ooms[0]["ts"] < read_samples(rclient, hook)[1].sample.ts


def test_the_oom_event_is_queued_before_the_sample_after_it(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook("gpu-job", publish_interval_s=3600.0)  # the thread idles
    queued_after: list[list[str]] = []  # the events already queued when each sample is

    class Recording(queue.Queue):  # type: ignore[type-arg]
        def put_nowait(self, item: Any) -> None:
            queued_after.append([e.event.event for e in hook._outbox.events])
            super().put_nowait(item)

    hook._outbox.queue = Recording(maxsize=16)
    hook.step()
    fake_cuda.stats["num_ooms"] = 1  # an OOM the loop caught and survived
    hook.step()
    assert queued_after == [[], ["oom"]]
    assert hook.close()
    assert [e["event"] for e in read_events(rclient, hook)] == ["oom"]
    age = [
        d.emb[FEATURES.index("log1p_age_s")]
        for d in read_samples(rclient, hook)
        if d.emb is not None
    ]
    assert age[1] == 0.0  # embedded after the OOM reset the domain's history


def test_steps_during_a_publishing_round_leave_in_the_order_they_were_taken(
    fake_cuda: FakeCuda, make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    # The thread has emptied the sample queue and not yet the events when the loop takes a
    # sample, then OOMs and takes the next: the OOM event must not leave before the sample
    # taken ahead of it (which would then be embedded as if after the OOM).
    hook = make_hook("gpu-job", publish_interval_s=3600.0)  # the thread idles; we drive it
    injected: list[bool] = []

    class Racing(queue.Queue):  # type: ignore[type-arg]
        def get_nowait(self) -> Any:
            try:
                return super().get_nowait()
            except queue.Empty:
                if not injected:
                    injected.append(True)
                    hook.step()  # the sample before the OOM
                    fake_cuda.stats["num_ooms"] = 1
                    hook.step()  # the OOM, then the sample after it
                raise

    hook._outbox.queue = Racing(maxsize=16)
    hook.step()
    hook._outbox.publish_pending(force=True)
    assert injected
    assert hook.close()
    samples = read_samples(rclient, hook)
    assert len(samples) == 3
    age = [d.emb[FEATURES.index("log1p_age_s")] for d in samples if d.emb is not None]
    assert age[1] > 0.0  # the sample before the OOM continues the history
    assert age[2] == 0.0  # the one after it starts it afresh
    assert [e["event"] for e in read_events(rclient, hook)] == ["oom"]


def test_mode_cuda_without_cuda_refuses(redis_url: str, key_prefix: str) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(RuntimeError, match="cuda"):
        MemoryHook("j", redis_url=redis_url, key_prefix=key_prefix, mode="cuda")


# --- helpers ---


def test_format_gpu_uuid() -> None:
    assert format_gpu_uuid(UUID) == f"GPU-{UUID}"
    assert format_gpu_uuid(UUID.upper()) == f"GPU-{UUID}"
    assert format_gpu_uuid(bytes.fromhex(UUID.replace("-", ""))) == f"GPU-{UUID}"
    assert format_gpu_uuid(f"MIG-{UUID}") == f"MIG-{UUID}"
    assert format_gpu_uuid("not-a-uuid") is None
    assert format_gpu_uuid("0" * 32) is None


def test_redact_url_hides_the_password() -> None:
    assert redact_url("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://user:s3cret@h/1") == "redis://user:***@h/1"
    assert redact_url("redis://h:6379/0") == "redis://h:6379/0"


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


@pytest.mark.parametrize(
    ("proc", "files", "expected"),
    [
        # v1, the cgroup visible under the mount, its parent unlimited
        (
            "4:memory:/kube/pod1\n",
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/kube/pod1/memory.limit_in_bytes": str(2 * GIB),
            },
            2 * GIB,
        ),
        # v1 in a container: the host's path is not under the mount, the mount is ours
        ("4:memory:/docker/abc\n", {"memory/memory.limit_in_bytes": str(GIB)}, GIB),
        # v2: the tightest limit on the way up
        (
            "0::/kubepods/pod1/c1\n",
            {"kubepods/pod1/c1/memory.max": "max", "kubepods/pod1/memory.max": str(3 * GIB)},
            3 * GIB,
        ),
        # no limit anywhere: MemTotal
        ("0::/user.slice\n", {"user.slice/memory.max": "max"}, 16 * GIB),
        # a limit above the machine's memory is no limit
        ("0::/big\n", {"big/memory.max": str(64 * GIB)}, 16 * GIB),
    ],
)
def test_memory_limit_bytes(
    tmp_path: Path, proc: str, files: dict[str, str], expected: int
) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    for rel, text in files.items():
        _write(root / rel, text)
    _write(tmp_path / "cgroup.proc", proc)
    _write(tmp_path / "meminfo", f"MemTotal:       {16 * GIB // 1024} kB\nMemFree: 1 kB\n")
    got = memory_limit_bytes(
        proc_cgroup=tmp_path / "cgroup.proc", cgroup_root=root, meminfo=tmp_path / "meminfo"
    )
    assert got == expected


def test_parse_jobctl() -> None:
    cmd = parse_jobctl({b"cmd": b'{"action":"checkpoint","id":7,"reason":"risk"}'})
    assert (cmd.action, cmd.id, cmd.reason) == ("checkpoint", "7", "risk")
    assert parse_jobctl(encode_jobctl("checkpoint", id="a")).id == "a"
    assert parse_jobctl({"cmd": '{"action":"checkpoint"}'}).id  # an id is made up if missing
    for bad, field in [
        ({}, "cmd"),
        ({"cmd": "{"}, "cmd"),
        ({"cmd": "[1]"}, "cmd"),
        ({"cmd": '{"id":"x"}'}, "cmd.action"),
        ({"cmd": '{"action":"checkpoint","id":[]}'}, "cmd.id"),
        ({"cmd": '{"action":"checkpoint","reason":3}'}, "cmd.reason"),
        ({b"cmd": b"\xff"}, "cmd"),
    ]:
        with pytest.raises(SchemaError) as info:
            parse_jobctl(bad)
        assert info.value.field == field


def test_install_returns_the_one_hook_until_closed(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, key_prefix: str
) -> None:
    monkeypatch.setattr(hook_mod, "_installed", None)
    kwargs: dict[str, Any] = {
        "redis_url": redis_url,
        "key_prefix": key_prefix,
        "mode": "host",
        "checkpoint_signal": None,
    }
    first = hook_mod.install("j", **kwargs)
    try:
        assert hook_mod.install("j", **kwargs) is first
    finally:
        first.close()
    second = hook_mod.install("j", **kwargs)
    try:
        assert second is not first
    finally:
        second.close()


def _in_a_forked_child(work: Callable[[], dict[str, Any]], timeout_s: float = 30.0) -> Any:
    """``work()`` in a forked child; what it returns, through a pipe."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never back into pytest
        code = 1
        try:
            os.close(r)
            os.write(w, json.dumps(work()).encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    reaped: list[int] = []

    def exited() -> bool:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            reaped.append(status)
        return bool(done)

    if not wait_until(exited, timeout_s=timeout_s, interval_s=0.01):
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    status = reaped[0]
    with os.fdopen(r, "rb") as f:
        data = f.read()
    assert os.waitstatus_to_exitcode(status) == 0
    return json.loads(data)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_install_in_a_forked_child_makes_the_childs_own_hook(
    monkeypatch: pytest.MonkeyPatch, redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    monkeypatch.setattr(hook_mod, "_installed", None)
    kwargs: dict[str, Any] = {
        "redis_url": redis_url,
        "key_prefix": key_prefix,
        "node": NODE,
        "mode": "host",
        "checkpoint_signal": None,
        "publish_interval_s": 3600.0,  # the parent's thread idles across the fork
    }
    parent = hook_mod.install("j", **kwargs)

    def child() -> dict[str, Any]:
        mine = hook_mod.install("j", **kwargs)
        try:
            mine.step()
            return {
                "parent_forked": parent._forked,
                "is_parent": mine is parent,
                "again": hook_mod.install("j", **kwargs) is mine,
                "device": mine.device,
                "off": mine._off,
                "pid": os.getpid(),
                "delivered": mine.close(5.0),
            }
        finally:
            mine.close(0.5)

    try:
        got = _in_a_forked_child(child)
        assert hook_mod.install("j", **kwargs) is parent  # the parent keeps its own
    finally:
        parent.close()
    assert got["parent_forked"] and not got["is_parent"] and got["again"]
    assert not got["off"] and got["delivered"]
    assert got["pid"] != os.getpid()
    assert got["device"] == f"proc:{got['pid']}"
    assert parent.device == f"proc:{os.getpid()}"
    assert [d.sample.device for d in read_samples(rclient, parent)] == [got["device"]]


def test_bench_hook_runs_and_cleans_up(
    redis_url: str, key_prefix: str, rclient: redis.Redis
) -> None:
    out = bench_hook(300, redis_url, key_prefix=key_prefix)
    for key in ("us_per_step_p50", "us_per_step_mean", "us_per_step_p99"):
        assert out[key] > 0 and out[f"{key}_no_publish"] > 0
    assert out["records_published"] > 0
    assert list(rclient.scan_iter(match=f"{key_prefix}:*")) == []


def test_a_cuda_bundle_holds_the_snapshot_and_the_allocator_figures(
    fake_cuda: FakeCuda,
    make_hook: Callable[..., MemoryHook],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """On CUDA the bundle carries torch.cuda.memory._snapshot() (here a simulated cache in
    torch's format: 60% of it free in 8 MiB pieces) and `oomcast explain` reads it out."""
    from oomcast.collectors.diagnosis import EXPANDABLE, analyse, read_file
    from oomcast.training.allocator import CachingAllocatorSim

    torch = pytest.importorskip("torch")
    sim = CachingAllocatorSim(400 * MIB)
    handles = [sim.malloc(8 * MIB) for _ in range(40)]
    for h in handles[::2]:
        sim.free(h)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda device=None: sim.memory_snapshot())
    fake_cuda.props.total_memory = 400 * MIB
    hook = make_hook("gpu-job", bundle_dir=str(tmp_path))
    hook.step()
    path = hook.write_bundle("test")
    assert path is not None
    snap, bundle = read_file(path)
    assert bundle is not None and bundle["allocator"]["num_alloc_retries"] == 3
    assert bundle["allocator"]["capacity_bytes"] == 400 * MIB
    d = analyse(snap, bundle=bundle, failing_request=16 * MIB)
    assert d.fragmentation == pytest.approx(0.6) and d.fits_largest_free is False
    assert any(EXPANDABLE in r for r in d.remedies)


def test_a_cuda_bundle_names_the_allocation_sites_that_grew(
    fake_cuda: FakeCuda,
    make_hook: Callable[..., MemoryHook],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    """The hook keeps each site's live bytes as a baseline; the bundle at alert time says
    which sites grew since: a leak's suspects, what `oomcast explain` prints first."""
    from oomcast.collectors.diagnosis import analyse, explain_text, read_file
    from oomcast.training.allocator import CachingAllocatorSim

    torch = pytest.importorskip("torch")
    sim = CachingAllocatorSim(400 * MIB)
    site: dict[int, int] = {}

    def alloc(n: int, line: int) -> None:
        for _ in range(n):
            site[sim.malloc(4 * MIB)] = line

    def frames(h: int) -> list[dict[str, Any]]:
        return [{"filename": "train.py", "line": site[h], "name": "step"}]

    monkeypatch.setattr(
        torch.cuda.memory, "_snapshot", lambda device=None: sim.memory_snapshot(frames)
    )
    fake_cuda.props.total_memory = 400 * MIB
    alloc(5, 10)  # the model: 20 MiB at train.py:10
    hook = make_hook("gpu-job", bundle_dir=str(tmp_path))
    hook.step()  # the first sample takes the baseline, from a thread of its own
    assert wait_until(lambda: hook._baseline is not None)
    alloc(10, 42)  # then train.py:42 keeps 40 MiB more, train.py:10 1 block more
    alloc(1, 10)
    path = hook.write_bundle("test")
    assert path is not None
    snap, bundle = read_file(path)
    assert bundle is not None
    assert [(g["where"], g["grew_bytes"]) for g in bundle["growing_sites"]] == [
        ("train.py:42 in step", 40 * MIB),
        ("train.py:10 in step", 4 * MIB),
    ]
    d = analyse(snap, bundle=bundle)
    assert any(r.startswith("leak suspects") and "train.py:42" in r for r in d.remedies)
    assert "grew most over the last" in explain_text(d)
