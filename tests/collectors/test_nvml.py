"""collectors/nvml.py (the NVML wrapper) and collectors/sources/nvml.py (the GPU source),
against a fake NVML; one test at the end uses the real driver where there is one."""

from __future__ import annotations

import dataclasses
import sys
import time
from pathlib import Path

import pytest
import redis

from oomcast.collectors.agent import NodeAgent
from oomcast.collectors.nvml import MemoryInfo, Nvml, NvmlUnavailable, ProcessMemory
from oomcast.collectors.procinfo import ProcResolver
from oomcast.collectors.publisher import StreamPublisher
from oomcast.collectors.sources.nvml import GPU_LOST_EVENT, GpuProcess, NvmlSource, main_job
from oomcast.model.processes import ProcessUse
from oomcast.model.schema import Event, Sample, SchemaError, parse_record
from oomcast.model.wire import Keys, decode_event, decode_samples
from tests.collectors import fake_nvml
from tests.collectors.fake_nvml import GIB, MIB, FakeGpu, FakeNvml
from tests.collectors.test_procinfo import CID, UID, UID_, write_proc

T0 = 1_750_000_000.0


class Ticker:
    """A perf_counter stand-in that advances ``step`` seconds at each reading."""

    def __init__(self, step: float = 0.25) -> None:
        self.t = 0.0
        self.step = step

    def __call__(self) -> float:
        self.t += self.step
        return self.t


def two_gpus() -> FakeNvml:
    return FakeNvml(
        [
            FakeGpu(total=80 * GIB, used=30 * GIB, reserved=500 * MIB),
            FakeGpu(total=40 * GIB, used=1 * GIB, reserved=300 * MIB),
        ]
    )


# -- the wrapper: initialisation -------------------------------------------------------------


def test_init_is_lazy_and_happens_once() -> None:
    fake = two_gpus()
    nvml = Nvml(fake)
    assert not nvml.initialized
    assert fake.calls["nvmlInit"] == 0
    assert nvml.device_count() == 2
    handle = nvml.handle(1)
    assert nvml.memory_info(handle) is not None
    assert nvml.compute_processes(handle) == []
    nvml.init()
    assert fake.calls["nvmlInit"] == 1
    assert nvml.initialized and fake.refcount == 1


def test_close_shuts_down_and_the_next_query_initialises_again() -> None:
    fake = two_gpus()
    nvml = Nvml(fake)
    nvml.close()  # never initialised: nothing to shut down
    assert fake.calls["nvmlShutdown"] == 0
    with nvml:
        assert fake.refcount == 1
    assert fake.calls["nvmlShutdown"] == 1 and fake.refcount == 0
    assert not nvml.initialized
    assert nvml.device_count() == 2
    assert fake.calls["nvmlInit"] == 2


def test_missing_binding_is_fatal_with_an_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # makes `import pynvml` fail
    nvml = Nvml()
    with pytest.raises(NvmlUnavailable) as info:
        nvml.device_count()
    msg = str(info.value)
    assert "pynvml" in msg and "oomcast[collector]" in msg and "nvidia-ml-py" in msg
    assert info.value.hint in msg


@pytest.mark.parametrize(
    ("error", "phrases"),
    [
        (fake_nvml.NVMLError_LibraryNotFound, ["libnvidia-ml.so.1", "Container Toolkit"]),
        (fake_nvml.NVMLError_DriverNotLoaded, ["kernel driver is not loaded", "nvidia-smi"]),
        (fake_nvml.NVMLError_NoPermission, ["/dev/nvidia", "refused"]),
        (fake_nvml.NVMLError_LibRmVersionMismatch, ["does not match the kernel driver"]),
        (fake_nvml.NVMLError_Unknown, ["nvidia-smi"]),
    ],
)
def test_init_failures_are_fatal_with_a_hint(
    error: type[fake_nvml.NVMLError], phrases: list[str]
) -> None:
    fake = two_gpus()
    fake.init_error = error
    nvml = Nvml(fake)
    with pytest.raises(NvmlUnavailable) as info:
        nvml.init()
    msg = str(info.value)
    assert error.__name__.removeprefix("NVMLError_") in msg
    for phrase in phrases:
        assert phrase in msg
    # a query does not hide it behind a None either
    with pytest.raises(NvmlUnavailable):
        nvml.device_count()
    assert not nvml.initialized
    assert nvml.stats.calls_by_function["nvmlInit"] == 2
    fake.init_error = None  # fixed (driver loaded): the next call succeeds
    assert nvml.device_count() == 2


