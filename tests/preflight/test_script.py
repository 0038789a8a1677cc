"""Preflight of training scripts as written (preflight/script.py): no PreflightJob, no
submit(), the script's own loop, eval and torch.save; run on fake tensors."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import torch
from support import PEAK_RSS_OF, oomcast_cmd, peak_rss_bytes

from oomcast.bench.preflight.scripts_gpu import SCRIPTS as EXAMPLES
from oomcast.cli.main import main
from oomcast.preflight.script import ScriptFailed, preflight_script

WIDTH, CLASSES = 2048, 10
PARAM_SIZES = [4 * n for n in (WIDTH * WIDTH, WIDTH, WIDTH * CLASSES, CLASSES)]
PARAM_BYTES = sum(PARAM_SIZES)
# what the caching allocator counts: each block rounded up to 512 bytes
PARAM_BLOCK_BYTES = sum(-(-n // 512) * 512 for n in PARAM_SIZES)

PLAIN = textwrap.dedent(
    f"""
    import argparse
    import torch
    from torch import nn
    import torch.nn.functional as F

    ap = argparse.ArgumentParser()
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--out", required=True)
    ap.add_argument("--eval-every", type=int, default=2)
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Sequential(nn.Linear({WIDTH}, {WIDTH}), nn.ReLU(), nn.Linear({WIDTH}, {CLASSES}))
    model = model.to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for step in range(1000):
        x = torch.randn(args.batch_size, {WIDTH}).to(device)
        y = torch.randint(0, {CLASSES}, (args.batch_size,)).to(device)
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        print("loss", loss.item())
        if args.eval_every and (step + 1) % args.eval_every == 0:
            model.eval()
            with torch.no_grad():
                xe = torch.randn(4 * args.batch_size, {WIDTH}, device=device)
                acc = (model(xe).argmax(-1) == 0).float().mean()
            model.train()
            torch.save({{"model": model.state_dict(), "opt": opt.state_dict()}}, args.out)
    """
)
ITEM_LINE = 1 + PLAIN.splitlines().index('    print("loss", loss.item())')


def _script(tmp_path: Path, text: str, name: str = "train.py") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


@pytest.mark.slow  # seconds of fake training
def test_a_plain_script_is_checked_as_written(tmp_path: Path) -> None:
    script = _script(tmp_path, PLAIN)
    out = tmp_path / "ckpt.pt"
    report = preflight_script(str(script), ["--out", str(out)], gpu="T4", steps=3)
    phases = {(p.step, p.phase): p for p in report.replay.phases}
    assert {ph for _, ph in phases} >= {"forward", "backward", "optimizer", "eval"}
    # evals and saves every 2 steps (after step 1): it stops at the end of its 3rd step
    assert report.steps == 3
    assert report.batch_size == 8
    # the model's parameters are what is on the GPU before the first step, to the block
    assert phases[(-1, "other")].peak_allocated_bytes == PARAM_BLOCK_BYTES
    # AdamW's first step: parameters, gradients and two moments
    assert phases[(0, "optimizer")].peak_allocated_bytes >= 4 * PARAM_BYTES
    assert (1, "eval") in phases
    # torch.save copies to host memory: the checkpoint is seen but takes nothing on the GPU,
    # and the next batch is the next step's forward, not the checkpoint's
    assert not any(ph == "checkpoint" for _, ph in phases)
    assert any("checkpoint put nothing new on the GPU" in n for n in report.notes)
    assert not out.exists()  # torch.save wrote nothing
    assert report.fits and report.device == "cpu"
    item = [n for n in report.notes if f"train.py:{ITEM_LINE}:" in n]
    assert item and "loss.item()" in item[0] and "stand-in" in item[0], report.notes
    # AdamW reads its own step counts (torch's business, not a line of the script to warn of)
    assert not [n for n in report.notes if "opt.step()" in n], report.notes


def test_oomcast_s_own_frames_are_its_folders_not_what_sits_beside_them() -> None:
    from oomcast.preflight import script as s

    root = s._ROOT
    assert s._ours(os.path.join(root, "preflight", "tracker.py"))
    assert s._ours(os.path.join(root, "training", "capture.py"))
    # an editable install's checkout may hold the virtual environment: torch is not ours
    venv_torch = os.path.join(root, ".venv", "lib", "site-packages", "torch", "optim", "adam.py")
    assert not s._ours(venv_torch)
    # the accuracy bench's example scripts are scripts, named by their own lines
    assert not s._ours(os.path.join(root, "bench", "preflight", "scripts", "mlp.py"))
    # every folder the package installs (setup.py's TOP) is covered
    top = re.search(r"TOP = \((.*?)\)", (Path(__file__).parents[2] / "setup.py").read_text())
    assert top is not None
    folders = {f.strip().strip('"') for f in top.group(1).split(",") if f.strip()}
    assert {os.path.join(root, f) + os.sep for f in folders} == set(s._OURS)


@pytest.mark.slow  # seconds of fake training
def test_a_script_without_an_eval_gets_one_run_for_it(tmp_path: Path) -> None:
    script = _script(tmp_path, PLAIN)
    report = preflight_script(
        str(script),
        ["--out", str(tmp_path / "c.pt"), "--eval-every", "0"],
        gpu="T4",
        steps=2,
        extra_steps=3,
    )
    assert report.steps == 5  # 2 steps, then 3 more waiting for an eval or a save
    assert any(p.phase == "eval" for p in report.replay.phases)
    assert not any(p.phase == "checkpoint" for p in report.replay.phases)
    text = "\n".join(report.notes)
    assert "preflight ran the model's last train call again" in text
    assert "the checkpoint phase is not checked" in text


@pytest.mark.slow  # seconds of fake training
def test_the_verdict_follows_the_capacity_and_names_the_phase(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, PLAIN)
    common = ["--", "python", str(script), "--out", str(tmp_path / "c.pt")]
    rc = main(["preflight", "--capacity-bytes", str(1 << 30), "--json", *common])
    obj = json.loads(capsys.readouterr().out)
    assert rc == 0 and obj["verdict"]["fits"] is True
    order = [((p["step"], p["phase"]), p["peak_reserved_bytes"]) for p in obj["phases"]]
    # room for what step 0 reserved up to its backward pass: the first phase that reserved
    # more in the run that fit is where the run that does not fit must fail
    room = dict(order)[(0, "backward")]
    first_over = next(key for key, reserved in order if reserved > room)
    rc = main(["preflight", "--capacity-bytes", str(room), "--json", *common])
    obj = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert obj["verdict"]["fits"] is False
    assert (obj["verdict"]["step"], obj["verdict"]["phase"]) == first_over
    assert first_over == (0, "optimizer")  # AdamW's two moments appear


def test_a_wrong_gpu_name_stops_before_the_script_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = tmp_path / "ran"
    script = _script(tmp_path, f"open({str(marker)!r}, 'w').close()\n" + PLAIN)
    rc = main(["preflight", "--gpu", "A100", "--", "python", str(script), "--out", "x"])
    err = capsys.readouterr().err
    assert rc == 2
    assert "unknown GPU 'A100'; known: H200" in err and "A100-40GB" in err
    assert not marker.exists()


def test_a_script_that_puts_nothing_on_the_gpu_is_not_a_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "print('hello')\n")
    rc = main(["preflight", "--gpu", "L4", "--", "python", str(script)])
    assert rc == 2
    assert "nothing put on the GPU: nothing to check" in capsys.readouterr().err


def test_a_failing_script_names_its_own_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    script = _script(tmp_path, "import torch\nx = torch.ones(3)\nraise KeyError('batch_size')\n")
    rc = main(["preflight", "--gpu", "T4", "--", "python", str(script)])
    err = capsys.readouterr().err
    assert rc == 2
    assert f"{script}:3 (`raise KeyError('batch_size')`)" in err
    assert "KeyError: 'batch_size'" in err and "Traceback" in err


@pytest.mark.slow  # seconds of fake training
def test_a_value_dependent_shape_names_the_line(tmp_path: Path) -> None:
    text = PLAIN.replace(
        "    loss = F.cross_entropy(model(x), y)\n",
        "    x = x[x[:, 0] > 0]\n    loss = F.cross_entropy(model(x), y[: len(x)])\n",
    )
    assert "x = x[x[:, 0] > 0]" in text
    script = _script(tmp_path, text)
    with pytest.raises(ScriptFailed, match=r"train\.py:\d+ \(`x = x\[x\[:, 0\] > 0\]`\)") as e:
        preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4")
    assert "depends on tensor values" in str(e.value)


@pytest.mark.slow  # seconds of fake training
def test_a_dataloader_with_workers_runs_in_the_scripts_process(tmp_path: Path) -> None:
    text = PLAIN.replace(
        "for step in range(1000):\n"
        f"    x = torch.randn(args.batch_size, {WIDTH}).to(device)\n"
        f"    y = torch.randint(0, {CLASSES}, (args.batch_size,)).to(device)\n",
        "from torch.utils.data import DataLoader, TensorDataset\n"
        f"data = TensorDataset(torch.randn(512, {WIDTH}), torch.randint(0, {CLASSES}, (512,)))\n"
        "loader = DataLoader(data, batch_size=args.batch_size, shuffle=True, num_workers=2)\n"
        "for step, (x, y) in enumerate(loader):\n"
        "    x, y = x.to(device), y.to(device)\n",
    )
    assert "num_workers=2" in text
    script = _script(tmp_path, text)
    report = preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2)
    assert report.fits and report.steps == 2 and report.batch_size == 8
    assert "it had run the steps, an eval and a checkpoint" in report.notes[0]


def test_a_call_that_would_start_the_real_gpu_stops_the_run_naming_its_line(
    tmp_path: Path,
) -> None:
    # A call preflight does not emulate (here: freeing CUDA IPC memory; a custom kernel
    # would be another). The run stops where the call is, before any CUDA context, and
    # says what to do about it.
    text = PLAIN.replace(
        "    loss.backward()\n",
        "    loss.backward()\n    torch.cuda.ipc_collect()\n",
    )
    assert "ipc_collect()" in text
    script = _script(tmp_path, text)
    line = 1 + text.splitlines().index("    torch.cuda.ipc_collect()")
    with pytest.raises(ScriptFailed) as e:
        preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4")
    msg = str(e.value)
    assert f"train.py:{line} (`torch.cuda.ipc_collect()`)" in msg
    assert "(torch.cuda.ipc_collect) would start the real GPU" in msg
    assert "in phase backward of step 0" in msg
    assert "Nothing ran on the GPU" in msg and "$OOMCAST_PREFLIGHT=1" in msg
    assert "OOMCAST_PREFLIGHT" not in os.environ  # set only while the script runs

    # the way out the message gives: skip the call under preflight
    skipped = text.replace(
        "    torch.cuda.ipc_collect()\n",
        "    if not os.environ.get('OOMCAST_PREFLIGHT'):\n        torch.cuda.ipc_collect()\n",
    ).replace("import argparse\n", "import argparse\nimport os\n")
    script = _script(tmp_path, skipped, "skipped.py")
    report = preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2)
    assert report.fits and report.steps == 2


@pytest.mark.parametrize(
    ("call", "via"),
    [
        ("torch.cuda.memory._host_allocator()", "torch.cuda.memory."),
        ("torch.cuda.caching_allocator_alloc(1024)", "torch.cuda.caching_allocator_alloc"),
        ("torch.cuda.ExternalStream(1234)", "torch.cuda.ExternalStream"),
    ],
)
def test_every_way_to_the_real_gpu_is_stopped(tmp_path: Path, call: str, via: str) -> None:
    # torch.cuda's modules that bind _lazy_init by name, and a class made in C++
    text = PLAIN.replace("opt = torch.optim", f"{call}\nopt = torch.optim")
    script = _script(tmp_path, text)
    with pytest.raises(ScriptFailed, match="would start the real GPU") as e:
        preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4")
    assert f"(`{call}`)" in str(e.value) and f"({via}" in str(e.value)


def test_a_memory_fraction_the_script_sets_is_its_capacity(tmp_path: Path) -> None:
    # a job sharing a GPU caps itself: the verdict is against its share, not the whole card
    def run(call: str) -> Any:
        text = PLAIN.replace("opt = torch.optim", f"{call}\nopt = torch.optim")
        script = _script(tmp_path, text)
        return preflight_script(
            str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2, remedies=False
        )

    whole = run("assert torch.cuda.get_per_process_memory_fraction() == 1.0")
    assert whole.fits
    need = whole.replay.peak_reserved_bytes
    total = whole.total_bytes
    assert total is not None
    roomy = run(f"torch.cuda.set_per_process_memory_fraction({2 * need / total!r})")
    assert roomy.fits and roomy.capacity_bytes == int(2 * need / total * total)
    assert any("set_per_process_memory_fraction" in n for n in roomy.notes), roomy.notes
    tight = run(
        f"torch.cuda.set_per_process_memory_fraction({need / 2 / total!r})\n"
        f"assert torch.cuda.get_per_process_memory_fraction() == {need / 2 / total!r}"
    )
    assert not tight.fits and tight.replay.oom is not None
    assert tight.capacity_bytes == int(need / 2 / total * total)
    with pytest.raises(ScriptFailed, match="Allowed range"):
        run("torch.cuda.set_per_process_memory_fraction(1.5)")
    # the remedy: the smallest fraction, in hundredths, that holds what it needs uncapped
    text = PLAIN.replace(
        "opt = torch.optim",
        f"torch.cuda.set_per_process_memory_fraction({need / 2 / total!r})\nopt = torch.optim",
    )
    fixed = preflight_script(
        str(_script(tmp_path, text)), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2
    )
    [remedy] = [r for r in fixed.remedies if r.name == "memory_fraction"]
    assert remedy.fits and remedy.value is not None
    assert remedy.value / 100 * total >= need > (remedy.value - 1) / 100 * total
    assert f"set_per_process_memory_fraction({remedy.value / 100:.2f})" in remedy.change


def test_the_cap_in_force_where_the_run_peaked_is_the_one_reported(tmp_path: Path) -> None:
    # a cap raised after the model is on the GPU: the verdict, the capacity and the note
    # agree on the cap the peak met; a script that fails uncapped keeps its OOM report
    plain = preflight_script(
        str(_script(tmp_path, PLAIN, "plain.py")), ["--out", str(tmp_path / "c.pt")],
        gpu="T4", steps=2, remedies=False,
    )  # fmt: skip
    total = plain.total_bytes
    assert total is not None
    tiny = plain.replay.peak_reserved_bytes / 4 / total
    text = PLAIN.replace(
        "opt = torch.optim",
        f"torch.cuda.set_per_process_memory_fraction({tiny!r})\n"
        "torch.cuda.set_per_process_memory_fraction(0.9)\nopt = torch.optim",
    )
    raised = preflight_script(
        str(_script(tmp_path, text)), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2,
        remedies=False,
    )  # fmt: skip
    assert raised.fits and raised.capacity_bytes == min(int(0.9 * total), plain.capacity_bytes)
    assert not any(f"({tiny!r})" in n for n in raised.notes)
    # capped at a quarter of its need, then failing where the capped run never got
    text = PLAIN.replace(
        "opt = torch.optim",
        f"torch.cuda.set_per_process_memory_fraction({tiny!r})\nopt = torch.optim",
    ).replace("    loss.backward()\n", "    loss.backward()\n    assert step < 1, 'too far'\n")
    failing = preflight_script(
        str(_script(tmp_path, text)), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2
    )
    assert not failing.fits and failing.replay.oom is not None
    [remedy] = [r for r in failing.remedies if r.name == "memory_fraction"]
    assert not remedy.fits and "without its cap the script failed" in remedy.change


def test_cuda_events_and_streams_for_timing_run_as_written(tmp_path: Path) -> None:
    # the common timing loop: events recorded around the step, a side stream for the
    # batch copy, elapsed_time logged. Nothing of it is GPU memory: it runs, and the
    # elapsed_time line is named as a stand-in value like loss.item()'s.
    text = PLAIN.replace(
        "for step in range(1000):\n",
        "start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)\n"
        "side = torch.cuda.Stream()\n"
        "for step in range(1000):\n"
        "    start.record()\n",
    ).replace(
        "    loss.backward()\n",
        "    loss.backward()\n"
        "    with torch.cuda.stream(stream=side):\n"
        "        side.wait_stream(torch.cuda.current_stream())\n"
        "        assert torch.cuda.current_stream() == torch.cuda.current_stream() != side\n"
        "        assert side.cuda_stream == 0 and side.device_index == 0\n"
        "    end.record()\n"
        "    torch.cuda.synchronize()\n"
        "    ms = start.elapsed_time(end)\n",
    )
    report = _same_as_plain(tmp_path, text)
    line = 1 + text.splitlines().index("    ms = start.elapsed_time(end)")
    [asked] = [n for n in report.notes if f"train.py:{line}:" in n]
    assert "got a stand-in (float)" in asked and "times)" in asked


def test_the_device_generic_accelerator_api_takes_the_gpu_path(tmp_path: Path) -> None:
    # the idiom of PyTorch's own tutorials since 2.6: without the emulation the script
    # trained on the CPU for real and preflight said it fits in 2 MiB
    text = PLAIN.replace(
        'device = "cuda" if torch.cuda.is_available() else "cpu"',
        "device = torch.accelerator.current_accelerator().type"
        ' if torch.accelerator.is_available() else "cpu"\n'
        'assert device == "cuda" and torch.accelerator.device_count() == 1\n'
        "side = torch.Stream(device=device)\n"
        "start, end = torch.Event(enable_timing=True), torch.Event(enable_timing=True)\n"
        'assert torch.Stream(device="cpu").device_type != side.device_type',
    ).replace(
        "    loss.backward()\n",
        "    start.record()\n"
        "    loss.backward()\n"
        "    side.wait_stream(torch.accelerator.current_stream())\n"
        "    end.record()\n"
        "    torch.accelerator.synchronize()\n"
        "    print(start.elapsed_time(end), torch.accelerator.max_memory_allocated(),\n"
        '          torch.cuda.memory_stats()["allocated_bytes.all.peak"])\n'
        "    assert 'Allocated memory' in torch.cuda.memory_summary()\n",
    )
    report = _same_as_plain(tmp_path, text)
    assert report.to_json()["peak_allocated_bytes"] >= 4 * PARAM_BYTES  # AdamW's, on the GPU


@pytest.mark.parametrize(
    "spelling",
    [
        'torch.set_default_device("cuda")\nmodel = nn.Sequential(',
        'with torch.device("cuda"):\n    model = nn.Sequential(',
    ],
)
def test_a_default_cuda_device_makes_gpu_memory(tmp_path: Path, spelling: str) -> None:
    # tensors made without a device land on the default one: torch puts its DeviceContext
    # under every other mode, where preflight's own did not see it ("PyTorch is not linked
    # with support for cuda devices", before)
    import torch.utils._device as device_mod

    base = device_mod.DeviceContext
    text = PLAIN.replace("model = nn.Sequential(", spelling)
    report = _same_as_plain(tmp_path, text)
    assert report.to_json()["peak_allocated_bytes"] >= 4 * PARAM_BYTES
    # the weights are loaded before the first step, as .cuda() has them
    other = [p for p in report.replay.phases if p.step == -1]
    assert other and other[0].peak_allocated_bytes >= PARAM_BYTES
    # nothing of the script's default leaks out of its run
    assert torch._GLOBAL_DEVICE_CONTEXT.device_context is None
    assert torch._C._len_torch_function_stack() == 0
    assert device_mod.DeviceContext is base
    assert torch.get_default_device() == torch.device("cpu")


def test_factories_on_the_default_device_alone_are_gpu_memory(tmp_path: Path) -> None:
    # no .to(device) anywhere: what lands on the GPU is what the default device put there,
    # and the script sees cuda:0 as its default, as on a GPU
    text = textwrap.dedent(
        """
        import torch
        from torch import nn
        torch.set_default_device("cuda")
        torch.set_default_dtype(torch.float64)
        assert torch.get_default_device() == torch.device("cuda", 0)
        model = nn.Linear(512, 512)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            model(torch.randn(64, 512)).sum().backward()
            opt.step()
            opt.zero_grad()
        """
    )
    report = preflight_script(str(_script(tmp_path, text)), [], gpu="T4", steps=3)
    weights = (512 * 512 + 512) * 8
    assert report.to_json()["peak_allocated_bytes"] >= 2 * weights  # weights and grads, f64
    assert torch.get_default_dtype() == torch.float32  # the script's default dtype stayed its own


def test_data_parallel_on_the_one_emulated_gpu_is_the_module(tmp_path: Path) -> None:
    # older scripts wrap the model whatever the GPU count; torch's own forward checks the
    # weights sit on cuda:0 and stopped the run ("found one of them on device: cpu")
    text = PLAIN.replace(
        "model = model.to(device)\n",
        "model = model.to(device)\nmodel = nn.DataParallel(model)\n",
    )
    assert "nn.DataParallel" in text
    report = _same_as_plain(tmp_path, text)
    assert report.to_json()["peak_allocated_bytes"] >= 4 * PARAM_BYTES


ACCELERATE_LOOP = textwrap.dedent(
    """
    import sys
    import torch
    from torch import nn
    from accelerate import Accelerator

    accelerator = Accelerator(mixed_precision="bf16")
    model = nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.utils.data.TensorDataset(torch.randn(256, 256))
    dl = torch.utils.data.DataLoader(data, batch_size=32, shuffle=True)
    model, opt, dl = accelerator.prepare(model, opt, dl)
    for (x,) in dl:
        loss = model(x).pow(2).mean()
        accelerator.backward(loss)
        opt.step()
        opt.zero_grad()
    accelerator.save_state(sys.argv[1])
    """
)


def test_an_accelerate_loop_and_its_save_state_are_checked(tmp_path: Path) -> None:
    # Accelerator.save_state writes safetensors through accelerate's own binding of
    # save_file, which failed on fake tensors ("invalid shape, data type, or offset")
    state = pytest.importorskip("accelerate.state")
    # whatever this process set up before (another test's Trainer, say) is not the script's,
    # and is back after its run
    before = dict(state.AcceleratorState._shared_state)
    out = tmp_path / "state"
    report = preflight_script(str(_script(tmp_path, ACCELERATE_LOOP)), [str(out)], gpu="T4")
    assert state.AcceleratorState._shared_state == before
    assert report.fits and report.steps == 8  # the whole loop: no eval to wait for, then the save
    assert any("checkpoint put nothing new on the GPU" in n for n in report.notes), report.notes
    assert not any(out.rglob("*.safetensors")) and not any(out.rglob("*.bin"))


def test_data_parallel_over_several_gpus_is_not_emulated(tmp_path: Path) -> None:
    text = PLAIN.replace(
        "model = model.to(device)\n",
        "model = model.to(device)\nmodel = nn.DataParallel(model, device_ids=[0, 1])\n",
    )
    with pytest.raises(ScriptFailed, match="preflight emulates one"):
        preflight_script(str(_script(tmp_path, text)), ["--out", str(tmp_path / "c.pt")], gpu="T4")


def test_a_lazy_module_is_named_as_not_supported(tmp_path: Path) -> None:
    text = PLAIN.replace(f"nn.Linear({WIDTH}, {CLASSES})",
                         f"nn.LazyLinear({CLASSES})")  # fmt: skip
    assert "LazyLinear" in text
    with pytest.raises(ScriptFailed, match="Lazy modules"):
        preflight_script(str(_script(tmp_path, text)), ["--out", str(tmp_path / "c.pt")], gpu="T4")


def _same_as_plain(tmp_path: Path, text: str) -> Any:
    """``text`` preflighted for 2 steps, checked to fit with the same peak as ``PLAIN``
    (what it adds holds no GPU memory); its report."""
    out = ["--out", str(tmp_path / "c.pt")]
    report = preflight_script(str(_script(tmp_path, text)), out, gpu="T4", steps=2)
    base = preflight_script(str(_script(tmp_path, PLAIN, "plain.py")), out, gpu="T4", steps=2)
    assert report.fits and report.steps == 2
    assert report.to_json()["peak_allocated_bytes"] == base.to_json()["peak_allocated_bytes"]
    return report


def test_a_library_s_call_is_named_by_the_script_s_line_through_the_library(
    tmp_path: Path,
) -> None:
    lib = tmp_path / "site-packages"
    lib.mkdir()
    (lib / "timing.py").write_text("import torch\n\ndef sync():\n    torch.cuda.ipc_collect()\n")
    text = PLAIN.replace(
        "opt = torch.optim",
        f"import sys; sys.path.insert(0, {str(lib)!r})\nimport timing\n"
        "timing.sync()\nopt = torch.optim",
    )
    script = _script(tmp_path, text)
    with pytest.raises(ScriptFailed) as e:
        preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4")
    line = 1 + text.splitlines().index("timing.sync()")
    assert f"train.py:{line} (`timing.sync()`), through {lib / 'timing.py'}:4" in str(e.value)


def test_the_cuda_rng_calls_a_framework_saves_are_emulated_wherever_they_are_bound(
    tmp_path: Path,
) -> None:
    # the Trainer saves torch.cuda.random.get_rng_state_all() with its checkpoints
    text = PLAIN.replace(
        "opt = torch.optim",
        "state = torch.cuda.random.get_rng_state()\n"
        "torch.cuda.random.set_rng_state(state)\nopt = torch.optim",
    )
    script = _script(tmp_path, text)
    report = preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2)
    assert report.fits and report.steps == 2


def test_pinned_batches_are_moved_without_pinning(tmp_path: Path) -> None:
    # pin_memory() would start the GPU (page-locked host memory goes through CUDA); under
    # preflight the tensor is moved as it is, and counted on the GPU once it gets there
    text = PLAIN.replace(
        f"    x = torch.randn(args.batch_size, {WIDTH}).to(device)\n",
        f"    x = torch.randn(args.batch_size, {WIDTH}).pin_memory()"
        ".to(device, non_blocking=True)\n",
    )
    assert "pin_memory()" in text
    script = _script(tmp_path, text)
    report = preflight_script(str(script), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2)
    plain = _script(tmp_path, PLAIN, "plain.py")
    base = preflight_script(str(plain), ["--out", str(tmp_path / "c.pt")], gpu="T4", steps=2)
    assert report.fits and report.steps == 2
    assert report.to_json()["peak_allocated_bytes"] == base.to_json()["peak_allocated_bytes"]


BIG = textwrap.dedent(
    """
    import torch
    from torch import nn
    import torch.nn.functional as F

    D, L, V, T = 6144, 24, 32000, 1024

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.n1, self.n2 = nn.LayerNorm(D), nn.LayerNorm(D)
            self.qkv, self.proj = nn.Linear(D, 3 * D), nn.Linear(D, D)
            self.up, self.down = nn.Linear(D, 4 * D), nn.Linear(4 * D, D)

        def forward(self, x):
            b = x.shape[0]
            q, k, v = self.qkv(self.n1(x)).view(b, T, 3, 48, D // 48).unbind(2)
            a = F.scaled_dot_product_attention(
                q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
            )
            x = x + self.proj(a.transpose(1, 2).reshape(x.shape))
            return x + self.down(F.gelu(self.up(self.n2(x))))

    blocks = [Block() for _ in range(L)]
    model = nn.Sequential(nn.Embedding(V, D), *blocks, nn.LayerNorm(D), nn.Linear(D, V)).cuda()
    print(f"{sum(p.numel() for p in model.parameters()) / 1e9:.1f}B parameters")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for step in range(100):
        x = torch.randint(0, V, (1, T + 1), device="cuda")
        loss = F.cross_entropy(model(x[:, :-1]).flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
    """
)


@pytest.mark.slow  # a fresh interpreter with torch
def test_an_11b_parameter_plain_script_takes_no_real_memory(tmp_path: Path) -> None:
    """Ordinary module code, no meta device: 11.3 B parameters would take 45 GB in fp32 on
    this 24 GB machine; under preflight the process stays under 2 GB and gets a verdict."""
    script = _script(tmp_path, BIG, "big.py")
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            PEAK_RSS_OF,
            "280",  # the wrapper kills preflight then; the run below gives up at 300
            *oomcast_cmd("preflight", "--gpu", "H100-80GB", "--json", "--", "python", str(script)),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 1, out.stderr  # its activations do not fit 80 GB beside AdamW
    assert "11.3B parameters" in out.stderr  # the script's output: stdout is the report's
    obj = json.loads(out.stdout)
    params = [p for p in obj["phases"] if p["step"] == -1]
    assert params and params[0]["peak_allocated_bytes"] > 45e9  # fp32 weights
    assert obj["verdict"]["fits"] is False
    rss = peak_rss_bytes(out.stderr)
    assert rss < 2 << 30, f"{rss / 2**20:.0f} MiB"


@pytest.mark.slow  # imports transformers
def test_an_unmodified_hugging_face_trainer_script(tmp_path: Path) -> None:
    """Its eval and save come every 50 steps: the Trainer is asked to run both after the 3rd
    step, through its own loop; the checkpoint is seen and nothing is written."""
    pytest.importorskip("transformers")
    script = _script(tmp_path, (EXAMPLES / "hf_trainer.py").read_text())
    out = tmp_path / "out"
    report = preflight_script(str(script), [str(out)], gpu="T4", steps=3)
    seen = {p.phase for p in report.replay.phases}
    assert seen >= {"forward", "backward", "eval"}, seen
    assert report.steps == 3 and report.batch_size == 16
    assert "it had run the steps, an eval and a checkpoint" in report.notes[0], report.notes
    assert not list(out.glob("checkpoint-*"))  # no checkpoint written
    assert report.fits


@pytest.mark.slow  # imports pytorch_lightning
def test_an_unmodified_lightning_script(tmp_path: Path) -> None:
    """Lightning's sanity check is the eval; its checkpoint (at the end of the epoch, 16
    steps away) is taken through the trainer's own save_checkpoint after the 3rd step; the
    optimizer runs the training step as a closure, and its phases stay apart."""
    pytest.importorskip("pytorch_lightning")
    script = _script(tmp_path, (EXAMPLES / "lightning_mlp.py").read_text())
    root = tmp_path / "root"
    report = preflight_script(str(script), [str(root)], gpu="T4", steps=3)
    phases = {(p.step, p.phase) for p in report.replay.phases}
    assert {(0, "eval"), (0, "forward"), (0, "backward"), (0, "optimizer")} <= phases, phases
    assert (2, "optimizer") in phases
    assert "it had run the steps, an eval and a checkpoint" in report.notes[0], report.notes
    assert not list(root.rglob("*.ckpt"))
    assert report.fits and report.batch_size == 32


def _peaks(
    tmp_path: Path, example: str, *extra: str, gpu: str = "T4"
) -> dict[tuple[int, str], float]:
    """Preflight an example script with extra arguments: peak allocated MiB per (step, phase)."""
    run = tmp_path / "-".join(("run", *extra)).replace(" ", "")
    run.mkdir()
    script = _script(run, (EXAMPLES / example).read_text())
    report = preflight_script(str(script), [str(run / "out"), *extra], gpu=gpu, steps=3)
    assert report.steps == 3, report.notes
    return {(p.step, p.phase): p.peak_allocated_bytes / 2**20 for p in report.replay.phases}


@pytest.mark.slow  # four fake runs of a Trainer, about 30 s
def test_the_hugging_face_trainer_s_own_settings_shape_the_report(tmp_path: Path) -> None:
    """TrainingArguments as the script sets them: gradient checkpointing keeps far fewer
    activations, bf16 (autocast) makes them smaller, and gradient accumulation holds the
    first micro-batch's gradients through the second one's forward and backward. On an A100:
    bf16 is an 8.0 feature (on a T4 attention in bf16 has no fused kernel, and the math path
    keeps fp32 weights: bf16 is then the larger run)."""
    pytest.importorskip("transformers")
    gpu = "A100-40GB"
    plain = _peaks(tmp_path, "hf_trainer.py", gpu=gpu)
    ckpt = _peaks(tmp_path, "hf_trainer.py", "--grad-ckpt", gpu=gpu)
    bf16 = _peaks(tmp_path, "hf_trainer.py", "--bf16", gpu=gpu)
    accum = _peaks(tmp_path, "hf_trainer.py", "--grad-accum", "2", gpu=gpu)
    assert ckpt[(1, "forward")] < 0.5 * plain[(1, "forward")], (ckpt, plain)
    assert bf16[(1, "forward")] < 0.95 * plain[(1, "forward")], (bf16, plain)
    assert accum[(0, "forward")] > plain[(0, "forward")] + 10, (accum, plain)
    # the optimizer's state appears at step 0; transformers' default with torch >= 2.8 is
    # fused AdamW, whose later steps allocate nothing (one kernel, no optimizer row), where
    # the foreach AdamW of older installs allocates its temporaries every step
    from transformers import TrainingArguments

    fused = "fused" in str(TrainingArguments(str(tmp_path / "x"), report_to=[]).optim).lower()
    assert (0, "optimizer") in plain and ((1, "optimizer") in plain) is not fused, plain


@pytest.mark.slow  # three fake runs of a Lightning fit, about 15 s
def test_the_lightning_trainer_s_own_settings_shape_the_report(tmp_path: Path) -> None:
    """precision and accumulate_grad_batches as the script sets them. bf16-mixed makes a
    bf16 copy of each weight in the forward (this MLP's weights outweigh its activations,
    so its forward grows); accumulating two batches holds the gradients of the first
    through the second one's forward (and the second forward comes after a backward pass,
    whose cuBLAS workspace is held from then on)."""
    pytest.importorskip("pytorch_lightning")
    from oomcast.preflight.gpus import lookup_gpu
    from oomcast.preflight.kernels import CudaKernels

    plain = _peaks(tmp_path, "lightning_mlp.py")
    mixed = _peaks(tmp_path, "lightning_mlp.py", "--precision", "bf16-mixed")
    accum = _peaks(tmp_path, "lightning_mlp.py", "--accumulate", "2")
    weights_mib = (512 * 4096 + 4096 * 4096 + 4096 * 10 + 4096 + 4096 + 10) * 4 / 2**20
    extra = mixed[(0, "forward")] - plain[(0, "forward")]
    assert 0.3 * weights_mib < extra < 0.7 * weights_mib, (extra, weights_mib)
    workspace_mib = CudaKernels(lookup_gpu("T4").capability).blas_workspace_bytes / 2**20
    held = accum[(0, "forward")] - plain[(0, "forward")] - workspace_mib
    assert 0.9 * weights_mib < held < 1.1 * weights_mib, (held, weights_mib)


def test_moves_to_and_from_the_gpu_are_what_the_gpu_holds() -> None:
    """A move to cuda copies into device memory (once, however often it is asked); whatever
    is computed from device tensors is device memory; a copy back to the CPU is not."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomcast.preflight.script import ScriptTracker, _Moves

    with FakeTensorMode(allow_non_fake_inputs=True), ScriptTracker(None, "t") as t, _Moves(t):
        host = torch.randn(256, 256)
        assert not t.ops  # made on the host
        dev = host.to("cuda")
        assert t.is_device(dev) and not t.is_device(host)
        assert [op.size for op in t.ops] == [256 * 256 * 4]
        assert dev.cuda() is dev and dev.to("cuda:0") is dev  # already there: no copy
        assert t.is_device(dev * 2) and t.is_device(torch.zeros(3, device="cuda"))
        back = [dev.cpu(), dev.to("cpu"), dev.to("cpu", torch.float16)]
        assert not any(t.is_device(b) for b in back)
        assert not t.is_device(back[0] + 1)
        assert len([op for op in t.ops if op.alloc]) == 3  # dev, dev * 2, the zeros


