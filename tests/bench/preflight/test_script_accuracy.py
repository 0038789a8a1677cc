"""The accuracy harness for scripts as written (bench/preflight/script_accuracy.py): its
cases ship, a wrong name is refused, and one case measured end to end agrees with the
allocator (its figures are in docs/preflight-accuracy.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from oomcast.bench.preflight import script_accuracy as sa


def test_every_case_is_a_shipped_script_with_its_placeholders() -> None:
    assert len(sa.CASES) >= 12
    assert len({c.name for c in sa.CASES}) == len(sa.CASES)
    for c in sa.CASES:
        assert (sa.SCRIPTS / c.file).is_file(), c.file
        argv = " ".join(c.argv)
        assert "{batch}" in argv and "{steps}" in argv and "{out}" in argv, c.name
        assert c.batches[0] < c.batches[1]


def test_a_wrong_case_name_is_refused_naming_the_cases(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(KeyError, match="mlp"):
        sa.main(["--only", "nope"])


def test_summary_and_table_count_what_was_measured() -> None:
    good = sa.Row("a", "MLP", 8, {"peak_bytes": 1000}, {
        "peak_bytes": 1030, "peak_phase": "backward",
        "verdicts": [{"fits": False}, {"fits": True}],
    })  # fmt: skip
    wrong = sa.Row("b", "MLP", 8, {"peak_bytes": 1000}, {
        "peak_bytes": 990, "peak_phase": "forward",
        "verdicts": [{"fits": True}, {"fits": True}],
    })  # fmt: skip
    broken = sa.Row("c", "MLP", 8, {"error": "exit 1: boom"}, {})
    s = sa.summarize([good, wrong, broken])
    assert s["measured"] == 2 and s["errors"] == ["c bs 8"]
    assert s["verdicts_right"] == 3 and s["verdicts"] == 4
    assert s["max_abs_rel_err"] == pytest.approx(0.03) and s["max_row"] == "a bs 8"
    table = sa.format_table([good, wrong, broken])
    assert "OOM / fits" in table and "fits (wrong) / fits" in table and "error: exit 1" in table


@pytest.mark.slow  # two child processes: a real CPU run under the profiler and a traced one
def test_the_mlp_script_measured_end_to_end(tmp_path: Path) -> None:
    row = sa.measure_row(sa.case("mlp"), 64)
    assert row.ok, (row.truth, row.predicted)
    assert row.truth["events"] > 100 and row.truth["peak_bytes"] > 100 << 20
    assert row.predicted["steps"] == sa.STEPS and row.predicted["stopped_by"] == "done"
    assert row.rel_err is not None and abs(row.rel_err) < 0.01
    assert row.verdicts_right == [True, True]