# -- the wrapper: queries --------------------------------------------------------------------


def test_memory_info_v2_separates_the_drivers_reserve() -> None:
    nvml = Nvml(two_gpus())
    mem = nvml.memory_info(nvml.handle(0))
    free = 80 * GIB - 500 * MIB - 30 * GIB
    assert mem == MemoryInfo(
        total=80 * GIB, free=free, used=30 * GIB, reserved=500 * MIB, version=2
    )
    assert mem.usable == 80 * GIB - 500 * MIB
    assert nvml.stats.errors == 0


@pytest.mark.parametrize(
    ("mode", "counted"),
    [("not_supported", 1), ("function_not_found", 1), ("no_version_kwarg", 0)],
)
def test_memory_info_falls_back_to_v1_once(mode: str, counted: int) -> None:
    fake = FakeNvml([FakeGpu(total=16 * GIB, used=4 * GIB, reserved=200 * MIB)], memory_v2=mode)
    nvml = Nvml(fake)
    handle = nvml.handle(0)
    mem = nvml.memory_info(handle)
    assert mem is not None
    assert mem.version == 1 and mem.reserved is None
    assert mem.total == mem.usable == 16 * GIB
    assert mem.used == 4 * GIB + 200 * MIB  # v1 counts the reserve as used
    assert nvml.stats.errors == counted
    calls = fake.calls["nvmlDeviceGetMemoryInfo"]
    assert nvml.memory_info(handle) == mem
    assert fake.calls["nvmlDeviceGetMemoryInfo"] == calls + 1  # v2 is not tried again
    assert nvml.stats.errors == counted


@pytest.mark.parametrize(
    "error",
    [
        fake_nvml.NVMLError_NotSupported,
        fake_nvml.NVMLError_NoPermission,
        fake_nvml.NVMLError_GpuIsLost,
        fake_nvml.NVMLError_Unknown,
        fake_nvml.NVMLError_InvalidArgument,
    ],
)
def test_per_field_failures_become_none_and_are_counted(error: type[fake_nvml.NVMLError]) -> None:
    fake = two_gpus()
    fake.fail("nvmlDeviceGetUUID", error, device=1)
    fake.fail("nvmlDeviceGetComputeRunningProcesses", error, device=1)
    nvml = Nvml(fake)
    h0, h1 = nvml.handle(0), nvml.handle(1)
    assert nvml.uuid(h0) == fake.gpus[0].uuid
    assert nvml.uuid(h1) is None
    assert nvml.compute_processes(h0) == []
    assert nvml.compute_processes(h1) is None
    name = error.__name__.removeprefix("NVMLError_")
    assert nvml.stats.errors == 2
    assert nvml.stats.errors_by_function == {
        "nvmlDeviceGetUUID": 1,
        "nvmlDeviceGetComputeRunningProcesses": 1,
    }
    assert nvml.stats.errors_by_error == {name: 2}
    assert nvml.last_error is not None
    assert nvml.last_error.function == "nvmlDeviceGetComputeRunningProcesses"
    assert nvml.last_error.code == error.CODE
    assert nvml.failed_with(name)


def test_memory_failure_after_v2_is_not_mistaken_for_a_missing_v2() -> None:
    fake = two_gpus()
    nvml = Nvml(fake)
    h = nvml.handle(0)
    fake.fail("nvmlDeviceGetMemoryInfo", fake_nvml.NVMLError_GpuIsLost, device=0)
    assert nvml.memory_info(h) is None
    assert nvml.failed_with("GpuIsLost")
    fake.heal()
    mem = nvml.memory_info(h)
    assert mem is not None and mem.version == 2


def test_processes_keep_unknown_memory_as_none() -> None:
    fake = FakeNvml([FakeGpu(processes=[(100, 3 * GIB), (200, None)])])
    nvml = Nvml(fake)
    assert nvml.compute_processes(nvml.handle(0)) == [
        ProcessMemory(100, 3 * GIB),
        ProcessMemory(200, None),
    ]


def test_processes_fall_back_to_the_v2_query_on_an_older_driver() -> None:
    fake = FakeNvml([FakeGpu(processes=[(100, GIB)])], processes_v3=False)
    nvml = Nvml(fake)
    h = nvml.handle(0)
    assert nvml.compute_processes(h) == [ProcessMemory(100, GIB)]
    assert nvml.compute_processes(h) == [ProcessMemory(100, GIB)]
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses"] == 1
    assert fake.calls["nvmlDeviceGetComputeRunningProcesses_v2"] == 2
    assert nvml.stats.errors_by_error == {"NVMLLibraryMismatchError": 1}


