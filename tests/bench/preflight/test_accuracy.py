"""Preflight's accuracy on the zoo, against the real capture, MemTracker and the CPU allocator.

The slow tests measure the whole zoo once (``measure()``, about 40 s of CPU) and check the
issue's targets on it; the fast ones check the measuring machinery on small, known cases.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from oomcast.bench.preflight import accuracy
from oomcast.bench.preflight.accuracy import (
    FIGURES,
    Row,
    capture_peaks,
    measure,
    min_capacity,
    replay,
    scaled,
    summarize,
)
from oomcast.bench.preflight.zoo import zoo_row
from oomcast.preflight.capture import JobCapture, PhaseOp

MIB = 1 << 20


@pytest.fixture(autouse=True)
def _one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # a shared machine: more threads only contend
    yield
    torch.set_num_threads(threads)


# -- the machinery, on captures whose answers are known ----------------------------------------


def _capture(persistent: int, ops: list[tuple[bool, int, int, str]]) -> JobCapture:
    cap = JobCapture(job="toy", batch_size=1, device="cpu", fake=False)
    cap.persistent = [PhaseOp(True, 1, persistent, "persistent", -1, "")]
    cap.ops = [PhaseOp(a, sid, size, phase, 0, "") for a, sid, size, phase in ops]
    return cap


TOY = _capture(
    30 * MIB,
    [
        (True, 2, 8 * MIB, "forward"),
        (True, 3, 8 * MIB, "backward"),
        (False, 2, 0, "backward"),
        (True, 4, 4 * MIB, "optimizer"),
        (False, 3, 0, "optimizer"),
        (False, 4, 0, "optimizer"),
        (True, 5, 2 * MIB, "eval"),
        (False, 5, 0, "eval"),
    ],
)


def test_capture_peaks_per_figure_and_none_for_a_phase_that_did_not_run() -> None:
    assert capture_peaks(TOY) == {
        "peak": 46 * MIB,
        "train": 46 * MIB,
        "eval": 32 * MIB,
        "checkpoint": None,
    }


def test_min_capacity_is_where_the_replay_starts_to_fit() -> None:
    c = min_capacity(TOY)
    assert c >= 46 * MIB
    assert replay(TOY, c).fits
    assert replay(TOY, int(c * 0.99)) == accuracy.Verdict(False, "train", 0)
    assert not replay(TOY, 20 * MIB).fits
    assert replay(TOY, 20 * MIB).phase == "other"  # the parameters alone do not fit


def test_scaling_a_capture_scales_its_peaks() -> None:
    big = scaled(TOY, 64)
    assert capture_peaks(big)["peak"] == 64 * 46 * MIB
    assert scaled(TOY, 1) is TOY


def _row(job: str, guess: int, truth: int, fits: tuple[bool, bool]) -> Row:
    peaks = {f: guess for f in FIGURES}
    row = Row(job, "toy", 1, {"preflight": peaks, "real": {f: truth for f in FIGURES}})
    row.peaks["real"]["checkpoint"] = None
    row.min_capacity = {"x1": {"preflight": guess, "real": truth}}
    real, pre = accuracy.Verdict(fits[0]), accuracy.Verdict(fits[1])
    row.verdicts = [{"scale": 1, "agree": real == pre}]
    return row


def test_summary_takes_median_and_max_of_the_absolute_error() -> None:
    rows = [_row("a", 100, 100, (True, True)), _row("b", 90, 100, (True, True)),
            _row("c", 130, 100, (False, True))]  # fmt: skip
    s = summarize(rows)
    peak = s["real"]["peak"]
    assert peak["n"] == 3
    assert peak["median_abs"] == pytest.approx(0.10)
    assert peak["max_abs"] == pytest.approx(0.30) and peak["max_signed"] == pytest.approx(0.30)
    assert "checkpoint" not in s["real"]  # no truth there: not counted as zero error
    assert s["verdicts_x1"] == {"n": 3, "agree": 2}
    assert s["min_capacity_x1"]["max_abs"] == pytest.approx(0.30)


def test_an_unknown_job_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="unknown zoo jobs: nope"):
        measure(["mlp", "nope"])


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_memtracker_is_left_out_with_the_reason_where_it_cannot_run() -> None:
    seq2seq = zoo_row("gru_seq2seq").job
    assert "NotImplementedError" in (accuracy.memtracker_note(seq2seq) or "")
    with pytest.raises(NotImplementedError, match="multiple iterative calls"):
        accuracy.memtracker_peaks(seq2seq, 2, evals=1, steps=1, checkpoints=0)
    assert accuracy.memtracker_note(zoo_row("gpt").job) is None


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
def test_main_prints_json_for_the_jobs_asked(capsys: pytest.CaptureFixture[str]) -> None:
    accuracy.main(["--jobs", "mlp", "--json", "--no-allocator"])
    doc = json.loads(capsys.readouterr().out)
    assert [(r["job"], r["batch_size"]) for r in doc["rows"]] == [("mlp", 64), ("mlp", 1024)]
    assert doc["summary"]["real"]["peak"]["n"] == 2
    assert doc["rows"][1]["peaks"]["real"]["train"] > doc["rows"][0]["peaks"]["real"]["train"]


# -- the zoo: the issue's targets -----------------------------------------------------------------


@pytest.fixture(scope="module")
def table() -> list[Row]:
    return measure()


@pytest.mark.slow
@pytest.mark.timeout(600)  # the whole zoo, four runs per row; ~40 s alone, more on a busy machine
def test_peak_allocated_within_the_issue_targets_against_the_real_capture(
    table: list[Row],
) -> None:
    s = summarize(table)["real"]
    assert s["peak"]["n"] == len(table) >= 20
    worst = {f: max(table, key=lambda r: abs(r.rel_err("real", f) or 0)) for f in s}
    for fig, v in s.items():
        w = worst[fig]
        where = f"{fig}: worst {w.job} bs={w.batch_size} {w.rel_err('real', fig):+.1%}"
        assert v["median_abs"] <= 0.05, where
        assert v["max_abs"] <= 0.15, where


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verdicts_match_the_real_replay_on_every_row(table: list[Row]) -> None:
    wrong = [
        f"{r.job} bs={r.batch_size} x{v['scale']} at {v['factor']} C*: real {v['real']},"
        f" preflight {v['preflight']}"
        for r in table
        for v in r.verdicts
        if not v["agree"]
    ]
    assert not wrong, "\n".join(wrong)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_memtracker_agrees_with_the_real_capture_where_it_does_not_change_the_run(
    table: list[Row],
) -> None:
    """The real capture and MemTracker count the same storages, byte for byte, on every row
    MemTracker can run, except one: with an eval that keeps grad on and never calls
    backward, MemTracker's module hooks hold the eval's tensors alive, so the process really
    has more live (the allocator oracle, run without MemTracker, agrees with the capture)."""
    measured = [r for r in table if "memtracker" in r.peaks]
    assert len(measured) >= len(table) - 2
    assert all(r.notes.get("memtracker") for r in table if r not in measured)
    for r in measured:
        eval_with_grad = not zoo_row(r.job).job.eval_no_grad
        for fig in FIGURES:
            real, mt = r.peaks["real"][fig], r.peaks["memtracker"][fig]
            assert (real is None) == (mt is None), (r.job, fig)
            if real is None or mt is None:
                continue
            if eval_with_grad:
                assert mt >= real, (r.job, r.batch_size, fig)
            else:
                assert mt == real, (r.job, r.batch_size, fig, mt - real)
    s = summarize(table)["memtracker"]
    assert s["peak"]["median_abs"] <= 0.05


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_tracker_stays_near_what_the_cpu_allocator_allocates(table: list[Row]) -> None:
    """The allocator (torch.profiler memory events, on a run with no dispatch mode) is the
    strictest truth this machine has, and it differs from the capture both ways: scratch
    buffers made inside a kernel reach it but no dispatch mode (resnet: the grad_output that
    convolution_backward makes contiguous, about 11% of the train peak), and a run under a
    Python dispatch mode may take another kernel (GRU eval: 5.4% more). The bound asserted is
    what was measured, with a margin: median 5%, max 15%."""
    s = summarize(table, predicted="real")["allocator"]
    for fig, v in s.items():
        assert v["median_abs"] <= 0.05 and v["max_abs"] <= 0.15, (fig, v)
