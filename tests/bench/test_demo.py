"""`oomcast demo` as a user runs it, bounded by --duration."""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from support import oomcast_cmd, wait_until

from oomcast.bench import demo
from oomcast.bench.demo.summary import Oom, summarize
from oomcast.cli import collect as cli_collect
from oomcast.cli import main as cli
from oomcast.collectors.sources.sim import SimSource
from oomcast.model.schema import Event, Sample


@pytest.mark.slow
def test_demo_runs_and_cleans_up(redis_url: str, rclient: redis.Redis) -> None:
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url}
    done = subprocess.run(  # no --plain: piped, it prints lines all the same
        oomcast_cmd("demo", "--duration", "12"),
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert done.returncode == 0, done.stderr
    assert "service: http://127.0.0.1:" in done.stdout
    assert "demo-node-a/gpu" in done.stdout  # the service's view, read over its REST API
    # as `oomcast top --plain` prints it: a block headed by the time, a domain a line
    assert re.search(r"^\d\d:\d\d:\d\d \d+ live, \d+ firing", done.stdout, re.M)
    assert re.search(r"^  demo-node-\w/gpu\d job=\S+ used \d+%", done.stdout, re.M)
    assert re.search(
        r"^demo over: \d+ OOMs?, \d+ of them warned of in advance; \d+ alerts? fired in all,"
        r" \d+ false alarms?(, \d+ still open)?; \d+ webhooks? received",
        done.stdout,
        re.M,
    ), done.stdout
    assert "demo-node-b/gpu" in done.stdout  # both nodes' partitions are read
    assert ", 0 with a bad signature" in done.stdout
    assert list(rclient.scan_iter(match=f"{demo.PREFIX}:*")) == []
    assert "Traceback" not in done.stderr


def test_demo_starts_a_private_redis_when_none_answers(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    real = demo._answers
    monkeypatch.setattr(demo, "_answers", lambda url: ":6379/" not in url and real(url))
    said: list[str] = []
    with demo.redis_for_demo(said.append, configured=None) as url:
        assert ":6379/" not in url
        assert redis.Redis.from_url(url).ping()
    assert "private redis-server" in said[0]
    assert not real(url)  # stopped on the way out


@pytest.mark.slow
def test_a_reader_that_goes_away_leaves_the_summary_on_stderr_and_no_keys(
    redis_url: str, rclient: redis.Redis
) -> None:
    # `oomcast demo | tee log` with Ctrl-C: tee dies with the demo's stdout still open. Here
    # the reader reads three lines and closes the pipe, as tee's death would.
    env = {**os.environ, "OOMCAST_REDIS_URL": redis_url}
    proc = subprocess.Popen(
        oomcast_cmd("demo", "--duration", "10"),
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    for _ in range(3):
        proc.stdout.readline()
    proc.stdout.close()
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 0, err
    assert re.search(r"^demo over: ", err, re.M), err  # the summary, where it could go
    assert "Traceback" not in err and "BrokenPipeError" not in err
    assert list(rclient.scan_iter(match=f"{demo.PREFIX}:*")) == []


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_ctrl_c_stops_everything_it_started(tmp_path: Path) -> None:
    # Like a terminal: SIGINT to the whole foreground process group.
    proc = subprocess.Popen(
        oomcast_cmd("demo", "--plain", "--private-redis"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    first = proc.stdout.readline()
    assert "started a private redis-server at" in first
    url = first.split(" at ")[1].split()[0]
    client = redis.Redis.from_url(url)
    assert client.ping()
    for line in proc.stdout:
        if line.startswith("webhooks:"):
            break

    def streaming() -> bool:  # the simulated nodes are up and their samples arrive
        keys = list(client.scan_iter(match=f"{demo.PREFIX}:samples:*"))
        return any(client.xlen(k) > 0 for k in keys)

    assert wait_until(streaming, 30)
    os.killpg(proc.pid, signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)  # the demo prints every thread's stack
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.communicate(timeout=3)  # collects the stacks (it does not exit by itself)
        proc.kill()
        out, err = proc.communicate()
        stacks = err[-6000:]
        raise AssertionError(f"the demo did not stop within 60 s of Ctrl-C:\n{stacks}") from None
    assert proc.returncode == 0, err
    assert "demo over:" in out
    assert "Traceback" not in err
    with pytest.raises(redis.ConnectionError):
        redis.Redis.from_url(url, socket_connect_timeout=0.5).ping()


# --- the demo's simulated GPUs, on virtual time -------------------------------------------

T0 = 1_700_000_000.0


def _demo_sources() -> dict[str, SimSource]:
    """Each demo node's sim source, built by the CLI from the very argv the demo runs."""
    out = {}
    for node, patterns, seed in demo.NODES:
        args = cli.build_parser().parse_args(demo.collector_argv(node, patterns, seed, 1.0))
        (source,) = cli_collect._build_sources(args)
        assert isinstance(source, SimSource)
        out[node] = source
    return out


def _run_demo_gpus(seconds: float) -> tuple[dict[tuple[str, str], list[Sample]], list[Event]]:
    samples: dict[tuple[str, str], list[Sample]] = {}
    ooms: list[Event] = []
    sources = _demo_sources()
    for i in range(int(seconds / demo.SAMPLE_INTERVAL_S) + 1):
        for source in sources.values():
            for rec in source.poll(T0 + i * demo.SAMPLE_INTERVAL_S):
                if isinstance(rec, Event):
                    ooms.append(rec)
                else:
                    samples.setdefault(rec.domain, []).append(rec)
    return samples, ooms


def test_demo_gpus_include_a_leak_that_ooms_60_to_85s_in_and_gpus_that_never_oom() -> None:
    samples, ooms = _run_demo_gpus(300)
    patterns = demo.demo_patterns()
    assert set(samples) == set(patterns)  # the CLI gives the GPUs the patterns we expect
    first: dict[tuple[str, str], float] = {}
    for e in ooms:
        first.setdefault(e.domain, e.ts - T0)
    # the fast leak: its first OOM leaves room for the demo's start-up (a few seconds)
    fast = ("demo-node-a", "gpu0")
    assert patterns[fast] == "fast_leak"
    assert 62 <= first[fast] <= 80, first
    assert min(first.values()) == first[fast]  # and it is the demo's first OOM
    # ...after a steady climb from its start-up level, visible well over 30 s ahead
    before = [s for s in samples[fast] if s.ts - T0 <= first[fast]]
    frac = {round(s.ts - T0, 1): s.used_frac for s in before}
    assert 0.3 < frac[5.0] < 0.7
    assert frac[round(first[fast] - 30)] < 0.9
    means = [
        sum(s.used_frac for s in before[i : i + 20]) / 20 for i in range(10, len(before) - 20, 4)
    ]
    assert all(b > a for a, b in itertools.pairwise(means))  # climbs, every 2 s
    steps = [b.used_frac - a.used_frac for a, b in itertools.pairwise(before[10:])]
    assert max(steps) < 0.1  # no jumps
    # GPUs that never OOM stay in the mix
    safe = {d for d, p in patterns.items() if p in ("sawtooth", "spiky", "plateau")}
    assert {patterns[d] for d in safe} == {"sawtooth", "spiky", "plateau"}
    assert not safe & set(first)
    assert all(max(s.used_frac for s in samples[d]) > 0.5 for d in safe)  # busy, not idle


# --- the closing summary, from hand-made webhooks ------------------------------------------

A0, A3 = ("demo-node-a", "gpu0"), ("demo-node-a", "gpu3")
B1, B2, B3 = ("demo-node-b", "gpu1"), ("demo-node-b", "gpu2"), ("demo-node-b", "gpu3")


@pytest.fixture
def utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def hook(
    status: str,
    domain: tuple[str, str],
    episode: str,
    observed: float,
    *,
    fired: float | None = None,
    tto: float | None = None,
    reason: str = "",
    job: str | None = None,
) -> dict[str, Any]:
    """A webhook as the service sends one; times in seconds after T0."""
    return {
        "status": status,
        "node": domain[0],
        "device": domain[1],
        "job": job or f"job-{domain[1]}",
        "risk": {"60": 0.9},
        "time_to_oom_s": tto,
        "observed_at": T0 + observed,
        "fired_at": T0 + (observed if fired is None else fired),
        "sent_at": T0 + observed + 0.2,
        "model_version": "test",
        "episode": episode,
        "reason": reason,
        "rule_name": "oom-forecast",
    }


OOM_REASON = "the job ran out of memory"
CALM = "the forecast calmed down"


def test_summary_scores_warned_ooms_false_alarms_and_misses(utc: None) -> None:
    warned = hook("firing", A0, "e1", 40.0, fired=40.5, tto=32.4, job="fast_leak-gpu0")
    received = [
        (hook("firing", B2, "e0", 20.0, tto=50.0), True),  # sawtooth, resolves: false alarm
        (warned, True),
        (dict(warned), True),  # delivered twice: one alert
        (hook("resolved", B2, "e0", 30.0, reason=CALM), True),
        (hook("resolved", A0, "e1", 70.0, reason=OOM_REASON, job="fast_leak-gpu0"), True),
        (hook("firing", A3, "e2", 80.0, tto=20.0), True),  # spiky, open at the end: false alarm
        (hook("firing", B1, "e3", 85.0, tto=40.0), True),  # leak, open: may still OOM
        (hook("firing", B3, "e4", 86.0), False),  # bad signature: ignored
    ]
    ooms = [
        Oom(*A0, T0 + 70.5, "fast_leak-gpu0"),
        Oom("demo-node-a", "gpu2", T0 + 88.0, "step_growth-gpu2"),
    ]
    lines = summarize(received, ooms, demo.demo_patterns(), started_at=T0 - 2.0)
    assert lines == [
        "demo over: 2 OOMs, 1 of them warned of in advance; 4 alerts fired in all,"
        " 2 false alarms, 1 still open; 8 webhooks received, 1 with a bad signature.",
        "  warned OOM demo-node-a/gpu0 job=fast_leak-gpu0: first firing 22:14:00 (t+42.5s),"
        " predicted time_to_oom_s 32s, actual 30.5s from its observed_at to the OOM at"
        " 22:14:30 (t+72.5s); lead 30.0s",
        "  missed OOM demo-node-a/gpu2 job=step_growth-gpu2: OOM at 22:14:48 (t+90.0s),"
        " no alert before it",
        "  false alarm demo-node-b/gpu2 job=job-gpu2: fired 22:13:40 (t+22.0s), resolved"
        " 22:13:50 (t+32.2s) without an OOM (the forecast calmed down)",
        "  false alarm demo-node-a/gpu3 job=job-gpu3: fired 22:14:40 (t+82.0s), still open at"
        " the end; a spiky job never OOMs",
    ]


def test_summary_alert_that_calmed_down_before_the_oom_did_not_warn_of_it(utc: None) -> None:
    received = [
        (hook("firing", B1, "e1", 10.0, tto=60.0), True),
        (hook("resolved", B1, "e1", 20.0, reason=CALM), True),
        (hook("firing", B1, "e2", 50.0, tto=9.0), True),  # then a new one, open at the OOM
    ]
    ooms = [Oom(*B1, T0 + 55.0, "leak-gpu1")]
    lines = summarize(received, ooms, demo.demo_patterns())
    assert lines[0] == (
        "demo over: 1 OOM, 1 of them warned of in advance; 2 alerts fired in all,"
        " 1 false alarm; 3 webhooks received, 0 with a bad signature."
    )
    assert lines[1] == (
        "  warned OOM demo-node-b/gpu1 job=job-gpu1: first firing 22:14:10, predicted"
        " time_to_oom_s 9s, actual 5.0s from its observed_at to the OOM at 22:14:15; lead 5.0s"
    )
    assert lines[2].startswith("  false alarm demo-node-b/gpu1 job=job-gpu1: fired 22:13:30,")


def test_summary_takes_the_oom_time_from_the_resolved_alert_when_no_event_was_seen(
    utc: None,
) -> None:
    received = [
        (hook("firing", A0, "e1", 30.0, tto=45.0), True),
        (hook("resolved", A0, "e1", 71.0, reason=OOM_REASON), True),
    ]
    lines = summarize(received, [], demo.demo_patterns())
    assert lines == [
        "demo over: 1 OOM, 1 of them warned of in advance; 1 alert fired in all,"
        " 0 false alarms; 2 webhooks received, 0 with a bad signature.",
        "  warned OOM demo-node-a/gpu0 job=job-gpu0: first firing 22:13:50, predicted"
        " time_to_oom_s 45s, actual 41.0s from its observed_at to the OOM at 22:14:31;"
        " lead 41.0s; OOM time from the resolved alert",
    ]


def test_summary_of_a_quiet_demo() -> None:
    assert summarize([], [], demo.demo_patterns()) == [
        "demo over: 0 OOMs, 0 of them warned of in advance; 0 alerts fired in all,"
        " 0 false alarms; 0 webhooks received, 0 with a bad signature."
    ]


def test_demo_agents_hold_their_own_node_keys_never_the_master(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from oomcast.model.control import node_key

    monkeypatch.setenv("OOMCAST_CONTROL_SECRET", "inherited-master")
    envs = {node: demo.collector_env("redis://h/0", node, "m" * 64) for node, _, _ in demo.NODES}
    for node, env in envs.items():
        assert env["OOMCAST_NODE_KEY"] == node_key("m" * 64, node)
        assert "OOMCAST_CONTROL_SECRET" not in env
        assert env["OOMCAST_KEY_PREFIX"] == demo.PREFIX
    assert len({env["OOMCAST_NODE_KEY"] for env in envs.values()}) == len(demo.NODES)


def test_the_demos_alert_lines_say_the_cause_and_the_first_remedy() -> None:
    from oomcast.bench.demo.view import _alert_line

    alert = {
        "status": "firing",
        "node": "demo-node-b",
        "device": "gpu1",
        "job": "j",
        "time_to_oom_s": 44.0,
        "reason": "risk 0.9",
        "sent_at": 0.0,
        "cause": "fragmentation",
        "remedies": ["set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True in the job"],
    }
    line = _alert_line(alert, True)
    assert "cause: fragmentation; fix: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments" in line
    assert "cause" not in _alert_line({**alert, "status": "resolved"}, True)
    # an episode the OOM ended reads as the OOM, with no forecast left in it (it read
    # "RESOLVED ... OOM in ~1s (the job ran out of memory)")
    died = _alert_line({**alert, "status": "resolved", "reason": "the job ran out of memory"}, True)
    assert " OOM      demo-node-b/gpu1" in died and "OOM in ~" not in died
    assert "RESOLVED" in _alert_line({**alert, "status": "resolved", "reason": "calm"}, True)
