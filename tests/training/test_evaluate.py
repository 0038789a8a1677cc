"""training/evaluate.py and `oomcast evaluate`: scoring detectors on a folder of traces."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import support

from oomcast.model.baselines import baseline_by_name, baseline_detectors
from oomcast.model.forecast import AlertRule, Detector
from oomcast.model.schema import Event, Record, Sample
from oomcast.model.trace import TraceError
from oomcast.training.classes import ClassScore
from oomcast.training.evaluate import (
    Causes,
    Score,
    evaluate,
    evaluate_folder,
    first_alert_ts,
    format_table,
    quantile,
    scan_domain,
)

T0 = support.T0
CORE_KEYS = {"recall", "median_lead_s", "false_alarms", "oom_traces", "ok_traces"}
TTO_KEYS = {"tto_rel_err_60s", "tto_rel_err_30s", "tto_rel_err_10s"}
KEYS = CORE_KEYS | TTO_KEYS | {"classes"}


def core(summary: dict[str, Any]) -> dict[str, Any]:
    """The summary keys DESIGN.md fixes."""
    return {k: summary[k] for k in CORE_KEYS}


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
    assert core(s90) == {
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
    assert core(s) == {
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
    no_tto = {"median": None, "p90": None, "n": 0, "missing": 0}
    assert s.summary(10) == {
        "recall": 0.5,
        "median_lead_s": 10.0,
        "false_alarms": 2,
        "oom_traces": 4,
        "ok_traces": 9,
        "tto_rel_err_60s": no_tto,
        "tto_rel_err_30s": no_tto,
        "tto_rel_err_10s": no_tto,
        "classes": ClassScore().summary(),  # none added one by one: no class to count
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
        [sys.executable, "-m", "oomcast.cli.main", "evaluate", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
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


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
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


@pytest.mark.slow  # about 1 s or more (the fast tier leaves it out)
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


# --- per-trace lines, time-to-OOM checks, resampling, causes ----------------------------------

TOTAL = 10**9  # bytes: the fractions below are whole byte counts, so the fits are exact
LINEAR = "predict_linear_w60s_h60s"
THRESH = "threshold_0.90"


def gpu(ts: float, used: int, device: str = "gpu0") -> Sample:
    return Sample(ts=ts, node="n1", device=device, kind="gpu", total_bytes=TOTAL, used_bytes=used)


def oom_event(ts: float, device: str = "gpu0") -> Event:
    return Event(ts=ts, node="n1", device=device, event="oom")


def oom_a(hz: int = 1) -> list[Record]:
    """used = 0.40275 + 0.005 t, sampled at ``hz`` while t < 100, OOM at t = 100 (below
    capacity). predict_linear sees the line exactly: time to OOM 119.45 - t, 19.45 s too late
    everywhere; its 60 s rule fires at t = 60 (1 Hz). Use stays under 0.9: threshold_0.90
    never fires."""
    recs: list[Record] = [
        gpu(T0 + i / hz, 402_750_000 + 5_000_000 * i // hz) for i in range(100 * hz)
    ]
    return [*recs, oom_event(T0 + 100)]


def oom_b() -> list[Record]:
    """used = 0.5005 + 0.01 t at 1 Hz for t < 50, OOM at t = 50: predict_linear says
    49.95 - t, 0.05 s short; it fires at t = 1 (its second sample). 0.9 is passed at t = 40."""
    recs: list[Record] = [gpu(T0 + t, 500_500_000 + 10_000_000 * t) for t in range(50)]
    return [*recs, oom_event(T0 + 50)]


def ok_trace() -> list[Record]:
    """No OOM. gpu0 (first in the file) touches 0.92 at t = 20, gpu1 0.96 at t = 8."""
    recs: list[Record] = []
    for t in range(30):
        recs.append(gpu(T0 + t, 920_000_000 if t == 20 else 500_000_000, "gpu0"))
        recs.append(gpu(T0 + t, 960_000_000 if t == 8 else 500_000_000, "gpu1"))
    return recs


def hand_folder(root: Path) -> Path:
    support.write(root / "oom_a.jsonl", oom_a())
    support.write(root / "oom_b.jsonl.gz", oom_b())
    support.write(root / "ok.jsonl", ok_trace())
    return root


def two() -> list[Detector]:
    return [baseline_by_name(THRESH), baseline_by_name(LINEAR)]


def read_lines(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]


def tto(predicted: float | None, true: float) -> dict[str, float | None]:
    return {"predicted": predicted, "true": true}


EXPECTED_LINES: dict[tuple[str, str], dict[str, Any]] = {
    ("ok.jsonl", THRESH): {
        "oom": False,
        "oom_ts": None,
        "first_alert_ts": T0 + 8,  # gpu1's, the earlier of the two domains' first alerts
        "lead_s": None,
        "false_alarm": True,
        "tto_at": {},
    },
    ("oom_a.jsonl", THRESH): {
        "oom": True,
        "oom_ts": T0 + 100,
        "first_alert_ts": None,
        "lead_s": None,
        "false_alarm": False,
        "tto_at": {"60": tto(None, 60.0), "30": tto(None, 30.0), "10": tto(None, 10.0)},
    },
    ("oom_a.jsonl", LINEAR): {
        "oom": True,
        "oom_ts": T0 + 100,
        "first_alert_ts": T0 + 60,
        "lead_s": 40.0,
        "false_alarm": False,
        "tto_at": {"60": tto(79.45, 60.0), "30": tto(49.45, 30.0), "10": tto(29.45, 10.0)},
    },
    ("oom_b.jsonl.gz", THRESH): {
        "oom": True,
        "oom_ts": T0 + 50,
        "first_alert_ts": T0 + 40,
        "lead_s": 10.0,
        "false_alarm": False,
        "tto_at": {"30": tto(None, 30.0), "10": tto(None, 10.0)},  # no sample 60 s before
    },
    ("oom_b.jsonl.gz", LINEAR): {
        "oom": True,
        "oom_ts": T0 + 50,
        "first_alert_ts": T0 + 1,
        "lead_s": 49.0,
        "false_alarm": False,
        "tto_at": {"30": tto(29.95, 30.0), "10": tto(9.95, 10.0)},
    },
}


def test_per_trace_lines_by_hand(tmp_path: Path) -> None:
    folder = hand_folder(tmp_path / "t")
    out = tmp_path / "out" / "per_trace.jsonl"  # its folder is made
    evaluate_folder(folder, two(), per_trace=out)
    lines = read_lines(out)
    # one line per trace (in find_traces order) and detector (in the order given)
    assert [(x["trace"], x["detector"]) for x in lines] == [
        ("ok.jsonl", THRESH),
        ("ok.jsonl", LINEAR),
        ("oom_a.jsonl", THRESH),
        ("oom_a.jsonl", LINEAR),
        ("oom_b.jsonl.gz", THRESH),
        ("oom_b.jsonl.gz", LINEAR),
    ]
    by_key = {(x["trace"], x["detector"]): x for x in lines}
    for key, want in EXPECTED_LINES.items():
        got = by_key[key]
        assert set(got) == {"trace", "detector", "cause", "class", "span_s", "max_level", *want}
        if got["oom"]:
            assert got["class"] == ("oom_long" if got["span_s"] >= 60 else "oom_short"), key
        else:  # the hand traces stay far below their limit: an alert is a false alarm,
            # unless it came in the trace's last minute (its future unknown)
            assert got["class"] in (("censored", "ordinary") if got["false_alarm"]
                                    else ("ordinary",)), key  # fmt: skip
        assert {k: got[k] for k in want} == want, key
        assert got["cause"] is None  # no manifest
    # predict_linear on the OK trace: whatever it did, the line says it consistently
    ok_linear = by_key[("ok.jsonl", LINEAR)]
    assert ok_linear["oom"] is False and ok_linear["tto_at"] == {}
    assert ok_linear["false_alarm"] is (ok_linear["first_alert_ts"] is not None)


def test_per_trace_takes_an_open_file(tmp_path: Path) -> None:
    import io

    buf = io.StringIO()
    evaluate(
        [baseline_by_name(LINEAR)], [support.write(tmp_path / "a.jsonl", oom_a())], per_trace=buf
    )
    (line,) = [json.loads(x) for x in buf.getvalue().splitlines()]
    assert line["lead_s"] == 40.0 and line["tto_at"]["30"] == tto(49.45, 30.0)


def test_relative_error_summary_by_hand(tmp_path: Path) -> None:
    result = evaluate_folder(hand_folder(tmp_path), two())
    lin = result["detectors"][LINEAR]
    assert core(lin) == {
        "recall": 1.0,
        "median_lead_s": 44.5,  # 40 and 49
        "false_alarms": lin["false_alarms"],
        "oom_traces": 2,
        "ok_traces": 1,
    }
    # |pred - true| / true: oom_a 19.45/60, 19.45/30, 19.45/10; oom_b (none 60 s ahead) 0.05/30,
    # 0.05/10. p90 interpolates between the order statistics.
    assert lin["tto_rel_err_60s"] == {"median": 0.3242, "p90": 0.3242, "n": 1, "missing": 0}
    lo, hi = 0.05 / 30, 19.45 / 30
    assert lin["tto_rel_err_30s"] == {
        "median": round((lo + hi) / 2, 4),
        "p90": round(lo + 0.9 * (hi - lo), 4),
        "n": 2,
        "missing": 0,
    }
    assert lin["tto_rel_err_30s"]["median"] == 0.325
    assert lin["tto_rel_err_30s"]["p90"] == 0.5837
    assert lin["tto_rel_err_10s"] == {"median": 0.975, "p90": 1.751, "n": 2, "missing": 0}
    # the threshold rule never says a time: every check it was asked for is missing
    th = result["detectors"][THRESH]
    assert th["tto_rel_err_60s"] == {"median": None, "p90": None, "n": 0, "missing": 1}
    assert th["tto_rel_err_30s"] == {"median": None, "p90": None, "n": 0, "missing": 2}
    assert th["tto_rel_err_10s"] == {"median": None, "p90": None, "n": 0, "missing": 2}
    assert core(th) == {
        "recall": 0.5,  # oom_b alerted 10 s ahead, oom_a never
        "median_lead_s": 10.0,
        "false_alarms": 1,
        "oom_traces": 2,
        "ok_traces": 1,
    }


def test_quantile_interpolates() -> None:
    assert quantile([3.0], 0.9) == 3.0
    assert quantile([0.0, 10.0], 0.9) == 9.0
    assert quantile([5.0, 1.0, 2.0, 4.0, 3.0], 0.5) == 3.0
    assert quantile(list(map(float, range(11))), 0.9) == 9.0


class _Counting:
    """Wraps a forecaster and counts the samples it is stepped on."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.version = inner.version
        self.horizons_s = inner.horizons_s
        self.steps = 0

    def init_state(self) -> Any:
        return self.inner.init_state()

    def step(self, states: list[Any], samples: list[Sample], embeddings: object = None) -> Any:
        self.steps += len(samples)
        return self.inner.step(states, samples)


