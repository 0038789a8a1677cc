"""The admission verdict on a live state: residents' peak, the job's need, the margin, and
no admission at all on a GPU whose own forecast fires."""

from __future__ import annotations

from support import GIB, T0, sample

from oomcast.model.baselines import ThresholdBaseline
from oomcast.service.api.admission import admit
from oomcast.service.pipeline.rules import Rule
from oomcast.service.pipeline.state import LiveState


def live(fracs: list[float]) -> LiveState:
    rule = Rule("r", ("webhook",), fire_after=1, resolve_after=1, horizon_s=60, fire_risk=0.5)
    state = LiveState(ThresholdBaseline(0.9), [rule], horizon_s=60)
    for i, f in enumerate(fracs):
        state.apply([sample(T0 + i, f)], T0 + i)
    return state


def test_the_margin_and_the_context_count() -> None:
    st = live([0.5, 0.5]).domains[("n1", "gpu0")]
    # 80 GiB: 40 used, 1.6 margin -> 38.4 left; a 38 GiB job fits without a context only
    assert admit(st, 38 * GIB, context_bytes=0, margin_frac=0.02).fits
    tight = admit(st, 38 * GIB, context_bytes=1 * GIB, margin_frac=0.02)
    margin = int(0.02 * 80 * GIB)
    assert not tight.fits and tight.headroom_bytes == 80 * GIB - margin - 40 * GIB - 39 * GIB


def test_a_gpu_heading_for_oom_admits_nothing() -> None:
    st = live([0.5, 0.95]).domains[("n1", "gpu0")]
    assert any(ep.firing for ep in st.episodes.values())
    verdict = admit(st, 1, context_bytes=0, margin_frac=0.0)
    assert not verdict.fits and verdict.domain_firing and "firing" in verdict.reason
