"""training/evaluate.py and `oomcast evaluate`: scoring detectors on a folder of traces."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import support

from oomcast.model.baselines import baseline_by_name, baseline_detectors
from oomcast.model.forecast import AlertRule, Detector
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import TraceError
from oomcast.training.evaluate import (
    Score,
    evaluate,
    evaluate_folder,
    first_alert_ts,
    format_table,
)

T0 = support.T0
KEYS = {"recall", "median_lead_s", "false_alarms", "oom_traces", "ok_traces"}

# name -> records; leads of threshold_0.90 are roughly 60, 26 and 12 s
LEAKS: dict[str, list[Record]] = {
    "leak_long.jsonl": support.leak_trace(seconds_to_oom=300, seed=0),
    "leak_mid.jsonl.gz": support.leak_trace(start_frac=0.85, seconds_to_oom=40, seed=1),
    "leak_short.jsonl": support.leak_trace(start_frac=0.5, seconds_to_oom=60, seed=2),
}
STEADY: dict[str, list[Record]] = {
    "steady_cool.jsonl": support.steady_trace(level=0.7),  # peaks at 0.75
    "steady_hot.jsonl": support.steady_trace(level=0.88, amplitude=0.05),  # peaks at 0.93
    "steady_hot2.jsonl.gz": support.steady_trace(level=0.89, amplitude=0.03, device="gpu3"),
}


def hand_lead(records: list[Record], frac: float) -> float | None:
    """oom ts minus the first ts with used_frac >= frac, straight from the records."""
    oom = next(r.ts for r in records if isinstance(r, Event) and r.event == "oom")
    for r in records:
        if isinstance(r, Sample) and r.ts < oom and r.used_bytes / r.total_bytes >= frac:
            return oom - r.ts
    return None


def hand_leads(frac: float) -> list[float]:
    leads = [hand_lead(recs, frac) for recs in LEAKS.values()]
    assert all(lead is not None for lead in leads), leads
    return [lead for lead in leads if lead is not None]


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    d = tmp_path / "traces"
    for name, recs in {**LEAKS, **STEADY}.items():
        support.write(d / name, recs)
    (d / "README.txt").write_text("not a trace")
    return d


def threshold(frac: float) -> Detector:
    return baseline_by_name(f"threshold_{frac:.2f}")


def test_hand_leads_are_what_the_fixture_intends() -> None:
    long_, mid, short = hand_leads(0.9)
    assert 55 <= long_ <= 65
    assert 20 <= mid <= 32
    assert 8 <= short <= 16


def test_threshold_lead_on_a_linear_leak(tmp_path: Path) -> None:
    recs = LEAKS["leak_long.jsonl"]
    support.write(tmp_path / "one.jsonl", recs)
    expected = hand_lead(recs, 0.9)
    assert expected is not None
    result = evaluate_folder(tmp_path, [threshold(0.9)])
    s = result["detectors"]["threshold_0.90"]
    assert s["median_lead_s"] == pytest.approx(expected, abs=0.005)
    assert s["recall"] == 1.0
    assert s["oom_traces"] == 1
    assert s["ok_traces"] == 0
    assert s["false_alarms"] == 0


def test_scores_by_hand(folder: Path) -> None:
    leads90 = hand_leads(0.9)
    leads95 = hand_leads(0.95)
    result = evaluate_folder(folder, [threshold(0.9), threshold(0.95)], min_lead_s=30)
    assert result["min_lead_s"] == 30
    s90 = result["detectors"]["threshold_0.90"]
    assert s90 == {
        "recall": round(1 / 3, 4),  # only the long leak is alerted >= 30 s ahead
        "median_lead_s": pytest.approx(statistics.median(leads90), abs=0.005),
        "false_alarms": 2,  # steady_hot and steady_hot2, once each however often they fire
        "oom_traces": 3,
        "ok_traces": 3,
    }
    s95 = result["detectors"]["threshold_0.95"]
    assert s95["false_alarms"] == 0  # nothing steady reaches 0.95
    assert s95["median_lead_s"] == pytest.approx(statistics.median(leads95), abs=0.005)
    assert s95["recall"] == round(sum(lead >= 30 for lead in leads95) / 3, 4)


@pytest.mark.parametrize(("min_lead", "recall"), [(0, 1.0), (10, 1.0), (20, 2 / 3), (70, 0.0)])
def test_recall_at_min_lead(folder: Path, min_lead: float, recall: float) -> None:
    result = evaluate_folder(folder, [threshold(0.9)], min_lead_s=min_lead)
    assert result["detectors"]["threshold_0.90"]["recall"] == round(recall, 4)
    assert result["min_lead_s"] == min_lead


def test_alerts_on_other_domains_or_after_the_oom_do_not_count(tmp_path: Path) -> None:
    # gpu0 OOMs at T0 + 30 without ever passing 0.9 before it; gpu1 is over 0.9 all along;
    # after the OOM gpu0 reads 0.95 (a late sample must not count as an alert)
    recs: list[Record] = [support.sample(T0 + t, 0.5) for t in range(30)]
    recs += [support.sample(T0 + t, 0.95, device="gpu1") for t in range(30)]
    recs.append(Event(ts=T0 + 30, node="n1", device="gpu0", event="oom"))
    recs.append(support.sample(T0 + 31, 0.95))
    recs.sort(key=lambda r: (r.ts, isinstance(r, Event)))
    support.write(tmp_path / "t.jsonl", recs)
    s = evaluate_folder(tmp_path, [threshold(0.9)])["detectors"]["threshold_0.90"]
    assert s == {
        "recall": 0.0,
        "median_lead_s": None,
        "false_alarms": 0,
        "oom_traces": 1,
        "ok_traces": 0,
    }


def test_false_alarm_on_any_domain_of_an_ok_trace(tmp_path: Path) -> None:
    recs: list[Record] = []
    for t in range(20):
        recs.append(support.sample(T0 + t, 0.5, device="gpu0"))
        recs.append(support.sample(T0 + t, 0.91 if t == 17 else 0.5, device="gpu1"))
    support.write(tmp_path / "ok.jsonl", recs)
    s = evaluate_folder(tmp_path, [threshold(0.9)])["detectors"]["threshold_0.90"]
    assert s["false_alarms"] == 1
    assert s["ok_traces"] == 1
    assert s["oom_traces"] == 0
    assert s["recall"] is None
    assert s["median_lead_s"] is None


def test_first_alert_ts_stops_before_until() -> None:
    ss = [support.sample(T0 + t, 0.95 if t >= 5 else 0.5) for t in range(10)]
    det = threshold(0.9)
    assert first_alert_ts(det, ss, None) == T0 + 5
    assert first_alert_ts(det, ss, T0 + 6) == T0 + 5
    assert first_alert_ts(det, ss, T0 + 5) is None


def test_rule_horizon_matters() -> None:
    # predict_linear on 0.4995 + 0.001 t projects an OOM 500.5 - t s ahead: a 60 s rule fires
    # first at t = 441, a 300 s rule at t = 201
    total = 10**9
    ss = [
        Sample(
            ts=T0 + t,
            node="n1",
            device="gpu0",
            kind="gpu",
            total_bytes=total,
            used_bytes=round((0.4995 + 0.001 * t) * total),
        )
        for t in range(500)
    ]
    fc = baseline_by_name("predict_linear_w60s_h60s").forecaster
    assert first_alert_ts(Detector("a", fc, AlertRule(60, 0.5)), ss, None) == T0 + 441
    assert first_alert_ts(Detector("b", fc, AlertRule(300, 0.5)), ss, None) == T0 + 201


def test_score_summary_rounding() -> None:
    s = Score(leads_s=[10.0, 40.123, 7.0], missed=1, false_alarms=2, oom_traces=4, ok_traces=9)
    assert s.summary(10) == {
        "recall": 0.5,
        "median_lead_s": 10.0,
        "false_alarms": 2,
        "oom_traces": 4,
        "ok_traces": 9,
    }
    assert s.summary(40.2)["recall"] == 0.0
    assert Score(leads_s=[1.0, 2.0, 4.0]).summary(0)["recall"] is None


def test_evaluate_takes_paths_and_every_baseline(folder: Path) -> None:
    paths = sorted(folder.glob("*.json*"))
    assert len(paths) == 6
    result = evaluate(baseline_detectors(), paths)
    assert set(result) == {"detectors", "min_lead_s"}
    assert result["min_lead_s"] == 10.0
    assert set(result["detectors"]) == {d.name for d in baseline_detectors()}
    for s in result["detectors"].values():
        assert set(s) == KEYS
        assert s["oom_traces"] == 3
        assert s["ok_traces"] == 3


def test_evaluate_folder_refuses_an_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="no traces"):
        evaluate_folder(tmp_path, [threshold(0.9)])


def test_evaluate_folder_names_the_corrupt_line(folder: Path) -> None:
    bad = folder / "zz_bad.jsonl"
    bad.write_text(json.dumps(support.sample().to_dict()) + "\n\n{oops\n", encoding="utf-8")
    with pytest.raises(TraceError) as info:
        evaluate_folder(folder, [threshold(0.9)])
    assert info.value.line == 3
    assert info.value.path == str(bad)


def test_format_table(folder: Path) -> None:
    result = evaluate_folder(folder, [threshold(0.9)], min_lead_s=20)
    table = format_table(result)
    lines = table.splitlines()
    assert lines[0].split()[0] == "detector"
    assert set(lines[1].replace(" ", "")) == {"-"}
    row = lines[2].split()
    assert row[0] == "threshold_0.90"
    assert row[1] == "66.7%"
    assert row[3] == "2/3"
    assert lines[-1].endswith("at least 20s ahead")


# --- the CLI ---------------------------------------------------------------------------------


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "oomcast.service.cli", "evaluate", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_json_prints_one_object(folder: Path) -> None:
    proc = cli("--traces", str(folder), "--json")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout.strip()
    assert "\n" not in out  # exactly one line, one object
    result = json.loads(out)
    assert set(result) == {"detectors", "min_lead_s"}
    assert result["min_lead_s"] == 10
    # the shipped model is scored first, beside every baseline
    assert next(iter(result["detectors"])) == "model"
    assert set(result["detectors"]) == {"model"} | {d.name for d in baseline_detectors()}
    for name, s in result["detectors"].items():
        assert set(s) == KEYS, name
        assert s["oom_traces"] == 3
        assert s["ok_traces"] == 3
    t90 = result["detectors"]["threshold_0.90"]
    leads = hand_leads(0.9)
    assert t90["recall"] == 1.0
    assert t90["false_alarms"] == 2
    assert t90["median_lead_s"] == pytest.approx(statistics.median(leads), abs=0.005)


def test_cli_min_lead_changes_min_lead_s(folder: Path) -> None:
    proc = cli("--traces", str(folder), "--json", "--min-lead", "30")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["min_lead_s"] == 30
    assert result["detectors"]["threshold_0.90"]["recall"] == round(1 / 3, 4)


def test_cli_table_without_json(folder: Path) -> None:
    proc = cli("--traces", str(folder))
    assert proc.returncode == 0, proc.stderr
    assert "threshold_0.90" in proc.stdout
    assert "kubelet_100MiB_10s" in proc.stdout
    with pytest.raises(json.JSONDecodeError):
        json.loads(proc.stdout)


def test_cli_corrupt_trace_exits_2_with_file_and_line(folder: Path) -> None:
    bad = folder / "sub" / "bad.jsonl"
    bad.parent.mkdir()
    good = json.dumps(support.sample().to_dict())
    bad.write_text(f"{good}\n{good}\n", encoding="utf-8")  # same ts twice: line 2
    proc = cli("--traces", str(folder), "--json")
    assert proc.returncode == 2
    assert f"{bad}:2:" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_cli_empty_folder_exits_2(tmp_path: Path) -> None:
    proc = cli("--traces", str(tmp_path), "--json")
    assert proc.returncode == 2
    assert "no traces" in proc.stderr
    assert str(tmp_path) in proc.stderr
    assert "Traceback" not in proc.stderr
    assert proc.stdout == ""


def test_cli_missing_folder_exits_2(tmp_path: Path) -> None:
    proc = cli("--traces", str(tmp_path / "nope"), "--json")
    assert proc.returncode == 2
    assert "not a folder" in proc.stderr


def test_cli_takes_several_folders_and_files(folder: Path, tmp_path: Path) -> None:
    one = sorted(folder.rglob("*.jsonl*"))[0]
    both = json.loads(cli("--traces", str(folder), "--json").stdout)
    alone = json.loads(cli("--traces", str(one), "--json").stdout)
    mixed = json.loads(cli("--traces", str(folder), str(one), "--json").stdout)
    name = "threshold_0.90"
    total = both["detectors"][name]["oom_traces"] + both["detectors"][name]["ok_traces"]
    alone_total = alone["detectors"][name]["oom_traces"] + alone["detectors"][name]["ok_traces"]
    assert alone_total == 1
    mixed_d = mixed["detectors"][name]
    assert mixed_d["oom_traces"] + mixed_d["ok_traces"] == total + 1


class _SeesAllocator:
    """Fires on any sample that reports allocated bytes: shows which view evaluate scored."""

    version = "test/sees-allocator"
    horizons_s = (60,)

    def init_state(self) -> None:
        return None

    def step(self, states: list[None], samples: list[Sample], embeddings: object = None) -> list:  # type: ignore[type-arg]
        from oomcast.model.forecast import Forecast, RiskRow

        return [
            Forecast(
                RiskRow({60: 0}, [1.0 if s.allocated_bytes else 0.0]), None, s.ts, self.version
            )
            for s in samples
        ]


def test_view_nvml_scores_gpu_samples_without_allocator_figures(tmp_path: Path) -> None:
    from dataclasses import replace

    records = [
        replace(r, allocated_bytes=1) if isinstance(r, Sample) else r
        for r in support.steady_trace(seconds=60)
    ]
    path = support.write(tmp_path / "ok.jsonl", records)
    det = Detector("sees", _SeesAllocator(), AlertRule(60, 0.5))
    assert evaluate([det], [path])["detectors"]["sees"]["false_alarms"] == 1
    nvml = evaluate([det], [path], view="nvml")
    assert nvml["view"] == "nvml" and nvml["detectors"]["sees"]["false_alarms"] == 0
    with pytest.raises(ValueError, match="view='dcgm'"):
        evaluate([det], [path], view="dcgm")