def test_one_pass_per_trace_and_no_more_than_needed(tmp_path: Path) -> None:
    base = baseline_by_name(LINEAR)
    fc = _Counting(base.forecaster)
    det = Detector(LINEAR, fc, base.rule)
    evaluate([det], [support.write(tmp_path / "a.jsonl", oom_a())])
    # alert at t = 60, last check at t = 90 (10 s before the OOM): samples 0..90, once each
    assert fc.steps == 91
    fc.steps = 0
    evaluate([det], [support.write(tmp_path / "b.jsonl", oom_b())])
    assert fc.steps == 41  # alert at t = 1, last check at t = 40
    fc.steps = 0
    thr = _Counting(baseline_by_name(THRESH).forecaster)
    evaluate(
        [Detector(THRESH, thr, AlertRule(5, 0.5))],
        [support.write(tmp_path / "o.jsonl", ok_trace())],
    )
    assert thr.steps == 21 + 9  # each domain up to its first alert: gpu0 t <= 20, gpu1 t <= 8


def test_scan_domain_checks_the_last_sample_at_or_before_each_cut() -> None:
    ss = [gpu(T0 + t, 402_750_000 + 5_000_000 * t) for t in range(0, 100, 7)]  # every 7 s
    alert, at = scan_domain(baseline_by_name(LINEAR), ss, T0 + 100, (60, 30, 10))
    assert alert == T0 + 63  # the first sample with 119.45 - t <= 60
    assert {h: ts - T0 for h, (ts, _) in at.items()} == {60: 35, 30: 70, 10: 84}
    assert {h: round(p, 6) for h, (_, p) in at.items() if p is not None} == {
        60: 84.45,
        30: 49.45,
        10: 35.45,
    }
    assert scan_domain(baseline_by_name(LINEAR), ss, T0 + 50, (60,))[1] == {}


