"""Proof on the node (collectors/proof.py): a live command acts only when the agent's own
reading of the domain confirms the state the command claims.

The defect: anyone who can write to Redis can XADD forged samples; the service forecasts an
OOM from them and signs a real ``shed``; the agent, which checked only the signature, killed
a real process. These tests drive the control listener with a GPU measured through the
agent's NVML source (the fake NVML module) and cgroups measured from their files."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
import redis
from support import LIMIT, MIB, v1_files, v2_files, wait_until, write_files

from oomcast.collectors.actions import ActionResult
from oomcast.collectors.control import ControlListener
from oomcast.collectors.nvml import Nvml
from oomcast.collectors.procinfo import ProcResolver
from oomcast.collectors.proof import Measurement, check_claim, make_measure, measure_cgroup
from oomcast.collectors.sources.nvml import NvmlSource
from oomcast.collectors.sources.sim import SimGPU, SimSource
from oomcast.model.control import REASONS, Command, new_command, node_key, sign_command
from oomcast.model.wire import Keys
from tests.collectors.fake_nvml import GIB, FakeGpu, FakeNvml

NODE = "node-p"
KEY = node_key("master-secret", NODE)
RESERVED = 512 * MIB
USABLE = 80 * GIB - RESERVED  # what the NVML source reports as a GPU's capacity


def command(used: float, total: float = USABLE, **kw: Any) -> Command:
    args: dict[str, Any] = {
        "node": NODE,
        "action": "shed",
        "device": "gpu0",
        "job": "trainer",
        "params": {"need_bytes": GIB},
        "forecast": {"risk": {"60": 0.99}, "used_bytes": used, "total_bytes": total},
    }
    args.update(kw)
    return Command(**new_command(**args))


# --- check_claim ---------------------------------------------------------------------------


def fixed(used: int, total: int = USABLE) -> Any:
    return lambda cmd: Measurement(used, total)


def test_claim_confirmed_within_the_tolerance_and_refused_past_it() -> None:
    cmd = command(used=0.95 * USABLE)
    ok = check_claim(cmd, fixed(int(0.901 * USABLE)), tolerance=0.05)
    assert ok.confirmed, ok.message
    assert ok.details["measured"]["used_frac"] == pytest.approx(0.901, abs=1e-3)
    assert ok.details["claimed"]["used_frac"] == pytest.approx(0.95, abs=1e-3)
    no = check_claim(cmd, fixed(int(0.89 * USABLE)), tolerance=0.05)
    assert not no.confirmed and "89.0% used here" in no.message and "95.0%" in no.message
    assert no.details["tolerance_pp"] == 5.0
    # a wider tolerance (the agent's flag) lets the same reading through
    assert check_claim(cmd, fixed(int(0.89 * USABLE)), tolerance=0.10).confirmed
    # more in use than claimed is more danger, not less
    assert check_claim(cmd, fixed(USABLE), tolerance=0.0).confirmed


def test_claim_with_another_capacity_is_not_confirmed() -> None:
    # a forged sample says the GPU is a 16 GiB one, nearly full
    cmd = command(used=15 * GIB, total=16 * GIB)
    v = check_claim(cmd, fixed(15 * GIB))
    assert not v.confirmed and "capacity" in v.message
    assert v.details["measured"]["total_bytes"] == USABLE
    # within the small capacity tolerance: confirmed
    assert check_claim(command(used=USABLE * 0.9, total=USABLE * 1.01), fixed(USABLE)).confirmed


@pytest.mark.parametrize(
    "forecast",
    [
        {},
        {"used_bytes": 1},
        {"used_bytes": True, "total_bytes": 2},
        {"used_bytes": "1", "total_bytes": 2},
        {"used_bytes": 1, "total_bytes": 0},
        {"used_bytes": -1, "total_bytes": 2},
        {"used_bytes": 10**400, "total_bytes": 2},
    ],
)
def test_command_without_usable_figures_is_not_confirmed(forecast: dict[str, Any]) -> None:
    cmd = Command(**new_command(node=NODE, action="shed", device="gpu0", forecast=forecast))
    v = check_claim(cmd, fixed(USABLE))
    assert not v.confirmed and "claims no used_bytes/total_bytes" in v.message


def test_unmeasurable_domain_is_not_confirmed() -> None:
    cmd = command(used=USABLE)
    assert "cannot be measured" in check_claim(cmd, None).message
    assert not check_claim(cmd, lambda c: None).confirmed

    def broken(c: Command) -> Measurement:
        raise OSError("gone")

    v = check_claim(cmd, broken)
    assert not v.confirmed and "measured" not in v.details and "claimed" in v.details


def test_unconfirmed_is_a_refusal_reason() -> None:
    assert "unconfirmed" in REASONS


# --- measuring -----------------------------------------------------------------------------


def nvml_source(fake: FakeNvml) -> NvmlSource:
    source = NvmlSource(NODE, Nvml(fake), ProcResolver())  # type: ignore[arg-type]
    source.poll(1.0)
    return source


def test_gpu_is_measured_afresh_through_nvml() -> None:
    fake = FakeNvml([FakeGpu(used=10 * GIB, reserved=RESERVED)])
    source = nvml_source(fake)
    measure = make_measure(nvml=source)
    assert measure(command(0)) == Measurement(10 * GIB, USABLE)
    fake.gpus[0].used = 70 * GIB  # no poll since: the reading is NVML's now, not the last sample
    assert measure(command(0)) == Measurement(70 * GIB, USABLE)
    assert measure(command(0, device="gpu7")) is None
    fake.lose(0)
    assert measure(command(0)) is None


def test_cgroup_is_measured_from_its_files(tmp_path: Path) -> None:
    write_files(tmp_path / "v2" / "kubepods" / "pod1", v2_files(current=400 * MIB))
    (tmp_path / "v2" / "cgroup.controllers").write_text("memory\n")
    measure = make_measure(cgroup_root=tmp_path / "v2")
    cmd = command(0, device="cgroup:/kubepods/pod1")
    assert measure(cmd) == Measurement(400 * MIB, LIMIT)
    assert measure(command(0, device="cgroup:/kubepods/none")) is None
    assert measure(command(0, device="cgroup:/../v2/kubepods/pod1")) is None  # no climbing out
    assert make_measure()(cmd) is None  # no cgroup root: cannot measure
    write_files(tmp_path / "v2" / "free", v2_files(limit="max"))
    assert measure_cgroup(tmp_path / "v2", "/free") is None  # no limit: no capacity
    write_files(tmp_path / "v1" / "job", v1_files(usage=300 * MIB))
    assert measure_cgroup(tmp_path / "v1", "/job") == Measurement(300 * MIB, LIMIT)
    # the agent never writes to what it reads (the v2 peak stays as it was)
    assert (tmp_path / "v2" / "kubepods" / "pod1" / "memory.peak").read_text() == f"{320 * MIB}\n"


def test_simulated_gpu_is_measured_from_the_simulator() -> None:
    sim = SimSource([SimGPU(NODE, "gpu0", "plateau")])
    (sample,) = sim.poll(100.0)
    measure = make_measure(sim=sim)
    got = measure(command(0))
    assert got is not None and got.used_bytes == sample.used_bytes  # type: ignore[union-attr]
    assert measure(command(0, device="gpu1")) is None


# --- through the control listener ----------------------------------------------------------


class Recorder:
    def __init__(self) -> None:
        self.calls: list[Command] = []
        self.lock = threading.Lock()

    def __call__(self, cmd: Command, candidates: Sequence[Any]) -> ActionResult:
        with self.lock:
            self.calls.append(cmd)
        return ActionResult("done", "shed someone")


class Agent:
    """A control listener whose GPU is measured through the (fake) NVML source."""

    def __init__(self, client: redis.Redis, prefix: str, measure: Any = "nvml") -> None:
        self.client = client
        self.keys = Keys(prefix)
        self.fake = FakeNvml([FakeGpu(used=10 * GIB, reserved=RESERVED)])
        self.source = nvml_source(self.fake)
        self.shed = Recorder()
        self.listener = ControlListener(
            client,
            self.keys,
            NODE,
            KEY,
            {"shed": self.shed, "checkpoint": self.shed},
            lambda cmd: [],
            block_ms=100,
            measure=make_measure(nvml=self.source) if measure == "nvml" else measure,
        )

    def send(self, cmd: dict[str, Any]) -> None:
        self.client.xadd(self.keys.control(NODE), sign_command(cmd, KEY))

    def events(self, n: int) -> list[dict[str, Any]]:
        def got() -> list[dict[str, Any]]:
            return [json.loads(f[b"event"]) for _, f in self.client.xrange(self.keys.events)]

        assert wait_until(lambda: len(got()) >= n, 15), got()
        return got()


@pytest.fixture
def agent(rclient: redis.Redis, key_prefix: str) -> Iterator[Agent]:
    a = Agent(rclient, key_prefix)
    a.listener.start()
    yield a
    assert a.listener.stop(10)


def forged_shed(**kw: Any) -> dict[str, Any]:
    """A shed the service signed in good faith, from forged samples of a nearly full GPU."""
    forecast = {"risk": {"60": 0.99}, "used_bytes": int(0.97 * USABLE), "total_bytes": USABLE}
    args: dict[str, Any] = {
        "node": NODE,
        "action": "shed",
        "device": "gpu0",
        "job": "trainer",
        "params": {"need_bytes": 8 * GIB},
        "forecast": forecast,
    }
    return new_command(**{**args, **kw})


def test_signed_shed_from_forged_samples_is_refused_by_the_agents_own_reading(
    agent: Agent,
) -> None:
    cmd = forged_shed()
    agent.send(cmd)
    (event,) = agent.events(1)
    assert event["event"] == "command_refused" and event["reason"] == "unconfirmed", event
    assert event["authenticated"] is True and event["id"] == cmd["id"]
    assert event["measured"] == {
        "used_bytes": 10 * GIB,
        "total_bytes": USABLE,
        "used_frac": round(10 * GIB / USABLE, 4),
    }
    assert event["claimed"]["used_bytes"] == int(0.97 * USABLE)
    assert event["tolerance_pp"] == 5.0
    assert agent.shed.calls == []  # nobody was shed
    assert agent.listener.stats.refused == {"unconfirmed": 1}

    # the GPU really fills up: the same claim now holds, and the shed goes ahead
    agent.fake.gpus[0].used = int(0.95 * USABLE)
    agent.send(forged_shed())
    result = agent.events(2)[-1]
    assert result["event"] == "action_result" and result["outcome"] == "done", result
    assert result["proof"]["measured"]["used_bytes"] == int(0.95 * USABLE)
    assert len(agent.shed.calls) == 1


def test_dry_runs_need_no_proof(agent: Agent) -> None:
    agent.send(forged_shed(dry_run=True))
    (event,) = agent.events(1)
    assert event["event"] == "action_result" and "proof" not in event
    assert len(agent.shed.calls) == 1


def test_a_live_checkpoint_needs_no_proof_it_loses_no_work(agent: Agent) -> None:
    agent.send(forged_shed(action="checkpoint", params={}))
    (event,) = agent.events(1)
    assert event["event"] == "action_result" and event["action"] == "checkpoint"
    assert "proof" not in event
    assert len(agent.shed.calls) == 1  # this fixture's checkpoint executor is the fake


def test_listener_that_cannot_measure_acts_on_no_live_command(
    rclient: redis.Redis, key_prefix: str
) -> None:
    a = Agent(rclient, key_prefix, measure=None)
    a.listener.start()
    try:
        a.send(forged_shed())
        (event,) = a.events(1)
        assert event["reason"] == "unconfirmed" and "cannot be measured" in event["message"]
        assert "measured" not in event and a.shed.calls == []
    finally:
        assert a.listener.stop(10)


def test_listener_refuses_a_tolerance_out_of_range(rclient: redis.Redis) -> None:
    with pytest.raises(ValueError, match="confirm_tolerance"):
        ControlListener(rclient, Keys("x"), NODE, KEY, {}, lambda c: [], confirm_tolerance=5)
