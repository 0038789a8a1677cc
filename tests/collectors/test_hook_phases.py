"""collectors/hook_phases.py: the hook's step, phase and schedule, against the real Redis
(host mode measures a real allocation; the CUDA path runs on test_hook's faked torch.cuda)."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from support import wait_until

from oomcast.collectors import hook_phases
from oomcast.collectors.hook import MemoryHook
from oomcast.model.events import ScheduleEvent
from oomcast.model.schema import Sample, SchemaError
from oomcast.model.wire import DecodedSample, decode_event, decode_samples
from tests.collectors.test_hook import GIB, FakeCuda, fake_cuda  # noqa: F401  (a fixture)

MIB = 1 << 20
NODE = "n-phases"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OOMCAST_HOOK", "OOMCAST_JOB", "OOMCAST_NODE", "OOMCAST_KEY_PREFIX"):
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def make_hook(redis_url: str, key_prefix: str) -> Iterator[Callable[..., MemoryHook]]:
    made: list[MemoryHook] = []

    def make(job: str = "job-p", **kwargs: Any) -> MemoryHook:
        kwargs.setdefault("checkpoint_signal", None)
        kwargs.setdefault("publish_interval_s", 0.02)
        kwargs.setdefault("peak_reset_s", 0.0)  # every sample's peak covers only its own span
        hook = MemoryHook(job, redis_url=redis_url, key_prefix=key_prefix, node=NODE, **kwargs)
        made.append(hook)
        return hook

    yield make
    for hook in made:
        hook.close(timeout_s=0.5)


def samples(client: redis.Redis, hook: MemoryHook) -> list[Sample]:
    out = []
    for _id, fields in client.xrange(hook.keys.samples_for(hook.node)):
        for decoded in decode_samples(fields):
            assert isinstance(decoded, DecodedSample), decoded
            out.append(decoded.sample)
    return out


def schedules(client: redis.Redis, hook: MemoryHook) -> list[ScheduleEvent]:
    out = []
    for _id, fields in client.xrange(hook.keys.events):
        event = decode_event(fields)  # as the service reads it
        if json.loads(fields[b"event"])["event"] == "schedule":
            assert isinstance(event, ScheduleEvent)
            out.append(event)
    return out


def test_samples_carry_the_step_counted_or_given(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    hook.step()
    hook.step()
    hook.step(40)
    hook.step()
    with pytest.raises(ValueError, match="step=-1"):
        hook.step(-1)
    assert hook.close()
    got = samples(rclient, hook)
    assert [s.step for s in got] == [1, 2, 40, 41]
    assert all(s.phase is None for s in got)
    assert schedules(rclient, hook) == []  # no schedule set: none sent


def test_set_schedule_publishes_it_with_a_sample_and_refuses_bad_values(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    with pytest.raises(SchemaError) as err:
        hook.set_schedule(eval_every_steps=0)
    assert err.value.field == "eval_every_steps"
    with pytest.raises(SchemaError) as err:
        hook.set_schedule(phase_extra_bytes={"training": 1})
    assert err.value.field == "phase_extra_bytes.training"
    hook.set_schedule(eval_every_steps=100, step_s=0.5, phase_extra_bytes={"eval": 5 * GIB})
    hook.set_schedule(checkpoint_every_steps=1000)  # adds to what was set
    assert hook.close()
    first, second = schedules(rclient, hook)
    assert (first.eval_every_steps, first.checkpoint_every_steps) == (100, None)
    assert (second.eval_every_steps, second.checkpoint_every_steps) == (100, 1000)
    assert second.step_s == 0.5 and dict(second.phase_extra_bytes) == {"eval": 5 * GIB}
    assert second.measured == () and second.domain == (NODE, hook.device)
    assert second.job == "job-p"
    assert [s.step for s in samples(rclient, hook)] == [0, 0]  # the level it starts from


def test_a_phases_first_occurrence_is_measured_from_a_real_allocation(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    hook.set_schedule(eval_every_steps=10, phase_extra_bytes={"eval": 8 * GIB})
    for _ in range(10):
        hook.step()
    with hook.phase("eval"):
        block = bytearray(b"\x01") * (200 * MIB)  # every page written: resident
        del block
    hook.step()
    hook.set_phase_extra_bytes({"eval": 9 * GIB, "checkpoint": GIB})  # eval is measured now
    assert hook.close()
    measured = schedules(rclient, hook)[1]
    assert measured.measured == ("eval",)
    assert 150 * MIB <= measured.phase_extra_bytes["eval"] <= 400 * MIB
    last = schedules(rclient, hook)[-1]
    assert last.phase_extra_bytes["eval"] == measured.phase_extra_bytes["eval"]
    assert last.phase_extra_bytes["checkpoint"] == GIB
    assert hook.measured_phases == {"eval"}
    phases = [(s.step, s.phase) for s in samples(rclient, hook)]
    assert phases[-3:] == [(10, None), (10, "eval"), (11, None)]


def test_the_cuda_peak_of_a_phase_is_measured_above_the_level_around_it(
    fake_cuda: FakeCuda,  # noqa: F811
    make_hook: Callable[..., MemoryHook],
    rclient: redis.Redis,
) -> None:
    hook = make_hook("gpu-job")
    assert hook.mode == "cuda"
    hook.step(99)
    hook.begin_phase("eval")  # used 50 GiB; the reservation peaks 6 GiB higher in the eval
    fake_cuda.stats["reserved_bytes.all.peak"] = 46 * GIB
    hook.end_phase()
    # a checkpoint Hugging Face reports only at its end: the level is the previous sample's
    fake_cuda.stats["reserved_bytes.all.peak"] = 43 * GIB
    hook.end_phase("checkpoint")
    # the optimizer's first step leaves its state behind: only the rest counts as extra
    hook.begin_phase("optimizer")
    fake_cuda.stats["reserved_bytes.all.peak"] = 48 * GIB
    fake_cuda.stats["reserved_bytes.all.current"] = 44 * GIB
    fake_cuda.free = 26 * GIB
    hook.end_phase("optimizer")
    assert hook.phase_extra_bytes == {"eval": 6 * GIB, "checkpoint": 3 * GIB, "optimizer": 4 * GIB}
    assert hook.flush(5.0)
    assert schedules(rclient, hook) == []  # no schedule yet: the figures wait for one
    hook.set_schedule(eval_every_steps=100)
    assert hook.close()
    [only] = schedules(rclient, hook)
    assert only.measured == ("eval", "checkpoint", "optimizer")
    assert dict(only.phase_extra_bytes) == hook.phase_extra_bytes
    assert [s.phase for s in samples(rclient, hook)] == [
        None, None, "eval", "checkpoint", None, "optimizer", None
    ]  # fmt: skip


def test_the_schedule_is_published_again_for_a_service_that_missed_it(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(hook_phases, "REPUBLISH_S", 0.0)
    hook = make_hook(mode="host")
    hook.set_schedule(eval_every_steps=5)
    hook.step()
    hook.step()
    assert wait_until(lambda: len(schedules(rclient, hook)) == 3)
    assert hook.close()


def test_a_hook_that_is_off_takes_a_schedule_and_sends_nothing(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(enabled=False)
    hook.set_schedule(eval_every_steps=5, phase_extra_bytes={"eval": 1})
    with hook.phase("eval"):
        hook.step()
    assert hook.schedule_event(ts=1.0).eval_every_steps == 5
    assert hook.close()
    assert rclient.xlen(hook.keys.events) == 0


def test_an_unknown_phase_is_refused(make_hook: Callable[..., MemoryHook]) -> None:
    hook = make_hook(mode="host")
    with pytest.raises(ValueError, match="phase='training'"):
        hook.begin_phase("training")


def test_on_cuda_a_phase_is_measured_from_the_allocators_allocated_peak(
    fake_cuda: FakeCuda,  # noqa: F811
    make_hook: Callable[..., MemoryHook],
    rclient: redis.Redis,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint served from the allocator's cached blocks does not raise the
    reservation (its used-terms measure was 0), but its allocated peak shows what it
    needs: 8 GiB above the 30 GiB allocated before it."""
    torch = pytest.importorskip("torch")
    stats = fake_cuda.stats
    stats["allocated_bytes.all.peak"] = stats["allocated_bytes.all.current"]

    def reset(device: int) -> None:  # torch resets both peaks
        stats["reserved_bytes.all.peak"] = stats["reserved_bytes.all.current"]
        stats["allocated_bytes.all.peak"] = stats["allocated_bytes.all.current"]

    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    hook = make_hook("gpu-job")
    hook.step(99)
    hook.begin_phase("checkpoint")  # 30 GiB allocated of 40 reserved
    stats["allocated_bytes.all.peak"] = 38 * GIB  # from the cached blocks: no new reservation
    hook.end_phase()
    # an eval with a sample inside it: the peak over the whole phase counts
    hook.begin_phase("eval")
    stats["allocated_bytes.all.peak"] = 36 * GIB
    hook.step(100)
    stats["allocated_bytes.all.peak"] = 33 * GIB
    hook.end_phase()
    assert hook.phase_extra_bytes == {"checkpoint": 8 * GIB, "eval": 6 * GIB}
    hook.set_schedule(checkpoint_every_steps=100)
    assert hook.close()
    [only] = schedules(rclient, hook)
    assert dict(only.phase_extra_bytes) == {"checkpoint": 8 * GIB, "eval": 6 * GIB}
    assert only.measured == ("eval", "checkpoint")
    got = samples(rclient, hook)
    assert all(s.allocated_bytes == 30 * GIB for s in got)  # the peak is not a sample field