def test_nvml_shut_down_under_us_is_reinitialised() -> None:
    fake = two_gpus()
    nvml = Nvml(fake)
    assert nvml.device_count() == 2
    fake.nvmlShutdown()  # another user of the library in this process
    assert nvml.device_count() is None
    assert nvml.failed_with("Uninitialized")
    assert nvml.device_count() == 2
    assert fake.calls["nvmlInit"] == 2


def test_time_in_nvml_is_accounted() -> None:
    fake = two_gpus()
    nvml = Nvml(fake, timer=Ticker(0.25))
    nvml.device_count()  # init + count
    nvml.uuid(nvml.handle(0))
    assert nvml.stats.calls == 4
    assert nvml.stats.call_seconds == pytest.approx(4 * 0.25)
    assert nvml.stats.calls_by_function["nvmlDeviceGetUUID"] == 1


# -- the source -------------------------------------------------------------------------------


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    """A /proc with a Kubernetes pod (two processes), a bare process and a notebook."""
    pod = (
        f"0::/kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID_}.slice"
        f"/cri-containerd-{CID}.scope\n"
    )
    write_proc(tmp_path, 1001, comm="torchrun", start=11, cgroup=pod)
    write_proc(tmp_path, 1002, comm="python3", start=12, cgroup=pod)
    write_proc(tmp_path, 2001, comm="python3", start=21, environ={"OOMCAST_PRIORITY": "9"})
    write_proc(tmp_path, 3001, comm="jupyter-lab", start=31)
    return tmp_path


def make_source(fake: FakeNvml, proc: Path, **kwargs: object) -> tuple[NvmlSource, ProcResolver]:
    resolver = ProcResolver(proc, priorities={"jupyter*": -5, "pod:*": 3})
    source = NvmlSource("node-a", Nvml(fake), resolver, **kwargs)  # type: ignore[arg-type]
    return source, resolver


def samples(records: list[object]) -> list[Sample]:
    return [r for r in records if isinstance(r, Sample)]


def test_one_sample_per_gpu_with_capacity_use_and_main_job(proc: Path) -> None:
    fake = FakeNvml(
        [
            FakeGpu(
                total=80 * GIB,
                used=50 * GIB,
                reserved=500 * MIB,
                processes=[(2001, 10 * GIB), (1001, 38 * GIB), (1002, 2 * GIB)],
            ),
            FakeGpu(total=40 * GIB, used=0, reserved=300 * MIB),
        ]
    )
    source, _ = make_source(fake, proc)
    records = source.poll(T0)
    # who is on each GPU rides along: largest first, with each pid's job (the neighbour cause)
    gpu0, gpu1 = (r.processes for r in samples(records))
    assert [(p.pid, p.used_bytes) for p in gpu0 or ()] == [
        (1001, 38 * GIB),
        (2001, 10 * GIB),
        (1002, 2 * GIB),
    ]
    assert gpu0 is not None and gpu0[0].job == f"pod:{UID}" and gpu1 == ()
    assert [dataclasses.replace(r, processes=None) for r in samples(records)] == [
        Sample(
            ts=T0,
            node="node-a",
            device="gpu0",
            kind="gpu",
            total_bytes=80 * GIB - 500 * MIB,
            used_bytes=50 * GIB,
            job=f"pod:{UID}",
        ),
        Sample(
            ts=T0,
            node="node-a",
            device="gpu1",
            kind="gpu",
            total_bytes=40 * GIB - 300 * MIB,
            used_bytes=0,
            job=None,
        ),
    ]
    for r in records:  # what the service will accept
        assert parse_record(r.to_dict()) == r
    assert source.stats.samples == 2 and source.stats.polls == 1
    assert not source.exhausted