def test_a_linear_on_a_transposed_input_holds_one_output_as_the_real_kernel_does() -> None:
    """PyTorch's linear adds the bias in place on plain tensors but out of place under a
    dispatch mode, which held a second logits-sized tensor at the peak (+11% on an LSTM LM
    against the allocator). Under preflight it is one output, with the same values."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from oomcast.preflight.script import ScriptTracker, _linear, _module_moves, _Moves

    x = torch.randn(7, 5, 16).transpose(0, 1)  # (5, 7, 16), not contiguous
    w, b = torch.randn(32, 16), torch.randn(32)
    torch.testing.assert_close(_linear(x, w, b), torch.nn.functional.linear(x, w, b))
    out_bytes = 5 * 7 * 32 * 4
    with (
        FakeTensorMode(allow_non_fake_inputs=True),
        ScriptTracker(None, "t") as t,
        _Moves(t),
        _module_moves(t),
    ):
        lin = torch.nn.Linear(16, 32).to("cuda")
        h = torch.randn(7, 5, 16).to("cuda").transpose(0, 1)
        t.ops.clear()
        y = lin(h)
        assert y.shape == (5, 7, 32)
        sizes = [op.size for op in t.ops if op.alloc]
        assert sizes.count(out_bytes) == 1, sizes


@pytest.mark.slow  # imports transformers
def test_save_pretrained_is_a_checkpoint_that_writes_nothing(tmp_path: Path) -> None:
    """Hugging Face's save_pretrained looks for shared storages by address, which fake
    tensors do not have (it raised on every model): it is seen as the checkpoint."""
    pytest.importorskip("transformers")
    script = _script(
        tmp_path,
        textwrap.dedent(
            """
            import sys
            import torch
            from transformers import GPT2Config, GPT2LMHeadModel
            model = GPT2LMHeadModel(GPT2Config(vocab_size=512, n_positions=64, n_embd=64,
                                               n_layer=2, n_head=2)).to("cuda")
            opt = torch.optim.AdamW(model.parameters())
            for step in range(3):
                ids = torch.randint(0, 512, (4, 64), device="cuda")
                model(input_ids=ids, labels=ids).loss.backward()
                opt.step()
                opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(input_ids=ids)
            model.save_pretrained(sys.argv[1])
            """
        ),
    )
    out = tmp_path / "saved"
    report = preflight_script(str(script), [str(out)], gpu="T4", steps=3)
    assert "it had run the steps, an eval and a checkpoint" in report.notes[0], report.notes
    assert not out.exists()


@pytest.mark.parametrize("reentrant", [False, True])
def test_gradient_checkpointing_recomputes_in_the_backward_and_the_eval_is_still_seen(
    tmp_path: Path, reentrant: bool
) -> None:
    """Checkpointing runs the blocks again inside the backward: the non-reentrant kind stops
    them part-way (their forward hooks never end), the reentrant kind through a backward of
    its own. The recomputation is the backward's, the module labels it left do not make a
    host tensor device memory, and the script's own eval is still seen (it once was not)."""
    from oomcast.preflight.script import trace_script

    script = _script(
        tmp_path,
        textwrap.dedent(
            f"""
            import sys
            import torch
            from torch import nn
            from torch.utils.checkpoint import checkpoint

            class M(nn.Module):
                def __init__(self):
                    super().__init__()
                    self.blocks = nn.ModuleList(
                        nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256))
                        for _ in range(4)
                    )

                def forward(self, x):
                    for b in self.blocks:
                        x = x + checkpoint(b, x, use_reentrant={reentrant})
                    return x.pow(2).mean()

            model = M().to("cuda")
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            for _ in range(3):
                model(torch.randn(64, 256, device="cuda", requires_grad=True)).backward()
                host = torch.zeros(123457)  # on the host: never device memory
                opt.step()
                opt.zero_grad()
            model.eval()
            with torch.no_grad():
                model(torch.randn(256, 256, device="cuda"))
            torch.save(model.state_dict(), sys.argv[1])
            """
        ),
    )
    argv = [str(tmp_path / "c.pt")]
    report = preflight_script(str(script), argv, gpu="T4", steps=3)
    assert "it had run the steps, an eval and a checkpoint" in report.notes[0], report.notes
    phases = [(p.step, p.phase) for p in report.replay.phases]
    assert (2, "eval") in phases and report.batch_size == 64
    assert not any("ran the model's last train call again" in n for n in report.notes)
    trace = trace_script(str(script), argv, total_bytes=1 << 40, steps=3)
    assert not any(op.alloc and op.size == 123457 * 4 for op in trace.ops)
    for step in range(3):
        ops = [op.phase for op in trace.ops if op.alloc and op.step == step]
        first_backward = ops.index("backward")
        assert "forward" not in ops[first_backward:], (step, ops)