def test_resample_scores_a_10hz_trace_as_a_1hz_one(tmp_path: Path) -> None:
    path = support.write(tmp_path / "a10.jsonl", oom_a(hz=10))
    det = [baseline_by_name(LINEAR)]
    native = evaluate(det, [path], per_trace=tmp_path / "native.jsonl")
    resampled = evaluate(det, [path], resample_s=1.0, per_trace=tmp_path / "1hz.jsonl")
    # at 10 Hz the rule fires at t = 59.5 (119.45 - t <= 60); at 1 Hz at t = 60, as on oom_a
    assert native["detectors"][LINEAR]["median_lead_s"] == 40.5
    assert resampled["detectors"][LINEAR]["median_lead_s"] == 40.0
    assert resampled["resample_s"] == 1.0 and "resample_s" not in native
    (line,) = read_lines(tmp_path / "1hz.jsonl")
    want = EXPECTED_LINES[("oom_a.jsonl", LINEAR)]
    assert {k: line[k] for k in want} == want
    with pytest.raises(ValueError, match="resample_s=0"):
        evaluate(det, [path], resample_s=0)


def write_manifest(folder: Path, entries: list[dict[str, Any]], key: str = "runs") -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps({"generator": "test", key: entries}))


def test_causes_from_recorded_and_simulated_manifests(tmp_path: Path) -> None:
    rec = tmp_path / "rec"
    write_manifest(rec, [{"file": "001-leak.jsonl.gz", "cause": "leak"}, {"file": "x.jsonl"}])
    sim = tmp_path / "sim"
    (sim / "test").mkdir(parents=True)
    write_manifest(sim, [{"file": "test/00000-leak.jsonl.gz", "family": "leak_fast"}], "traces")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "manifest.json").write_text("{not json")
    causes = Causes()
    assert causes.of(rec / "001-leak.jsonl.gz") == "leak"
    assert causes.of(rec / "x.jsonl") is None  # named, but without a cause
    assert causes.of(rec / "002.jsonl") is None  # not named
    assert causes.of(sim / "test" / "00000-leak.jsonl.gz") == "leak_fast"  # manifest above
    assert causes.of(tmp_path / "bad" / "t.jsonl") is None
    assert causes.of(tmp_path / "t.jsonl") is None