def test_process_table_maps_pids_to_jobs_and_priorities(proc: Path) -> None:
    fake = FakeNvml(
        [
            FakeGpu(processes=[(3001, GIB), (1002, 2 * GIB), (2001, 5 * GIB), (4040, None)]),
            FakeGpu(),
        ]
    )
    source, _ = make_source(fake, proc)
    source.poll(T0)
    assert source.processes("gpu0") == [
        GpuProcess(pid=2001, used_bytes=5 * GIB, job="pid:2001", priority=9, start_time=21),
        GpuProcess(pid=1002, used_bytes=2 * GIB, job=f"pod:{UID}", priority=3, start_time=12),
        GpuProcess(pid=3001, used_bytes=GIB, job="pid:3001", priority=-5, start_time=31),
        # a pid /proc does not show (another pid namespace, or already gone)
        GpuProcess(pid=4040, used_bytes=None, job="pid:4040", priority=0, start_time=None),
    ]
    assert source.processes("gpu1") == []
    assert source.processes("gpu9") == []
    assert source.devices() == ["gpu0", "gpu1"]
    # the table follows the GPU: the notebook exits
    fake.gpus[0].processes = [(1002, 2 * GIB)]
    source.poll(T0 + 1)
    assert [p.pid for p in source.processes("gpu0")] == [1002]


def test_main_job_without_per_process_memory() -> None:
    def p(pid: int, used: int | None, job: str) -> GpuProcess:
        return GpuProcess(pid, used, job, 0, None)

    assert main_job([]) is None
    assert main_job([p(1, None, "a"), p(2, None, "a")]) == "a"
    assert main_job([p(1, None, "a"), p(2, None, "b")]) is None
    assert main_job([p(1, None, "a"), p(2, 0, "b")]) == "b"
    assert main_job([p(1, GIB, "a"), p(2, GIB, "b")]) == "a"  # a tie goes to the lower pid


def test_interval_is_respected(proc: Path) -> None:
    fake = two_gpus()
    source, _ = make_source(fake, proc, interval_s=1.0)
    assert len(source.poll(T0)) == 2
    calls = sum(fake.calls.values())
    assert source.poll(T0 + 0.5) == []
    assert source.poll(T0 + 0.99) == []
    assert sum(fake.calls.values()) == calls  # no NVML call between samples
    assert [s.ts for s in samples(source.poll(T0 + 1.0))] == [T0 + 1.0] * 2
    assert source.stats.polls == 2


def test_polls_a_little_late_keep_the_beat(proc: Path) -> None:
    """An agent ticking at the source's interval polls a little late now and then; the next
    sample is still due one interval after the last due time, not after the late poll (which
    skipped every few ticks: GPUs sampled at two thirds of the rate asked)."""
    source, _ = make_source(two_gpus(), proc, interval_s=1.0)
    late = [0.0, 1.02, 2.0, 3.01, 4.0, 5.03, 6.0]
    assert all(len(samples(source.poll(T0 + t))) == 2 for t in late)
    assert source.poll(T0 + 6.5) == []  # and a poll before the beat still gets nothing
    assert len(samples(source.poll(T0 + 60.0))) == 2  # after a stall: no burst to catch up
    assert source.poll(T0 + 60.5) == []


def test_handles_are_kept_between_polls(proc: Path) -> None:
    fake = two_gpus()
    source, _ = make_source(fake, proc, interval_s=1.0)
    for i in range(5):
        assert len(samples(source.poll(T0 + i))) == 2
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == 2  # once per GPU, not per poll
    assert fake.calls["nvmlInit"] == 1


def test_failing_gpu_is_skipped_while_the_others_report(proc: Path) -> None:
    fake = FakeNvml([FakeGpu(processes=[(1001, GIB)]), FakeGpu(processes=[(2001, GIB)])])
    source, _ = make_source(fake, proc)
    source.poll(T0)
    assert source.processes("gpu0") and source.processes("gpu1")
    fake.fail("nvmlDeviceGetMemoryInfo", fake_nvml.NVMLError_Unknown, device=1)
    out = source.poll(T0 + 1)
    assert [s.device for s in samples(out)] == ["gpu0"]
    assert not any(isinstance(r, Event) for r in out)
    assert source.processes("gpu1") == []  # no stale table to act on
    assert source.stats.skipped == 1
    assert source.nvml.stats.errors_by_function["nvmlDeviceGetMemoryInfo"] >= 1
    fake.heal()
    assert [s.device for s in samples(source.poll(T0 + 2))] == ["gpu0", "gpu1"]


def test_failed_gpu_gets_a_fresh_handle_and_empty_memory_is_not_a_sample(proc: Path) -> None:
    fake = FakeNvml([FakeGpu(), FakeGpu(total=0, reserved=0)])
    source, _ = make_source(fake, proc)
    assert [s.device for s in samples(source.poll(T0))] == ["gpu0"]
    assert source.stats.skipped == 1 and source.stats.gpus_lost == 0
    fake.fail("nvmlDeviceGetMemoryInfo", fake_nvml.NVMLError_InvalidArgument, device=0)
    handles = fake.calls["nvmlDeviceGetHandleByIndex"]
    source.poll(T0 + 1)
    fake.heal()
    assert [s.device for s in samples(source.poll(T0 + 2))] == ["gpu0"]
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == handles + 1  # gpu0 asked again


