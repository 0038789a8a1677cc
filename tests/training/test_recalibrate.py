"""training/recalibrate.py and ``oomcast recalibrate``: a model whose risks are too low is
refit upwards and scores better; the refit is written only when asked, into a new file that
loads, carries the new version and rule, and whose risks are the correction of the
original's; too few OOMs is refused; bad input is named.

The fleet is plain shapes of ``training/shapes.py`` (straight leaks to an OOM, flat lines,
climbs that level off, sawtooths, allocator caches), at most 10 minutes each, seen at 1 Hz.
The model "too low" is the shipped one with its risks pushed down in logit space inside the
graph: sigmoid(logit(risk) - 2)."""

from __future__ import annotations

import json
import random
import subprocess
import sys
from datetime import date
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

import oomcast.training.recalibrate as rc
from oomcast.cli.common import SHIPPED_MODEL
from oomcast.cli.main import main
from oomcast.model.forecast import AlertRule, Detector
from oomcast.model.runtime import RECALIBRATION_KEY, OnnxForecaster
from oomcast.model.trace import downsample_trace, find_traces, load_trace, write_trace
from oomcast.training.dataset import sequences_of_trace
from oomcast.training.evaluate import evaluate
from oomcast.training.shapes import SHAPES

HORIZONS = (5, 15, 30, 45, 60, 120, 300)
DAY = date(2026, 1, 2)