def test_by_cause_and_the_cause_field(tmp_path: Path) -> None:
    folder = hand_folder(tmp_path / "t")
    support.write(folder / "zz_other.jsonl", oom_b())  # in no manifest: "unknown"
    write_manifest(
        folder,
        [
            {"file": "oom_a.jsonl", "cause": "leak"},
            {"file": "oom_b.jsonl.gz", "cause": "leak"},
            {"file": "ok.jsonl", "cause": "none"},
        ],
    )
    out = tmp_path / "lines.jsonl"
    result = evaluate_folder(folder, two(), by_cause=True, per_trace=out)
    assert set(result) == {"detectors", "min_lead_s", "by_cause"}
    by = result["by_cause"]
    assert list(by) == ["leak", "none", "unknown"]
    assert core(by["leak"][LINEAR]) == {
        "recall": 1.0,
        "median_lead_s": 44.5,
        "false_alarms": 0,
        "oom_traces": 2,
        "ok_traces": 0,
    }
    assert by["leak"][LINEAR]["tto_rel_err_10s"]["median"] == 0.975
    assert core(by["none"][THRESH]) == {
        "recall": None,
        "median_lead_s": None,
        "false_alarms": 1,
        "oom_traces": 0,
        "ok_traces": 1,
    }
    assert core(by["unknown"][THRESH]) == {
        "recall": 1.0,
        "median_lead_s": 10.0,
        "false_alarms": 0,
        "oom_traces": 1,
        "ok_traces": 0,
    }
    assert result["detectors"][THRESH]["oom_traces"] == 3  # the overall summary has them all
    causes = {(x["trace"], x["detector"]): x["cause"] for x in read_lines(out)}
    assert causes[("oom_a.jsonl", THRESH)] == "leak"
    assert causes[("ok.jsonl", LINEAR)] == "none"
    assert causes[("zz_other.jsonl", LINEAR)] is None
    table = format_table(result)
    assert "cause: leak" in table and "cause: unknown" in table


def test_cli_per_trace_resample_and_by_cause(tmp_path: Path) -> None:
    folder = tmp_path / "t"
    support.write(folder / "a10.jsonl", oom_a(hz=10))
    write_manifest(folder, [{"file": "a10.jsonl", "cause": "leak"}])
    lines = tmp_path / "lines.jsonl"
    proc = cli(
        "--traces", str(folder), "--json", "--resample-s", "1", "--per-trace", str(lines),
        "--by-cause",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert result["resample_s"] == 1.0
    assert set(result["by_cause"]) == {"leak"}
    assert result["by_cause"]["leak"][LINEAR]["median_lead_s"] == 40.0
    lin = result["detectors"][LINEAR]
    assert lin["median_lead_s"] == 40.0
    assert lin["tto_rel_err_30s"] == {"median": 0.6483, "p90": 0.6483, "n": 1, "missing": 0}
    got = read_lines(lines)
    assert {x["detector"] for x in got} == set(result["detectors"])  # one line per detector
    (line,) = [x for x in got if x["detector"] == LINEAR]
    assert line["trace"] == "a10.jsonl" and line["cause"] == "leak"
    assert line["lead_s"] == 40.0
    assert line["tto_at"] == {
        "60": tto(79.45, 60.0),
        "30": tto(49.45, 30.0),
        "10": tto(29.45, 10.0),
    }


@pytest.mark.parametrize("value", ["0", "-1", "nan"])
def test_cli_refuses_a_bad_resample(tmp_path: Path, value: str) -> None:
    support.write(tmp_path / "a.jsonl", oom_a())
    proc = cli("--traces", str(tmp_path), "--json", "--resample-s", value)
    assert proc.returncode == 2
    assert "--resample-s" in proc.stderr
    assert "Traceback" not in proc.stderr