@pytest.mark.slow  # a few dozen short fake runs of the script
def test_a_scripts_largest_batch_is_found_through_its_own_argument(tmp_path: Path) -> None:
    """The script is traced again at other values of its --batch-size: the largest that
    fits, the same from any starting batch, and checked alone it fits and the next does not."""
    script = _script(tmp_path, PLAIN)
    cap = 160 << 20

    def report(*args: str, remedies: bool = True) -> Any:
        argv = ["--out", str(tmp_path / "c.pt"), *args]
        return preflight_script(str(script), argv, capacity_bytes=cap, remedies=remedies)

    found = []
    for start in (["--batch-size", "64"], ["--batch-size=3000"]):
        (best,) = [m for m in report(*start).remedies if m.name == "largest_batch"]
        assert best.fits and best.value is not None, best
        found.append(best.value)
    assert found[0] == found[1], found
    assert (
        f"--batch-size {found[0]} (the run uses 64;"
        in report("--batch-size", "64").remedies[0].change
    )
    assert report("--batch-size", str(found[0]), remedies=False).fits
    assert not report("--batch-size", str(found[0] + 1), remedies=False).fits


def test_the_batch_argument_is_found_in_either_spelling() -> None:
    from oomcast.preflight.script import batch_argument

    assert batch_argument(["--lr", "3e-4"]) is None
    found = batch_argument(["--lr", "3e-4", "--per_device_train_batch_size", "16", "x"])
    assert found is not None and found.value == 16
    assert found.argv(4) == ["--lr", "3e-4", "--per_device_train_batch_size", "4", "x"]
    joined = batch_argument(["--batch-size=32"])
    assert joined is not None and joined.argv(48) == ["--batch-size=48"]
    twice = batch_argument(["--batch-size", "8", "--batch-size", "16"])  # argparse reads the last
    assert (
        twice is not None and twice.value == 16 and twice.argv(4)[1:] == ["8", "--batch-size", "4"]
    )
    assert batch_argument(["--batch-size", "\u00b3"]) is None  # a digit, not a number


