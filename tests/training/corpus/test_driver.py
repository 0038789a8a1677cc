"""training/corpus/driver.py: each behaviour puts the bytes it promises where it promises,
on the run's own clock; pacing and statistics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from oomcast.training.corpus.driver import MIB, Driver, JobHooks, Phase, Script


class Clock:
    def __init__(self) -> None:
        self.t = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.t

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.t += seconds


def drive(script: Script, steps: int, step_s: float, hooks: JobHooks | None = None,
          stats: Path | None = None) -> tuple[Driver, Clock]:  # fmt: skip
    clock = Clock()
    driver = Driver(script, None if stats is None else str(stats), hooks, clock=clock,
                    sleep=clock.sleep)  # fmt: skip
    for _ in range(steps):
        clock.t += step_s  # the step's compute
        driver.end_step()
    return driver, clock


def held(driver: Driver) -> int:
    return sum(h.nbytes for h in driver.holders.values())


def test_a_script_survives_the_command_line_and_refuses_what_it_does_not_know() -> None:
    script = Script(duration_s=60, period_s=0.2, phases=[Phase("leak", 5.0, rate_bps=1e6)])
    assert Script.from_json(script.to_json()) == script
    with pytest.raises(ValueError, match="meteor"):
        Script.from_json(json.dumps({"duration_s": 1, "period_s": 1,
                                     "phases": [{"kind": "meteor", "start_s": 0}]}))  # fmt: skip
    with pytest.raises(ValueError, match="unknown keys"):
        Phase.from_dict({"kind": "leak", "start_s": 0, "speed": 3})
    with pytest.raises(ValueError, match="positive"):
        Script.from_json(json.dumps({"duration_s": 0, "period_s": 1}))


def test_a_leak_holds_its_rate_times_the_time_since_it_began() -> None:
    script = Script(duration_s=100, period_s=0.5, phases=[Phase("leak", 10.0, rate_bps=4 * MIB)])
    driver, _ = drive(script, 60, 0.1)  # 30 s of run time
    assert held(driver) == pytest.approx(20 * 4 * MIB, rel=0.05)
    before, _ = drive(script, 15, 0.1)  # 7.5 s: not begun
    assert held(before) == 0


def test_a_leak_keeps_the_hooked_layer_s_outputs() -> None:
    layer = nn.Linear(64, 4096)
    script = Script(duration_s=100, period_s=1.0, phases=[Phase("leak", 0.0, rate_bps=2 * MIB)])
    clock = Clock()
    driver = Driver(script, None, JobHooks(leak_module=layer), clock=clock, sleep=clock.sleep)
    for _ in range(5):
        layer(torch.randn(32, 64))  # 512 KiB of output a step
        clock.t += 0.1
        driver.end_step()
    items = driver.holders[0].items
    assert items and all(t.shape == (32, 4096) for t in items)
    assert not any(t.requires_grad for t in items)  # detached: no graph kept beside


def test_warmup_levels_off_and_plateau_climbs_in_a_line_then_holds() -> None:
    warm = Script(duration_s=1000, period_s=1.0,
                  phases=[Phase("warmup", 0.0, level_bytes=64 * MIB, tau_s=20.0)])  # fmt: skip
    early, _ = drive(warm, 20, 0.1)
    late, _ = drive(warm, 200, 0.1)
    assert held(early) == pytest.approx(64 * MIB * 0.63, rel=0.1)  # one time constant
    assert held(late) == pytest.approx(64 * MIB, rel=0.02)
    flat = Script(duration_s=1000, period_s=1.0,
                  phases=[Phase("plateau", 0.0, level_bytes=64 * MIB, tau_s=40.0)])  # fmt: skip
    half, _ = drive(flat, 20, 0.1)
    full, _ = drive(flat, 200, 0.1)
    assert held(half) == pytest.approx(32 * MIB, rel=0.1)
    assert held(full) == pytest.approx(64 * MIB, rel=0.02)


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_eval_accum_rises_and_lets_go_and_churn_tracks_its_target() -> None:
    script = Script(duration_s=1000, period_s=1.0,
                    phases=[Phase("eval_accum", 0.0, rate_bps=MIB, every_s=30.0)])  # fmt: skip
    clock = Clock()
    driver = Driver(script, None, None, clock=clock, sleep=clock.sleep)
    peaks, current = [], 0
    for _ in range(200):
        clock.t += 0.1
        driver.end_step()
        now = held(driver)
        if now < current:  # an evaluation ended
            peaks.append(current)
        current = now
    assert len(peaks) >= 4 and peaks == sorted(peaks)  # each evaluation holds more
    churn = Script(duration_s=1000, period_s=1.0, phases=[Phase("churn", 0.0, rate_bps=MIB)])
    driver, _ = drive(churn, 120, 0.1)
    total = sum(t.nbytes for t in driver.churn)
    assert len(driver.churn) == 200 and 0.5 * 120 * MIB < total < 2.0 * 120 * MIB


def test_sudden_behaviours_fire_once_at_their_time() -> None:
    script = Script(duration_s=1000, period_s=1.0, batch=16, seq=64, phases=[
        Phase("step_scale", 10.0, factor=2.5),
        Phase("checkpoint", 5.0, level_bytes=8 * MIB),
    ])  # fmt: skip
    clock = Clock()
    driver = Driver(script, None, JobHooks(state=lambda: {"w": torch.zeros(4)}), clock=clock,
                    sleep=clock.sleep)  # fmt: skip
    assert driver.size(16, 64, False) == (16, 64)
    for _ in range(12):
        clock.t += 1.0
        driver.end_step()
    assert driver.size(16, 64, False) == (40, 64) and driver.size(16, 64, True) == (16, 160)
    kept = sum(len(b) for b in driver.kept)
    assert 8 * MIB <= kept < 8 * MIB + 64 * MIB
    for _ in range(5):
        clock.t += 1.0
        driver.end_step()
    assert sum(len(b) for b in driver.kept) == kept  # once


def test_pacing_keeps_the_period_and_statistics_say_so(tmp_path: Path) -> None:
    script = Script(duration_s=30, period_s=0.25)
    stats = tmp_path / "stats.jsonl"
    driver, clock = drive(script, 40, 0.1, stats=stats)
    assert all(s == pytest.approx(0.15) for s in clock.slept)  # 0.1 s of work, 0.15 asleep
    driver.close()
    lines = [json.loads(x) for x in stats.read_text().splitlines()]
    assert lines[-1]["final"] and sum(x["steps"] for x in lines) == 40
    counted = [x for x in lines if x["steps"]]
    assert all(x["period_s"] == pytest.approx(0.25) for x in counted)
    assert all(x["compute_s"] == pytest.approx(0.1) for x in counted)
    # a step slower than the period: no sleep, and no burst to catch up afterwards
    slow, clock = drive(script, 5, 0.6)
    assert not clock.slept and slow._lag_resets >= 4