def test_an_announced_absolute_peak_is_sent_until_its_phase_runs(
    make_hook: Callable[..., MemoryHook], rclient: redis.Redis
) -> None:
    hook = make_hook(mode="host")
    with pytest.raises(SchemaError) as err:
        hook.set_phase_extra_bytes({}, phase_peak_bytes={"forward": GIB})
    assert err.value.field == "phase_peak_bytes.forward"
    hook.set_schedule(step_s=1.0)
    hook.set_phase_extra_bytes({}, phase_peak_bytes={"optimizer": 90 * GIB})
    hook.set_phase_extra_bytes({"optimizer": 60 * GIB}, phase_peak_bytes={"eval": 70 * GIB})
    assert hook.phase_peak_bytes == {"optimizer": 90 * GIB, "eval": 70 * GIB}
    with hook.phase("optimizer"):
        pass
    assert hook.phase_peak_bytes == {"eval": 70 * GIB}  # spent: the step has run
    hook.set_phase_extra_bytes({}, phase_peak_bytes={"optimizer": 95 * GIB})  # too late
    assert hook.phase_peak_bytes == {"eval": 70 * GIB}
    assert hook.close()
    sent = schedules(rclient, hook)
    assert dict(sent[0].phase_peak_bytes) == {}
    assert dict(sent[1].phase_peak_bytes) == {"optimizer": 90 * GIB}
    assert dict(sent[2].phase_peak_bytes) == {"optimizer": 90 * GIB, "eval": 70 * GIB}
    assert dict(sent[-1].phase_peak_bytes) == {"eval": 70 * GIB}