def test_a_script_that_ignores_its_batch_option_gets_no_made_up_answer(tmp_path: Path) -> None:
    """Every probe "fits" when the script never reads the option: the search once reported
    --batch-size 65536 after 11 re-runs. It stops and says why."""
    text = PLAIN.replace("x = torch.randn(args.batch_size,", "x = torch.randn(8,").replace(
        f"y = torch.randint(0, {CLASSES}, (args.batch_size,))",
        f"y = torch.randint(0, {CLASSES}, (8,))",
    )
    assert "torch.randn(8," in text
    script = _script(tmp_path, text)
    argv = ["--out", str(tmp_path / "c.pt"), "--batch-size", "8"]
    report = preflight_script(str(script), argv, capacity_bytes=1 << 30)
    (best,) = report.remedies
    assert "does not follow the option" in best.change and "65536" not in best.change, best


@pytest.mark.parametrize(
    "spelling",
    [
        'torch.autocast("cuda", dtype=torch.bfloat16)',
        "torch.autocast(device_type='cuda')",
        "torch.autocast('cuda', torch.float16, True)",
        "torch.cuda.amp.autocast()",
    ],
)
def test_mixed_precision_counts_activations_at_their_size(tmp_path: Path, spelling: str) -> None:
    """autocast("cuda") leaves the emulated GPU's CPU tensors alone unless preflight runs it
    on the CPU: the activations a Linear keeps are then half their fp32 size. The script's
    own torch.cuda.memory_allocated() reads the traced bytes (it read 0)."""
    text = textwrap.dedent(
        f"""
        import sys
        import torch
        from torch import nn
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)]).to("cuda")
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            x = torch.randn(16384, 1024, device="cuda")
            if sys.argv[1] == "amp":
                with {spelling}:
                    loss = model(x).float().pow(2).mean()
            else:
                loss = model(x).pow(2).mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
        model.eval()
        with torch.no_grad():
            model(x)
        torch.save(model.state_dict(), sys.argv[2])
        """
    )
    script = _script(tmp_path, text)
    full, amp = (
        preflight_script(str(script), [mode, str(tmp_path / "c.pt")], gpu="H100-80GB", steps=3)
        for mode in ("fp32", "amp")
    )
    fwd_full, fwd_amp = (
        max(p.peak_allocated_bytes for p in r.replay.phases if p.phase == "forward")
        for r in (full, amp)
    )
    weights = 8 * (1024 * 1024 + 1024) * 4
    # fp32 keeps 8 activations of 16384x1024x4 bytes; autocast keeps them in 16 bits (plus
    # the 16-bit weight copies it casts), well under the fp32 forward
    assert fwd_amp < 0.8 * fwd_full, (fwd_amp, fwd_full)  # 0.74 measured; 1.0 without
    assert amp.replay.peak_allocated_bytes > weights