def write_fleet(folder: Path, leaks: int, others: int, seed: int = 0) -> Path:
    """``leaks`` traces that OOM and ``others`` that never do, drawn from the shapes in
    turn (those longer than 10 minutes are drawn again), at 1 Hz."""
    quiet = [name for name in SHAPES if name != "leak"]
    want = {"leak": leaks, "quiet": others}
    made = {"leak": 0, "quiet": 0}
    i = 0
    while made != want:
        i += 1
        shape = "leak" if i % 2 else quiet[(i // 2) % len(quiet)]
        key = "leak" if shape == "leak" else "quiet"
        if made[key] == want[key]:
            continue
        trace = SHAPES[shape](random.Random(seed * 7919 + i), i)
        samples = next(iter(trace.samples.values()))
        if samples[-1].ts - samples[0].ts > 600:
            continue
        trace = downsample_trace(trace, 1.0)
        write_trace(folder / f"{i:04d}-{shape}.jsonl.gz", trace.records())
        made[key] += 1
    return folder


def lowered(src: Path, out: Path, shift: float = -2.0) -> Path:
    """The model with sigmoid(logit(risk) + shift) as its risk: a shut gate (0) stays 0."""
    model = onnx.load(str(src))
    graph = model.graph
    for node in graph.node:
        node.output[:] = ["risk_net" if o == "risk" else o for o in node.output]
    graph.initializer.extend([
        numpy_helper.from_array(np.asarray(1.0, np.float32), "low_one"),
        numpy_helper.from_array(np.asarray(shift, np.float32), "low_shift"),
    ])  # fmt: skip
    graph.node.extend([
        helper.make_node("Log", ["risk_net"], ["low_log_p"]),
        helper.make_node("Sub", ["low_one", "risk_net"], ["low_q"]),
        helper.make_node("Log", ["low_q"], ["low_log_q"]),
        helper.make_node("Sub", ["low_log_p", "low_log_q"], ["low_z"]),
        helper.make_node("Add", ["low_z", "low_shift"], ["low_z2"]),
        helper.make_node("Sigmoid", ["low_z2"], ["risk"]),
    ])  # fmt: skip
    for prop in model.metadata_props:
        if prop.key == "oomcast.version":
            prop.value = "low-1"
    onnx.save(model, str(out))
    return out


def corrected(risks: np.ndarray, table: dict[int, tuple[float, float]]) -> np.ndarray:
    """The correction written out here, apart from the runtime's."""
    a = np.asarray([table[h][0] for h in HORIZONS])
    b = np.asarray([table[h][1] for h in HORIZONS])
    p = np.clip(risks.astype(np.float64), 1e-6, 1 - 1e-6)
    out = 1.0 / (1.0 + np.exp(-(a * np.log(p / (1 - p)) + b)))
    out[risks <= 0] = 0.0
    return np.maximum.accumulate(out, axis=1)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fleet(tmp_path_factory.mktemp("fleet"), leaks=12, others=24)


@pytest.fixture(scope="module")
def low_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return lowered(SHIPPED_MODEL, tmp_path_factory.mktemp("low") / "low.onnx")


@pytest.fixture
def few_hours(monkeypatch: pytest.MonkeyPatch) -> None:
    """The small fleet holds 3.6 job-hours: the other two floors are kept."""
    monkeypatch.setattr(rc, "MIN_JOB_HOURS", 1.0)


def refit(model: Path, fleet: Path) -> rc.Result:
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(rc, "MIN_JOB_HOURS", 1.0)
        return rc.recalibrate(model, {str(fleet): find_traces(fleet)}, today=DAY)


@pytest.fixture(scope="module")
def result(low_model: Path, fleet: Path) -> rc.Result:
    return refit(low_model, fleet)


@pytest.fixture(scope="module")
def written(result: rc.Result, low_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return rc.write_model(low_model, tmp_path_factory.mktemp("out") / "new.onnx", result)


@pytest.mark.slow  # the module's refit: about 5 s on 2 cores, once
def test_risks_too_low_are_raised_and_score_better(result: rc.Result) -> None:
    ev = result.evidence
    assert (ev.traces, ev.long_ooms, ev.oom_free, ev.kept_traces) == (36, 12, 24, 0)
    shipped, new = result.columns["shipped"], result.columns["refit"]
    fitted = [h for h, ab in result.table.items() if ab != (1.0, 0.0)]
    assert len(fitted) >= 5, result.table
    for h in fitted:
        s, r = shipped["calibration"][str(h)], new["calibration"][str(h)]
        assert r["mean_risk"] > s["mean_risk"], (h, s, r)
        assert r["brier"] < s["brier"], (h, s, r)
        assert abs(r["mean_risk"] - r["observed"]) < abs(s["mean_risk"] - s["observed"])
    # the rule training's choice keeps: no ordinary run alerted, more long OOMs warned
    assert shipped["rule"] == {"horizon_s": 45, "fire_risk": 0.189915, "fire_after": 1}
    assert new["scores"]["false_alarms"] == 0
    assert new["scores"]["long_warned_30s"] > shipped["scores"]["long_warned_30s"]
    assert result.new_version == "low-1+fleet.20260102"
    text = rc.format_report(result)
    assert "Nothing was written" in text and "biased sample" in text


@pytest.mark.slow
def test_the_written_model_carries_the_refit(
    result: rc.Result, written: Path, low_model: Path, fleet: Path
) -> None:
    fc = OnnxForecaster(written)
    assert fc.version == "low-1+fleet.20260102"
    assert fc.rule == AlertRule(result.rule["horizon_s"], result.rule["fire_risk"], 1)
    assert fc.rule == result.refit_rule()
    assert fc.recalibration == result.table
    assert fc.tto_min_risk == min(0.5, result.rule["fire_risk"])
    assert json.loads(fc.metadata[RECALIBRATION_KEY]) == {
        str(h): list(ab) for h, ab in result.table.items()
    }
    made = json.loads(fc.metadata[rc.PROVENANCE_KEY])
    assert made["from_version"] == "low-1" and made["evidence"]["long_ooms"] == 12
    low = OnnxForecaster(low_model)
    assert {k: v for k, v in fc.metadata.items() if k not in rc.WRITTEN_KEYS} == {
        k: v for k, v in low.metadata.items() if k not in rc.WRITTEN_KEYS
    }
    leak = next(p for p in find_traces(fleet) if p.name.endswith("-leak.jsonl.gz"))
    samples = next(iter(load_trace(leak).samples.values()))
    before = np.asarray([[f.risk[h] for h in HORIZONS] for f in low.window(samples)])
    after = np.asarray([[f.risk[h] for h in HORIZONS] for f in fc.window(samples)])
    np.testing.assert_allclose(after, corrected(before, result.table), rtol=2e-6, atol=1e-7)
    assert after.mean() > before.mean()


@pytest.mark.slow
def test_the_rule_is_trainings_choice_on_the_written_models_risks(
    result: rc.Result, written: Path, fleet: Path
) -> None:
    """Training's rule choice, run here on the written model's own forecasts (stepped by
    the runtime, one per tick at 1 Hz), picks the rule the refit carries."""
    from oomcast.training.train import best_rule, score_rules

    fc = OnnxForecaster(written)
    seqs, risks = [], []
    for path in find_traces(fleet):
        trace = load_trace(path)
        for seq in sequences_of_trace(trace, path.name):
            seq.group = str(fleet)
            samples = next(iter(trace.samples.values()))
            risk = np.asarray([[f.risk[h] for h in HORIZONS] for f in fc.window(samples)])
            assert len(risk) == len(seq.x)  # 1 Hz: every sample is a tick
            seqs.append(seq)
            risks.append(risk)
    chosen = best_rule(score_rules(seqs, risks, 0.02), 0.02)
    assert (chosen.horizon_s, chosen.fire_after) == (result.rule["horizon_s"], 1)
    assert chosen.fire_risk == pytest.approx(result.rule["fire_risk"], rel=1e-4)
    assert chosen.recall_30 == result.rule["recall_30"]


@pytest.mark.slow
def test_evaluate_on_the_written_model_gives_the_refit_column(
    result: rc.Result, written: Path, fleet: Path
) -> None:
    fc = OnnxForecaster(written)
    got = evaluate([Detector("model", fc, fc.rule)], find_traces(fleet))["detectors"]["model"]
    scores = result.columns["refit"]["scores"]
    classes = got["classes"]
    assert classes["oom_long"]["warned_30s"] == scores["long_warned_30s"]
    assert classes["oom_long"]["warned_10s"] == scores["long_warned_10s"]
    assert classes["oom_long"]["median_lead_s"] == scores["median_lead_s"]
    assert classes["ordinary"]["false_alarms"] == scores["false_alarms"]
    assert classes["near_miss"]["warned"] == scores["near_misses_alerted"]
    assert classes["censored"]["n"] == scores["censored"]


@pytest.mark.slow
def test_a_refit_model_is_refit_from_the_network_not_on_top(
    result: rc.Result, written: Path, fleet: Path
) -> None:
    """Refitting the written model replaces its correction: the same table again, and its
    column as it is is the first refit's."""
    again = refit(written, fleet)
    assert again.table == result.table
    assert again.columns["shipped"]["calibration"] == result.columns["refit"]["calibration"]
    assert again.new_version == "low-1+fleet.20260102"  # named from its base, not stacked


@pytest.mark.slow  # it takes the module's refit
def test_write_model_never_replaces_a_file(
    result: rc.Result, low_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "taken.onnx"
    out.write_bytes(b"keep me")
    with pytest.raises(FileExistsError):
        rc.write_model(low_model, out, result)
    assert out.read_bytes() == b"keep me"


@pytest.mark.slow  # the first to import training's code (and torch): about 1.5 s alone
def test_too_few_ooms_is_refused(
    tmp_path: Path, few_hours: None, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_fleet(tmp_path / "thin", leaks=5, others=24, seed=1)
    with pytest.raises(rc.TooLittleEvidence) as err:
        rc.recalibrate(SHIPPED_MODEL, {str(folder): find_traces(folder)})
    assert err.value.evidence.long_ooms == 5
    assert "the 29 traces hold too few long OOMs (5; need 10) for a refit" in str(err.value)
    assert "(enough: runs that never OOMed 24, job-hours" in str(err.value)
    assert main(["recalibrate", "--traces", str(folder), "--no-progress"]) == 3
    out = capsys.readouterr()
    assert "recalibrate: error: refused" in out.err and "long OOMs (5; need 10)" in out.err
    assert not out.out


@pytest.mark.slow  # imports training's code (and torch) when run alone: about 1.5 s
def test_too_few_job_hours_is_refused(tmp_path: Path) -> None:
    folder = write_fleet(tmp_path / "short", leaks=10, others=20, seed=2)
    with pytest.raises(rc.TooLittleEvidence) as err:
        rc.recalibrate(SHIPPED_MODEL, {str(folder): find_traces(folder)})
    assert err.value.evidence.job_hours < rc.MIN_JOB_HOURS
    assert f"too few job-hours ({err.value.evidence.job_hours:.2f}; need 5)" in str(err.value)
    assert "long OOMs" not in str(err.value).split("(enough: ")[0]


@pytest.mark.slow
def test_the_cli_prints_both_columns_and_writes_only_a_new_file(
    fleet: Path,
    low_model: Path,
    tmp_path: Path,
    few_hours: None,
    capsys: pytest.CaptureFixture[str],
) -> None:
    out = tmp_path / "shadow.onnx"
    listing = sorted(fleet.iterdir())
    argv = ["recalibrate", "--traces", str(fleet), "--model", str(low_model), "--no-progress"]
    assert main([*argv, "--out", str(out)]) == 0
    text = capsys.readouterr().out
    header = next(line for line in text.splitlines() if "shipped" in line and "refit" in line)
    assert header.split() == ["shipped", "refit"]
    assert "low-1+fleet." in text and "Brier" in text and "long OOMs warned >= 30 s" in text
    assert "biased sample" in text and f"OOMCAST_SHADOW_MODEL_PATH={out}" in text
    assert OnnxForecaster(out).version.startswith("low-1+fleet.")
    before = out.read_bytes()
    assert main([*argv, "--out", str(out)]) == 2  # refused before any work
    assert "the file exists" in capsys.readouterr().err
    assert out.read_bytes() == before
    assert sorted(fleet.iterdir()) == listing  # nothing written beside the traces


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--traces", "{tmp}/nowhere"], "--traces {tmp}/nowhere: not a folder or file"),
        (["--traces", "{tmp}/empty"], "--traces {tmp}/empty: no traces"),
        (["--traces", "{tmp}/fleet", "--model", "{tmp}/junk.onnx"], "--model {tmp}/junk.onnx"),
        (["--traces", "{tmp}/fleet", "--model", "{tmp}/absent.onnx"], "no model file"),
        (["--traces", "{tmp}/fleet", "--out", "{tmp}/no/such/new.onnx"], "does not exist"),
    ],
)
def test_bad_input_is_named(
    args: list[str], said: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "empty").mkdir()
    (tmp_path / "junk.onnx").write_bytes(b"not a model")
    write_fleet(tmp_path / "fleet", leaks=1, others=1)
    argv = [a.format(tmp=tmp_path) for a in args]
    assert main(["recalibrate", *argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert said.format(tmp=tmp_path) in err, err
    assert "Traceback" not in err


def test_out_on_an_existing_file_is_refused_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = write_fleet(tmp_path / "fleet", leaks=1, others=1)
    out = tmp_path / "taken.onnx"
    out.write_bytes(b"keep me")
    argv = ["recalibrate", "--traces", str(folder), "--out", str(out), "--no-progress"]
    assert main(argv) == 2
    assert f"--out {out}: the file exists" in capsys.readouterr().err
    assert out.read_bytes() == b"keep me"


def test_fleet_version_names_a_refit_from_its_base() -> None:
    assert (
        rc.fleet_version("lstm-2026.12.04b", date(2026, 12, 5)) == "lstm-2026.12.04b+fleet.20261205"
    )
    assert rc.fleet_version("v1+fleet.20260101", date(2026, 3, 4)) == "v1+fleet.20260304"


def test_the_command_and_the_module_load_no_torch() -> None:
    code = (
        "import sys, oomcast.cli.main, oomcast.training.recalibrate;"
        " sys.exit('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def fake_seq(risk_at_tto: dict[str, float], *, oom: bool, level: float, group: str = "g") -> tuple:
    """A 1 Hz sequence of 121 ticks and its risks (ticks, H): an OOM at its end when
    ``oom`` (then the risk is ``risk_at_tto[k]`` from ``k`` seconds before it), else a run
    that reached ``level`` and whose risk is ``risk_at_tto["all"]`` throughout."""
    from oomcast.training.dataset import Sequence

    n = 121
    tto = np.arange(n - 1, -1, -1, dtype=np.float64) if oom else np.full(n, np.inf)
    seq = Sequence(
        name="s", x=np.zeros((n, 1), np.float32), y=np.zeros((n, len(HORIZONS)), np.float32),
        m=np.ones((n, len(HORIZONS)), np.float32), tto=tto, ooms=oom, group=group,
        oom_after_s=float(n - 1) if oom else None, max_level=level, span_s=float(n - 1),
    )  # fmt: skip
    risk = np.full((n, len(HORIZONS)), risk_at_tto.get("all", 0.0), np.float32)
    for ahead, r in sorted(risk_at_tto.items()):
        if ahead != "all":
            risk[tto <= float(ahead)] = r
    return seq, risk


def test_a_ceiling_that_holds_the_rule_back_is_named_with_what_dropping_it_buys() -> None:
    # ten leaks at 0.9 from 40 s before their OOM and 0.95 in their last 5 s; four near
    # misses at 0.9 (a straight climb that stopped short); twenty quiet runs
    leaks = [fake_seq({"40": 0.9, "5": 0.95}, oom=True, level=1.0) for _ in range(10)]
    near = [fake_seq({"all": 0.9}, oom=False, level=0.95) for _ in range(4)]
    quiet = [fake_seq({}, oom=False, level=0.5) for _ in range(20)]
    seqs, risks = map(list, zip(*leaks, *near, *quiet, strict=True))
    rule, _ = rc.choose_rule(seqs, risks)
    assert rule["recall_30"] == 0.0  # above 0.9 only in the last 5 s
    binding = rc.binding_ceilings(seqs, risks, rule)
    assert set(binding) == {"near_misses"}
    assert binding["near_misses"]["recall_30"] == 1.0
    assert binding["near_misses"]["near_miss_warned"] == 1.0
    note = rc._ceiling_note(rule, "near_misses", binding["near_misses"])
    assert "at most half of the near misses" in note and "100% of them" in note

    # the same, with one quiet run of five in a group of its own alerting at 0.9 instead
    loud = [fake_seq({"all": 0.9}, oom=False, level=0.5, group="h")]
    loud += [fake_seq({}, oom=False, level=0.5, group="h") for _ in range(4)]
    seqs, risks = map(list, zip(*leaks, *quiet, *loud, strict=True))
    rule, _ = rc.choose_rule(seqs, risks)
    binding = rc.binding_ceilings(seqs, risks, rule)
    assert set(binding) == {"false_alarms"} and binding["false_alarms"]["recall_30"] == 1.0
    # a horizon that alerts on no near miss (and warns nothing) must not hide the others
    seqs, risks = map(list, zip(*leaks, *near, *quiet, strict=True))
    risks = [r.copy() for r in risks]
    for r in risks:
        r[:, 0] = 0.0  # the 5 s horizon: quiet everywhere
    rule, _ = rc.choose_rule(seqs, risks)
    assert rule["recall_30"] == 0.0
    binding = rc.binding_ceilings(seqs, risks, rule)
    assert set(binding) == {"near_misses"} and binding["near_misses"]["recall_30"] == 1.0
    # nothing holds back a rule that already warns them all
    seqs, risks = map(list, zip(*leaks, *quiet, strict=True))
    rule, _ = rc.choose_rule(seqs, risks)
    assert rule["recall_30"] == 1.0 and rc.binding_ceilings(seqs, risks, rule) == {}


def test_the_correction_is_fitted_where_the_straight_line_adds_nothing() -> None:
    # the network's ticks are calibrated (label drawn at the risk); the line's are certain
    # and wrong (a climb that stopped short). Fitted on everything, the slope collapses.
    rng = np.random.default_rng(0)
    n, H = 4000, len(HORIZONS)
    r = rng.uniform(0.02, 0.6, (n, H)).astype(np.float32)
    y = (rng.uniform(size=(n, H)) < r).astype(np.float32)
    r[:400] = 1.0 - 1e-6
    y[:400] = 0.0
    seq, _ = fake_seq({}, oom=False, level=0.5)
    seq.y, seq.m = y, np.ones((n, H), np.float32)
    off = np.ones((n, H), bool)
    off[:400] = False
    every = rc.fit_table([r], [seq], HORIZONS)
    network = rc.fit_table([r], [seq], HORIZONS, [off])
    assert all(every[h][0] < 0.5 for h in HORIZONS)
    assert all(0.7 < network[h][0] < 1.4 for h in HORIZONS)


@pytest.mark.slow  # torch, and a shape's embedding
def test_line_off_marks_the_straight_climb_and_nothing_of_a_flat_run() -> None:
    leak = SHAPES["leak"](random.Random(2), 2)  # a clean one: some draws are noisy
    flat = SHAPES["flat"](random.Random(3), 3)
    [leak_seq] = sequences_of_trace(leak, "leak")
    [flat_seq] = sequences_of_trace(flat, "flat")
    [leak_off, flat_off] = rc.line_off([leak_seq, flat_seq], HORIZONS)
    assert leak_off.shape == (len(leak_seq.x), len(HORIZONS))
    assert flat_off.all()
    assert (~leak_off[-30:, -1]).mean() > 0.8  # the leak's last 30 s: the line holds
    assert leak_off[:60].all()  # its first minute: no growth yet