def test_failed_process_query_still_reports_memory(proc: Path) -> None:
    fake = FakeNvml([FakeGpu(used=GIB, processes=[(1001, GIB)])])
    fake.fail("nvmlDeviceGetComputeRunningProcesses", fake_nvml.NVMLError_NoPermission)
    source, _ = make_source(fake, proc)
    [sample] = source.poll(T0)
    assert isinstance(sample, Sample)
    assert sample.used_bytes == GIB and sample.job is None
    assert source.processes("gpu0") == []


def test_lost_gpu_yields_one_event_and_is_retried_later(proc: Path) -> None:
    fake = FakeNvml([FakeGpu(processes=[(1001, GIB)]), FakeGpu(processes=[(2001, GIB)])])
    source, _ = make_source(fake, proc, retry_lost_s=30.0)
    source.poll(T0)
    fake.lose(1)
    out = source.poll(T0 + 1)
    assert [s.device for s in samples(out)] == ["gpu0"]
    assert [r for r in out if isinstance(r, Event)] == [
        Event(ts=T0 + 1, node="node-a", device="gpu1", event=GPU_LOST_EVENT, job="pid:2001")
    ]
    assert source.stats.gpus_lost == 1
    handles = fake.calls["nvmlDeviceGetHandleByIndex"]
    for t in range(2, 31):  # not asked again before retry_lost_s, and no second event
        out = source.poll(T0 + t)
        assert [r.device for r in out] == ["gpu0"]
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == handles
    out = source.poll(T0 + 31)  # retried, still lost: quietly skipped
    assert [r.device for r in out] == ["gpu0"]
    assert fake.calls["nvmlDeviceGetHandleByIndex"] == handles + 1
    fake.heal(1)  # reset brings it back
    out = source.poll(T0 + 62)
    assert [s.device for s in samples(out)] == ["gpu0", "gpu1"]
    assert source.stats.gpus_lost == 1


def test_uuid_naming(proc: Path) -> None:
    fake = two_gpus()
    source, _ = make_source(fake, proc, device_naming="uuid")
    out = samples(source.poll(T0))
    assert [s.device for s in out] == [g.uuid for g in fake.gpus]
    uuid_calls = fake.calls["nvmlDeviceGetUUID"]
    source.poll(T0 + 1)
    assert fake.calls["nvmlDeviceGetUUID"] == uuid_calls  # read once per GPU
    fake.fail("nvmlDeviceGetUUID", fake_nvml.NVMLError_Unknown, device=0)
    fresh, _ = make_source(fake, proc, device_naming="uuid")
    # no UUID, no sample: gpu0 under another name would split its history
    assert [s.device for s in samples(fresh.poll(T0))] == [fake.gpus[1].uuid]


def test_count_failure_and_vanishing_gpus(proc: Path) -> None:
    fake = two_gpus()
    source, _ = make_source(fake, proc)
    assert len(source.poll(T0)) == 2
    fake.fail("nvmlDeviceGetCount", fake_nvml.NVMLError_Unknown)
    assert source.poll(T0 + 1) == []
    assert source.devices() == []
    fake.heal()
    fake.gpus.pop()
    assert [s.device for s in samples(source.poll(T0 + 2))] == ["gpu0"]
    assert source.devices() == ["gpu0"]


def test_fatal_nvml_error_reaches_the_caller(proc: Path) -> None:
    fake = two_gpus()
    fake.init_error = fake_nvml.NVMLError_LibraryNotFound
    source, _ = make_source(fake, proc)
    with pytest.raises(NvmlUnavailable, match=r"libnvidia-ml\.so\.1"):
        source.poll(T0)


