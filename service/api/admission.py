"""``POST /v1/admit``: will a job fit on a GPU beside what already runs there?

A scheduler (or a validating admission webhook) asks before it co-locates a job: it sends
the job's preflight profile (``oomcast preflight --json``: the peak the caching allocator
would reserve, per phase) and the GPU it has in mind. The answer compares that peak, plus
the CUDA context the new process brings, with what the GPU's residents have used at their
highest over the history the service holds (not their use of this instant: a neighbour
between two evals looks smaller than it is), less a margin. A GPU whose own forecast is
already firing admits nothing. Pure: the route hands in the domain's state.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from oomcast.service.pipeline.state import DomainState

# The device memory a new process takes outside the caching allocator (its CUDA context,
# kernels, library workspaces): the same default as oomcast preflight's (preflight/gpus.py),
# kept here because the service image has no torch to import that module with.
CONTEXT_BYTES = 768 << 20


@dataclass(frozen=True)
class Admission:
    fits: bool
    node: str
    device: str
    total_bytes: int
    resident_now_bytes: int
    resident_peak_bytes: int
    job_needs_bytes: int
    headroom_bytes: int  # what would be left at the residents' peak and the job's (< 0: short)
    margin_bytes: int
    domain_firing: bool
    reason: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def admit(
    st: DomainState, peak_reserved_bytes: int, *, context_bytes: int, margin_frac: float
) -> Admission:
    last = st.last
    assert last is not None
    cols = st.history.columns()
    resident_peak = max(
        int(cols["used"].max()) if len(cols["used"]) else 0, last.peak_bytes or 0, last.used_bytes
    )
    need = peak_reserved_bytes + context_bytes
    margin = int(margin_frac * last.total_bytes)
    headroom = last.total_bytes - margin - resident_peak - need
    firing = any(ep.firing for ep in st.episodes.values())
    if firing:
        fits, reason = False, "the GPU's own forecast is firing: it is heading for an OOM already"
    elif headroom >= 0:
        fits, reason = (
            True,
            (
                f"fits: the residents' peak {_gib(resident_peak)} plus the job's"
                f" {_gib(need)} leaves {_gib(headroom)} beyond the {_gib(margin)} margin"
            ),
        )
    else:
        fits, reason = (
            False,
            (
                f"does not fit: the residents' peak {_gib(resident_peak)} plus the job's"
                f" {_gib(need)} is {_gib(-headroom)} over {_gib(last.total_bytes - margin)}"
                f" ({_gib(last.total_bytes)} less the margin)"
            ),
        )
    return Admission(
        fits=fits,
        node=last.node,
        device=last.device,
        total_bytes=last.total_bytes,
        resident_now_bytes=last.used_bytes,
        resident_peak_bytes=resident_peak,
        job_needs_bytes=need,
        headroom_bytes=headroom,
        margin_bytes=margin,
        domain_firing=firing,
        reason=reason,
    )
