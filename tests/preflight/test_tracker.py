"""The tracker's correction for a kernel whose fake implementation under-reports: the CPU
LSTM layer's workspace, sized from the real kernel at batches 1 and 2 and extrapolated."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from oomcast.preflight.tracker import fake_workspace_sizes


class Record(TorchDispatchMode):  # type: ignore[no-untyped-call]
    """Keeps the last mkldnn_rnn_layer call: its args and outputs."""

    def __init__(self) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.call: tuple[object, object] | None = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if func is torch.ops.aten.mkldnn_rnn_layer.default:
            self.call = (args, out)
        return out


@pytest.mark.parametrize(("batch", "seq", "hidden"), [(5, 7, 32), (24, 16, 64)])
def test_the_fake_lstm_workspace_is_sized_as_the_real_one(
    batch: int, seq: int, hidden: int
) -> None:
    torch.manual_seed(0)
    real = nn.LSTM(hidden, hidden, batch_first=True)
    rec = Record()
    with rec:
        real(torch.randn(batch, seq, hidden, requires_grad=True))
    assert rec.call is not None
    truth = int(rec.call[1][3].untyped_storage().nbytes())  # type: ignore[index]

    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fake = nn.LSTM(hidden, hidden, batch_first=True)
        x = mode.from_tensor(torch.randn(batch, seq, hidden)).requires_grad_()
        rec = Record()
        with rec:
            fake(x)
    assert rec.call is not None
    args, out = rec.call
    assert out[3].numel() == 0  # type: ignore[index]  # what the fake kernel says
    assert fake_workspace_sizes(torch.ops.aten.mkldnn_rnn_layer.default, args, out) == {3: truth}


def test_other_kernels_are_left_alone() -> None:
    x = torch.ones(2)
    assert fake_workspace_sizes(torch.ops.aten.add.Tensor, (x, x), x + x) == {}


def test_a_large_workspace_is_extrapolated_not_allocated(monkeypatch: pytest.MonkeyPatch) -> None:
    """Past EXACT_WORKSPACE_BYTES the real kernel runs at batches 1 and 2 only: the figure
    is the line through them, within 5% of the real one on this shape."""
    from oomcast.preflight import tracker

    monkeypatch.setattr(tracker, "EXACT_WORKSPACE_BYTES", 0)
    monkeypatch.setattr(tracker, "_WORKSPACE_CACHE", {})
    batches: list[int] = []
    real_workspace = tracker._real_workspace
    monkeypatch.setattr(
        tracker,
        "_real_workspace",
        lambda args, b: batches.append(b) or real_workspace(args, b),
    )
    torch.manual_seed(0)
    rec = Record()
    with rec:
        nn.LSTM(64, 64, batch_first=True)(torch.randn(24, 16, 64, requires_grad=True))
    assert rec.call is not None
    truth = int(rec.call[1][3].untyped_storage().nbytes())  # type: ignore[index]
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        x = mode.from_tensor(torch.randn(24, 16, 64)).requires_grad_()
        rec = Record()
        with rec:
            nn.LSTM(64, 64, batch_first=True)(x)
    args, out = rec.call  # type: ignore[misc]
    got = tracker.fake_workspace_sizes(torch.ops.aten.mkldnn_rnn_layer.default, args, out)[3]
    assert batches == [1, 2]
    assert abs(got - truth) / truth < 0.05