def test_metric_samples_report_nvml_cost_and_errors(proc: Path) -> None:
    fake = FakeNvml([FakeGpu(processes=[(1001, GIB), (2001, GIB)]), FakeGpu()])
    resolver = ProcResolver(proc)
    source = NvmlSource("node-a", Nvml(fake, timer=Ticker(0.001)), resolver)
    source.poll(T0)  # init, count, 2 x (handle, memory, processes): 8 calls
    assert source.stats.last_poll_samples == 2
    assert source.stats.last_poll_nvml_seconds == pytest.approx(8 * 0.001)
    assert source.stats.nvml_seconds_per_sample == pytest.approx(4 * 0.001)
    fake.fail("nvmlDeviceGetMemoryInfo", fake_nvml.NVMLError_Unknown, device=1)
    source.poll(T0 + 1)
    metrics = {
        (name, tuple(sorted(labels.items()))): (kind, value)
        for name, kind, _, labels, value in source.metric_samples()
    }
    assert metrics[("oomcast_agent_nvml_gpus", ())] == ("gauge", 1)
    assert metrics[("oomcast_agent_nvml_skipped_total", ())] == ("counter", 1)
    key = (("error", "Unknown"), ("function", "nvmlDeviceGetMemoryInfo"))
    assert metrics[("oomcast_agent_nvml_errors_total", key)] == ("counter", 1)
    calls = ("oomcast_agent_nvml_calls_total", (("function", "nvmlDeviceGetCount"),))
    assert metrics[calls] == ("counter", 2)
    kind, seconds = metrics[("oomcast_agent_nvml_call_seconds_total", ())]
    assert kind == "counter" and seconds == pytest.approx(source.nvml.stats.call_seconds)
    assert metrics[("oomcast_agent_nvml_gpu_processes", (("device", "gpu0"),))] == ("gauge", 2)
    assert ("oomcast_agent_nvml_gpu_processes", (("device", "gpu1"),)) not in metrics


def test_the_node_agent_publishes_what_the_source_reports(proc: Path) -> None:
    fake = FakeNvml([FakeGpu(used=10 * GIB, processes=[(1001, 9 * GIB)]), FakeGpu()])
    source, _ = make_source(fake, proc)
    keys = Keys("oomcast-nvml-test", 4)
    # build_entries does not talk to Redis; the client is never connected
    agent = NodeAgent([source], StreamPublisher(redis.Redis(port=1)), keys)
    entries = agent.build_entries(T0)
    [entry] = entries
    assert entry.stream == keys.samples_for("node-a")
    decoded = decode_samples(entry.fields)
    assert not any(isinstance(d, SchemaError) for d in decoded)
    assert [d.sample for d in decoded if not isinstance(d, SchemaError)] == [
        Sample(
            T0, "node-a", "gpu0", "gpu", 80 * GIB - 512 * MIB, 10 * GIB, job=f"pod:{UID}",
            processes=(ProcessUse(1001, 9 * GIB, f"pod:{UID}"),),
        ),
        Sample(T0, "node-a", "gpu1", "gpu", 80 * GIB - 512 * MIB, 0, processes=()),
    ]  # fmt: skip
    assert all(d.emb is not None for d in decoded if not isinstance(d, SchemaError))
    fake.lose(1)
    samples_entry, event_entry = agent.build_entries(T0 + 1)
    assert samples_entry.n_samples == 1
    assert decode_event(event_entry.fields) == Event(T0 + 1, "node-a", "gpu1", GPU_LOST_EVENT)


def test_source_validates_its_settings(proc: Path) -> None:
    with pytest.raises(ValueError, match="device_naming"):
        make_source(two_gpus(), proc, device_naming="serial")
    with pytest.raises(ValueError, match="interval_s"):
        make_source(two_gpus(), proc, interval_s=0)


def test_close_releases_nvml_and_polling_resumes(proc: Path) -> None:
    fake = two_gpus()
    source, _ = make_source(fake, proc)
    source.poll(T0)
    source.close()
    assert fake.refcount == 0
    assert len(source.poll(T0 + 1)) == 2
    assert fake.calls["nvmlInit"] == 2


# -- a real GPU ------------------------------------------------------------------------------


def test_real_nvml_reports_every_gpu() -> None:
    nvml = Nvml()
    try:
        nvml.init()
    except NvmlUnavailable as exc:
        pytest.skip(f"no usable NVIDIA driver/GPU here: {exc}")
    try:
        count = nvml.device_count()
        assert count is not None
        if count == 0:
            pytest.skip("NVML works but lists no GPU")
        source = NvmlSource("real-node", nvml, ProcResolver())
        records = source.poll(time.time())
        gpus = samples(records)
        assert [s.device for s in gpus] == [f"gpu{i}" for i in range(count)]
        for s in gpus:
            assert parse_record(s.to_dict()) == s
            assert 0 <= s.used_bytes <= s.total_bytes
            assert s.total_bytes > 256 * MIB
            for p in source.processes(s.device):
                assert p.pid > 0
        assert nvml.stats.call_seconds > 0
    finally:
        nvml.close()