def test_the_scripts_own_memory_figures_are_the_traced_bytes(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    script = _script(
        tmp_path,
        textwrap.dedent(
            """
            import sys
            import torch
            a = torch.zeros(1024, 1024, device="cuda")
            b = torch.zeros(1024, 1024, device="cuda")
            del b
            print("MEMORY", torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated(),
                  file=sys.stderr)
            torch.cuda.reset_peak_memory_stats()
            print("AFTER", torch.cuda.max_memory_allocated(), file=sys.stderr)
            """
        ),
    )
    preflight_script(str(script), [], gpu="T4")  # it trains nothing, but it ran
    err = capfd.readouterr().err
    assert f"MEMORY {4 << 20} {8 << 20}" in err and f"AFTER {4 << 20}" in err


@pytest.mark.parametrize("scaler", ['torch.amp.GradScaler("cuda")', "torch.cuda.amp.GradScaler()"])
def test_fp16_with_a_grad_scaler_takes_its_steps(tmp_path: Path, scaler: str) -> None:
    """GradScaler skips a step when found_inf.item() says a gradient overflowed; with a
    stand-in value every step was skipped (0 steps, no optimizer state, and the frameworks'
    fp16 never reached their eval or save). Steps are taken, autocast("cuda", None, False)
    included (it raised)."""
    script = _script(
        tmp_path,
        textwrap.dedent(
            f"""
            import sys
            import torch
            from torch import nn
            model = nn.Sequential(nn.Linear(512, 2048), nn.ReLU(), nn.Linear(2048, 10)).cuda()
            opt = torch.optim.Adam(model.parameters())
            scaler = {scaler}
            with torch.autocast("cuda", None, False):
                pass
            for _ in range(50):
                x = torch.randn(32, 512).cuda()
                with torch.autocast("cuda", dtype=torch.float16):
                    loss = model(x).float().logsumexp(-1).mean()
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
            torch.save(model.state_dict(), sys.argv[1])
            """
        ),
    )
    report = preflight_script(str(script), [str(tmp_path / "c.pt")], gpu="T4", steps=3)
    assert report.steps >= 3, report.notes
    # Adam's two moments exist: the optimizer really stepped
    weights = 4 * (512 * 2048 + 2048 + 2048 * 10 + 10)
    assert report.replay.peak_allocated_bytes > 3 * weights


def test_a_compiled_model_is_run_eagerly_and_the_report_says_so(tmp_path: Path) -> None:
    # fullgraph=True made the script fail (review): dynamo compiles no frame under preflight
    from oomcast.preflight.script import script_notes, trace_script

    text = textwrap.dedent(
        """
        import torch
        model = torch.compile(torch.nn.Linear(64, 64).cuda(), fullgraph=True)
        other = torch.nn.Linear(64, 64).cuda()
        other.compile()
        opt = torch.optim.SGD([*model.parameters(), *other.parameters()], lr=0.1)
        for step in range(3):
            other(model(torch.randn(8, 64, device="cuda"))).sum().backward()
            opt.step()
        """
    )
    trace = trace_script(
        str(_script(tmp_path, text)), [], total_bytes=1 << 40, steps=2, extra_steps=0
    )
    assert trace.compiled and trace.steps_done == 2
    assert any("ran it eagerly" in n for n in script_notes(trace, 2, 0))
    plain = trace_script(
        str(
            _script(
                tmp_path,
                text.replace(", fullgraph=True", "")
                .replace("torch.compile(", "(")
                .replace("other.compile()", ""),
            )
        ),
        [],
        total_bytes=1 << 40,
        steps=2,
        extra_steps=0,
    )
    assert not plain.compiled
    assert not any("ran it eagerly" in n for n in script_notes(plain, 2, 0))
