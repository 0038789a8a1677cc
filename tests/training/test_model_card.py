"""training/model_card.py and `oomcast card`: the card's counts, checked by hand on a tiny
corpus and a tiny simulated split, and its three figures.

The traces are built so that the baselines' outcomes follow from their shapes (the tiny
model's alerts do not, so only what holds for any model is asserted about it):

corpus, 4 Hz (ticks fall on whole seconds), test split unless said:
  000a gan/leak        0.5 -> 1.0 over 200 s, OOM at 200: threshold 0.90 fires ~40 s ahead,
                       0.95 ~20 s ahead
  000b gan/none        sawtooth 0.88 +- 0.05 for 120 s: threshold 0.90 fires (a false alarm)
  001a hf_bert/step_up flat 0.6 for 100 s, 0.97 at 100 s, OOM at 100.5: no lead of 10 s
  001b hf_bert/none    sawtooth 0.5 +- 0.05 for 120 s, then an ``exit`` event (kind "near")
  002a mlp_tabular/leak, train split: must be left out
simulated, 1 Hz:
  00000-leak        0.5 -> 1.0 over 400 s: both thresholds fire 30 s ahead or more
  00001-steady      0.9 +- 0.03 for 300 s: threshold 0.90 fires
  00002-neighbour   flat 0.5 for 150 s, 0.98 at 150 s, OOM at 150.5
  00003-plateau     0.6 +- 0.05 for 300 s
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support import T0, leak_trace, sample, steady_trace, write

from oomcast.model.forecast import HORIZONS_S
from oomcast.model.schema import Event, Record
from oomcast.training.model_card import FIGURES, MODEL, SETS, build

THR90, THR95, KUBELET = "threshold_0.90", "threshold_0.95", "kubelet_100MiB_10s"
CORPUS_SETS = ("corpus_test_10hz", "corpus_test_1hz")
SIM_SETS = ("sim_test_full", "sim_test_nvml")


def sudden_trace(
    flat_s: float, level: float, jump: float, interval_s: float, device: str = "gpu0"
) -> list[Record]:
    """Flat at ``level`` for ``flat_s``, one sample at ``jump`` at ``flat_s``, the OOM half a
    second later."""
    n = round(flat_s / interval_s)
    out: list[Record] = [sample(T0 + i * interval_s, level, device=device) for i in range(n)]
    out.append(sample(T0 + flat_s, jump, device=device))
    out.append(Event(ts=T0 + flat_s + 0.5, node="n1", device=device, event="oom"))
    return out


def with_exit(records: list[Record], at: float) -> list[Record]:
    return [*records, Event(ts=at, node="n1", device="gpu0", event="exit")]


CORPUS_RUNS: list[tuple[str, str, str, str, str, list[Record]]] = [
    # name, program, cause, split, kind (as training/corpus/plan.py names them), records
    ("000a-gan-leak", "gan", "leak", "test", "oom",
     leak_trace(start_frac=0.5, seconds_to_oom=200, interval_s=0.25, seed=0)),
    ("000b-gan-none", "gan", "none", "test", "ordinary",
     steady_trace(level=0.88, amplitude=0.05, seconds=120, interval_s=0.25)),
    ("001a-hf_bert-step_up", "hf_bert", "step_up", "test", "sudden",
     sudden_trace(100, 0.6, 0.97, 0.25)),
    ("001b-hf_bert-none", "hf_bert", "none", "test", "near",
     with_exit(steady_trace(level=0.5, amplitude=0.05, seconds=120, interval_s=0.25), T0 + 120)),
    ("002a-mlp_tabular-leak", "mlp_tabular", "leak", "train", "oom",
     leak_trace(start_frac=0.5, seconds_to_oom=100, interval_s=0.25, seed=5)),
]  # fmt: skip
SIM_TRACES: list[tuple[str, str, list[Record]]] = [
    ("00000-leak", "leak", leak_trace(start_frac=0.5, seconds_to_oom=400, seed=1)),
    ("00001-steady", "steady", steady_trace(level=0.9, amplitude=0.03, seconds=300)),
    ("00002-neighbour", "neighbour", sudden_trace(150, 0.5, 0.98, 1.0)),
    ("00003-plateau", "plateau", steady_trace(level=0.6, amplitude=0.05, seconds=300)),
]


def write_corpus(folder: Path) -> Path:
    runs = []
    for name, program, cause, split, kind, records in CORPUS_RUNS:
        write(folder / f"{name}.jsonl.gz", records)
        oom = any(isinstance(r, Event) and r.event == "oom" for r in records)
        runs.append(
            {
                "file": f"{name}.jsonl.gz",
                "program": program,
                "cause": cause,
                "split": split,
                "kind": kind,
                "oom": oom,
            }
        )
    (folder / "manifest.json").write_text(json.dumps({"runs": runs}))
    return folder


def write_sim(folder: Path) -> Path:
    entries = []
    for name, family, records in SIM_TRACES:
        write(folder / "test" / f"{name}.jsonl.gz", records)
        entries.append({"file": f"test/{name}.jsonl.gz", "split": "test", "family": family})
    (folder / "manifest.json").write_text(json.dumps({"traces": entries}))
    return folder / "test"


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from oomcast.training.export import export
    from oomcast.training.train import Sources, train

    tmp = tmp_path_factory.mktemp("card-model")
    train(
        Sources(shapes=60),
        tmp / "r",
        epochs=1,
        draws_per_epoch=32,
        cache=tmp / "c",
        progress=False,
        log=lambda *a, **k: None,
    )
    return export(tmp / "r" / "checkpoint.pt", tmp / "m.onnx", "card-test")


@pytest.fixture(scope="module")
def card(model: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("card")
    corpus = write_corpus(tmp / "corpus")
    sim_test = write_sim(tmp / "sim")
    result = build(
        model,
        sim_test=sim_test,
        corpus=corpus,
        figures_dir=tmp / "fig",
        out_json=tmp / "out" / "card.json",
    )
    assert json.loads((tmp / "out" / "card.json").read_text()) == result
    return result


@pytest.mark.slow
def test_every_set_scores_the_model_and_every_baseline(card: dict[str, Any]) -> None:
    assert set(card["sets"]) == set(SETS)
    names = set(card["sets"]["corpus_test_10hz"]["detectors"])
    assert MODEL in names and {THR90, THR95, KUBELET} <= names and len(names) == 9
    for name in CORPUS_SETS:  # the train-split run is left out
        s = card["sets"][name]
        assert (s["traces"], s["oom_traces"], s["ok_traces"]) == (4, 2, 2), name
        assert set(s["detectors"]) == names
    for name in SIM_SETS:
        s = card["sets"][name]
        assert (s["traces"], s["oom_traces"], s["ok_traces"]) == (4, 2, 2), name
        assert "by_program" not in s["detectors"][MODEL]
    assert card["sets"]["corpus_test_1hz"]["resample_s"] == 1.0
    assert card["sets"]["sim_test_nvml"]["view"] == "nvml"
    assert card["model"]["version"] == "card-test"
    assert set(card["seconds"]) == {*SETS, "model_risks", "figures", "total"}


@pytest.mark.slow
def test_corpus_counts_by_hand(card: dict[str, Any]) -> None:
    for name in CORPUS_SETS:
        dets = card["sets"][name]["detectors"]
        t90, t95 = dets[THR90], dets[THR95]
        # 30 s: only threshold 0.90 warns the leak; 10 s: both do; none warns the step
        assert (t90["at_30s"]["recall"], t90["at_10s"]["recall"]) == (0.5, 0.5), name
        assert (t95["at_30s"]["recall"], t95["at_10s"]["recall"]) == (0.0, 0.5), name
        assert t90["at_30s"]["false_alarms"] == 1 and t95["at_30s"]["false_alarms"] == 0
        assert t90["growth"] == {
            "oom_traces": 1,
            "warned_30s": 1,
            "warned_10s": 1,
            "recall_30s": 1.0,
            "recall_10s": 1.0,
        }
        assert t95["growth"]["recall_30s"] == 0.0 and t95["growth"]["recall_10s"] == 1.0
        assert t90["sudden"] == {
            "oom_traces": 1,
            "warned_30s": 0,
            "warned_10s": 0,
            "recall_30s": 0.0,
            "recall_10s": 0.0,
        }
        assert t90["by_cause"] == {
            "leak": {
                "oom_traces": 1,
                "warned_30s": 1,
                "warned_10s": 1,
                "ok_traces": 0,
                "false_alarms": 0,
            },
            "none": {
                "oom_traces": 0,
                "warned_30s": 0,
                "warned_10s": 0,
                "ok_traces": 2,
                "false_alarms": 1,
            },
            "step_up": {
                "oom_traces": 1,
                "warned_30s": 0,
                "warned_10s": 0,
                "ok_traces": 0,
                "false_alarms": 0,
            },
        }
        assert t95["by_cause"]["leak"]["warned_30s"] == 0
        assert t95["by_cause"]["leak"]["warned_10s"] == 1
        assert t90["by_program"] == {
            "gan": {"ok_traces": 1, "false_alarms": 1},
            "hf_bert": {"ok_traces": 1, "false_alarms": 0},
        }
        assert t95["by_program"]["gan"] == {"ok_traces": 1, "false_alarms": 0}
        assert dets[KUBELET]["at_10s"]["recall"] == 0.0  # 80 GiB never gets within 100 MiB
        # the model's tables count the same traces, whatever it alerts on
        model = dets[MODEL]
        assert model["growth"]["oom_traces"] == 1 and model["sudden"]["oom_traces"] == 1
        assert {c: (r["oom_traces"], r["ok_traces"]) for c, r in model["by_cause"].items()} == {
            "leak": (1, 0),
            "none": (0, 2),
            "step_up": (1, 0),
        }
        assert {p: r["ok_traces"] for p, r in model["by_program"].items()} == {
            "gan": 1,
            "hf_bert": 1,
        }


@pytest.mark.slow
def test_simulated_counts_by_hand(card: dict[str, Any]) -> None:
    for name in SIM_SETS:
        dets = card["sets"][name]["detectors"]
        for det in (THR90, THR95):  # the leak warned 30 s ahead; the neighbour never
            assert dets[det]["growth"]["recall_30s"] == 1.0, (name, det)
            assert dets[det]["sudden"] == {
                "oom_traces": 1,
                "warned_30s": 0,
                "warned_10s": 0,
                "recall_30s": 0.0,
                "recall_10s": 0.0,
            }
        assert dets[THR90]["by_cause"] == {
            "leak": {
                "oom_traces": 1,
                "warned_30s": 1,
                "warned_10s": 1,
                "ok_traces": 0,
                "false_alarms": 0,
            },
            "neighbour": {
                "oom_traces": 1,
                "warned_30s": 0,
                "warned_10s": 0,
                "ok_traces": 0,
                "false_alarms": 0,
            },
            "plateau": {
                "oom_traces": 0,
                "warned_30s": 0,
                "warned_10s": 0,
                "ok_traces": 1,
                "false_alarms": 0,
            },
            "steady": {
                "oom_traces": 0,
                "warned_30s": 0,
                "warned_10s": 0,
                "ok_traces": 1,
                "false_alarms": 1,
            },
        }
        assert dets[THR95]["at_30s"]["false_alarms"] == 0


@pytest.mark.slow
def test_the_10s_figures_come_from_the_same_pass(card: dict[str, Any]) -> None:
    for s in card["sets"].values():
        for d in s["detectors"].values():
            a30, a10 = d["at_30s"], d["at_10s"]
            assert {k: v for k, v in a30.items() if k != "recall"} == {
                k: v for k, v in a10.items() if k != "recall"
            }
            # evaluate's own recall at 30 s agrees with the per-trace lines' count
            n = a30["oom_traces"]
            assert a30["recall"] == round(
                sum(r["warned_30s"] for r in d["by_cause"].values()) / n, 4
            )
            assert a10["recall"] == round(
                sum(r["warned_10s"] for r in d["by_cause"].values()) / n, 4
            )


@pytest.mark.slow
def test_baselines_at_the_models_false_alarms(card: dict[str, Any]) -> None:
    for name, cmp in card["quietest_baseline_at_model_fa"].items():
        dets = card["sets"][name]["detectors"]
        fa = dets[MODEL]["at_30s"]["false_alarms"]
        assert cmp["model"] == {
            "false_alarms": fa,
            "growth_recall_30s": dets[MODEL]["growth"]["recall_30s"],
        }
        expected = {n for n, d in dets.items() if n != MODEL and d["at_30s"]["false_alarms"] <= fa}
        assert set(cmp["baselines"]) == expected
        assert THR95 in cmp["baselines"] and KUBELET in cmp["baselines"]  # they never false-alarm
        assert (THR90 in cmp["baselines"]) == (fa >= 1)
        ours = cmp["model"]["growth_recall_30s"]
        theirs = [b["growth_recall_30s"] for b in cmp["baselines"].values()]
        assert cmp["model_beats_all"] == (None if ours is None else all(ours > t for t in theirs))
        quietest = cmp["quietest_baseline"]
        fewest = min(d["at_30s"]["false_alarms"] for n, d in dets.items() if n != MODEL)
        assert quietest["false_alarms"] == fewest == 0
        assert quietest["growth_recall_30s"] == dets[quietest["name"]]["growth"]["recall_30s"]
    corpus = card["quietest_baseline_at_model_fa"]["corpus_test_10hz"]["baselines"]
    assert corpus[THR95] == {"false_alarms": 0, "growth_recall_30s": 0.0}


@pytest.mark.slow
def test_reliability_counts_every_known_tick(card: dict[str, Any]) -> None:
    rel = card["reliability"]["corpus_test_10hz"]
    assert set(rel) == {str(h) for h in HORIZONS_S}
    for h in HORIZONS_S:
        rows = rel[str(h)]
        assert len(rows) == 10
        # leak: 200 ticks before its OOM, all known; step: 101; gan/none: the 120 ticks end
        # at 119 s with no exit, known where 119 - t >= h; hf_bert/none exits normally at
        # 120 s: that is censoring too (the run proved nothing past its end), known where
        # 120 - t >= h
        known = 200 + 101 + max(0, 120 - h) + max(0, 121 - h)
        assert sum(r["count"] for r in rows) == known, h
        # OOM within h: the last h ticks of the leak, those from 100.5 - h of the step
        positives = min(h, 200) + min(h, 101)
        observed = sum(r["observed"] * r["count"] for r in rows if r["count"])
        assert observed == pytest.approx(positives, abs=0.01 * len(rows)), h
        for r in rows:
            if r["count"]:
                assert r["lo"] <= r["mean_predicted"] <= r["hi"]


@pytest.mark.slow
def test_figures_and_examples(card: dict[str, Any]) -> None:
    assert set(card["figures"]) == set(FIGURES)
    for key, path in card["figures"].items():
        data = Path(path).read_bytes()
        assert Path(path).name == FIGURES[key] and len(data) > 1000
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
    assert [e["trace"] for e in card["risk_examples"]] == [
        "000a-gan-leak.jsonl.gz",  # the corpus's only growth OOM
        "001b-hf_bert-none.jsonl.gz",  # its near miss (no warm-up nor censored run here)
        "001a-hf_bert-step_up.jsonl.gz",  # a sudden OOM, from the corpus
        "00000-leak.jsonl.gz",  # a simulated growth OOM
        "00001-steady.jsonl.gz",  # the simulated OOM-free trace closest to its limit
    ]
    assert card["risk_examples"][0]["oom_ts"] == T0 + 200


@pytest.mark.slow
def test_cli_card(model: Path, tmp_path: Path) -> None:
    corpus = write_corpus(tmp_path / "corpus")
    sim_test = write_sim(tmp_path / "sim")
    cli = [sys.executable, "-m", "oomcast.cli.main", "card", "--model", str(model)]
    missing = subprocess.run(
        [*cli, "--sim-test", str(sim_test), "--corpus", str(tmp_path / "nowhere")],
        capture_output=True,
        text=True,
    )
    assert missing.returncode == 2 and "--corpus" in missing.stderr
    out = tmp_path / "card.json"
    done = subprocess.run(
        [
            *cli,
            "--sim-test",
            str(sim_test),
            "--corpus",
            str(corpus),
            "--figures",
            str(tmp_path / "fig"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["sets"]["corpus_test_10hz"]["oom_traces"] == 2
    assert all((tmp_path / "fig" / f).stat().st_size > 0 for f in FIGURES.values())
